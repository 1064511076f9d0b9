"""Per-token loss terms: PPO clipped surrogates, clipped value loss, entropy, KL.

Every loss returns ``(loss, metrics)``: ``loss`` is [B, T], zero off the action mask, and is
never reduced here. Reduction happens only through :func:`tracerl.core.aggregate.loss_weights`
so that the denominator is chosen once for the whole batch and micro-batches, padding and
data-parallel ranks reproduce the full-batch objective. ``metrics`` are floats for logging,
averaged over this call's action tokens.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "KLEstimator",
    "SequenceRatio",
    "entropy",
    "kl_estimate",
    "kl_loss",
    "kl_reward_penalty",
    "ppo_sequence_loss",
    "ppo_token_loss",
    "value_loss",
]

KLEstimator = Literal["k1", "k2", "k3"]
"""Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
divergence", 2020), with ``log_r = log pi_ref - log pi``:
``k1 = -log_r`` (unbiased, can be negative), ``k2 = log_r ** 2 / 2`` (biased, low variance),
``k3 = exp(log_r) - 1 - log_r`` (unbiased, never negative)."""

SequenceRatio = Literal["product", "geometric_mean"]
"""How a sequence-level ratio is formed: ``product`` of token ratios (exp of the summed
log-ratio) or ``geometric_mean`` (exp of the mean log-ratio, as in GSPO)."""


def _check(name: str, tensor: torch.Tensor, shape: torch.Size) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor")
    if tensor.shape != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if not bool(torch.isfinite(tensor.detach()).all()):
        raise ValueError(f"{name} contains NaN or inf")


def _mask(action_mask: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(action_mask, torch.Tensor):
        action_mask = torch.as_tensor(action_mask)
    if action_mask.shape != shape:
        raise ValueError(
            f"action_mask has shape {tuple(action_mask.shape)}, expected {tuple(shape)}"
        )
    return action_mask.to(dtype)


def _masked_mean(value: torch.Tensor, maskf: torch.Tensor) -> float:
    count = float(maskf.sum())
    return float((value.detach() * maskf).sum()) / count if count else 0.0


def _clip_bounds(clip_low: float, clip_high: float | None) -> tuple[float, float]:
    high = clip_low if clip_high is None else clip_high
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    if not high >= 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    return 1.0 - clip_low, 1.0 + high


def _surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    lower: float,
    upper: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pessimistic PPO loss ``max(-r A, -clip(r) A)``; dual clip bounds it by ``-c A`` for A<0."""
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(lower, upper) * advantages
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    dual = torch.zeros_like(was_clipped)
    if dual_clip is not None:
        if not dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip!r}")
        # Ye et al. 2020: with A < 0 a huge ratio would make the loss unbounded; cap it.
        bound = -dual_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, was_clipped, dual


def ppo_token_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO clipped surrogate, [B, T] per-token loss.

    ``ratio_t = exp(new_t - old_t)`` clipped to ``[1 - clip_low, 1 + clip_high]`` (asymmetric
    when ``clip_high`` differs, as in DAPO's clip-higher); ``dual_clip`` c > 1 bounds the loss
    of negative-advantage tokens by ``-c A``. ``importance_weights`` (e.g. truncated
    old/behavior weights) multiply the loss and carry no gradient.
    """
    shape = new_logprobs.shape
    _check("new_logprobs", new_logprobs, shape)
    _check("old_logprobs", old_logprobs, shape)
    _check("advantages", advantages, shape)
    maskf = _mask(action_mask, shape, new_logprobs.dtype)
    lower, upper = _clip_bounds(clip_low, clip_high)
    log_ratio = new_logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    loss, clipped, dual = _surrogate(ratio, advantages.detach(), lower, upper, dual_clip)
    if importance_weights is not None:
        _check("importance_weights", importance_weights, shape)
        loss = loss * importance_weights.detach()
    metrics = {
        "ppo/clip_fraction": _masked_mean(clipped.to(maskf.dtype), maskf),
        "ppo/dual_clip_fraction": _masked_mean(dual.to(maskf.dtype), maskf),
        "ppo/ratio_mean": _masked_mean(ratio, maskf),
        "ppo/approx_kl_k3": _masked_mean(torch.expm1(-log_ratio) + log_ratio, maskf),
    }
    return loss * maskf, metrics


def ppo_sequence_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    ratio: SequenceRatio = "geometric_mean",
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence-level PPO clipped surrogate (GSPO with ``ratio="geometric_mean"``).

    ``advantages`` is [B], one per sequence. The row's ratio ``s`` is the product or the
    geometric mean of its token ratios over action tokens, clipped as one number. The
    sequence's loss is written on each of its action tokens, so reducing with
    ``sequence_mean`` gives exactly the mean over sequences of the sequence objective (its
    gradient flows through every token via ``s``). A row without action tokens raises.
    """
    shape = new_logprobs.shape
    _check("new_logprobs", new_logprobs, shape)
    _check("old_logprobs", old_logprobs, shape)
    _check("advantages", advantages, shape[:-1])
    if ratio not in ("product", "geometric_mean"):
        raise ValueError(f"ratio must be 'product' or 'geometric_mean', got {ratio!r}")
    maskf = _mask(action_mask, shape, new_logprobs.dtype)
    lengths = maskf.sum(-1)
    if bool((lengths == 0).any()):
        raise ValueError("action_mask has a row with no action position")
    lower, upper = _clip_bounds(clip_low, clip_high)
    summed = ((new_logprobs - old_logprobs.detach()) * maskf).sum(-1)
    log_s = summed / lengths if ratio == "geometric_mean" else summed
    s = torch.exp(log_s)
    loss, clipped, dual = _surrogate(s, advantages.detach(), lower, upper, dual_clip)
    rows = torch.ones_like(lengths)
    metrics = {
        "ppo_seq/clip_fraction": _masked_mean(clipped.to(rows.dtype), rows),
        "ppo_seq/dual_clip_fraction": _masked_mean(dual.to(rows.dtype), rows),
        "ppo_seq/ratio_mean": _masked_mean(s, rows),
    }
    return loss[..., None] * maskf, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    clip: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, ±clip) - R)^2)``.

    ``clip=None`` gives the plain squared error. Returns, old values and the mask carry no
    gradient.
    """
    shape = values.shape
    _check("values", values, shape)
    _check("old_values", old_values, shape)
    _check("returns", returns, shape)
    maskf = _mask(action_mask, shape, values.dtype)
    target = returns.detach()
    error = (values - target) ** 2
    if clip is None:
        loss = 0.5 * error
        clipped = torch.zeros_like(maskf, dtype=torch.bool)
    else:
        if not clip > 0:
            raise ValueError(f"clip must be > 0 or None, got {clip!r}")
        anchor = old_values.detach()
        moved = anchor + (values - anchor).clamp(-clip, clip)
        clipped_error = (moved - target) ** 2
        loss = 0.5 * torch.maximum(error, clipped_error)
        clipped = clipped_error > error
    residual = (target - values.detach()) * maskf
    count = float(maskf.sum())
    variance = float(((target * maskf - (target * maskf).sum() / count) ** 2 * maskf).sum())
    explained = 1.0 - float((residual**2).sum()) / variance if count and variance > 0 else 0.0
    metrics = {
        "value/clip_fraction": _masked_mean(clipped.to(maskf.dtype), maskf),
        "value/explained_variance": explained,
    }
    return loss * maskf, metrics


def entropy(
    logits: torch.Tensor, action_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token entropy of the categorical distribution given by ``logits`` [B, T, V].

    Returns entropy [B, T] (differentiable, zero off the mask); to add an entropy bonus,
    subtract ``coef * entropy`` from the loss before reduction.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    shape = logits.shape[:2]
    maskf = _mask(action_mask, shape, logits.dtype)
    log_p = torch.log_softmax(logits, dim=-1)
    value = -(log_p.exp() * log_p).sum(-1)
    if not bool(torch.isfinite(value.detach()).all()):
        raise ValueError("logits give NaN or inf entropy")
    return value * maskf, {"entropy/mean": _masked_mean(value, maskf)}


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from the sampled tokens' logprobs, unmasked."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs has shape {tuple(ref_logprobs.shape)}, but logprobs has "
            f"{tuple(logprobs.shape)}"
        )
    _check("logprobs", logprobs, logprobs.shape)
    _check("ref_logprobs", ref_logprobs, logprobs.shape)
    log_r = ref_logprobs.detach() - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    estimator: KLEstimator = "k3",
    clamp: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL to the reference as a **loss term**: [B, T], differentiable in ``logprobs``.

    Add ``coef * loss`` to the policy loss before reduction (GRPO-style KL regularisation).

    ``clamp``: cap each token's estimate at this value (no gradient beyond it). k3's
    ``exp(ref - logp)`` is unbounded: one token whose probability fell 10 nats below the
    reference's gives a value of about 22,000 and a gradient as large, which then decides the
    whole clipped update. The metric is the unclamped mean; ``kl_loss/clamped_fraction`` counts
    the capped tokens.
    """
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be > 0 or None, got {clamp!r}")
    value = kl_estimate(logprobs, ref_logprobs, estimator)
    maskf = _mask(action_mask, value.shape, value.dtype)
    metrics = {f"kl_loss/{estimator}": _masked_mean(value, maskf)}
    if clamp is not None:
        over = (value.detach() > clamp).to(value.dtype)
        metrics["kl_loss/clamped_fraction"] = _masked_mean(over, maskf)
        value = value.clamp(max=clamp)
    return value * maskf, metrics


def kl_reward_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    coef: float,
    estimator: KLEstimator = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL to the reference as a **per-token reward penalty**: ``coef * kl``, [B, T], no gradient.

    Subtract it from the token rewards before computing advantages (PPO-RLHF style). It is
    detached: a reward is data, not part of the differentiated objective.
    """
    if not coef >= 0:
        raise ValueError(f"coef must be >= 0, got {coef!r}")
    value = kl_estimate(logprobs.detach(), ref_logprobs, estimator)
    maskf = _mask(action_mask, value.shape, value.dtype)
    return coef * value * maskf, {f"kl_penalty/{estimator}": _masked_mean(value, maskf)}
