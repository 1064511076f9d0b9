"""Asynchronous RL steps (``asynchronous.max_staleness: 1``) with ``rollout.engine: vllm``
against a real vLLM server: the worker syncs the learner's published weights into the server
(mid-attempt, before each sampler call), and every action token carries a version the server
was verified to serve when it sampled it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tracerl.models.tiny import save_tiny
from tracerl.rollout.vllm import engine as vllm_engine
from tracerl.trace import read_attempts
from tracerl.train import asynchronous
from tracerl.train.config import load_config

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent / "train"))
from engine_models import SHAPE, tiny_model  # noqa: E402
from tiny_runs import OneCallTrainer  # noqa: E402

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("lora", [False, True])
def test_async_steps_sample_only_verified_versions(tmp_path: Path, lora: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``lora``: ``model.lora`` on, so each sync loads the learner's adapter into the server."""
    model, tokenizer = tiny_model()
    policy = save_tiny(model, tokenizer, tmp_path / "policy")
    verified: list[int] = []
    verify = vllm_engine.VllmEngine.verify

    def recording(self: vllm_engine.VllmEngine, model: object, version: int) -> object:
        result = verify(self, model, version)  # raises SyncMismatch unless it serves them
        verified.append(version)
        return result

    monkeypatch.setattr(vllm_engine.VllmEngine, "verify", recording)
    data = {
        "seed": 1, "steps": 3, "threads": 1, "tensorboard": False, "progress": False,
        "model": {"path": str(policy), "max_positions": SHAPE.max_positions,
                  "lora": {"rank": 4 if lora else 0, "target_modules": ["q_proj", "v_proj"]}},
        "tasks": {"train_count": 4, "heldout_count": 2},
        "rollout": {"engine": "vllm", "tasks_per_step": 2, "group_size": 2, "max_turns": 1,
                    "max_turn_tokens": 8, "concurrency": 4, "env_workers": 1,
                    "show_tool_schemas": False},
        "update": {"entropy_coef": 0.05, "lr": 0.01, "micro_batch_rows": 4, "tis_cap": 2.0},
        "asynchronous": {"max_staleness": 1, "weight_sync": "mid_attempt"},
        "eval": {"samples_per_task": 1, "greedy": False}, "run_dir": str(tmp_path / "run"),
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    OneCallTrainer(load_config(tmp_path / "recipe.yaml")).run()
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [0, 1, 2]
    sampled = {v for a in read_attempts(run / "traces") for v in asynchronous.action_versions(a)}
    assert sampled and sampled <= set(verified)
    assert max(sampled) >= 1  # the learner's weights reached the server and were sampled
    for record in steps:
        assert record["engine"]["probe_max_abs_diff"] <= 1e-4
        assert max(int(age) for age in record["async"]["staleness_versions"]) <= 1
