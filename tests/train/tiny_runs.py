"""A whole training run small enough for a test: a 1-layer model, four train tasks, two steps.

Not a test module itself: tests import it by adding this folder to ``sys.path``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

TINY_RUN: dict[str, Any] = {
    "seed": 5, "steps": 2, "threads": 1, "tensorboard": False, "progress": False,
    "keep_checkpoints": 10,
    "model": {"vocab_size": 400, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
              "intermediate_size": 32},
    "tasks": {"train_count": 4, "heldout_count": 2},
    "sft": {"enabled": True, "demos_per_task": 1, "steps": 20},
    "rollout": {"tasks_per_step": 2, "group_size": 2, "max_turns": 2, "max_turn_tokens": 6,
                "concurrency": 2, "env_workers": 1, "show_tool_schemas": False},
    # An entropy bonus moves the weights every step even when all rewards are 0.
    "update": {"entropy_coef": 0.05, "lr": 0.01, "micro_batch_rows": 2},
    "eval": {"samples_per_task": 2, "greedy": True},
}
"""The run; tests change single fields with ``tiny_recipe``."""


def tiny_recipe(root: Path, **changes: Any) -> Path:
    """Write ``TINY_RUN`` with ``changes`` (a section's dict updates that section's fields)
    and ``run_dir: root/run`` to ``root/recipe.yaml``; returns the file."""
    recipe = copy.deepcopy(TINY_RUN)
    for key, value in changes.items():
        if isinstance(value, dict):
            recipe[key].update(value)
        else:
            recipe[key] = value
    recipe["run_dir"] = str(root / "run")
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path
