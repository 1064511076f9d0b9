"""LoRA through a real vLLM server: the server holds the base, each version's adapter is
loaded under a name of its own and the older one unloaded, and requests get the new
version's logprobs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tracerl.models.lora import LoraSettings, adapter_parameters, apply_lora
from tracerl.models.tiny import save_tiny
from tracerl.rollout import SamplingParams
from tracerl.rollout.vllm import EngineError, VllmConfig, VllmEngine, probe

sys.path.insert(0, str(Path(__file__).parent))
from engine_models import tiny_model

pytestmark = pytest.mark.engine


def moved(model: Any, seed: int) -> None:
    """Move every adapter weight (a training step would), in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in adapter_parameters(model):
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmEngine, Any]]:
    base, tokenizer = tiny_model()
    base_dir = save_tiny(base, tokenizer, tmp_path_factory.mktemp("base") / "base")
    policy = apply_lora(base, LoraSettings(rank=8, alpha=16.0,
                                           target_modules=("q_proj", "v_proj")),
                        base_name=str(base_dir))
    engine = VllmEngine(VllmConfig(), tmp_path_factory.mktemp("run"), tokenizer, seed=0)
    try:
        engine.start(policy, 0)
        yield engine, policy
    finally:
        engine.close()


def test_lora_sync_serves_the_new_adapter_version(lora_engine: tuple[VllmEngine, Any]) -> None:
    engine, policy = lora_engine
    first = engine.adapter
    assert first == "policy-s00001-v000000" and engine.verified_version == 0
    moved(policy, seed=1)
    metrics = engine.sync(policy, 1)
    assert metrics["probe_max_abs_diff"] <= 1e-4
    assert engine.adapter == "policy-s00002-v000001"
    expected = probe.trainer_logprobs(policy, engine.probe)
    assert probe.server_logprobs(engine.base_url, engine.adapter, engine.probe) == \
        pytest.approx(expected, abs=1e-4)
    # The base model's name still serves the base, which the adapter moved away from.
    with policy.disable_adapter():
        base = probe.trainer_logprobs(policy, engine.probe)
    served_base = probe.server_logprobs(engine.base_url, "policy", engine.probe)
    assert served_base == pytest.approx(base, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(served_base, expected, strict=True)) > 1e-3
    with pytest.raises(EngineError, match="answered 404"):  # the older version is unloaded
        probe.server_logprobs(engine.base_url, first, engine.probe)
    # Sampling names the new adapter and stamps its version.
    assert engine.policy is not None
    prompt = engine.probe[:8]
    (completion,) = engine.policy.generate([prompt], SamplingParams(max_new_tokens=6, seed=2))
    assert completion.policy_version == 1
    full = probe.trainer_logprobs(policy, prompt + list(completion.token_ids))
    assert completion.logprobs == pytest.approx(full[len(prompt) - 1:], abs=1e-4)
    assert sorted(p.name for p in (engine.directory / "weights").iterdir()) == [
        "s00001-v000000", "s00002-v000001"]
