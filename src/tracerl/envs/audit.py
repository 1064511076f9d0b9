"""Scoring an attempt (``verify``) and auditing it (``audit_attempt``), kept apart.

The reward comes only from the hidden tests, run on the attempt's final files in a fresh
sandbox after protected files are put back as they were. The audit says what the agent did
that it should not have: changed protected files (found by content hash, whatever did it),
or named hidden or out-of-repository paths in its tool calls. A report can show both.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from tracerl.envs.sandbox import Sandbox
from tracerl.envs.tasks import Task, check_relative_path, run_in_fresh_workspace
from tracerl.envs.tools import failure_excerpt


@dataclass(frozen=True)
class VerifyResult:
    """The verifier's score of an attempt's final files."""

    reward: float
    """1.0 when the hidden tests pass, else 0.0."""
    hidden_passed: bool
    """The hidden test command exited 0."""
    visible_passed: bool
    """The visible test command exited 0 (with protected files restored)."""
    output: str
    """Short excerpt of the hidden tests' output (``PASS`` or ``FAIL`` and what failed)."""
    seconds: float
    """Wall-clock seconds the verification took."""


@dataclass(frozen=True)
class AuditResult:
    """What an attempt did that does not count as solving the task."""

    protected_modified: tuple[str, ...]
    """Protected files whose content hash changed, that were deleted, or that were added."""
    reverted: bool
    """True when modified protected files were put back before verification."""
    hidden_access_attempts: tuple[str, ...]
    """Hidden files named in the agent's tool calls (paths or content)."""
    outside_access_attempts: tuple[str, ...]
    """Paths outside the repository named in the agent's tool calls."""
    protected_write_attempts: tuple[str, ...]
    """Protected files the agent tried to change with its tools."""
    flagged: bool
    """True when any of the above is non-empty."""


def content_hashes(files: Mapping[str, str]) -> dict[str, str]:
    """SHA-256 of each file's UTF-8 content."""
    return {path: hashlib.sha256(text.encode("utf-8")).hexdigest()
            for path, text in files.items()}


def changed_protected(task: Task, final_files: Mapping[str, str]) -> tuple[str, ...]:
    """Protected paths whose content differs from the start (changed, deleted or added)."""
    before = content_hashes(task.protected_files())
    after = content_hashes({p: c for p, c in final_files.items() if task.is_protected(p)})
    return tuple(sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p)))


def files_for_verification(task: Task, final_files: Mapping[str, str]) -> dict[str, str]:
    """The final files with every protected file restored (and added ones dropped)."""
    files = {p: c for p, c in final_files.items() if not task.is_protected(p)}
    files.update(task.protected_files())
    return files


def verify_files(task: Task, final_files: Mapping[str, str], sandbox: Sandbox) -> VerifyResult:
    """Run the hidden and visible tests on ``final_files`` in fresh sandboxes.

    Raises ``SandboxStartError`` when a sandbox cannot start (not the attempt's fault).
    """
    start = time.monotonic()
    files = files_for_verification(task, final_files)
    # Hidden files are written last, so a same-named file planted by the agent is replaced.
    hidden = run_in_fresh_workspace(sandbox, {**files, **task.hidden_files},
                                    task.hidden_test_command)
    visible = run_in_fresh_workspace(sandbox, files, task.test_command)
    passed = hidden.exit_code == 0 and not hidden.timed_out
    return VerifyResult(
        reward=1.0 if passed else 0.0, hidden_passed=passed,
        visible_passed=visible.exit_code == 0 and not visible.timed_out,
        output=failure_excerpt(hidden), seconds=time.monotonic() - start,
    )


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def audit_attempt(task: Task, final_files: Mapping[str, str],
                  tool_calls: Iterable[tuple[str, Mapping[str, Any]]]) -> AuditResult:
    """Audit an attempt from its final files and the tool calls it made (name, arguments)."""
    modified = changed_protected(task, final_files)
    hidden_names = {p for p in task.hidden_files} | {PurePosixPath(p).name
                                                     for p in task.hidden_files}
    hidden_hits: set[str] = set()
    outside: set[str] = set()
    protected_writes: set[str] = set()
    for name, arguments in tool_calls:
        for text in _strings(arguments):
            hidden_hits.update(h for h in hidden_names if h in text)
        path = arguments.get("path") if isinstance(arguments, Mapping) else None
        if not isinstance(path, str):
            continue
        try:
            normal = check_relative_path(path)
        except ValueError:
            outside.add(path)
            continue
        if name in ("replace", "write_file") and task.is_protected(normal):
            protected_writes.add(normal)
    return AuditResult(
        protected_modified=modified, reverted=bool(modified),
        hidden_access_attempts=tuple(sorted(hidden_hits)),
        outside_access_attempts=tuple(sorted(outside)),
        protected_write_attempts=tuple(sorted(protected_writes)),
        flagged=bool(modified or hidden_hits or outside or protected_writes),
    )
