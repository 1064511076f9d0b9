"""Fault injection: tools that fail as real tools do, and infrastructure that fails, on purpose.

Two families, kept apart because they mean different things to an evaluation:

- **Tool faults**, inside the agent's world: a command that fails, a command that times out, a
  flaky test run, a truncated output (and a slow tool). Each comes back to the agent as the
  observation such a tool would give, and the attempt goes on: a policy that checks and tries
  again can recover, one that does not fails. They measure recovery.
- **Infrastructure faults**, outside it: the tool's own code crashes, or the sandbox cannot
  start. They set ``info["tool_error"]``, and the collector ends the attempt ``tool_error``:
  the infrastructure's fault, never the agent's, excluded (and counted) by the evaluation.

Every injected fault is reported in the step's ``info["fault"]``; the collector records an
attempt's faults in its metadata (``injected_faults``) so evaluation can count faulted
attempts and how many of them still succeeded.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Literal

from tracerl.envs.sandbox import SandboxStartError

FaultKind = Literal["tool_crash", "sandbox_start_failure", "slow_tool", "command_failure",
                    "command_timeout", "flaky_test", "truncated_output"]
"""What was injected.

Infrastructure (the attempt ends ``tool_error``):

- ``tool_crash``: the tool raised before doing anything.
- ``sandbox_start_failure``: a tool that runs the sandbox found it would not start.

Tool faults (an observation; the attempt goes on):

- ``command_failure``: the tool did not do its work and says it failed (an I/O error).
- ``command_timeout``: the tool did not finish in time and says so; nothing was changed.
- ``flaky_test``: the tests ran, but the run reports a spurious failure instead of their
  result (as a flaky test does); running them again gives the real result.
- ``truncated_output``: the tool ran, but only the first half of its output came back.
- ``slow_tool``: the tool ran normally after a delay of ``FaultConfig.slow_seconds``.
"""

INFRASTRUCTURE_FAULTS: frozenset[FaultKind] = frozenset({"tool_crash", "sandbox_start_failure"})
"""Faults outside the agent's world: they end the attempt as ``tool_error``."""

TOOL_FAULTS: tuple[FaultKind, ...] = ("command_failure", "command_timeout", "flaky_test",
                                      "truncated_output")
"""Faults the agent sees as observations and can recover from (``slow_tool`` aside)."""

SKIPS_TOOL: frozenset[FaultKind] = frozenset({"command_failure", "command_timeout"})
"""Tool faults after which the tool has done nothing (no file changed)."""

SANDBOX_TOOLS = frozenset({"run_tests"})
"""Tools that start a sandbox, the only ones a sandbox start failure can hit."""

_APPLIES: dict[FaultKind, frozenset[str] | None] = {
    "command_failure": None,  # every tool
    "command_timeout": None,
    "flaky_test": SANDBOX_TOOLS,
    "truncated_output": frozenset({"list_files", "view_file", "run_tests"}),
}
"""The tools each tool fault can hit (None: all of them)."""

TRUNCATION_MARK = "\n[output truncated]"
"""What a truncated output ends with (the sandbox marks its own output cap the same way)."""


class InjectedToolCrash(RuntimeError):
    """A tool crash made on purpose by ``FaultInjector``."""

    fault: FaultKind = "tool_crash"


class InjectedSandboxStartFailure(SandboxStartError):
    """A sandbox start failure made on purpose by ``FaultInjector``."""

    fault: FaultKind = "sandbox_start_failure"


@dataclass(frozen=True)
class FaultConfig:
    """Probabilities of each fault per tool call, and how many faults an attempt gets."""

    tool_crash: float = 0.0
    """Probability that a tool call crashes (infrastructure)."""
    sandbox_start_failure: float = 0.0
    """Probability that a sandboxed tool's sandbox fails to start (infrastructure)."""
    command_failure: float = 0.0
    """Probability that a tool call fails without doing its work."""
    command_timeout: float = 0.0
    """Probability that a tool call times out without doing its work."""
    flaky_test: float = 0.0
    """Probability that a test run reports a spurious failure."""
    truncated_output: float = 0.0
    """Probability that a tool's output (files, a file, a test run) comes back cut."""
    any_tool_fault: float = 0.0
    """Instead of the four above: probability that a tool call gets a tool fault, of a kind
    drawn evenly among those that can hit that tool (so every tool is hit at this rate)."""
    slow_tool: float = 0.0
    """Probability that a tool call is delayed by ``slow_seconds``."""
    slow_seconds: float = 1.0
    """Delay of a slow tool call."""
    max_per_attempt: int | None = None
    """Faults of any kind injected into one attempt at most (None: no limit); 1 gives each
    attempt a single fault to recover from."""
    seed: int | None = None
    """Seed of the injector's own random stream (independent of the environment's)."""

    def __post_init__(self) -> None:
        for name in ("tool_crash", "sandbox_start_failure", *TOOL_FAULTS, "slow_tool"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
        if not 0.0 <= self.any_tool_fault <= 1.0:
            raise ValueError(f"any_tool_fault must be a probability in [0, 1], "
                             f"got {self.any_tool_fault!r}")
        total = sum(getattr(self, name) for name in TOOL_FAULTS)
        if self.any_tool_fault > 0 and total > 0:
            raise ValueError("any_tool_fault: give it or the probabilities of the single "
                             f"kinds ({', '.join(TOOL_FAULTS)}), not both")
        if total > 1.0 + 1e-9:
            raise ValueError(f"{', '.join(TOOL_FAULTS)}: at most one hits a call, so their "
                             f"probabilities must sum to <= 1, got {total!r}")
        if self.slow_seconds < 0:
            raise ValueError(f"slow_seconds must be >= 0, got {self.slow_seconds!r}")
        if self.max_per_attempt is not None and self.max_per_attempt < 0:
            raise ValueError(f"max_per_attempt must be >= 0 or None, got {self.max_per_attempt!r}")

    @classmethod
    def tool_faults(cls, rate: float, *, seed: int | None = None,
                    infrastructure: float = 0.0) -> FaultConfig:
        """A tool fault at ``rate`` per call (``any_tool_fault``), and ``infrastructure`` as the
        probability that a test run's sandbox fails to start (what ``tracerl eval
        --inject-faults RATE --inject-infrastructure-faults P`` uses)."""
        return cls(sandbox_start_failure=infrastructure, any_tool_fault=rate, seed=seed)

    @property
    def active(self) -> bool:
        return any(getattr(self, name) > 0 for name in
                   ("tool_crash", "sandbox_start_failure", *TOOL_FAULTS, "any_tool_fault",
                    "slow_tool"))


class FaultInjector:
    """Draws and applies faults before a tool runs."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._injected = 0

    def new_attempt(self) -> None:
        """Start counting toward ``max_per_attempt`` again (called at every reset)."""
        self._injected = 0

    def before_tool(self, tool: str) -> FaultKind | None:
        """Draw at most one fault for a call of ``tool``; returns which one, if any.

        Infrastructure faults raise (``InjectedToolCrash`` or ``InjectedSandboxStartFailure``,
        both with a ``fault`` attribute). A slow tool sleeps and returns ``"slow_tool"``. A tool
        fault is returned for the caller to apply: :func:`skipped_observation` instead of the
        tool for those in ``SKIPS_TOOL``, :func:`after_tool` on the tool's output otherwise.
        """
        config = self.config
        # Draw all four every time so one kind's probability does not shift the others'.
        crash, start, tool_fault, slow = (self._rng.random() for _ in range(4))
        limit = config.max_per_attempt
        if limit is not None and self._injected >= limit:
            return None
        kind: FaultKind | None = None
        if crash < config.tool_crash:
            kind = "tool_crash"
        elif tool in SANDBOX_TOOLS and start < config.sandbox_start_failure:
            kind = "sandbox_start_failure"
        else:
            kind = _pick_tool_fault(config, tool, tool_fault)
            if kind is None and slow < config.slow_tool:
                kind = "slow_tool"
        if kind is None:
            return None
        self._injected += 1
        if kind == "tool_crash":
            raise InjectedToolCrash(f"injected fault: {tool} crashed")
        if kind == "sandbox_start_failure":
            raise InjectedSandboxStartFailure("injected fault: the sandbox failed to start")
        if kind == "slow_tool":
            time.sleep(config.slow_seconds)
        return kind


def _pick_tool_fault(config: FaultConfig, tool: str, draw: float) -> FaultKind | None:
    """The tool fault ``draw`` (uniform in [0, 1)) falls on, among those that can hit ``tool``."""
    kinds = [kind for kind in TOOL_FAULTS
             if (applies := _APPLIES[kind]) is None or tool in applies]
    if config.any_tool_fault > 0:
        if draw >= config.any_tool_fault or not kinds:
            return None
        return kinds[min(int(draw / config.any_tool_fault * len(kinds)), len(kinds) - 1)]
    edge = 0.0
    for kind in kinds:
        edge += getattr(config, kind)
        if draw < edge:
            return kind
    return None


def skipped_observation(kind: FaultKind, tool: str) -> str:
    """What a tool that did nothing because of ``kind`` answers (a test run answers as a
    failed run does; the other tools with an ``error:`` line)."""
    if kind == "command_failure":
        detail = "OSError: [Errno 5] Input/output error"
        return f"FAIL\n{detail}" if tool in SANDBOX_TOOLS else f"error: {tool}: {detail}"
    if kind == "command_timeout":
        return "FAIL\nkilled: timeout" if tool in SANDBOX_TOOLS else f"error: {tool}: timed out"
    raise ValueError(f"kind: {kind!r} does not replace the tool's work")


def after_tool(kind: FaultKind, observation: str) -> str:
    """The tool's ``observation`` as a fault of ``kind`` changes it (unchanged for kinds that
    do not touch the output)."""
    if kind == "flaky_test":
        return "FAIL\nConnectionResetError: [Errno 104] Connection reset by peer"
    if kind == "truncated_output":
        return observation[: max(1, len(observation) // 2)] + TRUNCATION_MARK
    return observation
