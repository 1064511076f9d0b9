"""What a hidden-test verdict requires: evidence that every check ran, not an exit status.

A hidden test command's exit status says nothing about whether its checks ran: code under
test that ends the process early with status 0 (``os._exit(0)``, ``SystemExit(0)`` raised past
an ``except Exception``) would pass a plain script. So the verifier asks for evidence:

1. The hidden tests report each check as one JSON line on a pipe whose descriptor is in
   ``TRACERL_REPORT_FD`` (``tracerl_report``, written next to them, does it for plain
   scripts, ``unittest`` and pytest), then an end record after the last check.
2. A harness, started by the verifier in the sandbox, reads a per-run secret nonce from a
   file it deletes before any code under test runs, makes itself unreadable to other
   processes (not dumpable), runs the hidden test command with the pipe, and only after that
   command has exited writes the nonce, the exit status and the records to a result file.
3. The host judges the result (``judge``): the nonce must match, the command must exit 0,
   the end record must be there, every declared check (``Task.hidden_checks`` and
   ``Task.hidden_values``) must be reported exactly once, and each must pass. A value check
   is compared on the host with the expected value, which never enters the sandbox, so no
   code in the sandbox can make it pass without computing the right value.

The hidden files that a command names get a random name per run (the command is rewritten to
match), and every file the verifier writes replaces whatever the attempt left at that path
(a file, a directory, a link): the attempt's files can neither predict nor block them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tracerl.envs.sandbox import Sandbox, SandboxResult

REPORT_FD_ENV = "TRACERL_REPORT_FD"
"""Environment variable holding the descriptor the hidden tests report their checks on."""
REPORT_MODULE = "tracerl_report"
"""Module the verifier writes at the workspace root for hidden tests to report with."""
MAX_RECORDS = 10_000
"""Most check records a harness keeps; more make the verdict a fail."""

REPORT_SOURCE = '''"""Report hidden-test checks to the verifier (see the task format's documentation).

Plain scripts: ``check(name, fn)`` (passes when fn() returns None or True without raising),
``value(name, fn)`` (reports repr(fn()), compared by the verifier with the task's expected
value), then ``end()`` after the last check. unittest: ``run_unittest(module_or_case, ...)``.
pytest: ``python -m pytest -p tracerl_report ...``.
"""

import json as _json
import os as _os

_FD = int(_os.environ.get("TRACERL_REPORT_FD", "-1"))
_write = _os.write


def _report(record):
    if _FD < 0:
        raise RuntimeError("TRACERL_REPORT_FD is not set: run under the verifier's harness")
    _write(_FD, (_json.dumps(record) + "\\n").encode())


def check(name, fn):
    try:
        result = fn()
    except Exception as error:
        _report({"check": name, "ok": False, "error": type(error).__name__})
        return
    _report({"check": name, "ok": result is None or result is True})


def value(name, fn):
    try:
        got = repr(fn())
    except Exception as error:
        got = "raised " + type(error).__name__
    _report({"check": name, "value": got})


def end():
    _report({"end": True})


def run_unittest(*targets):
    import unittest

    loader = unittest.TestLoader()
    suite = unittest.TestSuite()
    for target in targets:
        if isinstance(target, type):
            suite.addTests(loader.loadTestsFromTestCase(target))
        else:
            suite.addTests(loader.loadTestsFromModule(target))
    seen = {}

    class _Result(unittest.TestResult):
        def addSuccess(self, test):
            seen.setdefault(test.id(), True)

        def addFailure(self, test, err):
            seen[test.id()] = False

        def addError(self, test, err):
            seen[test.id()] = False

        def addSkip(self, test, reason):
            seen[test.id()] = False

        def addExpectedFailure(self, test, err):
            seen[test.id()] = False

        def addUnexpectedSuccess(self, test):
            seen[test.id()] = False

    suite.run(_Result())
    for name, ok in seen.items():
        _report({"check": name, "ok": ok})
    end()


_pytest_seen = {}


def pytest_runtest_logreport(report):
    if report.when == "call" or not report.passed:
        previous = _pytest_seen.get(report.nodeid, True)
        _pytest_seen[report.nodeid] = previous and report.passed


def pytest_sessionfinish(session, exitstatus):
    for name, ok in _pytest_seen.items():
        _report({"check": name, "ok": ok})
    end()
'''
"""Source of ``tracerl_report``; pytest loads it as a plugin with ``-p tracerl_report``."""

EARLY_EXIT_PATTERNS: dict[str, re.Pattern[str]] = {
    "os._exit": re.compile(r"\b_exit\s*\("),
    "SystemExit": re.compile(r"\bSystemExit\b"),
    "exit()": re.compile(r"\b(?:exit|quit)\s*\("),
    "kill or abort": re.compile(r"\b(?:kill|killpg|abort)\s*\(|\bSIGKILL\b"),
    "atexit": re.compile(r"\batexit\b"),
}
"""Code that can end the test process before its checks have run (``exit(`` also matches
``sys.exit(``)."""
HARNESS_PATTERNS: dict[str, re.Pattern[str]] = {
    "builtins": re.compile(r"\b__builtins__\b|\bbuiltins\b"),
    "unittest": re.compile(r"\b(?:unittest|Test(?:Result|Case|Loader|Suite|Program)|"
                           r"TextTestRunner|TextTestResult)(?:\.\w+)+\s*=(?!=)"
                           r"|setattr\(\s*unittest\b"),
    "pytest hooks": re.compile(r"\bpytest_\w+|\bconftest\b|\b_pytest\b"),
    "sys.modules": re.compile(r"\bsys\s*\.\s*modules\b"),
    "report channel": re.compile(r"TRACERL_REPORT_FD|\btracerl_report\b"),
    "introspection": re.compile(r"\b_getframe\b|\bget_objects\b|\bget_referrers\b"
                                r"|\bf_back\b|\bf_globals\b|/proc/"),
}
"""Code that can change how the test machinery judges (assert helpers, unittest results,
pytest hooks, the verifier's report channel) or read the test's own state."""


def added_pattern_names(before: str, after: str,
                        patterns: Mapping[str, re.Pattern[str]]) -> list[str]:
    """Names of the patterns found more often in ``after`` than in ``before``."""
    return [name for name, pattern in patterns.items()
            if len(pattern.findall(after)) > len(pattern.findall(before))]


_HARNESS_SOURCE = '''import ctypes, json, os, subprocess, sys, threading
secret_path, result_path = sys.argv[1], sys.argv[2]
os.unlink(sys.argv[0])
with open(secret_path) as handle:
    secret = json.load(handle)
os.unlink(secret_path)
try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
    pass
read_fd, write_fd = os.pipe()
env = dict(os.environ)
env["TRACERL_REPORT_FD"] = str(write_fd)
env["PYTHONPATH"] = os.getcwd() + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
records, state = [], {"overflow": False}
def collect():
    with os.fdopen(read_fd, "rb") as stream:
        while True:
            line = stream.readline(65536)
            if not line:
                return
            if len(records) >= LIMIT or not line.endswith(b"\\n"):
                state["overflow"] = True
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                records.append({"malformed": line[:200].decode("utf-8", "replace")})
reader = threading.Thread(target=collect, daemon=True)
reader.start()
child = subprocess.Popen(["/bin/sh", "-c", secret["command"]], stdin=subprocess.DEVNULL,
                         pass_fds=(write_fd,), env=env)
os.close(write_fd)
code = child.wait()
reader.join(2.0)
payload = {"nonce": secret["nonce"], "exit": code, "records": list(records),
           "overflow": state["overflow"] or reader.is_alive()}
with open(result_path + ".part", "w") as handle:
    json.dump(payload, handle)
os.replace(result_path + ".part", result_path)
'''.replace("LIMIT", str(MAX_RECORDS))


@dataclass(frozen=True)
class Verdict:
    """The judged outcome of one run of a task's hidden tests."""

    passed: bool
    """True only with evidence that every check ran and passed (see the module docstring)."""
    reason: str
    """Why it failed, one sentence; ``"passed"`` when it passed."""
    exit_code: int | None
    """Exit status of the hidden test command; None when no verdict came back."""
    checks_expected: int
    """How many checks the task declares (0: any non-empty set of checks is accepted)."""
    checks_run: int
    """How many distinct checks reported."""
    checks_passed: int
    """How many of them passed."""
    ended: bool
    """The tests reported their end (after their last check)."""
    early_exit: bool
    """The command exited 0 without the evidence: it ended before its checks did."""
    failures: tuple[str, ...]
    """One line per failed, missing, unknown or malformed check (at most 20)."""
    displaced: tuple[str, ...]
    """The attempt's paths removed or left out because a verifier file needed the place or
    because they could not be copied."""
    result: SandboxResult
    """The sandboxed run (its output is the hidden tests' output)."""
    outcomes: Mapping[str, bool] = field(default_factory=dict)
    """Each distinct check reported: passed or not (what ``checks_run`` counts)."""

    def summary(self) -> str:
        """``PASS`` or ``FAIL: reason`` and the first failures, for logs."""
        if self.passed:
            return f"PASS ({self.checks_passed} checks)"
        return "\n".join([f"FAIL: {self.reason}", *self.failures[:5]])


def declared_checks(checks: Sequence[str], values: Mapping[str, str]) -> set[str]:
    """Every check name a task declares (pass/fail checks and value checks)."""
    return set(checks) | set(values)


def judge(payload: Any, nonce: str, checks: Sequence[str], values: Mapping[str, str], *,
          timed_out: bool, result: SandboxResult,
          displaced: Sequence[str] = ()) -> Verdict:
    """Judge the harness's result file (already parsed; None when it is missing)."""
    declared = declared_checks(checks, values)

    def verdict(passed: bool, reason: str, exit_code: int | None = None, run: int = 0,
                good: int = 0, ended: bool = False, early: bool = False,
                failures: Iterable[str] = (), outcomes: Mapping[str, bool] | None = None
                ) -> Verdict:
        return Verdict(passed, reason, exit_code, len(declared), run, good, ended, early,
                       tuple(failures)[:20], tuple(displaced), result, dict(outcomes or {}))

    if timed_out:
        return verdict(False, "the hidden tests ran out of time")
    if (not isinstance(payload, Mapping) or payload.get("nonce") != nonce
            or not isinstance(payload.get("exit"), int)
            or not isinstance(payload.get("records"), list)):
        return verdict(False, "no verdict came back from the harness (killed or tampered with)")
    exit_code: int = payload["exit"]
    seen: dict[str, bool] = {}
    failures: list[str] = []
    ended = False
    for record in payload["records"]:
        if not isinstance(record, Mapping):
            failures.append(f"malformed record {str(record)[:80]!r}")
            continue
        if record.get("end") is True and len(record) == 1:
            ended = True
            continue
        name = record.get("check")
        if not isinstance(name, str) or ended:
            failures.append(f"malformed or late record {json.dumps(record)[:80]}")
            continue
        if name in seen:
            failures.append(f"{name}: reported twice")
            seen[name] = False
            continue
        if name in values:
            got = record.get("value")
            ok = isinstance(got, str) and got == values[name]
            if not ok:
                failures.append(f"{name}: got {str(got)[:80]}, want {values[name][:80]}")
        elif declared and name not in declared:
            ok = False
            failures.append(f"{name}: not a check of this task")
        else:
            ok = record.get("ok") is True and "value" not in record
            if not ok:
                failures.append(f"{name}: failed" + (f" ({record['error']})"
                                                    if isinstance(record.get("error"), str)
                                                    else ""))
        seen[name] = ok
    missing = sorted(declared - set(seen))
    failures += [f"{name}: never ran" for name in missing]
    run, good = len(seen), sum(seen.values())
    if payload.get("overflow") is True:
        failures.append("the tests reported too much or left the report pipe open")
    complete = ended and not missing and run > 0
    early = exit_code == 0 and not complete
    if exit_code != 0:
        reason = f"the hidden test command exited {exit_code}"
    elif not ended:
        reason = "the tests ended before reporting their end (an early exit)"
    elif run == 0:
        reason = "no check ran"
    elif missing:
        reason = f"{len(missing)} of {len(declared)} checks never ran"
    elif failures:
        reason = f"{len(failures)} checks failed"
    else:
        return verdict(True, "passed", exit_code, run, good, ended, outcomes=seen)
    return verdict(False, reason, exit_code, run, good, ended, early, failures, seen)


# -- writing the verification workspace ------------------------------------------------------

def _clear_way(root: Path, relative: str) -> list[str]:
    """Remove whatever blocks writing a file at ``relative``: a non-directory where a parent
    directory must be, anything but a plain file at the path. Returns what went."""
    removed: list[str] = []
    parts = PurePosixPath(relative).parts
    for depth in range(1, len(parts)):
        current = root.joinpath(*parts[:depth])
        if current.is_symlink() or (current.exists() and not current.is_dir()):
            current.unlink()
            removed.append("/".join(parts[:depth]))
    target = root / relative
    if target.is_symlink():
        target.unlink()
        removed.append(relative)
    elif target.is_dir():
        shutil.rmtree(target)
        removed.append(relative)
    return removed


def _valid(path: str) -> bool:
    pure = PurePosixPath(path)
    return (bool(path) and "\x00" not in path and "\\" not in path and not pure.is_absolute()
            and ".." not in pure.parts and str(pure) == path)


def write_attempt_files(root: Path, files: Mapping[str, str]) -> list[str]:
    """Write an attempt's files; returns the paths that could not be written (left out)."""
    left_out: list[str] = []
    for path, content in files.items():
        if not _valid(path):
            left_out.append(path)
            continue
        try:
            _clear_way(root, path)
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8", errors="replace")
        except (OSError, ValueError):
            left_out.append(path)
    return left_out


def write_verifier_files(root: Path, files: Mapping[str, str]) -> list[str]:
    """Write the verifier's own files over anything in their way; returns what was removed."""
    removed: list[str] = []
    for path, content in files.items():
        removed += _clear_way(root, path)
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
    return removed


def randomized_entries(hidden_files: Mapping[str, str], command: str,
                       token: str) -> tuple[dict[str, str], str]:
    """The hidden files with every one the command names renamed ``<stem>_<token><suffix>``
    (same directory), and the command rewritten to match."""
    renamed: dict[str, str] = {}
    for path, content in hidden_files.items():
        pattern = re.compile(r"(?<![\w./-])" + re.escape(path) + r"(?![\w.-])")
        if pattern.search(command) is None:
            renamed[path] = content
            continue
        pure = PurePosixPath(path)
        new = str(pure.with_name(f"{pure.stem}_{token}{pure.suffix}"))
        command = pattern.sub(new, command)
        renamed[new] = content
    return renamed, command


def run_verdict(sandbox: Sandbox, attempt_files: Mapping[str, str],
                hidden_files: Mapping[str, str], command: str, *,
                checks: Sequence[str] = (), values: Mapping[str, str] | None = None) -> Verdict:
    """Run ``command`` on ``attempt_files`` plus ``hidden_files`` under the harness; judge it.

    ``attempt_files`` are the files under test (protected ones already restored); what they
    do to the verification is their own doing and ends as a failed verdict. Raises
    ``SandboxStartError`` only when the sandbox itself cannot start.
    """
    values = dict(values or {})
    token = secrets.token_hex(6)
    nonce = secrets.token_hex(16)
    hidden, command = randomized_entries(hidden_files, command, token)
    harness, secret, result_name = (f".verify_{token}.py", f".secret_{token}",
                                    f".verdict_{token}.json")
    with tempfile.TemporaryDirectory(prefix="tracerl-verify-") as tmp:
        root = Path(tmp)
        left_out = write_attempt_files(root, attempt_files)
        removed = write_verifier_files(root, {
            **hidden, f"{REPORT_MODULE}.py": REPORT_SOURCE, harness: _HARNESS_SOURCE,
            secret: json.dumps({"nonce": nonce, "command": command}),
        })
        result = sandbox.run(root, f"python {harness} {secret} {result_name}")
        payload: Any = None
        target = root / result_name
        if target.is_file() and not target.is_symlink() and target.stat().st_size < 64 << 20:
            try:
                payload = json.loads(target.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                payload = None
    return judge(payload, nonce, checks, values, timed_out=result.timed_out, result=result,
                 displaced=sorted(set(left_out) | set(removed)))


def workspace_paths(root: Path) -> set[str]:
    """Every path (files, directories, links, special files) under ``root``, relative."""
    out: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            out.add(os.path.relpath(os.path.join(dirpath, name), root))
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    return out
