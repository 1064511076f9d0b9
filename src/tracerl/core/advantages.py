"""Advantage estimators: GAE (1-D and batched over action positions), group-relative, RLOO.

Paper symbols: ``gamma`` is the discount, ``trace_decay`` is GAE's lambda (Schulman et al.,
"High-Dimensional Continuous Control Using Generalized Advantage Estimation", §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from tracerl.core._convert import (
    as_float,
    as_mask,
    check_finite,
    check_same_shape,
    check_unit_interval,
    kind_of,
    restore,
)
from tracerl.core._gae_kernel import gae_blocks, min_scaled_decay

__all__ = [
    "GroupReport",
    "batch_gae",
    "batch_gae_reference",
    "gae",
    "group_advantages",
    "rloo_advantages",
    "whiten",
]


def gae(
    rewards: Any,
    values: Any,
    next_values: Any,
    terminated: Any,
    truncated: Any,
    gamma: float = 1.0,
    trace_decay: float = 1.0,
) -> Any:
    """Generalized advantage estimation over one trajectory (the specification's 1-D form).

    ``B_t = (1 - terminated_t) * next_values_t``, ``delta_t = r_t + gamma * B_t - V_t`` and
    ``A_t = delta_t + gamma * trace_decay * A_{t+1}``, where the backward recursion restarts
    after a terminated or truncated step: at a truncation the bootstrap ``next_values_t``
    still enters ``delta_t`` (the task did not end), but nothing later is carried back.

    All five sequences have length T. Returns the advantages as the same kind as ``rewards``
    (a list of floats for a list). This is the readable reference; use :func:`batch_gae` for
    token batches.
    """
    gamma = check_unit_interval(gamma, "gamma")
    trace_decay = check_unit_interval(trace_decay, "trace_decay")
    kind = kind_of(rewards)
    r = as_float(rewards, "rewards")
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(r.shape)}")
    v = as_float(values, "values")
    nv = as_float(next_values, "next_values")
    term = as_mask(terminated, "terminated")
    trunc = as_mask(truncated, "truncated")
    check_same_shape(r, "rewards", values=v, next_values=nv, terminated=term, truncated=trunc)
    rl, vl, nvl = r.tolist(), v.tolist(), nv.tolist()
    tl, ul = term.tolist(), trunc.tolist()
    out = [0.0] * len(rl)
    carry = 0.0
    for t in reversed(range(len(rl))):
        bootstrap = 0.0 if tl[t] else nvl[t]
        delta = rl[t] + gamma * bootstrap - vl[t]
        if tl[t] or ul[t]:
            carry = 0.0  # the recursion stops at an ending: nothing after it belongs here
        carry = delta + gamma * trace_decay * carry
        out[t] = carry
    if kind == "sequence":
        return out
    return restore(torch.tensor(out, dtype=r.dtype, device=r.device), kind)


def _as_float_unchecked(
    value: Any, name: str, *, like: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`as_float` minus the NaN/inf pass for float tensors, for callers that check later.

    A full pass over a large input costs as much as the whole blocked GAE kernel, which finds
    NaN/inf in the blocks it already holds in cache.
    """
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value if like is None else value.to(device=like.device, dtype=like.dtype)
    return as_float(value, name, like=like)


def _batch_inputs(
    rewards: Any,
    values: Any,
    action_mask: Any,
    bootstrap_values: Any,
    gamma: float,
    trace_decay: float,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    gamma = check_unit_interval(gamma, "gamma")
    trace_decay = check_unit_interval(trace_decay, "trace_decay")
    convert = as_float if check else _as_float_unchecked
    r = convert(rewards, "rewards")
    if r.dim() != 2:
        raise ValueError(f"rewards must be [B, T], got shape {tuple(r.shape)}")
    v = convert(values, "values", like=r)
    check_same_shape(r, "rewards", values=v)
    mask = as_mask(action_mask, "action_mask", shape=r.shape).to(r.device)
    boot = as_float(bootstrap_values, "bootstrap_values", like=r)
    if boot.shape != (r.shape[0],):
        raise ValueError(
            f"bootstrap_values has shape {tuple(boot.shape)}, expected ({r.shape[0]},)"
        )
    return r, v, mask, boot, gamma, trace_decay


def batch_gae_reference(
    rewards: Any,
    values: Any,
    action_mask: Any,
    bootstrap_values: Any,
    gamma: float = 1.0,
    trace_decay: float = 1.0,
) -> tuple[Any, Any]:
    """The plain per-step loop (vectorised over rows) computing what :func:`batch_gae` computes.

    Kept as the readable definition for tests and as the benchmark's baseline.
    """
    kind = kind_of(rewards)
    r, v, mask, boot, gamma, trace_decay = _batch_inputs(
        rewards, values, action_mask, bootstrap_values, gamma, trace_decay
    )
    if not torch.equal(r * mask, r):
        raise ValueError("rewards has nonzero entries on positions where action_mask is 0")
    advantages, returns = _loop(r, v, mask, boot, gamma, trace_decay)
    return restore(advantages, kind), restore(returns, kind)


def _loop(
    r: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    boot: torch.Tensor,
    gamma: float,
    trace_decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = torch.zeros_like(r)
    next_value = boot.clone()
    carry = torch.zeros_like(boot)
    for t in reversed(range(r.shape[1])):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        candidate = delta + gamma * trace_decay * carry
        carry = torch.where(m, candidate, carry)
        next_value = torch.where(m, v[:, t], next_value)
        advantages[:, t] = torch.where(m, candidate, torch.zeros_like(candidate))
    return advantages, (advantages + v) * mask


def batch_gae(
    rewards: Any,
    values: Any,
    action_mask: Any,
    bootstrap_values: Any,
    gamma: float = 1.0,
    trace_decay: float = 1.0,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[Any, Any]:
    """GAE over [B, T] token rows, running over action positions only.

    Args:
        rewards: [B, T], placed on action positions. A nonzero reward on a position with
            mask 0 raises ValueError: an observation or prompt token was not chosen by the
            policy, so a reward there has no action to credit (move it to the preceding action).
        values: [B, T] critic values V_t; only action positions are read.
        action_mask: [B, T] bool/0-1; 1 marks tokens sampled by the policy.
        bootstrap_values: [B] value after the row's last action: 0 when the attempt truly
            terminated, the value of the continuation state when it was truncated or is a
            fragment that continues.
        gamma, trace_decay: in [0, 1]; one step of discount per action token.
        out: optional ``(advantages, returns)`` tensors of shape [B, T] and the dtype and
            device of the (converted) rewards, written and returned instead of fresh ones;
            for a training loop that calls this every step on same-shaped batches. They
            must not overlap each other or any input. If a ValueError about the rewards is
            raised, they may be partly written.

    Returns:
        ``(advantages, returns)``, both [B, T] and zero on non-action positions;
        ``returns = advantages + values`` on action positions. No whitening. Fresh tensors
        (or ``out``) that share no memory with the inputs or with any internal buffer.

    For each action t with next action t' (or the bootstrap), ``delta_t = r_t + gamma V_t' -
    V_t`` and ``A_t = delta_t + gamma * trace_decay * A_t'``. The fast path rewrites this,
    exactly, as ``A_t = R_t - V_t + gamma * Y_{t+1}`` where R and Y solve pass-through
    recurrences with decay ``c = gamma * trace_decay`` on actions and 1 elsewhere: R over the
    rewards, Y over ``(1 - trace_decay) * V`` with Y ending at the bootstrap. Both terms stay
    of the size of a return, so nothing large cancels. It runs in cache-sized time blocks on
    a reusable per-thread workspace (see ``tracerl.core._gae_kernel``); calls from several
    threads at once are safe.
    """
    kind = kind_of(rewards)
    r, v, mask, boot, gamma, trace_decay = _batch_inputs(
        rewards, values, action_mask, bootstrap_values, gamma, trace_decay, check=False
    )
    if r.requires_grad or v.requires_grad or boot.requires_grad:
        r, v, boot = r.detach(), v.detach(), boot.detach()
    advantages, returns = _outputs(out, r, (r, v, mask, boot))
    decay = gamma * trace_decay
    if 0.0 < decay < min_scaled_decay(r.dtype):
        check_finite(r, "rewards")
        check_finite(v, "values")
        # So small a decay would push the chunk rescaling past the float range; such values
        # are far from any practical setting, so the plain loop handles them.
        if not torch.equal(r * mask, r):
            raise ValueError("rewards has nonzero entries on positions where action_mask is 0")
        slow_advantages, slow_returns = _loop(r, v, mask, boot, gamma, trace_decay)
        advantages.copy_(slow_advantages)
        returns.copy_(slow_returns)
    else:
        gae_blocks(r, v, mask, boot, gamma, trace_decay, advantages, returns)
    return restore(advantages, kind), restore(returns, kind)


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """Byte range [first, last) of the storage that ``tensor`` can touch."""
    first = tensor.data_ptr()
    span = sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return first, first + (span + 1) * tensor.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    return a0 < b1 and b0 < a1


def _outputs(
    out: tuple[torch.Tensor, torch.Tensor] | None,
    like: torch.Tensor,
    inputs: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh output tensors, or the caller's ``out`` pair after checking it is usable."""
    if out is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format), torch.empty_like(
            like, memory_format=torch.contiguous_format
        )
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError("out must be a tuple (advantages, returns) of two tensors")
    for name, tensor in zip(("advantages", "returns"), out, strict=True):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"out {name} must be a torch tensor, got {type(tensor).__name__}")
        if tensor.shape != like.shape or tensor.dtype != like.dtype or tensor.device != like.device:
            raise ValueError(
                f"out {name} must be {like.dtype} of shape {tuple(like.shape)} on {like.device}, "
                f"got {tensor.dtype} of shape {tuple(tensor.shape)} on {tensor.device}"
            )
        if tensor.requires_grad:
            raise ValueError(f"out {name} must not require grad")
        if any(_overlap(tensor, source) for source in inputs):
            raise ValueError(f"out {name} overlaps an input; pass separate tensors")
    if _overlap(out[0], out[1]):
        raise ValueError("out advantages and returns overlap; pass separate tensors")
    return out[0], out[1]


@dataclass(frozen=True)
class GroupReport:
    """What each group contributed to a group-relative advantage computation."""

    group_ids: tuple[Any, ...]
    """The distinct group ids, in sorted order; the per-group tuples below follow it."""
    sizes: tuple[int, ...]
    """Number of attempts in each group."""
    means: tuple[float, ...]
    """Mean reward of each group."""
    stds: tuple[float, ...]
    """Standard deviation of each group's rewards, in the convention that was used."""
    uniform: tuple[bool, ...]
    """Whether every reward in the group is equal (no relative signal)."""
    num_uniform: int
    """Groups whose rewards are all equal."""
    num_uniform_zero: int
    """Uniform groups whose rewards are all 0 (every attempt failed)."""
    num_uniform_one: int
    """Uniform groups whose rewards are all 1 (every attempt succeeded)."""

    @property
    def num_groups(self) -> int:
        """Number of groups."""
        return len(self.group_ids)

    @property
    def fraction_uniform(self) -> float:
        """Fraction of groups with no within-group reward variation."""
        return self.num_uniform / self.num_groups if self.group_ids else 0.0


def _groups(
    rewards: Any, group_ids: Any
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, torch.Tensor]:
    r = as_float(rewards, "rewards")
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one per attempt), got shape {tuple(r.shape)}")
    if r.numel() == 0:
        raise ValueError("rewards is empty")
    ids = (
        group_ids.detach().cpu().numpy()
        if isinstance(group_ids, torch.Tensor)
        else (np.asarray(group_ids))
    )
    if ids.shape != (r.numel(),):
        raise ValueError(f"group_ids has shape {ids.shape}, expected ({r.numel()},)")
    unique, inverse = np.unique(ids, return_inverse=True)
    index = torch.from_numpy(inverse.reshape(-1).astype(np.int64)).to(r.device)
    sizes = torch.bincount(index, minlength=len(unique)).to(r.dtype)
    return r, index, unique, sizes


def _group_mean(r: torch.Tensor, index: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(sizes).index_add_(0, index, r) / sizes


def group_advantages(
    rewards: Any,
    group_ids: Any,
    scale: Literal["std"] | None = "std",
    std: Literal["population", "sample"] = "population",
    eps: float = 1e-6,
) -> tuple[Any, GroupReport]:
    """Group-relative advantages (GRPO): ``(r - mean_g) / (std_g + eps)`` per attempt.

    Args:
        rewards: [N], one outcome reward per whole attempt.
        group_ids: [N], attempts with the same id answered the same task.
        scale: ``"std"`` divides by the group's standard deviation (GRPO); ``None`` only
            centres (Dr. GRPO), which keeps easy and hard tasks on the reward's own scale.
        std: ``"population"`` (divide by G; the default, because it is the specification's
            convention and gives ±1 for a half-and-half binary group) or ``"sample"`` (divide
            by G - 1, the unbiased convention most frameworks use).
        eps: added to the std so uniform groups give 0, not a division by zero.

    A group of one attempt raises ValueError: it has no comparison to make, and passing its
    raw reward through would silently be a different estimator.
    """
    if std not in ("population", "sample"):
        raise ValueError(f"std must be 'population' or 'sample', got {std!r}")
    if scale not in ("std", None):
        raise ValueError(f"scale must be 'std' or None, got {scale!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    kind = kind_of(rewards)
    r, index, unique, sizes = _groups(rewards, group_ids)
    if bool((sizes < 2).any()):
        lonely = unique[int(torch.nonzero(sizes < 2)[0])]
        raise ValueError(f"group_ids has a group of one attempt ({lonely!r}); need at least 2")
    mean = _group_mean(r, index, sizes)
    centred = r - mean[index]
    squares = torch.zeros_like(sizes).index_add_(0, index, centred**2)
    spread = torch.sqrt(squares / (sizes if std == "population" else sizes - 1))
    advantages = centred / (spread[index] + eps) if scale == "std" else centred
    minimum = torch.full_like(sizes, float("inf")).scatter_reduce_(0, index, r, "amin")
    maximum = torch.full_like(sizes, float("-inf")).scatter_reduce_(0, index, r, "amax")
    uniform = minimum == maximum
    report = GroupReport(
        group_ids=tuple(unique.tolist()),
        sizes=tuple(int(s) for s in sizes.tolist()),
        means=tuple(mean.tolist()),
        stds=tuple(spread.tolist()),
        uniform=tuple(bool(u) for u in uniform.tolist()),
        num_uniform=int(uniform.sum()),
        num_uniform_zero=int((uniform & (minimum == 0)).sum()),
        num_uniform_one=int((uniform & (minimum == 1)).sum()),
    )
    return restore(advantages, kind), report


def rloo_advantages(rewards: Any, group_ids: Any) -> Any:
    """REINFORCE leave-one-out: ``r_i - mean of the other rewards in i's group``.

    Equals ``G / (G - 1) * (r_i - mean_g)``; unbiased because the baseline excludes the
    attempt itself. A group of one attempt raises ValueError (no other attempt to compare).
    """
    kind = kind_of(rewards)
    r, index, unique, sizes = _groups(rewards, group_ids)
    if bool((sizes < 2).any()):
        lonely = unique[int(torch.nonzero(sizes < 2)[0])]
        raise ValueError(f"group_ids has a group of one attempt ({lonely!r}); need at least 2")
    totals = torch.zeros_like(sizes).index_add_(0, index, r)
    baseline = (totals[index] - r) / (sizes[index] - 1)
    return restore(r - baseline, kind)


def whiten(values: Any, mask: Any = None, shift_mean: bool = True, eps: float = 1e-8) -> Any:
    """Normalise ``values`` to zero mean and unit population variance over masked positions.

    Statistics come from the positions where ``mask`` is 1 (all positions when None); other
    positions are returned as 0. With ``shift_mean=False`` the mean is added back (only the
    scale changes). The statistics are those of this call's batch: whiten the whole batch
    before splitting it into micro-batches or ranks.
    """
    kind = kind_of(values)
    x = as_float(values, "values")
    m = (
        torch.ones_like(x, dtype=torch.bool)
        if mask is None
        else as_mask(mask, "mask", shape=x.shape).to(x.device)
    )
    count = int(m.sum())
    if count == 0:
        raise ValueError("mask has no position to whiten over")
    mf = m.to(x.dtype)
    mean = (x * mf).sum() / count
    variance = (((x - mean) * mf) ** 2).sum() / count
    out = (x - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        out = out + mean
    return restore(out * mf, kind)
