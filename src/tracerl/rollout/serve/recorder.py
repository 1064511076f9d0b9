"""Token-level traces of HTTP sessions, and the Hermes tool-call text <-> OpenAI ``tool_calls``.

An agent talking to ``tracerl serve`` sends its whole conversation on every request, as text
messages. Re-tokenizing that text would not reproduce the tokens the model actually sampled
(a tokenizer may split the same text differently), so a session keeps its token context —
every prompt token and every sampled token, in order — and builds the next prompt as that
context plus the tokens of what is new (tool results, user messages, template markup). What is
new is recorded as ``observation``; what the model sampled as ``action`` with its behavior
logprobs. When the agent rewrites its history (its own compaction, an edited message), the new
context no longer extends the old one: the current fragment closes as ``continued`` and a new
fragment starts from the new prompt, so the trace still shows exactly what the model saw.

A session is written to the trace store once, when it is finished (``SessionRecorder.finish``),
or as ``cancelled`` when the server stops with it still open: the store is append-only and a
half-recorded attempt is never written as if it were complete.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracerl.hermes import ToolCallError, decode_tool_call, tool_call_blocks
from tracerl.trace.schema import (
    Attempt,
    Costs,
    EndReason,
    Fragment,
    Role,
    Segment,
    Timings,
    Turn,
    check_attempt,
)
from tracerl.trace.schema import SamplingParams as TraceSamplingParams
from tracerl.trace.store import TraceStore


@dataclass(frozen=True)
class ParsedToolCall:
    """One tool call found in generated text, in the OpenAI wire shape."""

    name: str
    """The function's name."""
    arguments: str
    """Its arguments as a JSON object text (``json.dumps`` of what the model wrote)."""
    call_id: str
    """Id the agent echoes in the ``tool`` message that answers the call."""

    def to_openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_hermes_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """Split generated text into (content, tool calls).

    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks whose JSON parses and
    names a function become tool calls; the content is the text before the first of them
    (None if that is empty and there are calls, as OpenAI servers answer). A block that does not
    parse is not a tool call: the whole text stays content, so the agent sees what the model
    wrote instead of a silently dropped call.
    """
    calls: list[ParsedToolCall] = []
    first_start: int | None = None
    for start, raw in tool_call_blocks(text):
        try:
            name, arguments = decode_tool_call(raw)
        except ToolCallError:
            return text, []
        if not isinstance(arguments, dict):
            return text, []
        if first_start is None:
            first_start = start
        calls.append(
            ParsedToolCall(
                name,
                json.dumps(arguments, ensure_ascii=False),
                f"call_{uuid.uuid4().hex[:24]}",
            )
        )
    if not calls:
        return text, []
    content = text[:first_start]
    return (content if content else None), calls


def normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message reduced to what the chat template renders, for comparison and rendering.

    Content given as a list of ``{"type": "text", "text": ...}`` parts is joined; tool-call
    arguments are kept as the JSON text the agent sent.
    """
    if not isinstance(message, Mapping):
        raise ValueError(f"messages: each message must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "tool", "developer"):
        raise ValueError(f"messages: unknown role {role!r}")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError("messages: only text content parts are supported")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"messages: content must be a string, a list of parts or null ({role})")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if role == "assistant" and message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function", {}) if isinstance(call, Mapping) else {}
            name, arguments = function.get("name"), function.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise ValueError("messages: a tool call needs function.name and function.arguments")
            calls.append(
                {"id": call.get("id"), "type": "function",
                 "function": {"name": name, "arguments": arguments}}
            )
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def same_message(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two normalized messages render the same (empty content equals null content)."""
    if a["role"] != b["role"] or (a.get("content") or "") != (b.get("content") or ""):
        return False
    calls_a, calls_b = a.get("tool_calls") or [], b.get("tool_calls") or []
    if len(calls_a) != len(calls_b):
        return False
    for x, y in zip(calls_a, calls_b, strict=True):
        if x["function"]["name"] != y["function"]["name"]:
            return False
        try:
            if json.loads(x["function"]["arguments"]) != json.loads(y["function"]["arguments"]):
                return False
        except json.JSONDecodeError:
            return False
    return True


@dataclass
class _Session:
    key: str
    started_at: float
    fragments: list[Fragment] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    """Every token of the current fragment so far: prompts, observations and actions."""
    context_text: str = ""
    """Chat sessions: the rendered text ``context`` stands for (empty if unknown)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """Chat sessions: the last request's messages plus the assistant message returned."""
    last_finish: str | None = None
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    n_turns: int = 0
    tool_calls: int = 0
    model: str = ""


@dataclass(frozen=True)
class Sample:
    """What the policy sampled for one request, as the recorder needs it."""

    token_ids: Sequence[int]
    """Sampled tokens."""
    logprobs: Sequence[float]
    """Behavior logprob of each sampled token."""
    finish_reason: str
    """``"stop"`` or ``"length"``."""
    policy_version: int
    """Version of the weights that sampled them."""
    sampling: TraceSamplingParams
    """The distribution they were sampled from."""
    engine: str
    """The engine that sampled them."""
    seconds: float = 0.0
    """Wall time of the generation call."""
    tool_calls: int = 0
    """Tool calls parsed from the sampled text."""


class SessionRecorder:
    """Keeps each open session's token trace and writes finished ones to a ``TraceStore``.

    Thread-safe: the HTTP handlers call it from the event loop and from worker threads.
    ``store`` may be None, in which case finished attempts are only returned (and kept in
    ``finished``), which is what tests and dry runs use.
    """

    def __init__(self, store: TraceStore | None) -> None:
        self.store = store
        self.finished: list[Attempt] = []
        """Attempts finished by this recorder, in order (written to the store too, if any)."""
        self._sessions: dict[str, _Session] = {}
        self._used_ids: set[str] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ prompt building

    def chat_prompt(
        self,
        key: str | None,
        messages: list[dict[str, Any]],
        render: Any,
        encode: Any,
    ) -> tuple[list[int], str]:
        """Prompt token ids for a chat request, reusing the session's sampled tokens.

        ``render(messages, add_generation_prompt)`` gives the chat-template text and
        ``encode(text)`` its token ids. Returns (prompt ids, rendered prompt text).
        """
        full_text: str = render(messages, True)
        with self._lock:
            session = self._sessions.get(key) if key is not None else None
            if session is not None and session.context:
                if session.context_text and full_text.startswith(session.context_text):
                    delta = full_text[len(session.context_text) :]
                    return session.context + list(encode(delta)), full_text
                # The agent's copy of the assistant message may render differently from the
                # sampled tokens (JSON spacing, a cut stop string); when it is the message we
                # returned, the sampled tokens stand for it and only what follows is encoded.
                n_prev = len(session.messages)
                if (
                    n_prev
                    and session.last_finish == "stop"
                    and len(messages) > n_prev
                    and all(same_message(a, b) for a, b in zip(messages, session.messages, strict=False))
                ):
                    prefix_text: str = render(messages[:n_prev], False)
                    if full_text.startswith(prefix_text):
                        delta = full_text[len(prefix_text) :]
                        return session.context + list(encode(delta)), full_text
        return list(encode(full_text)), full_text

    # ------------------------------------------------------------------ recording

    def record(
        self,
        key: str,
        prompt_ids: Sequence[int],
        sample: Sample,
        *,
        model: str = "",
        prompt_text: str = "",
        sampled_text: str = "",
        messages: list[dict[str, Any]] | None = None,
    ) -> None:
        """Append one request/response turn to session ``key`` (opened on first use).

        The part of ``prompt_ids`` that extends the session's context is an observation; a
        prompt that does not extend it starts a new fragment (the open one ends ``continued``).
        """
        prompt = [int(t) for t in prompt_ids]
        action = Segment(
            Role.ACTION,
            np.asarray(sample.token_ids, dtype=np.int64),
            logprobs=np.asarray(sample.logprobs, dtype=np.float32),
            sampling=sample.sampling,
            policy_version=sample.policy_version,
            engine=sample.engine,
        )
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = _Session(key, time.time(), model=model)
            n = len(session.context)
            if session.context and prompt[:n] == session.context and len(prompt) > n:
                context_segment = Segment(Role.OBSERVATION, np.asarray(prompt[n:], dtype=np.int64))
            else:
                if session.turns:
                    session.fragments.append(
                        Fragment(len(session.fragments), tuple(session.turns), EndReason.CONTINUED)
                    )
                session.turns = []
                context_segment = Segment(Role.PROMPT, np.asarray(prompt, dtype=np.int64))
            session.turns.append(Turn((context_segment, action)))
            session.context = prompt + [int(t) for t in sample.token_ids]
            session.context_text = prompt_text + sampled_text if prompt_text else ""
            session.messages = list(messages or [])
            session.last_finish = sample.finish_reason
            session.generated_tokens += len(sample.token_ids)
            session.generation_seconds += sample.seconds
            session.n_turns += 1
            session.tool_calls += sample.tool_calls

    def open_sessions(self) -> list[str]:
        """Keys of sessions recorded but not finished."""
        with self._lock:
            return list(self._sessions)

    def session_summary(self, key: str) -> dict[str, Any]:
        """Counts of an open session (ValueError if there is none)."""
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                raise ValueError(f"session: no open session {key!r}")
            return {
                "session": key,
                "turns": session.n_turns,
                "fragments": len(session.fragments) + 1,
                "context_tokens": len(session.context),
                "generated_tokens": session.generated_tokens,
            }

    def finish(
        self,
        key: str,
        *,
        end: EndReason | str = EndReason.TERMINATED,
        reward: float | None = None,
        task_id: str | None = None,
        group_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Attempt:
        """Close session ``key``, write its attempt to the store and return it.

        ``end`` is why the attempt ended (any attempt ending; ``continued`` is refused, it is
        not an ending). ValueError if the session is unknown.
        """
        end = EndReason(end)
        if end is EndReason.CONTINUED:
            raise ValueError("end_reason: 'continued' is not an attempt ending")
        with self._lock:
            session = self._sessions.pop(key, None)
            if session is None:
                raise ValueError(f"session: no open session {key!r} (nothing was generated)")
            attempt_id = key
            suffix = 1
            while attempt_id in self._used_ids or (
                self.store is not None and attempt_id in self.store
            ):
                suffix += 1
                attempt_id = f"{key}/{suffix}"
            self._used_ids.add(attempt_id)
        fragments = [
            *session.fragments,
            Fragment(len(session.fragments), tuple(session.turns), end),
        ]
        attempt = Attempt(
            attempt_id=attempt_id,
            task_id=task_id or key,
            group_id=group_id or task_id or key,
            fragments=tuple(fragments),
            reward=reward,
            timings=Timings(
                started_at=session.started_at,
                finished_at=time.time(),
                generation_seconds=session.generation_seconds,
            ),
            costs=Costs(generated_tokens=session.generated_tokens, turns=session.n_turns,
                        tool_calls=session.tool_calls),
            metadata={"source": "serve", "session": key, "model": session.model,
                      **dict(metadata or {})},
        )
        problems = check_attempt(attempt)
        if problems:
            raise ValueError(f"session {key!r} does not form a valid attempt: {problems[0]}")
        with self._lock:
            if self.store is not None:
                self.store.append(attempt)
            self.finished.append(attempt)
        return attempt

    def finish_all(self, end: EndReason | str = EndReason.CANCELLED,
                   metadata: Mapping[str, Any] | None = None) -> list[Attempt]:
        """Finish every open session with ``end`` (the server stops: nothing is lost)."""
        return [self.finish(key, end=end, metadata=metadata) for key in self.open_sessions()]
