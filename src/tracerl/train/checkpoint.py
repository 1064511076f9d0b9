"""Checkpoints that a killed run resumes from without repeating or losing an update.

A checkpoint is a directory ``checkpoints/step-000012`` holding the policy (``save_pretrained``,
so ``tracerl eval --policy`` and ``AutoModelForCausalLM`` load it), its tokenizer, and
``trainer.pt``: the optimizer, the critic's own weights, every random generator, the policy
version and the trainer's state. It is written under a temporary name, fsynced and renamed
into place, so a crash leaves either the complete checkpoint or none. ``step`` in a checkpoint
is the number of RL steps *completed*: resuming from ``step-000012`` runs step 12 next.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINTS_DIR = "checkpoints"
"""Sub-directory of the run holding the checkpoints."""
_NAME = re.compile(r"^step-(\d{6})$")


@dataclass
class TrainerState:
    """What the loop needs, besides weights, to continue exactly where it stopped."""

    step: int = 0
    """RL steps completed."""
    policy_version: int = 0
    """Version of the policy weights (one per optimizer update of the policy)."""
    task_success: dict[str, float] = field(default_factory=dict)
    """Estimated success per train task (an EMA), for success-weighted task sampling."""
    elapsed_seconds: float = 0.0
    """RL wall time spent before this checkpoint (for ``max_seconds`` across restarts)."""
    totals: dict[str, float] = field(default_factory=dict)
    """Running totals (generated tokens, tool seconds, filtered groups, ...)."""


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())


def rng_state() -> dict[str, Any]:
    """Every global random generator's state."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """The directory of the checkpoint after ``step`` RL steps (whether or not it exists)."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step:06d}"


def kept_steps(run_dir: str | Path) -> list[int]:
    """The steps of the complete checkpoints a run holds, ascending."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if (m := _NAME.match(p.name)) and (p / "trainer.pt").is_file())


def save_checkpoint(run_dir: str | Path, state: TrainerState, model: Any, tokenizer: Any,
                    extra: dict[str, Any], files: dict[str, str] | None = None) -> Path:
    """Write checkpoint ``state.step`` atomically; returns its directory. ``files``: more
    text files to put in it (name -> content)."""
    final = checkpoint_path(run_dir, state.step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({"state": state.__dict__, "rng": rng_state(), **extra}, tmp / "trainer.pt")
    for name, content in (files or {}).items():
        (tmp / name).write_text(content, encoding="utf-8")
    _fsync_tree(tmp)
    if final.exists():  # the same step saved again after a restart: replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most steps, or None."""
    steps = kept_steps(run_dir)
    return checkpoint_path(run_dir, steps[-1]) if steps else None


def load_trainer_file(directory: Path) -> tuple[TrainerState, dict[str, Any]]:
    """The trainer state and the rest of ``trainer.pt`` (optimizer, critic, generators)."""
    # On the CPU first: a run saved on a GPU resumes anywhere (the optimizer moves its state
    # to the parameters' device when it loads it).
    payload = torch.load(directory / "trainer.pt", weights_only=False, map_location="cpu")
    state = TrainerState(**payload.pop("state"))
    return state, payload


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)))
    for _, path in found[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
