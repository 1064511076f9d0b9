"""Per-step metrics: a JSON-lines file, TensorBoard event files, and a progress bar.

Records are nested mappings (``{"reward": {"mean": 0.4}}``); the JSON-lines file keeps them
nested, TensorBoard gets every numeric leaf under its slash-joined name. A resumed run appends
to the same file; a step already written (the run died after logging, before checkpointing)
is never written twice.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

METRICS_FILE = "metrics.jsonl"
"""Name of the per-step metrics file in the run directory."""


def flatten(record: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, float]:
    """Numeric leaves of a nested record, with joined names (bools as 0/1)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name, sep))
        elif isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(float(value))):
            out[name] = float(value)
    return out


def nest(flat: Mapping[str, float], sep: str = "/") -> dict[str, Any]:
    """``{"a/b": 1}`` → ``{"a": {"b": 1}}``."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        node = out
        parts = name.split(sep)
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                child = node[part] = {"value": child}
            node = child
        node[parts[-1]] = value
    return out


class MetricsWriter:
    """Appends one record per step to ``metrics.jsonl`` and, optionally, TensorBoard."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.written_steps = self._existing_steps()
        """Steps already in the file (from before a restart)."""
        self._tb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def _existing_steps(self) -> set[int]:
        steps: set[int] = set()
        if not self.path.is_file():
            return steps
        good = 0
        with open(self.path, "rb") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # a half-written last line from a crash: cut it off below
                good += len(line)
                if isinstance(record.get("step"), int) and record.get("kind", "train") == "train":
                    steps.add(record["step"])
        if good != self.path.stat().st_size:
            with open(self.path, "r+b") as handle:
                handle.truncate(good)
        return steps

    def write(self, step: int, record: Mapping[str, Any], kind: str = "train") -> bool:
        """Append ``record`` for ``step``; False (nothing written) if the step is already there."""
        if kind == "train" and step in self.written_steps:
            return False
        line = json.dumps({"step": step, "kind": kind, **record}, sort_keys=False)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        if kind == "train":
            self.written_steps.add(step)
        if self._tb is not None:
            for name, value in flatten(record).items():
                self._tb.add_scalar(f"{kind}/{name}", value, step)
            self._tb.flush()
        return True

    def close(self) -> None:
        """Close the TensorBoard writer."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class StepProgress:
    """A progress bar over RL steps showing the latest reward, success and seconds per step."""

    def __init__(self, total: int, *, enabled: bool, done: int = 0) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task: Any = None
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]RL[/bold] step {task.completed}/{task.total}"),
                BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                transient=False)
            self._task = self._progress.add_task("rl", total=total, completed=done, info="")

    def __enter__(self) -> StepProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, info: str) -> None:
        """One more step done; ``info`` is shown beside the bar."""
        if self._progress is not None:
            self._progress.update(self._task, advance=1, info=info)

    def note(self, info: str) -> None:
        """Change the text beside the bar (e.g. the phase in progress)."""
        if self._progress is not None:
            self._progress.update(self._task, info=info)
