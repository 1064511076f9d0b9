"""Which torch device a name means on this machine, refused clearly when it has none."""

from __future__ import annotations

import torch


def resolve_device(name: str, field: str = "model.device") -> torch.device:
    """``name`` (cpu, cuda, cuda:N or auto) as a torch device; ValueError, naming ``field``,
    if it is not one this machine has."""
    text = name.strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        device = torch.device("meta")  # not a device name at all: refused below
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"{field}: expected cpu, cuda, cuda:N or auto, got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"{field}: {name!r} asked for, but this torch sees no CUDA device "
                         "(use cpu, or auto to take a GPU only where there is one)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{field}: {name!r} asked for, but torch sees "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    return device
