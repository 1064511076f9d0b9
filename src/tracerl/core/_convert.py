"""Private helpers: accept tensors, arrays or sequences; give back the same kind; validate.

Every public function of ``tracerl.core`` runs on torch tensors. Inputs that arrive as NumPy
arrays or plain Python sequences are converted on the way in (NumPy without a copy where the
dtype allows) and the result is converted back to the caller's kind on the way out.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch

Kind = Literal["tensor", "ndarray", "sequence"]
"""The kind of container an argument arrived in: a torch tensor, a NumPy array, or a plain
Python sequence (list/tuple, possibly nested) or scalar."""


def kind_of(value: object) -> Kind:
    """Return the container kind of ``value``."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, np.ndarray):
        return "ndarray"
    return "sequence"


def as_float(value: object, name: str, *, like: torch.Tensor | None = None) -> torch.Tensor:
    """Convert ``value`` to a floating-point tensor, checking that every entry is finite.

    Integer and bool inputs become float64 (float32 stays float32, so the fast paths keep their
    precision and speed). With ``like`` the result is moved to its device and dtype.
    """
    if isinstance(value, torch.Tensor):
        tensor = value
    elif isinstance(value, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(value))
    elif isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be numbers, got a string")
    else:
        try:
            tensor = torch.as_tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"{name} must be a number or a sequence of numbers: {error}") from None
    if not tensor.is_floating_point():
        if tensor.is_complex():
            raise ValueError(f"{name} must be real numbers, got {tensor.dtype}")
        tensor = tensor.to(torch.float64)
    if like is not None:
        tensor = tensor.to(device=like.device, dtype=like.dtype)
    check_finite(tensor, name)
    return tensor


def as_mask(value: object, name: str, *, shape: torch.Size | None = None) -> torch.Tensor:
    """Convert ``value`` to a bool tensor; entries must be 0/1 (or bool)."""
    if isinstance(value, torch.Tensor):
        tensor = value
    elif isinstance(value, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(value))
    else:
        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"{name} must be a sequence of 0/1 or bool: {error}") from None
    if tensor.dtype != torch.bool:
        bad = (tensor != 0) & (tensor != 1)
        if bool(bad.any()):
            raise ValueError(f"{name} must contain only 0/1 or bool values")
        tensor = tensor != 0
    if shape is not None and tensor.shape != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    return tensor


def check_finite(tensor: torch.Tensor, name: str) -> None:
    """Raise ValueError when ``tensor`` holds NaN or inf.

    A full ``isfinite().all()`` pass costs more than the GAE itself on large batches, so the
    sum is checked first: a finite sum proves every entry finite, and only a non-finite sum
    (a NaN/inf entry, or an overflow of huge finite entries) pays for the exact check.
    """
    data = tensor.detach()
    if data.numel() == 0:
        return
    if not bool(torch.isfinite(data.sum())) and not bool(torch.isfinite(data).all()):
        raise ValueError(f"{name} contains NaN or inf")


def check_same_shape(reference: torch.Tensor, ref_name: str, **others: torch.Tensor) -> None:
    """Raise ValueError naming the first argument whose shape differs from ``reference``."""
    for name, tensor in others.items():
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, but {ref_name} has "
                f"{tuple(reference.shape)}"
            )


def check_unit_interval(value: float, name: str) -> float:
    """Validate a coefficient such as gamma or trace_decay: a real number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if not (0.0 <= float(value) <= 1.0) or math.isnan(float(value)):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def restore(tensor: torch.Tensor, kind: Kind) -> Any:
    """Return ``tensor`` as the container kind the caller used."""
    if kind == "tensor":
        return tensor
    data = tensor.detach().cpu()
    if kind == "ndarray":
        return data.numpy()
    return data.tolist()
