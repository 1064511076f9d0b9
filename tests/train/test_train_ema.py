"""`update.ema_decay`: the run keeps a moving average of the policy's weights from the warm
start, evaluates and publishes it as the run's policy, and trains on the raw weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from tracerl.eval.evaluate import load_policy
from tracerl.train import checkpoint as ckpt
from tracerl.train.config import load_config
from tracerl.train.trainer import EMA_DIR, Trainer

RECIPE = {
    "seed": 4, "steps": 2, "threads": 1, "tensorboard": False, "progress": False,
    "keep_checkpoints": 10,
    "model": {"vocab_size": 400, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
              "intermediate_size": 32},
    "tasks": {"train_count": 4, "heldout_count": 2},
    "sft": {"enabled": True, "demos_per_task": 1, "steps": 5},
    "rollout": {"tasks_per_step": 2, "group_size": 2, "max_turns": 2, "max_new_tokens": 6,
                "concurrency": 2, "env_workers": 1, "show_tool_schemas": False},
    # An entropy bonus moves the weights every step even when all rewards are 0.
    "update": {"entropy_coef": 0.05, "lr": 0.01, "micro_batch_rows": 2, "ema_decay": 0.5},
    "eval": {"samples_per_task": 1, "greedy": False},
}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def test_the_run_publishes_the_average_and_trains_on_its_own_weights(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    run_dir = tmp_path / "run"
    recipe.write_text(yaml.safe_dump({**RECIPE, "run_dir": str(run_dir)}))
    trainer = Trainer(load_config(recipe))
    summary = trainer.run()

    sft = _tensors(run_dir / "sft")
    one, two = (_tensors(ckpt.checkpoint_path(run_dir, s)) for s in (1, 2))
    published = _tensors(run_dir / EMA_DIR)
    assert any(not torch.equal(one[k], two[k]) for k in one)  # the steps moved the weights
    # ema = 0.5 ema + 0.5 w after each step, from the warm start: 1/4 sft + 1/4 w1 + 1/2 w2.
    for name in published:
        expected = 0.25 * sft[name].double() + 0.25 * one[name].double() + 0.5 * two[name].double()
        torch.testing.assert_close(published[name].double(), expected, rtol=0, atol=1e-6)
    # Each checkpoint carries the average so far (a resumed run continues it) ...
    _, extra = ckpt.load_trainer_file(ckpt.checkpoint_path(run_dir, 1))
    for name, value in extra["ema"].items():
        key = name if name in sft else name.removeprefix("model.")
        expected = 0.5 * sft[key].double() + 0.5 * one[key].double()
        torch.testing.assert_close(value.double(), expected, rtol=0, atol=1e-6)
    # ... while the checkpoints and the trainer's model keep the raw weights.
    for name, value in trainer.actor.policy.state_dict().items():
        if name in two:
            assert torch.equal(value, two[name]), name
    assert summary["policy_dir"] == str(run_dir / EMA_DIR)
    assert summary["policy"] == "weight average, update.ema_decay 0.5"
    assert summary["last_checkpoint"] == str(ckpt.checkpoint_path(run_dir, 2))
    written = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert written["policy_dir"] == summary["policy_dir"]
    policy = load_policy(run_dir / EMA_DIR)  # loadable as `tracerl eval --policy` loads it
    assert policy.conversation is not None
