"""Loss reduction by explicit per-token weights, computed once for the whole batch.

``loss_weights`` returns [B, T] weights such that ``(weights * loss).sum()`` is the objective.
Because the denominator is fixed from the *whole* batch before any split, summing
``(weights[rows] * loss[rows]).sum()`` over micro-batches, or over data-parallel ranks (an
all-reduce with SUM), reproduces the full-batch value and gradient exactly; padding positions
carry weight 0. (If a data-parallel wrapper *averages* gradients over R ranks, multiply each
rank's loss by R.)
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch

from tracerl.core._convert import as_mask

__all__ = ["LOSS_MODES", "LossMode", "aggregate_loss", "loss_weights"]

LossMode = Literal["token_mean", "sequence_mean", "task_mean", "constant"]
"""Denominator of a loss.

``token_mean``: every action position of the batch counts once (longer rows weigh more).
``sequence_mean``: mean over each row's action positions, then over rows.
``task_mean``: mean over all action positions of a task's rows, then over tasks (a task split
into fragments still counts once). Needs ``group_ids``.
``constant``: sum over action positions divided by a fixed ``constant`` (Dr. GRPO), so the
weight of a token does not depend on what else is in the batch.
"""

LOSS_MODES: tuple[LossMode, ...] = ("token_mean", "sequence_mean", "task_mean", "constant")


def _task_index(group_ids: Any, rows: int) -> torch.Tensor:
    if isinstance(group_ids, torch.Tensor):
        ids = group_ids.detach().cpu().numpy()
    else:
        ids = np.asarray(group_ids)
    if ids.shape != (rows,):
        raise ValueError(f"group_ids has shape {ids.shape}, expected ({rows},): one id per row")
    _, inverse = np.unique(ids, return_inverse=True)
    return torch.from_numpy(inverse.reshape(-1).astype(np.int64))


def loss_weights(
    action_mask: Any,
    mode: LossMode,
    group_ids: Any = None,
    constant: float | None = None,
) -> torch.Tensor:
    """[B, T] float64 weights (on the mask's device) whose weighted sum is the mode's mean.

    Raises ValueError when the batch (``token_mean``), a row (``sequence_mean``) or a task
    (``task_mean``) has no action position, since its mean would be undefined; drop such rows
    before building the batch.
    """
    mask = as_mask(action_mask, "action_mask")
    if mask.dim() != 2:
        raise ValueError(f"action_mask must be [B, T], got shape {tuple(mask.shape)}")
    maskf = mask.to(torch.float64)
    per_row = maskf.sum(-1)
    if mode == "token_mean":
        total = float(per_row.sum())
        if total == 0:
            raise ValueError("action_mask has no action position")
        return maskf / total
    if mode == "sequence_mean":
        if bool((per_row == 0).any()):
            row = int(torch.nonzero(per_row == 0)[0])
            raise ValueError(f"action_mask row {row} has no action position")
        return maskf / (per_row[:, None] * mask.shape[0])
    if mode == "task_mean":
        if group_ids is None:
            raise ValueError("group_ids is required for mode 'task_mean'")
        task = _task_index(group_ids, mask.shape[0]).to(mask.device)
        tasks = int(task.max()) + 1 if task.numel() else 0
        per_task = torch.zeros(tasks, dtype=torch.float64, device=mask.device)
        per_task.index_add_(0, task, per_row)
        if bool((per_task == 0).any()):
            raise ValueError("group_ids has a task whose rows have no action position")
        return maskf / (per_task[task][:, None] * tasks)
    if mode == "constant":
        if constant is None or isinstance(constant, bool) or not constant > 0:
            raise ValueError(
                f"constant must be a positive number for mode 'constant', got {constant!r}"
            )
        return maskf / float(constant)
    raise ValueError(f"mode must be one of {LOSS_MODES}, got {mode!r}")


def aggregate_loss(
    loss: torch.Tensor,
    action_mask: Any,
    mode: LossMode,
    group_ids: Any = None,
    constant: float | None = None,
) -> torch.Tensor:
    """``(loss_weights(...) * loss).sum()``: the reduced objective, differentiable in ``loss``."""
    if not isinstance(loss, torch.Tensor):
        loss = torch.as_tensor(loss, dtype=torch.float64)
    weights = loss_weights(action_mask, mode, group_ids, constant)
    if weights.shape != loss.shape:
        raise ValueError(
            f"loss has shape {tuple(loss.shape)}, but action_mask has {tuple(weights.shape)}"
        )
    if not bool(torch.isfinite(loss.detach()).all()):
        raise ValueError("loss contains NaN or inf")
    return (weights.to(device=loss.device, dtype=loss.dtype) * loss).sum()
