"""Tasks that live in a repository: a directory or a git commit as the starting files, and an
environment of their own, bound read-only into the sandbox."""

from __future__ import annotations

import json
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from tracerl.envs.coding import CodingEnv
from tracerl.envs.repos import RepoSource, environment_dirs
from tracerl.envs.sandbox import Sandbox
from tracerl.envs.tasks import Task, dump_tasks, load_tasks, run_in_fresh_workspace, validate_task

HIDDEN = ("import sys\nfrom tracerl_report import check, end\nimport envmarker\n"
          "from temp import to_fahrenheit\n"
          "check('own environment', lambda: envmarker.WHERE == 'task env')\n"
          "check('minus forty', lambda: to_fahrenheit(-40) == -40)\nend()\n")


@pytest.fixture(scope="module")
def task_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with a module that only it has."""
    root = tmp_path_factory.mktemp("env") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    site = next(root.glob("lib/python*/site-packages"))
    (site / "envmarker.py").write_text("WHERE = 'task env'\n")
    return root


def _repo(root: Path) -> Path:
    (root / "tests").mkdir(parents=True)
    (root / "temp.py").write_text("def to_fahrenheit(c):\n    return c * 9 / 5 - 32\n")
    (root / "tests" / "test_temp.py").write_text(
        "import sys\nsys.path.insert(0, '.')\nfrom temp import to_fahrenheit\n"
        "assert to_fahrenheit(100) == 212\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "temp.cpython-311.pyc").write_bytes(b"\x00\x01")
    (root / "logo.png").write_bytes(b"\x89PNG\x00\x00")
    return root


def _row(repo: dict[str, str], environment: Path | None) -> dict[str, object]:
    row: dict[str, object] = {
        "id": "repo-1", "family": "repository", "instruction": "Fix to_fahrenheit.",
        "repo": repo, "protected": ["tests/*"], "test_command": "python tests/test_temp.py",
        "hidden_files": {"hidden_check.py": HIDDEN},
        "hidden_test_command": "python hidden_check.py",
        "hidden_checks": ["own environment", "minus forty"],
        "solution": {"temp.py": "def to_fahrenheit(c):\n    return c * 9 / 5 + 32\n"},
    }
    if environment is not None:
        row["environment"] = str(environment)
    return row


def test_directory_task_reads_text_files_and_round_trips(tmp_path: Path) -> None:
    _repo(tmp_path / "project")
    row = _row({"path": "project"}, None)
    row["files"] = {"NOTES.md": "added by the task\n"}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(row) + "\n")
    [task] = load_tasks(tmp_path / "tasks.jsonl")
    assert sorted(task.files) == ["NOTES.md", "temp.py", "tests/test_temp.py"]
    assert task.repo == RepoSource(path="project")
    out = task.to_dict()
    assert out["repo"] == {"path": "project"} and out["files"] == {"NOTES.md": "added by the task\n"}
    dump_tasks([task], tmp_path / "again.jsonl")
    assert load_tasks(tmp_path / "again.jsonl") == [task]


def test_git_commit_task_reads_the_commit_not_the_work_tree(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = _repo(tmp_path / "project")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "temp.py", "tests"], check=True)
    subprocess.run([*git, "commit", "-qm", "start"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    (root / "temp.py").write_text("changed after the commit\n")
    task = Task.from_dict(_row({"git": str(root), "commit": commit}, None))
    assert task.files["temp.py"].startswith("def to_fahrenheit")
    with pytest.raises(ValueError, match=r"repo-1: repo.git .* 'nosuchrev'"):
        Task.from_dict(_row({"git": str(root), "commit": "nosuchrev"}, None))


@pytest.mark.parametrize(("repo", "message"), [
    ({"path": "x", "git": "y"}, "exactly one of path or git"),
    ({"git": "y"}, "needs repo.commit"),
    ({"path": "/no/such/dir"}, "no such directory"),
    ({"path": "x", "branch": "main"}, "unknown keys"),
])
def test_bad_repo_is_refused_with_the_reason(repo: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Task.from_dict(_row(repo, None))


def test_bad_environment_is_refused(tmp_path: Path) -> None:
    _repo(tmp_path)
    with pytest.raises(ValueError, match="environment must be an absolute path"):
        Task.from_dict(_row({"path": str(tmp_path)}, Path("relative/venv")))
    with pytest.raises(ValueError, match="no such virtualenv or executable"):
        environment_dirs(tmp_path / "missing")
    with pytest.raises(ValueError, match="without bin/python"):
        environment_dirs(tmp_path)


def test_repo_task_validates_in_its_own_environment(tmp_path: Path, task_env: Path,
                                                     sandbox: Sandbox) -> None:
    task = Task.from_dict(_row({"path": str(_repo(tmp_path / "project"))}, task_env))
    assert validate_task(task, sandbox).ok
    # Under tracerl's own interpreter the environment's module is missing: the hidden
    # tests fail on the solution, so validation tells.
    plain = Task.from_dict(_row({"path": str(tmp_path / "project")}, None))
    problems = validate_task(plain, sandbox).problems
    assert any("solution fails the hidden tests" in p for p in problems)
    ran = run_in_fresh_workspace(task.sandbox(sandbox), task.files,
                                 "python -c 'import sys; print(sys.prefix)'")
    assert ran.stdout.strip() == str(task_env)


def test_repo_task_cannot_write_outside_or_read_hidden(tmp_path: Path, task_env: Path,
                                                       sandbox: Sandbox) -> None:
    project = _repo(tmp_path / "project")
    task = Task.from_dict(_row({"path": str(project)}, task_env))
    site = next(task_env.glob("lib/python*/site-packages"))
    targets = [str(site / "envmarker.py"), str(project / "temp.py"), str(task_env / "new.txt")]
    probe = (
        "import os\n"
        f"for target in {targets!r}:\n"
        "    try:\n"
        "        open(target, 'w').write('x')\n"
        "        print('WROTE', target)\n"
        "    except OSError as error:\n"
        "        print('refused', type(error).__name__)\n"
        f"print('repo visible', os.path.exists({str(project)!r}))\n"
        "print('hidden here', os.path.exists('hidden_check.py'))\n"
        "open('inside.txt', 'w').write('ok')\n"
    )
    env = CodingEnv([task], sandbox=sandbox)
    env.reset(options={"task_id": task.id})
    assert env.workspace is not None
    env.workspace.write("probe.py", probe)
    result = task.sandbox(sandbox).run(env.workspace.root, "python probe.py")
    assert "WROTE" not in result.stdout and result.stdout.count("refused") == 3, result
    assert "repo visible False" in result.stdout and "hidden here False" in result.stdout
    assert (env.workspace.root / "inside.txt").read_text() == "ok"
    assert (site / "envmarker.py").read_text() == "WHERE = 'task env'\n"
    assert project.joinpath("temp.py").read_text().startswith("def to_fahrenheit")
    observation, *_ = env.step('<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>')
    assert "AssertionError" in observation or "FAIL" in observation
    env.close()


def test_budget_test_seconds_sets_the_sandbox_time_limit(tmp_path: Path) -> None:
    row = _row({"path": str(_repo(tmp_path / "project"))}, None)
    row["budget"] = {"test_seconds": 45}
    task = Task.from_dict(row)
    sandbox = Sandbox(unsafe=True)
    limited = task.sandbox(sandbox)
    assert limited.limits.wall_seconds == 45 and limited.limits.cpu_seconds == 45
    assert task.sandbox(sandbox) is limited and sandbox.limits.wall_seconds == 10
    assert task.to_dict()["budget"] == {"test_seconds": 45}
    row["budget"] = {"test_seconds": 0}
    with pytest.raises(ValueError, match=r"budget\.test_seconds must be a positive number"):
        Task.from_dict(row)


def test_a_sandbox_with_derived_ones_still_pickles(task_env: Path) -> None:
    import pickle

    sandbox = Sandbox(unsafe=True)
    derived = sandbox.with_environment(str(task_env))
    assert sandbox.with_environment(str(task_env)) is derived
    copy = pickle.loads(pickle.dumps(sandbox))  # sandboxes travel to Ray workers
    assert copy.with_environment(str(task_env)).environment == str(task_env)
