from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tracerl.cli import main

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed")]

# Two small runs with the same tasks, group size, steps and budgets: GRPO without a critic and
# PPO with a value-head critic (GAE). Same generation budget by construction.
COMMON = ["steps=2", "tasks.train_count=8", "tasks.heldout_count=4", "rollout.tasks_per_step=2",
          "rollout.group_size=4", "rollout.max_turns=2", "rollout.max_turn_tokens=64",
          "eval.samples_per_task=2", "progress=false", "tensorboard=false",
          "model.max_positions=4096", "model.hidden_size=32", "model.num_layers=1",
          "model.num_heads=2", "model.intermediate_size=64"]


def test_compare_two_trained_runs_at_matched_budgets(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from tracerl.train.config import load_config
    from tracerl.train.trainer import Trainer

    for name, extra in (("grpo", ["algorithm.estimator=grpo", "critic.kind=none"]),
                        ("ppo", ["algorithm.estimator=gae", "critic.kind=value_head"])):
        config = load_config(None, [f"run_dir={tmp_path / name}", *COMMON, *extra])
        Trainer(config).run()
    table = tmp_path / "compare.json"
    assert main(["compare", str(tmp_path / "grpo"), str(tmp_path / "ppo"),
                 "--json", str(table)]) == 0
    out = capsys.readouterr().out
    assert "grpo" in out and "gae" in out and "value_head" in out
    rows = json.loads(table.read_text(encoding="utf-8"))["runs"]
    # Matched generation budget: the same number of complete rollouts per run.
    assert rows[0]["rollouts"] == rows[1]["rollouts"] == 2 * 2 * 4
    for row in rows:
        assert row["generated_tokens"] > 0 and row["train_seconds"] > 0
        assert row["success"] is not None and row["ci95"] is not None
    for run in ("grpo", "ppo"):
        assert main(["report", str(tmp_path / run)]) == 0
        assert (tmp_path / run / "report.html").is_file()
