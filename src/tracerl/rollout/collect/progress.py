"""The collector's progress bar: attempts done, tokens per second and endings so far."""

from __future__ import annotations

import time
from collections import Counter
from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tracerl.rollout.collect.batching import BatcherStats
from tracerl.trace.schema import EndReason


class CollectorProgress:
    """A rich progress bar, or nothing when disabled (tests, non-terminal runs)."""

    def __init__(self, total: int, stats: BatcherStats, *, enabled: bool) -> None:
        self.total = total
        self.stats = stats
        self.endings: Counter[str] = Counter()
        self._started = time.perf_counter()
        self._progress: Progress | None = None
        self._task = None
        if enabled:
            self._progress = Progress(
                TextColumn("attempts"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[endings]}"),
                TimeElapsedColumn(),
            )
            self._task = self._progress.add_task("collect", total=total, rate="", endings="")

    def __enter__(self) -> CollectorProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._progress is not None:
            self.refresh()
            self._progress.stop()

    def attempt_done(self, reason: EndReason) -> None:
        self.endings[reason.value] += 1
        self.refresh()

    def refresh(self) -> None:
        if self._progress is None or self._task is None:
            return
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        endings = " ".join(f"{k}={v}" for k, v in sorted(self.endings.items()))
        self._progress.update(
            self._task, completed=sum(self.endings.values()),
            rate=f"{self.stats.tokens / elapsed:.0f} tok/s", endings=endings,
        )
