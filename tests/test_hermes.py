"""The one definition of the tool-call text format, and its readers agreeing with it."""

from __future__ import annotations

import pytest

from tracerl.envs.tools import parse_tool_call
from tracerl.hermes import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCallError,
    decode_tool_call,
    first_tool_call,
    render_tool_call,
    tool_call_blocks,
)
from tracerl.models.tiny import CHAT_TEMPLATE, train_tokenizer
from tracerl.rollout.collect.compaction import describe_action
from tracerl.rollout.serve.recorder import parse_hermes_tool_calls


def test_render_is_read_back_by_every_reader() -> None:
    text = "I will look. " + render_tool_call("view_file", {"path": "café.py"})
    assert text.endswith('<tool_call>{"name": "view_file", "arguments": {"path": "café.py"}}'
                         "</tool_call>")
    assert decode_tool_call(first_tool_call(text) or "") == ("view_file", {"path": "café.py"})
    parsed = parse_tool_call(text)
    assert parsed.call is not None and parsed.call.arguments == {"path": "café.py"}
    content, calls = parse_hermes_tool_calls(text)
    assert content == "I will look. " and [c.name for c in calls] == ["view_file"]
    assert describe_action(text) == 'view_file {"path": "caf\\u00e9.py"}'


def test_the_chat_template_renders_what_render_tool_call_writes() -> None:
    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 4, vocab_size=300)
    messages = [{"role": "user", "content": "fix it"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"function": {"name": "submit", "arguments": {}}}]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert render_tool_call("submit", {}) in rendered
    assert TOOL_CALL_OPEN in CHAT_TEMPLATE and TOOL_CALL_CLOSE in CHAT_TEMPLATE


def test_lenient_and_strict_readings_of_an_open_block() -> None:
    cut = 'a <tool_call>{"name": "submit", "arguments": {}}'  # cut at the token limit
    assert first_tool_call(cut) == '{"name": "submit", "arguments": {}}'
    assert list(tool_call_blocks(cut)) == []
    two = render_tool_call("a", {}) + " and " + render_tool_call("b", {"x": "1"})
    assert [(start, decode_tool_call(raw)[0]) for start, raw in tool_call_blocks(two)] == [
        (0, "a"), (two.index(TOOL_CALL_OPEN, 1), "b")]
    assert first_tool_call("no call here") is None


def test_decode_names_what_is_wrong() -> None:
    with pytest.raises(ToolCallError, match=r"not valid JSON") as error:
        decode_tool_call('{"name": ')
    assert error.value.reason == "json"
    with pytest.raises(ToolCallError, match='needs "name" and "arguments"') as error:
        decode_tool_call('{"arguments": {}}')
    assert error.value.reason == "shape"
    # Arguments given as a JSON string (the OpenAI wire format) are decoded; an empty string
    # is no arguments and an undecodable one is None, for the caller to refuse.
    assert decode_tool_call('{"name": "f", "arguments": "{\\"a\\": 1}"}') == ("f", {"a": 1})
    assert decode_tool_call('{"name": "f", "arguments": ""}') == ("f", {})
    assert decode_tool_call('{"name": "f", "arguments": "{"}') == ("f", None)
    assert decode_tool_call('{"name": "f"}') == ("f", {})
