"""Collecting joint attempts: several agents, each with its own context, policy and trace.

A joint attempt runs one :class:`tracerl.envs.multi.MultiAgentEnv` episode. Each agent keeps
its own context, built as the single-agent collector builds one (``ChatTokens``: the first
prompt, then for each action the closing tokens and the next observation message appended,
so the recorded tokens are exactly the ones fed); an agent's context holds only its own
instruction, its own actions and what was sent to it. Its record is an ordinary
:class:`tracerl.trace.Attempt` (``attempt_id`` ``JOINT/AGENT``), so the store, ``pack`` and
the update read it unchanged, with:

- every segment's ``agent`` set to the agent whose context it is; its action segments carry
  the version of the policy that agent acts with (``Segment.policy_version``), and the
  policy's name is in ``metadata["policy"]``;
- what another agent sent it as an ``observation`` segment (``prompt`` for the instruction),
  never an action;
- ``metadata["joint"]``: the joint attempt's id, every agent's policy and its version at the
  start and at the end of the joint attempt (how far the others moved while it ran), the
  order in which the agents' turns happened, and every agent's reward.

All agents share one ending. A failure of the environment (an exception from ``step``, or
``info["tool_error"]``) ends the joint attempt ``tool_error`` for every agent, with no reward
for anyone. An environment that breaks the API (an unknown agent, a message to an agent that
does not exist) raises ValueError: it is the caller's bug, not an outcome.

Joint attempts are run in lock-step: each round, every unfinished one asks the agent whose
turn it is for an action, and the prompts are sampled in one batch per policy. Between
rounds ``between_rounds`` is called (a trainer that updates one agent's policy while the
others collect, or a test, changes weights there); versions are read when they are used.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tracerl.envs.multi import MultiAgentEnv, check_agents, check_reset, check_step
from tracerl.rollout.collect.chat_tokens import ChatTokens
from tracerl.rollout.collect.collector import attempt_seed
from tracerl.rollout.decoding.choices import ChoiceConstraint, TokenTexts
from tracerl.rollout.policies.sampling import SamplingParams as RolloutSampling
from tracerl.trace.schema import (
    Attempt,
    Costs,
    EndReason,
    Fragment,
    Role,
    SamplingParams,
    Segment,
    Timings,
    Turn,
    logprob_array,
    token_array,
)


@dataclass
class AgentPolicy:
    """A named policy agents act with, and its conversation format."""

    name: str
    """The policy's name (recorded on each of its agents' attempts)."""
    policy: Any
    """A sampler with ``generate(prompts, params, row_seeds=, constraints=)``,
    ``policy_version`` and ``engine`` (an ``HFPolicy``)."""
    chat: ChatTokens
    """How its conversations are rendered."""
    texts: TokenTexts | None = None
    """Token texts for action masking, made on first use."""


@dataclass(frozen=True)
class JointConfig:
    """How joint attempts are run."""

    sampling: RolloutSampling
    """Sampling of every action (``max_new_tokens``: per action)."""
    max_turns: int = 16
    """Actions of all agents together before the joint attempt is truncated."""
    name_agent: bool = False
    """Start each agent's instruction with ``agent NAME.``: a policy shared by several agents
    then knows which one it is playing."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns: must be >= 1, got {self.max_turns}")


@dataclass(frozen=True)
class JointAttempt:
    """One joint attempt: each agent's record and what they share."""

    joint_id: str
    """Id of the joint attempt (each agent's attempt id is ``joint_id/agent``)."""
    task_id: str
    """The task."""
    group_id: str
    """The joint attempts at the same task in the same step share it."""
    attempts: Mapping[str, Attempt]
    """Each agent's record."""
    end: EndReason
    """The one ending of all agents."""
    order: tuple[tuple[str, int], ...]
    """``(agent, turn index in that agent's attempt)`` of every action, in the order taken."""

    @property
    def rewards(self) -> dict[str, float | None]:
        """Each agent's reward (None: not scored, e.g. after a tool error)."""
        return {name: a.reward for name, a in self.attempts.items()}


@dataclass
class _Agent:
    texts: list[str] = field(default_factory=list)  # observations not yet in its context
    turns: list[Turn] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    last_action: list[int] = field(default_factory=list)
    acted: bool = False
    generated: int = 0
    seconds: float = 0.0


@dataclass
class _Joint:
    index: int
    task_id: str
    group_id: str
    sample_index: int
    seed: int
    env: Any
    agents: dict[str, _Agent]
    versions_start: dict[str, int]
    next_agent: str | None = None
    end: EndReason | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    order: list[tuple[str, int]] = field(default_factory=list)
    error: str | None = None
    started: float = 0.0


class JointCollector:
    """Runs joint attempts of ``make_env()`` environments (see the module docstring).

    ``policies``: the policies by name; ``agent_policy``: which policy each agent acts with
    (several agents may share one)."""

    def __init__(self, policies: Sequence[AgentPolicy], agent_policy: Mapping[str, str],
                 make_env: Callable[[], MultiAgentEnv], config: JointConfig) -> None:
        self.policies = {p.name: p for p in policies}
        if len(self.policies) != len(policies):
            raise ValueError("policies: names must be distinct")
        unknown = sorted(set(agent_policy.values()) - set(self.policies))
        if unknown:
            raise ValueError(f"agent_policy: policies {unknown} are not among "
                             f"{sorted(self.policies)}")
        self.agent_policy = dict(agent_policy)
        self.make_env = make_env
        self.config = config

    def collect(self, task_ids: Sequence[str], group_size: int, *, seed: int,
                step: int = 0, between_rounds: Callable[[int], None] | None = None
                ) -> list[JointAttempt]:
        """``group_size`` joint attempts at each task, run to their endings."""
        if group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {group_size}")
        joints = [self._start(i, task_id, k, seed, step)
                  for i, (task_id, k) in enumerate(
                      (t, k) for t in task_ids for k in range(group_size))]
        round_index = 0
        try:
            while True:
                active = [j for j in joints if j.end is None]
                if not active:
                    break
                if round_index and between_rounds is not None:
                    between_rounds(round_index)
                self._round(active, round_index)
                round_index += 1
        finally:
            for joint in joints:
                close = getattr(joint.env, "close", None)
                if callable(close):
                    close()
        return [self._record(j) for j in joints]

    # -- one joint attempt ------------------------------------------------------------------

    def _start(self, index: int, task_id: str, sample_index: int, seed: int,
               step: int) -> _Joint:
        env = self.make_env()
        names = check_agents(env.agents)
        missing = sorted(set(names) - set(self.agent_policy))
        if missing:
            raise ValueError(f"agent_policy: no policy for agents {missing}")
        attempt = attempt_seed(seed, task_id, sample_index)
        joint = _Joint(index, task_id, f"{task_id}@{step}", sample_index, attempt, env,
                       {name: _Agent() for name in names},
                       {name: self._version(name) for name in names}, started=time.time())
        try:
            start = env.reset(seed=attempt, options={"task_id": task_id})
        except ValueError:
            raise  # an unknown task: the caller's input
        except Exception as error:
            joint.end, joint.error = EndReason.TOOL_ERROR, f"{type(error).__name__}: {error}"
            return joint
        start = check_reset(names, start)
        for name, text in start.observations.items():
            prefix = f"agent {name}. " if self.config.name_agent else ""
            joint.agents[name].texts.append(prefix + text)
        joint.next_agent = start.next_agent
        return joint

    def _version(self, agent: str) -> int:
        return int(self.policies[self.agent_policy[agent]].policy.policy_version)

    @staticmethod
    def _context(chat: ChatTokens, state: _Agent, agent: str) -> list[Segment]:
        """The segments that bring ``agent``'s context up to its next action."""
        texts, state.texts = state.texts, []
        if not state.acted:
            first, rest = texts[0], texts[1:]
            if not rest:
                return [Segment(Role.PROMPT, token_array(chat.first_prompt(first)), agent=agent)]
            return [Segment(Role.PROMPT, token_array(chat.opening(first)), agent=agent),
                    Segment(Role.OBSERVATION, token_array(chat.observation("\n".join(rest))),
                            agent=agent)]
        ids = chat.after_action(state.last_action) + chat.observation("\n".join(texts))
        return [Segment(Role.OBSERVATION, token_array(ids), agent=agent)]

    def _round(self, active: list[_Joint], round_index: int) -> None:
        by_policy: dict[str, list[_Joint]] = {}
        for joint in active:
            assert joint.next_agent is not None
            by_policy.setdefault(self.agent_policy[joint.next_agent], []).append(joint)
        for name, joints in by_policy.items():
            self._act(self.policies[name], joints, round_index)

    def _act(self, entry: AgentPolicy, joints: list[_Joint], round_index: int) -> None:
        sampling = self.config.sampling
        prompts, seeds, rules, contexts = [], [], [], []
        for joint in joints:
            assert joint.next_agent is not None
            state = joint.agents[joint.next_agent]
            segments = self._context(entry.chat, state, joint.next_agent)
            contexts.append(segments)
            prompt = state.context + [int(t) for s in segments for t in s.token_ids]
            prompts.append(prompt)
            seeds.append((joint.seed * 1_000_003 + round_index * 7919 + 1) & 0x7FFFFFFF)
            rules.append(self._rule(entry, joint.env, joint.next_agent))
        started = time.perf_counter()
        completions = entry.policy.generate(prompts, sampling, row_seeds=seeds,
                                            constraints=rules)
        seconds = (time.perf_counter() - started) / max(len(joints), 1)
        engine = str(getattr(entry.policy, "engine", type(entry.policy).__name__))
        for joint, prompt, segments, seed, rule, completion in zip(
                joints, prompts, contexts, seeds, rules, completions, strict=True):
            agent = joint.next_agent
            assert agent is not None
            state = joint.agents[agent]
            action = list(completion.token_ids)
            segments.append(Segment(
                Role.ACTION, token_array(action), logprobs=logprob_array(completion.logprobs),
                sampling=SamplingParams(
                    temperature=sampling.temperature, top_p=sampling.top_p,
                    top_k=sampling.top_k or None, max_new_tokens=sampling.max_new_tokens,
                    seed=seed, constraint=None if rule is None else rule.name),
                policy_version=completion.policy_version, engine=engine, agent=agent))
            joint.order.append((agent, len(state.turns)))
            state.turns.append(Turn(tuple(segments)))
            state.context = prompt + action
            state.last_action = action
            state.acted = True
            state.generated += len(action)
            state.seconds += seconds
            self._step(joint, agent, completion.text)

    def _rule(self, entry: AgentPolicy, env: Any, agent: str) -> ChoiceConstraint | None:
        choices = env.choices(agent) if hasattr(env, "choices") else None
        if not choices:
            return None
        policy = entry.policy
        if entry.texts is None:
            width = int(policy.model.get_output_embeddings().weight.shape[0])
            entry.texts = TokenTexts(policy.tokenizer, width)
        end_ids = self.config.sampling.stop_token_ids or tuple(policy.eos_ids)
        return ChoiceConstraint(entry.texts, choices, end_ids)

    def _step(self, joint: _Joint, agent: str, text: str) -> None:
        names = tuple(joint.agents)
        try:
            result = joint.env.step(agent, text)
        except Exception as error:  # the environment itself failed: infrastructure
            joint.end, joint.error = EndReason.TOOL_ERROR, f"{type(error).__name__}: {error}"
            return
        result = check_step(names, result)
        if result.info.get("tool_error"):
            joint.end = EndReason.TOOL_ERROR
            joint.error = str(result.observations.get(agent, "tool error"))
            return
        for name, observation in result.observations.items():
            joint.agents[name].texts.append(observation)
        for name, value in result.rewards.items():
            joint.rewards[name] = joint.rewards.get(name, 0.0) + float(value)
        if result.terminated:
            joint.end = EndReason.TERMINATED
        elif result.truncated or len(joint.order) >= self.config.max_turns:
            joint.end = EndReason.TRUNCATED_TURNS
        joint.next_agent = None if joint.end is not None else result.next_agent

    # -- records ----------------------------------------------------------------------------

    def _record(self, joint: _Joint) -> JointAttempt:
        assert joint.end is not None
        joint_id = f"{joint.group_id}#{joint.sample_index}"
        scored = joint.end not in (EndReason.TOOL_ERROR, EndReason.CANCELLED)
        shared = {
            "id": joint_id,
            "agents": {name: {"policy": self.agent_policy[name],
                              "version_start": joint.versions_start[name],
                              "version_end": self._version(name),
                              "actions": sum(1 for a, _ in joint.order if a == name)}
                       for name in joint.agents},
            "order": [[a, t] for a, t in joint.order],
            "rewards": {name: joint.rewards.get(name, 0.0) for name in joint.agents}
            if scored else None,
        }
        if joint.error is not None:
            shared["error"] = joint.error
        attempts = {}
        for name, state in joint.agents.items():
            entry = self.policies[self.agent_policy[name]]
            turns = list(state.turns)
            continuation: list[int] = []
            if not turns:  # never acted: its context as it stood, for inspection
                segments = self._context(entry.chat, state, name) if state.texts else []
                turns = [Turn(tuple(segments))] if segments else []
            elif joint.end is not EndReason.TERMINATED:
                continuation = entry.chat.after_action(state.last_action)
                if state.texts:
                    continuation += entry.chat.observation("\n".join(state.texts))
            reward = joint.rewards.get(name, 0.0) if scored else None
            attempts[name] = Attempt(
                attempt_id=f"{joint_id}/{name}", task_id=joint.task_id,
                group_id=joint.group_id,
                fragments=(Fragment(0, tuple(turns), joint.end,
                                    continuation_ids=token_array(continuation)),),
                reward=reward, rewards={} if reward is None else {"env": reward},
                timings=Timings(started_at=joint.started, finished_at=time.time(),
                                generation_seconds=state.seconds),
                costs=Costs(generated_tokens=state.generated, turns=len(state.turns)),
                metadata={"agent": name, "policy": self.agent_policy[name],
                          "sample_index": joint.sample_index, "seed": joint.seed,
                          "joint": shared})
        return JointAttempt(joint_id, joint.task_id, joint.group_id, attempts, joint.end,
                            tuple(joint.order))
