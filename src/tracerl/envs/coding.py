"""The coding environment: a Gymnasium-style env over a task set, a sandbox and the tools.

One episode is one attempt at one task. Actions are the policy's text; the env runs the first
``<tool_call>`` in it and returns the tool's output as the next observation.

- ``terminated`` is True after ``submit``: the task really ended, and the reward (hidden
  tests on the final files, protected files restored) is returned with it.
- ``truncated`` is True when the turn or time budget ran out: the attempt was cut, not ended;
  its reward is 0 here and ``verify()`` scores the files it left, if the caller wants.
- ``restart`` puts every file back as the task gave it and answers with the task statement
  again, with ``info["fresh_context"] = True``: the collector then continues the attempt in a
  new context (a new fragment, as after a compaction), so the next try is not conditioned on
  the one given up. The turn and time budgets go on; nothing is terminated.
- A tool or sandbox crash sets ``info["tool_error"]`` and ends nothing: it is the
  infrastructure's fault, and the collector decides whether to retry or to end the attempt
  with that reason. An agent mistake (bad call, missing file) is an ``error:`` observation.
- An injected tool fault (:mod:`tracerl.envs.faults`: a failed or timed-out command, a flaky
  test run, a truncated output) is an observation like a real tool's failure, and the attempt
  goes on; ``info["fault"]`` names it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, SupportsFloat

import gymnasium as gym
from gymnasium import spaces

from tracerl.envs.audit import AuditResult, VerifyResult, audit_attempt, verify_files
from tracerl.envs.faults import (
    SKIPS_TOOL,
    FaultConfig,
    FaultInjector,
    FaultKind,
    after_tool,
    skipped_observation,
)
from tracerl.envs.sandbox import Sandbox
from tracerl.envs.tasks import Task, write_files
from tracerl.envs.tools import (
    MAX_LINE_CHARS,
    TOOL_SCHEMAS,
    PathError,
    Workspace,
    failure_excerpt,
    line_number,
    list_files_tool,
    parse_tool_call,
    replace_tool,
    view_file_tool,
    write_file_tool,
)
from tracerl.envs.verdict import workspace_paths

CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n\t"
"""Characters of observations and actions: printable ASCII, newline and tab."""
MAX_TEXT = 1 << 16
"""``max_length`` of the observation and action spaces."""


def to_charset(text: str, limit: int) -> str:
    """``text`` with characters outside ``CHARSET`` replaced by ``?``, cut to ``limit``."""
    allowed = set(CHARSET)
    clean = "".join(ch if ch in allowed else "?" for ch in text)
    return clean if len(clean) <= limit else clean[: limit - 12] + "\n[truncated]"


def task_statement(task: Task) -> str:
    """The first observation of an attempt at ``task``: its instruction and its files' paths."""
    listing = "\n".join(sorted(task.files))
    return f"{task.instruction}\nFiles:\n{listing}"


class CodingEnv(gym.Env[str, str]):
    """Attempts at coding tasks; see the module docstring for the episode's semantics."""

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gymnasium's attribute)

    def __init__(self, tasks: Sequence[Task], *, sandbox: Sandbox | None = None,
                 max_turns: int = 8, max_seconds: float | None = None,
                 faults: FaultConfig | None = None, observation_chars: int = 4000,
                 check_syntax: bool = True) -> None:
        """``max_turns``/``max_seconds`` apply when a task's own budget leaves them unset.
        ``check_syntax``: an edit that would leave a Python file that parsed unparsable is
        refused with the parser's error (``tools.parse_error``), as SWE-agent's editor does."""
        if not tasks:
            raise ValueError("tasks must not be empty")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_seconds is not None and max_seconds <= 0:
            raise ValueError(f"max_seconds must be positive, got {max_seconds}")
        if not 16 <= observation_chars <= MAX_TEXT:
            raise ValueError(f"observation_chars must be in [16, {MAX_TEXT}]")
        self.tasks = list(tasks)
        self._by_id = {task.id: i for i, task in enumerate(self.tasks)}
        self.sandbox = sandbox if sandbox is not None else Sandbox()
        self.max_turns = max_turns
        self.max_seconds = max_seconds
        self.faults = FaultInjector(faults) if faults is not None and faults.active else None
        self.observation_chars = observation_chars
        self.check_syntax = check_syntax
        self.observation_space = spaces.Text(max_length=MAX_TEXT, min_length=1, charset=CHARSET)
        self.action_space = spaces.Text(max_length=MAX_TEXT, min_length=0, charset=CHARSET)
        self.task: Task | None = None
        self.workspace: Workspace | None = None
        self.tool_calls: list[tuple[str, dict[str, Any]]] = []
        self.open_file: str | None = None
        """The file ``view_file`` and ``replace`` use when no ``path`` is given: the last file
        viewed, at first the task's first editable file (as an editor's open file, SWE-agent
        style; a small policy then never has to type a file name)."""
        self._turn = 0
        self._started = 0.0
        self._done = True
        self._last_verify: VerifyResult | None = None

    # -- episode --------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an attempt. ``options`` may pick the task: ``{"task_id": ...}`` or
        ``{"task_index": ...}``; otherwise it is drawn with the env's seeded generator."""
        super().reset(seed=seed)
        options = options or {}
        if "task_id" in options:
            if options["task_id"] not in self._by_id:
                raise ValueError(f"options.task_id: unknown task {options['task_id']!r}")
            index = self._by_id[options["task_id"]]
        elif "task_index" in options:
            index = int(options["task_index"])
            if not 0 <= index < len(self.tasks):
                raise ValueError(f"options.task_index must be in [0, {len(self.tasks)})")
        else:
            index = int(self.np_random.integers(len(self.tasks)))
        self._cleanup()
        task = self.tasks[index]
        _sweep_orphaned_workspaces()
        root = Path(tempfile.mkdtemp(prefix=f"{WORKSPACE_PREFIX}{os.getpid()}-"))
        # An env dropped without close() (or a process ending normally) still removes it; a
        # process killed outright leaves it, and the next process sweeps it.
        self._remove_workspace = weakref.finalize(self, shutil.rmtree, root, ignore_errors=True)
        write_files(root, task.files)
        self.task, self.workspace = task, Workspace(root)
        self.open_file = self._first_editable()
        self.tool_calls = []
        if self.faults is not None:
            self.faults.new_attempt()
        self._last_verify = None
        self._edits: list[tuple[str, str | None, int | None]] = []
        """Undo history: (path, its text before the edit or None if the edit created it, the
        line a line-scoped replace named)."""
        self._turn, self._started, self._done = 0, time.monotonic(), False
        observation = self._statement()
        info = {"task_id": task.id, "family": task.family, "turn": 0,
                "max_turns": self._max_turns()}
        return to_charset(observation, self.observation_chars), info

    def open_file_text(self) -> str | None:
        """The text of the open file (what ``replace`` without ``path`` edits), or None when
        there is none; read by decoding rules that keep an edit's ``old`` in the file."""
        if self.workspace is None or self.open_file is None or self._done:
            return None
        try:
            return self.workspace.read(self.open_file)
        except (OSError, ValueError):
            return None

    def _statement(self) -> str:
        """The task statement: the first observation of an attempt, and again after ``restart``."""
        assert self.task is not None
        return task_statement(self.task)

    def _first_editable(self) -> str | None:
        """The file an attempt opens with: the first editable file the instruction names
        (in the order it names them), else the task's first file that is not protected."""
        assert self.task is not None
        editable = [p for p in sorted(self.task.files) if not self.task.is_protected(p)]
        named = [(self.task.instruction.find(p), p) for p in editable
                 if re.search(r"(?<![\w./-])" + re.escape(p) + r"(?![\w-])",
                              self.task.instruction)]
        if named:
            return min(named)[1]
        return editable[0] if editable else None

    def _known_path(self, path: Any) -> Any:
        """``path`` itself when it is a file of the workspace (or not a string); else the one
        workspace file it names without its directory or without ``.py``, when exactly one
        matches (``temp`` or ``temp.py`` for ``src/temp.py``): a policy that met other task
        sets may name a file as those did."""
        assert self.workspace is not None
        if not isinstance(path, str) or not path:
            return path
        try:
            if self.workspace.exists(path):
                return path
        except PathError:
            return path
        name = path.rsplit("/", 1)[-1]
        matches = [p for p in self.workspace.list_files()
                   if p.rsplit("/", 1)[-1] in (name, name + ".py")]
        return matches[0] if len(matches) == 1 else path

    def step(self, action: str) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        """Run the first tool call in ``action``; see the module docstring."""
        if self._done or self.task is None or self.workspace is None:
            raise RuntimeError("step() called without an active attempt; call reset() first")
        if not isinstance(action, str):
            raise ValueError(f"action must be a string, got {type(action).__name__}")
        self._turn += 1
        info: dict[str, Any] = {"task_id": self.task.id, "turn": self._turn, "tool": None,
                                "tool_seconds": 0.0, "tool_error": False, "fault": None,
                                "agent_error": False}
        parsed = parse_tool_call(action)
        if parsed.raw_name is not None:
            recorded = dict(parsed.raw_arguments or {})
            if parsed.raw_name in ("view_file", "replace") and "path" not in recorded:
                recorded["path"] = self.open_file  # the audit sees which file was meant
            self.tool_calls.append((parsed.raw_name, recorded))
        terminated = truncated = False
        reward = 0.0
        if parsed.call is None:
            observation = parsed.error or "error: no tool call"
            info["agent_error"] = True
        elif parsed.call.name == "submit":
            info["tool"] = "submit"
            observation, terminated = "submitted", True
        else:
            info["tool"] = parsed.call.name
            observation = self._run_tool(parsed.call.name, dict(parsed.call.arguments), info)
            if (parsed.call.name == "restart" and not info["tool_error"]
                    and info["fault"] not in SKIPS_TOOL):
                info["fresh_context"] = True
        if terminated:
            self._done = True
            try:
                verdict = self.verify()
                audit = self.audit(verdict)
            except Exception as error:  # the verifier's sandbox failed: not the agent's doing
                info["tool_error"], info["verify_error"] = True, f"{type(error).__name__}: {error}"
            else:
                reward = verdict.reward
                info["verify"], info["audit"] = verdict, audit
        elif self._turn >= self._max_turns():
            truncated, info["truncated_reason"] = True, "max_turns"
        elif self._max_seconds() is not None and (
                time.monotonic() - self._started > (self._max_seconds() or 0.0)):
            truncated, info["truncated_reason"] = True, "max_seconds"
        if truncated:
            self._done = True
        return to_charset(observation, self.observation_chars), reward, terminated, truncated, info

    def _run_tool(self, name: str, arguments: dict[str, Any], info: dict[str, Any]) -> str:
        assert self.workspace is not None and self.task is not None
        start = time.monotonic()
        try:
            fault: FaultKind | None = None
            if self.faults is not None:
                fault = self.faults.before_tool(name)
                info["fault"] = fault
            if fault in SKIPS_TOOL:
                assert fault is not None
                return skipped_observation(fault, name)
            observation = self._dispatch(name, arguments)
            return observation if fault is None else after_tool(fault, observation)
        except PathError as error:
            info["agent_error"] = True
            return f"error: {name}: {error}"
        except Exception as error:
            # Anything else is the infrastructure failing: the tool, the sandbox, the disk.
            info["tool_error"] = True
            info["fault"] = getattr(error, "fault", info["fault"])
            return f"tool error: {type(error).__name__}"
        finally:
            info["tool_seconds"] = time.monotonic() - start

    def _dispatch(self, name: str, arguments: dict[str, Any]) -> str:
        assert self.workspace is not None and self.task is not None
        workspace = self.workspace
        if name == "list_files":
            return list_files_tool(workspace)
        if name in ("view_file", "replace"):
            path = self._known_path(arguments.get("path", self.open_file))
            if path is None:
                raise PathError("no open file; give path")
            if name == "view_file":
                shown = view_file_tool(workspace, path)
                self.open_file = path
                return shown
            previous: str | None = workspace.read(path)  # replace needs the file to exist
            result = replace_tool(workspace, path, arguments.get("old"), arguments["new"],
                                  arguments.get("line"), check_syntax=self.check_syntax)
            if result == "OK":
                self._edits.append((path, previous, line_number(arguments.get("line"))))
            return result
        if name == "write_file":
            path = arguments["path"]
            previous = workspace.read(path) if workspace.exists(path) else None
            result = write_file_tool(workspace, path, arguments["content"],
                                     check_syntax=self.check_syntax)
            if result == "OK":
                self._edits.append((path, previous, None))
            return result
        if name == "undo":
            return self._undo()
        if name == "restart":
            return self._restart()
        if name == "run_tests":
            return failure_excerpt(self.task.sandbox(self.sandbox).run(workspace.root,
                                                                      self.task.test_command))
        raise ValueError(f"no such tool {name!r}")  # parse_tool_call lets none through

    def _undo(self) -> str:
        """Restore the file the last edit changed; a line-scoped replace shows its line again."""
        assert self.workspace is not None
        if not self._edits:
            return "error: undo: nothing to undo"
        path, previous, line = self._edits.pop()
        if previous is None:
            self.workspace.remove(path)
            return f"OK: {path} removed"
        self.workspace.write(path, previous)
        lines = previous.splitlines()
        if line is not None and line <= len(lines):
            return f"OK\n{line}: {lines[line - 1][:MAX_LINE_CHARS]}"
        return "OK"

    def _restart(self) -> str:
        """Every edit undone at once (files the attempt created removed, the others written
        back as the task gave them), the open file as at the start, the statement again."""
        assert self.workspace is not None and self.task is not None
        for path in sorted({path for path, _, _ in self._edits}):
            if path in self.task.files:
                self.workspace.write(path, self.task.files[path])
            elif self.workspace.exists(path):
                self.workspace.remove(path)
        self._edits = []
        self.open_file = self._first_editable()
        return self._statement()

    # -- scoring --------------------------------------------------------------------------

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas (OpenAI function format), for ``apply_chat_template(tools=...)``."""
        return [dict(schema) for schema in TOOL_SCHEMAS]

    def verify(self) -> VerifyResult:
        """Score the current files with the hidden tests (protected files restored)."""
        if self.task is None or self.workspace is None:
            raise RuntimeError("verify() needs an attempt; call reset() first")
        self._last_verify = verify_files(self.task, self._final_files(), self.sandbox)
        return self._last_verify

    def audit(self, verify: VerifyResult | None = None) -> AuditResult:
        """Audit the current files and the tool calls made so far; ``verify`` (this attempt's
        score, by default the last ``verify()`` of this attempt) adds whether its hidden tests
        exited 0 without evidence."""
        if self.task is None or self.workspace is None:
            raise RuntimeError("audit() needs an attempt; call reset() first")
        return audit_attempt(self.task, self._final_files(), self.tool_calls,
                             workspace_paths=workspace_paths(self.workspace.root),
                             verify=verify if verify is not None else self._last_verify)

    def _final_files(self) -> dict[str, str]:
        """The workspace's regular files; one that cannot be read (the attempt's code made it
        unreadable) is left out: what the attempt did to its files is its own failure."""
        assert self.workspace is not None
        files: dict[str, str] = {}
        for path in self.workspace.list_files():
            try:
                with open(self.workspace.root / path, "rb") as handle:
                    files[path] = handle.read(1 << 20).decode("utf-8", errors="replace")
            except OSError:
                continue
        return files

    def _max_turns(self) -> int:
        budget = self.task.budget if self.task is not None else None
        return budget.max_turns if budget is not None and budget.max_turns else self.max_turns

    def _max_seconds(self) -> float | None:
        budget = self.task.budget if self.task is not None else None
        if budget is not None and budget.max_seconds is not None:
            return budget.max_seconds
        return self.max_seconds

    def _cleanup(self) -> None:
        if self.workspace is not None:
            self._remove_workspace()  # runs once; also at garbage collection or exit
            self.workspace = None

    def close(self) -> None:
        """Delete the current attempt's workspace."""
        self._cleanup()
        self._done = True
        super().close()


WORKSPACE_PREFIX = "tracerl-attempt-"
"""Attempt workspaces are ``<tmp>/tracerl-attempt-<pid>-<random>``: the pid says whose."""
ORPHAN_AGE_SECONDS = 3600.0
"""A workspace of a process that is gone is swept once untouched this long (a pid may name a
live process of another pid namespace sharing the directory, whose attempts are younger)."""
_swept = False


def _sweep_orphaned_workspaces(directory: str | None = None, *, force: bool = False) -> int:
    """Remove the attempt workspaces that killed processes left behind (once per process, or
    again with ``force``): those whose pid is not running and that have been untouched for
    ``ORPHAN_AGE_SECONDS``. Returns how many were removed."""
    global _swept
    if _swept and not force:
        return 0
    _swept = True
    removed, now = 0, time.time()
    pattern = re.compile(re.escape(WORKSPACE_PREFIX) + r"(\d+)-")
    for path in Path(directory or tempfile.gettempdir()).glob(f"{WORKSPACE_PREFIX}*-*"):
        match = pattern.match(path.name)
        if match is None or _pid_running(int(match.group(1))):
            continue
        try:
            if now - path.stat().st_mtime < ORPHAN_AGE_SECONDS:
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += not path.exists()
    return removed


def _pid_running(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
