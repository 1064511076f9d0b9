"""The task format: round trips, clear errors, validation, and the CLI end to end."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tracerl.envs import cli as envs_cli
from tracerl.envs.sandbox import Sandbox
from tracerl.envs.tasks import Budget, Task, dump_tasks, load_tasks, validate_task

HAND_WRITTEN = {
    "id": "celsius-1",
    "family": "hand_written",
    "instruction": "Fix to_fahrenheit in temp.py.",
    "files": {
        "temp.py": "def to_fahrenheit(c):\n    return c * 9 / 5 - 32\n",
        "tests/test_temp.py": "import sys\nsys.path.insert(0, '.')\nfrom temp import "
                              "to_fahrenheit\nassert to_fahrenheit(100) == 212, "
                              "to_fahrenheit(100)\nprint('ok')\n",
    },
    "protected": ["tests/*"],
    "test_command": "python tests/test_temp.py",
    "hidden_files": {"hidden_check.py": "from tracerl_report import check, end, value\n"
                                        "from temp import to_fahrenheit\n"
                                        "value('freezing', lambda: to_fahrenheit(0))\n"
                                        "check('minus forty', lambda: to_fahrenheit(-40) == -40)\n"
                                        "end()\n"},
    "hidden_test_command": "python hidden_check.py",
    "hidden_checks": ["minus forty"],
    "hidden_values": {"freezing": "32.0"},
    "solution": {"temp.py": "def to_fahrenheit(c):\n    return c * 9 / 5 + 32\n"},
    "budget": {"max_turns": 6, "max_seconds": 60},
    "source": "kept as an extra field",
}


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tracerl")
    envs_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    task = Task.from_dict(HAND_WRITTEN)
    assert task.budget == Budget(max_turns=6, max_seconds=60)
    assert task.is_protected("tests/test_temp.py") and not task.is_protected("temp.py")
    assert task.extra == {"source": "kept as an extra field"}
    dump_tasks([task], tmp_path / "t.jsonl")
    assert load_tasks(tmp_path / "t.jsonl") == [task]
    assert task.to_dict() == HAND_WRITTEN


def test_loadable_with_datasets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    other = dict(HAND_WRITTEN, id="other", files={"b.py": "x = 1\n"}, solution=None)
    path = _write(tmp_path / "t.jsonl", [HAND_WRITTEN, other])
    rows = datasets.load_dataset("json", data_files=str(path), split="train")
    tasks = [Task.from_dict(row) for row in rows]
    assert tasks[0] == Task.from_dict(HAND_WRITTEN)
    assert tasks[1].files == {"b.py": "x = 1\n"} and tasks[1].solution is None


@pytest.mark.parametrize(("change", "message"), [
    ({"files": {"../evil.py": "x"}}, "inside the workspace"),
    ({"files": {"/abs.py": "x"}}, "inside the workspace"),
    ({"test_command": ""}, "test_command"),
    ({"protected": "tests/*"}, "protected"),
    ({"budget": {"max_turns": 0}}, "max_turns"),
    ({"budget": {"turns": 3}}, "unknown budget keys"),
    ({"hidden_files": {"temp.py": "x"}}, "repeat paths"),
])
def test_bad_fields_are_named(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Task.from_dict({**HAND_WRITTEN, **change})


def test_load_errors_name_the_line(tmp_path: Path) -> None:
    missing = {k: v for k, v in HAND_WRITTEN.items() if k != "hidden_test_command"}
    path = _write(tmp_path / "bad.jsonl", [HAND_WRITTEN, missing])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*hidden_test_command"):
        load_tasks(path)
    (tmp_path / "j.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"j.jsonl:1: not valid JSON"):
        load_tasks(tmp_path / "j.jsonl")
    _write(tmp_path / "dup.jsonl", [HAND_WRITTEN, HAND_WRITTEN])
    with pytest.raises(ValueError, match="duplicate task id"):
        load_tasks(tmp_path / "dup.jsonl")


def test_validate_accepts_a_good_task_and_rejects_broken_ones(sandbox: Sandbox) -> None:
    assert validate_task(Task.from_dict(HAND_WRITTEN), sandbox).ok
    already_solved = Task.from_dict({**HAND_WRITTEN, "files": {
        **HAND_WRITTEN["files"], "temp.py": HAND_WRITTEN["solution"]["temp.py"]}})  # type: ignore[index]
    check = validate_task(already_solved, sandbox)
    assert check.problems == ("the starting files already pass the hidden tests",)
    wrong_solution = Task.from_dict({**HAND_WRITTEN, "solution": {
        "temp.py": "def to_fahrenheit(c):\n    return c\n"}})
    problems = validate_task(wrong_solution, sandbox).problems
    assert any(p.startswith("the solution fails the visible tests") for p in problems)
    assert any(p.startswith("the solution fails the hidden tests") for p in problems)


def test_cli_validate_and_sandbox_run_end_to_end(sandbox: Sandbox, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path / "good.jsonl", [HAND_WRITTEN])
    assert _run_cli(["tasks", "validate", str(good)]) == 0
    assert "1/1 tasks valid" in capsys.readouterr().out

    broken = _write(tmp_path / "broken.jsonl", [{**HAND_WRITTEN, "solution": {"temp.py": ""}}])
    assert _run_cli(["tasks", "validate", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "celsius-1: the solution fails the visible tests" in out and "0/1 tasks valid" in out

    code = _run_cli(["sandbox", "run", "--tasks", str(good), "--id", "celsius-1", "--",
                     "sh", "-c", "ls -R; python tests/test_temp.py"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"exit_code", "stdout", "stderr", "seconds", "timed_out"}
    assert result["exit_code"] == 1 and "AssertionError: 148.0" in result["stderr"]
    assert "temp.py" in result["stdout"] and "hidden_check.py" not in result["stdout"]

    _run_cli(["sandbox", "run", "--tasks", str(good), "--id", "celsius-1", "--timeout", "0.5",
              "--", "sleep", "20"])
    timed = json.loads(capsys.readouterr().out)
    assert timed["timed_out"] and timed["killed_reason"] == "timeout"
    with pytest.raises(ValueError, match="no task"):
        _run_cli(["sandbox", "run", "--tasks", str(good), "--id", "nope", "--", "true"])
