"""The coding pair: disjoint powers, messages as the only channel, the hidden tests' verdict."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tracerl.envs.multi import check_multi_env
from tracerl.envs.pair import FIXER, TESTER, CodingPairEnv
from tracerl.envs.sandbox import Sandbox
from tracerl.envs.suite import generate_split
from tracerl.envs.suite.demonstrator import bug_line


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture
def pair(sandbox: Sandbox) -> Any:
    env = CodingPairEnv(generate_split("train", count=3), sandbox=sandbox, max_turns=12)
    yield env
    env.close()


def test_the_pair_solves_a_task_only_through_messages(pair: CodingPairEnv) -> None:
    task = pair.inner.tasks[1]
    start = pair.reset(options={"task_id": task.id})
    assert start.next_agent == TESTER and "cannot edit" in start.observations[TESTER]
    (test,) = task.protected
    path, bad, good = bug_line(task)
    refused = pair.step(TESTER, call("replace", path=path, old=bad, new=good))
    assert refused.observations[TESTER].startswith("error: the tester cannot call replace")
    assert refused.next_agent == TESTER
    assert not pair.step(TESTER, call("view_file", path=test)).observations[TESTER].startswith(
        "error")
    failing = pair.step(TESTER, call("run_tests")).observations[TESTER]
    assert failing.startswith("FAIL")
    sent = pair.step(TESTER, call("send_message", text=failing[:200]))
    assert sent.next_agent == FIXER and sent.info["messages"] == [(TESTER, FIXER)]
    assert sent.observations == {FIXER: f"message from tester: {failing[:200]}"}
    for forbidden, message in ((call("run_tests"), "the fixer cannot call run_tests"),
                               (call("view_file", path=test), "may view the code, not")):
        assert message in pair.step(FIXER, forbidden).observations[FIXER]
    assert pair.step(FIXER, call("replace", path=path, old=bad, new=good)).observations[
        FIXER].startswith("OK")
    end = pair.step(FIXER, call("submit"))
    assert end.terminated and end.rewards == {TESTER: 1.0, FIXER: 1.0}


def test_a_message_to_nobody_is_the_agents_mistake(pair: CodingPairEnv) -> None:
    pair.reset(options={"task_id": pair.inner.tasks[0].id})
    step = pair.step(TESTER, call("send_message", text="hi", to="manager"))
    assert step.observations[TESTER].startswith("error: send_message: no agent 'manager'")
    assert step.next_agent == TESTER
    with pytest.raises(ValueError, match="it is the turn of 'tester'"):
        pair.step(FIXER, call("submit"))


def test_the_turn_budget_truncates_and_a_tool_crash_is_infrastructure(
        sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    env = CodingPairEnv(generate_split("train", count=2), sandbox=sandbox, max_turns=2)
    env.reset(options={"task_id": env.inner.tasks[0].id})
    env.step(TESTER, call("send_message", text="look at line 3"))
    end = env.step(FIXER, call("view_file"))
    assert end.truncated and end.next_agent is None and end.rewards == {TESTER: 0.0, FIXER: 0.0}
    env.reset(options={"task_id": env.inner.tasks[0].id})

    def crash(name: str, arguments: dict[str, Any]) -> str:
        raise RuntimeError("the sandbox is gone")

    monkeypatch.setattr(env.inner, "_dispatch", crash)
    failed = env.step(TESTER, call("run_tests"))
    assert failed.info["tool_error"] and failed.next_agent is None
    env.close()


def test_the_pair_passes_the_environment_check(sandbox: Sandbox) -> None:
    tasks = generate_split("train", count=2)

    def act(agent: str, observation: str, step: int) -> str:
        return call("send_message", text="done") if agent == TESTER else call("submit")

    env = CodingPairEnv(tasks, sandbox=sandbox)
    report = check_multi_env(env, episodes=2, options=[{"task_id": t.id} for t in tasks],
                             act=act)
    assert report.actions == {TESTER: 2, FIXER: 2}
