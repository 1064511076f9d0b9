"""Kill a run mid-step, restart it: it continues from the last checkpoint and the trace store,
and ends with the same weights as a run that was never interrupted."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tracerl.trace import Attempt, EndReason, TraceStore, read_attempts
from tracerl.train.config import config_from_dict, load_config
from tracerl.train.trainer import Trainer

RECIPE = {
    "seed": 3, "steps": 3, "threads": 1, "tensorboard": False, "progress": False,
    "model": {"vocab_size": 400, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
              "intermediate_size": 32},
    "tasks": {"train_count": 4, "heldout_count": 2},
    "sft": {"demos_per_task": 1},
    "rollout": {"tasks_per_step": 2, "group_size": 2, "max_turns": 2, "max_turn_tokens": 6,
                # One attempt at a time: the sampler's batches, hence its float rounding,
                # are the same in every run, so the two runs can be compared exactly.
                "concurrency": 1, "env_workers": 1, "show_tool_schemas": False},
    # An entropy bonus moves the weights every step even when all rewards are 0.
    # The weight average is part of what a restart must continue (update.ema_decay).
    "update": {"entropy_coef": 0.05, "lr": 0.01, "micro_batch_rows": 2, "ema_decay": 0.5},
    "eval": {"samples_per_task": 1, "greedy": False},
}

KILLED_RUN = """
import os, sys
from tracerl.trace import Attempt, EndReason, TraceStore, read_attempts
from tracerl.train.config import config_from_dict, load_config
from tracerl.train.trainer import Trainer

def die(phase, trainer):
    # Like kill -9: no cleanup, no store sealing, the step's attempts are in the log only.
    if phase == "collect" and trainer.state.step == 1:
        os._exit(9)

Trainer(load_config(sys.argv[1]), hooks=[die]).run()
"""


def _recipe(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, "run_dir": str(tmp_path / name)}))
    return path


def _weights(run_dir: Path, policy: str = "checkpoints/step-000003") -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / policy)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.slow  # three short runs of the whole loop; `make test-slow`
def test_killed_run_resumes_without_repeating_or_losing_an_update(tmp_path: Path) -> None:
    Trainer(load_config(_recipe(tmp_path, "straight"))).run()

    recipe = _recipe(tmp_path, "killed")
    died = subprocess.run([sys.executable, "-c", KILLED_RUN, str(recipe)], capture_output=True,
                          text=True, timeout=600)
    assert died.returncode == 9, died.stderr[-2000:]
    run_dir = tmp_path / "killed"
    assert (run_dir / "checkpoints" / "step-000001").is_dir()
    assert not (run_dir / "checkpoints" / "step-000002").exists()

    Trainer(load_config(recipe)).run()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == [0, 1, 2]  # each update logged once: none repeated, none lost
    # Step 1's groups were collected before the kill and reused from the store, not resampled.
    assert records[[r["step"] for r in records].index(1)]["dynamic"]["reused_groups"] == 2
    straight = [json.loads(line) for line in
                (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == [r["policy_version"] for r in straight]
    assert torch.equal(_weights(run_dir), _weights(tmp_path / "straight"))
    assert torch.equal(_weights(run_dir, "policy"), _weights(tmp_path / "straight", "policy"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == 3
    low, high = summary["heldout_gain_ci95"]  # paired by task, from the evaluations' files
    assert low <= summary["heldout_gain"] <= high


def test_a_finished_run_continued_with_more_steps_is_evaluated_again(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_runs import tiny_recipe

    def after() -> dict[str, object]:
        data: dict[str, object] = json.loads((tmp_path / "run" / "eval_after_sampled.json")
                                             .read_text(encoding="utf-8"))
        return data

    Trainer(load_config(tiny_recipe(tmp_path, steps=1, sft={"steps": 5}))).run()
    assert (after()["rl_steps"], after()["policy"]) == (1, "last checkpoint")
    # Files of an older version say neither: taken for evaluations before any RL step.
    for path in (tmp_path / "run").glob("eval_*.json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        del data["rl_steps"], data["policy"]
        path.write_text(json.dumps(data), encoding="utf-8")
    before = (tmp_path / "run" / "eval_before_sampled.json").read_text(encoding="utf-8")
    said: list[str] = []
    summary = Trainer(load_config(tiny_recipe(tmp_path, steps=2, sft={"steps": 5})),
                      log=said.append).run()
    assert summary["rl_steps"] == 2
    assert after()["rl_steps"] == 2  # not the one-step evaluation reused
    assert any("evaluation after: the files hold another" in line for line in said)
    # The new evaluation's attempts are stored, the earlier ones kept beside them.
    from tracerl.trace import read_attempts

    for name, count in (("sampled", 4), ("greedy", 2)):
        assert len(read_attempts(tmp_path / "run" / "eval" / f"after-{name}")) == count
        kept = tmp_path / "run" / "eval" / f"after-{name}.earlier"  # its steps not recorded
        assert len(read_attempts(kept)) == count
    # The warm start's evaluation is the same run's and is kept.
    assert (tmp_path / "run" / "eval_before_sampled.json").read_text(encoding="utf-8") == before
    # Restarted with nothing left to do, the run reuses its evaluation.
    said.clear()
    Trainer(load_config(tiny_recipe(tmp_path, steps=2, sft={"steps": 5})), log=said.append).run()
    assert not any(line.startswith("evaluation") for line in said)


def _cancelled(attempt: Attempt) -> Attempt:
    """The attempt as a Ctrl-C leaves it: stopped, recorded, ending ``cancelled``."""
    last = dataclasses.replace(attempt.fragments[-1], end=EndReason.CANCELLED)
    return dataclasses.replace(attempt, fragments=(*attempt.fragments[:-1], last),
                               reward=None, attempt_id=attempt.attempt_id)


def test_a_group_cancelled_by_ctrl_c_is_collected_again_on_resume(tmp_path: Path) -> None:
    """A cancelled group has ``group_size`` members, but the step cannot train on them: the
    resumed step collects it anew and trains on as many attempts as an uninterrupted one."""
    recipe = {**RECIPE, "steps": 1, "update": {"entropy_coef": 0.05, "lr": 0.01,
                                                "micro_batch_rows": 2}}
    said: dict[str, list[str]] = {"straight": [], "resumed": []}

    def run(name: str) -> dict[str, Any]:
        config = config_from_dict({**recipe, "run_dir": str(tmp_path / name)})
        Trainer(config, log=said[name].append).run()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        (step,) = [r for r in rows if r["kind"] == "train"]
        return step

    straight = run("straight")
    # What a Ctrl-C during step 0's collection leaves in the store: every group of the step
    # recorded in full, but with members ending `cancelled` (one group wholly, one in part).
    step0 = [a for a in read_attempts(tmp_path / "straight" / "traces")
             if a.group_id.startswith("s00000r0:")]
    groups = sorted({a.group_id for a in step0})
    assert len(groups) == 2 and len(step0) == 4
    left = [_cancelled(a) if a.group_id == groups[0] or a.attempt_id.endswith(":0") else a
            for a in step0]
    assert sum(a.end_reason is EndReason.CANCELLED for a in left) == 3
    with TraceStore(tmp_path / "resumed" / "traces") as store:
        store.append_many(left)

    resumed = run("resumed")
    assert resumed["dynamic"]["reused_groups"] == 0  # neither group is reused as it is
    assert resumed["attempts"]["trained_on"] == straight["attempts"]["trained_on"] > 0
    assert resumed["attempts"]["collected"] == straight["attempts"]["collected"]
    assert "cancelled" not in resumed["endings"]
    # The cancelled attempts stay in the store, unused; the groups were collected anew.
    ids = {a.attempt_id for a in read_attempts(tmp_path / "resumed" / "traces")}
    assert {a.attempt_id for a in left} <= ids
    assert any(i.startswith("s00000r0-re1:") for i in ids)
    # The log line and metrics.jsonl say the same number of attempts trained on.
    for name, step in (("straight", straight), ("resumed", resumed)):
        (line,) = [m for m in said[name] if m.startswith("step 0:")]
        assert f" {step['attempts']['trained_on']} attempts trained on" in line, line
