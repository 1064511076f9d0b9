"""Tool-call parsing, schemas (usable by HF chat templates) and test-failure excerpts."""

from __future__ import annotations

import pytest

from tracerl.envs.sandbox import SandboxResult
from tracerl.envs.tools import TOOL_NAMES, TOOL_SCHEMAS, failure_excerpt, parse_tool_call


def test_parses_hermes_style_calls() -> None:
    parsed = parse_tool_call('I will look.\n<tool_call>\n{"name": "view_file", "arguments": '
                             '{"path": "a.py"}}\n</tool_call> and more')
    assert parsed.error is None and parsed.call is not None
    assert parsed.call.name == "view_file" and parsed.call.arguments == {"path": "a.py"}
    as_string = parse_tool_call('<tool_call>{"name": "run_tests", "arguments": "{}"}</tool_call>')
    assert as_string.call is not None and as_string.call.name == "run_tests"
    unclosed = parse_tool_call('<tool_call>{"name": "submit", "arguments": {}}')
    assert unclosed.call is not None and unclosed.call.name == "submit"


@pytest.mark.parametrize(("text", "message"), [
    ("just words", "error: no tool call"),
    ("<tool_call>{oops}</tool_call>", "not valid JSON"),
    ('<tool_call>["view_file"]</tool_call>', 'needs "name"'),
    ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "unknown tool rm"),
    ('<tool_call>{"name": "replace", "arguments": {"new": "x"}}</tool_call>',
     "missing argument old"),
    ('<tool_call>{"name": "view_file", "arguments": {"path": "a", "x": 1}}</tool_call>',
     "unknown argument x"),
    ('<tool_call>{"name": "view_file", "arguments": {"path": 3}}</tool_call>',
     "must be a string"),
    ('<tool_call>{"name": "view_file", "arguments": 5}</tool_call>', "must be an object"),
])
def test_mistakes_are_explained(text: str, message: str) -> None:
    parsed = parse_tool_call(text)
    assert parsed.call is None
    assert parsed.error is not None and parsed.error.startswith("error:")
    assert message in parsed.error


def test_schemas_are_openai_functions_and_render_in_a_chat_template() -> None:
    assert [s["function"]["name"] for s in TOOL_SCHEMAS] == list(TOOL_NAMES)
    for schema in TOOL_SCHEMAS:
        params = schema["function"]["parameters"]
        assert schema["type"] == "function" and params["type"] == "object"
        assert set(params["required"]) <= set(params["properties"])
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model))
    tokenizer.chat_template = (
        "{% for tool in tools %}{{ tool.function.name }}({{ tool.function.parameters.required"
        " | join(',') }})\n{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "fix it"}],
                                         tools=TOOL_SCHEMAS, tokenize=False)
    assert "replace(new)" in text and "user: fix it" in text


def _result(code: int, stdout: str = "", stderr: str = "", timed_out: bool = False) -> SandboxResult:
    return SandboxResult(code, stdout, stderr, 0.1, timed_out, "timeout" if timed_out else None)


def test_excerpts_are_short_and_regular() -> None:
    assert failure_excerpt(_result(0, "PASS\n")) == "PASS"
    suite_style = _result(1, "FAIL f(1) got 2 want 3\nFAIL f(2) got 4 want 6\n")
    assert failure_excerpt(suite_style) == "FAIL\nf(1) got 2 want 3\nf(2) got 4 want 6"
    traceback = _result(1, stderr=(
        'Traceback (most recent call last):\n  File "/workspace/test_a.py", line 3, in <module>\n'
        "    assert add(1, 2) == 3, add(1, 2)\nAssertionError: -1\n"))
    assert failure_excerpt(traceback) == ('FAIL\nFile "test_a.py", line 3, in <module>\n'
                                       "assert add(1, 2) == 3, add(1, 2)\nAssertionError: -1")
    assert failure_excerpt(_result(137, timed_out=True)) == "FAIL\nkilled: timeout"
    assert failure_excerpt(_result(2)) == "FAIL\nexit code 2"
