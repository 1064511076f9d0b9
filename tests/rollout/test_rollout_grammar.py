"""Grammar-constrained tool calls: the language, the masks, the sampler and the collector."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from tracerl.envs.tools import ARGUMENT_ALTERNATIVES, TOOL_SCHEMAS, parse_tool_call
from tracerl.models.tiny import render_tool_call
from tracerl.rollout import HFPolicy, SamplingParams
from tracerl.rollout.decoding.constraints import EditConstraint, VocabularyTexts
from tracerl.rollout.decoding.grammar import AllRules, ToolCallGrammar, tool_specs

FILE = "def limit(x, top):\n    if x > top:\n        return top\n    return x - 1\n"
CALLS = [
    render_tool_call("replace", {"line": 2, "old": ">", "new": ">="}),
    render_tool_call("replace", {"line": 4, "old": "x - 1", "new": "x + 1"}),
    render_tool_call("replace", {"old": 'say "hi"\\', "new": "a\tb\nc"}),
    render_tool_call("replace", {"old": "x </tool", "new": "<</tool_"}),
    render_tool_call("replace", {"line": 12, "new": "return top"}),
    render_tool_call("view_file", {}),
    render_tool_call("view_file", {"path": "calc.py"}),
    render_tool_call("run_tests", {}),
    render_tool_call("submit", {}),
]
CORPUS = [FILE, *CALLS] * 10

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def policy(tiny_policy_on: Callable[[Sequence[str], int], HFPolicy]) -> HFPolicy:
    return tiny_policy_on(CORPUS, 256)


@pytest.fixture(scope="module")
def grammar(policy: HFPolicy) -> ToolCallGrammar:
    width = int(policy.model.get_output_embeddings().weight.shape[0])
    return ToolCallGrammar(tool_specs(TOOL_SCHEMAS, ARGUMENT_ALTERNATIVES), policy.tokenizer,
                           width, policy.eos_ids)


@pytest.mark.parametrize("call", CALLS)
def test_every_well_formed_call_is_in_the_language_token_by_token(
        policy: HFPolicy, grammar: ToolCallGrammar, call: str) -> None:
    ids = [*policy.tokenizer.encode(call, add_special_tokens=False), policy.eos_ids[0]]
    rule = grammar.rule()
    for k, token in enumerate(ids):
        mask = rule.allowed(policy.decode(ids[:k]))
        assert mask is not None and bool(mask[token]), (call, k)
    # After the call only an end-of-turn token may come.
    final = grammar.advance(grammar.start, call)
    assert final == ("done",)
    assert grammar.mask(final).nonzero().flatten().tolist() == sorted(set(policy.eos_ids))


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "replace", "arguments": {"line": 6, "old": "7", "new", "new": "7"}}',
    '<tool_call>{"name": "replace", "arguments": {"new": "x"}}',  # neither old nor line
    '<tool_call>{"name": "replace", "arguments": {"line": 06, "new": "x"}}',  # leading zero
    '<tool_call>{"name": "replace", "arguments": {"line": 12345, "new": "x"}}',  # 5 digits
    '<tool_call>{"name": "replace", "arguments": {"old": "a", "old": "b", "new": "x"}}',
    '<tool_call>{"name": "replace", "arguments": {"old": "a\\q", "new": "x"}}',  # bad escape
    '<tool_call>{"name": "replace", "arguments": {"old": "a\nb", "new": "x"}}',  # raw newline
    '<tool_call>{"name": "replacer", "arguments": {}}',
    '<tool_call>{"name": "submit", "arguments": {"path": "x"}}',  # submit takes nothing
    '<tool_call>{"name": "view_file", "arguments": {}}</tool_call> and more',
    'Let me look. <tool_call>',
    '<tool_call>{"name": "replace", "arguments": {"old": "a</tool_call>',  # the parser ends there
])
def test_text_no_parser_accepts_leaves_the_language(grammar: ToolCallGrammar, text: str) -> None:
    assert grammar.advance(grammar.start, text) is None


def test_every_call_the_grammar_completes_parses(grammar: ToolCallGrammar) -> None:
    for call in CALLS:
        assert grammar.advance(grammar.start, call) == ("done",)
        parsed = parse_tool_call(call)
        assert parsed.call is not None, parsed.error


def test_sampled_actions_are_all_well_formed_calls(policy: HFPolicy,
                                                   grammar: ToolCallGrammar) -> None:
    """An untrained model writes noise unconstrained; under the grammar, every completion that
    ends is one call the environment parses."""
    params = SamplingParams(temperature=1.0, max_new_tokens=60, seed=0)
    prompt = policy.tokenizer.encode(FILE, add_special_tokens=False)
    free = policy.generate([prompt] * 16, params, row_seeds=list(range(16)))
    assert sum(parse_tool_call(c.text).call is not None for c in free) < 4
    rules = [grammar.rule() for _ in range(16)]
    completions = policy.generate([prompt] * 16, params, row_seeds=list(range(16)),
                                  constraints=rules)
    ended = [c for c in completions if c.finish_reason == "stop"]
    assert len(ended) >= 8
    for completion in ended:
        parsed = parse_tool_call(completion.text)
        assert parsed.call is not None, (completion.text, parsed.error)
        assert completion.text.endswith("</tool_call>")
    # The recorded logprobs are the masked distribution's: finite, and never all zero.
    assert all(torch.isfinite(torch.tensor(c.logprobs)).all() for c in completions)


def test_with_the_edit_rule_old_is_a_piece_of_the_line_and_the_call_well_formed(
        policy: HFPolicy, grammar: ToolCallGrammar) -> None:
    width = int(policy.model.get_output_embeddings().weight.shape[0])
    vocabulary = VocabularyTexts(policy.tokenizer, width)
    start = '<tool_call>{"name": "replace", "arguments": {"line": 2, "old": "'
    prompt = policy.tokenizer.encode(FILE + start, add_special_tokens=False)

    class _Started:
        name = "started"

        def __init__(self, rule: AllRules) -> None:
            self.rule = rule

        def allowed(self, text: str) -> torch.Tensor | None:
            return self.rule.allowed(start + text)

    rules = [_Started(AllRules([grammar.rule(), EditConstraint(vocabulary, FILE)]))
             for _ in range(16)]
    params = SamplingParams(temperature=1.0, max_new_tokens=80, seed=1)
    completions = policy.generate([prompt] * 16, params, row_seeds=list(range(16)),
                                  constraints=rules)
    closed = 0
    for completion in completions:
        old = completion.text.split('"', 1)[0]
        assert old in "    if x > top:"
        if '"' in completion.text:  # the rule let `old` close: it occurs once in the line
            closed += 1
            assert "    if x > top:".count(old) == 1
            assert completion.text[len(old):].startswith('", "')  # the grammar goes on
        if completion.finish_reason == "stop":
            parsed = parse_tool_call(start + completion.text)
            assert parsed.call is not None, parsed.error
            assert parsed.call.arguments["old"] == old and "new" in parsed.call.arguments
    assert closed > 0


def test_all_rules_keep_the_first_rule_where_they_would_allow_nothing() -> None:
    class _Fixed:
        def __init__(self, name: str, keep: list[bool]) -> None:
            self.name, self.keep = name, torch.tensor(keep)

        def allowed(self, text: str) -> torch.Tensor:
            return self.keep

    both = AllRules([_Fixed("a", [True, True, False]), _Fixed("b", [False, True, True])])
    assert both.name == "a+b"
    assert both.allowed("").tolist() == [False, True, False]
    apart = AllRules([_Fixed("a", [True, False, False]), _Fixed("b", [False, True, True])])
    assert apart.allowed("").tolist() == [True, False, False]


def test_schemas_the_grammar_cannot_write_are_refused() -> None:
    schema = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"items": {"type": "array"}}}}}
    with pytest.raises(ValueError, match=r"pick\.items has type 'array'"):
        tool_specs([schema])
    with pytest.raises(ValueError, match="no function name"):
        tool_specs([{"type": "function", "function": {}}])
    with pytest.raises(ValueError, match="no tool to call"):
        tool_specs([])


def test_grammar_needs_an_end_token(policy: HFPolicy) -> None:
    with pytest.raises(ValueError, match="end_ids"):
        ToolCallGrammar(tool_specs(TOOL_SCHEMAS), policy.tokenizer, 10, ())


def test_collector_refuses_the_grammar_for_a_policy_that_cannot_apply_it() -> None:
    from tracerl.rollout.collect.collector import Collector, CollectorConfig

    class _Served:
        policy_version = 0

        def generate(self, prompts: object, params: SamplingParams) -> list[object]:
            return []

        def decode(self, token_ids: object) -> str:
            return ""

    with pytest.raises(ValueError, match="constrain_calls: _Served applies no decoding"):
        Collector(_Served(), lambda: None, None,  # type: ignore[arg-type]
                  CollectorConfig(constrain_calls=True))
