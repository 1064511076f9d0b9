"""`tracerl train-eval`: a run's checkpoints evaluated afterwards score exactly what the run's
own evaluations scored, and averaged weights are the weighted mean of the checkpoints'."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tracerl.train.config import load_config
from tracerl.train.run_eval import (
    average_spec,
    checkpoint_dir,
    ema_spec,
    evaluate_run,
    mean_weights,
    mix_spec,
    parse_ema,
    parse_mix,
    step_spec,
)
from tracerl.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_runs import tiny_recipe


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("run_eval")
    Trainer(load_config(tiny_recipe(root))).run()
    return root / "run"


def _read(path: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads(path.read_text(encoding="utf-8"))
    return data


def test_checkpoints_evaluated_afterwards_match_the_runs_evaluations(run_dir: Path,
                                                                      tmp_path: Path) -> None:
    out = tmp_path / "evaluated"
    records = evaluate_run(run_dir, [step_spec(2), step_spec(0)], out, log=lambda *_: None)
    assert [r["label"] for r in records] == ["step00002", "step00000"]
    for label, run_label in (("step00002", "after"), ("step00000", "before")):
        for kind in ("sampled", "greedy"):
            ours = _read(out / f"eval_{label}_{kind}.json")
            theirs = _read(run_dir / f"eval_{run_label}_{kind}.json")
            assert ours["per_task"] == theirs["per_task"], (label, kind)
            assert ours["success"] == theirs["success"]
            assert ours["generated_tokens"] == theirs["generated_tokens"]
    lines = (out / "evaluations.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["label"] for line in lines] == ["step00002", "step00000"]
    # The run's own files are untouched.
    assert not (run_dir / "eval_step00002_sampled.json").exists()


def test_averaged_weights_are_the_weighted_mean(run_dir: Path) -> None:
    def tensors(step: int) -> dict[str, torch.Tensor]:
        return load_file(str(checkpoint_dir(run_dir, step) / "model.safetensors"))

    one, two, sft = tensors(1), tensors(2), tensors(0)
    assert any(not torch.equal(one[k], two[k]) for k in one)  # the steps did move the weights
    mean = mean_weights(run_dir, average_spec("1-2"))
    for name in one:
        expected = (one[name].double() + two[name].double()) / 2
        torch.testing.assert_close(mean[name].double(), expected, rtol=0, atol=1e-7)
    ema = mean_weights(run_dir, ema_spec(0.5, 2))  # 0.25 sft + 0.25 step 1 + 0.5 step 2
    for name in one:
        expected = 0.25 * sft[name].double() + 0.25 * one[name].double() + 0.5 * two[name].double()
        torch.testing.assert_close(ema[name].double(), expected, rtol=0, atol=1e-7)
    assert sum(w for _, w in ema_spec(0.9, 17).weights) == pytest.approx(1.0, abs=1e-12)
    assert parse_ema("0.5", run_dir) == ema_spec(0.5, 2)  # through the newest checkpoint
    assert parse_ema("0.5@1", run_dir) == ema_spec(0.5, 1)
    mix = mean_weights(run_dir, mix_spec(0.25, 1))  # 0.75 sft + 0.25 step 1
    for name in one:
        expected = 0.75 * sft[name].double() + 0.25 * one[name].double()
        torch.testing.assert_close(mix[name].double(), expected, rtol=0, atol=1e-7)
    assert parse_mix("0.5", run_dir) == mix_spec(0.5, 2)
    assert parse_mix("1@1", run_dir) == mix_spec(1.0, 1)


def test_bad_requests_are_refused_with_the_argument_named(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step 7: no policy"):
        evaluate_run(run_dir, [step_spec(7)], tmp_path / "x", log=lambda *_: None)
    with pytest.raises(ValueError, match="--average: FIRST must be <= LAST"):
        average_spec("5-3")
    with pytest.raises(ValueError, match="--average: expected FIRST-LAST"):
        average_spec("5")
    with pytest.raises(ValueError, match=r"--ema: the decay must be in \[0, 1\)"):
        ema_spec(1.0, 3)
    with pytest.raises(ValueError, match="--ema: expected DECAY or DECAY@LAST"):
        parse_ema("0.8@last", run_dir)
    with pytest.raises(ValueError, match=r"--mix: ALPHA must be in \[0, 1\]"):
        mix_spec(1.5, 3)
    with pytest.raises(ValueError, match="--mix: needs a checkpoint"):
        mix_spec(0.5, 0)
    with pytest.raises(ValueError, match="--mix: expected ALPHA or ALPHA@STEP"):
        parse_mix("half", run_dir)
    with pytest.raises(ValueError, match=r"run_dir: .* holds no config\.yaml"):
        evaluate_run(tmp_path, [step_spec(0)], tmp_path / "y", log=lambda *_: None)
    with pytest.raises(ValueError, match="--out: must differ"):
        evaluate_run(run_dir, [step_spec(0)], run_dir, log=lambda *_: None)
