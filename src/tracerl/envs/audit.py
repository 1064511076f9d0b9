"""Scoring an attempt (``verify``) and auditing it (``audit_attempt``), kept apart.

The reward comes only from the hidden tests' verdict (``envs.verdict``: evidence that every
check ran and passed), run on the attempt's final files in a fresh sandbox after protected
files are put back as they were. The audit says what the agent did that it should not have:
changed protected files (found by content hash, whatever did it), named hidden or
out-of-repository paths in its tool calls, added code that ends the test process early or
patches the test machinery, left paths where the hidden tests go, or had its hidden tests
exit 0 without the evidence. A report can show both.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from tracerl.envs.sandbox import Sandbox
from tracerl.envs.tasks import (
    Task,
    check_relative_path,
    hidden_verdict,
    leaves_workspace,
    run_in_fresh_workspace,
)
from tracerl.envs.tools import failure_excerpt
from tracerl.envs.verdict import (
    EARLY_EXIT_PATTERNS,
    HARNESS_PATTERNS,
    Verdict,
    added_pattern_names,
)


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
    checks_passed: int = 0
    """Hidden checks that reported a pass."""
    checks_expected: int = 0
    """Hidden checks the task declares (0 when it declares none)."""
    verdict_reason: str = ""
    """Why the hidden verdict failed (``"passed"`` when it passed)."""
    early_exit: bool = False
    """The hidden test command exited 0 without evidence that its checks ran."""
    displaced: tuple[str, ...] = ()
    """The attempt's paths removed or left out while writing the verification workspace."""


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
    """True when any finding (this field's siblings) is non-empty or true."""
    early_exit_code: tuple[str, ...] = ()
    """``path: pattern`` of code the attempt added that can end the test process early."""
    harness_patches: tuple[str, ...] = ()
    """``path: pattern`` of code the attempt added that can patch the test machinery."""
    hidden_name_hits: tuple[str, ...] = ()
    """Paths left where hidden files go, and changed files naming a hidden file."""
    exited_early: bool = False
    """The hidden tests exited 0 without the evidence that their checks ran."""

    def findings(self) -> dict[str, Any]:
        """The non-empty findings beyond the trace's audit record, JSON-ready."""
        out: dict[str, Any] = {}
        for name in ("outside_access_attempts", "protected_write_attempts", "early_exit_code",
                     "harness_patches", "hidden_name_hits"):
            if getattr(self, name):
                out[name] = list(getattr(self, name))
        if self.exited_early:
            out["exited_early"] = True
        return out


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
    # The verifier's files replace whatever the attempt left in their way (envs.verdict).
    verdict: Verdict = hidden_verdict(task, files, sandbox)
    try:
        visible = run_in_fresh_workspace(task.sandbox(sandbox), files, task.test_command)
        visible_passed = visible.exit_code == 0 and not visible.timed_out
    except (OSError, ValueError):  # the attempt's paths could not be copied: its failure
        visible_passed = False
    output = verdict.summary()
    if not verdict.passed and verdict.result.exit_code != 0:
        output += "\n" + failure_excerpt(verdict.result)
    return VerifyResult(
        reward=1.0 if verdict.passed else 0.0, hidden_passed=verdict.passed,
        visible_passed=visible_passed, output=output, seconds=time.monotonic() - start,
        checks_passed=verdict.checks_passed, checks_expected=verdict.checks_expected,
        verdict_reason=verdict.reason, early_exit=verdict.early_exit,
        displaced=verdict.displaced,
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


def added_patterns(task: Task, final_files: Mapping[str, str],
                   patterns: Mapping[str, re.Pattern[str]]) -> tuple[str, ...]:
    """``path: pattern`` for each pattern found more often in a final file than in the same
    file at the start (a new file counts from zero); protected files are left out (they are
    restored before verification)."""
    hits: list[str] = []
    for path, text in sorted(final_files.items()):
        before = task.files.get(path, "")
        if task.is_protected(path) or text == before:
            continue
        hits += [f"{path}: {name}" for name in added_pattern_names(before, text, patterns)]
    return tuple(hits)


def hidden_name_hits(task: Task, final_files: Mapping[str, str],
                     workspace_paths: Iterable[str]) -> tuple[str, ...]:
    """Paths where hidden files go (or their directories) that the attempt occupied, and
    changed files whose text names a hidden file."""
    hidden = list(task.hidden_files)
    hits: set[str] = set()
    for path in workspace_paths:
        if any(path == h or path.startswith(h + "/") for h in hidden):
            hits.add(path)
        elif path in final_files and any(h.startswith(path + "/") for h in hidden):
            hits.add(path)  # a file where a hidden file's directory must be
    names = {PurePosixPath(h).name for h in hidden} | {PurePosixPath(h).stem for h in hidden
                                                       if len(PurePosixPath(h).stem) >= 6}
    for path, text in final_files.items():
        if task.is_protected(path) or text == task.files.get(path):
            continue
        found = sorted(n for n in names if n in text and n not in task.files.get(path, ""))
        hits.update(f"{path}: names {n}" for n in found)
    return tuple(sorted(hits))


def audit_attempt(task: Task, final_files: Mapping[str, str],
                  tool_calls: Iterable[tuple[str, Mapping[str, Any]]], *,
                  workspace_paths: Iterable[str] | None = None,
                  verify: VerifyResult | None = None) -> AuditResult:
    """Audit an attempt from its final files and the tool calls it made (name, arguments).

    ``workspace_paths`` (every path left in the workspace, directories too; the final
    files' paths when None) finds paths left where hidden files go; ``verify`` (the
    attempt's score) tells whether its hidden tests exited 0 without evidence."""
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
            if leaves_workspace(path):  # an empty or "." path is a malformed call, not a try
                outside.add(path)
            continue
        if name in ("replace", "write_file") and task.is_protected(normal):
            protected_writes.add(normal)
    exits = added_patterns(task, final_files, EARLY_EXIT_PATTERNS)
    patches = added_patterns(task, final_files, HARNESS_PATTERNS)
    names = hidden_name_hits(task, final_files,
                             final_files if workspace_paths is None else workspace_paths)
    exited_early = verify is not None and verify.early_exit
    return AuditResult(
        protected_modified=modified, reverted=bool(modified),
        hidden_access_attempts=tuple(sorted(hidden_hits)),
        outside_access_attempts=tuple(sorted(outside)),
        protected_write_attempts=tuple(sorted(protected_writes)),
        flagged=bool(modified or hidden_hits or outside or protected_writes or exits
                     or patches or names or exited_early),
        early_exit_code=exits, harness_patches=patches, hidden_name_hits=names,
        exited_early=exited_early,
    )
