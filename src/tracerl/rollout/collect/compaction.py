"""Compaction: replacing a long history with a summary, without ending the task.

When an attempt's context passes ``CompactionConfig.threshold_tokens``, the collector closes
the current fragment with ``EndReason.CONTINUED`` and starts a new fragment whose first context
is the chat template over a summary of the attempt so far. That context is exactly what the
policy sees next, so it is also the state a critic bootstraps the closed fragment from (see
``trace.pack``). A compaction boundary is never terminal: the task, its files and its budgets
go on.

What a summary must keep is decision-relevant state, not prose: the instruction, the latest
test output, and the actions already tried, so the agent does not walk back into a dead end it
already explored. ``TemplateSummarizer`` keeps exactly those, deterministically;
``PolicySummarizer`` asks the policy itself to write the log of what was tried and keeps the
instruction and latest test output verbatim around it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tracerl.hermes import ToolCallError, decode_tool_call, first_tool_call

TextGenerator = Callable[[str], Awaitable[str]]
"""Sends one user message to the policy (fresh conversation) and returns its reply text."""

@dataclass(frozen=True)
class HistoryTurn:
    """One exchange of the attempt, as text."""

    action_text: str
    """What the policy wrote."""
    observation_text: str
    """What came back (empty if nothing did)."""
    tool: str | None = None
    """The tool the environment ran for it, if any (``info['tool']``)."""


@dataclass(frozen=True)
class History:
    """Everything a summarizer may use: the whole attempt so far, across fragments."""

    instruction: str
    """The attempt's first observation (the task statement)."""
    turns: tuple[HistoryTurn, ...]
    """Every turn since the attempt started, in order (earlier compactions included)."""
    fragment_index: int
    """Index of the fragment being closed."""

    @property
    def latest_test_output(self) -> str | None:
        """The observation of the most recent test run (``run_tests``), if any."""
        for turn in reversed(self.turns):
            if turn.tool == "run_tests":
                return turn.observation_text
        return None


class Summarizer(Protocol):
    """Turns a history into the text of the next fragment's first user message."""

    async def summarize(self, history: History, generate: TextGenerator) -> str: ...


def describe_action(action_text: str, limit: int = 120) -> str:
    """A one-line description of an action: its tool call as compact JSON, else its first line."""
    raw = first_tool_call(action_text)
    if raw is not None:
        try:
            name, arguments = decode_tool_call(raw)
        except ToolCallError as error:
            which = "unparseable" if error.reason == "json" else "malformed"
            text = f"{which} tool call {raw!r}"
        else:
            text = name + (f" {json.dumps(arguments, sort_keys=True)}" if arguments else "")
    else:
        first = action_text.strip().splitlines()[0] if action_text.strip() else ""
        text = f"no tool call: {first!r}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(text: str, limit: int) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "(empty)"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 12] + "\n[truncated]"


@dataclass(frozen=True)
class TemplateSummarizer:
    """Instruction, actions already tried (with the first line of each result), latest test
    output and the latest observation. Deterministic; uses no model."""

    max_actions: int = 20
    """Most recent actions listed; older ones are counted, not listed."""
    line_chars: int = 120
    """Longest description of one action or result."""
    output_chars: int = 1200
    """Longest test output or observation kept."""

    async def summarize(self, history: History, generate: TextGenerator) -> str:
        return self.render(history)

    def render(self, history: History) -> str:
        """The summary text (synchronous; ``summarize`` returns this)."""
        turns = history.turns
        shown = turns[-self.max_actions :]
        lines = [history.instruction, "", "[Earlier turns were replaced by this summary.]"]
        lines.append(f"Actions already tried ({len(turns)}):")
        if len(turns) > len(shown):
            lines.append(f"- ... {len(turns) - len(shown)} earlier actions")
        for turn in shown:
            lines.append(
                f"- {describe_action(turn.action_text, self.line_chars)} -> "
                f"{_first_line(turn.observation_text, self.line_chars)}"
            )
        test_output = history.latest_test_output
        if test_output is not None:
            lines += ["Latest test output:", _clip(test_output, self.output_chars)]
        if turns and turns[-1].tool != "run_tests":
            lines += ["Latest observation:", _clip(turns[-1].observation_text, self.output_chars)]
        return "\n".join(lines)


@dataclass(frozen=True)
class PolicySummarizer:
    """The policy writes the log of what was tried; the instruction, the latest test output and
    the latest observation are kept verbatim around it, so a poor summary cannot lose them.

    The summary call's tokens are not recorded as actions: they are context for the next
    fragment (role ``summary``), and the policy is not trained on writing them.
    """

    request: str = (
        "Summarize the attempt below for yourself. List every action already tried and what it "
        "showed, so that you do not repeat a dead end. Be brief."
    )
    """The instruction given to the policy before the transcript."""
    transcript_chars: int = 4000
    """Longest transcript sent (most recent turns kept)."""
    fallback: TemplateSummarizer = field(default_factory=TemplateSummarizer)
    """Renders the verbatim parts."""

    async def summarize(self, history: History, generate: TextGenerator) -> str:
        transcript = "\n".join(
            f"ACTION: {describe_action(t.action_text)}\nRESULT: {_first_line(t.observation_text, 200)}"
            for t in history.turns
        )
        transcript = transcript[-self.transcript_chars :]
        written = (await generate(f"{self.request}\n\n{transcript}")).strip()
        lines = [history.instruction, "", "[Earlier turns were replaced by this summary.]",
                 "Summary of what was tried:", written or "(empty summary)"]
        clip = self.fallback.output_chars
        if history.latest_test_output is not None:
            lines += ["Latest test output:", _clip(history.latest_test_output, clip)]
        if history.turns and history.turns[-1].tool != "run_tests":
            lines += ["Latest observation:", _clip(history.turns[-1].observation_text, clip)]
        return "\n".join(lines)


@dataclass(frozen=True)
class CompactionConfig:
    """When and how to compact an attempt's context."""

    threshold_tokens: int
    """Compact when the next context would be longer than this many tokens."""
    summarizer: Summarizer = field(default_factory=TemplateSummarizer)
    """Writes the next fragment's first user message."""
    summary_max_new_tokens: int = 128
    """Generation cap of a ``PolicySummarizer`` call."""
    max_fragments: int = 32
    """Most fragments per attempt; one more compaction ends it ``truncated_tokens``."""

    def __post_init__(self) -> None:
        if isinstance(self.threshold_tokens, bool) or self.threshold_tokens < 1:
            raise ValueError(f"threshold_tokens: must be >= 1, got {self.threshold_tokens!r}")
        if self.summary_max_new_tokens < 1:
            raise ValueError(
                f"summary_max_new_tokens: must be >= 1, got {self.summary_max_new_tokens}"
            )
        if self.max_fragments < 2:
            raise ValueError(f"max_fragments: must be >= 2, got {self.max_fragments}")
