"""Several agents in one task: the environment API, its checks, and ``check_multi_env``.

One *joint attempt* is one try of N named agents at one task. The environment decides who
acts next; each agent sees only its own observations (its tools' outputs and the messages sent
to it), never another agent's context; it hands out rewards per agent (a shared reward is the
same number for every agent); and the joint attempt has one ending for all agents.

- ``reset(seed=, options=)`` returns a :class:`MultiReset`: each agent's first observation
  (every agent gets one: its instruction) and the agent that acts first.
- ``step(agent, action)`` runs the action of the agent whose turn it is and returns a
  :class:`MultiStep`: the new observations, keyed by the agent that receives each (the actor's
  own tool output, a message to another agent), who acts next, rewards per agent and the
  ending (``terminated``: the task is over; ``truncated``: a budget ran out).
- ``choices(agent)``: the action texts an agent may take, when the environment has a finite
  action set (the collector then masks every other text, as action masking does in RL on
  discrete action spaces); None when any text is allowed.

Errors: an environment that names an agent it does not have (as the next actor, as the
receiver of an observation or message, in the rewards) is broken, and :func:`check_step`
raises ValueError naming it. ``info["tool_error"]`` on a step (or an exception from ``step``)
is the infrastructure's failure: the collector ends the joint attempt ``tool_error`` for every
agent and scores it for nobody. An agent's own mistake (a bad call, a message to a name that
does not exist written by the agent) is an ``error:`` observation to that agent, and the
attempt goes on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class MultiReset:
    """What ``reset`` returns."""

    observations: Mapping[str, str]
    """Each agent's first observation (its instruction), keyed by agent name."""
    next_agent: str
    """The agent that acts first."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """Extras (the task id, ...)."""


@dataclass(frozen=True)
class MultiStep:
    """What ``step`` returns."""

    observations: Mapping[str, str]
    """New observations by receiving agent: the actor's tool output, messages to others.
    An agent absent from the mapping received nothing this step."""
    next_agent: str | None
    """The agent that acts next; None once the joint attempt is over."""
    rewards: Mapping[str, float] = field(default_factory=dict)
    """Rewards per agent given at this step (at the ending: the outcome). A shared reward is
    the same value for every agent."""
    terminated: bool = False
    """The task is over (solved or failed for good)."""
    truncated: bool = False
    """A budget (turns, time) ran out: the task was not over."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """Extras: ``tool_error`` (infrastructure failure), ``tool`` (the tool called),
    ``messages`` (``[(sender, receiver), ...]`` delivered at this step)."""


@runtime_checkable
class MultiAgentEnv(Protocol):
    """The environment a joint attempt runs in (see the module docstring)."""

    agents: tuple[str, ...]
    """The agents' names, in a fixed order."""

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> MultiReset:
        """Start a joint attempt (``options["task_id"]`` picks the task)."""
        ...

    def step(self, agent: str, action: str) -> MultiStep:
        """Run ``agent``'s action; it must be that agent's turn."""
        ...

    def choices(self, agent: str) -> Sequence[str] | None:
        """The actions ``agent`` may take now, or None when any text is allowed."""
        ...


def check_agents(agents: Sequence[str]) -> tuple[str, ...]:
    """The agent names as a tuple; ValueError unless they are distinct non-empty strings."""
    names = tuple(agents)
    if not names:
        raise ValueError("agents: an environment needs at least one agent")
    for name in names:
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"agents: {name!r} is not a valid agent name (a non-empty string "
                             "without surrounding spaces)")
    if len(set(names)) != len(names):
        raise ValueError(f"agents: names must be distinct, got {list(names)}")
    return names


def _known(agents: tuple[str, ...], name: object, what: str) -> None:
    if name not in agents:
        raise ValueError(f"{what}: names agent {name!r}, which this environment does not have "
                         f"(agents: {', '.join(agents)})")


def check_reset(agents: tuple[str, ...], result: object) -> MultiReset:
    """``result`` if it is a valid :class:`MultiReset` for ``agents``; ValueError otherwise."""
    if not isinstance(result, MultiReset):
        raise ValueError(f"reset: must return a MultiReset, got {type(result).__name__}")
    for name, text in result.observations.items():
        _known(agents, name, "reset observations")
        if not isinstance(text, str):
            raise ValueError(f"reset observations: agent {name!r}'s observation is "
                             f"{type(text).__name__}, not text")
    missing = [a for a in agents if a not in result.observations]
    if missing:
        raise ValueError(f"reset observations: no first observation for {missing} (every "
                         "agent needs its instruction)")
    _known(agents, result.next_agent, "reset next_agent")
    return result


def check_step(agents: tuple[str, ...], result: object) -> MultiStep:
    """``result`` if it is a valid :class:`MultiStep` for ``agents``; ValueError otherwise
    (an unknown agent anywhere, a message to an agent that does not exist, a reward that is
    not a finite number, a next agent after the ending or none before it)."""
    if not isinstance(result, MultiStep):
        raise ValueError(f"step: must return a MultiStep, got {type(result).__name__}")
    for pair in result.info.get("messages", ()):
        sender, receiver = pair
        _known(agents, sender, "step messages (sender)")
        _known(agents, receiver, f"step messages: a message from {sender!r} to {receiver!r}")
    for name, text in result.observations.items():
        _known(agents, name, "step observations")
        if not isinstance(text, str):
            raise ValueError(f"step observations: agent {name!r}'s observation is "
                             f"{type(text).__name__}, not text")
    for name, value in result.rewards.items():
        _known(agents, name, "step rewards")
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value)):
            raise ValueError(f"step rewards: agent {name!r}'s reward {value!r} is not a finite "
                             "number")
    over = result.terminated or result.truncated
    if over and result.next_agent is not None:
        raise ValueError(f"step: the joint attempt ended but next_agent is "
                         f"{result.next_agent!r} (must be None)")
    if not over and not result.info.get("tool_error"):
        if result.next_agent is None:
            raise ValueError("step: the joint attempt goes on but next_agent is None")
        _known(agents, result.next_agent, "step next_agent")
    return result


@dataclass(frozen=True)
class CheckReport:
    """What :func:`check_multi_env` ran."""

    episodes: int
    """Joint attempts run."""
    steps: int
    """Steps run over all of them."""
    actions: Mapping[str, int]
    """Actions taken per agent."""
    endings: Mapping[str, int]
    """Joint attempts per ending (``terminated``, ``truncated``)."""


def check_multi_env(env: Any, *, episodes: int = 4, seed: int = 0, max_steps: int = 200,
                    options: Sequence[dict[str, Any] | None] = (),
                    act: Callable[[str, str, int], str] | None = None) -> CheckReport:
    """Run a user's multi-agent environment and raise ValueError at the first broken rule.

    In the spirit of Gymnasium's ``check_env``: ``episodes`` joint attempts (with
    ``options[i]`` for the i-th, when given) are run with actions from ``act(agent,
    observation, step)`` (default: the first of ``env.choices(agent)``, else ``"noop"``), and
    checked: distinct agent names; every reset and step result valid (:func:`check_reset`,
    :func:`check_step`: no unknown agent, no message to an agent that does not exist, finite
    rewards); the same seed and options give the same first observations; a step by an agent
    whose turn it is not is refused; every joint attempt ends within ``max_steps`` steps; and
    every agent acts in at least one of them (an agent that never acts cannot learn).
    """
    if episodes < 1:
        raise ValueError(f"episodes: must be >= 1, got {episodes}")
    agents = check_agents(getattr(env, "agents", ()))
    actions = dict.fromkeys(agents, 0)
    endings = {"terminated": 0, "truncated": 0}
    steps = 0
    for episode in range(episodes):
        chosen = options[episode] if episode < len(options) else None
        first = check_reset(agents, env.reset(seed=seed + episode, options=chosen))
        again = check_reset(agents, env.reset(seed=seed + episode, options=chosen))
        if dict(first.observations) != dict(again.observations):
            raise ValueError("reset: the same seed and options gave different first "
                             "observations (reset must be deterministic given its seed)")
        last = dict(again.observations)
        actor: str | None = again.next_agent
        others = [a for a in agents if a != actor]
        if others:
            try:
                env.step(others[0], _default_action(env, others[0]))
            except ValueError:
                pass
            else:
                raise ValueError(f"step: agent {others[0]!r} acted out of turn (it was "
                                 f"{actor!r}'s turn) and the environment accepted it")
        for turn in range(max_steps + 1):
            if actor is None:
                break
            if turn == max_steps:
                raise ValueError(f"episode {episode}: not over after {max_steps} steps (an "
                                 "environment must end every joint attempt)")
            text = (act(actor, last.get(actor, ""), turn) if act is not None
                    else _default_action(env, actor))
            result = check_step(agents, env.step(actor, text))
            if result.info.get("tool_error"):
                raise ValueError(f"episode {episode}: step {turn} reported a tool error: "
                                 f"{result.observations.get(actor, '')!r}")
            actions[actor] += 1
            steps += 1
            last.update(result.observations)
            if result.terminated or result.truncated:
                endings["terminated" if result.terminated else "truncated"] += 1
                break
            actor = result.next_agent
    idle = [a for a in agents if actions[a] == 0]
    if idle:
        raise ValueError(f"agents: {idle} never acted in {episodes} joint attempts (every "
                         "agent must get a turn)")
    close = getattr(env, "close", None)
    if callable(close):
        close()
    return CheckReport(episodes, steps, actions, endings)


def _default_action(env: Any, agent: str) -> str:
    choices = env.choices(agent) if hasattr(env, "choices") else None
    return str(choices[0]) if choices else "noop"
