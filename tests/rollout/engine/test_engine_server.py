"""A real vLLM server (CPU build) on the tiny model: its logprobs equal the trainer's forward,
a full sync serves the new weights, and a skipped or corrupted sync is caught by the probe."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tracerl.rollout import SamplingParams
from tracerl.rollout.vllm import SyncMismatch, VllmConfig, VllmEngine, probe
from tracerl.rollout.vllm.engine import BODY_FILE, write_version
from tracerl.rollout.vllm.server import post_json

sys.path.insert(0, str(Path(__file__).parent))
from engine_models import perturbed, tiny_model

pytestmark = pytest.mark.engine


class Served:
    """The module's server and the weights the trainer holds now."""

    def __init__(self, engine: VllmEngine, model: Any) -> None:
        self.engine = engine
        self.model = model


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model, tokenizer = tiny_model()
    engine = VllmEngine(VllmConfig(), tmp_path_factory.mktemp("run"), tokenizer, seed=0)
    try:
        first = engine.start(model, 0)
        assert first["probe_max_abs_diff"] <= 1e-4
        yield Served(engine, model)
    finally:
        engine.close()
    assert engine.server is not None and engine.server.returncode() is not None


def test_server_logprobs_equal_the_trainers_forward_at_temperature_1(served: Served) -> None:
    engine, model = served.engine, served.model
    policy = engine.policy
    assert policy is not None and policy.policy_version == 0
    prompts = [policy.chat_prompt([{"role": "user", "content": "Fix the bug in add."}]),
               engine.tokenizer.encode("def add(a, b):", add_special_tokens=False)]
    completions = policy.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12,
                                                          seed=5))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert len(completion.token_ids) > 0 and completion.policy_version == 0
        expected = probe.trainer_logprobs(model, prompt + list(completion.token_ids))
        assert completion.logprobs == pytest.approx(expected[len(prompt) - 1:], abs=1e-4)
    # Greedy: the policy records the point mass (0); vLLM itself reports the log-softmax.
    (greedy,) = policy.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=6))
    assert greedy.logprobs == (0.0,) * len(greedy.token_ids)
    raw = post_json(engine.base_url, "/v1/completions", {
        "model": "policy", "prompt": prompts[0], "max_tokens": 6, "temperature": 0.0,
        "logprobs": 0, "return_tokens_as_token_ids": True})
    reported = raw["choices"][0]["logprobs"]["token_logprobs"]
    expected = probe.trainer_logprobs(model, prompts[0] + list(greedy.token_ids))
    assert reported == pytest.approx(expected[len(prompts[0]) - 1:], abs=1e-4)
    assert all(value < 0 for value in reported)


def test_full_sync_serves_the_new_weights_and_not_the_old(served: Served) -> None:
    engine, old = served.engine, served.model
    new = perturbed(old, 0.02, seed=1)
    metrics = engine.sync(new, 1)
    served.model = new
    assert metrics["probe_max_abs_diff"] <= 1e-4 and metrics["load_seconds"] > 0
    assert engine.policy is not None and engine.policy.policy_version == 1
    answered = probe.server_logprobs(engine.base_url, "policy", engine.probe)
    assert answered == pytest.approx(probe.trainer_logprobs(new, engine.probe), abs=1e-4)
    before = probe.trainer_logprobs(old, engine.probe)
    assert max(abs(a - b) for a, b in zip(answered, before, strict=True)) > 1e-2
    with pytest.raises(SyncMismatch, match="holds policy version 0"):
        engine.verify(old, 0)
    versions = sorted(p.name for p in (engine.directory / "weights").iterdir())
    assert versions == ["s00001-v000001"]


def test_skipped_sync_is_caught_and_the_version_stays(served: Served) -> None:
    engine = served.engine
    updated = perturbed(served.model, 0.02, seed=2)  # the trainer moved on, nothing synced
    with pytest.raises(SyncMismatch, match=r"holds policy version 2, but the server's probe "
                                           r"logprobs differ"):
        engine.verify(updated, 2)
    assert engine.policy is not None and engine.policy.policy_version == 1


def test_corrupted_sync_is_caught(served: Served, tmp_path: Path) -> None:
    engine = served.engine
    updated = perturbed(served.model, 0.02, seed=3)
    path = write_version(updated, tmp_path, "s00099-v000003")
    body = path / BODY_FILE
    data = bytearray(body.read_bytes())
    data[-4096:] = bytes(4096)  # the end of a weight lost in the write: zeros
    body.write_bytes(bytes(data))
    engine.load(path)  # the server loads it without complaint
    with pytest.raises(SyncMismatch, match="holds policy version 3"):
        engine.verify(updated, 3)
    assert engine.policy is not None and engine.policy.policy_version == 1
    metrics = engine.sync(updated, 3)  # a proper sync repairs it
    assert metrics["probe_max_abs_diff"] <= 1e-4 and engine.policy.policy_version == 3
