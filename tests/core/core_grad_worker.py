"""Shared by the micro-batch/rank invariance test: a tiny policy, a batch, and a rank worker.

Not a test module itself; the test imports it by adding this folder to ``sys.path`` so that
processes started with ``spawn`` can import it too.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tracerl import kl_loss, loss_weights, ppo_token_loss

FEATURES, VOCAB, ROWS, LENGTH = 5, 7, 8, 12
MODES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("token_mean", {}),
    ("sequence_mean", {}),
    ("task_mean", {"group_ids": [0, 0, 0, 1, 1, 2, 2, 2]}),
    ("constant", {"constant": 64.0}),
)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, VOCAB).double()


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, LENGTH + 1, (ROWS,), generator=g)
    mask = torch.arange(LENGTH)[None, :] < lengths[:, None]
    mask &= torch.rand(ROWS, LENGTH, generator=g) < 0.8  # observations inside the row
    mask[:, 0] = True
    return {
        "features": torch.randn(ROWS, LENGTH, FEATURES, generator=g, dtype=torch.float64),
        "actions": torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g),
        "mask": mask,
        "advantages": torch.randn(ROWS, LENGTH, generator=g, dtype=torch.float64),
        "old": -torch.rand(ROWS, LENGTH, generator=g, dtype=torch.float64) * 2 - 0.5,
        "ref": -torch.rand(ROWS, LENGTH, generator=g, dtype=torch.float64) * 2 - 0.5,
    }


def per_token_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], rows: slice, width: int
) -> torch.Tensor:
    """Loss of ``rows``, cut (or padded) to ``width`` positions, as a micro-batch would see it."""

    def take(x: torch.Tensor) -> torch.Tensor:
        return x[rows, :width]

    logits = model(take(batch["features"]))
    logprobs = torch.log_softmax(logits, -1).gather(-1, take(batch["actions"])[..., None])[..., 0]
    mask = take(batch["mask"])
    policy, _ = ppo_token_loss(
        logprobs,
        take(batch["old"]),
        take(batch["advantages"]),
        mask,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
    )
    kl, _ = kl_loss(logprobs, take(batch["ref"]), mask, "k3")
    return policy + 0.1 * kl


def objective(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], weights: torch.Tensor, rows: slice
) -> torch.Tensor:
    mask = batch["mask"][rows]
    # Trim trailing all-padding columns: padding must not change anything.
    width = int(torch.nonzero(mask.any(0)).max()) + 1
    return (weights[rows, :width] * per_token_loss(model, batch, rows, width)).sum()


def gradients(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        batch = make_batch()
        per = ROWS // world
        rows = slice(rank * per, (rank + 1) * per)
        for mode, extra in MODES:
            model = make_model()
            weights = loss_weights(batch["mask"], mode, **extra)  # whole batch, every rank
            objective(model, batch, weights, rows).backward()
            grad = gradients(model)
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            if rank == 0:
                torch.save(grad, os.path.join(out_dir, f"{mode}.pt"))
    finally:
        dist.destroy_process_group()
