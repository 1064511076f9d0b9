"""Advantage estimators: GAE (1-D and batched over action positions), group-relative, RLOO.

Paper symbols: ``gamma`` is the discount, ``trace_decay`` is GAE's lambda (Schulman et al.,
"High-Dimensional Continuous Control Using Generalized Advantage Estimation", §3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from tracerl.core._convert import (
    as_float,
    as_mask,
    check_same_shape,
    check_unit_interval,
    kind_of,
    restore,
)

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


def _batch_inputs(
    rewards: Any,
    values: Any,
    action_mask: Any,
    bootstrap_values: Any,
    gamma: float,
    trace_decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    gamma = check_unit_interval(gamma, "gamma")
    trace_decay = check_unit_interval(trace_decay, "trace_decay")
    r = as_float(rewards, "rewards")
    if r.dim() != 2:
        raise ValueError(f"rewards must be [B, T], got shape {tuple(r.shape)}")
    v = as_float(values, "values", like=r)
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


def _orders(dtype: torch.dtype) -> float:
    """Decimal orders of magnitude the chunk rescaling may span in ``dtype``.

    Half of the range below 1 (about 19 for float32, 154 for float64), leaving the other half
    for the magnitudes of the values being rescaled.
    """
    return -math.log10(torch.finfo(dtype).tiny) / 2


def _min_scaled_decay(dtype: torch.dtype) -> float:
    """Smallest decay whose single step stays inside the rescaling's range."""
    return float(10.0 ** -_orders(dtype))


def _chunk_length(decay: float, length: int, dtype: torch.dtype) -> int:
    """Longest power-of-two chunk whose within-chunk decay product stays far above underflow.

    The fast path rescales each chunk by cumulative decay products; keeping them above the
    square root of the smallest normal float (about 1e-19 in float32) leaves the rescaled terms
    normal floats, so the rescaling costs no precision.
    """
    if decay >= 1.0:
        return length
    max_len = max(1, int(_orders(dtype) / -math.log10(decay)))
    chunk = 1 << int(math.log2(max_len))
    return min(chunk, length)


def _scan_in_place(
    values: torch.Tensor, scale: torch.Tensor | None, boundary: torch.Tensor, chunk: int
) -> None:
    """Overwrite ``values`` (u) with Y, where ``Y_j = u_j + g_j * Y_{j-1}`` and ``Y_{-1} = boundary``.

    Runs forward along the last axis of [B, T] (callers pass time reversed). ``scale`` holds
    the inclusive product Q of g within each chunk of ``chunk`` steps (None when every g is
    1). Within a chunk ``Y_j = Q_j * (carry + sum_{i <= j} u_i / Q_i)``: one cumulative sum of
    growing terms, so no large partial sum is ever cancelled. Chunk lengths keep Q far above
    underflow. The carry into each chunk takes a short loop over T / chunk chunk totals.
    """
    b, t = values.shape
    if scale is None:
        values[:, 0].add_(boundary)
        values.cumsum_(-1)
        return
    whole, tail = divmod(t, chunk)
    blocks = []  # (u, Q) as [B, chunks, length] views of the same storage
    if whole:
        cut = whole * chunk
        blocks.append((values[:, :cut].view(b, whole, chunk), scale[:, :cut].view(b, whole, chunk)))
    if tail:
        blocks.append(
            (values[:, t - tail :].view(b, 1, tail), scale[:, t - tail :].view(b, 1, tail))
        )
    carry = boundary
    for u, q in blocks:
        u.div_(q)
        totals = u.sum(-1)  # (B, chunks)
        ends = q[..., -1]  # (B, chunks): decay across each whole chunk
        incoming = torch.empty_like(totals)
        for index in range(totals.shape[1]):
            incoming[:, index] = carry
            carry = ends[:, index] * (carry + totals[:, index])
        u[..., 0].add_(incoming)
        u.cumsum_(-1)
        u.mul_(q)


def _next_action_values(
    values: torch.Tensor, mask: torch.Tensor, boot: torch.Tensor
) -> torch.Tensor:
    """For each position, the value at the first action strictly after it (else bootstrap)."""
    b, t = values.shape
    positions = torch.arange(t, device=values.device).expand(b, t)
    index = torch.where(mask, positions, torch.full_like(positions, t))
    # reversed cumulative minimum gives the first action at or after each position
    first_at_or_after = index.flip(-1).cummin(-1).values.flip(-1)
    following = torch.cat([first_at_or_after[:, 1:], torch.full_like(index[:, :1], t)], dim=1)
    extended = torch.cat([values, boot[:, None]], dim=1)
    return extended.gather(1, following)


def batch_gae(
    rewards: Any,
    values: Any,
    action_mask: Any,
    bootstrap_values: Any,
    gamma: float = 1.0,
    trace_decay: float = 1.0,
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

    Returns:
        ``(advantages, returns)``, both [B, T] and zero on non-action positions;
        ``returns = advantages + values`` on action positions. No whitening.

    For each action t with next action t' (or the bootstrap), ``delta_t = r_t + gamma V_t' -
    V_t`` and ``A_t = delta_t + gamma * trace_decay * A_t'``. The fast path rewrites this,
    exactly, as ``A_t = R_t - V_t + gamma * Y_{t+1}`` where R and Y solve pass-through
    recurrences with decay ``c = gamma * trace_decay`` on actions and 1 elsewhere: R over the
    rewards, Y over ``(1 - trace_decay) * V`` with Y ending at the bootstrap. Both terms stay
    of the size of a return, so nothing large cancels.
    """
    kind = kind_of(rewards)
    r, v, mask, boot, gamma, trace_decay = _batch_inputs(
        rewards, values, action_mask, bootstrap_values, gamma, trace_decay
    )
    if r.requires_grad or v.requires_grad:
        r, v, boot = r.detach(), v.detach(), boot.detach()
    decay = gamma * trace_decay
    if 0.0 < decay < _min_scaled_decay(r.dtype):
        # So small a decay would push the chunk rescaling past the float range; such values
        # are far from any practical setting, so the plain loop handles them.
        if not torch.equal(r * mask, r):
            raise ValueError("rewards has nonzero entries on positions where action_mask is 0")
        advantages, returns = _loop(r, v, mask, boot, gamma, trace_decay)
        return restore(advantages, kind), restore(returns, kind)
    # Work in reversed time so both recurrences run forward, and in place on a handful of
    # buffers: fresh multi-megabyte allocations (page faults) cost more than the arithmetic.
    rewards_rev = r.flip(-1)
    values_rev = v.flip(-1)
    maskf = mask.flip(-1).to(r.dtype)
    nonzero = torch.count_nonzero(rewards_rev)
    rewards_rev.mul_(maskf)
    if torch.count_nonzero(rewards_rev) != nonzero:
        raise ValueError("rewards has nonzero entries on positions where action_mask is 0")
    values_rev.mul_(maskf)  # values on action positions
    returns_rev = rewards_rev
    if gamma == 0.0:
        pass  # returns are the rewards themselves
    elif decay == 0.0:
        # trace_decay == 0: the one-step residual; the scaled scan needs decay > 0.
        following = _next_action_values(v, mask, boot).flip(-1)
        returns_rev.add_(following.mul_(maskf), alpha=gamma)
    else:
        scale = None
        chunk = _chunk_length(decay, r.shape[1], r.dtype)
        if decay != 1.0:
            scale = torch.rsub(maskf, 1.0).add_(maskf, alpha=decay)  # g: decay on actions
            whole = (r.shape[1] // chunk) * chunk
            scale[:, :whole].view(r.shape[0], -1, chunk).cumprod_(-1)
            scale[:, whole:].cumprod_(-1)
        if trace_decay == 1.0:
            # Y reduces to the bootstrap, which folds into R's boundary (gamma == decay).
            _scan_in_place(returns_rev, scale, boot, chunk)
        else:
            carried = values_rev * (1.0 - trace_decay)
            _scan_in_place(returns_rev, scale, torch.zeros_like(boot), chunk)
            _scan_in_place(carried, scale, boot, chunk)
            # returns_t = R_t + gamma * Y_{t+1}; Y_T is the bootstrap. Reversed: shift by one.
            returns_rev[:, 1:].add_(carried[:, :-1], alpha=gamma)
            returns_rev[:, 0].add_(boot, alpha=gamma)
        returns_rev.mul_(maskf)
    advantages_rev = values_rev.neg_().add_(returns_rev)
    advantages, returns = advantages_rev.flip(-1), returns_rev.flip(-1)
    return restore(advantages, kind), restore(returns, kind)


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
