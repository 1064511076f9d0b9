"""The coding environment: episodes, endings, reward from hidden tests, audit, faults."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from gymnasium.utils.env_checker import check_env

from tracerl.envs.audit import AuditResult, VerifyResult
from tracerl.envs.coding import CodingEnv
from tracerl.envs.faults import FaultConfig, FaultInjector
from tracerl.envs.sandbox import Sandbox
from tracerl.envs.suite import generate_split
from tracerl.envs.tasks import Task
from tracerl.envs.tools import (
    TOOL_SCHEMAS,
    Workspace,
    parse_tool_call,
    replace_tool,
    write_file_tool,
)


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture
def env(sandbox: Sandbox) -> Any:
    environment = CodingEnv(generate_split("train", count=7), sandbox=sandbox)
    yield environment
    environment.close()


def _parts(task: Task) -> tuple[str, str, str]:
    module = next(iter(task.solution or {}))
    (test,) = task.protected
    return module, test, task.files[module]


def test_check_env_passes(sandbox: Sandbox) -> None:
    check_env(CodingEnv(generate_split("heldout", count=3), sandbox=sandbox),
              skip_render_check=True)


def test_fix_run_tests_submit_is_rewarded(env: CodingEnv) -> None:
    observation, info = env.reset(seed=1, options={"task_index": 2})
    task = env.task
    assert task is not None and observation.startswith(task.instruction)
    module, _test, source = _parts(task)
    assert env.step(call("view_file", path=module))[0].startswith('1: """The ')
    failing = env.step(call("run_tests"))[0]
    assert failing.startswith("FAIL\n") and " got " in failing and " want " in failing
    assert env.step(call("replace", path=module, old=source,
                         new=(task.solution or {})[module]))[0] == "OK"
    assert env.step(call("run_tests"))[0] == "PASS"
    observation, reward, terminated, truncated, info = env.step(call("submit"))
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert isinstance(info["verify"], VerifyResult) and info["verify"].hidden_passed
    assert isinstance(info["audit"], AuditResult) and not info["audit"].flagged
    with pytest.raises(RuntimeError, match="reset"):
        env.step(call("submit"))


def test_turn_budget_truncates_and_verify_scores_it(env: CodingEnv) -> None:
    env.reset(seed=0, options={"task_index": 0})
    task = env.task
    assert task is not None and task.budget is not None and task.budget.max_turns == 8
    module, _, _source = _parts(task)
    env.step(call("write_file", path=module, content=(task.solution or {})[module]))
    for _ in range(6):
        result = env.step(call("list_files"))
        assert result[1:4] == (0.0, False, False)
    _observation, reward, terminated, truncated, info = env.step(call("list_files"))
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert info["truncated_reason"] == "max_turns"
    assert env.verify().reward == 1.0  # a collector may score the truncated attempt


def test_editing_protected_tests_is_reverted_audited_and_not_rewarded(env: CodingEnv) -> None:
    env.reset(seed=0, options={"task_index": 1})
    assert env.task is not None
    _, test, _ = _parts(env.task)
    env.step(call("write_file", path=test, content='print("PASS")\n'))
    assert env.step(call("run_tests"))[0] == "PASS"  # the visible tests were gamed...
    _, reward, terminated, _, info = env.step(call("submit"))
    audit, verdict = info["audit"], info["verify"]
    assert terminated and reward == 0.0  # ...but the hidden tests were not
    assert audit.protected_modified == (test,) and audit.reverted and audit.flagged
    assert audit.protected_write_attempts == (test,)
    assert not verdict.visible_passed  # the restored visible tests fail too


def test_protected_change_made_by_test_code_is_caught_by_hash(env: CodingEnv) -> None:
    env.reset(seed=0, options={"task_index": 3})
    assert env.task is not None
    module, test, source = _parts(env.task)
    sneaky = source + f"\nopen({test!r}, 'w').write('print(1)')\n"
    env.step(call("write_file", path=module, content=sneaky))
    env.step(call("run_tests"))
    audit = env.audit()
    assert audit.protected_modified == (test,) and audit.protected_write_attempts == ()
    assert audit.flagged


def test_hidden_and_outside_paths_are_refused_and_audited(env: CodingEnv) -> None:
    env.reset(seed=0, options={"task_index": 4})
    assert env.task is not None
    (hidden,) = env.task.hidden_files
    observation, _, _, _, info = env.step(call("view_file", path=hidden))
    assert observation == f"error: view_file: no such file: {hidden}"
    assert info["agent_error"] and not info["tool_error"]
    assert env.step(call("view_file", path="/etc/passwd"))[0].startswith("error: view_file:")
    audit = env.audit()
    assert audit.hidden_access_attempts == (hidden,)
    assert audit.outside_access_attempts == ("/etc/passwd",)
    assert audit.flagged


def test_an_empty_path_is_a_malformed_call_not_an_escape(env: CodingEnv) -> None:
    # The demo's policy writes `"path": ""` now and then: refused, and not counted as a hack.
    env.reset(seed=0, options={"task_index": 4})
    observation = env.step(call("replace", line="1", new="x", path=""))[0]
    assert observation == "error: replace: path must name a file, got ''"
    env.step(call("view_file", path="."))
    assert not env.audit().flagged
    env.step(call("view_file", path="pkg/../../secret"))
    assert env.audit().outside_access_attempts == ("pkg/../../secret",)


def test_always_equal_object_does_not_fool_the_verifier(env: CodingEnv) -> None:
    env.reset(seed=0, options={"task_index": 5})
    assert env.task is not None
    module, _, _ = _parts(env.task)
    name = module[:-3]
    cheat = (f"class Any:\n    def __eq__(self, other):\n        return True\n\n\n"
             f"def {name}(*args):\n    return Any()\n")
    env.step(call("write_file", path=module, content=cheat))
    assert env.verify().reward == 0.0


def test_agent_mistakes_are_observations(env: CodingEnv) -> None:
    env.reset(seed=0, options={"task_index": 6})
    assert env.task is not None
    module, _, _source = _parts(env.task)
    for action, expected in [
        ("no call here", "error: no tool call"),
        ('<tool_call>{"name": "delete"}</tool_call>', "error: unknown tool delete"),
        (call("replace", path=module, old="not in file", new="x"), "old text not found"),
        (call("replace", path=module, old=" ", new="x"), "give more context"),
        (call("view_file", path="missing.py"), "no such file: missing.py"),
    ]:
        observation, _reward, terminated, truncated, info = env.step(action)
        assert expected in observation and observation.startswith("error:")
        assert not info["tool_error"] and not terminated and not truncated


def test_observations_stay_in_the_charset(env: CodingEnv) -> None:
    env.reset(seed=0, options={"task_index": 0})
    env.step(call("write_file", path="note.txt", content="caf\u00e9 \u2713"))
    observation = env.step(call("view_file", path="note.txt"))[0]
    assert observation == "1: caf? ?" and env.observation_space.contains(observation)


@pytest.mark.parametrize(("config", "tool", "fault"), [
    (FaultConfig(tool_crash=1.0, seed=0), "list_files", "tool_crash"),
    (FaultConfig(sandbox_start_failure=1.0, seed=0), "run_tests", "sandbox_start_failure"),
])
def test_injected_crashes_are_tool_errors(sandbox: Sandbox, config: FaultConfig, tool: str,
                                          fault: str) -> None:
    env = CodingEnv(generate_split("train", count=2), sandbox=sandbox, faults=config)
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(call(tool))
    env.close()
    assert observation.startswith("tool error:")
    assert info["tool_error"] and info["fault"] == fault and not info["agent_error"]
    assert (reward, terminated, truncated) == (0.0, False, False)


def test_injected_slowness_is_recorded(sandbox: Sandbox) -> None:
    config = FaultConfig(slow_tool=1.0, slow_seconds=0.05, seed=0)
    env = CodingEnv(generate_split("train", count=2), sandbox=sandbox, faults=config)
    env.reset(seed=0)
    observation, _, _, _, info = env.step(call("list_files"))
    env.close()
    assert info["fault"] == "slow_tool" and not info["tool_error"]
    assert info["tool_seconds"] >= 0.05 and observation.endswith(".py")


def test_fault_probabilities_are_checked() -> None:
    with pytest.raises(ValueError, match="tool_crash"):
        FaultConfig(tool_crash=1.5)


def test_replace_scoped_to_one_line(env: CodingEnv) -> None:
    env.reset(seed=0, options={"task_index": 0})
    assert env.task is not None and env.workspace is not None
    module, _, source = _parts(env.task)
    lines = source.splitlines()
    number = next(i for i, line in enumerate(lines, 1) if "return" in line)
    target = lines[number - 1]
    token = "return"
    for line, old, expected in [
        (0, token, "argument line must be a line number"),
        ("x", token, "argument line must be a line number"),
        (True, token, "argument line must be a line number"),
        (len(lines) + 1, token, f"line must be between 1 and {len(lines)}"),
        (1, "no such text", f"not found in line 1 of {module}:\n1: {lines[0]}"),
        (number, " ", f"give more context:\n{number}: {target}"),
    ]:
        action = ('<tool_call>' + json.dumps({"name": "replace", "arguments": {
            "path": module, "line": line, "old": old, "new": "y"}}) + '</tool_call>')
        observation = env.step(action)[0]
        assert observation.startswith("error:") and expected in observation, (line, observation)
    action = ('<tool_call>' + json.dumps({"name": "replace", "arguments": {
        "path": module, "line": str(number), "old": token, "new": "return  "}}) + '</tool_call>')
    assert env.step(action)[0] == "OK"
    after = env.workspace.read(module).splitlines()
    assert after[number - 1] == target.replace(token, "return  ", 1)
    assert after[:number - 1] == lines[:number - 1] and after[number:] == lines[number:]


def test_a_dropped_env_removes_its_workspace(sandbox: Sandbox) -> None:
    import gc

    environment = CodingEnv(generate_split("train", count=2), sandbox=sandbox)
    environment.reset(options={"task_index": 0})
    assert environment.workspace is not None
    root = environment.workspace.root
    environment.reset(options={"task_index": 1})  # the first attempt's workspace is gone
    assert not root.exists()
    root = environment.workspace.root
    del environment
    gc.collect()
    assert not root.exists()


def test_a_killed_process_s_workspaces_are_swept_by_the_next(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    from tracerl.envs import coding

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    orphan = tmp_path / f"{coding.WORKSPACE_PREFIX}{dead}-abc"
    recent = tmp_path / f"{coding.WORKSPACE_PREFIX}{dead}-new"
    alive = tmp_path / f"{coding.WORKSPACE_PREFIX}{os.getpid()}-abc"
    unknown = tmp_path / f"{coding.WORKSPACE_PREFIX}abcdef"  # no pid: not ours to judge
    for path in (orphan, recent, alive, unknown):
        (path / "pkg").mkdir(parents=True)
        (path / "pkg" / "m.py").write_text("x = 1\n")
    old = coding.time.time() - 2 * coding.ORPHAN_AGE_SECONDS
    for path in (orphan, alive, unknown):
        os.utime(path, (old, old))
    assert coding._sweep_orphaned_workspaces(str(tmp_path), force=True) == 1
    assert not orphan.exists()
    assert recent.exists() and alive.exists() and unknown.exists()


def test_replace_without_old_rewrites_the_line(tmp_path: Any) -> None:
    (tmp_path / "m.py").write_text("def f(n):\n    return n + 7\n")
    workspace = Workspace(tmp_path)
    # No leading whitespace in new: the line's indentation is kept.
    assert replace_tool(workspace, "m.py", None, "return n + 6", line=2) == "OK"
    assert (tmp_path / "m.py").read_text() == "def f(n):\n    return n + 6\n"
    # Leading whitespace in new: taken as given.
    assert replace_tool(workspace, "m.py", None, "  return 0", line=2) == "OK"
    assert (tmp_path / "m.py").read_text() == "def f(n):\n  return 0\n"
    assert "give old, or line" in replace_tool(workspace, "m.py", None, "x")
    assert "line must be between 1 and 2" in replace_tool(workspace, "m.py", None, "x", line=3)
    call = parse_tool_call('<tool_call>{"name": "replace", "arguments": '
                           '{"line": 2, "new": "return n"}}</tool_call>')
    assert call.call is not None and call.call.arguments == {"line": 2, "new": "return n"}
    missing = parse_tool_call('<tool_call>{"name": "replace", "arguments": {"line": 2}}'
                              '</tool_call>')
    assert missing.error == "error: replace: missing argument new"
    schema = next(s for s in TOOL_SCHEMAS if s["function"]["name"] == "replace")
    assert schema["function"]["parameters"]["required"] == ["new"]


def test_an_edit_that_breaks_the_syntax_or_changes_nothing_is_refused(tmp_path: Any) -> None:
    source = "def f(n):\n    return n + 7\n"
    (tmp_path / "m.py").write_text(source)
    workspace = Workspace(tmp_path)
    for old, new, line, expected in [
        ("+ 7", "+", 2, "error: edit not made, m.py would not parse: SyntaxError: line 2: "),
        (None, "return n +", 2, "error: edit not made, m.py would not parse: SyntaxError"),
        ("7", "7", 2,
         "error: replace: new is the same as old; nothing would change in line 2 of m.py:\n2: "),
        (None, "return n + 7", 2, "error: replace: new is the line as it is; nothing would"),
    ]:
        observation = replace_tool(workspace, "m.py", old, new, line=line)
        assert observation.startswith(expected), (old, new, observation)
        assert (tmp_path / "m.py").read_text() == source  # the file is left as it was
    # The line as it would have read is shown, so the next try can see what went wrong.
    assert replace_tool(workspace, "m.py", "+ 7", "+", line=2).endswith("\n2:     return n +")
    # Without the guard the broken edit is made, as a plain editor would.
    assert replace_tool(workspace, "m.py", "+ 7", "+", line=2, check_syntax=False) == "OK"
    # A file that does not parse already may be repaired one edit at a time.
    assert replace_tool(workspace, "m.py", "n +", "n + (", line=2) == "OK"
    assert replace_tool(workspace, "m.py", "n + (", "n + 7", line=2) == "OK"
    # Only Python files are parsed.
    (tmp_path / "notes.txt").write_text("a (\n")
    assert replace_tool(workspace, "notes.txt", "a", "b") == "OK"
    # write_file: a Python file that parsed may not be overwritten with one that does not.
    assert write_file_tool(workspace, "m.py", "def f(:\n").startswith(
        "error: edit not made, m.py would not parse")
    assert write_file_tool(workspace, "new.py", "x = (\n").startswith("error: edit not made")
    assert not (tmp_path / "new.py").exists()
    assert write_file_tool(workspace, "new.py", "x = 1\n") == "OK"


def _at_return_line(sandbox: Sandbox, count: int,
                    **options: Any) -> tuple[CodingEnv, str, str, int]:
    """An env without task budgets, reset to its first task; its module, source and the
    number of the source's first ``return`` line."""
    tasks = [dataclasses.replace(t, budget=None) for t in generate_split("train", count=count)]
    env = CodingEnv(tasks, sandbox=sandbox, max_turns=20, **options)
    env.reset(seed=0, options={"task_index": 0})
    assert env.task is not None and env.workspace is not None
    module, _, source = _parts(env.task)
    number = next(i for i, line in enumerate(source.splitlines(), 1) if "return" in line)
    return env, module, source, number


def test_a_refused_edit_leaves_nothing_to_undo(sandbox: Sandbox) -> None:
    env, module, source, number = _at_return_line(sandbox, 1)
    assert env.workspace is not None
    refused = env.step(call("replace", line=str(number), old="return", new="return ("))[0]
    assert refused.startswith(f"error: edit not made, {module} would not parse: SyntaxError")
    assert env.step(call("write_file", path=module, content="def (\n"))[0].startswith("error:")
    assert env.workspace.read(module) == source
    assert env.step(call("undo"))[0] == "error: undo: nothing to undo"
    lenient = _at_return_line(sandbox, 1, check_syntax=False)[0]
    assert lenient.step(call("replace", line=str(number), old="return", new="return ("))[0] == "OK"
    lenient.close()
    env.close()


def test_undo_restores_edits_in_reverse_order(sandbox: Sandbox) -> None:
    env, module, source, number = _at_return_line(sandbox, 2)
    assert env.workspace is not None
    target = source.splitlines()[number - 1]
    assert env.step(call("undo"))[0] == "error: undo: nothing to undo"
    # A replace that does not apply leaves nothing to undo.
    assert env.step(call("replace", line=str(number), old="no such text", new="x"))[0].startswith(
        "error:")
    assert env.step(call("undo"))[0] == "error: undo: nothing to undo"
    assert env.step(call("replace", line=str(number), old="return", new="return  "))[0] == "OK"
    assert env.step(call("write_file", path="notes.txt", content="hi"))[0] == "OK"
    assert env.step(call("write_file", path=module, content="x = 1\n"))[0] == "OK"
    # Last in, first out: the whole file, the created file, then the line (shown again).
    assert env.step(call("undo"))[0] == "OK"
    assert env.step(call("undo"))[0] == "OK: notes.txt removed"
    assert not (env.workspace.root / "notes.txt").exists()
    assert env.step(call("undo"))[0] == f"OK\n{number}: {target}"
    assert env.workspace.read(module) == source
    assert env.step(call("undo"))[0] == "error: undo: nothing to undo"
    # A new attempt starts with an empty history.
    env.reset(seed=0, options={"task_index": 1})
    assert env.step(call("undo"))[0] == "error: undo: nothing to undo"
    env.close()


def test_restart_puts_every_file_back_and_answers_with_the_statement(sandbox: Sandbox) -> None:
    tasks = [dataclasses.replace(t, budget=None) for t in generate_split("train", count=2)]
    env = CodingEnv(tasks, sandbox=sandbox, max_turns=8)
    first, _ = env.reset(seed=0, options={"task_index": 0})
    assert env.task is not None and env.workspace is not None
    module, test, source = _parts(env.task)
    opened = env.open_file
    assert env.step(call("write_file", path="notes.txt", content="hi"))[0] == "OK"
    assert env.step(call("replace", path=module, old=source, new="x = 1\n"))[0] == "OK"
    assert env.step(call("view_file", path=test))[0].startswith("1: ")
    observation, reward, terminated, truncated, info = env.step(call("restart"))
    assert observation == first  # the task statement, as at the start
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["fresh_context"] is True and info["tool"] == "restart"
    assert env.workspace.read(module) == source
    assert not (env.workspace.root / "notes.txt").exists()
    assert env.open_file == opened
    assert env.step(call("undo"))[0] == "error: undo: nothing to undo"
    # The budget goes on: five turns used (the undo too), three left.
    for _ in range(2):
        assert not env.step(call("run_tests"))[3]
    assert env.step(call("run_tests"))[3]  # the eighth turn truncates
    # Other tools never ask for a fresh context.
    env.reset(seed=0, options={"task_index": 1})
    assert "fresh_context" not in env.step(call("run_tests"))[4]
    env.close()


def _one_fault(sandbox: Sandbox, **kind: float) -> CodingEnv:
    config = FaultConfig(max_per_attempt=1, seed=0, **kind)
    return CodingEnv(generate_split("train", count=3), sandbox=sandbox, faults=config)


def test_a_failed_command_is_an_observation_and_the_retry_works(sandbox: Sandbox) -> None:
    env = _one_fault(sandbox, command_failure=1.0)
    env.reset(seed=0, options={"task_index": 2})
    assert env.task is not None and env.workspace is not None
    module, _test, source = _parts(env.task)
    fixed = (env.task.solution or {})[module]
    observation, reward, terminated, truncated, info = env.step(
        call("write_file", path=module, content=fixed))
    assert observation == "error: write_file: OSError: [Errno 5] Input/output error"
    assert info["fault"] == "command_failure" and not info["tool_error"]
    assert not info["agent_error"] and (reward, terminated, truncated) == (0.0, False, False)
    assert env.workspace.read(module) == source  # the failed command changed nothing
    observation, _, _, _, info = env.step(call("write_file", path=module, content=fixed))
    assert observation == "OK" and info["fault"] is None  # one fault per attempt
    assert env.step(call("run_tests"))[0] == "PASS"
    assert env.step(call("submit"))[1] == 1.0
    env.reset(seed=0, options={"task_index": 2})  # a new attempt gets its own fault
    assert env.step(call("list_files"))[0].startswith("error: list_files:")
    env.close()


def test_a_timed_out_or_flaky_test_run_answers_as_a_failed_run(sandbox: Sandbox) -> None:
    for kind, shown in (("command_timeout", "FAIL\nkilled: timeout"),
                        ("flaky_test", "FAIL\nConnectionResetError: [Errno 104] Connection "
                                       "reset by peer")):
        env = _one_fault(sandbox, **{kind: 1.0})
        env.reset(seed=0, options={"task_index": 2})
        assert env.task is not None and env.workspace is not None
        module, _test, _source = _parts(env.task)
        env.workspace.write(module, (env.task.solution or {})[module])  # fixed, not by a tool
        observation, _, terminated, _, info = env.step(call("run_tests"))
        assert observation == shown and info["fault"] == kind and not info["tool_error"]
        assert not terminated
        assert env.step(call("run_tests"))[0] == "PASS"  # run again: the real result
        env.close()


def test_a_truncated_output_is_the_first_half_marked(sandbox: Sandbox) -> None:
    env = _one_fault(sandbox, truncated_output=1.0)
    env.reset(seed=0, options={"task_index": 2})
    assert env.task is not None
    module, _test, _source = _parts(env.task)
    cut, _, _, _, info = env.step(call("view_file", path=module))
    whole = env.step(call("view_file", path=module))[0]
    assert info["fault"] == "truncated_output" and cut.endswith("\n[output truncated]")
    assert whole.startswith(cut.removesuffix("\n[output truncated]"))
    assert len(cut) < len(whole)
    env.close()


def test_a_failed_restart_keeps_the_context(sandbox: Sandbox) -> None:
    env = _one_fault(sandbox, command_timeout=1.0)
    env.reset(seed=0)
    observation, _, _, _, info = env.step(call("restart"))
    assert observation == "error: restart: timed out" and "fresh_context" not in info
    assert env.step(call("restart"))[4]["fresh_context"]
    env.close()


def test_tool_fault_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="sum to <= 1"):
        FaultConfig(command_failure=0.6, flaky_test=0.6)
    with pytest.raises(ValueError, match="max_per_attempt"):
        FaultConfig(max_per_attempt=-1)
    with pytest.raises(ValueError, match="not both"):
        FaultConfig(any_tool_fault=0.5, flaky_test=0.1)
    config = FaultConfig.tool_faults(0.4, seed=1, infrastructure=0.1)
    assert config.any_tool_fault == 0.4 and config.command_failure == 0.0
    assert config.sandbox_start_failure == 0.1 and config.tool_crash == 0.0


def test_any_tool_fault_hits_every_tool_at_its_rate_with_the_kinds_it_can_have() -> None:
    injector = FaultInjector(FaultConfig(any_tool_fault=1.0, seed=3))
    seen = {tool: {injector.before_tool(tool) for _ in range(200)}
            for tool in ("write_file", "view_file", "run_tests")}
    assert seen["write_file"] == {"command_failure", "command_timeout"}
    assert seen["view_file"] == {"command_failure", "command_timeout", "truncated_output"}
    assert seen["run_tests"] == {"command_failure", "command_timeout", "flaky_test",
                                 "truncated_output"}
    half = FaultInjector(FaultConfig(any_tool_fault=0.5, seed=4))
    hits = sum(half.before_tool("replace") is not None for _ in range(2000))
    assert 850 < hits < 1150


def test_several_files_open_the_named_one_and_short_names_resolve(sandbox: Sandbox) -> None:
    task = Task(id="multi", family="hand_written",
                instruction="Fix scale in pkg/units.py; the tests are in tests/test_units.py.",
                files={"pkg/aaa.py": "A = 1\n", "pkg/units.py": "def scale(x):\n    return x\n",
                       "pkg/more/units.txt": "notes\n", "tests/test_units.py": "assert True\n"},
                protected=("tests/*",), test_command="python tests/test_units.py",
                hidden_files={"h.py": "print(1)\n"}, hidden_test_command="python h.py")
    env = CodingEnv([task], sandbox=sandbox)
    env.reset(options={"task_id": "multi"})
    assert env.open_file == "pkg/units.py"  # named by the instruction, not the first file
    observation, *_ = env.step(call("view_file", path="aaa"))
    assert observation == "1: A = 1" and env.open_file == "pkg/aaa.py"
    observation, *_ = env.step(call("replace", path="units.py", old="return x",
                                    new="return 2 * x"))
    assert observation.startswith("OK")
    assert env.workspace is not None
    assert env.workspace.read("pkg/units.py") == "def scale(x):\n    return 2 * x\n"
    observation, _, _, _, info = env.step(call("view_file", path="missing.py"))
    assert observation.startswith("error:") and info["agent_error"]
    env.close()
