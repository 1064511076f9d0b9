"""Micro-batching, padding and data-parallel ranks reproduce the full-batch update exactly."""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from tracerl.train.config import CriticConfig, UpdateConfig
from tracerl.train.update import ActorCritic, RowBatch, freeze_old, minibatch_step

sys.path.insert(0, str(Path(__file__).parent))
from train_rows import VOCAB, make_batch


def make_model(critic: str = "none") -> ActorCritic:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0)
    model = LlamaForCausalLM(config).to(torch.float64)
    actor = ActorCritic(model, CriticConfig(kind=critic), temperature=0.9).to(torch.float64)
    if actor.value_head is not None:
        torch.nn.init.normal_(actor.value_head.weight, std=0.1)
    return actor


def step(model: ActorCritic, batch: RowBatch, config: UpdateConfig, critic: CriticConfig,
         rank_rows: torch.Tensor | None = None,
         demonstrations: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
         ) -> dict[str, float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    frozen = freeze_old(model, batch, micro_batch_rows=4)
    # Move the policy away from the anchor so the clip is active on some tokens.
    return minibatch_step(model, optimizer, frozen, config, critic, rank_rows, demonstrations,
                          0.4)


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


CONFIGS = [
    (UpdateConfig(micro_batch_rows=100, loss_mode="token_mean", entropy_coef=0.01, tis_cap=2.0),
     "none"),
    (UpdateConfig(micro_batch_rows=100, loss_mode="task_mean", loss_level="sequence"), "none"),
    (UpdateConfig(micro_batch_rows=100, loss_mode="sequence_mean"), "value_head"),
    (UpdateConfig(micro_batch_rows=100, loss_mode="token_mean"), "separate"),
]


@pytest.mark.parametrize(("config", "critic_kind"), CONFIGS)
def test_micro_batches_equal_full_batch(config: UpdateConfig, critic_kind: str) -> None:
    critic = CriticConfig(kind=critic_kind)  # type: ignore[arg-type]
    batch = make_batch(critic=critic_kind != "none")
    full = make_model(critic_kind)
    split = copy.deepcopy(full)
    step(full, batch, config, critic)
    for micro in (1, 4):
        model = copy.deepcopy(split)
        step(model, batch, UpdateConfig(**{**config.__dict__, "micro_batch_rows": micro}), critic)
        assert torch.allclose(params(model), params(full), atol=1e-6, rtol=0)
    assert not torch.allclose(params(split), params(full), atol=1e-6, rtol=0)


def demonstration_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from tracerl.train.sft import pad_sequences

    generator = torch.Generator().manual_seed(3)
    rows = []
    for length in (9, 14, 6):
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        rows.append((ids, [i >= length // 2 for i in range(length)]))
    return pad_sequences(rows, pad_id=0)


def test_mixed_demonstrations_add_their_supervised_gradient_once() -> None:
    """``update.sft_coef`` adds coef x the warm start's loss on the demonstrations to a step:
    with every advantage 0 the step's gradient is exactly that term's, and the micro-batch
    size (which splits only the RL rows) leaves the step unchanged."""
    from tracerl.train.sft import demonstration_loss

    demos = demonstration_rows()
    batch = freeze_old(make_model(), make_batch(), micro_batch_rows=4)
    still = replace(batch, advantages=torch.zeros_like(batch.advantages))
    config = UpdateConfig(micro_batch_rows=100, sft_coef=0.7, grad_clip=None)
    model = make_model()
    expected_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = minibatch_step(model, optimizer, still, config, CriticConfig(), None, demos, 0.4)
    (0.7 * demonstration_loss(expected_model.policy, *demos, observation_weight=0.4)).backward()
    for after, before, reference in zip(model.parameters(), expected_model.parameters(),
                                        make_model().parameters(), strict=True):
        assert before.grad is not None
        assert torch.allclose(reference.detach() - after.detach(), before.grad, atol=1e-12)
    assert metrics["update/sft_loss"] > 0
    # Advantages on: any micro-batch size gives the full batch's step, demonstrations included.
    full = make_model()
    minibatch_step(full, torch.optim.AdamW(full.parameters(), lr=1e-2), batch, config,
                   CriticConfig(), None, demos, 0.4)
    for micro in (1, 4):
        model = make_model()
        minibatch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batch,
                       replace(config, micro_batch_rows=micro), CriticConfig(), None, demos, 0.4)
        assert torch.allclose(params(model), params(full), atol=1e-6, rtol=0)
    # Off (coef 0), the demonstrations change nothing.
    plain, ignored = make_model(), make_model()
    minibatch_step(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), batch,
                   UpdateConfig(micro_batch_rows=100), CriticConfig())
    minibatch_step(ignored, torch.optim.AdamW(ignored.parameters(), lr=1e-2), batch,
                   UpdateConfig(micro_batch_rows=100), CriticConfig(), None, demos, 0.4)
    assert torch.equal(params(plain), params(ignored))
    assert not torch.allclose(params(plain), params(full), atol=1e-6, rtol=0)


def test_entropy_at_the_action_tokens_only_equals_the_whole_distributions() -> None:
    """The fused forward computes the output head (and so the entropy) only at the action
    tokens; the transformers forward computes it everywhere. Same entropies and gradients."""
    from tracerl.train.update import token_loss

    config, critic = UpdateConfig(entropy_coef=0.3), CriticConfig()
    sparse = make_model()
    dense = copy.deepcopy(sparse)
    dense.fused = False
    batch = freeze_old(sparse, make_batch(), micro_batch_rows=6)
    mask = batch.action_mask
    results = []
    for model in (sparse, dense):
        _, _, entropies = model.evaluate(batch.input_ids, batch.attention_mask,
                                         need_entropy=True, needed=mask)
        assert entropies is not None
        loss, metrics = token_loss(model, batch, config, critic)
        (loss * mask).sum().backward()
        results.append((entropies, metrics["entropy/mean"],
                        torch.cat([p.grad.flatten() for p in model.parameters()])))
    (e_sparse, m_sparse, g_sparse), (e_dense, m_dense, g_dense) = results
    assert torch.allclose(e_sparse[mask], e_dense[mask], atol=1e-6, rtol=0)
    assert bool((e_dense[mask] > 0).all())
    assert m_sparse == pytest.approx(m_dense, abs=1e-6)
    assert m_sparse == pytest.approx(float(e_dense[mask].detach().mean()), abs=1e-6)
    assert torch.allclose(g_sparse, g_dense, atol=1e-6, rtol=0)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_never_changes_the_loss(side: str) -> None:
    config, critic = UpdateConfig(micro_batch_rows=2), CriticConfig(kind="value_head")
    base = make_model("value_head")
    reference = copy.deepcopy(base)
    loss_ref = step(reference, make_batch(critic=True), config, critic)["update/loss"]
    padded = copy.deepcopy(base)
    loss_pad = step(padded, make_batch(side=side, extra_pad=7, critic=True), config,
                    critic)["update/loss"]
    assert loss_pad == pytest.approx(loss_ref, abs=1e-9)
    assert torch.allclose(params(padded), params(reference), atol=1e-9, rtol=0)


def _rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        model = make_model("none")
        # Rank 0 alone computes the mixed demonstrations' term, as ppo_update does.
        config = UpdateConfig(micro_batch_rows=2, loss_mode="token_mean", sft_coef=0.5)
        step(model, make_batch(), config, CriticConfig(), torch.arange(rank, 6, world),
             demonstration_rows() if rank == 0 else None)
        torch.save(params(model), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_full_batch(tmp_path: Path) -> None:
    full = make_model("none")
    step(full, make_batch(), UpdateConfig(micro_batch_rows=100, sft_coef=0.5), CriticConfig(),
         None, demonstration_rows())
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.allclose(got, params(full), atol=1e-6, rtol=0)


@pytest.mark.parametrize("critic_kind", ["none", "value_head"])
def test_single_step_update_may_take_old_logprobs_from_its_own_forward(critic_kind: str) -> None:
    config, critic = UpdateConfig(micro_batch_rows=4), CriticConfig(kind=critic_kind)  # type: ignore[arg-type]
    batch = make_batch(critic=critic_kind != "none")
    frozen_model = make_model(critic_kind)
    reused_model = copy.deepcopy(frozen_model)
    frozen = freeze_old(frozen_model, batch, micro_batch_rows=4)
    reused = freeze_old(reused_model, batch, micro_batch_rows=4, policy=False)
    assert frozen.old_logprobs is not None and reused.old_logprobs is None
    assert (reused.old_values is None) == (critic_kind == "none")
    for model, rows in ((frozen_model, frozen), (reused_model, reused)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        minibatch_step(model, optimizer, rows, config, critic)
    assert torch.allclose(params(reused_model), params(frozen_model), atol=1e-9, rtol=0)

    several = UpdateConfig(micro_batch_rows=4, epochs=2)
    optimizer = torch.optim.AdamW(reused_model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="old_logprobs: not frozen"):
        minibatch_step(reused_model, optimizer, reused, several, critic)


@pytest.mark.parametrize("critic_kind", ["none", "value_head"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])  # the head on action positions only; all
def test_fused_forward_gives_the_transformers_update(critic_kind: str,
                                                     entropy_coef: float) -> None:
    critic = CriticConfig(kind=critic_kind)  # type: ignore[arg-type]
    batch = make_batch(critic=critic_kind != "none")
    fused = make_model(critic_kind)
    plain = copy.deepcopy(fused)
    plain.fused = False
    assert fused._use_fused() and not plain._use_fused()
    config = UpdateConfig(micro_batch_rows=4, entropy_coef=entropy_coef)
    for model in (fused, plain):
        step(model, batch, config, critic)
    assert torch.allclose(params(fused), params(plain), atol=1e-9, rtol=0)


def test_warm_up_raises_the_rate_linearly_and_resumes_where_it_stopped() -> None:
    """``update.warmup_steps``: rate k+1/N of the base for the (k+1)-th step, then the base;
    the count comes from the optimizer's state, so a restored optimizer continues."""
    from tracerl.train.update import make_adamw, warm_up

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = make_adamw([{"params": [weight], "lr": 0.4}], weight_decay=0.0)
    seen = []
    for _ in range(3):
        warm_up(optimizer, 4)
        seen.append(optimizer.param_groups[0]["lr"])
        weight.grad = torch.ones(3)
        optimizer.step()
    resumed = make_adamw([{"params": [weight], "lr": 0.4}], weight_decay=0.0)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for _ in range(2):
        warm_up(resumed, 4)
        seen.append(resumed.param_groups[0]["lr"])
        weight.grad = torch.ones(3)
        resumed.step()
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])
    plain = make_adamw([{"params": [weight], "lr": 0.4}], weight_decay=0.0)
    warm_up(plain, 0)
    assert plain.param_groups[0]["lr"] == 0.4
