"""Data-parallel ranks for ``torchrun --nproc_per_node N -m tracerl train CONFIG``.

Ranks share the update, not the rollouts. Rank 0 (the lead) does everything a single process
does: it collects, verifies, freezes the old policy, computes the advantages, evaluates, writes
the trace store, the metrics and the checkpoints. It then broadcasts the step's rows (old
logprobs, values and reference logprobs already frozen) to every rank; each rank computes every
``world_size``-th row of each minibatch and ``update.minibatch_step`` sums the gradients with an
all-reduce, so every rank takes the same optimizer step and the weights stay identical (the
update equals one process's to float summation order: ``tests/train/test_train_ranks.py``).
Rank 0's weights are broadcast once at the start (after a warm start or a resume), so ranks
never drift apart because their warm starts rounded differently.

The backend is NCCL when the device is a GPU (each rank takes ``cuda:LOCAL_RANK``) and gloo on
the CPU. Without torchrun's variables (``WORLD_SIZE`` unset or 1) nothing here does anything.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

TIMEOUT = datetime.timedelta(hours=3)
"""How long a rank waits for the lead (which may be collecting or evaluating meanwhile)."""


def start(device: torch.device) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``: joins torchrun's process group when there is one (or
    uses one the caller initialised), and gives each GPU rank its own device."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        return 0, 1, device
    if device.type == "cuda" and device.index is None:
        local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    return rank, world, device


def share(value: T, world_size: int, device: torch.device) -> T:
    """Rank 0's ``value`` on every rank (returned as is with one rank)."""
    if world_size == 1:
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]


def sync_parameters(module: torch.nn.Module, world_size: int) -> None:
    """Every rank takes rank 0's parameters and buffers."""
    if world_size == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)
