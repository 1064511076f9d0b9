"""Reusing earlier turns' keys and values (``rollout.policies.prefix_cache``): the same logits and the
same samples as prefilling every prompt whole, never across a weight change."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from tracerl.models.tiny import render_tool_call
from tracerl.rollout import HFPolicy, SamplingParams
from tracerl.rollout.policies.fused_decoder import FusedLlamaDecoder
from tracerl.rollout.policies.fused_llama import pack_llama
from tracerl.rollout.policies.prefix_cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    render_tool_call("run_tests", {}),
    "FAIL: add(1, 2) got -1 want 3",
    "fix the bug in add",
] * 10


@pytest.fixture(scope="module")
def policy(tiny_policy_on: Callable[[Sequence[str], int], HFPolicy]) -> HFPolicy:
    return tiny_policy_on(CORPUS, 256)


@pytest.mark.parametrize("group_overhead", [0, 10**6])  # a group per length; one group
def test_prefill_from_cached_keys_equals_whole_prefill(policy: HFPolicy,
                                                       group_overhead: int) -> None:
    lengths, cached = [5, 11, 2, 8, 9], [3, 10, 0, 1, 4]
    vocab = policy.model.get_input_embeddings().num_embeddings
    width = max(lengths)
    generator = torch.Generator().manual_seed(3)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, vocab, (n,), generator=generator)
        mask[row, width - n:] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.inference_mode():
        packed = pack_llama(policy.model)
        whole = FusedLlamaDecoder(packed, len(lengths), width + 3, group_overhead=group_overhead)
        expected = whole.prefill(ids, mask, positions)
        past = [whole.row_cache(r, n) if n else None for r, n in enumerate(cached)]
        decoder = FusedLlamaDecoder(packed, len(lengths), width + 3,
                                    group_overhead=group_overhead)
        logits = decoder.prefill(ids, mask, positions, past=past)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
        tokens, next_position = logits.argmax(dim=-1), positions[:, -1:] + 1
        for _ in range(3):  # decoding on top of the reused keys gives the same logits too
            torch.testing.assert_close(decoder.step(tokens, next_position),
                                       whole.step(tokens, next_position), atol=1e-5, rtol=0)
            next_position = next_position + 1
        # A row's keys after decoding: its prompt, then the fed tokens.
        assert decoder.row_cache(1, 11 + 3).shape[-2] == 14
        with pytest.raises(ValueError, match="cached tokens"):
            decoder.row_cache(1, 15)
        bad = FusedLlamaDecoder(packed, len(lengths), width + 3)
        with pytest.raises(ValueError, match="leave one"):
            bad.prefill(ids, mask, positions, past=[whole.row_cache(0, 5), *past[1:]])


def _conversation(policy: HFPolicy, turns: int) -> tuple[list[list], list[list], list[list[int]]]:
    """Four conversations over ``turns`` turns: each prompt is the previous one, the sampled
    action and an observation (as a multi-turn attempt's context grows). Returns the tokens
    and logprobs of each turn and the prompts of the turn after."""
    tok = policy.tokenizer
    prompts = [policy.chat_prompt([{"role": "user", "content": t}])
               for t in ("fix add", "def add(a, b):\n    return a - b", "x", "fix the bug " * 3)]
    observation = tok.encode("FAIL: add(1, 2) got -1 want 3", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    tokens, logprobs = [], []
    for turn in range(turns):
        completions = policy.generate(prompts, params, row_seeds=[turn * 10 + i for i in range(4)])
        tokens.append([c.token_ids for c in completions])
        logprobs.append([c.logprobs for c in completions])
        prompts = [[*p, *c.token_ids, *observation] for p, c in zip(prompts, completions,
                                                                     strict=True)]
    return tokens, logprobs, prompts


def test_later_turns_reuse_earlier_keys_and_sample_the_same(policy: HFPolicy) -> None:
    cached = HFPolicy(policy.model, policy.tokenizer)
    whole = HFPolicy(policy.model, policy.tokenizer, prefix_cache_bytes=0)
    tokens, logprobs, _ = _conversation(cached, 4)
    expected_tokens, expected_logprobs, _ = _conversation(whole, 4)
    assert tokens == expected_tokens
    for got, expected in zip(logprobs, expected_logprobs, strict=True):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert cached.prefix_cache.hits == 4 * 3  # every row after the first turn
    assert cached.prefix_cache.reused_tokens > 0
    assert len(cached.prefix_cache) == 4 * 4  # each turn's rows (kept until evicted)
    assert whole.prefix_cache.hits == 0 and len(whole.prefix_cache) == 0


def test_a_weight_update_empties_the_cache(policy: HFPolicy) -> None:
    cached = HFPolicy(policy.model, policy.tokenizer)
    _, _, next_prompts = _conversation(cached, 2)
    assert len(cached.prefix_cache) == 2 * 4  # the last four extended by next_prompts
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    saved = {k: v.clone() for k, v in policy.model.state_dict().items()}
    try:
        with torch.no_grad():  # an optimizer step writes the parameters in place
            next(policy.model.parameters()).add_(0.01)
        hits = cached.prefix_cache.hits
        after = cached.generate(next_prompts, params, row_seeds=[1, 2, 3, 4])
        assert cached.prefix_cache.hits == hits  # keys of the old weights are not reused
        fresh = HFPolicy(policy.model, policy.tokenizer, prefix_cache_bytes=0).generate(
            next_prompts, params, row_seeds=[1, 2, 3, 4])
        assert [c.token_ids for c in after] == [c.token_ids for c in fresh]
        policy.model.load_state_dict(saved)  # so does loading weights
        cached.generate(next_prompts, params, row_seeds=[1, 2, 3, 4])
        assert cached.prefix_cache.hits == hits
    finally:
        policy.model.load_state_dict(saved)


def test_prefix_cache_keeps_its_budget_and_finds_the_longest_prefix() -> None:
    kv = lambda n: torch.zeros((1, 2, 1, n, 4))  # noqa: E731 - 32 bytes a token
    cache = PrefixCache(max_bytes=32 * 10)
    cache.put([1, 2, 3], kv(3))
    cache.put([1, 2, 3, 4, 5], kv(5))
    key, found = cache.find([1, 2, 3, 4, 5, 6]) or ((), None)
    assert key == (1, 2, 3, 4, 5) and found is not None and found.shape[-2] == 5
    key, found = cache.find([1, 2, 3, 4, 5]) or ((), None)  # the whole prompt: one left
    assert key == (1, 2, 3, 4, 5) and found is not None and found.shape[-2] == 4
    assert cache.find([1, 2, 9]) is None and cache.find([7]) is None
    cache.put([7, 8, 9, 10], kv(4))  # 12 tokens > 10: the least recently used goes
    assert cache.bytes <= 32 * 10 and len(cache) == 2
    assert cache.find([1, 2, 3, 0]) is None
    cache.put(list(range(11)), kv(11))  # larger than the whole budget: not kept
    assert cache.find([*range(11), 0]) is None
    cache.discard((1, 2, 3, 4, 5))
    assert cache.find([1, 2, 3, 4, 5, 6]) is None
    with pytest.raises(ValueError, match="kv holds"):
        cache.put([1, 2], kv(3))
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)
    cache.check_weights("a")  # weights never seen: emptied
    assert len(cache) == 0
    cache.put([1, 2], kv(2))
    cache.check_weights("a")  # the same weights: kept
    assert len(cache) == 1
    cache.check_weights("b")
    assert len(cache) == 0
