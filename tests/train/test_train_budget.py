"""The run's time budget: another RL step is taken only while it and the final evaluation fit."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tracerl.train.trainer import Trainer


def _trainer(*, before_turns: float, recent_turns: float) -> Trainer:
    trainer = Trainer.__new__(Trainer)  # the budget reads these fields only
    trainer.config = SimpleNamespace(max_seconds=100.0)  # type: ignore[assignment]
    trainer.started = time.perf_counter() - 40.0  # 40 s used
    trainer.steps_here, trainer.step_seconds = 2, 20.0  # 10 s per step
    trainer.timings = {"evaluate_before": 20.0}
    trainer.before_turns, trainer.recent_turns = before_turns, recent_turns
    return trainer


def test_the_final_evaluation_is_budgeted_as_the_attempts_have_grown() -> None:
    # Attempts as long as the first evaluation's: 40 + 10 + 1.5 * 20 = 80 s fits in 100.
    assert _trainer(before_turns=4.0, recent_turns=4.0).time_left_for_step()
    # Attempts twice as long: the final evaluation is budgeted at 1.5 * 2 * 20 = 60 s: no step.
    assert not _trainer(before_turns=4.0, recent_turns=8.0).time_left_for_step()
    # Shorter attempts never budget less than half as much again.
    assert _trainer(before_turns=8.0, recent_turns=2.0).time_left_for_step()
