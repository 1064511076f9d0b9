from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tracerl.models.tiny import TinyModelConfig, build_tiny_model, render_tool_call, train_tokenizer
from tracerl.rollout import HFPolicy, SamplingParams, sequence_logprobs
from tracerl.rollout.policies import fused_decoder
from tracerl.rollout.policies.fused_decoder import FusedLlamaDecoder, length_groups
from tracerl.rollout.policies.fused_llama import (
    fused_sequence_forward,
    pack_llama,
    rope_inv_freq,
    shared_prefix_owner,
    unsupported_reason,
)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def pop(self):\n        return self.items.pop()\n",
    render_tool_call("run_tests", {}),
    "fix the bug in add",
] * 10
VOCAB = 300


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # shared machine; tiny matrices gain nothing from more threads
    yield
    torch.set_num_threads(previous)


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    # Default init leaves norms at 1 and biases at 0; perturb every parameter so that each one
    # (norm weights, Qwen2's q/k/v biases) actually matters to the logits being compared.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def _llama(**overrides: Any) -> torch.nn.Module:
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    }
    kwargs.update(overrides)
    torch.manual_seed(0)
    return _perturbed(LlamaForCausalLM(LlamaConfig(**kwargs)), 1)


def _qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return _perturbed(Qwen2ForCausalLM(config), 2)


LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}
MODELS = {
    "llama-mha-tied": lambda: _llama(num_key_value_heads=4, tie_word_embeddings=True),
    "llama-gqa-untied-llama3-rope": lambda: _llama(rope_parameters=LLAMA3_ROPE),
    "llama-linear-rope-mlp-bias": lambda: _llama(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        attention_bias=True, mlp_bias=True,
    ),
    "qwen2-qkv-bias": _qwen2,
}


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("group_overhead", [0, 10**6])  # a group per length; one group
def test_fused_logits_equal_transformers_at_prefill_and_every_step(name: str, group_overhead: int) -> None:
    model = MODELS[name]()
    assert unsupported_reason(model) is None
    lengths = [5, 11, 2, 8]
    width, n_rows, n_steps = max(lengths), len(lengths), 7
    generator = torch.Generator().manual_seed(3)
    ids = torch.zeros((n_rows, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):  # left padding, as the sampler lays prompts out
        ids[row, width - n :] = torch.randint(1, VOCAB, (n,), generator=generator)
        mask[row, width - n :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.inference_mode():
        decoder = FusedLlamaDecoder(
            pack_llama(model), n_rows, width + n_steps, group_overhead=group_overhead
        )
        assert len(decoder.groups) == 0
        fused = decoder.prefill(ids, mask, positions, all_positions=True)
        expected = _hf_logits(model, ids, mask)
        assert len(decoder.groups) == (4 if group_overhead == 0 else 1)
        real = mask.bool()
        assert real.sum() == sum(lengths)
        torch.testing.assert_close(fused[real], expected[real], atol=1e-5, rtol=0)
        next_position = positions[:, -1:] + 1
        for step in range(n_steps):
            tokens = torch.randint(1, VOCAB, (ids.shape[0],), generator=generator)
            fused_step = decoder.step(tokens, next_position)
            ids = torch.cat([ids, tokens[:, None]], dim=1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            torch.testing.assert_close(
                fused_step, _hf_logits(model, ids, mask)[:, -1], atol=1e-5, rtol=0
            )
            next_position = next_position + 1
            if step == 2:  # drop rows mid-way, as the sampler does when rows finish
                keep = torch.tensor([0, 1, 3])
                assert decoder.select_rows(keep)
                ids, mask, next_position = ids[keep], mask[keep], next_position[keep]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_fused_sequence_forward_matches_transformers_values_and_gradients(name: str,
                                                                          side: str) -> None:
    model = MODELS[name]().train()
    lengths = [5, 11, 2, 8]
    width = max(lengths)
    generator = torch.Generator().manual_seed(4)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):  # the update pads on either side
        span = slice(width - n, width) if side == "left" else slice(0, n)
        ids[row, span] = torch.randint(1, VOCAB, (n,), generator=generator)
        mask[row, span] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    weights = torch.randn((*ids.shape, VOCAB), generator=generator) * mask[..., None]
    real = mask.bool()

    out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                output_hidden_states=True)
    (out.logits * weights).sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits, hidden = fused_sequence_forward(model, ids, mask, positions)
    (logits * weights).sum().backward()

    assert torch.isfinite(logits).all() and torch.isfinite(hidden).all()
    torch.testing.assert_close(logits[real], out.logits[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden[real], out.hidden_states[-1][real], atol=1e-5, rtol=0)
    for parameter_name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected_grads[parameter_name], atol=1e-5,
                                   rtol=1e-4, msg=parameter_name)


@pytest.mark.parametrize("side", ["left", "right"])
def test_rows_sharing_a_prompt_compute_it_once_with_the_same_values_and_gradients(
        side: str) -> None:
    model = MODELS["llama-gqa-untied-llama3-rope"]().train()
    generator = torch.Generator().manual_seed(5)
    prompt_a, prompt_b = (torch.randint(1, VOCAB, (n,), generator=generator) for n in (6, 4))
    rows = [torch.cat([prompt_a, torch.randint(1, VOCAB, (n,), generator=generator)])
            for n in (3, 5)] + [torch.cat([prompt_b, torch.randint(1, VOCAB, (4,),
                                                                    generator=generator)])]
    rows.append(rows[0].clone())  # an identical row: every token shared
    rows.append(prompt_a[:4].clone())  # a row that is a prefix of the others
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[index, span], mask[index, span] = row, 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    owner = shared_prefix_owner(ids, mask, positions)
    computed = int(((owner.flatten() == torch.arange(ids.numel())) & mask.flatten().bool()).sum())
    if side == "right":  # aligned prompts: A once, the copy of row 0 and the prefix row free
        assert computed == int(mask.sum()) - 6 - len(rows[0]) - 4
    else:
        assert computed < int(mask.sum())  # only the identical row is aligned with row 0
    weights = torch.randn((*ids.shape, VOCAB), generator=generator) * mask[..., None]
    real = mask.bool()
    expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    (expected * weights).sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits, _ = fused_sequence_forward(model, ids, mask, positions)
    assert logits is not None
    (logits * weights).sum().backward()
    torch.testing.assert_close(logits[real], expected[real], atol=1e-5, rtol=0)
    for parameter_name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected_grads[parameter_name], atol=1e-5,
                                   rtol=1e-4, msg=parameter_name)


def test_length_groups_minimise_padding_plus_overhead() -> None:
    assert length_groups([3, 3, 50, 60], overhead=0) in ([(0, 2), (2, 3), (3, 4)], [(0, 1), (1, 2), (2, 3), (3, 4)])
    assert length_groups([3, 3, 50, 60], overhead=20) == [(0, 2), (2, 4)]
    assert length_groups([3, 3, 50, 60], overhead=10**6) == [(0, 4)]
    assert length_groups([7]) == [(0, 1)]


def test_rope_scaling_really_changes_the_frequencies() -> None:
    default, _ = rope_inv_freq(_llama().config)
    llama3, _ = rope_inv_freq(_llama(rope_parameters=LLAMA3_ROPE).config)
    assert not torch.allclose(default, llama3)


# ----------------------------------------------------------------- through HFPolicy


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tokenizer(CORPUS, vocab_size=400)


@pytest.fixture(scope="module")
def tiny(tokenizer: Any) -> torch.nn.Module:
    config = TinyModelConfig(
        hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=96
    )
    model = build_tiny_model(tokenizer, config, seed=0)
    with torch.no_grad():  # sharpen, so that top-k/top-p really cut tokens
        model.get_input_embeddings().weight.mul_(8.0)
    return model


def _prompts(policy: HFPolicy) -> list[list[int]]:
    texts = ["fix add", "def add(a, b):\n    return a - b", "x", "class Stack:\n    pass\n" * 3]
    return [policy.chat_prompt([{"role": "user", "content": t}]) for t in texts]


PARAMS = [
    SamplingParams(temperature=1.0, max_new_tokens=16, seed=1),
    SamplingParams(temperature=0.6, top_k=7, max_new_tokens=16, seed=2),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=16, seed=4),
    SamplingParams(temperature=0.0, max_new_tokens=16),
]


@pytest.mark.parametrize("params", PARAMS)
def test_fused_path_samples_what_the_transformers_path_samples(
    tiny: torch.nn.Module, tokenizer: Any, params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One length group per prompt, so that grouping, regrouping and compaction all run.
    monkeypatch.setattr(fused_decoder, "GROUP_OVERHEAD_CELLS", 0)
    fused = HFPolicy(tiny, tokenizer, decode="fused")
    hf = HFPolicy(tiny, tokenizer, decode="hf")
    assert (fused.decode_path(), hf.decode_path()) == ("fused", "hf")
    prompts = _prompts(fused)
    # A frequent extra stop token makes rows finish at different steps: the batch shrinks.
    common = tokenizer.encode("a", add_special_tokens=False)[0]
    stopping = SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        max_new_tokens=params.max_new_tokens, seed=params.seed,
        stop_token_ids=(tokenizer.eos_token_id, common),
    )
    for p in (params, stopping):
        for row_seeds in (None, [5, 6, 7, 8]):
            a = fused.generate(prompts, p, row_seeds=row_seeds)
            b = hf.generate(prompts, p, row_seeds=row_seeds)
            for x, y in zip(a, b, strict=True):
                assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
                torch.testing.assert_close(
                    torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0
                )


def _recompute(policy: HFPolicy, prompts: list[list[int]], completions: list[Any], params: SamplingParams) -> list[torch.Tensor]:
    rows = [list(p) + list(c.token_ids) for p, c in zip(prompts, completions, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        out = sequence_logprobs(policy.model, ids, mask, params=params)
    return [out[i, len(p) : len(p) + len(c.token_ids)] for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]


@pytest.mark.parametrize("params", PARAMS[:3])
def test_fused_behavior_logprobs_match_one_pass_recompute(
    tiny: torch.nn.Module, tokenizer: Any, params: SamplingParams
) -> None:
    policy = HFPolicy(tiny, tokenizer, decode="fused")
    prompts = _prompts(policy)
    completions = policy.generate(prompts, params)
    for completion, expected in zip(completions, _recompute(policy, prompts, completions, params), strict=True):
        assert len(completion.token_ids) > 0
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-5, rtol=0)


def test_weight_update_after_generate_is_reflected_in_the_next(tokenizer: Any) -> None:
    config = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=96)
    model = build_tiny_model(tokenizer, config, seed=1)
    fused = HFPolicy(model, tokenizer, decode="fused")
    hf = HFPolicy(model, tokenizer, decode="hf")
    prompts = _prompts(fused)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(), seed=9)
    before = fused.generate(prompts, params)
    # One optimizer step, as a trainer takes between rollouts (in place, on q/k/v, MLP and head).
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    ids = torch.tensor([prompts[1]])
    model.train()
    loss = -torch.log_softmax(model(ids).logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None]).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    after = fused.generate(prompts, params)
    reference = hf.generate(prompts, params)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    for x, y in zip(after, reference, strict=True):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        torch.cat([torch.tensor(c.logprobs) for c in after]),
        torch.cat(_recompute(fused, prompts, after, params)),
        atol=1e-5, rtol=0,
    )


def test_which_path_runs_and_fallbacks(tiny: torch.nn.Module, tokenizer: Any) -> None:
    assert HFPolicy(tiny, tokenizer).decode_path() == "fused"  # the default for Llama models
    assert HFPolicy(tiny, tokenizer, cache="dynamic").decode_path() == "hf"  # a cache was named
    with pytest.raises(ValueError, match="decode must be 'auto', 'fused' or 'hf'"):
        HFPolicy(tiny, tokenizer, decode="fast")  # type: ignore[arg-type]

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match="decode='fused' is not supported by GPT2LMHeadModel: model_type 'gpt2'"):
        HFPolicy(gpt2, tokenizer, decode="fused")
    fallback = HFPolicy(gpt2, tokenizer)
    assert fallback.decode_path() == "hf"
    assert len(fallback.generate([[5, 6]], SamplingParams(max_new_tokens=3, stop_token_ids=(), seed=0))[0].token_ids) == 3

    dynamic_rope = _llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert "rope type 'dynamic' is not implemented" in str(unsupported_reason(dynamic_rope))
    assert HFPolicy(dynamic_rope, tokenizer).decode_path() == "hf"

    # A hook added after the policy was built (as an adapter library would) is not bypassed.
    policy = HFPolicy(tiny, tokenizer)
    strict = HFPolicy(tiny, tokenizer, decode="fused")
    handle = tiny.model.layers[0].mlp.register_forward_hook(lambda module, args, output: output)
    try:
        assert policy.decode_path() == "hf"
        with pytest.raises(ValueError, match="has forward hooks"):
            strict.generate([[5, 6]], SamplingParams(max_new_tokens=2))
    finally:
        handle.remove()
    assert policy.decode_path() == "fused"
