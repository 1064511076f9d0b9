"""The Hermes tool-call format, defined once.

A call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the model's text.

Every part of tracerl that writes or reads a tool call goes through this module: the tiny
model's tokenizer and chat template (``models.tiny``), the environment's tool parser
(``envs.tools.parse_tool_call``), the tool-call grammar (``rollout.decoding.grammar``),
compaction's action descriptions (``rollout.collect.compaction``), the server's OpenAI
``tool_calls`` (``rollout.serve.recorder``) and the scripted demonstrations and policies.

Two readings of a text: :func:`first_tool_call` is lenient (a block left open at the end of
the text counts, as a reply cut at the token limit still says what it meant to call), and
:func:`tool_call_blocks` is strict (only closed blocks, as an OpenAI server answers them).
Imports nothing of tracerl.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
"""Opens a tool call; an ordinary (not special) token of the tiny tokenizer, so decoded text
keeps it."""
TOOL_CALL_CLOSE = "</tool_call>"
"""Closes a tool call."""

_OPEN = re.escape(TOOL_CALL_OPEN)
_CLOSE = re.escape(TOOL_CALL_CLOSE)
_LENIENT = re.compile(f"{_OPEN}(.*?)(?:{_CLOSE}|$)", re.DOTALL)
_STRICT = re.compile(f"{_OPEN}(.*?){_CLOSE}", re.DOTALL)


class ToolCallError(ValueError):
    """A tool-call block whose JSON is not a call; ``reason`` says which way."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        """``"json"`` (the block is not valid JSON) or ``"shape"`` (no string ``name``)."""


def render_tool_call(name: str, arguments: Mapping[str, object]) -> str:
    """The text of one tool call, exactly as the tiny model's chat template renders it."""
    payload = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{payload}{TOOL_CALL_CLOSE}"


def first_tool_call(text: str) -> str | None:
    """The JSON text (stripped) of the first tool call in ``text``, closed or left open at the
    end of the text; None when ``text`` has no ``<tool_call>``."""
    match = _LENIENT.search(text)
    return None if match is None else match.group(1).strip()


def tool_call_blocks(text: str) -> Iterator[tuple[int, str]]:
    """``(start, json_text)`` of every closed tool call in ``text``, in order: ``start`` is
    the offset of its ``<tool_call>``, ``json_text`` its stripped contents."""
    for match in _STRICT.finditer(text):
        yield match.start(), match.group(1).strip()


def decode_tool_call(json_text: str) -> tuple[str, Any]:
    """``(name, arguments)`` of a tool call's JSON text.

    ``arguments`` is returned as given (a missing one is ``{}``), except that a JSON string
    (the OpenAI wire format, which some templates copy) is decoded: an empty string is ``{}``
    and one that does not decode is None. Callers check that it is an object. Raises
    :class:`ToolCallError` when the text is not JSON or has no string ``name``.
    """
    try:
        payload = json.loads(json_text)
    except json.JSONDecodeError as error:
        raise ToolCallError(f"tool call is not valid JSON ({error.msg})", "json") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise ToolCallError('tool call needs "name" and "arguments"', "shape")
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            arguments = None
    return payload["name"], arguments
