"""`update.sft_coef`: the warm start's demonstrations mixed into every RL optimizer step
(PPO-ptx), drawn reproducibly so a resumed run mixes in what an uninterrupted one would."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tracerl.train.config import load_config
from tracerl.train.run_eval import evaluate_run, step_spec
from tracerl.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_runs import tiny_recipe


def test_the_run_mixes_demonstrations_into_each_optimizer_step(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, seed=6, sft={"steps": 5, "batch_size": 3,
                                                "fresh_names": 0.5},
                         update={"sft_coef": 0.5, "epochs": 2},
                         eval={"samples_per_task": 1, "greedy": False})
    trainer = Trainer(load_config(recipe))
    trainer.run()
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    losses = [row["update"]["sft_loss"] for row in rows if "sft_loss" in row.get("update", {})]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)  # both RL steps mixed them in

    # The batch of an optimizer step depends on the step alone: the same in a new process
    # (a resumed run), another for another step; sft.batch_size rows, actions among them.
    again = Trainer(load_config(recipe))
    again.setup()
    for k in (0, 3):
        first, second = trainer.demonstration_batch(k), again.demonstration_batch(k)
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b)
        ids, attention, action = first
        assert ids.shape[0] == 3 and bool(action.any()) and bool((attention.bool() | ~action).all())
    assert not torch.equal(trainer.demonstration_batch(0)[0], trainer.demonstration_batch(1)[0])
    trainer.close()
    again.close()
    # Its checkpoints are evaluated afterwards as any run's are (no update runs there).
    run_dir, out = tmp_path / "run", tmp_path / "evals"
    evaluate_run(run_dir, [step_spec(2)], out, log=lambda *_: None)
    ours = json.loads((out / "eval_step00002_sampled.json").read_text(encoding="utf-8"))
    theirs = json.loads((run_dir / "eval_after_sampled.json").read_text(encoding="utf-8"))
    assert ours["per_task"] == theirs["per_task"]
