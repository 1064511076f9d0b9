from __future__ import annotations

import math

import pytest
import torch

from tracerl.models.tiny import TinyModelConfig, build_tiny_model, render_tool_call, train_tokenizer
from tracerl.rollout import (
    HFPolicy,
    SamplingParams,
    logprobs_from_logits,
    processed_logprobs,
    sequence_logprobs,
)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def pop(self):\n        return self.items.pop()\n",
    render_tool_call("run_tests", {}),
    "fix the bug in add",
] * 10

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def policy() -> HFPolicy:
    torch.manual_seed(0)
    tokenizer = train_tokenizer(CORPUS, vocab_size=400)
    config = TinyModelConfig(
        hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=96
    )
    model = build_tiny_model(tokenizer, config, seed=0)
    # Sharpen the random model a little so that top-k/top-p actually cut tokens.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
    return HFPolicy(model, tokenizer)


def _prompts(policy: HFPolicy) -> list[list[int]]:
    texts = ["fix add", "def add(a, b):\n    return a - b", "x", "class Stack:\n    pass\n" * 3]
    return [policy.chat_prompt([{"role": "user", "content": t}]) for t in texts]


def _recompute(policy: HFPolicy, prompts, completions, params, processing="sampling"):  # type: ignore[no-untyped-def]
    """Logprobs of every completion from ONE right-padded forward pass over the whole batch."""
    rows = [list(p) + list(c.token_ids) for p, c in zip(prompts, completions, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        out = sequence_logprobs(policy.model, ids, mask, params=params, processing=processing)
    return [
        out[i, len(p) : len(p) + len(c.token_ids)]
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=1),
        SamplingParams(temperature=0.6, top_k=7, max_new_tokens=16, seed=2),
        SamplingParams(temperature=1.4, top_p=0.8, max_new_tokens=16, seed=3),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=16, seed=4),
    ],
)
def test_behavior_logprobs_match_one_pass_recompute(policy: HFPolicy, params: SamplingParams) -> None:
    prompts = _prompts(policy)
    completions = policy.generate(prompts, params)
    recomputed = _recompute(policy, prompts, completions, params)
    for completion, expected in zip(completions, recomputed, strict=True):
        assert len(completion.token_ids) > 0
        got = torch.tensor(completion.logprobs)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_truncation_changes_the_recorded_logprobs(policy: HFPolicy) -> None:
    # With top-k the recorded number is the renormalised one, higher than the untruncated one.
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=16, seed=5)
    prompts = _prompts(policy)
    completions = policy.generate(prompts, params)
    truncated = torch.cat(_recompute(policy, prompts, completions, params))
    full = torch.cat(_recompute(policy, prompts, completions, params, processing="temperature"))
    recorded = torch.cat([torch.tensor(c.logprobs) for c in completions])
    torch.testing.assert_close(recorded, truncated, atol=1e-5, rtol=0)
    assert (recorded >= full - 1e-6).all() and (recorded - full).max() > 1e-3


def test_processed_minus_raw_is_exactly_the_temperature_correction(policy: HFPolicy) -> None:
    temperature = 0.5
    params = SamplingParams(temperature=temperature, max_new_tokens=16, seed=6)
    prompt = _prompts(policy)[1]
    completion = policy.generate([prompt], params)[0]
    ids = torch.tensor([prompt + list(completion.token_ids)])
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(prompt) - 1 : -1]  # (n, V)
    tokens = torch.tensor(completion.token_ids)
    recorded = torch.tensor(completion.logprobs)
    raw = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    assert (recorded - raw).abs().max() > 1e-2  # the two really differ at T != 1
    # log softmax(z/T)_a - log softmax(z)_a = z_a (1/T - 1) - logsumexp(z/T) + logsumexp(z)
    chosen = logits.gather(-1, tokens[:, None])[:, 0]
    correction = (
        chosen * (1 / temperature - 1)
        - torch.logsumexp(logits / temperature, dim=-1)
        + torch.logsumexp(logits, dim=-1)
    )
    torch.testing.assert_close(recorded - raw, correction, atol=1e-5, rtol=0)
    raw_via_api = logprobs_from_logits(logits, tokens, temperature=temperature, processing="raw")
    torch.testing.assert_close(raw_via_api, raw, atol=1e-6, rtol=0)


def test_greedy_records_point_mass_and_is_argmax(policy: HFPolicy) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompt = _prompts(policy)[0]
    completion = policy.generate([prompt], params)[0]
    assert completion.logprobs == (0.0,) * len(completion.token_ids)
    ids = list(prompt)
    with torch.no_grad():
        for token in completion.token_ids:
            assert policy.model(torch.tensor([ids])).logits[0, -1].argmax().item() == token
            ids.append(token)
    lp = processed_logprobs(torch.tensor([[0.1, 2.0, -1.0]]), temperature=0.0)
    assert lp.tolist() == [[-math.inf, 0.0, -math.inf]]
    with pytest.raises(ValueError, match="temperature-only"):
        processed_logprobs(torch.zeros(3), temperature=0.0, processing="temperature")


def test_deterministic_under_seed(policy: HFPolicy) -> None:
    prompts = _prompts(policy)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=11)
    first = policy.generate(prompts, params)
    assert policy.generate(prompts, params) == first
    other = policy.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=12))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_row_seeds_make_rows_independent_of_their_batch(policy: HFPolicy) -> None:
    prompts = _prompts(policy)
    eos = policy.tokenizer.eos_token_id
    common = policy.tokenizer.encode("a", add_special_tokens=False)[0]
    # A frequent extra stop token makes rows finish at different steps, so the batch shrinks.
    params = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=(eos, common))
    together = policy.generate(prompts, params, row_seeds=[10, 11, 12, 13])
    alone = [policy.generate([p], params, row_seeds=[s])[0] for p, s in zip(prompts, [10, 11, 12, 13], strict=True)]
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_repeated_prompts_prefilled_once_sample_as_if_alone(policy: HFPolicy) -> None:
    assert policy.decode_path() == "fused"
    base = _prompts(policy)
    prompts = [base[1], base[0], base[1], base[3], base[1], base[0]]  # a group's G copies
    seeds = [20, 21, 22, 23, 24, 25]
    eos = policy.tokenizer.eos_token_id
    common = policy.tokenizer.encode("a", add_special_tokens=False)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=(eos, common))
    together = policy.generate(prompts, params, row_seeds=seeds)
    alone = [policy.generate([p], params, row_seeds=[s])[0]
             for p, s in zip(prompts, seeds, strict=True)]
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-5, rtol=0)
    recomputed = _recompute(policy, prompts, together, params)
    for completion, expected in zip(together, recomputed, strict=True):
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-5, rtol=0)
    assert len({tuple(c.token_ids) for c in together[::2]}) > 1  # copies sample differently


def test_static_and_dynamic_caches_agree(policy: HFPolicy) -> None:
    dynamic = HFPolicy(policy.model, policy.tokenizer, cache="dynamic")
    static = HFPolicy(policy.model, policy.tokenizer, cache="static")
    prompts = _prompts(policy)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=12, seed=7)
    for a, b in zip(static.generate(prompts, params), dynamic.generate(prompts, params), strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_stop_tokens_stop_strings_and_length(policy: HFPolicy) -> None:
    prompts = _prompts(policy)
    seeds = [0, 1, 2, 3]  # per-row generators: a row's draws do not depend on the others
    length = policy.generate(prompts, SamplingParams(max_new_tokens=5, stop_token_ids=()), row_seeds=seeds)
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" and c.stop_reason is None for c in length)
    stop_token = length[0].token_ids[2]
    stopped = policy.generate(
        prompts[:1], SamplingParams(max_new_tokens=5, stop_token_ids=(stop_token,)), row_seeds=seeds[:1]
    )[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_token
    assert stopped.token_ids[-1] == stop_token and len(stopped.token_ids) <= 3
    # A stop string is found in the decoded text; the text is never cut.
    text = length[1].text
    needle = text[len(text) // 2 :][:2] or text
    by_string = policy.generate(
        prompts[1:2],
        SamplingParams(max_new_tokens=5, stop_token_ids=(), stop_strings=(needle,)),
        row_seeds=seeds[1:2],
    )[0]
    assert by_string.finish_reason == "stop" and by_string.stop_reason == needle
    assert needle in by_string.text and by_string.text == policy.decode(by_string.token_ids)
    assert length[1].token_ids[: len(by_string.token_ids)] == by_string.token_ids


def test_context_limits(policy: HFPolicy) -> None:
    context = policy.context_length
    assert context == 96
    with pytest.raises(ValueError, match=r"prompt 1 has 97 tokens, more than the model's context of 96"):
        policy.generate([[5], [5] * 97], SamplingParams())
    near_full = policy.generate([[5] * 93], SamplingParams(max_new_tokens=50, stop_token_ids=(), seed=0))[0]
    assert len(near_full.token_ids) == 3 and near_full.finish_reason == "length"
    full = policy.generate([[5] * 96], SamplingParams(max_new_tokens=50, seed=0))[0]
    assert full.token_ids == () and full.finish_reason == "length"


def test_bad_prompts(policy: HFPolicy) -> None:
    with pytest.raises(ValueError, match="prompts is empty"):
        policy.generate([], SamplingParams())
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        policy.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="prompt 0 is a string"):
        policy.generate(["hello"], SamplingParams())  # type: ignore[list-item]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        policy.generate([[10**6]], SamplingParams())
    with pytest.raises(ValueError, match="row_seeds has 1 seeds for 2 prompts"):
        policy.generate([[5], [6]], SamplingParams(), row_seeds=[1])


def test_chat_template_required(policy: HFPolicy) -> None:
    tokenizer = train_tokenizer(CORPUS, vocab_size=400)
    tokenizer.chat_template = None
    bare = HFPolicy(policy.model, tokenizer)
    with pytest.raises(ValueError, match="has no chat template"):
        bare.chat_prompt([{"role": "user", "content": "hi"}])


def test_version_engine_and_training_flag(policy: HFPolicy) -> None:
    assert policy.engine == "hf"
    policy.model.train()
    policy.policy_version = 3
    completion = policy.generate([[5, 6]], SamplingParams(max_new_tokens=2, seed=0))[0]
    assert completion.policy_version == 3
    assert policy.model.training  # restored after sampling
    policy.model.eval()
    policy.policy_version = 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -1}, "top_k must be an integer"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids must be"),
        ({"stop_strings": "</tool_call>"}, "stop_strings must be a tuple"),
        ({"stop_strings": ("",)}, "stop_strings must be a tuple"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sequence_logprobs_handles_left_padding_and_gradients(policy: HFPolicy) -> None:
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
    ids[0, :2] = policy.tokenizer.pad_token_id
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = sequence_logprobs(policy.model, ids, mask, temperature=0.7, processing="temperature")
    assert out.shape == (2, 5) and out.requires_grad
    assert out[0, :3].tolist() == [0.0, 0.0, 0.0] and out[1, 0].item() == 0.0
    unpadded = sequence_logprobs(policy.model, ids[1:, :3], temperature=0.7, processing="temperature")
    torch.testing.assert_close(out[0, 3:], unpadded[0, 1:], atol=1e-5, rtol=0)
    out[:, 1:].sum().backward()
    assert policy.model.get_input_embeddings().weight.grad is not None
    policy.model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="processing must be one of"):
        sequence_logprobs(policy.model, ids, processing="tempered")  # type: ignore[arg-type]
