"""Dynamic sampling keeps uniform groups out of the update, but never out of the accounting:
the step's outcomes, uniform-group rates and costs count every attempt it generated."""

from __future__ import annotations

import json
from pathlib import Path

from tracerl.train.config import config_from_dict
from tracerl.train.trainer import Trainer

RECIPE = {
    "seed": 0, "steps": 1, "threads": 1, "tensorboard": False, "progress": False,
    "model": {"vocab_size": 400, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
              "intermediate_size": 32},
    "tasks": {"train_count": 4, "heldout_count": 2},
    "rollout": {"tasks_per_step": 3, "group_size": 2, "max_turns": 1, "max_new_tokens": 4,
                "show_tool_schemas": False},
    # An untrained model never solves a task: every group is uniform (all zero).
    "dynamic": {"filter_uniform": True},
    "eval": {"samples_per_task": 1, "greedy": False},
}


def test_filtered_groups_are_counted_in_outcomes_and_costs(tmp_path: Path) -> None:
    config = config_from_dict({**RECIPE, "run_dir": str(tmp_path / "run")})
    Trainer(config).run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    (step,) = [r for r in rows if r.get("kind") == "train"]
    assert step["dynamic"]["filtered_all_zero"] == 3
    assert step["attempts"]["collected"] == 6 and step["attempts"]["trained_on"] == 0
    assert step["groups"]["count"] == 3 and step["groups"]["all_zero_rate"] == 1.0
    assert step["costs"]["generated_tokens"] > 0
    assert step["endings"] and sum(step["endings"].values()) == 6
