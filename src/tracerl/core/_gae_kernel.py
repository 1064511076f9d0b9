"""Private: the cache-blocked kernel behind :func:`tracerl.core.advantages.batch_gae`.

Why it is shaped like this. On a CPU the arithmetic of GAE is a few flops per token; what
costs is memory: every whole-batch temporary is a fresh multi-megabyte allocation whose
pages are faulted in on first write, and every whole-batch pass streams the batch through
main memory. So the kernel walks the batch in time blocks of about ``BLOCK_ELEMENTS`` tokens,
from the last block to the first (the recursion runs backward in time). Each block is read
once from the inputs into a small per-thread workspace (reversed in time, so the backward
recursion becomes a forward cumulative sum), every intermediate step runs in that workspace
while it sits in cache, and the block's results are written once into the outputs. The
workspace is allocated once per (rows, block length, dtype, device) and thread, and reused;
it is never handed to the caller.

The recurrence ``Y_j = u_j + g_j * Y_{j-1}`` (reversed time ``j``, decay ``g`` equal to
``gamma * trace_decay`` on actions and 1 elsewhere) is solved within each chunk of ``chunk``
steps as ``Y_j = Q_j * (carry + sum_{i <= j} u_i / Q_i)``, ``Q`` the inclusive product of
``g`` within the chunk: one cumulative sum of growing terms, so no large partial sum is
cancelled. Chunk lengths keep ``Q`` far above underflow; a short loop carries the value from
one chunk into the next.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tracerl.core._convert import check_finite

BLOCK_ELEMENTS = 1 << 19
"""Tokens per time block: the workspace (about 21 bytes per token, 11 MB) then stays within
a server's last-level cache while the inputs and outputs stream through once. Fewer blocks
mean fewer small torch calls, until the workspace leaves the cache; ``python bench/gae.py
--block-sweep 15,17,19,21`` times the choice (docs/core.md has a run)."""

_MAX_WORKSPACES = 4
"""Workspaces kept per thread (least recently used dropped first)."""


def _orders(dtype: torch.dtype) -> float:
    """Decimal orders of magnitude the chunk rescaling may span in ``dtype``.

    Half of the range below 1 (about 19 for float32, 154 for float64), leaving the other half
    for the magnitudes of the values being rescaled.
    """
    return -math.log10(torch.finfo(dtype).tiny) / 2


def min_scaled_decay(dtype: torch.dtype) -> float:
    """Smallest decay whose single step stays inside the rescaling's range."""
    return float(10.0 ** -_orders(dtype))


def chunk_length(decay: float, length: int, dtype: torch.dtype) -> int:
    """Longest power-of-two chunk whose within-chunk decay product stays far above underflow.

    Keeping the products above the square root of the smallest normal float (about 1e-19 in
    float32) leaves the rescaled terms normal floats, so the rescaling costs no precision.
    """
    if decay >= 1.0:
        return length
    max_len = max(1, int(_orders(dtype) / -math.log10(decay)))
    return min(1 << int(math.log2(max_len)), length)


@dataclass(frozen=True)
class _Workspace:
    """Reusable buffers for one block of ``rows * block`` tokens (flat; viewed per block)."""

    mask: torch.Tensor
    """The block's action mask as 0.0/1.0 in reversed time (float arithmetic on a 0/1 mask
    is several times faster in torch than ``where`` or ``masked_fill`` on a bool one)."""
    scale: torch.Tensor
    """Scratch, then the decay g, then its within-chunk cumulative product Q."""
    planes: torch.Tensor
    """[2, rows * block]: the one or two sequences being scanned, then the results."""
    values: torch.Tensor
    """The block's values on action positions (0 elsewhere), then scratch."""


_local = threading.local()


def _workspace(rows: int, block: int, dtype: torch.dtype, device: torch.device) -> _Workspace:
    """The calling thread's workspace for this layout (threads never share one)."""
    cache: OrderedDict[tuple[int, int, torch.dtype, torch.device], _Workspace] | None
    cache = getattr(_local, "workspaces", None)
    if cache is None:
        cache = _local.workspaces = OrderedDict()
    key = (rows, block, dtype, device)
    found = cache.get(key)
    if found is not None:
        cache.move_to_end(key)
        return found
    size = rows * block
    made = _Workspace(
        mask=torch.empty(size, dtype=dtype, device=device),
        scale=torch.empty(size, dtype=dtype, device=device),
        planes=torch.empty(2, size, dtype=dtype, device=device),
        values=torch.empty(size, dtype=dtype, device=device),
    )
    cache[key] = made
    while len(cache) > _MAX_WORKSPACES:
        cache.popitem(last=False)
    return made


def _layout(rows: int, length: int, chunk: int) -> tuple[int, int]:
    """(block length, chunk length): blocks hold whole chunks, or are one chunk each."""
    block = max(1, min(length, BLOCK_ELEMENTS // max(rows, 1)))
    if block <= chunk:
        return block, block
    return (block // chunk) * chunk, chunk


def _scan(u: torch.Tensor, q: torch.Tensor | None, carry: torch.Tensor, chunk: int) -> torch.Tensor:
    """Overwrite ``u`` ([P, B, n]) with Y, ``Y_{-1} = carry`` ([P, B]); return Y's last column.

    ``q`` ([B, n]) holds Q within chunks of ``chunk`` steps, or is None when every g is 1.
    """
    n = u.shape[-1]
    if q is None:
        u[..., 0].add_(carry)
        u.cumsum_(-1)
        return u[..., -1].clone()
    whole, tail = divmod(n, chunk)
    pieces = []
    if whole:
        cut = whole * chunk
        pieces.append((u[..., :cut].unflatten(-1, (whole, chunk)), q[:, :cut].unflatten(-1, (whole, chunk))))
    if tail:
        pieces.append((u[..., n - tail :].unsqueeze(-2), q[:, n - tail :].unsqueeze(-2)))
    for piece, products in pieces:  # piece: [P, B, k, length], products: [B, k, length]
        piece.div_(products)
        if piece.shape[-2] == 1:
            piece[..., 0, 0].add_(carry)
            piece.cumsum_(-1)
            piece.mul_(products)
            carry = piece[..., 0, -1].clone()
            continue
        totals = piece.sum(-1)  # [P, B, k]
        ends = products[..., -1]  # [B, k]: decay across each whole chunk
        incoming = torch.empty_like(totals)
        for index in range(totals.shape[-1]):
            incoming[..., index] = carry
            carry = ends[:, index] * (carry + totals[..., index])
        piece[..., 0].add_(incoming)
        piece.cumsum_(-1)
        piece.mul_(products)
    return carry


def _following_values(
    active: torch.Tensor, values: torch.Tensor, carry: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For trace_decay == 0: in reversed time, the value at the latest action strictly before
    each position (``carry`` when none in the block), and the carry out of the block.

    The decay is 0 on actions, which the rescaled scan cannot express, so this takes the
    last action index by a cumulative maximum instead (with block-sized temporaries; only
    this rare setting uses it).
    """
    b, n = values.shape
    positions = torch.arange(1, n + 1, device=values.device).expand(b, n)
    latest = (positions * (active != 0)).cummax(-1).values  # 0: no action yet
    extended = torch.cat([carry[:, None], values], dim=1)  # column k + 1 holds position k
    before = torch.cat([torch.zeros_like(latest[:, :1]), latest[:, :-1]], dim=1)
    return extended.gather(1, before), extended.gather(1, latest[:, -1:])[:, 0]


def _reverse_into(
    source: torch.Tensor, target: torch.Tensor, reverse: torch.Tensor, scratch: torch.Tensor
) -> None:
    """Write ``source`` with its last axis reversed into ``target``, allocating nothing.

    ``index_select`` reverses into a contiguous buffer at full speed (into a strided target
    it does not), so it reverses into ``scratch`` or straight into a contiguous ``target``.
    """
    if target.is_contiguous():
        torch.index_select(source, 1, reverse, out=target)
        return
    torch.index_select(source, 1, reverse, out=scratch)
    target.copy_(scratch)


def gae_blocks(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    bootstrap: torch.Tensor,
    gamma: float,
    trace_decay: float,
    advantages: torch.Tensor,
    returns: torch.Tensor,
) -> None:
    """Fill ``advantages`` and ``returns`` ([B, T]) with batch GAE over action positions.

    ``returns_t = R_t + gamma * Y_{t+1}`` and ``advantages_t = returns_t - V_t`` on actions,
    0 elsewhere, where R scans the rewards (ending at 0) and Y scans ``(1 - trace_decay) V``
    over actions (ending at the bootstrap), both with decay ``gamma * trace_decay`` per
    action; the scan of ``gamma * Y`` runs alongside R in the second plane. ``mask`` is bool.
    ``rewards`` and ``values`` need not have been checked for NaN/inf: the kernel checks them
    as it goes and raises ValueError naming the argument. Also raises ValueError for a nonzero reward on a non-action position
    (the outputs may then be partly written). Requires ``gamma * trace_decay`` to be 0 or at
    least :func:`min_scaled_decay`.
    """
    rows, length = rewards.shape
    dtype, device = rewards.dtype, rewards.device
    decay = gamma * trace_decay
    scanned = gamma > 0.0 and decay > 0.0
    chunk = chunk_length(decay, length, dtype) if scanned else length
    block, chunk = _layout(rows, length, chunk)
    space = _workspace(rows, block, dtype, device)
    reverse = torch.arange(block - 1, -1, -1, device=device)
    mask_bytes = mask.view(torch.uint8)  # bool -> float converts fast from bytes, not bools
    two_planes = scanned and trace_decay < 1.0
    # 1 + (decay - 1) * m is one pass fewer than (1 - m) + decay * m, but only exact when
    # decay - 1 keeps all of decay's digits (not for a tiny decay).
    as_dtype = torch.tensor([decay - 1.0, decay], dtype=dtype)
    offset_exact = bool(as_dtype[0] + 1.0 == as_dtype[1])
    # carry[0]: R after the block (reversed time); carry[1]: gamma * Y there.
    if two_planes:
        carry = torch.stack([torch.zeros_like(bootstrap), bootstrap * gamma])
    else:
        carry = bootstrap[None].clone() if scanned else torch.zeros_like(bootstrap)[None]
    following = bootstrap.clone()  # trace_decay == 0: value of the next action (or bootstrap)
    checksum = torch.zeros((), dtype=dtype, device=device)
    end = length
    while end > 0:
        start = max(0, end - block)
        n = end - start
        size = rows * n
        back = reverse[block - n :]  # n-1 .. 0: reverses a block's columns
        active = space.mask[:size].view(rows, n)
        q = space.scale[:size].view(rows, n)
        q.copy_(mask_bytes[:, start:end])
        torch.index_select(q, 1, back, out=active)
        planes = space.planes[:, :size].view(2, rows, n)
        own, other = planes[0], planes[1]
        # A plain strided copy then an in-cache reversal reads the (cold) input faster than
        # one index_select from it.
        other.copy_(rewards[:, start:end])
        torch.index_select(other, 1, back, out=own)
        torch.addcmul(own, own, active, value=-1.0, out=other)  # rewards off the actions
        low, high = torch.aminmax(other)
        if bool(low) or bool(high):
            check_finite(rewards, "rewards")
            raise ValueError("rewards has nonzero entries on positions where action_mask is 0")
        v = space.values[:size].view(rows, n)
        q.copy_(values[:, start:end])
        torch.index_select(q, 1, back, out=v)
        v.mul_(active)
        if scanned:
            products: torch.Tensor | None = None
            if decay != 1.0:
                # g: decay on actions, 1 elsewhere, each exactly as the dtype rounds them.
                if offset_exact:
                    torch.mul(active, decay - 1.0, out=q).add_(1.0)
                else:
                    torch.mul(active, -1.0, out=q).add_(1.0).add_(active, alpha=decay)
                products = q
                whole = (n // chunk) * chunk
                if whole:
                    q[:, :whole].unflatten(-1, (-1, chunk)).cumprod_(-1)
                if whole < n:
                    q[:, whole:].cumprod_(-1)
            if two_planes:
                torch.mul(v, gamma * (1.0 - trace_decay), out=other)
                previous = carry[1]
                carry = _scan(planes, products, carry, chunk)
                # returns_t = R_t + gamma * Y_{t+1}: one step back in reversed time.
                own[:, 1:].add_(other[:, :-1])
                own[:, 0].add_(previous)
            else:
                carry = _scan(planes[:1], products, carry, chunk)
            own.mul_(active)
        elif gamma > 0.0:  # trace_decay == 0: the one-step residual
            next_values, following = _following_values(active, v, following)
            own.addcmul_(next_values, active, value=gamma)
        torch.sub(own, v, out=other)
        # Any NaN or inf in the block's rewards or values reaches its advantages (a masked
        # value still does: inf * 0 is NaN), so one in-cache sum per block replaces a full
        # pass over each input.
        checksum = checksum + other.sum()
        _reverse_into(own, returns[:, start:end], back, v)
        _reverse_into(other, advantages[:, start:end], back, q)
        end = start
    if not bool(torch.isfinite(checksum)):
        # A non-finite input, or finite results too large for their sum: find out which.
        check_finite(rewards, "rewards")
        check_finite(values, "values")
