"""PPO surrogates, value loss, entropy, KL estimators, importance weights, loss weights."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracerl import (
    entropy,
    kl_estimate,
    kl_loss,
    kl_reward_penalty,
    loss_weights,
    mismatch_metrics,
    ppo_sequence_loss,
    ppo_token_loss,
    truncated_importance_weights,
    value_loss,
)


def _lp(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)


def test_token_loss_clips_asymmetrically_and_zeroes_padding() -> None:
    old = _lp(0.5, 0.5, 0.5, 0.5)
    new = _lp(0.8, 0.8, 0.2, 0.3).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = ppo_token_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # ratios 1.6, 1.6, 0.4: A>0 clipped at 1.28; A<0 keeps the unclipped (pessimistic) 1.6;
    # A<0 with ratio 0.4 is clipped at 0.8.
    assert loss.detach().tolist()[0] == pytest.approx([-1.28, 1.6, 0.8, 0.0])
    assert metrics["ppo/clip_fraction"] == pytest.approx(2 / 3)
    loss.sum().backward()
    assert new.grad is not None and new.grad[0, 0] == 0 and new.grad[0, 1] != 0


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    old, new = _lp(0.1), _lp(0.9)
    adv = torch.tensor([[-1.0]], dtype=torch.float64)
    loss, metrics = ppo_token_loss(new, old, adv, torch.ones(1, 1), dual_clip=3.0)
    assert float(loss) == pytest.approx(3.0)
    assert metrics["ppo/dual_clip_fraction"] == 1.0


def test_importance_weights_multiply_the_token_loss() -> None:
    old, new = _lp(0.5, 0.5), _lp(0.5, 0.5)
    adv = torch.ones(1, 2, dtype=torch.float64)
    weights = torch.tensor([[2.0, 0.5]], dtype=torch.float64)
    loss, _ = ppo_token_loss(new, old, adv, torch.ones(1, 2), importance_weights=weights)
    assert loss.tolist()[0] == pytest.approx([-2.0, -0.5])


def test_sequence_loss_geometric_mean_and_product() -> None:
    old = _lp(0.5, 0.25, 0.5)
    new = _lp(0.6, 0.2, 0.6).requires_grad_()
    mask = torch.ones(1, 3)
    adv = torch.tensor([1.0], dtype=torch.float64)
    product, _ = ppo_sequence_loss(new, old, adv, mask, clip_low=0.5, ratio="product")
    assert product.detach().tolist()[0] == pytest.approx([-1.152] * 3)
    gmean, _ = ppo_sequence_loss(new, old, adv, mask, ratio="geometric_mean")
    assert float(gmean[0, 0].detach()) == pytest.approx(-(1.152 ** (1 / 3)))
    (gmean.sum() / 3).backward()
    assert new.grad is not None and bool((new.grad != 0).all())


def test_value_loss_clipped_takes_the_larger_error() -> None:
    values = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 0.5]], dtype=torch.float64)
    loss, _ = value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    # row 0: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> 1.62
    assert loss.detach().tolist()[0] == pytest.approx([1.62, 0.125])
    plain, _ = value_loss(values, old, returns, torch.ones(1, 2), clip=None)
    assert plain.detach().tolist()[0] == pytest.approx([0.5, 0.125])


def test_entropy_of_uniform_logits() -> None:
    logits = torch.zeros(1, 2, 4, requires_grad=True)
    value, _ = entropy(logits, torch.tensor([[1, 0]]))
    assert value.detach().tolist()[0] == pytest.approx([math.log(4), 0.0])


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.floats(-3, 3), min_size=1, max_size=8),
    st.lists(st.floats(-3, 3), min_size=8, max_size=8),
)
def test_kl_estimators_k1_k2_k3(logp: list[float], ref: list[float]) -> None:
    lp = torch.tensor(logp, dtype=torch.float64)
    rf = torch.tensor(ref[: len(logp)], dtype=torch.float64)
    log_r = rf - lp
    assert torch.allclose(kl_estimate(lp, rf, "k1"), -log_r)
    assert torch.allclose(kl_estimate(lp, rf, "k2"), 0.5 * log_r**2)
    k3 = kl_estimate(lp, rf, "k3")
    assert torch.allclose(k3, torch.exp(log_r) - 1 - log_r) and bool((k3 >= -1e-12).all())


def test_kl_loss_has_gradient_and_reward_penalty_has_none() -> None:
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0]])
    loss, _ = kl_loss(lp, ref, mask, "k3")
    penalty, _ = kl_reward_penalty(lp, ref, mask, coef=0.1, estimator="k1")
    assert loss.requires_grad and not penalty.requires_grad
    assert penalty.tolist()[0] == pytest.approx([0.05, 0.0])


def test_kl_clamp_caps_a_collapsed_token_and_its_gradient() -> None:
    """A token 10 nats below the reference: k3 about 22,000 unclamped; capped at 10 with no
    gradient, while a token inside the cap keeps its value and gradient."""
    lp = torch.tensor([[-11.0, -1.2]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1]])
    raw, metrics = kl_loss(lp, ref, mask, "k3")
    assert raw[0, 0].item() == pytest.approx(math.expm1(10.0) - 10.0)
    capped, capped_metrics = kl_loss(lp, ref, mask, "k3", clamp=10.0)
    assert capped[0, 0].item() == 10.0
    assert capped[0, 1].item() == pytest.approx(math.expm1(0.2) - 0.2)
    assert capped_metrics["kl_loss/k3"] == metrics["kl_loss/k3"]
    assert capped_metrics["kl_loss/clamped_fraction"] == 0.5
    capped.sum().backward()
    assert lp.grad is not None
    assert lp.grad[0, 0].item() == 0.0
    assert lp.grad[0, 1].item() == pytest.approx(1.0 - math.exp(0.2))
    with pytest.raises(ValueError, match="clamp"):
        kl_loss(lp, ref, mask, "k3", clamp=0.0)


def test_truncated_importance_weights_token_and_sequence() -> None:
    old = _lp(0.5, 0.9, 0.5)
    behavior = _lp(0.5, 0.3, 0.25)
    mask = torch.tensor([[1, 1, 1]])
    token, metrics = truncated_importance_weights(old, behavior, mask, cap=2.0, level="token")
    assert token.tolist()[0] == pytest.approx([1.0, 2.0, 2.0])
    assert metrics["mismatch/fraction_over_cap"] == pytest.approx(1 / 3)
    sequence, _ = truncated_importance_weights(old, behavior, mask, cap=10.0, level="sequence")
    assert sequence.tolist()[0] == pytest.approx([6.0] * 3)
    summary = mismatch_metrics(old, behavior, mask, cap=2.0)
    assert summary["mismatch/mean_abs_log_ratio"] == pytest.approx((math.log(3) + math.log(2)) / 3)
    assert summary["mismatch/max_abs_log_ratio"] == pytest.approx(math.log(3))
    # k3 per token: r - 1 - log r with r = 1, 3, 2.
    assert summary["mismatch/kl_behavior_old"] == pytest.approx(
        (0.0 + (2 - math.log(3)) + (1 - math.log(2))) / 3)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    length=st.integers(1, 10),
    seed=st.integers(0, 1000),
    mode=st.sampled_from(["token_mean", "sequence_mean", "task_mean"]),
)
def test_loss_weights_of_mean_modes_sum_to_one(
    rows: int, length: int, seed: int, mode: str
) -> None:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, length, generator=g) < 0.5
    mask[:, 0] = True
    ids = torch.randint(0, 3, (rows,), generator=g)
    weights = loss_weights(mask, mode, group_ids=ids)  # type: ignore[arg-type]
    assert float(weights.sum()) == pytest.approx(1.0)
    assert bool((weights[~mask] == 0).all())
