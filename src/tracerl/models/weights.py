"""Checks on loaded weights, shared by every loader (trainer, evaluation, serving, samplers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def check_finite_weights(model: Any, source: str | Path) -> None:
    """Raise ValueError naming each floating-point tensor of ``model`` (a ``torch.nn.Module``)
    that holds NaN or infinite values: a policy loaded from ``source`` with broken weights would
    otherwise be evaluated, served or trained on without a word."""
    problems: list[str] = []
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
            continue
        nan = int(torch.isnan(tensor).sum())
        inf = int(torch.isinf(tensor).sum())
        if nan or inf:
            counts = [f"{n} {kind}" for n, kind in ((nan, "NaN"), (inf, "infinite")) if n]
            problems.append(f"tensor {name!r} has {' and '.join(counts)} values")
    if problems:
        more = f" (and {len(problems) - 3} more tensors)" if len(problems) > 3 else ""
        raise ValueError(f"checkpoint {source}: " + "; ".join(problems[:3]) + more)
