"""Diagnostics of a step's packed batch, written with the step's metrics: each task's share of
the loss weight with and without the attempts' fragments split (``segmentation``), and the
critic's explained variance on the step's completed attempts (``critic``); the run's totals
and its costs per solved attempt (``per_solved``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tracerl.core import batch_gae, loss_weights
from tracerl.eval.summary import succeeded
from tracerl.trace import Attempt, PackedBatch


def segmentation_report(batch: PackedBatch, mode: Any, constant: float | None
                        ) -> dict[str, float]:
    """Each task's share of the loss weight with its attempts' fragments as packed, and as if
    each attempt were one row; the largest change shows what compaction did to the weights."""
    mask = batch.action_mask
    if not bool(mask.any()):
        return {}
    tasks = batch.task_index
    try:
        split = loss_weights(mask, mode, tasks, constant).sum(-1)
    except ValueError:
        return {}
    per_attempt = torch.zeros(len(batch.attempt_ids))
    per_attempt.index_add_(0, batch.attempt_index, mask.sum(-1).float())
    width = int(per_attempt.max())
    whole = torch.arange(width)[None, :] < per_attempt[:, None]
    attempt_task = torch.zeros(len(batch.attempt_ids), dtype=torch.long)
    attempt_task[batch.attempt_index] = tasks
    try:
        joined = loss_weights(whole, mode, attempt_task, constant).sum(-1)
    except ValueError:
        return {}
    count = int(tasks.max()) + 1
    share_split = torch.zeros(count, dtype=torch.float64).index_add_(0, tasks, split)
    share_joined = torch.zeros(count, dtype=torch.float64).index_add_(0, attempt_task, joined)
    return {"max_task_share_change": float((share_split - share_joined).abs().max()),
            "split_attempts": float((torch.bincount(batch.attempt_index) > 1).sum()),
            "max_task_share": float(share_split.max())}


def critic_report(batch: PackedBatch, old_values: torch.Tensor | None,
                  token_rewards: torch.Tensor, gamma: float) -> dict[str, float]:
    """Explained variance of the old values against completed returns of this step's
    attempts, which the critic has never been fitted on (they were just collected)."""
    complete = (~batch.needs_bootstrap) & (batch.fragment_index == 0)
    if not bool(complete.any()) or old_values is None:
        return {}
    mask = batch.action_mask[complete]
    _, returns = batch_gae(token_rewards[complete], torch.zeros(mask.shape), mask,
                           torch.zeros(int(complete.sum())), gamma=gamma, trace_decay=1.0)
    target, predicted = returns[mask].double(), old_values[complete][mask].double()
    variance = float(target.var(unbiased=False))
    explained = (1.0 - float((target - predicted).var(unbiased=False)) / variance
                 if variance > 0 else 0.0)
    return {"explained_variance_heldout": explained,
            "predicted_return_mean": float(predicted.mean()),
            "completed_return_mean": float(target.mean())}


def add_totals(totals: dict[str, float], metrics: dict[str, Any], attempts: Sequence[Attempt],
               wall_seconds: float) -> dict[str, float]:
    """Add a finished step's costs to the run's ``totals`` (generated tokens, tool seconds,
    groups dynamic sampling filtered, attempts that solved their task) and return the run's
    costs so far per solved attempt: generated tokens, tool seconds and wall seconds
    (``wall_seconds``: the run's RL time so far). Empty while nothing is solved."""
    costs, dynamic = metrics.get("costs", {}), metrics.get("dynamic", {})
    added = {"generated_tokens": costs.get("generated_tokens", 0.0),
             "tool_seconds": costs.get("tool_seconds", 0.0),
             "filtered_groups": (dynamic.get("filtered_all_zero", 0)
                                 + dynamic.get("filtered_all_one", 0)),
             "solved": sum(succeeded(a) for a in attempts)}
    for key, value in added.items():
        totals[key] = totals.get(key, 0.0) + float(value)
    solved = totals["solved"]
    if not solved:
        return {}
    return {"solved": solved, "generated_tokens": totals["generated_tokens"] / solved,
            "tool_seconds": totals["tool_seconds"] / solved, "wall_seconds": wall_seconds / solved}
