"""A whole training run small enough for a test: a 1-layer model, four train tasks, two steps.

Not a test module itself: tests import it by adding this folder to ``sys.path``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from tracerl.envs.audit import VerifyResult
from tracerl.envs.tasks import Task
from tracerl.envs.tools import TOOL_SCHEMAS, parse_tool_call
from tracerl.train.trainer import Trainer

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
            recipe.setdefault(key, {}).update(value)
        else:
            recipe[key] = value
    recipe["run_dir"] = str(root / "run")
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


class OneCallEnv:
    """A one-decision environment: an attempt is a single tool call out of two (``tools``);
    calling ``rewarded`` ends it solved, the other one truncates it unsolved (the turn budget
    is one call). With ``rollout.constrain_calls`` every action is a well-formed call of one
    of the two tools, so a fresh tiny model picks each about half the time and success
    depends on the policy's choice alone."""

    def __init__(self, tools: tuple[str, str] = ("submit", "undo"),
                 rewarded: str = "submit") -> None:
        if rewarded not in tools:
            raise ValueError(f"rewarded: {rewarded!r} is not one of tools {tools}")
        self.tool_schemas = [dict(s) for s in TOOL_SCHEMAS if s["function"]["name"] in tools]
        self.rewarded = rewarded
        self.task_id = ""
        self.solved = False

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.task_id = str((options or {}).get("task_id", "one-call"))
        self.solved = False
        return f"Finish the task: call {self.rewarded}.", {"task_id": self.task_id, "turn": 0}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        call = parse_tool_call(action).call
        name = None if call is None else call.name
        info: dict[str, Any] = {"task_id": self.task_id, "turn": 1, "tool": name,
                                "tool_seconds": 0.0, "tool_error": False}
        if name == self.rewarded:
            self.solved = True
            info["verify"] = self.verify()
            return "done", 1.0, True, False, info
        info["truncated_reason"] = "max_turns"
        return "OK", 0.0, False, True, info

    def verify(self) -> VerifyResult:
        passed = self.solved
        return VerifyResult(reward=float(passed), hidden_passed=passed, visible_passed=passed,
                            output="PASS" if passed else "FAIL", seconds=0.0)


class OneCallTrainer(Trainer):
    """The real trainer with :class:`OneCallEnv` for training and evaluation alike."""

    def make_env_factory(self, tasks: Sequence[Task]) -> Callable[[], OneCallEnv]:
        return OneCallEnv
