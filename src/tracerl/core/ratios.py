"""Probability ratios and off-policy correction.

Three policies appear in an update and stay apart here: the *behavior* policy that actually
sampled the tokens (its logprobs recorded by the sampler, with temperature/top-p applied), the
*old* policy (the trained weights at the start of the update, logprobs frozen for it), and the
*new* policy being optimised. PPO's ratio is new/old; the truncated importance weight
old/behavior corrects for the sampler not being the old policy (asynchronous rollouts,
inference-engine numerics).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from tracerl.core._convert import as_float, as_mask, check_same_shape, kind_of, restore

__all__ = [
    "ImportanceLevel",
    "ImportanceMode",
    "mismatch_metrics",
    "sequence_ratio",
    "token_ratios",
    "truncated_importance_weights",
]

ImportanceMode = Literal["truncate", "mask"]
"""What a weight above the cap becomes: the cap (``truncate``, TIS) or 0 (``mask``)."""

ImportanceLevel = Literal["token", "sequence"]
"""Granularity of a truncated importance weight: ``token`` gives each token its own
``min(pi_old / pi_behavior, cap)``; ``sequence`` gives every token of a row the capped product
over the row's action tokens."""


def _pair(new: Any, old: Any, new_name: str, old_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    a = as_float(new, new_name)
    b = as_float(old, old_name, like=a)
    check_same_shape(a, new_name, **{old_name: b})
    return a, b


def _row_mask(mask: Any, like: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    return as_mask(mask, "mask", shape=like.shape).to(like.device)


def token_ratios(new_logprobs: Any, old_logprobs: Any) -> Any:
    """Per-token ratios ``pi_new(a_t) / pi_old(a_t) = exp(new - old)``, same shape as inputs.

    Differentiable in ``new_logprobs``. Never a stand-in for :func:`sequence_ratio`.
    """
    kind = kind_of(new_logprobs)
    new, old = _pair(new_logprobs, old_logprobs, "new_logprobs", "old_logprobs")
    return restore(torch.exp(new - old), kind)


def sequence_ratio(new_logprobs: Any, old_logprobs: Any, mask: Any = None) -> Any:
    """Ratio of whole sequences: the product of token ratios over action tokens.

    Computed as ``exp(sum(mask * (new - old)))`` along the last axis, so long products neither
    underflow nor lose precision token by token. Input [T] gives a scalar, [B, T] gives [B].
    Its scale and variance grow with length; it is not interchangeable with token ratios.
    """
    kind = kind_of(new_logprobs)
    new, old = _pair(new_logprobs, old_logprobs, "new_logprobs", "old_logprobs")
    m = _row_mask(mask, new).to(new.dtype)
    result = torch.exp(((new - old) * m).sum(-1))
    if kind == "sequence" and result.dim() == 0:
        return float(result)
    return restore(result, kind)


def truncated_importance_weights(
    old_logprobs: Any,
    behavior_logprobs: Any,
    action_mask: Any,
    cap: float = 2.0,
    level: ImportanceLevel = "token",
    mode: ImportanceMode = "truncate",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``min(pi_old / pi_behavior, cap)`` for [B, T] tokens.

    Returns ``(weights, metrics)``: weights [B, T] (no gradient, zero off the mask) to multiply
    into a per-token loss, and :func:`mismatch_metrics`. At ``sequence`` level each row's
    weight is the capped product of its token ratios (exp of the summed log-ratio). With
    ``mode="mask"`` a weight above ``cap`` becomes 0 instead of ``cap`` (the token leaves the
    loss), as decoupled PPO's implementation in AReaL treats it.
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"cap must be a positive number, got {cap!r}")
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    old, behavior = _pair(old_logprobs, behavior_logprobs, "old_logprobs", "behavior_logprobs")
    old, behavior = old.detach(), behavior.detach()
    mask = as_mask(action_mask, "action_mask", shape=old.shape).to(old.device)
    maskf = mask.to(old.dtype)
    log_ratio = (old - behavior) * maskf
    raw = torch.exp(log_ratio) if level == "token" else torch.exp(log_ratio.sum(-1, keepdim=True))
    if mode == "truncate":
        capped = raw.clamp(max=float(cap))
    else:
        capped = torch.where(raw > float(cap), torch.zeros_like(raw), raw)
    weights = capped * maskf
    metrics = mismatch_metrics(old, behavior, mask, cap=cap)
    return weights, metrics


def mismatch_metrics(
    old_logprobs: Any, behavior_logprobs: Any, action_mask: Any, cap: float = 2.0
) -> dict[str, float]:
    """How far the sampler drifted from the old policy, over action tokens.

    ``mismatch/mean_abs_log_ratio``: mean of ``|log pi_old - log pi_behavior|``;
    ``mismatch/fraction_over_cap``: fraction of tokens whose ratio exceeds ``cap``;
    ``mismatch/max_log_ratio``: the largest log-ratio;
    ``mismatch/max_abs_log_ratio``: the largest ``|log pi_old - log pi_behavior|``;
    ``mismatch/kl_behavior_old``: an estimate of KL(pi_behavior || pi_old) per token from the
    sampled tokens (drawn from the behavior policy): the mean of ``r - 1 - log r`` with
    ``r = pi_old / pi_behavior`` (Schulman's k3; unbiased, never negative);
    ``mismatch/sequence_fraction_over_cap``: fraction of rows whose product exceeds ``cap``.
    """
    old, behavior = _pair(old_logprobs, behavior_logprobs, "old_logprobs", "behavior_logprobs")
    mask = as_mask(action_mask, "action_mask", shape=old.shape).to(old.device)
    count = int(mask.sum())
    if count == 0:
        raise ValueError("action_mask has no action positions")
    log_ratio = (old - behavior).detach()[mask]
    log_cap = float(torch.log(torch.tensor(float(cap), dtype=torch.float64)))
    row_sums = ((old - behavior).detach() * mask.to(old.dtype)).sum(-1)
    rows = mask.reshape(-1, mask.shape[-1]).any(-1)
    row_sums = row_sums.reshape(-1)[rows]
    return {
        "mismatch/mean_abs_log_ratio": float(log_ratio.abs().mean()),
        "mismatch/fraction_over_cap": float((log_ratio > log_cap).to(torch.float64).mean()),
        "mismatch/max_log_ratio": float(log_ratio.max()),
        "mismatch/max_abs_log_ratio": float(log_ratio.abs().max()),
        "mismatch/kl_behavior_old": float((torch.expm1(log_ratio) - log_ratio).mean()),
        "mismatch/sequence_fraction_over_cap": float((row_sums > log_cap).to(torch.float64).mean()),
    }
