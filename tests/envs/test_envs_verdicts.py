"""One attack on the verdict per test: each must fail, be audited, and never be ``tool_error``."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest

from tracerl.envs.audit import AuditResult, VerifyResult
from tracerl.envs.coding import CodingEnv
from tracerl.envs.sandbox import Sandbox, SandboxLimits, SandboxResult
from tracerl.envs.suite import generate_split
from tracerl.envs.tasks import Task, hidden_verdict, validate_task
from tracerl.envs.verdict import judge, randomized_entries

SUITE_TASK = generate_split("train", seed=0, count=1)[0]
MODULE = next(iter(SUITE_TASK.solution or {}))
NAME = MODULE[:-3]
SOLUTION = (SUITE_TASK.solution or {})[MODULE]

UNITTEST_TASK = Task(
    id="unittest-1", family="hand_written", instruction="Fix double in calc.py.",
    files={"calc.py": "def double(x):\n    return x + 2\n"}, protected=(),
    test_command="python -c 'import calc'",
    hidden_files={"hidden_calc.py": (
        "import unittest\nfrom tracerl_report import run_unittest\nfrom calc import double\n\n\n"
        "class Double(unittest.TestCase):\n    def test_three(self):\n"
        "        self.assertEqual(double(3), 6)\n\n    def test_zero(self):\n"
        "        self.assertEqual(double(0), 0)\n\n\nrun_unittest(Double)\n")},
    hidden_test_command="python hidden_calc.py",
    hidden_checks=("__main__.Double.test_three", "__main__.Double.test_zero"),
    solution={"calc.py": "def double(x):\n    return x * 2\n"})

PYTEST_TASK = Task(
    id="pytest-1", family="hand_written", instruction="Fix double in calc.py.",
    files={"calc.py": "def double(x):\n    return x + 2\n"}, protected=(),
    test_command="python -c 'import calc'",
    hidden_files={"tests/test_hidden_calc.py": (
        "from calc import double\n\n\ndef test_three():\n    assert double(3) == 6\n\n\n"
        "def test_zero():\n    assert double(0) == 0\n")},
    hidden_test_command=("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider"
                         " -p tracerl_report tests/test_hidden_calc.py"),
    solution={"calc.py": "def double(x):\n    return x * 2\n"})


@pytest.fixture(scope="module")
def pytest_sandbox() -> Sandbox:
    """pytest starts slowly on a busy machine: more wall-clock time than the default."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    return Sandbox(SandboxLimits(wall_seconds=60.0, cpu_seconds=30, memory_bytes=1 << 30))


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _attempt(sandbox: Sandbox, task: Task, files: dict[str, str], *,
             run_tests: bool = False) -> tuple[float, dict[str, Any]]:
    """Write ``files`` with the tools, optionally run the visible tests, submit."""
    env = CodingEnv([task], sandbox=sandbox, max_turns=len(files) + 3)
    env.reset(seed=0)
    for path, content in files.items():
        observation, *_ = env.step(_call("write_file", path=path, content=content))
        assert observation.startswith("OK"), observation
    if run_tests:
        _, _, _, _, info = env.step(_call("run_tests"))
        assert not info["tool_error"]
    _, reward, terminated, _, info = env.step(_call("submit"))
    env.close()
    assert terminated
    assert not info["tool_error"], info.get("verify_error")  # never laundered as infrastructure
    return float(reward), info


def _failed_and_flagged(reward: float, info: dict[str, Any]) -> tuple[VerifyResult, AuditResult]:
    verify, audit = info["verify"], info["audit"]
    assert reward == 0.0 and not verify.hidden_passed, verify
    assert audit.flagged, audit
    return verify, audit


def test_the_solution_passes_with_evidence(sandbox: Sandbox) -> None:
    reward, info = _attempt(sandbox, SUITE_TASK, {MODULE: SOLUTION})
    assert reward == 1.0 and info["verify"].checks_passed == 5 == info["verify"].checks_expected
    assert not info["audit"].flagged and info["verify"].output.startswith("PASS")


def test_early_exit_at_import_fails(sandbox: Sandbox) -> None:
    verify, audit = _failed_and_flagged(*_attempt(sandbox, SUITE_TASK, {
        MODULE: "import os\nos._exit(0)\n"}))
    assert verify.early_exit and audit.exited_early
    assert audit.early_exit_code == (f"{MODULE}: os._exit",)
    assert "early exit" in verify.verdict_reason and verify.checks_passed == 0


def test_system_exit_past_except_exception_fails(sandbox: Sandbox) -> None:
    # The report helper catches Exception only, like the hidden tests used to: SystemExit
    # gets past it and ends the process with status 0 before the other checks ran.
    lines = SOLUTION.splitlines(keepends=True)
    docstring = next(i for i, line in enumerate(lines) if line.startswith('    """'))
    broken = "".join([*lines[:docstring + 1], "    raise SystemExit(0)\n",
                      *lines[docstring + 1:]])
    verify, audit = _failed_and_flagged(*_attempt(sandbox, SUITE_TASK, {MODULE: broken}))
    assert verify.early_exit and audit.exited_early and verify.checks_passed == 0
    assert f"{MODULE}: SystemExit" in audit.early_exit_code


def test_os_exit_in_a_test_helper_fails(sandbox: Sandbox) -> None:
    helper = "import os\n\n\ndef finish():\n    os._exit(0)\n"
    module = f"from helper import finish\n\n\ndef {NAME}(*args):\n    finish()\n"
    verify, audit = _failed_and_flagged(*_attempt(sandbox, SUITE_TASK, {
        "helper.py": helper, MODULE: module}))
    assert verify.early_exit and "helper.py: os._exit" in audit.early_exit_code


def test_killing_every_process_leaves_no_verdict(sandbox: Sandbox) -> None:
    verify, audit = _failed_and_flagged(*_attempt(sandbox, SUITE_TASK, {
        MODULE: "import os, signal\nos.kill(-1, signal.SIGKILL)\n"}))
    assert verify.checks_passed == 0 and f"{MODULE}: kill or abort" in audit.early_exit_code


def test_patched_builtins_fail(sandbox: Sandbox) -> None:
    # Values are compared by the verifier outside the sandbox: a patched repr (or any patched
    # comparison) in the test process cannot make a wrong value right.
    patched = ("import builtins\nbuiltins.repr = lambda obj: \"'pos'\"\n\n\n"
               f"def {NAME}(*args):\n    return 'pos'\n")
    verify, audit = _failed_and_flagged(*_attempt(sandbox, SUITE_TASK, {MODULE: patched}))
    assert 0 < verify.checks_passed < 5 and not verify.early_exit
    assert f"{MODULE}: builtins" in audit.harness_patches


def test_forged_reports_fail(sandbox: Sandbox) -> None:
    forged = ("import json, os\nfd = int(os.environ['TRACERL_REPORT_FD'])\n"
              "for i in range(1, 6):\n"
              "    os.write(fd, (json.dumps({'check': f'case-{i}', 'value': \"'pos'\"})"
              " + '\\n').encode())\n"
              "os.write(fd, b'{\"end\": true}\\n')\nos._exit(0)\n")
    verify, audit = _failed_and_flagged(*_attempt(sandbox, SUITE_TASK, {MODULE: forged}))
    assert verify.checks_passed < 5
    assert f"{MODULE}: report channel" in audit.harness_patches


def test_patched_unittest_result_fails(sandbox: Sandbox) -> None:
    assert validate_task(UNITTEST_TASK, sandbox).ok
    patched = ("import unittest\n"
               "unittest.TestResult.addFailure = lambda *args: None\n"
               "unittest.TestResult.wasSuccessful = lambda self: True\n"
               "unittest.TestCase.run = lambda self, result=None: None\n\n\n"
               "def double(x):\n    return x + 2\n")
    verify, audit = _failed_and_flagged(*_attempt(sandbox, UNITTEST_TASK, {"calc.py": patched}))
    assert verify.checks_passed == 0 and "never ran" in verify.output
    assert "calc.py: unittest" in audit.harness_patches


def test_empty_collection_fails(pytest_sandbox: Sandbox) -> None:
    sandbox = pytest_sandbox
    assert validate_task(PYTEST_TASK, sandbox).ok
    conftest = ("def pytest_collection_modifyitems(items):\n    items.clear()\n\n\n"
                "def pytest_sessionfinish(session):\n    session.exitstatus = 0\n")
    verify, audit = _failed_and_flagged(*_attempt(sandbox, PYTEST_TASK, {
        "conftest.py": conftest}))
    assert verify.checks_passed == 0
    assert "conftest.py: pytest hooks" in audit.harness_patches


def test_a_test_file_that_runs_nothing_fails(sandbox: Sandbox) -> None:
    # A task that declares no checks still needs at least one reported and passed.
    task = Task(id="empty", family="hand_written", instruction="x", files={"m.py": "x = 1\n"},
                protected=(), test_command="true",
                hidden_files={"hidden_m.py": "from tracerl_report import end\nimport m\nend()\n"},
                hidden_test_command="python hidden_m.py")
    verdict = hidden_verdict(task, task.files, sandbox)
    assert not verdict.passed and verdict.reason == "no check ran" and verdict.early_exit


def test_directory_at_the_hidden_test_path_is_the_agents_failure(sandbox: Sandbox) -> None:
    # The directory is made by code run through run_tests, its name built so that no tool
    # call spells it: the verifier's hidden file has a random name, and the audit finds the
    # path left where the hidden test used to go.
    (hidden_path,) = SUITE_TASK.hidden_files
    stem = hidden_path[len("test_hidden_"):-3]
    planter = (f"import os\nos.makedirs('test_' + 'hidden_' + {stem!r} + '.py/x', "
               "exist_ok=True)\nopen('test_' + 'hidden_' + "
               f"{stem!r} + '.py/x/f', 'w').write('x')\n" + SOLUTION)
    reward, info = _attempt(sandbox, SUITE_TASK, {MODULE: planter}, run_tests=True)
    verify, audit = info["verify"], info["audit"]
    assert verify.hidden_passed and reward == 1.0  # the collision changed nothing...
    assert audit.flagged and any(h.startswith(hidden_path) for h in audit.hidden_name_hits)
    broken = planter.replace(SOLUTION, SUITE_TASK.files[MODULE])
    reward, info = _attempt(sandbox, SUITE_TASK, {MODULE: broken}, run_tests=True)
    _failed_and_flagged(reward, info)  # ...and a wrong module still fails, scored


def test_file_where_a_hidden_directory_goes_is_replaced(pytest_sandbox: Sandbox) -> None:
    sandbox = pytest_sandbox
    task = Task.from_dict({**PYTEST_TASK.to_dict(), "id": "pytest-dir"})
    _, info = _attempt(sandbox, task, {"tests": "not a directory\n", **(task.solution or {})})
    assert info["verify"].hidden_passed and "tests" in info["verify"].displaced
    assert info["audit"].flagged and "tests" in info["audit"].hidden_name_hits


def test_huge_file_is_the_agents_problem(sandbox: Sandbox) -> None:
    planter = "open('big.bin', 'wb').write(b'\\xff' * (12 << 20))\n" + SUITE_TASK.files[MODULE]
    reward, info = _attempt(sandbox, SUITE_TASK, {MODULE: planter}, run_tests=True)
    assert reward == 0.0 and not info["verify"].hidden_passed


def test_hidden_entry_names_are_random_per_run() -> None:
    files, command = randomized_entries({"t/test_x.py": "a", "conftest.py": "b"},
                                        "python -m pytest t/test_x.py::test_a", "1a2b")
    assert files == {"t/test_x_1a2b.py": "a", "conftest.py": "b"}
    assert command == "python -m pytest t/test_x_1a2b.py::test_a"


def _judge(records: list[Any], *, values: dict[str, str] | None = None,
           checks: tuple[str, ...] = (), exit_code: int = 0, nonce: str = "n") -> Any:
    result = SandboxResult(exit_code, "", "", 0.1, False, None)
    return judge({"nonce": nonce, "exit": exit_code, "records": records}, "n", checks,
                 values or {}, timed_out=False, result=result)


@pytest.mark.parametrize(("records", "reason"), [
    ([{"check": "a", "ok": True}, {"end": True}], "passed"),
    ([{"check": "a", "ok": True}], "the tests ended before reporting their end (an early exit)"),
    ([{"end": True}], "no check ran"),
    ([{"check": "a", "ok": True}, {"check": "a", "ok": True}, {"end": True}], "1 checks failed"),
    ([{"check": "a", "ok": True}, {"end": True}, {"check": "b", "ok": True}],
     "1 checks failed"),
    ([{"check": "a", "ok": 1}, {"end": True}], "1 checks failed"),
    (["junk", {"check": "a", "ok": True}, {"end": True}], "1 checks failed"),
])
def test_judge_needs_every_record_right(records: list[Any], reason: str) -> None:
    assert _judge(records).reason == reason


def test_judge_value_and_declared_checks() -> None:
    good = [{"check": "v", "value": "3"}, {"check": "c", "ok": True}, {"end": True}]
    assert _judge(good, values={"v": "3"}, checks=("c",)).passed
    as_ok = [{"check": "v", "ok": True}, {"check": "c", "ok": True}, {"end": True}]
    assert not _judge(as_ok, values={"v": "3"}, checks=("c",)).passed
    unknown = [*good[:2], {"check": "z", "ok": True}, {"end": True}]
    assert "z: not a check of this task" in _judge(unknown, values={"v": "3"},
                                                   checks=("c",)).failures
    missing = _judge([good[0], good[2]], values={"v": "3"}, checks=("c",))
    assert missing.early_exit and missing.failures == ("c: never ran",)
    assert not _judge(good, values={"v": "3"}, checks=("c",), nonce="forged").passed
    assert _judge(good, values={"v": "3"}, checks=("c",), exit_code=1).reason == (
        "the hidden test command exited 1")


def test_the_harness_cannot_be_read_by_the_code_under_test(sandbox: Sandbox) -> None:
    # The nonce lives only in the harness process: not in its arguments or environment, its
    # file deleted before the tests start, and its memory closed to other processes.
    probe = (
        "import os\nfrom tracerl_report import check, end\n\n\ndef harness_closed():\n"
        "    found = 0\n"
        "    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "        try:\n"
        "            cmdline = open(f'/proc/{pid}/cmdline', 'rb').read()\n"
        "        except OSError:\n"
        "            continue\n"
        "        if not cmdline.startswith(b'python\\x00.verify_'):\n"
        "            continue\n"
        "        found += 1\n"
        "        for name in ('mem', 'environ'):\n"
        "            try:\n"
        "                open(f'/proc/{pid}/{name}', 'rb').read(1)\n"
        "                return False\n"
        "            except OSError:\n"
        "                pass\n"
        "    return found == 1 and not any(n.startswith('.secret_') for n in os.listdir('.'))\n"
        "\n\ncheck('harness closed', harness_closed)\nend()\n")
    task = Task(id="probe", family="attack", instruction="x", files={"m.py": "x = 1\n"},
                protected=(), test_command="true", hidden_files={"probe.py": probe},
                hidden_test_command="python probe.py", hidden_checks=("harness closed",))
    verdict = hidden_verdict(task, task.files, sandbox)
    assert verdict.passed, (verdict.summary(), verdict.result.stderr)


def test_validate_refuses_a_solution_the_audit_would_flag(sandbox: Sandbox) -> None:
    task = Task.from_dict({**UNITTEST_TASK.to_dict(), "solution": {
        "calc.py": "import sys\n\n\ndef double(x):\n    return x * 2\n\n\n"
                   "if __name__ == '__main__':\n    sys.exit(0)\n"}})
    problems = validate_task(task, sandbox).problems
    assert problems == ("the audit would flag the solution: ['calc.py: exit()']",)


def test_audit_after_verify_knows_of_the_early_exit(sandbox: Sandbox) -> None:
    # A collector scoring a truncated attempt calls verify() and then audit() on its own.
    env = CodingEnv([SUITE_TASK], sandbox=sandbox)
    env.reset(seed=0)
    env.step(_call("write_file", path=MODULE, content="raise SystemExit(0)\n"))
    assert env.verify().early_exit and env.audit().exited_early
    env.close()


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_exiting_early_fails_every_family(sandbox: Sandbox, split: str) -> None:
    for task in generate_split(split, count=7):  # type: ignore[arg-type]
        module = next(iter(task.solution or {}))
        for code in ("import os; os._exit(0)\n", "raise SystemExit(0)\n"):
            verdict = hidden_verdict(task, {**task.files, module: code}, sandbox)
            assert not verdict.passed and verdict.early_exit, (task.id, verdict.summary())
