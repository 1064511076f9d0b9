"""The multi-agent environment API, its checks, ``check_multi_env`` and the referential game."""

from __future__ import annotations

from typing import Any

import pytest

from tracerl.envs.multi import (
    MultiReset,
    MultiStep,
    check_agents,
    check_multi_env,
    check_step,
)
from tracerl.envs.referential import (
    LISTENER,
    SPEAKER,
    ReferentialGame,
    referential_tasks,
    split_tasks,
)


class _Relay:
    """A user's environment: ``a`` then ``b`` act; what ``a`` says goes to ``b``. Knobs
    break one rule each."""

    def __init__(self, *, agents: tuple[str, ...] = ("a", "b"), next_first: str = "a",
                 message_to: str = "b", only_a: bool = False, reward: float = 1.0,
                 never_ends: bool = False, raises: bool = False) -> None:
        self.agents = agents
        self.next_first = next_first
        self.message_to = message_to
        self.only_a = only_a
        self.reward = reward
        self.never_ends = never_ends
        self.raises = raises
        self.turn: str | None = None

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> MultiReset:
        self.turn = "a"
        return MultiReset({name: f"you are {name}" for name in self.agents}, self.next_first)

    def choices(self, agent: str) -> tuple[str, ...] | None:
        return ("x", "y")

    def step(self, agent: str, action: str) -> MultiStep:
        if agent != self.turn:
            raise ValueError(f"not {agent}'s turn")
        if self.raises:
            raise RuntimeError("sandbox died")
        if agent == "a" and not self.only_a:
            self.turn = "b"
            return MultiStep({self.message_to: action}, "b",
                             info={"messages": [("a", self.message_to)]})
        if self.never_ends:
            return MultiStep({agent: "again"}, agent)
        return MultiStep({}, None, rewards={"a": self.reward, "b": self.reward},
                         terminated=True)


def test_a_valid_environment_passes_the_check_and_every_agent_acts() -> None:
    report = check_multi_env(_Relay(), episodes=3)
    assert report.actions == {"a": 3, "b": 3}
    assert report.endings == {"terminated": 3, "truncated": 0}


def test_the_referential_game_passes_the_check() -> None:
    tasks = referential_tasks()
    game = ReferentialGame(tasks)
    report = check_multi_env(game, episodes=5, options=[{"task_id": t.id} for t in tasks[:5]])
    assert report.actions == {SPEAKER: 5, LISTENER: 5}


@pytest.mark.parametrize(("env", "message"), [
    (_Relay(next_first="c"), "reset next_agent: names agent 'c'"),
    (_Relay(message_to="nobody"), "message from 'a' to 'nobody'"),
    (_Relay(only_a=True), r"\['b'\] never acted"),
    (_Relay(reward=float("nan")), "reward nan is not a finite number"),
    (_Relay(never_ends=True), "not over after 200 steps"),
    (_Relay(agents=("a", "a")), "names must be distinct"),
])
def test_broken_environments_are_refused_with_the_rule_they_break(env: _Relay,
                                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_multi_env(env, episodes=2)


def test_an_unknown_agent_in_observations_or_rewards_is_named() -> None:
    agents = ("a", "b")
    with pytest.raises(ValueError, match="step observations: names agent 'zed'"):
        check_step(agents, MultiStep({"zed": "hi"}, "a"))
    with pytest.raises(ValueError, match="step rewards: names agent 'zed'"):
        check_step(agents, MultiStep({}, None, rewards={"zed": 1.0}, terminated=True))
    with pytest.raises(ValueError, match="ended but next_agent is 'a'"):
        check_step(agents, MultiStep({}, "a", terminated=True))
    with pytest.raises(ValueError, match="goes on but next_agent is None"):
        check_step(agents, MultiStep({}, None))
    with pytest.raises(ValueError, match="at least one agent"):
        check_agents(())


def test_an_environment_that_accepts_a_step_out_of_turn_is_refused() -> None:
    class Lax(_Relay):
        def step(self, agent: str, action: str) -> MultiStep:
            self.turn = agent
            return super().step(agent, action)

    with pytest.raises(ValueError, match="acted out of turn"):
        check_multi_env(Lax())


def test_the_game_rewards_both_agents_when_the_listener_picks_the_target() -> None:
    task = referential_tasks()[1]
    game = ReferentialGame([task])
    start = game.reset(options={"task_id": task.id})
    assert f"target {task.target}" in start.observations[SPEAKER]
    assert "target" not in start.observations[LISTENER]
    step = game.step(SPEAKER, "ko")
    assert step.observations == {LISTENER: "heard ko"} and step.next_agent == LISTENER
    with pytest.raises(ValueError, match="it is the turn of 'listener'"):
        game.step(SPEAKER, "ka")
    end = game.step(LISTENER, task.target)
    assert end.terminated and end.rewards == {SPEAKER: 1.0, LISTENER: 1.0}
    game.reset(options={"task_id": task.id})
    game.step(SPEAKER, "ko")
    wrong = next(c for c in task.candidates if c != task.target)
    assert game.step(LISTENER, wrong).rewards == {SPEAKER: 0.0, LISTENER: 0.0}


def test_game_tasks_and_their_split() -> None:
    tasks = referential_tasks(("a", "b", "c"), candidates=2)
    assert len(tasks) == 3 * 2 and len({t.id for t in tasks}) == len(tasks)
    train, heldout = split_tasks(tasks, 0.25, seed=0)
    assert len(heldout) == 2 and {t.id for t in train} | {t.id for t in heldout} == {
        t.id for t in tasks}
    with pytest.raises(ValueError, match="candidates: must be in"):
        referential_tasks(("a", "b"), candidates=3)
    with pytest.raises(ValueError, match=r"options\.task_id: unknown task"):
        ReferentialGame(tasks).reset(options={"task_id": "nope"})
