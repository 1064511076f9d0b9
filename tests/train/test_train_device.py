"""``model.device``: where the policy trains, checked before any compute; on a GPU, the same
update and the same sampling arithmetic as on the CPU (the CUDA tests skip without one)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tracerl.models.device import resolve_device
from tracerl.train.config import CriticConfig, UpdateConfig, config_from_dict
from tracerl.train.update import ActorCritic, RowBatch, freeze_old, ppo_update

sys.path.insert(0, str(Path(__file__).parent))
import train_rows

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")
VOCAB = 64


@pytest.fixture
def no_tf32() -> Iterator[None]:
    """Full float32 matrix products on the GPU, so that it can be compared with the CPU."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_resolve_device_names_cpu_and_auto() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")


@pytest.mark.parametrize("name", ["tpu", "gpu", "cuda:x", ""])
def test_unknown_device_is_refused_with_the_field_name(name: str) -> None:
    with pytest.raises(ValueError, match=r"model\.device: expected cpu, cuda, cuda:N or auto"):
        config_from_dict({"model": {"device": name}})


@pytest.mark.skipif(CUDA, reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match=r"model\.device: 'cuda' asked for, but this torch sees "
                                         r"no CUDA device"):
        config_from_dict({"model": {"device": "cuda"}})


@needs_cuda
def test_a_gpu_index_past_the_last_is_refused() -> None:
    with pytest.raises(ValueError, match=r"model\.device: 'cuda:99' asked for, but torch sees"):
        config_from_dict({"model": {"device": "cuda:99"}})


def make_actor(critic: str = "none") -> ActorCritic:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=0)
    actor = ActorCritic(LlamaForCausalLM(config), CriticConfig(kind=critic), temperature=0.9)
    if actor.value_head is not None:
        torch.nn.init.normal_(actor.value_head.weight, std=0.1)
    return actor


def make_batch() -> tuple[RowBatch, torch.Tensor]:
    """Eight rows, two per attempt."""
    return train_rows.make_batch(rows=8, width=24, critic=True), torch.arange(8) // 2


def test_row_batch_to_keeps_every_field() -> None:
    batch, _ = make_batch()
    moved = batch.to(torch.device("cpu"))
    for name in batch.__dataclass_fields__:
        a, b = getattr(batch, name), getattr(moved, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def _update(actor: ActorCritic, batch: RowBatch, attempts: torch.Tensor, micro: int,
            sgd: bool = False) -> tuple[RowBatch, dict[str, float]]:
    config = UpdateConfig(epochs=2, minibatches=2, micro_batch_rows=micro, lr=0.01,
                          kl_coef=0.0, entropy_coef=0.01)
    critic = CriticConfig(kind="value_head" if actor.has_critic else "none")
    groups = [{"params": actor.policy_parameters(), "lr": config.lr},
              {"params": actor.critic_parameters(), "lr": 0.01}]
    optimizer = torch.optim.SGD(groups) if sgd else torch.optim.AdamW(groups)
    frozen = freeze_old(actor, batch, micro)
    metrics = ppo_update(actor, optimizer, frozen, attempts, config, critic,
                         torch.Generator().manual_seed(0))
    return frozen, metrics


@needs_cuda
@pytest.mark.parametrize("critic", ["none", "value_head"])
def test_an_update_on_the_gpu_matches_the_cpu(critic: str, no_tf32: None) -> None:
    # Logprobs, norms and rotary angles are float32 on both devices (as in transformers), so
    # the two gradients agree to float32 rounding; plain SGD keeps that difference as it is
    # (AdamW's first step is about lr * sign(gradient) and would turn a rounding difference in
    # a near-zero entry into a step of lr).
    batch, attempts = make_batch()
    cpu = make_actor(critic)
    gpu = copy.deepcopy(cpu).to(torch.device("cuda"))
    frozen_cpu, metrics_cpu = _update(cpu, batch, attempts, micro=3, sgd=True)
    frozen_gpu, metrics_gpu = _update(gpu, batch, attempts, micro=3, sgd=True)
    assert frozen_gpu.old_logprobs is not None and frozen_gpu.old_logprobs.device.type == "cpu"
    assert frozen_cpu.old_logprobs is not None
    assert torch.allclose(frozen_gpu.old_logprobs, frozen_cpu.old_logprobs, atol=1e-5)
    for name in ("update/loss", "update/grad_norm"):
        assert metrics_gpu[name] == pytest.approx(metrics_cpu[name], rel=1e-4, abs=1e-6)
    for (name, a), b in zip(cpu.named_parameters(), gpu.parameters(), strict=True):
        assert torch.allclose(a, b.cpu(), atol=1e-6), name


@needs_cuda
def test_micro_batches_on_the_gpu_give_the_full_batch_update(no_tf32: None) -> None:
    batch, attempts = make_batch()
    whole = make_actor("value_head").to(torch.float64).to(torch.device("cuda"))
    split = copy.deepcopy(whole)
    _update(whole, batch, attempts, micro=8)
    _update(split, batch, attempts, micro=1)
    for (name, a), b in zip(whole.named_parameters(), split.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


@needs_cuda
def test_one_nccl_rank_gives_the_undistributed_update(tmp_path: Path) -> None:
    """The update's all-reduce on CUDA gradients (NCCL) changes nothing with one rank."""
    import torch.distributed as dist

    batch, attempts = make_batch()
    plain = make_actor("value_head").to(torch.device("cuda"))
    ranked = copy.deepcopy(plain)
    _update(plain, batch, attempts, micro=3)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        _update(ranked, batch, attempts, micro=3)
    finally:
        dist.destroy_process_group()
    for (name, a), b in zip(plain.named_parameters(), ranked.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


@needs_cuda
def test_critic_values_of_whole_sequences_come_back_on_the_cpu() -> None:
    batch, _ = make_batch()
    cpu = make_actor("value_head")
    gpu = copy.deepcopy(cpu).to(torch.device("cuda"))
    on_cpu = cpu.state_values(batch.input_ids, batch.attention_mask)
    on_gpu = gpu.state_values(batch.input_ids, batch.attention_mask)
    assert on_gpu.device.type == "cpu"
    assert torch.allclose(on_cpu, on_gpu, atol=1e-5)


@needs_cuda
def test_sampling_on_the_gpu_matches_transformers_and_its_own_logprobs(no_tf32: None) -> None:
    """The fused sampler on CUDA, repeated prompts included (a group's prefill is copied to each
    row): the same tokens as the transformers path, and behavior logprobs that one forward over
    the finished sequences recomputes."""
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model, train_tokenizer
    from tracerl.rollout import HFPolicy, SamplingParams, sequence_logprobs

    corpus = ["def add(a, b):\n    return a + b\n", "fix the bug in add", "run the tests"] * 10
    tokenizer = train_tokenizer(corpus, vocab_size=300)
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2,
                                                        intermediate_size=64, max_positions=96),
                             seed=1).to(torch.device("cuda"))
    fused, plain = HFPolicy(model, tokenizer, decode="fused"), HFPolicy(model, tokenizer,
                                                                        decode="hf")
    assert (fused.decode_path(), plain.decode_path()) == ("fused", "hf")
    texts = ["fix add", "fix add", "def add(a, b):", "fix add"]
    prompts = [fused.chat_prompt([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    a = fused.generate(prompts, params, row_seeds=[1, 2, 3, 4])
    b = plain.generate(prompts, params, row_seeds=[1, 2, 3, 4])
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    rows = [list(prompt) + list(c.token_ids) for prompt, c in zip(prompts, a, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        out = sequence_logprobs(model, ids.cuda(), mask.cuda(), params=params).cpu()
    for i, (prompt, c) in enumerate(zip(prompts, a, strict=True)):
        assert c.token_ids
        expected = out[i, len(prompt):len(prompt) + len(c.token_ids)]
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)


def test_eval_refuses_an_unknown_device_by_its_flag(tmp_path: Path) -> None:
    from tracerl.eval.evaluate import load_policy

    with pytest.raises(ValueError, match=r"--device: expected cpu, cuda, cuda:N or auto, got 'tpu'"):
        load_policy(tmp_path, device="tpu")
