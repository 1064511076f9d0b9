"""The coding pair: a tester who runs the tests and a fixer who edits, talking by messages.

One coding task (the built-in suite's, or any :class:`tracerl.envs.tasks.Task`), one workspace
in the sandbox (a :class:`tracerl.envs.coding.CodingEnv` underneath: the same tools, budgets,
verdicts and audit), two agents with disjoint powers:

- the **tester** may ``run_tests`` and ``view_file`` the test files (the task's protected
  files); it cannot edit;
- the **fixer** may ``view_file`` the code (every other file), ``replace``, ``undo`` and
  ``submit``; it cannot run the tests, nor read them.

Each may ``send_message`` (``{"name": "send_message", "arguments": {"text": ...}}``; an
optional ``to`` must name the other agent): the text is an observation of the other agent,
whose turn it then is. Any other call is answered to the caller, whose turn goes on. So what
fails (the test output) and what was changed (the edit) cross only in messages: a message that
drops "already tried A" loses it. A call outside the caller's powers, or a message to an agent
that does not exist, is the agent's mistake: an ``error:`` observation to it.

The tester acts first. ``submit`` ends the joint attempt with the hidden tests' verdict
(``tracerl.envs.verdict``, the audit applied) as the reward of both agents; the turn budget
(all agents' actions together) truncates it, scored by the same verdict on the files it left.
A tool or sandbox failure is ``info["tool_error"]``: infrastructure, scored for nobody.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

from tracerl.envs.coding import CodingEnv
from tracerl.envs.multi import MultiReset, MultiStep
from tracerl.envs.sandbox import Sandbox
from tracerl.envs.tasks import Task
from tracerl.envs.tools import parse_tool_call

TESTER = "tester"
"""Runs and reads the tests; cannot edit."""
FIXER = "fixer"
"""Views and edits the code, submits; cannot run or read the tests."""
POWERS: dict[str, frozenset[str]] = {
    TESTER: frozenset({"run_tests", "view_file", "send_message"}),
    FIXER: frozenset({"view_file", "replace", "undo", "send_message", "submit"}),
}
"""The calls each agent may make."""


class CodingPairEnv:
    """The coding pair as a :class:`tracerl.envs.multi.MultiAgentEnv` (module docstring)."""

    agents: tuple[str, ...] = (TESTER, FIXER)

    def __init__(self, tasks: Sequence[Task], *, sandbox: Sandbox | None = None,
                 max_turns: int = 16) -> None:
        if max_turns < 2:
            raise ValueError(f"max_turns: must be >= 2 (each agent acts), got {max_turns}")
        # The inner budget never ends the pair's attempt first: this one counts every action.
        self.inner = CodingEnv(tasks, sandbox=sandbox, max_turns=max_turns + 1)
        self.max_turns = max_turns
        self._turn: str | None = None
        self._actions = 0

    @property
    def task(self) -> Task | None:
        """The task of the current joint attempt."""
        return self.inner.task

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> MultiReset:
        """Start a joint attempt at ``options["task_id"]`` (or a task drawn with ``seed``)."""
        statement, info = self.inner.reset(seed=seed, options=options)
        task = self.inner.task
        assert task is not None
        tests = ", ".join(p for p in sorted(task.files) if self._is_test(p))
        self._turn, self._actions = TESTER, 0
        return MultiReset(
            observations={
                TESTER: (f"You are the tester. You can run_tests and view_file the tests "
                         f"({tests}); you cannot edit. Tell the fixer what fails with "
                         f"send_message.\n{statement}"),
                FIXER: ("You are the fixer. You can view_file and replace the code, undo, "
                        "and submit; you cannot run or read the tests. The tester tells you "
                        f"what fails.\n{statement}"),
            },
            next_agent=TESTER, info=info)

    def choices(self, agent: str) -> None:
        """Free text: tool calls."""
        return None

    def _is_test(self, path: str) -> bool:
        task = self.inner.task
        return task is not None and any(fnmatch.fnmatch(path, g) for g in task.protected)

    def _other(self, agent: str) -> str:
        return FIXER if agent == TESTER else TESTER

    def step(self, agent: str, action: str) -> MultiStep:
        """Run ``agent``'s call (see the module docstring)."""
        if agent not in self.agents:
            raise ValueError(f"agent: {agent!r} is not an agent of the coding pair "
                             f"({TESTER}, {FIXER})")
        if self._turn is None:
            raise ValueError("step: the joint attempt is over or was never started; call "
                             "reset()")
        if agent != self._turn:
            raise ValueError(f"step: it is the turn of {self._turn!r}, not of {agent!r}")
        self._actions += 1
        parsed = parse_tool_call(action)
        name, arguments = parsed.raw_name, dict(parsed.raw_arguments or {})
        if name == "send_message":
            return self._message(agent, arguments)
        if name is not None and name not in POWERS[agent]:
            return self._answer(agent, f"error: the {agent} cannot call {name} (it may call "
                                       f"{', '.join(sorted(POWERS[agent]))})")
        if name == "view_file":
            path = arguments.get("path", self.inner.open_file)
            if isinstance(path, str) and self._is_test(path) != (agent == TESTER):
                what = "only the tests" if agent == TESTER else "the code, not the tests"
                return self._answer(agent, f"error: the {agent} may view {what}")
        observation, reward, terminated, _truncated, info = self.inner.step(action)
        if info.get("tool_error"):
            self._turn = None
            return MultiStep({agent: observation}, None, info={"tool_error": True, **info})
        if terminated:
            self._turn = None
            if getattr(info.get("audit"), "flagged", False):
                reward = 0.0  # a flagged attempt never counts as solving
            return MultiStep({}, None, rewards={TESTER: float(reward), FIXER: float(reward)},
                             terminated=True, info=info)
        return self._answer(agent, observation, info)

    def _message(self, agent: str, arguments: dict[str, Any]) -> MultiStep:
        text, to = arguments.get("text"), arguments.get("to", self._other(agent))
        if not isinstance(text, str) or not text:
            return self._answer(agent, 'error: send_message: give "text"')
        if to not in self.agents or to == agent:
            return self._answer(agent, f"error: send_message: no agent {to!r} to send to "
                                       f"(the other agent is {self._other(agent)!r})")
        if self._actions >= self.max_turns:
            return self._truncate({to: f"message from {agent}: {text}"})
        self._turn = to
        return MultiStep({to: f"message from {agent}: {text}"}, to,
                         info={"messages": [(agent, to)], "tool": "send_message"})

    def _answer(self, agent: str, observation: str,
                info: dict[str, Any] | None = None) -> MultiStep:
        if self._actions >= self.max_turns:
            return self._truncate({agent: observation})
        return MultiStep({agent: observation}, agent, info=dict(info or {}))

    def _truncate(self, observations: dict[str, str]) -> MultiStep:
        """The turn budget is spent: the files left are scored (a failure to score them is
        the infrastructure's)."""
        self._turn = None
        try:
            verdict = self.inner.verify()
            audit = self.inner.audit(verdict)
        except Exception as error:
            return MultiStep(observations, None, info={
                "tool_error": True, "verify_error": f"{type(error).__name__}: {error}"})
        reward = 0.0 if audit.flagged else float(verdict.reward)
        return MultiStep(observations, None, rewards={TESTER: reward, FIXER: reward},
                         truncated=True, info={"verify": verdict})

    def close(self) -> None:
        """Delete the workspace."""
        self.inner.close()
