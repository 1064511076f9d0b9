"""Fault injection: make tools crash, sandboxes fail to start, or tools run slowly, on purpose.

Used to test that a collector records each ending for the right reason: a crash here is the
infrastructure's fault (``info["tool_error"]``), never the agent's.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Literal

from tracerl.envs.sandbox import SandboxStartError

FaultKind = Literal["tool_crash", "sandbox_start_failure", "slow_tool"]
"""What was injected.

- ``tool_crash``: the tool raised before doing anything.
- ``sandbox_start_failure``: a tool that runs the sandbox found it would not start.
- ``slow_tool``: the tool ran normally after a delay of ``FaultConfig.slow_seconds``.
"""

SANDBOX_TOOLS = frozenset({"run_tests"})
"""Tools that start a sandbox, the only ones a sandbox start failure can hit."""


class InjectedToolCrash(RuntimeError):
    """A tool crash made on purpose by ``FaultInjector``."""

    fault: FaultKind = "tool_crash"


class InjectedSandboxStartFailure(SandboxStartError):
    """A sandbox start failure made on purpose by ``FaultInjector``."""

    fault: FaultKind = "sandbox_start_failure"


@dataclass(frozen=True)
class FaultConfig:
    """Probabilities of each fault, drawn independently per tool call."""

    tool_crash: float = 0.0
    """Probability that a tool call crashes."""
    sandbox_start_failure: float = 0.0
    """Probability that a sandboxed tool's sandbox fails to start."""
    slow_tool: float = 0.0
    """Probability that a tool call is delayed by ``slow_seconds``."""
    slow_seconds: float = 1.0
    """Delay of a slow tool call."""
    seed: int | None = None
    """Seed of the injector's own random stream (independent of the environment's)."""

    def __post_init__(self) -> None:
        for name in ("tool_crash", "sandbox_start_failure", "slow_tool"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
        if self.slow_seconds < 0:
            raise ValueError(f"slow_seconds must be >= 0, got {self.slow_seconds!r}")

    @property
    def active(self) -> bool:
        return self.tool_crash > 0 or self.sandbox_start_failure > 0 or self.slow_tool > 0


class FaultInjector:
    """Draws and applies faults before a tool runs."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)

    def before_tool(self, tool: str) -> FaultKind | None:
        """Apply at most one fault for a call of ``tool``; returns which one, if any.

        Crashes raise (``InjectedToolCrash`` or ``InjectedSandboxStartFailure``, both with a
        ``fault`` attribute); a slow tool sleeps
        and returns ``"slow_tool"`` so the caller can record it.
        """
        config = self.config
        # Draw all three every time so one kind's probability does not shift the others'.
        crash, start, slow = (self._rng.random() for _ in range(3))
        if crash < config.tool_crash:
            raise InjectedToolCrash(f"injected fault: {tool} crashed")
        if tool in SANDBOX_TOOLS and start < config.sandbox_start_failure:
            raise InjectedSandboxStartFailure("injected fault: the sandbox failed to start")
        if slow < config.slow_tool:
            time.sleep(config.slow_seconds)
            return "slow_tool"
        return None
