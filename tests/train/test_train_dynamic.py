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
    "rollout": {"tasks_per_step": 3, "group_size": 2, "max_turns": 1, "max_turn_tokens": 4,
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


def test_generated_token_budget_stops_at_the_nearest_step_boundary(tmp_path: Path) -> None:
    """``max_generated_tokens`` ends RL at the step boundary nearest to the budget, counting
    the tokens of filtered groups too (what matched-budget comparisons need)."""
    # max_new_tokens 4, max_turns 1, 6 attempts: each step generates at most 24 tokens.
    recipe = {**RECIPE, "steps": 50, "max_generated_tokens": 50, "run_dir": str(tmp_path / "r")}
    trainer = Trainer(config_from_dict(recipe))
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").open()]
    steps = [r for r in rows if r.get("kind") == "train"]
    per_step = [r["costs"]["generated_tokens"] for r in steps]
    total = sum(per_step)
    assert 1 < len(steps) < 50
    assert trainer.state.totals["generated_tokens"] == total
    mean = total / len(steps)
    # Stopping one step earlier or later would not have been nearer to the budget.
    assert abs(total - 50) <= abs(total - per_step[-1] - 50) + 1e-9
    assert total + mean / 2 >= 50


def test_a_token_budget_below_one_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="max_generated_tokens"):
        config_from_dict({**RECIPE, "max_generated_tokens": 0})
