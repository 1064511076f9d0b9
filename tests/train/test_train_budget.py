"""The run's time budget: another RL step is taken only while it and the final evaluation
fit; and its threads: collection runs with ``rollout.threads``, the rest with ``threads``."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tracerl.rollout.collect.collector import Collector
from tracerl.train.config import load_config
from tracerl.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_runs import tiny_recipe


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


def test_collection_runs_with_its_own_threads(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, list[int]] = {"collect": [], "update": []}
    collect = Collector.collect

    def counting_collect(self: Collector, *args: Any, **kwargs: Any) -> Any:
        seen["collect"].append(torch.get_num_threads())
        return collect(self, *args, **kwargs)

    update = Trainer.update

    def counting_update(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        seen["update"].append(torch.get_num_threads())
        return update(self, *args, **kwargs)

    monkeypatch.setattr(Collector, "collect", counting_collect)
    monkeypatch.setattr(Trainer, "update", counting_update)
    previous = torch.get_num_threads()
    try:
        recipe = tiny_recipe(tmp_path, threads=2, rollout={"threads": 1}, sft={"enabled": False},
                             steps=1, eval={"samples_per_task": 1, "greedy": False})
        Trainer(load_config(recipe)).run()
    finally:
        torch.set_num_threads(previous)
    # Evaluation before, the step's collection, evaluation after: one thread each time.
    assert seen["collect"] == [1, 1, 1]
    assert seen["update"] == [2]
