"""Process rewards read from the tools' answers: passing test runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tracerl.envs.suite.demonstrator import bug_location, minimal_edit
from tracerl.envs.tasks import Task
from tracerl.eval.evaluate import EvalSettings, collect_attempts
from tracerl.models.tiny import render_tool_call
from tracerl.testing.scripted import ScriptedPolicy
from tracerl.train.config import config_from_dict
from tracerl.train.trainer import Trainer


def _script(task: Task) -> list[str]:
    """view, an edit whose ``old`` is not in the line, a no-op edit, the fix, a malformed call,
    a test run (PASS), submit."""
    _, line, bad, good = bug_location(task)
    old, new = minimal_edit(bad, good)
    return [render_tool_call("view_file", {}),
            render_tool_call("replace", {"line": line, "old": "@@", "new": new}),
            render_tool_call("replace", {"line": line, "old": old, "new": old}),
            render_tool_call("replace", {"line": line, "old": old, "new": new}),
            '<tool_call>{"name": "replace", "arguments": </tool_call>',
            render_tool_call("run_tests", {}),
            render_tool_call("submit", {})]


def test_test_run_rewards_per_turn(tmp_path: Path) -> None:
    """Only the turn that ran the visible tests (and saw PASS) gets a process reward; the edits
    (one not applied, one changing nothing, the fix) and the malformed call get none."""
    config = config_from_dict({
        "run_dir": str(tmp_path / "run"), "threads": 1, "tensorboard": False, "progress": False,
        "model": {"vocab_size": 400, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
                  "intermediate_size": 32},
        "tasks": {"train_count": 2, "heldout_count": 1},
        "rollout": {"show_tool_schemas": False, "process_reward": True,
                    "process_reward_coef": 0.5},
    })
    trainer = Trainer(config)
    trainer.setup()
    task = trainer.train_tasks[0]
    scripted = ScriptedPolicy(trainer.policy, [task], _script)
    settings = EvalSettings(samples=1, rollout=dataclasses.replace(  # as the trainer collects
        config.rollout, max_turns=10, max_turn_tokens=400, max_attempt_tokens=4000))
    (attempt,), _ = collect_attempts(scripted, [task], settings, sandbox=trainer.sandbox)
    assert attempt.reward == 1.0  # the fix passes the hidden tests
    rewarded = trainer._with_process_rewards(attempt)
    turns = [t for fragment in rewarded.fragments for t in fragment.turns]
    assert [t.process_reward for t in turns] == [None, None, None, None, None, 0.5, None]
