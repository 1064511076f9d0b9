"""The collector: exact token bookkeeping, endings, the store, cancellation and faults."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tracerl.envs import TOOL_SCHEMAS, CodingEnv, FaultConfig, Sandbox
from tracerl.envs.suite import generate_split
from tracerl.envs.tools import parse_tool_call
from tracerl.models.tiny import build_tiny_model, render_tool_call, train_tokenizer
from tracerl.rollout.collect.collector import Collector, CollectorConfig, attempt_seed
from tracerl.rollout.policies.hf import HFPolicy
from tracerl.rollout.policies.sampling import Completion, SamplingParams
from tracerl.testing.scripted import ScriptedPolicy
from tracerl.testing.toy_agent import TOY_MODEL, toy_tool_policy
from tracerl.trace import EndReason, Role, TraceStore, check_attempt, read_attempts

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
TOOLS = tuple(s for s in TOOL_SCHEMAS if s["function"]["name"] in ("run_tests", "submit"))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40)


class RecordingPolicy(HFPolicy):
    """The real HF policy, remembering every prompt it was fed and what it returned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[list[int]], list[Completion]]] = []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 **kwargs: Any) -> list[Completion]:
        out = super().generate(prompts, params, **kwargs)
        self.calls.append(([list(p) for p in prompts], out))
        return out


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox()


@pytest.fixture(scope="module")
def tasks() -> list[Any]:
    found = generate_split("train", seed=0, count=2)
    solved = dataclasses.replace(found[0], id="solved", files={**found[0].files,
                                                               **(found[0].solution or {})})
    return [*found, solved]


@pytest.fixture(scope="module")
def toy(tasks: list[Any], sandbox: Sandbox) -> RecordingPolicy:
    """A tiny model fitted to call run_tests, then submit."""
    torch.set_num_threads(1)
    env = CodingEnv(tasks, sandbox=sandbox)
    first = [env.reset(options={"task_id": t.id})[0] for t in tasks]
    env.close()
    fitted = toy_tool_policy(first, tools=TOOLS, steps=100)
    return RecordingPolicy(fitted.model, fitted.tokenizer)


def _collector(policy: HFPolicy, tasks: list[Any], sandbox: Sandbox, store: TraceStore | None,
               faults: FaultConfig | None = None, **config: Any) -> Collector:
    config.setdefault("sampling", GREEDY)
    config.setdefault("tools", TOOLS)
    return Collector(policy, lambda: CodingEnv(tasks, sandbox=sandbox, faults=faults),
                     store, CollectorConfig(**config))


def _segments(fragment: Any) -> list[Any]:
    return [seg for turn in fragment.turns for seg in turn.segments]


def test_recorded_segments_are_exactly_what_the_policy_was_fed(
    toy: RecordingPolicy, tasks: list[Any], sandbox: Sandbox, tmp_path: Path
) -> None:
    toy.calls.clear()
    sampling = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=30)
    with TraceStore(tmp_path / "s", fsync=False) as store:
        result = _collector(toy, tasks, sandbox, store, sampling=sampling,
                            max_turns=3).collect(tasks, 2, run_id="r", policy_version=0)
    fed: dict[tuple[int, ...], list[Completion]] = {}
    for prompts, outs in toy.calls:
        for prompt, completion in zip(prompts, outs, strict=True):
            fed.setdefault(tuple(prompt), []).append(completion)
    assert [a.attempt_id for a in result.attempts] == [
        f"r:{t.id}:{i}" for t in tasks for i in range(2)]  # by task, then sample index
    for attempt in result.attempts:
        assert check_attempt(attempt) == []
        assert attempt.group_id == f"r:{attempt.task_id}"
        assert attempt.metadata["seed"] == attempt_seed(0, attempt.task_id,
                                                        attempt.metadata["sample_index"])
        for fragment in attempt.fragments:
            context: list[int] = []
            for seg in _segments(fragment):
                if seg.role is Role.ACTION:
                    # This exact prompt was fed, and these tokens and logprobs came back.
                    assert any(
                        list(c.token_ids) == seg.token_ids.tolist()
                        and np.array_equal(seg.logprobs, np.asarray(c.logprobs, np.float32))
                        for c in fed[tuple(context)])
                    assert seg.engine == "hf" and seg.policy_version == 0
                    assert seg.sampling is not None and seg.sampling.temperature == 1.0
                context += seg.token_ids.tolist()
    assert sum(result.endings.values()) == 6
    assert result.generated_tokens == sum(
        len(s.token_ids) for a in result.attempts for f in a.fragments for s in _segments(f)
        if s.role is Role.ACTION)
    assert result.sampler_calls < sum(a.costs.turns for a in result.attempts)  # batched
    stored = {a.attempt_id: a for a in read_attempts(tmp_path / "s")}
    assert stored == {a.attempt_id: a for a in result.attempts}


def test_submit_terminates_with_the_verifier_reward(
    toy: RecordingPolicy, tasks: list[Any], sandbox: Sandbox
) -> None:
    result = _collector(toy, tasks, sandbox, None, max_turns=4).collect(tasks[2:], 1)
    (attempt,) = result.attempts
    assert attempt.end_reason is EndReason.TERMINATED
    assert attempt.reward == 1.0 and attempt.verifier is not None and attempt.verifier.passed
    assert attempt.fragments[-1].continuation_ids.size == 0
    assert attempt.costs.tool_calls == 2 and attempt.costs.tool_seconds > 0


def test_turn_budget_truncates_and_scores_the_files_left(
    toy: RecordingPolicy, tasks: list[Any], sandbox: Sandbox
) -> None:
    result = _collector(toy, tasks, sandbox, None, max_turns=1).collect(tasks[:1], 1)
    (attempt,) = result.attempts
    assert attempt.end_reason is EndReason.TRUNCATED_TURNS
    assert attempt.reward == 0.0  # the buggy files fail the hidden tests
    # The state the task continues from: the test output that came back after the action.
    assert "FAIL" in toy.decode(attempt.fragments[-1].continuation_ids.tolist())


def test_tool_crash_is_a_tool_error_not_the_agents_failure(
    toy: RecordingPolicy, tasks: list[Any], sandbox: Sandbox, tmp_path: Path
) -> None:
    with TraceStore(tmp_path / "s", fsync=False) as store:
        result = _collector(toy, tasks, sandbox, store,
                            faults=FaultConfig(tool_crash=1.0, seed=0)).collect(tasks[:2], 1)
    assert result.endings["tool_error"] == 2
    for attempt in result.attempts:
        assert attempt.reward is None and attempt.metadata["fault"] == "tool_crash"
    stored = read_attempts(tmp_path / "s")
    assert len(stored) == 2
    # The trace records the fault, so evaluation can count faulted attempts.
    assert all(a.metadata["injected_faults"] == ["tool_crash"] for a in stored)


def test_sandbox_start_failure_is_a_tool_error(
    toy: RecordingPolicy, tasks: list[Any], sandbox: Sandbox
) -> None:
    faults = FaultConfig(sandbox_start_failure=1.0, seed=0)
    result = _collector(toy, tasks, sandbox, None, faults=faults).collect(tasks[:1], 1)
    (attempt,) = result.attempts
    assert attempt.end_reason is EndReason.TOOL_ERROR
    assert attempt.metadata["fault"] == "sandbox_start_failure"


def test_unparseable_tool_call_is_an_observation(tasks: list[Any], sandbox: Sandbox) -> None:
    torch.set_num_threads(1)
    tokenizer = train_tokenizer([t.instruction for t in tasks], vocab_size=600)
    untrained = HFPolicy(build_tiny_model(tokenizer, TOY_MODEL, seed=2), tokenizer)
    result = _collector(untrained, tasks, sandbox, None, max_turns=2,
                        sampling=SamplingParams(temperature=1.0, max_new_tokens=8)
                        ).collect(tasks[:1], 1)
    (attempt,) = result.attempts
    assert attempt.end_reason is EndReason.TRUNCATED_TURNS  # the agent's mistake, not a fault
    observation = attempt.fragments[0].turns[1].segments[0]
    assert observation.role is Role.OBSERVATION
    assert "error:" in untrained.decode(observation.token_ids.tolist())


def test_prompt_longer_than_context_is_a_clear_error_and_context_end_is_truncation(
    toy: RecordingPolicy, tasks: list[Any], sandbox: Sandbox
) -> None:
    with pytest.raises(ValueError, match=r"first prompt has \d+ tokens"):
        _collector(toy, tasks, sandbox, None, max_context_tokens=20).collect(tasks[:1], 1)
    first = toy.chat_prompt([{"role": "user", "content": "x"}], tools=list(TOOLS))
    env = CodingEnv(tasks, sandbox=sandbox)
    observation = env.reset(options={"task_id": tasks[0].id})[0]
    env.close()
    prompt = toy.chat_prompt([{"role": "user", "content": observation}], tools=list(TOOLS))
    assert len(prompt) > len(first)
    result = _collector(toy, tasks, sandbox, None, max_context_tokens=len(prompt) + 5
                        ).collect(tasks[:1], 1)
    (attempt,) = result.attempts
    assert attempt.end_reason is EndReason.TRUNCATED_TOKENS
    assert len(attempt.fragments[0].turns[0].segments[1].token_ids) == 5


def test_wall_clock_budget_ends_with_timeout(
    toy: RecordingPolicy, tasks: list[Any], sandbox: Sandbox
) -> None:
    faults = FaultConfig(slow_tool=1.0, slow_seconds=1.0, seed=0)
    result = _collector(toy, tasks, sandbox, None, faults=faults, max_seconds=0.5,
                        verify_truncated=False).collect(tasks[:1], 1)
    assert result.attempts[0].end_reason is EndReason.TIMEOUT


def test_sigint_cancels_in_flight_attempts_and_loses_none(
    toy: RecordingPolicy, tasks: list[Any], sandbox: Sandbox, tmp_path: Path
) -> None:
    store = TraceStore(tmp_path / "s", fsync=False)
    faults = FaultConfig(slow_tool=1.0, slow_seconds=0.3, seed=0)
    collector = _collector(toy, tasks, sandbox, store, faults=faults, max_turns=6,
                           max_concurrent=3, env_workers=3)

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while len(store) < 1 and time.monotonic() < deadline:  # one attempt finished
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    killer = threading.Thread(target=interrupt)
    killer.start()
    result = collector.collect(tasks, 4, run_id="x")
    killer.join()
    store.close()
    assert result.endings["cancelled"] >= 1
    assert len(result.attempts) + result.not_started == 12
    stored = read_attempts(tmp_path / "s")
    assert {a.attempt_id for a in stored} == {a.attempt_id for a in result.attempts}
    for attempt in stored:
        assert check_attempt(attempt) == []
        if attempt.end_reason is EndReason.CANCELLED:
            assert attempt.reward is None


def test_bad_arguments_are_refused(toy: RecordingPolicy, tasks: list[Any],
                                   sandbox: Sandbox) -> None:
    collector = _collector(toy, tasks, sandbox, None)
    with pytest.raises(ValueError, match="group_size"):
        collector.collect(tasks, 0)
    with pytest.raises(ValueError, match="policy_version"):
        collector.collect(tasks, 1, policy_version=5)
    with pytest.raises(ValueError, match="appears twice"):
        collector.collect([tasks[0], tasks[0]], 1)
    with pytest.raises(ValueError, match="max_turns"):
        CollectorConfig(max_turns=0)


def test_toy_policy_fitted_on_real_test_outputs_submits_after_each(tasks: list[Any],
                                                                  sandbox: Sandbox) -> None:
    torch.set_num_threads(1)
    env = CodingEnv(tasks, sandbox=sandbox)
    first, outputs = [], []
    for task in tasks:
        first.append(env.reset(options={"task_id": task.id})[0])
        outputs.append(env.step(render_tool_call("run_tests", {}))[0])
    env.close()
    with pytest.raises(ValueError, match="test_outputs: need one per observation"):
        toy_tool_policy(first, tools=TOOLS, steps=0, test_outputs=outputs[:1])
    fitted = toy_tool_policy(first, tools=TOOLS, steps=100, test_outputs=outputs)
    result = _collector(fitted, tasks, sandbox, None, max_turns=4).collect(tasks, 1)
    assert result.endings["terminated"] == len(tasks)
    for attempt in result.attempts:  # run_tests, then submit: two actions
        actions = [s for s in _segments(attempt.fragments[0]) if s.role == "action"]
        assert len(actions) == 2


class _Sequence(ScriptedPolicy):
    """Plays fixed actions in order (one attempt at a time), whatever the conversation holds:
    after a restart the fresh context holds none of them. Remembers every prompt fed."""

    def __init__(self, base: HFPolicy, tasks: list[Any], actions: list[str]) -> None:
        super().__init__(base, tasks, lambda _task: list(actions))
        self.actions, self.fed = list(actions), []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 **kwargs: Any) -> list[Completion]:
        self.fed.extend(list(p) for p in prompts)
        return super().generate(prompts, params, **kwargs)

    def next_action(self, text: str) -> str:
        return self.actions[len(self.fed) - 1]


def test_restart_continues_the_attempt_in_a_fresh_context(
    toy: RecordingPolicy, tasks: list[Any], sandbox: Sandbox, tmp_path: Path
) -> None:
    task = tasks[2]  # its files already hold the fix: only the first try breaks them
    module = next(iter(task.solution or {}))
    actions = [render_tool_call("write_file", {"path": module, "content": "x = 1\n"}),
               render_tool_call("run_tests", {}), render_tool_call("restart", {}),
               render_tool_call("run_tests", {}), render_tool_call("submit", {})]
    policy = _Sequence(toy, tasks, actions)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=200)
    with TraceStore(tmp_path / "s", fsync=False) as store:
        result = _collector(policy, tasks, sandbox, store, sampling=sampling,
                            max_turns=8).collect([task], 1)
    (attempt,) = result.attempts
    assert check_attempt(attempt) == []
    # One attempt in two contexts: the given-up try is continued, not an ending.
    assert [f.end for f in attempt.fragments] == [EndReason.CONTINUED, EndReason.TERMINATED]
    assert attempt.reward == 1.0 and attempt.costs.turns == 5
    second = _segments(attempt.fragments[1])
    assert second[0].role is Role.SUMMARY
    # The next try was sampled from the statement alone: nothing of the first try in it.
    assert policy.fed[3] == second[0].token_ids.tolist() == policy.fed[0]
    assert [s.role for s in _segments(attempt.fragments[0])].count(Role.ACTION) == 3
    assert read_attempts(tmp_path / "s") == [attempt]


@contextlib.contextmanager
def _rules_seen(toy: RecordingPolicy) -> Iterator[list[Any]]:
    """Record the decoding rule the collector passes with each prompt (None: none)."""
    seen: list[Any] = []
    original = toy.generate

    def generate(prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 row_seeds: Sequence[int] | None = None,
                 constraints: Sequence[Any] | None = None) -> list[Completion]:
        seen.extend(constraints or [None] * len(prompts))
        return original(prompts, params, row_seeds=row_seeds, constraints=constraints)

    toy.generate = generate  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del toy.generate


def test_constrain_edits_gives_each_turn_the_open_files_rule_and_records_it(
        toy: RecordingPolicy, tasks: list[Any], sandbox: Sandbox, tmp_path: Path) -> None:
    with _rules_seen(toy) as seen, TraceStore(tmp_path / "store") as store:
        result = _collector(toy, tasks[:1], sandbox, store, constrain_edits=True,
                            max_turns=2).collect(tasks[:1], 1, run_id="c")
    attempt = result.attempts[0]
    env = CodingEnv(tasks[:1], sandbox=sandbox)
    env.reset(options={"task_id": tasks[0].id})
    opened = env.open_file_text()
    env.close()
    assert opened is not None and opened == tasks[0].files[str(env.open_file)]
    assert seen and all(rule is not None for rule in seen)
    assert seen[0].file_text == opened  # each turn's rule reads the environment's open file
    actions = [s for f in attempt.fragments for t in f.turns for s in t.segments
               if s.role is Role.ACTION]
    assert actions and all(s.sampling.constraint == "edit_old" for s in actions)
    stored = read_attempts(tmp_path / "store")[0]
    assert [s.sampling for f in stored.fragments for t in f.turns for s in t.segments
            if s.role is Role.ACTION] == [s.sampling for s in actions]
    # Off (the default), no rule is passed and none is recorded.
    with _rules_seen(toy) as seen:
        plain = _collector(toy, tasks[:1], sandbox, None, max_turns=2).collect(tasks[:1], 1)
    assert seen and all(rule is None for rule in seen)
    assert all(s.sampling.constraint is None for f in plain.attempts[0].fragments
               for t in f.turns for s in t.segments if s.role is Role.ACTION)


def test_constrain_calls_with_edits_gives_each_turn_both_rules_and_records_them(
        toy: RecordingPolicy, tasks: list[Any], sandbox: Sandbox, tmp_path: Path) -> None:
    from tracerl.rollout.decoding.grammar import AllRules, ToolCallRule

    with _rules_seen(toy) as seen, TraceStore(tmp_path / "store") as store:
        result = _collector(toy, tasks[:1], sandbox, store, constrain_edits=True,
                            constrain_calls=True, max_turns=2).collect(tasks[:1], 1, run_id="c")
    assert seen and all(isinstance(rule, AllRules) for rule in seen)
    # A fresh grammar state per turn, one grammar (and its mask cache) per collector.
    grammar_rules = [rule.rules[0] for rule in seen]
    assert all(isinstance(rule, ToolCallRule) for rule in grammar_rules)
    assert len({id(rule) for rule in grammar_rules}) == len(seen)
    assert len({id(rule.grammar) for rule in grammar_rules}) == 1
    actions = [s for f in result.attempts[0].fragments for t in f.turns for s in t.segments
               if s.role is Role.ACTION]
    assert actions and all(s.sampling.constraint == "tool_call+edit_old" for s in actions)
    # Every action the grammar let end is a call the environment parses.
    for action in actions:
        text = toy.decode(action.token_ids.tolist())
        if text.endswith("</tool_call>"):
            assert parse_tool_call(text).call is not None, text
