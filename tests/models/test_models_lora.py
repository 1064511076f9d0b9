"""LoRA adapters (``tracerl.models.lora``): only the adapter trains, it is saved in PEFT's
layout and loads back (trainable, or merged for evaluation and serving), a target the model
does not have is refused by name, and the adapter can be switched off for the reference."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tracerl.models.lora import (
    AdapterOff,
    LoraSettings,
    apply_lora,
    is_adapter_dir,
    is_lora,
    load_adapter_dir,
    load_with_adapter,
    save_adapter,
)
from tracerl.models.tiny import (
    TinyModelConfig,
    build_tiny_model,
    load_tiny,
    save_tiny,
    train_tokenizer,
)

SETTINGS = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tokenizer(["def f(x):\n    return x + 1\n"] * 5, vocab_size=300)


def _model(tokenizer: Any) -> Any:
    return build_tiny_model(tokenizer, TinyModelConfig(
        hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=256),
        seed=3)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _perturb(model: Any) -> None:
    """Move every adapter weight (a fresh adapter is the zero update)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))


IDS = torch.tensor([[5, 17, 40, 9, 3, 77, 12]])


def test_only_the_adapter_trains_and_starts_as_the_base(tokenizer: Any) -> None:
    base = _model(tokenizer)
    before = _logits(base, IDS)
    model = apply_lora(base, SETTINGS)
    assert is_lora(model) and not is_lora(base.__class__)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert {n.split(".self_attn.")[1].split(".")[0] for n in trainable} == {"q_proj", "v_proj"}
    assert torch.equal(_logits(model, IDS), before)  # B = 0: the base's function
    _perturb(model)
    assert not torch.allclose(_logits(model, IDS), before)


def test_the_same_seed_gives_the_same_adapter(tokenizer: Any) -> None:
    one = apply_lora(_model(tokenizer), SETTINGS, seed=4)
    state = torch.get_rng_state()
    two = apply_lora(_model(tokenizer), SETTINGS, seed=4)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left alone
    for (name, a), (_, b) in zip(one.named_parameters(), two.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_target_the_model_lacks_is_refused_naming_it_and_the_names_it_has(
        tokenizer: Any) -> None:
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "query_key_value"))
    with pytest.raises(ValueError, match=r"model.lora.target_modules: query_key_value matches "
                       r"no module of LlamaForCausalLM; its linear layers are named "
                       r"down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        apply_lora(_model(tokenizer), settings)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("rank", 0, "rank: must be >= 1"), ("alpha", 0.0, "alpha: must be > 0"),
    ("target_modules", (), "target_modules: must name at least one module"),
    ("dropout", 1.0, r"dropout: must be in \[0, 1\)")])
def test_bad_settings_are_refused_naming_the_field(field: str, value: Any, message: str) -> None:
    values: dict[str, Any] = {"rank": 4, "alpha": 8.0, "target_modules": ("q_proj",)}
    values[field] = value
    with pytest.raises(ValueError, match=message):
        LoraSettings(**values)


def test_the_adapter_is_saved_in_peft_layout_and_loads_back(tokenizer: Any,
                                                            tmp_path: Path) -> None:
    from peft import PeftModel

    base_dir = save_tiny(_model(tokenizer), tokenizer, tmp_path / "base")
    model = apply_lora(load_tiny(base_dir)[0], SETTINGS, base_name=str(base_dir))
    _perturb(model)
    expected = _logits(model, IDS)
    target = tmp_path / "adapters" / "v1"
    (target).mkdir(parents=True)
    (target / "stale.txt").write_text("from an earlier save")
    assert save_adapter(model, target) == target
    assert sorted(p.name for p in target.iterdir() if p.suffix != ".md") == [
        "adapter_config.json", "adapter_model.safetensors"]  # replaced whole, nothing stale
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]
    config = json.loads((target / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["base_model_name_or_path"] == str(base_dir)
    assert is_adapter_dir(target) and not is_adapter_dir(base_dir)
    # peft's own loader, on a base loaded separately.
    direct = PeftModel.from_pretrained(load_tiny(base_dir)[0], str(target))
    assert torch.equal(_logits(direct, IDS), expected)
    # Trainable (a resumed run): exactly the saved adapter, and only it trains.
    resumed = load_with_adapter(None, target, trainable=True)
    assert torch.equal(_logits(resumed, IDS), expected)
    assert all(("lora_" in n) == p.requires_grad for n, p in resumed.named_parameters())
    # Merged (evaluation, serving): a plain model computing the same function.
    merged = load_with_adapter(str(base_dir), target, merge=True)
    assert not is_lora(merged)
    torch.testing.assert_close(_logits(merged, IDS), expected, rtol=1e-5, atol=1e-5)


def test_a_moved_run_finds_its_base_beside_the_adapter(tokenizer: Any, tmp_path: Path) -> None:
    run = tmp_path / "run"
    base_dir = save_tiny(_model(tokenizer), tokenizer, run / "base")
    model = apply_lora(load_tiny(base_dir)[0], SETTINGS, base_name=str(base_dir))
    _perturb(model)
    expected = _logits(model, IDS)
    save_adapter(model, run / "checkpoints" / "step-000002")
    tokenizer.save_pretrained(run / "checkpoints" / "step-000002")
    moved = tmp_path / "elsewhere"
    run.rename(moved)
    loaded, loaded_tokenizer = load_tiny(moved / "checkpoints" / "step-000002")
    assert not is_lora(loaded) and len(loaded_tokenizer) == len(tokenizer)
    torch.testing.assert_close(_logits(loaded, IDS), expected, rtol=1e-5, atol=1e-5)
    (moved / "base" / "config.json").unlink()
    with pytest.raises(ValueError, match=r"its base .* is not there, and no base/ directory"):
        load_adapter_dir(moved / "checkpoints" / "step-000002")


def test_adapter_off_computes_the_base_alone(tokenizer: Any) -> None:
    base = _model(tokenizer)
    before = _logits(base, IDS)
    model = apply_lora(base, SETTINGS)
    _perturb(model)
    off = AdapterOff(model)
    assert torch.equal(_logits(off, IDS), before)
    assert not torch.equal(_logits(model, IDS), before)  # the adapter is back on after
    assert off.config is model.config
    with pytest.raises(ValueError, match="has no LoRA adapter"):
        AdapterOff(_model(tokenizer))


def test_without_peft_asking_for_lora_says_how_to_install_it(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft fails
    with pytest.raises(ImportError, match=r"pip install 'tracerl\[lora\]'"):
        apply_lora(_model(tokenizer), SETTINGS)
    assert not is_lora(_model(tokenizer))


def test_an_adapter_on_a_tied_output_head_is_not_merged(tokenizer: Any, tmp_path: Path) -> None:
    """The tiny model ties its output head to the input embedding: merging an adapter on the
    head would change the embedding too, so the loaded model keeps the adapter apart."""
    base_dir = save_tiny(_model(tokenizer), tokenizer, tmp_path / "base")
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "lm_head"))
    model = apply_lora(load_tiny(base_dir)[0], settings, base_name=str(base_dir))
    _perturb(model)
    expected = _logits(model, IDS)
    save_adapter(model, tmp_path / "adapter")
    loaded = load_with_adapter(None, tmp_path / "adapter", merge=True)
    assert is_lora(loaded)
    assert torch.equal(_logits(loaded, IDS), expected)
