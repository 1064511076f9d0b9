"""Constrained decoding of ``replace``'s ``old``: the mask, the sampler under it, the collector."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import pytest
import torch

from tracerl.models.tiny import render_tool_call
from tracerl.rollout import HFPolicy, SamplingParams, sequence_logprobs
from tracerl.rollout.decoding.constraints import EditConstraint, VocabularyTexts, open_string

FILE = "def limit(x, top):\n    if x > top:\n        return top\n    return x - 1\n"
CORPUS = [
    FILE,
    render_tool_call("replace", {"line": 2, "old": ">", "new": ">="}),
    render_tool_call("replace", {"line": 4, "old": "x - 1", "new": "x + 1"}),
    render_tool_call("view_file", {}),
    'print("a \\"quoted\\" word")',
] * 10


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def policy(tiny_policy_on: Callable[[Sequence[str], int], HFPolicy]) -> HFPolicy:
    return tiny_policy_on(CORPUS, 128)


@pytest.fixture(scope="module")
def vocabulary(policy: HFPolicy) -> VocabularyTexts:
    width = int(policy.model.get_output_embeddings().weight.shape[0])
    return VocabularyTexts(policy.tokenizer, width)


def _texts(vocabulary: VocabularyTexts, policy: HFPolicy, mask: torch.Tensor) -> set[str]:
    return {policy.tokenizer.decode([i]) for i in mask.nonzero().flatten().tolist()}


def test_open_string_reads_only_an_unclosed_old_of_replace() -> None:
    start = '<tool_call>{"name": "replace", "arguments": {"line": 2, "old": "'
    assert open_string(start) == ""
    assert open_string(start + "x >") == "x >"
    assert open_string(start + 'x >", "new": "') is None  # closed: `new` is free
    assert open_string(start + 'a \\"b') == 'a \\"b'  # an escaped quote does not close it
    assert open_string('{"name": "view_file", "arguments": {"old": "') is None
    assert open_string('{"name": "replace", "arguments": {"line": 2') is None


def test_mask_keeps_old_a_piece_of_the_named_line(policy: HFPolicy,
                                                  vocabulary: VocabularyTexts) -> None:
    rule = EditConstraint(vocabulary, FILE)
    start = '{"name": "replace", "arguments": {"line": 2, "old": "'
    mask = rule.allowed(start)
    assert mask is not None
    allowed = _texts(vocabulary, policy, mask)
    line = "    if x > top:"
    assert allowed and all(t in line for t in allowed), allowed
    assert not any('"' in t for t in allowed)  # an empty `old` cannot be closed
    # After `x >`, which occurs once in line 2: continuing or closing are both allowed.
    mask = rule.allowed(start + "x >")
    assert mask is not None
    allowed = _texts(vocabulary, policy, mask)
    assert any(t.startswith('"') for t in allowed)
    assert all(t.startswith('"') or ("x >" + t) in line for t in allowed)
    # " " occurs several times in the line: a string that is not unique may not be closed.
    mask = rule.allowed(start + " ")
    assert mask is not None
    assert not any(t.startswith('"') for t in _texts(vocabulary, policy, mask))


def test_mask_says_nothing_outside_its_string(vocabulary: VocabularyTexts) -> None:
    rule = EditConstraint(vocabulary, FILE)
    assert rule.allowed("") is None
    assert rule.allowed('{"name": "replace", "arguments": {"line": 2, "old": ">", "new": "') is None
    # Another file named, or a line the file does not have: the tool will answer, not the mask.
    assert rule.allowed('{"name": "replace", "arguments": {"path": "b.py", "old": "') is None
    assert rule.allowed('{"name": "replace", "arguments": {"line": 9, "old": "') is None
    # No line: the whole file is the scope.
    mask = rule.allowed('{"name": "replace", "arguments": {"old": "return x')
    assert mask is not None and bool(mask.any())


def test_quotes_in_the_line_are_matched_in_their_json_form(policy: HFPolicy,
                                                           vocabulary: VocabularyTexts) -> None:
    text = 'print("a \\"quoted\\" word")\n'
    rule = EditConstraint(vocabulary, text)
    written = json.dumps('print("a')[1:-1]  # print(\"a
    mask = rule.allowed('{"name": "replace", "arguments": {"line": 1, "old": "' + written)
    assert mask is not None
    body = json.dumps(text.rstrip("\n"))[1:-1]
    for t in _texts(vocabulary, policy, mask):
        head = t.split('"')[0]
        assert (written + head) in body


class _Started:
    """The rule, as if the completion had already written ``start`` (a random model would
    seldom write a whole call by itself)."""

    def __init__(self, rule: EditConstraint, start: str) -> None:
        self.rule, self.start = rule, start

    def allowed(self, text: str) -> torch.Tensor | None:
        return self.rule.allowed(self.start + text)


START = '<tool_call>{"name": "replace", "arguments": {"line": 2, "old": "'


def test_sampler_under_the_rule_writes_an_old_that_applies(policy: HFPolicy,
                                                           vocabulary: VocabularyTexts) -> None:
    prompt = policy.tokenizer.encode(START, add_special_tokens=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=0)
    rules = [_Started(EditConstraint(vocabulary, FILE), START) for _ in range(16)]
    completions = policy.generate([prompt] * 16, params, row_seeds=list(range(16)),
                                  constraints=rules)
    line = "    if x > top:"
    closed = 0
    for completion in completions:
        old = completion.text.split('"', 1)[0]
        assert old in line, completion.text  # never off the line
        if '"' in completion.text:  # every string the rule let close occurs once
            closed += 1
            assert old and line.count(old) == 1, completion.text
    assert closed > 0
    # The recorded logprob is the masked distribution's: never below the unmasked one, and
    # above it wherever the mask removed mass.
    for completion in completions[:4]:
        ids = torch.tensor([prompt + list(completion.token_ids)])
        with torch.no_grad():
            full = sequence_logprobs(policy.model, ids, torch.ones_like(ids), params=params,
                                     processing="raw")[0, len(prompt):]
        gained = [lp - full[i].item() for i, lp in enumerate(completion.logprobs)]
        assert gained[0] > 1e-3
        assert all(g >= -1e-5 for g in gained)


def test_greedy_under_the_rule_takes_the_masked_argmax(policy: HFPolicy,
                                                       vocabulary: VocabularyTexts) -> None:
    prompt = policy.tokenizer.encode(START, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_new_tokens=1, seed=0)
    rule = EditConstraint(vocabulary, FILE)
    completion = policy.generate([prompt], params, constraints=[_Started(rule, START)])[0]
    mask = rule.allowed(START)
    assert mask is not None
    with torch.no_grad():
        logits = policy.model(torch.tensor([prompt])).logits[0, -1]
    assert completion.token_ids[0] == int(logits.masked_fill(~mask, float("-inf")).argmax())
    assert completion.logprobs[0] == 0.0


def test_constraints_must_match_the_prompts(policy: HFPolicy) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=0)
    with pytest.raises(ValueError, match="constraints has 2 rules for 1 prompts"):
        policy.generate([[1, 2]], params, constraints=[None, None])


class _ServedPolicy:
    """A policy whose ``generate`` takes no decoding rules (as a served model's client)."""

    policy_version = 0

    def generate(self, prompts: object, params: SamplingParams) -> list[object]:
        return []

    def decode(self, token_ids: object) -> str:
        return ""


def test_collector_refuses_the_rule_for_a_policy_that_cannot_apply_it() -> None:
    from tracerl.rollout.collect.collector import Collector, CollectorConfig

    with pytest.raises(ValueError, match="constrain_edits: _ServedPolicy applies no decoding"):
        Collector(_ServedPolicy(), lambda: None, None,  # type: ignore[arg-type]
                  CollectorConfig(constrain_edits=True))
