"""Denominators: full batch, micro-batches and data-parallel ranks give the same gradient."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import core_grad_worker as worker


def _full_and_micro(mode: str, extra: dict) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    batch = worker.make_batch()
    weights = worker.loss_weights(batch["mask"], mode, **extra)
    model = worker.make_model()
    full = worker.objective(model, batch, weights, slice(0, worker.ROWS))
    full.backward()
    full_grad = worker.gradients(model)
    model = worker.make_model()
    total = 0.0
    for start in range(0, worker.ROWS, 2):  # 4 micro-batches of 2 rows
        part = worker.objective(model, batch, weights, slice(start, start + 2))
        part.backward()
        total += float(part.detach())
    return full_grad, worker.gradients(model), float(full.detach()), total


@pytest.mark.parametrize(("mode", "extra"), worker.MODES, ids=[m for m, _ in worker.MODES])
def test_micro_batches_reproduce_the_full_batch(mode: str, extra: dict) -> None:
    full_grad, micro_grad, full_value, micro_value = _full_and_micro(mode, extra)
    assert micro_value == pytest.approx(full_value, abs=1e-12)
    assert float(full_grad.abs().max()) > 1e-3  # a real gradient, not zeros
    assert torch.allclose(micro_grad, full_grad, atol=1e-6, rtol=0)


def test_two_gloo_ranks_reproduce_the_full_batch(tmp_path: Path) -> None:
    init_file = tmp_path / "rendezvous"
    mp.spawn(worker.rank_main, args=(2, str(init_file), str(tmp_path)), nprocs=2, join=True)
    for mode, extra in worker.MODES:
        full_grad, _, _, _ = _full_and_micro(mode, extra)
        rank_grad = torch.load(os.path.join(tmp_path, f"{mode}.pt"))
        assert torch.allclose(rank_grad, full_grad, atol=1e-6, rtol=0), mode


@torch.no_grad()
def test_naive_per_micro_batch_mean_does_not_reproduce_it() -> None:
    # The reason for explicit weights: averaging inside each micro-batch changes the objective.
    batch = worker.make_batch()
    model = worker.make_model()
    everything = slice(0, worker.ROWS)
    full = worker.objective(
        model, batch, worker.loss_weights(batch["mask"], "token_mean"), everything
    )
    naive = 0.0
    for start in range(0, worker.ROWS, 2):
        rows = slice(start, start + 2)
        local = worker.loss_weights(batch["mask"][rows], "token_mean")
        part = {name: tensor[rows] for name, tensor in batch.items()}
        naive += float(worker.objective(model, part, local, slice(0, 2))) / 4
    assert abs(naive - float(full)) > 1e-6
