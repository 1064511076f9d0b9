from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tracerl.eval.compare import compare_runs, format_table
from tracerl.eval.report import write_report
from tracerl.eval.runs import read_run
from tracerl.trace.store import TraceStore
from tracerl.trace.synthetic import synthetic_attempt

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def make_run(directory: Path, *, estimator: str, critic: str, steps: int, seed: int,
             tokens_per_attempt: int = 40) -> Path:
    """A run directory in the trainer's layout (metrics.jsonl, summary.json, config.yaml and a
    trace store of training attempts), from a small simulated training process."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text(
        f"algorithm:\n  estimator: {estimator}\ncritic:\n  kind: {critic}\n", encoding="utf-8")
    p = 0.1
    lines = [json.dumps({"step": 0, "kind": "sft", "loss": 2.0})]
    with TraceStore(directory / "traces", fsync=False) as store:
        for step in range(steps):
            p = min(0.9, p + 0.05)
            groups = rng.random((8, 4)) < p  # 8 tasks x 4 samples
            wins = groups.mean(axis=1)
            for task, row in enumerate(groups):
                for sample, won in enumerate(row):
                    store.append(synthetic_attempt(
                        rng, f"s{step}:{task}:{sample}", task_id=f"t{task}",
                        group_id=f"s{step}:{task}", total_tokens=60, turns=2,
                        reward=float(won), vocab_size=100, policy_version=step))
            record: dict[str, object] = {
                "step": step, "kind": "train", "reward": {"mean": float(groups.mean())},
                "success": {"mean": float(groups.mean())},
                "groups": {"all_zero_rate": float(np.mean(wins == 0)),
                           "all_one_rate": float(np.mean(wins == 1))},
                "endings": {"terminated": 28, "truncated_turns": 3, "tool_error": 1},
                "attempts": {"collected": 32},
                "costs": {"generated_tokens": 32 * tokens_per_attempt, "tool_seconds": 0.5},
                "time": {"train_seconds": 1.5},
            }
            if critic != "none":
                record["critic"] = {"explained_variance_heldout": 0.1 * step / steps,
                                    "predicted_return_mean": float(rng.random()),
                                    "completed_return_mean": float(groups.mean())}
            lines.append(json.dumps(record))
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"step\": 9", encoding="utf-8")
    (directory / "summary.json").write_text(json.dumps({
        "heldout_success_before": 0.2, "heldout_success_after": 0.45,
        "heldout_ci95_before": [0.1, 0.3], "heldout_ci95_after": [0.3, 0.6],
        "heldout_pass_at_k_before": {"1": 0.2, "2": 0.3, "4": 0.4},
        "heldout_pass_at_k_after": {"1": 0.45, "2": 0.55, "4": 0.7},
        "wall_seconds": 100.0}), encoding="utf-8")
    return directory


def test_report_skips_missing_plots_with_a_note_and_never_draws_them(tmp_path: Path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    out, plots = write_report(run)
    text = out.read_text(encoding="utf-8")
    assert all(plot.png is None and plot.note.startswith("skipped") for plot in plots)
    assert "<img" not in text and "no per-step metrics file" in text


def test_report_notes_a_half_written_line_and_draws_every_section(tmp_path: Path) -> None:
    run = make_run(tmp_path / "ppo", estimator="gae", critic="value_head", steps=6, seed=0)
    out, plots = write_report(run)
    assert [plot.png is not None for plot in plots] == [True] * len(plots)
    text = out.read_text(encoding="utf-8")
    assert "skipped 1 unreadable line(s)" in text
    assert "95% bootstrap interval over tasks" in text


def test_training_success_interval_comes_from_the_trace_store_by_policy_version(
        tmp_path: Path) -> None:
    run = read_run(make_run(tmp_path / "grpo", estimator="grpo", critic="none", steps=3, seed=4))
    assert len(run.metrics) == 3  # the sft record and the half-written line are not steps
    assert [s[0] for s in run.step_success] == [0, 1, 2]
    for (_, mean, low, high, attempts), record in zip(run.step_success, run.metrics,
                                                      strict=True):
        assert attempts == 32 and mean == record["success.mean"]
        assert low <= mean <= high


def test_compare_reports_budgets_and_flags_unmatched_ones(tmp_path: Path) -> None:
    grpo = make_run(tmp_path / "grpo", estimator="grpo", critic="none", steps=4, seed=1)
    ppo = make_run(tmp_path / "ppo", estimator="gae", critic="value_head", steps=4, seed=2)
    rows, warnings = compare_runs([grpo, ppo])
    assert [r.estimator for r in rows] == ["grpo", "gae"]
    # Counts come from each run's trace store, which holds every attempt generated.
    from tracerl.trace.cli import store_stats

    for row, run in zip(rows, (grpo, ppo), strict=True):
        stats = store_stats(str(run / "traces"))
        assert row.rollouts == stats["attempts"] == 4 * 32
        assert row.terminated == stats["endings"].get("terminated", 0)
        assert row.generated_tokens == stats["costs"]["generated_tokens"]
    assert not [w for w in warnings if "matched-budget" in w]
    table = format_table(rows)
    assert "0.450 [0.300, 0.600]" in table and "grpo" in table
    assert "shift" not in table  # the other agents' shift: a column of multi-agent runs only
    # Without a store, the metrics are the source.
    costly = make_run(tmp_path / "ppo8", estimator="gae", critic="value_head", steps=4, seed=2,
                      tokens_per_attempt=80)
    bare = make_run(tmp_path / "grpo_bare", estimator="grpo", critic="none", steps=4, seed=1)
    for run in (costly, bare):
        shutil.rmtree(run / "traces")
    (row,), _ = compare_runs([bare])
    assert row.rollouts == 4 * 32 and row.terminated == 4 * 28
    assert row.generated_tokens == 4 * 32 * 40
    _, warnings = compare_runs([bare, costly])
    # Equal rollouts: matched in that budget; the token difference is reported beside it.
    assert any("generated tokens differ by 100% between runs at matched complete rollouts"
               in w for w in warnings)
    assert not [w for w in warnings if "not a matched-budget" in w]
    # Neither budget agrees (2 steps of 120-token attempts against 4 of 40): not matched.
    short = make_run(tmp_path / "short", estimator="gae", critic="value_head", steps=2,
                     seed=2, tokens_per_attempt=120)
    shutil.rmtree(short / "traces")
    _, warnings = compare_runs([bare, short])
    assert any("not a matched-budget comparison" in w for w in warnings)


PROBE = """<script>window.addEventListener('load', () => {
  const out = document.createElement('pre'); out.id = 'probe';
  out.textContent = JSON.stringify([...document.images].map(i => [i.alt, i.naturalWidth,
    i.naturalHeight]));
  document.body.appendChild(out); });</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (the Makefile's "
                    "`browser` target installs the Debian packages chromium, chromium-driver)")
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", estimator="gae", critic="value_head", steps=6, seed=0)
    out, plots = write_report(run)
    # The probe goes into a copy: the report itself has no script.
    probed = tmp_path / "probed.html"
    probed.write_text(out.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"),
                      encoding="utf-8")
    assert CHROMIUM is not None
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
         probed.as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    match = re.search(r'<pre id="probe">(.*?)</pre>', result.stdout, re.DOTALL)
    assert match is not None, result.stderr[-2000:]
    images = json.loads(match.group(1).replace("&quot;", '"'))
    assert [alt for alt, _, _ in images] == [plot.title for plot in plots]
    assert all(width > 100 and height > 100 for _, width, height in images), images


def test_report_lists_success_with_and_without_faults_and_recovery(tmp_path: Path) -> None:
    run = tmp_path / "faults"
    run.mkdir()
    (run / "eval_faults.json").write_text(json.dumps({
        "success": 0.5, "ci95": [0.25, 0.75],
        "fault_injection": {"rate": 0.3, "success_without_faults": 0.5,
                            "success_with_faults": 0.375,
                            "infrastructure_failures_without_faults": 0,
                            "infrastructure_failures_with_faults": 2,
                            "faulted_attempts": 6, "recovered_attempts": 3,
                            "recovery_rate": 0.5}}), encoding="utf-8")
    text = write_report(run)[0].read_text(encoding="utf-8")
    assert "success without / with faults (infrastructure excluded)" in text
    assert "0.500 / 0.375" in text and "0 / 2" in text and "3 of 6 (0.500)" in text


def test_report_shows_hack_flags_by_kind(tmp_path: Path) -> None:
    run = tmp_path / "flagged"
    run.mkdir()
    (run / "eval_heldout.json").write_text(json.dumps({
        "success": 0.0, "ci95": [0.0, 0.0],
        "hack_flags": {"count": 3, "by_kind": {"protected_edit": 0, "early_exit": 2,
                                               "harness_patch": 1}}}), encoding="utf-8")
    out, _ = write_report(run)
    assert "3 (early_exit 2, harness_patch 1)" in out.read_text(encoding="utf-8")
