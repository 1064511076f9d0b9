"""Growing a conversation by appending token ids, so the recorded tokens are the ones fed.

Re-rendering the whole chat history with the template every turn re-tokenizes the sampled
assistant text, which can change earlier tokens (BPE merges across what were separate
samples, a template that rewrites old turns) and silently break the link between the action
tokens and the context they were conditioned on. Instead, the collector renders each piece
once and appends it:

- the first prompt: the template over the opening messages, with the generation prompt;
- after an action: the tokens the template puts after an assistant message's content (e.g. an
  end-of-message token) that the policy did not sample itself;
- an observation: what the template adds for one more tool (or user) message plus the next
  generation prompt.

The last two are measured once, as token differences between renderings of probe
conversations, which works for any template that only appends when a message is added.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

CONVERSATION_FILE = "tracerl_conversation.json"
"""Written beside a trained checkpoint: how its conversations were rendered (tool schemas in
the prompt or not, the system prompt), so an evaluation renders them the same way."""


def conversation_json(*, tool_schemas_in_prompt: bool, system_prompt: str | None,
                      constrain_edits: bool = False, constrain_calls: bool = False) -> str:
    """The content of ``CONVERSATION_FILE`` for a policy trained with this format
    (``constrain_edits``: its edits were decoded under ``rollout.decoding.constraints.EditConstraint``;
    ``constrain_calls``: its actions under ``rollout.decoding.grammar.ToolCallGrammar``)."""
    return json.dumps({"tool_schemas_in_prompt": tool_schemas_in_prompt,
                       "system_prompt": system_prompt, "constrain_edits": constrain_edits,
                       "constrain_calls": constrain_calls})


def write_conversation(directory: str | Path, *, tool_schemas_in_prompt: bool,
                       system_prompt: str | None, constrain_edits: bool = False,
                       constrain_calls: bool = False) -> None:
    """Record the conversation format a policy was trained with in ``directory``."""
    (Path(directory) / CONVERSATION_FILE).write_text(
        conversation_json(tool_schemas_in_prompt=tool_schemas_in_prompt,
                          system_prompt=system_prompt, constrain_edits=constrain_edits,
                          constrain_calls=constrain_calls),
        encoding="utf-8")


def read_conversation(directory: str | Path) -> dict[str, Any] | None:
    """The recorded conversation format of a checkpoint, or None when it has none (a model
    not trained by tracerl: the environment's tool schemas go in the prompt)."""
    path = Path(directory) / CONVERSATION_FILE
    if not path.is_file():
        return None
    record: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return record

ObservationRole = Literal["tool", "user"]
"""Chat role that carries the environment's observations."""


class ChatRenderer(Protocol):
    """Renders messages with a chat template to token ids (``HFPolicy.chat_prompt`` is one)."""

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...


class ChatTokens:
    """Token pieces of one conversation format (template, tools, system prompt, roles)."""

    def __init__(
        self,
        renderer: ChatRenderer,
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        system_prompt: str | None = None,
        observation_role: ObservationRole = "tool",
    ) -> None:
        if observation_role not in ("tool", "user"):
            raise ValueError(f"observation_role: must be 'tool' or 'user', got {observation_role!r}")
        self._renderer = renderer
        self.tools = [dict(t) for t in tools] if tools else None
        self.system_prompt = system_prompt
        self.observation_role = observation_role
        self.closing: tuple[int, ...] = self._measure_closing()
        """Tokens the template puts after an assistant message's content."""
        self._probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        self._probe_ids = self._render(self._probe, False)

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return list(self._renderer.chat_prompt(
            head + messages, tools=self.tools, add_generation_prompt=generation_prompt
        ))

    def _suffix(self, shorter: list[int], longer: list[int], what: str) -> list[int]:
        if longer[: len(shorter)] != shorter:
            raise ValueError(
                f"chat template: adding {what} changes earlier tokens; the collector needs a "
                "template that only appends (the recorded context must be what was fed)"
            )
        return longer[len(shorter) :]

    def _measure_closing(self) -> tuple[int, ...]:
        opening = self._render([{"role": "user", "content": "x"}], True)
        bodies = []
        for content in ("a", "b"):
            full = self._render(
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": content}], False
            )
            bodies.append(self._suffix(opening, full, "an assistant message"))
        first, second = bodies
        # The content tokens differ ('a' vs 'b'); what both end with is the template's closing.
        n = 0
        while n < min(len(first), len(second)) - 1 and first[-1 - n] == second[-1 - n]:
            n += 1
        return tuple(first[len(first) - n :])

    def first_prompt(self, observation: str) -> list[int]:
        """The opening context: system prompt and tools (if any), the first observation as a
        user message, and the generation prompt."""
        return self._render([{"role": "user", "content": observation}], True)

    def opening(self, observation: str) -> list[int]:
        """The opening context without the generation prompt, for an agent that receives
        observations (another agent's messages) before it first acts: they follow as
        :meth:`observation`, whose tokens end with the generation prompt."""
        opening = self._render([{"role": "user", "content": observation}], False)
        return self._suffix([], opening, "the first message")

    def after_action(self, action_ids: Sequence[int]) -> list[int]:
        """The closing tokens the policy did not sample (none of them when it ended its message
        with the closing's first token, e.g. EOS; all of them when it was cut off)."""
        closing = list(self.closing)
        ids = list(action_ids)
        for k in range(len(closing), 0, -1):
            if len(ids) >= k and ids[-k:] == closing[:k]:
                return closing[k:]
        return closing

    def observation(self, text: str) -> list[int]:
        """Tokens of one observation message followed by the next generation prompt."""
        after = self._render(
            [*self._probe, {"role": self.observation_role, "content": text}], True
        )
        return self._suffix(self._probe_ids, after, "an observation message")
