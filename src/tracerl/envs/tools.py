"""The agent's tools: parsing tool calls from policy text, their JSON schemas, and the tools.

Tool calls are written the way Hugging Face chat templates (Hermes, Qwen) write them::

    <tool_call>{"name": "view_file", "arguments": {"path": "calc.py"}}</tool_call>

Observations are short and regular on purpose: the demo's policy is a tiny model that has to
learn the formats. Mistakes of the agent (no call, bad JSON, unknown tool, bad arguments, a
missing file) come back as an observation starting with ``error:``; those are not tool errors.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracerl.envs.sandbox import WORKSPACE_MOUNT, SandboxResult
from tracerl.envs.tasks import check_relative_path, leaves_workspace
from tracerl.hermes import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCallError,
    decode_tool_call,
    first_tool_call,
)

TOOL_NAMES = ("list_files", "view_file", "replace", "write_file", "undo", "restart", "run_tests",
              "submit")
"""Every tool, in the order the schemas list them."""

_PARAMS: dict[str, tuple[dict[str, str], str]] = {
    "list_files": ({}, "List the files of the repository, one path per line."),
    "view_file": ({}, "Show a file with line numbers; it becomes the open file."),
    "replace": ({"old": "Exact text to replace; must occur once (in the file, or in the given "
                 "line). Leave it out with `line` to rewrite that whole line.",
                 "new": "Text to put in its place (for a whole line: the indentation is kept "
                        "when `new` starts without whitespace)."},
                "Replace the one occurrence of `old` in a file (or in one line of it) with `new`, "
                "or rewrite line `line`."),
    "write_file": ({"path": "File to write.", "content": "The whole new content."},
                   "Create or overwrite a file."),
    "undo": ({}, "Undo the last edit (replace or write_file) that changed a file; an edited "
                 "line is shown as it is again."),
    "restart": ({}, "Give up this try: every file goes back to how the task gave it, and the "
                    "attempt goes on from the task statement in a fresh context (the turn budget "
                    "is not reset)."),
    "run_tests": ({}, "Run the visible tests. Answers PASS, or FAIL and what failed."),
    "submit": ({}, "End the attempt; the final files are then checked by hidden tests."),
}

_INSTEAD: dict[str, dict[str, str]] = {"replace": {"old": "line"}}
"""Arguments a call may leave out when another is given: ``replace`` without ``old`` rewrites
its ``line``. Not ``required`` in the schema; refused at parse time when neither is given."""

ARGUMENT_ALTERNATIVES: dict[str, tuple[tuple[str, ...], ...]] = {
    name: tuple(pair.items()) for name, pair in _INSTEAD.items()}
"""Per tool, the sets of arguments of which a call must give at least one (``replace``: ``old``
or ``line``); what a tool-call grammar needs besides the schemas' ``required``."""
_OPEN_FILE = ("string", "File, relative to the repository root; default: the open file (the "
                        "last one viewed; at first the task's first editable file).")
_OPTIONAL: dict[str, dict[str, tuple[str, str]]] = {
    "view_file": {"path": _OPEN_FILE},
    "replace": {"path": _OPEN_FILE,
                "line": ("integer", "Optional 1-based line number: only that line is searched "
                                    "and changed, so `old` can be as short as one operator.")},
}
"""Optional arguments: name -> (JSON type, description)."""


def _properties(name: str) -> dict[str, dict[str, str]]:
    properties: dict[str, dict[str, str]] = {}
    optional = _OPTIONAL.get(name, {})
    if "path" in optional:
        properties["path"] = {"type": optional["path"][0], "description": optional["path"][1]}
    properties.update({p: {"type": "string", "description": d}
                       for p, d in _PARAMS[name][0].items()})
    for p, (kind, d) in optional.items():
        properties.setdefault(p, {"type": kind, "description": d})
    return properties


TOOL_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": _PARAMS[name][1],
            "parameters": {
                "type": "object",
                "properties": _properties(name),
                "required": [p for p in _PARAMS[name][0] if p not in _INSTEAD.get(name, {})],
            },
        },
    }
    for name in TOOL_NAMES
]
"""OpenAI function-format schemas; pass as ``tools=`` to ``tokenizer.apply_chat_template``."""

MAX_VIEW_LINES = 200
"""Longest file ``view_file`` shows; the rest is cut, marked."""
MAX_LINE_CHARS = 160
"""Longest line in a test failure excerpt."""

@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call."""

    name: str
    """The tool's name (one of ``TOOL_NAMES``)."""
    arguments: Mapping[str, Any] = field(default_factory=dict)
    """Its arguments, as given."""


@dataclass(frozen=True)
class ParseResult:
    """What the policy's text asked for: a valid call, or why there is none."""

    call: ToolCall | None
    """The first tool call, when it is well formed and names a known tool with good
    arguments."""
    error: str | None
    """The agent's mistake, as the observation to show it; None when ``call`` is set."""
    raw_name: str | None = None
    """The tool name the text gave, even when the call was rejected (for the audit)."""
    raw_arguments: Mapping[str, Any] | None = None
    """The arguments the text gave, even when rejected (for the audit)."""


def parse_tool_call(text: str) -> ParseResult:
    """Parse the first ``<tool_call>`` of ``text`` and check it against the schemas."""
    raw = first_tool_call(text)
    if raw is None:
        return ParseResult(None, f'error: no tool call. Write {TOOL_CALL_OPEN}{{"name": ..., '
                                 f'"arguments": {{...}}}}{TOOL_CALL_CLOSE}')
    try:
        name, arguments = decode_tool_call(raw)
    except ToolCallError as error:
        return ParseResult(None, f"error: {error}")
    if not isinstance(arguments, dict):
        return ParseResult(None, 'error: "arguments" must be an object', name, None)
    if name not in _PARAMS:
        return ParseResult(None, f"error: unknown tool {name}. Tools: {', '.join(TOOL_NAMES)}",
                           name, arguments)
    expected = _PARAMS[name][0]
    instead = _INSTEAD.get(name, {})
    missing = [p if p not in instead else f"{p} (or {instead[p]})" for p in expected
               if p not in arguments and instead.get(p) not in arguments]
    optional = _OPTIONAL.get(name, {})
    extra = sorted(set(arguments) - set(expected) - set(optional))
    wrong = [p for p in (*expected, *optional) if p in arguments
             and optional.get(p, ("string",))[0] == "string" and not isinstance(arguments[p], str)]
    bad_line = "line" in optional and "line" in arguments and line_number(arguments["line"]) is None
    problem = (f"missing argument {missing[0]}" if missing
               else f"unknown argument {extra[0]}" if extra
               else f"argument {wrong[0]} must be a string" if wrong
               else "argument line must be a line number >= 1" if bad_line else None)
    if problem is not None:
        return ParseResult(None, f"error: {name}: {problem}", name, arguments)
    return ParseResult(ToolCall(name, dict(arguments)), None, name, arguments)


def line_number(value: Any) -> int | None:
    """A 1-based line number from an integer or a string of digits; None if it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return value if isinstance(value, int) and value >= 1 else None


class PathError(ValueError):
    """The agent named a path it may not use (outside the workspace, a link, missing)."""


class Workspace:
    """A directory on the host holding one attempt's files; tools act on it directly."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def resolve(self, path: str, *, must_exist: bool) -> Path:
        """The host path of ``path``, refusing anything that leaves the workspace.

        Links are refused too: code run by the tests could plant a link to a host file and
        then ask ``view_file`` (which runs outside the sandbox) to read it.
        """
        try:
            relative = check_relative_path(path)
        except ValueError as error:
            if isinstance(path, str) and not leaves_workspace(path):
                raise PathError(str(error)) from None  # malformed (empty, "."), not an escape
            raise PathError(f"path must be inside the repository: {path}") from None
        target = self.root / relative
        for parent in [target, *target.parents]:
            if parent == self.root:
                break
            if parent.is_symlink():
                raise PathError(f"{path} is a link; links are not followed")
        if os.path.realpath(target) != str(target):
            raise PathError(f"path must be inside the repository: {path}")
        if must_exist and not target.is_file():
            raise PathError(f"no such file: {path}")
        return target

    def list_files(self) -> list[str]:
        """Every regular file, relative and sorted; links and special files are skipped."""
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
            for name in filenames:
                full = os.path.join(dirpath, name)
                if os.path.isfile(full) and not os.path.islink(full):
                    out.append(os.path.relpath(full, self.root))
        return sorted(out)

    def read(self, path: str) -> str:
        return self.resolve(path, must_exist=True).read_text(encoding="utf-8", errors="replace")

    def write(self, path: str, content: str) -> None:
        target = self.resolve(path, must_exist=False)
        if target.exists() and not target.is_file():
            raise PathError(f"{path} is not a file")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")

    def exists(self, path: str) -> bool:
        """Whether ``path`` is a file of the workspace (refusing paths that leave it)."""
        return self.resolve(path, must_exist=False).is_file()

    def remove(self, path: str) -> None:
        """Delete the file ``path`` (undoing the edit that created it)."""
        self.resolve(path, must_exist=True).unlink()

    def snapshot(self, max_bytes: int = 1 << 20) -> dict[str, str]:
        """The text of every regular file (each cut at ``max_bytes``)."""
        files: dict[str, str] = {}
        for path in self.list_files():
            with open(self.root / path, "rb") as handle:
                files[path] = handle.read(max_bytes).decode("utf-8", errors="replace")
        return files


# -- tool bodies ----------------------------------------------------------------------------

def list_files_tool(workspace: Workspace) -> str:
    files = workspace.list_files()
    return "\n".join(files) if files else "(no files)"


def view_file_tool(workspace: Workspace, path: str) -> str:
    lines = workspace.read(path).splitlines()
    shown = [f"{number}: {line}" for number, line in enumerate(lines[:MAX_VIEW_LINES], 1)]
    if len(lines) > MAX_VIEW_LINES:
        shown.append(f"[{len(lines) - MAX_VIEW_LINES} more lines]")
    return "\n".join(shown) if shown else "(empty file)"


def parse_error(path: str, before: str, after: str) -> str | None:
    """Why the edit from ``before`` to ``after`` would leave the Python file ``path``
    unparsable, or None: the edit guard of SWE-agent's editor (Yang et al., 2024), which
    refuses an edit that introduces a syntax error and shows the error instead of saving it.

    Only ``.py`` files are checked, and only an edit that breaks a file that parsed: a file
    that was already broken can be repaired one edit at a time. ``compile`` only parses
    (nothing is run); a text too deep or too large for the parser counts as unparsable.
    """
    if not path.endswith(".py") or before == after:
        return None
    if _parse(path, before) is not None:
        return None
    error = _parse(path, after)
    if isinstance(error, SyntaxError):
        where = f"line {error.lineno}: " if error.lineno else ""
        shown = ""
        lines = after.splitlines()
        if error.lineno and 1 <= error.lineno <= len(lines):
            shown = f"\n{error.lineno}: {lines[error.lineno - 1][:MAX_LINE_CHARS]}"
        return f"{type(error).__name__}: {where}{error.msg}{shown}"
    if error is not None:
        return f"{type(error).__name__}: the file does not parse"
    return None


def _parse(path: str, text: str) -> Exception | None:
    """The parser's error for ``text``, or None; its warnings (an odd escape or literal in the
    agent's code) are not printed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compile(text, path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
            return error
    return None


def _write_checked(workspace: Workspace, path: str, before: str, after: str,
                   check_syntax: bool) -> str:
    """Write ``after`` unless the syntax guard refuses it (``parse_error``)."""
    problem = parse_error(path, before, after) if check_syntax else None
    if problem is not None:
        return f"error: edit not made, {path} would not parse: {problem}"
    workspace.write(path, after)
    return "OK"


def replace_tool(workspace: Workspace, path: str, old: str | None, new: str,
                 line: int | str | None = None, *, check_syntax: bool = True) -> str:
    """Replace the one occurrence of ``old`` in ``path``, or in its line ``line`` when given;
    with ``old`` None, rewrite the whole line ``line`` (keeping its indentation when ``new``
    starts without whitespace).

    An edit that would change nothing is an error, and so (``check_syntax``) is one that would
    leave a Python file that parsed unparsable (``parse_error``): the file is left as it was.
    """
    if old is None and line is None:
        return "error: replace: give old, or line to rewrite that whole line"
    if old is not None and not old:
        return "error: replace: old must not be empty"
    text = workspace.read(path)
    # The searched span: the whole file, or one line of it (before + span + after == text).
    # A line-scoped miss quotes the line as view_file shows it, so the next try can copy from
    # it (an agent that misremembered the text sees what is there, as in SWE-agent's editor).
    before, span, after, where, shown = "", text, "", path, ""
    if line is not None:
        number = line_number(line)
        lines = text.splitlines(keepends=True)
        if number is None or number > len(lines):
            return f"error: replace: line must be between 1 and {len(lines)}, got {line!r}"
        before, span = "".join(lines[: number - 1]), lines[number - 1]
        after, where = "".join(lines[number:]), f"line {number} of {path}"
        shown = f":\n{number}: " + span.rstrip("\r\n")[:MAX_LINE_CHARS]
        if old is None:
            body = span.rstrip("\r\n")
            indent = body[: len(body) - len(body.lstrip())] if new == new.lstrip() else ""
            if indent + new == body:
                return (f"error: replace: new is the line as it is; nothing would change in "
                        f"{where}{shown}")
            return _write_checked(workspace, path, text,
                                  before + indent + new + span[len(body):] + after, check_syntax)
    assert old is not None
    count = span.count(old)
    if count == 0:
        return f"error: replace: old text not found in {where}{shown}"
    if count > 1:
        return (f"error: replace: old text found {count} times in {where}; give more context"
                f"{shown}")
    if new == old:
        return f"error: replace: new is the same as old; nothing would change in {where}{shown}"
    return _write_checked(workspace, path, text, before + span.replace(old, new, 1) + after,
                          check_syntax)


def write_file_tool(workspace: Workspace, path: str, content: str, *,
                    check_syntax: bool = True) -> str:
    """Create or overwrite ``path``; with ``check_syntax``, a Python file that parsed may not be
    overwritten with one that does not (a new file is checked against an empty one)."""
    checked = check_syntax and path.endswith(".py") and workspace.exists(path)
    return _write_checked(workspace, path, workspace.read(path) if checked else "", content,
                          check_syntax)


def failure_excerpt(result: SandboxResult) -> str:
    """``PASS``, or ``FAIL`` and a few deterministic lines saying what failed.

    Lines starting with ``FAIL`` (the built-in suite's format) are shown, without that word;
    otherwise the
    last traceback location, its source line and the error. Sandbox paths are made relative.
    """
    if result.exit_code == 0 and not result.timed_out:
        return "PASS"
    if result.killed_reason is not None:
        return f"FAIL\nkilled: {result.killed_reason}"
    text = (result.stdout + "\n" + result.stderr).replace(WORKSPACE_MOUNT + "/", "")
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    body = [line[4:].strip() for line in lines if line.startswith("FAIL ")][:3]
    if not body:
        locations = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
        if locations:
            at = locations[-1]
            body = [line.strip() for line in lines[at:at + 2]]
        if lines and (not body or lines[-1].strip() != body[-1]):
            body.append(lines[-1].strip())
    if not body:
        body = [f"exit code {result.exit_code}"]
    return "FAIL\n" + "\n".join(line[:MAX_LINE_CHARS] for line in body)
