"""The whole trainer under two data-parallel ranks (gloo, as torchrun would start them): rank 0
collects and writes the run, both ranks compute the update, and the weights equal a
single-process run's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tracerl.train.config import config_from_dict

RECIPE: dict[str, Any] = {
    "seed": 5, "steps": 2, "threads": 1, "tensorboard": False, "progress": False,
    "model": {"vocab_size": 400, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
              "intermediate_size": 32, "device": "cpu"},
    "tasks": {"train_count": 4, "heldout_count": 2},
    "sft": {"demos_per_task": 1, "steps": 20},
    "rollout": {"tasks_per_step": 2, "group_size": 2, "max_turns": 2, "max_turn_tokens": 6,
                # One attempt at a time: the sampler's batches, hence its rounding, are the
                # same in both runs.
                "concurrency": 1, "env_workers": 1, "show_tool_schemas": False},
    # Every group is kept and an entropy bonus moves the weights even when all rewards are 0;
    # two minibatches of odd-sized row sets give each rank a different share of each.
    "dynamic": {"filter_uniform": False, "refill": False},
    "update": {"entropy_coef": 0.05, "lr": 0.01, "micro_batch_rows": 1, "minibatches": 2,
               "kl_coef": 0.05},
    "eval": {"samples_per_task": 1, "greedy": False},
}


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _rank(rank: int, world: int, init_file: str, out: str) -> None:
    from tracerl.train.trainer import Trainer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        trainer = Trainer(config_from_dict({**RECIPE, "run_dir": f"{out}/ranked"}))
        summary = trainer.run()
        torch.save({"weights": _weights(trainer.actor), "summary": summary,
                    "version": trainer.state.policy_version, "step": trainer.state.step},
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_train_like_one_process(tmp_path: Path) -> None:
    from tracerl.train.trainer import Trainer

    single = Trainer(config_from_dict({**RECIPE, "run_dir": str(tmp_path / "single")}))
    single.run()
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    lead, other = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert torch.equal(lead["weights"], other["weights"])  # the ranks never drift apart
    assert lead["version"] == other["version"] == single.state.policy_version == 2
    assert lead["step"] == other["step"] == 2
    torch.testing.assert_close(lead["weights"], _weights(single.actor), atol=1e-6, rtol=0)
    # Rank 0 wrote the run; the other rank wrote nothing and returned no summary.
    assert other["summary"] == {} and lead["summary"]["rl_steps"] == 2
    ranked = tmp_path / "ranked"
    records = [json.loads(line) for line in (ranked / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [0, 1]
    # AdamW's step hardly depends on the gradient's scale, so the summed gradient's norm is
    # checked too: a row computed by both ranks (or by neither) would change it.
    alone = [json.loads(line) for line in
             (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    for key in ("grad_norm", "loss"):
        got = [[r["update"][key] for r in run if r["kind"] == "train"] for run in (records, alone)]
        assert got[0] == pytest.approx(got[1], rel=1e-5, abs=1e-9), key
        assert min(abs(v) for v in got[0]) > 0, key
    assert sorted(p.name for p in (ranked / "checkpoints").iterdir()) == sorted(
        p.name for p in (tmp_path / "single" / "checkpoints").iterdir())
