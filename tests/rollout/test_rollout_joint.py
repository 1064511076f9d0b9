"""Joint attempts: each agent's own context and record, versions, endings, bad environments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tracerl.cli import main as run
from tracerl.envs.multi import MultiReset, MultiStep
from tracerl.envs.referential import LISTENER, SPEAKER, ReferentialGame, referential_tasks
from tracerl.models.tiny import TinyModelConfig, build_tiny_model, train_tokenizer
from tracerl.rollout import HFPolicy
from tracerl.rollout.collect.chat_tokens import ChatTokens
from tracerl.rollout.collect.joint import AgentPolicy, JointCollector, JointConfig
from tracerl.rollout.policies.sampling import SamplingParams
from tracerl.trace import Role, TraceStore, pack, unpack
from tracerl.trace.store import read_attempt

TASKS = referential_tasks()
SHAPE = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                        max_positions=128)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    texts = [t for task in TASKS[:4] for t in
             ReferentialGame(TASKS).reset(options={"task_id": task.id}).observations.values()]
    return train_tokenizer(texts, vocab_size=300, words=["red", "blue", "green", "gold",
                                                          "ka", "ki", "ko", "ku"])


def _collector(tokenizer: Any, env: Any = None, *, shared: bool = False) -> JointCollector:
    names = ["both"] if shared else [SPEAKER, LISTENER]
    entries = []
    for i, name in enumerate(names):
        policy = HFPolicy(build_tiny_model(tokenizer, SHAPE, seed=i), tokenizer)
        entries.append(AgentPolicy(name, policy, ChatTokens(policy, tools=None,
                                                            observation_role="user")))
    mapping = ({SPEAKER: "both", LISTENER: "both"} if shared
               else {SPEAKER: SPEAKER, LISTENER: LISTENER})
    make_env = (lambda: env) if env is not None else (lambda: ReferentialGame(TASKS))
    config = JointConfig(SamplingParams(temperature=1.0, max_new_tokens=4), name_agent=shared)
    return JointCollector(entries, mapping, make_env, config)


def test_each_agent_sees_only_its_context_and_what_was_sent_to_it(tokenizer: Any) -> None:
    collector = _collector(tokenizer)
    joints = collector.collect([TASKS[0].id, TASKS[1].id], 2, seed=3)
    assert len(joints) == 4
    for joint in joints:
        speaker, listener = joint.attempts[SPEAKER], joint.attempts[LISTENER]
        assert joint.order == ((SPEAKER, 0), (LISTENER, 0))
        for attempt, name in ((speaker, SPEAKER), (listener, LISTENER)):
            segments = [s for turn in attempt.fragments[0].turns for s in turn.segments]
            assert {s.agent for s in segments} == {name}  # every segment names its agent
            actions = [s for s in segments if s.role is Role.ACTION]
            assert len(actions) == 1 and actions[0].policy_version == 0
            assert attempt.metadata["policy"] == name and attempt.end_reason.value == "terminated"
        said = tokenizer.decode(list(speaker.fragments[0].turns[0].segments[-1].token_ids),
                                skip_special_tokens=True)
        assert said in ("ka", "ki", "ko", "ku")  # masked to the game's words
        for attempt in (speaker, listener):  # each choice as the tokenizer writes it, then EOS
            action = attempt.fragments[0].turns[0].segments[-1].token_ids.tolist()
            text = tokenizer.decode(action, skip_special_tokens=True)
            assert action == [*tokenizer.encode(text, add_special_tokens=False),
                              tokenizer.eos_token_id]
        roles = [s.role for s in listener.fragments[0].turns[0].segments]
        assert roles == [Role.PROMPT, Role.OBSERVATION, Role.ACTION]
        message = listener.fragments[0].turns[0].segments[1]
        assert tokenizer.decode(list(message.token_ids), skip_special_tokens=True).endswith(
            f"heard {said}")  # what the speaker sent is the listener's observation
        task = next(t for t in TASKS if t.id == joint.task_id)
        assert f"target {task.target}" not in tokenizer.decode(
            [int(t) for s in listener.fragments[0].turns[0].segments for t in s.token_ids])
        # The listener's context is exactly the conversation rendered in one piece.
        instruction = ReferentialGame(TASKS).reset(options={"task_id": task.id}).observations
        rendered = collector.policies[LISTENER].policy.chat_prompt(
            [{"role": "user", "content": instruction[LISTENER]},
             {"role": "user", "content": f"heard {said}"}])
        fed = [int(t) for s in listener.fragments[0].turns[0].segments[:2] for t in s.token_ids]
        assert fed == rendered
        shared = speaker.metadata["joint"]
        assert shared == listener.metadata["joint"] and shared["id"] == joint.joint_id
        assert shared["agents"][LISTENER] == {"policy": LISTENER, "version_start": 0,
                                              "version_end": 0, "actions": 1}
        assert speaker.reward == listener.reward == joint.rewards[SPEAKER]


def test_versions_are_recorded_when_one_agents_weights_change_during_collection(
        tokenizer: Any) -> None:
    collector = _collector(tokenizer)

    def listener_updated(round_index: int) -> None:
        collector.policies[LISTENER].policy.policy_version = 5  # after the speakers' round

    joints = collector.collect([TASKS[2].id], 3, seed=0, between_rounds=listener_updated)
    for joint in joints:
        versions = {name: [s.policy_version for turn in a.fragments[0].turns
                           for s in turn.segments if s.role is Role.ACTION]
                    for name, a in joint.attempts.items()}
        assert versions == {SPEAKER: [0], LISTENER: [5]}
        agents = joint.attempts[SPEAKER].metadata["joint"]["agents"]
        assert (agents[SPEAKER]["version_start"], agents[SPEAKER]["version_end"]) == (0, 0)
        assert (agents[LISTENER]["version_start"], agents[LISTENER]["version_end"]) == (0, 5)


def test_a_shared_policy_is_told_which_agent_it_plays(tokenizer: Any) -> None:
    joints = _collector(tokenizer, shared=True).collect([TASKS[0].id], 1, seed=0)
    for name, attempt in joints[0].attempts.items():
        prompt = attempt.fragments[0].turns[0].segments[0].token_ids
        assert tokenizer.decode(list(prompt), skip_special_tokens=True).startswith(
            f"agent {name}. ")
        assert attempt.metadata["policy"] == "both"


class _Broken:
    agents = ("a", "b")

    def __init__(self, *, raises: bool = False, tool_error: bool = False,
                 stranger: bool = False) -> None:
        self.raises, self.tool_error, self.stranger = raises, tool_error, stranger

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> MultiReset:
        return MultiReset({"a": "go", "b": "wait"}, "a")

    def choices(self, agent: str) -> tuple[str, ...]:
        return ("ka", "ki")

    def step(self, agent: str, action: str) -> MultiStep:
        if agent == "b" and self.raises:
            raise RuntimeError("the sandbox died")
        if agent == "b" and self.tool_error:
            return MultiStep({"b": "error: runner crashed"}, None, info={"tool_error": True})
        if self.stranger:
            return MultiStep({"c": action}, "b", info={"messages": [("a", "c")]})
        if agent == "a":
            return MultiStep({"b": action}, "b")
        return MultiStep({}, None, rewards={"a": 1.0, "b": 1.0}, terminated=True)


def _pair_collector(tokenizer: Any, env: Any) -> JointCollector:
    policy = HFPolicy(build_tiny_model(tokenizer, SHAPE, seed=0), tokenizer)
    entry = AgentPolicy("p", policy, ChatTokens(policy, tools=None, observation_role="user"))
    return JointCollector([entry], {"a": "p", "b": "p"}, lambda: env,
                          JointConfig(SamplingParams(temperature=1.0, max_new_tokens=4)))


@pytest.mark.parametrize("failure", ["raises", "tool_error"])
def test_a_tool_failure_ends_the_joint_attempt_for_everyone_scored_for_nobody(
        tokenizer: Any, failure: str) -> None:
    env = _Broken(**{failure: True})
    joint = _pair_collector(tokenizer, env).collect(["t"], 1, seed=0)[0]
    assert joint.end.value == "tool_error"
    assert joint.rewards == {"a": None, "b": None}
    assert all(a.end_reason.value == "tool_error" for a in joint.attempts.values())
    assert "error" in joint.attempts["a"].metadata["joint"]
    batch = pack(list(joint.attempts.values()), has_critic=False, min_group_size=1)
    assert batch.report.excluded == {"tool_error": 2}  # never scored as the agents' failure


def test_a_message_to_an_agent_that_does_not_exist_is_refused(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="message from 'a' to 'c'"):
        _pair_collector(tokenizer, _Broken(stranger=True)).collect(["t"], 1, seed=0)
    policy = HFPolicy(build_tiny_model(tokenizer, SHAPE, seed=0), tokenizer)
    entry = AgentPolicy("p", policy, ChatTokens(policy, tools=None))
    with pytest.raises(ValueError, match=r"no policy for agents \['b'\]"):
        JointCollector([entry], {"a": "p"}, _Broken,
                       JointConfig(SamplingParams())).collect(["t"], 1, seed=0)


def test_agents_survive_the_store_and_traces_show_displays_them(
        tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    joint = _collector(tokenizer).collect([TASKS[0].id], 1, seed=0)[0]
    with TraceStore(tmp_path / "traces") as store:
        store.append_many(list(joint.attempts.values()))
    listener = joint.attempts[LISTENER]
    assert read_attempt(tmp_path / "traces", listener.attempt_id) == listener
    records = list(joint.attempts.values())
    assert unpack(pack(records, has_critic=False, min_group_size=1)) == records
    assert run(["traces", "show", str(tmp_path / "traces"), listener.attempt_id]) == 0
    out = capsys.readouterr().out
    for text in ("agent: listener", "agent listener", "policy listener, version 0 at start",
                 "turns in order: speaker:0 listener:0"):
        assert text in out, text
