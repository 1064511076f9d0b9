"""`update.ema_decay`: the run keeps a moving average of the policy's weights from the warm
start, evaluates and publishes it as the run's policy, and trains on the raw weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tracerl.eval.evaluate import checkpoint_rollout, load_policy
from tracerl.train import checkpoint as ckpt
from tracerl.train.config import load_config
from tracerl.train.trainer import POLICY_DIR, Trainer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_runs import tiny_recipe


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def test_the_run_publishes_the_average_and_trains_on_its_own_weights(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, seed=4, sft={"steps": 5},
                         update={"ema_decay": 0.5}, eval={"samples_per_task": 1, "greedy": False})
    run_dir = tmp_path / "run"
    trainer = Trainer(load_config(recipe))
    summary = trainer.run()

    sft = _tensors(run_dir / "sft")
    one, two = (_tensors(ckpt.checkpoint_path(run_dir, s)) for s in (1, 2))
    published = _tensors(run_dir / POLICY_DIR)
    assert any(not torch.equal(one[k], two[k]) for k in one)  # the steps moved the weights
    # ema = 0.5 ema + 0.5 w after each step, from the warm start: 1/4 sft + 1/4 w1 + 1/2 w2.
    for name in published:
        expected = 0.25 * sft[name].double() + 0.25 * one[name].double() + 0.5 * two[name].double()
        torch.testing.assert_close(published[name].double(), expected, rtol=0, atol=1e-6)
    # Each checkpoint carries the average so far (a resumed run continues it) ...
    _, extra = ckpt.load_trainer_file(ckpt.checkpoint_path(run_dir, 1))
    for name, value in extra["ema"].items():
        expected = 0.5 * sft[name].double() + 0.5 * one[name].double()
        torch.testing.assert_close(value.double(), expected, rtol=0, atol=1e-6)
    # ... while the checkpoints and the trainer's model keep the raw weights.
    for name, value in trainer.actor.policy.state_dict().items():
        if name in two:
            assert torch.equal(value, two[name]), name
    assert summary["policy_dir"] == str(run_dir / POLICY_DIR)
    assert summary["policy"] == "weight average, update.ema_decay 0.5"
    assert summary["last_checkpoint"] == str(ckpt.checkpoint_path(run_dir, 2))
    written = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert written["policy_dir"] == summary["policy_dir"]
    load_policy(run_dir / POLICY_DIR)  # loadable as `tracerl eval --policy` loads it
    # ... and decoded as the run decoded it.
    assert checkpoint_rollout(run_dir / POLICY_DIR) == trainer.config.rollout
