"""The benches' summary statistics: medians on both sides, spreads, per-token times."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_vs_trl_run_takes_medians_and_per_token_times() -> None:
    vs_trl = load("vs_trl")
    run = vs_trl.Run("x", seconds=[(9.0, 9.0), (1.0, 0.5), (3.0, 1.5), (2.0, 1.0)],
                     rewards=[0.0, 0.1, 0.2, 0.5], tokens=[10, 10, 30, 40])
    assert run.per_step() == (2.0, 1.0)  # the warm-up step's 9 s is left out
    assert run.per_token() == pytest.approx(0.1)  # median of 1/10, 3/30, 2/40
    assert run.first_reward(2) == pytest.approx(0.05)
    assert run.last_reward(2) == pytest.approx(0.35)
    with pytest.raises(ValueError, match="token counts missing"):
        vs_trl.Run("y", seconds=[(1.0, 1.0), (1.0, 1.0)], tokens=[5]).per_token()


def test_vs_trl_spread_error_and_verdict() -> None:
    vs_trl = load("vs_trl")
    assert vs_trl.spread([1.0, 2.0, 3.0, 4.0, 5.0]) == "3.00x [1.00-5.00], IQR 2.00-4.00"
    assert vs_trl.spread([2.0]) == "2.00x [2.00-2.00]"
    mean, error = vs_trl.mean_error([0.1, 0.3])
    assert mean == pytest.approx(0.2) and error == pytest.approx(0.1)
    assert vs_trl.mean_error([0.4]) == (0.4, 0.0)
    assert vs_trl.verdict(0.3, 0.1, 8).startswith("rose")
    assert vs_trl.verdict(-0.3, 0.1, 8).startswith("fell")
    assert "does not learn" in vs_trl.verdict(0.1, 0.1, 8)
    assert "no claim" in vs_trl.verdict(0.3, 0.0, 1)


def test_gae_times_every_contender_the_same_number_of_times() -> None:
    gae = load("gae")
    calls: list[str] = []
    timings = gae.timed_together({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                 3)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # one warm-up each, then turns
    assert [len(t.samples) for t in timings.values()] == [3, 3]
    assert timings["a"].median >= 0.0
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        gae.timed_together({"a": lambda: None}, 0)


def test_engine_sync_cell_sums_the_parts_and_marks_what_was_not_measured() -> None:
    engine = load("engine")
    parts = engine.medians({"write_seconds": [0.3, 0.1, 0.2], "load_seconds": [0.05],
                            "verify_seconds": [0.5, 0.7], "sync_seconds": [1.0]}, "lora_")
    assert parts["lora_write_seconds_median"] == pytest.approx(0.2)
    assert parts["lora_verify_seconds_median"] == pytest.approx(0.6)
    assert engine.sync_cell(parts, "lora_") == "0.850 (0.200 + 0.050 + 0.600)"
    assert engine.sync_cell(parts, "") == "-"  # no full sync measured


def test_engine_sizes_are_what_they_are_named() -> None:
    import torch
    import yaml

    from tracerl.models.tiny import build_tiny_model, count_parameters, train_tokenizer
    from tracerl.models.words import WORDS

    engine = load("engine")
    recipe = yaml.safe_load((BENCH.parent / "configs" / "demo.yaml").read_text("utf-8"))["model"]
    vocab, shape = engine.SIZES["demo"]
    assert vocab == recipe["vocab_size"]
    assert {k: getattr(shape, k) for k in ("hidden_size", "num_layers", "num_heads",
                                           "intermediate_size", "max_positions")} == {
        k: recipe[k] for k in ("hidden_size", "num_layers", "num_heads", "intermediate_size",
                               "max_positions")}
    counts = {}
    for name in ("100M", "0.5B"):
        vocab, shape = engine.SIZES[name]
        tokenizer = train_tokenizer(engine.CORPUS, vocab_size=vocab, words=WORDS)
        with torch.device("meta"):  # the shapes only: no memory for the weights
            counts[name] = count_parameters(build_tiny_model(tokenizer, shape, seed=0))
    assert 50e6 < counts["100M"] < 150e6
    assert 0.4e9 < counts["0.5B"] < 0.6e9
    assert "0.5B" not in engine.CPU_SIZES  # the GPU size is asked for by name
