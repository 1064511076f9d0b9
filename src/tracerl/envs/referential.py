"""A referential game: a speaker names a target with one word, a listener picks it.

The smallest task where two agents must learn together. The *speaker* sees the target (one
of a few items) and sends one word from a small set of symbols; the *listener* sees the
candidate items, in the task's order, and the speaker's word, and picks an item. Both get
reward 1 when the listener picks the target, 0 otherwise (a shared reward). The symbols mean
nothing at first: a protocol (which symbol names which item) has to be agreed while both
agents learn, so each one's environment changes as the other learns.

A task is one set of candidates and one target among them; :func:`referential_tasks` lists
them all. Both agents have finite action sets (``choices``): the speaker's symbols and
the listener's candidates; the collector masks every other text, so random play succeeds one
time in ``candidates``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tracerl.envs.multi import MultiReset, MultiStep, check_agents

SPEAKER = "speaker"
"""The agent that sees the target."""
LISTENER = "listener"
"""The agent that picks."""
ITEMS: tuple[str, ...] = ("red", "blue", "green", "gold")
"""The default items."""
SYMBOLS: tuple[str, ...] = ("ka", "ki", "ko", "ku")
"""The default words the speaker may send (meaningless until a protocol is learned)."""


@dataclass(frozen=True)
class ReferentialTask:
    """One round: the candidates in the listener's order and the target among them."""

    id: str
    """Task id."""
    candidates: tuple[str, ...]
    """The items the listener chooses from, in the order it sees them (the items' order)."""
    target: str
    """The item the speaker must name."""


def referential_tasks(items: Sequence[str] = ITEMS, candidates: int = 2) -> list[ReferentialTask]:
    """Every round: each set of ``candidates`` distinct items (in the items' order), each
    target among them."""
    names = tuple(items)
    if len(set(names)) != len(names) or not all(n and n.isalpha() for n in names):
        raise ValueError(f"items: must be distinct alphabetic words, got {list(names)}")
    if not 2 <= candidates <= len(names):
        raise ValueError(f"candidates: must be in [2, {len(names)}] (the number of items), "
                         f"got {candidates}")
    tasks: list[ReferentialTask] = []
    for shown in itertools.combinations(names, candidates):
        for target in shown:
            tasks.append(ReferentialTask(f"ref-{len(tasks):03d}", shown, target))
    return tasks


def split_tasks(tasks: Sequence[ReferentialTask], heldout_fraction: float,
                seed: int) -> tuple[list[ReferentialTask], list[ReferentialTask]]:
    """(train, held-out): a seeded split; held-out rounds are new sets of candidates, with
    the same items (a protocol over items generalises to them)."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction: must be in [0, 1), got {heldout_fraction}")
    order = list(tasks)
    random.Random(seed).shuffle(order)
    cut = round(len(order) * heldout_fraction)
    return order[cut:], order[:cut]


class ReferentialGame:
    """The game as a :class:`tracerl.envs.multi.MultiAgentEnv` (see the module docstring)."""

    agents: tuple[str, ...] = (SPEAKER, LISTENER)

    def __init__(self, tasks: Sequence[ReferentialTask], symbols: Sequence[str] = SYMBOLS) -> None:
        if not tasks:
            raise ValueError("tasks: must not be empty")
        self.symbols = check_agents(symbols)  # the same rules: distinct non-empty words
        self.tasks = {task.id: task for task in tasks}
        self._order = list(tasks)
        self.task: ReferentialTask | None = None
        self._turn: str | None = None

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> MultiReset:
        """Start a round: ``options["task_id"]`` picks it, else one is drawn with ``seed``."""
        options = options or {}
        if "task_id" in options:
            if options["task_id"] not in self.tasks:
                raise ValueError(f"options.task_id: unknown task {options['task_id']!r}")
            self.task = self.tasks[options["task_id"]]
        else:
            self.task = random.Random(seed).choice(self._order)
        self._turn = SPEAKER
        # Short on purpose: the one token that matters (the target, the word heard) is a
        # large share of what a tiny model reads, so conditioning on it is learned sooner.
        return MultiReset(
            observations={
                SPEAKER: f"target {self.task.target}",
                LISTENER: f"pick {' '.join(self.task.candidates)}",
            },
            next_agent=SPEAKER, info={"task_id": self.task.id})

    def choices(self, agent: str) -> tuple[str, ...] | None:
        """The speaker's symbols or the listener's candidates."""
        if agent == SPEAKER:
            return self.symbols
        if agent == LISTENER:
            return None if self.task is None else self.task.candidates
        raise ValueError(f"agent: {agent!r} is not an agent of this game ({SPEAKER}, {LISTENER})")

    def step(self, agent: str, action: str) -> MultiStep:
        """The speaker's word goes to the listener; the listener's pick ends the round."""
        if agent not in self.agents:
            raise ValueError(f"agent: {agent!r} is not an agent of this game "
                             f"({SPEAKER}, {LISTENER})")
        if self.task is None or self._turn is None:
            raise ValueError("step: the round is over or was never started; call reset()")
        if agent != self._turn:
            raise ValueError(f"step: it is the turn of {self._turn!r}, not of {agent!r}")
        word = action.strip()
        if agent == SPEAKER:
            self._turn = LISTENER
            return MultiStep(observations={LISTENER: f"heard {word}"},
                             next_agent=LISTENER,
                             info={"messages": [(SPEAKER, LISTENER)]})
        self._turn = None
        reward = float(word == self.task.target)
        return MultiStep(observations={}, next_agent=None,
                         rewards={SPEAKER: reward, LISTENER: reward}, terminated=True,
                         info={"picked": word, "target": self.task.target})

    def close(self) -> None:
        """Nothing to release."""
