"""Mining: only mutants the tests catch, never a collection error, no flaky test, seeded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tracerl.envs.mine import Miner, MineResult, MineSettings, remove_tests, with_report_plugin
from tracerl.envs.mutate import Mutant
from tracerl.envs.sandbox import Sandbox, SandboxLimits, SandboxResult
from tracerl.envs.tasks import validate_tasks
from tracerl.envs.verdict import Verdict

CALC = '''def add(a, b):
    return a + b


def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x


def unused(n):
    return n * 2
'''
TESTS = '''from calc import add, clamp


def test_add():
    assert add(2, 3) == 5


def test_add_negative():
    assert add(-2, -3) == -5


class TestClamp:
    def test_inside(self):
        assert clamp(5, 0, 10) == 5

    def test_low(self):
        assert clamp(-1, 0, 10) == 0

    def test_high(self):
        assert clamp(11, 0, 10) == 10
'''
REPO = {"calc.py": CALC, "test_calc.py": TESTS}


@pytest.fixture(scope="module")
def slow_sandbox() -> Sandbox:
    return Sandbox(SandboxLimits(wall_seconds=60.0, cpu_seconds=60))


def _settings(**changes: object) -> MineSettings:
    base: dict[str, object] = {"test_command": "python -m pytest -q", "tries_per_function": 1,
                               "heldout_fraction": 0.0}
    base.update(changes)
    return MineSettings(**base)  # type: ignore[arg-type]


def test_caught_mutants_become_valid_tasks_and_the_seed_fixes_them(
        slow_sandbox: Sandbox) -> None:
    miner = Miner(_settings(), slow_sandbox)
    first = miner.mine({"calc": REPO})
    tasks = first.train
    assert tasks and not first.heldout
    assert {t.extra["mutation"]["function"] for t in tasks} <= {"add", "clamp"}
    # unused() has no test: every mutant of it is refused as not caught.
    assert first.refused["not caught by the tests"] >= 1
    for task in tasks:
        assert task.solution == {"calc.py": CALC}
        hidden_only = set(task.extra["failing_tests"]) - set(task.extra["visible_failing_tests"])
        for nodeid in hidden_only:  # hidden failing tests are gone from the visible file
            definition = f"def {nodeid.split('::')[-1]}("
            assert definition not in task.files["test_calc.py"]
            assert definition in task.hidden_files["test_calc_hidden.py"]
    assert all(check.ok for check in validate_tasks(tasks, slow_sandbox))
    again = Miner(_settings(), slow_sandbox).mine({"calc": REPO})
    assert again.train == tasks


def test_a_mutant_that_breaks_collection_is_refused(slow_sandbox: Sandbox) -> None:
    miner = Miner(_settings(), slow_sandbox)
    result = MineResult()
    baseline = miner.baseline(REPO, result)
    assert baseline is not None
    broken = Mutant("constant", "add", 1, "import fails",
                    CALC + "\nLIMIT = 1 // 0\n")
    assert miner.attempt(REPO, "calc.py", broken, 0, baseline, result) is None
    assert result.refused == {"breaks collection (tests not reported)": 1}
    quiet = Mutant("operator", "unused", 14, "* -> //", CALC.replace("n * 2", "n // 2"))
    assert miner.attempt(REPO, "calc.py", quiet, 0, baseline, result) is None
    assert result.refused["not caught by the tests"] == 1


class _ScriptedMiner(Miner):
    """Test outcomes from a script instead of a sandbox: ``flip`` fails every other run."""

    def __init__(self, outcomes: Mapping[str, Sequence[bool]]) -> None:
        super().__init__(_settings(), Sandbox(unsafe=True))
        self.outcomes = outcomes
        self.calls = 0

    def _run(self, files: Mapping[str, str], exclude: Sequence[str]) -> Verdict:
        index = self.calls
        self.calls += 1
        mutated = files["calc.py"] != CALC
        seen = {name: script[index % len(script)] if not mutated or "flip" in name
                else not name.endswith("add")
                for name, script in self.outcomes.items()
                if name.split("::")[-1] not in exclude}
        result = SandboxResult(0 if all(seen.values()) else 1, "", "", 0.1, False, None)
        return Verdict(all(seen.values()), "scripted", result.exit_code, 0, len(seen),
                       sum(seen.values()), True, False, (), (), result, seen)


def test_a_flaky_test_is_excluded() -> None:
    outcomes = {"test_calc.py::test_add": [True], "test_calc.py::test_flip": [True, False],
                "test_calc.py::TestClamp::test_low": [True]}
    miner = _ScriptedMiner(outcomes)
    result = MineResult()
    baseline = miner.baseline(REPO, result)
    assert baseline is not None
    stable, excluded = baseline
    assert "test_calc.py::test_flip" not in stable and excluded == {"test_flip"}
    assert result.flaky == {"test_calc.py::test_flip"}
    mutant = Mutant("operator", "add", 2, "+ -> -", CALC.replace("a + b", "a - b"))
    task = miner.attempt(REPO, "calc.py", mutant, 0, baseline, result)
    assert task is not None
    assert task.extra["failing_tests"] == ["test_calc.py::test_add"]
    assert "test_flip" in task.test_command and "test_flip" in task.hidden_test_command
    assert "-k 'not (test_flip)'" in task.hidden_test_command


def test_remove_tests_keeps_everything_else() -> None:
    stripped = remove_tests(TESTS, {(None, "test_add"), ("TestClamp", "test_low")})
    assert stripped is not None
    assert "def test_add()" not in stripped and "def test_low" not in stripped
    assert "def test_add_negative" in stripped and "def test_high" in stripped
    everything = remove_tests(TESTS, {("TestClamp", n) for n in ("test_inside", "test_low",
                                                                 "test_high")})
    assert everything is not None and "class TestClamp:\n    pass\n" in everything
    assert remove_tests(TESTS, {("Other", "test_add")}) is None  # not defined there


def test_settings_and_commands_are_checked() -> None:
    with pytest.raises(ValueError, match="must run pytest"):
        MineSettings(test_command="python -m unittest")
    with pytest.raises(ValueError, match="visible_fraction"):
        _settings(visible_fraction=0.0)
    assert with_report_plugin("python -m pytest -q tests", ["a", "b"]) == (
        "python -m pytest -p tracerl_report -p no:cacheprovider -k 'not (a or b)' -q tests")


def test_cli_mines_a_git_commit_into_train_and_heldout(tmp_path: Path) -> None:
    import argparse
    import json
    import shutil
    import subprocess

    from tracerl.envs import cli as envs_cli
    from tracerl.envs.tasks import load_tasks

    if shutil.which("git") is None or shutil.which("bwrap") is None:
        pytest.skip("needs git and bubblewrap")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text(CALC)
    (repo / "shapes.py").write_text("def area(w, h):\n    return w * h\n")
    (repo / "test_calc.py").write_text(TESTS)
    (repo / "test_shapes.py").write_text("from shapes import area\n\n\ndef test_area():\n"
                                         "    assert area(2, 3) == 6\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "start"], check=True)
    parser = argparse.ArgumentParser(prog="tracerl")
    envs_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tasks", "mine", "--repo", str(repo), "--commit", "HEAD",
                              "--out", str(tmp_path / "out"), "--tries", "1",
                              "--heldout-fraction", "0.5", "--seed", "1"])
    assert args.func(args) == 0
    train = load_tasks(tmp_path / "out" / "train.jsonl")
    heldout = load_tasks(tmp_path / "out" / "heldout.jsonl")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["train"] == len(train) and summary["heldout"] == len(heldout)
    assert train and heldout
    train_paths = {t.extra["mutation"]["path"] for t in train}
    heldout_paths = {t.extra["mutation"]["path"] for t in heldout}
    assert not train_paths & heldout_paths  # split by module


@pytest.mark.slow
def test_stdlib_set_mines_and_validates(tmp_path: Path) -> None:
    import argparse
    import json

    from tracerl.envs import cli as envs_cli

    parser = argparse.ArgumentParser(prog="tracerl")
    envs_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tasks", "mine", "--stdlib", "colorsys", "getopt", "--tries", "1",
                              "--validate", "--out", str(tmp_path)])
    assert args.func(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["invalid"] == [] and summary["train"] > 0 and summary["heldout"] > 0
