"""Every recipe in configs/ loads and leaves room to act; every documented command runs on a
run shaped like the demo's (a tiny one made here)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tracerl.cli import main
from tracerl.rollout.settings import ROLLOUT_FILE, RolloutConfig, read_rollout
from tracerl.train.config import load_config
from tracerl.train.trainer import POLICY_DIR, Trainer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_runs import TINY_RUN, tiny_recipe

CONFIGS = sorted(p for p in (Path(__file__).parents[2] / "configs").glob("*.yaml")
                 if "multiagent" not in (yaml.safe_load(p.read_text(encoding="utf-8")) or {}))
"""The single-agent recipes (test_train_joint.py checks the multi-agent ones)."""
QUICK = ["tensorboard=false", "progress=false", "model.device=cpu", "tasks.train_count=8",
         "sft.demos_per_task=1"]
"""Fewer train tasks and demonstrations (the tokenizer is trained on them): the recipe's
model, conversation format and token limits are unchanged."""


@pytest.mark.parametrize("recipe", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_recipe_loads_and_its_first_prompt_leaves_room_for_a_turn(
        recipe: Path, tmp_path: Path) -> None:
    config = load_config(recipe, [f"run_dir={tmp_path / 'run'}", *QUICK])
    trainer = Trainer(config)
    trainer.setup()  # refuses a first prompt that cannot fit (check_first_prompts)
    try:
        longest = trainer.check_first_prompts()
        context = trainer.policy.context_length
        assert context is not None
        assert longest > 0 and longest + config.rollout.max_turn_tokens <= context
    finally:
        trainer.close()


def test_a_recipe_whose_first_prompt_cannot_fit_is_refused_before_the_warm_start(
        tmp_path: Path) -> None:
    grpo = next(p for p in CONFIGS if p.stem == "grpo")
    config = load_config(grpo, [f"run_dir={tmp_path / 'run'}", *QUICK,
                                "rollout.show_tool_schemas=true"])
    trainer = Trainer(config)
    with pytest.raises(ValueError, match=r"rollout\.show_tool_schemas: false.*max_positions"):
        trainer.setup()
    assert not (tmp_path / "run" / "sft").exists()


def test_a_renamed_rollout_key_is_refused_naming_the_new_one(tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"rollout": {"max_new_tokens": 64}}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"^rollout\.max_new_tokens: renamed; use "
                                         r"rollout\.max_turn_tokens$"):
        load_config(old)
    with pytest.raises(ValueError, match=r"use rollout\.max_turn_tokens"):
        load_config(None, ["rollout.max_new_tokens=64"])
    assert load_config(None, ["rollout.max_turn_tokens=64"]).rollout.max_turn_tokens == 64


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with the demo's shape: warm start, RL steps, checkpoints, evaluations, summary."""
    root = tmp_path_factory.mktemp("demo")
    assert main(["train", str(tiny_recipe(root))]) == 0
    return root / "run"


def _run_rollout() -> RolloutConfig:
    return RolloutConfig(**TINY_RUN["rollout"])


def test_every_policy_the_run_writes_carries_its_rollout_config(demo_run: Path) -> None:
    summary = json.loads((demo_run / "summary.json").read_text(encoding="utf-8"))
    assert summary["policy_dir"] == str(demo_run / POLICY_DIR)
    checkpoints = sorted((demo_run / "checkpoints").iterdir())
    for directory in (demo_run / POLICY_DIR, demo_run / "sft", *checkpoints):
        assert (directory / ROLLOUT_FILE).is_file(), directory
        assert read_rollout(directory) == _run_rollout()


def test_tracerl_eval_decodes_the_run_s_policy_exactly_as_the_run_did(
        demo_run: Path, tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    tasks, out = tmp_path / "heldout.jsonl", tmp_path / "eval.json"
    run = TINY_RUN
    assert main(["tasks", "export", "--split", "heldout", "--out", str(tasks), "--count",
                 str(run["tasks"]["heldout_count"]), "--max-turns",
                 str(run["rollout"]["max_turns"])]) == 0
    # The run's evaluation seeds: the run's seed + 7919. No decoding flag: the saved config.
    assert main(["eval", "--policy", str(demo_run / POLICY_DIR), "--tasks", str(tasks),
                 "--samples", str(run["eval"]["samples_per_task"]),
                 "--seed", str(run["seed"] + 7919), "--json", str(out)]) == 0
    result = json.loads(out.read_text(encoding="utf-8"))
    after = json.loads((demo_run / "eval_after_sampled.json").read_text(encoding="utf-8"))
    assert result["settings"]["rollout"] == after["settings"]["rollout"]
    assert result["settings"]["rollout"]["max_turns"] == run["rollout"]["max_turns"]
    for key in ("success", "generated_tokens", "turns", "tool_calls", "per_task", "by_ending"):
        assert result[key] == after[key], key
    assert result["training_cost"]["source"] == "summary.json of the run"


def test_the_documented_commands_run_on_the_run(demo_run: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(demo_run)]) == 0
    assert (demo_run / "report.html").is_file()
    assert main(["traces", "stats", str(demo_run / "traces")]) == 0
    assert main(["traces", "validate", str(demo_run / "traces")]) == 0
    assert main(["compare", str(demo_run), str(demo_run)]) == 0
    assert main(["train-eval", str(demo_run), "--step", "0", "--step", "2",
                 "--out", str(tmp_path / "steps")]) == 0
    records = [json.loads(line) for line in
               (tmp_path / "steps" / "evaluations.jsonl").read_text().splitlines()]
    after = json.loads((demo_run / "eval_after_sampled.json").read_text(encoding="utf-8"))
    # The last checkpoint evaluated as the run did reproduces the run's own evaluation.
    assert records[-1]["sampled"]["success"] == after["success"]
    capsys.readouterr()


def test_tracerl_serve_serves_the_run_s_policy(demo_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from tracerl.testing.serving import serve_subprocess

    with serve_subprocess(demo_run / POLICY_DIR, tmp_path / "served") as served:
        answer = served.client.chat.completions.create(
            model=POLICY_DIR, messages=[{"role": "user", "content": "Fix add in add.py."}])
    output = served.output
    assert served.returncode == 0, output
    assert "decoding as its run did" in output
    # No max_tokens in the request: the run's tokens per turn.
    assert answer.usage.completion_tokens <= TINY_RUN["rollout"]["max_turn_tokens"]
