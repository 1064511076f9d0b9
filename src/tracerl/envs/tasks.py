"""The task format: a JSON-lines file, one task per line, and its checks.

A task is a small repository (``files``), a visible test command the agent may run, files it
may read but must not change (``protected``), and hidden tests it never sees, run by the
verifier after the attempt. See ``docs/envs.md`` for the format with an example.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tracerl.envs.repos import RepoSource
from tracerl.envs.sandbox import Sandbox, SandboxResult
from tracerl.envs.verdict import (
    EARLY_EXIT_PATTERNS,
    HARNESS_PATTERNS,
    Verdict,
    added_pattern_names,
    run_verdict,
)

REQUIRED_FIELDS = ("id", "family", "instruction", "files", "protected", "test_command",
                   "hidden_files", "hidden_test_command")
OPTIONAL_FIELDS = ("solution", "budget", "hidden_checks", "hidden_values", "repo",
                   "environment")


@dataclass(frozen=True)
class Budget:
    """Per-attempt limits a task asks for; any left as None falls back to the caller's."""

    max_turns: int | None = None
    """Most tool calls (environment steps) before the attempt is truncated."""
    max_new_tokens: int | None = None
    """Most tokens the policy may generate over the attempt (enforced by the collector)."""
    max_seconds: float | None = None
    """Most wall-clock seconds for the attempt before it is truncated."""
    test_seconds: float | None = None
    """Wall-clock (and CPU) seconds one of the task's commands may take in the sandbox, for
    tasks whose tests take longer than the sandbox's default (a real project's suite)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens", "max_seconds", "test_seconds"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value <= 0):
                raise ValueError(f"budget.{name} must be a positive number, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in (("max_turns", self.max_turns),
                                  ("max_new_tokens", self.max_new_tokens),
                                  ("max_seconds", self.max_seconds),
                                  ("test_seconds", self.test_seconds)) if v is not None}


@dataclass(frozen=True)
class Task:
    """One coding task (one line of a task file)."""

    id: str
    """Unique name of the task within its set."""
    family: str
    """Kind of task (e.g. a bug family of the built-in suite); used to group reports."""
    instruction: str
    """What the agent is asked to do; the start of its first observation."""
    files: Mapping[str, str]
    """The starting repository: relative path to text content."""
    protected: tuple[str, ...]
    """Glob patterns of files the agent may read but must not change (e.g. visible tests)."""
    test_command: str
    """Shell command run in the workspace root by the agent's run-tests tool; exit 0 = pass."""
    hidden_files: Mapping[str, str]
    """Files added only for verification, never present while the agent works."""
    hidden_test_command: str
    """Shell command the verifier runs with ``hidden_files`` added. Solved only when it exits
    0 and reports every check passed (``tracerl.envs.verdict``; see ``docs/envs.md``)."""
    solution: Mapping[str, str] | None = None
    """Fixed versions of (some of) ``files``, used by ``validate`` to prove the task solvable."""
    budget: Budget | None = None
    """Limits this task asks for (turns, tokens, seconds)."""
    hidden_checks: tuple[str, ...] = ()
    """Names of the pass/fail checks the hidden tests must report, each exactly once."""
    hidden_values: Mapping[str, str] = field(default_factory=dict)
    """Value checks: name to the expected reported value (``repr`` of the result), compared
    by the verifier outside the sandbox. With neither field, any non-empty set of checks that
    all pass is accepted."""
    repo: RepoSource | None = None
    """Where ``files`` came from when the task lives in a repository (``envs.repos``): the
    repository's text files with the task's own ``files`` laid over them."""
    environment: str | None = None
    """The virtualenv or Python executable the task's commands run in (bound read-only into
    the sandbox, its ``bin`` first on ``PATH``); None: the interpreter tracerl runs under."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Unknown fields kept as they were, so a round trip loses nothing."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("id must be a non-empty string")
        for name in ("family", "instruction", "test_command", "hidden_test_command"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ValueError(f"task {self.id}: {name} must be a non-empty string")
        _check_files(self.id, "files", self.files)
        if not self.files:
            raise ValueError(f"task {self.id}: files must not be empty")
        _check_files(self.id, "hidden_files", self.hidden_files)
        overlap = sorted(set(self.files) & set(self.hidden_files))
        if overlap:
            raise ValueError(f"task {self.id}: hidden_files repeat paths of files: {overlap}")
        if (not isinstance(self.protected, tuple)
                or not all(isinstance(p, str) and p for p in self.protected)):
            raise ValueError(f"task {self.id}: protected must be a list of glob strings")
        if (not isinstance(self.hidden_checks, tuple)
                or not all(isinstance(c, str) and c for c in self.hidden_checks)
                or len(set(self.hidden_checks)) != len(self.hidden_checks)):
            raise ValueError(f"task {self.id}: hidden_checks must be a list of distinct "
                             "non-empty names")
        if not isinstance(self.hidden_values, Mapping) or not all(
                isinstance(k, str) and k and isinstance(v, str)
                for k, v in self.hidden_values.items()):
            raise ValueError(f"task {self.id}: hidden_values must be an object of "
                             "check name: expected value (a string)")
        both = sorted(set(self.hidden_checks) & set(self.hidden_values))
        if both:
            raise ValueError(f"task {self.id}: checks {both} are in both hidden_checks and "
                             "hidden_values")
        if self.environment is not None and (not isinstance(self.environment, str)
                                             or not self.environment.startswith("/")):
            raise ValueError(f"task {self.id}: environment must be an absolute path to a "
                             f"virtualenv or a Python executable, got {self.environment!r}")
        if self.solution is not None:
            _check_files(self.id, "solution", self.solution)
            hidden = sorted(set(self.solution) & set(self.hidden_files))
            if hidden:
                raise ValueError(f"task {self.id}: solution must not write hidden files {hidden}")

    def is_protected(self, path: str) -> bool:
        """True when ``path`` matches one of the protected glob patterns."""
        return any(fnmatch.fnmatchcase(path, pattern) for pattern in self.protected)

    def protected_files(self) -> dict[str, str]:
        """The starting content of every protected file."""
        return {p: c for p, c in self.files.items() if self.is_protected(p)}

    def sandbox(self, sandbox: Sandbox) -> Sandbox:
        """``sandbox`` running this task's commands in its ``environment``, with its
        ``budget.test_seconds`` as the time limit when it sets one."""
        derived = sandbox.with_environment(self.environment)
        seconds = None if self.budget is None else self.budget.test_seconds
        if seconds is None:
            return derived
        return derived.with_limits(dataclasses.replace(
            derived.limits, wall_seconds=seconds, cpu_seconds=max(1, math.ceil(seconds))))

    def to_dict(self) -> dict[str, Any]:
        files = dict(self.files)
        if self.repo is not None:
            try:
                base = self.repo.read_files()
            except ValueError:  # the repository is gone: keep every file, lose nothing
                base = {}
            files = {p: c for p, c in files.items() if base.get(p) != c}
            gone = sorted(set(base) - set(self.files))
            if gone:
                raise ValueError(f"task {self.id}: files {gone[:5]} of its repo are missing "
                                 "from files; a repo task cannot drop repository files")
        out: dict[str, Any] = {
            "id": self.id, "family": self.family, "instruction": self.instruction,
            "files": files, "protected": list(self.protected),
            "test_command": self.test_command, "hidden_files": dict(self.hidden_files),
            "hidden_test_command": self.hidden_test_command,
        }
        if self.solution is not None:
            out["solution"] = dict(self.solution)
        if self.budget is not None:
            out["budget"] = self.budget.to_dict()
        if self.hidden_checks:
            out["hidden_checks"] = list(self.hidden_checks)
        if self.hidden_values:
            out["hidden_values"] = dict(self.hidden_values)
        if self.repo is not None:
            out["repo"] = self.repo.to_dict()
        if self.environment is not None:
            out["environment"] = self.environment
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, row: Mapping[str, Any], base_dir: str | Path | None = None) -> Task:
        """Build a task from a parsed JSON object (or a ``datasets`` row).

        A task with ``repo`` may leave out ``files``; its repository is read now, relative
        paths from ``base_dir`` (``load_tasks`` passes the task file's directory).

        ``datasets`` turns the per-task ``{path: content}`` maps into one struct column whose
        keys are the union over tasks, with None where a task lacks the path; those Nones are
        dropped here.
        """
        if not isinstance(row, Mapping):
            raise ValueError(f"a task must be a JSON object, got {type(row).__name__}")
        missing = [name for name in REQUIRED_FIELDS if name not in row
                   and not (name == "files" and row.get("repo") is not None)]
        if missing:
            raise ValueError(f"task {row.get('id', '?')}: missing fields {missing}")
        budget = row.get("budget")
        if budget is not None and not isinstance(budget, Mapping):
            raise ValueError(f"task {row['id']}: budget must be an object")
        unknown_budget = set(budget or {}) - {"max_turns", "max_new_tokens", "max_seconds",
                                              "test_seconds"}
        if unknown_budget:
            raise ValueError(f"task {row['id']}: unknown budget keys {sorted(unknown_budget)}")
        protected = row["protected"]
        if not isinstance(protected, list | tuple):
            raise ValueError(f"task {row['id']}: protected must be a list of glob strings")
        checks = row.get("hidden_checks")
        if checks is not None and not isinstance(checks, list | tuple):
            raise ValueError(f"task {row['id']}: hidden_checks must be a list of names")
        values = row.get("hidden_values")
        known = set(REQUIRED_FIELDS) | set(OPTIONAL_FIELDS)
        files = _drop_none(row["id"], "files", row.get("files") or {})
        repo = None
        if row.get("repo") is not None:
            try:
                repo = RepoSource.from_value(row["repo"], base_dir)
                files = {**repo.read_files(), **files}
            except ValueError as error:
                raise ValueError(f"task {row['id']}: {error}") from None
        return cls(
            id=row["id"], family=row["family"], instruction=row["instruction"],
            files=files,
            protected=tuple(protected), test_command=row["test_command"],
            hidden_files=_drop_none(row["id"], "hidden_files", row["hidden_files"]),
            hidden_test_command=row["hidden_test_command"],
            solution=(None if row.get("solution") is None
                      else _drop_none(row["id"], "solution", row["solution"])),
            budget=None if budget is None else Budget(**{k: v for k, v in budget.items()
                                                         if v is not None}),
            hidden_checks=tuple(checks or ()),
            hidden_values=({} if values is None
                           else _drop_none(row["id"], "hidden_values", values)),
            repo=repo, environment=row.get("environment"),
            extra={k: v for k, v in row.items() if k not in known},
        )


def _drop_none(task_id: str, name: str, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ValueError(f"task {task_id}: {name} must be an object of path: content")
    return {k: v for k, v in value.items() if v is not None}


def leaves_workspace(path: str) -> bool:
    """Whether ``path`` points outside a workspace (absolute, ``..``, with either slash, or a
    NUL byte), as opposed to one that is only malformed (empty, ``.``)."""
    return (path.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", path)
            or "\x00" in path)


def check_relative_path(path: str) -> str:
    """Return ``path`` normalised, or raise ValueError if it could leave the workspace."""
    if isinstance(path, str) and not path.strip():
        raise ValueError(f"path must name a file, got {path!r}")
    if not isinstance(path, str) or "\x00" in path or "\\" in path:
        raise ValueError(f"path must be a non-empty relative POSIX path, got {path!r}")
    if leaves_workspace(path):
        raise ValueError(f"path must stay inside the workspace, got {path!r}")
    pure = PurePosixPath(path)
    normal = str(PurePosixPath(*[p for p in pure.parts if p != "."])) if pure.parts else ""
    if normal in ("", "."):
        raise ValueError(f"path must name a file, got {path!r}")
    return normal


def _check_files(task_id: str, name: str, files: Mapping[str, str]) -> None:
    if not isinstance(files, Mapping):
        raise ValueError(f"task {task_id}: {name} must be an object of path: content")
    for path, content in files.items():
        try:
            if check_relative_path(path) != path:
                raise ValueError(f"path must be normalised, got {path!r}")
        except ValueError as error:
            raise ValueError(f"task {task_id}: {name}: {error}") from None
        if not isinstance(content, str):
            raise ValueError(f"task {task_id}: {name}[{path!r}] must be a string")


# -- files ----------------------------------------------------------------------------------

def load_tasks(path: str | Path) -> list[Task]:
    """Read a JSON-lines task file; errors name the line. Ids must be unique."""
    tasks: list[Task] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                task = Task.from_dict(json.loads(line), base_dir=Path(path).parent)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            except (ValueError, TypeError) as error:
                raise ValueError(f"{path}:{number}: {error}") from None
            if task.id in seen:
                raise ValueError(f"{path}:{number}: duplicate task id {task.id!r}")
            seen.add(task.id)
            tasks.append(task)
    return tasks


def dump_tasks(tasks: Iterable[Task], path: str | Path) -> int:
    """Write tasks as JSON lines; returns how many were written."""
    count = 0
    with open(path, "w", encoding="utf-8") as handle:
        for task in tasks:
            handle.write(json.dumps(task.to_dict(), sort_keys=True) + "\n")
            count += 1
    return count


def write_files(root: Path, files: Mapping[str, str]) -> None:
    """Write ``files`` under ``root``, creating directories (paths are checked first)."""
    for path, content in files.items():
        target = root / check_relative_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")


# -- validation -----------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskCheck:
    """The outcome of validating one task."""

    task_id: str
    """The task checked."""
    problems: tuple[str, ...]
    """What is wrong, one sentence each; empty when the task is valid."""

    @property
    def ok(self) -> bool:
        return not self.problems


def run_in_fresh_workspace(sandbox: Sandbox, files: Mapping[str, str],
                           command: str) -> SandboxResult:
    """Materialise ``files`` in a new temporary workspace and run ``command`` there."""
    with tempfile.TemporaryDirectory(prefix="tracerl-ws-") as tmp:
        root = Path(tmp)
        write_files(root, files)
        return sandbox.run(root, command)


def hidden_verdict(task: Task, files: Mapping[str, str], sandbox: Sandbox) -> Verdict:
    """The hidden tests' verdict on ``files`` (with the task's hidden files added)."""
    return run_verdict(task.sandbox(sandbox), files, task.hidden_files,
                       task.hidden_test_command,
                       checks=task.hidden_checks, values=task.hidden_values)


def validate_task(task: Task, sandbox: Sandbox) -> TaskCheck:
    """Check that the start fails the hidden tests and that the solution passes both (the
    hidden tests by the verifier's verdict: every check reported and passed)."""
    problems: list[str] = []
    start = hidden_verdict(task, task.files, sandbox)
    if start.passed:
        problems.append("the starting files already pass the hidden tests")
    if task.solution is not None:
        fixed = {**task.files, **task.solution}
        visible = run_in_fresh_workspace(task.sandbox(sandbox), fixed, task.test_command)
        if visible.exit_code != 0:
            problems.append("the solution fails the visible tests: "
                            + _last_line(visible))
        hidden = hidden_verdict(task, fixed, sandbox)
        if not hidden.passed:
            problems.append("the solution fails the hidden tests: "
                            + hidden.reason + "; " + _last_line(hidden.result))
        touched = sorted(p for p in task.solution if task.is_protected(p))
        if touched:
            problems.append(f"the solution changes protected files {touched}")
        # The audit flags code an attempt adds that can end or patch the tests; a solution
        # that needs such code would be flagged too, so the task could never be solved.
        flagged = sorted(f"{path}: {name}" for path, text in task.solution.items()
                         for name in added_pattern_names(
                             task.files.get(path, ""), text,
                             {**EARLY_EXIT_PATTERNS, **HARNESS_PATTERNS}))
        if flagged:
            problems.append(f"the audit would flag the solution: {flagged}")
    return TaskCheck(task.id, tuple(problems))


def validate_tasks(tasks: Sequence[Task], sandbox: Sandbox, *,
                   workers: int = 2) -> list[TaskCheck]:
    """Validate many tasks, ``workers`` sandboxes at a time; results keep the input order."""
    from concurrent.futures import ThreadPoolExecutor

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda t: validate_task(t, sandbox), tasks))


def _last_line(result: SandboxResult) -> str:
    lines = [ln for ln in (result.stdout + "\n" + result.stderr).splitlines() if ln.strip()]
    return f"exit {result.exit_code}" + (f", {lines[-1].strip()[:200]}" if lines else "")
