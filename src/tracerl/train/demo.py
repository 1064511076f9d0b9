"""The demo: SFT on imperfect demonstrations, then multi-turn GRPO, judged on held-out tasks.

``tracerl demo`` (``make demo``) runs ``configs/demo.yaml`` (embedded below, so an
installed package needs no file) and then writes the curves of ``runs/demo`` as PNG files and
an HTML report. Every number in ``summary.json`` comes from the run; the seeds are fixed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tracerl.train.config import TrainConfig, _set_path, config_from_dict, parse_override

DEMO_RECIPE = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"
"""The demo recipe in a source checkout."""

SAMPLED_MARGIN = 0.15
"""Held-out success after RL must beat the SFT policy's sampled success by this much."""
GREEDY_MARGIN = 0.10
"""... and the SFT policy's greedy success by this much."""
WALL_SECONDS = 900.0
"""... within 15 minutes of wall time for the whole run (setting up the environment excluded;
``wall_seconds`` is the process's own time, so a resumed run is judged on its last part)."""


def demo_config(overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The demo's config: the recipe file, with ``key=value`` overrides."""
    if not DEMO_RECIPE.is_file():
        raise ValueError(f"demo recipe not found at {DEMO_RECIPE}")
    data: dict[str, Any] = yaml.safe_load(DEMO_RECIPE.read_text(encoding="utf-8"))
    for text in overrides:
        key, value = parse_override(text)
        _set_path(data, key, value)
    return config_from_dict(data)


def write_curves(run_dir: Path) -> list[Path]:
    """The run's plots as PNG files (and ``report.html``), from its metrics and summary."""
    from tracerl.eval.report import write_report

    _, plots = write_report(run_dir)
    written = []
    for plot in plots:
        if plot.png is None:
            continue
        name = "".join(c if c.isalnum() else "_" for c in plot.title.lower()).strip("_")
        path = run_dir / f"{name}.png"
        path.write_bytes(plot.png)
        written.append(path)
    return written


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """Whether the run met the demo's targets, with the margins and the time measured."""
    after = summary["heldout_success_after"]
    sampled_gain = after - summary["heldout_success_before"]
    greedy_gain = after - (summary["heldout_greedy_before"] or 0.0)
    missed = [name for name, ok in (("sampled gain", sampled_gain >= SAMPLED_MARGIN),
                                    ("greedy gain", greedy_gain >= GREEDY_MARGIN),
                                    ("time", summary["wall_seconds"] <= WALL_SECONDS)) if not ok]
    return {"sampled_gain": sampled_gain, "greedy_gain": greedy_gain,
            "sampled_gain_ci95": summary.get("heldout_gain_ci95"),
            "greedy_gain_ci95": summary.get("heldout_gain_over_greedy_ci95"),
            "missed": missed, "met": not missed}


def run_demo(overrides: list[str] | tuple[str, ...] = (), *, echo: bool = True
             ) -> dict[str, Any]:
    """Run the demo end to end; returns the summary (also in ``RUN_DIR/summary.json``)."""
    from tracerl.train.trainer import Trainer

    config = demo_config(overrides)
    summary = Trainer(config, log=print if echo else None).run()
    summary["demo_targets"] = verdict(summary)
    run_dir = Path(config.run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    curves = write_curves(run_dir)
    if echo:
        print(format_summary(summary))
        print("curves: " + ", ".join(str(p) for p in curves))
    return summary


def _behaviour_lines(summary: dict[str, Any], pct: Callable[[float | None], str]) -> list[str]:
    """How the sampled attempts edited and recovered, before and after RL (if recorded)."""
    before, after = summary.get("heldout_behaviour_before"), summary.get("heldout_behaviour_after")
    if not before or not after:
        return []

    def row(b: dict[str, Any]) -> str:
        fail = b["after_fail"]
        return (f"edits applied {pct(b['edits_applied'])}, malformed calls {pct(b['malformed'])},"
                f" after a FAIL: tried again {pct(fail['retry'])} of {fail['count']}, submitted "
                f"{pct(fail['next'].get('submit', 0.0) if fail['count'] else None)}")

    return [f"  SFT     {row(before)}", f"  RL      {row(after)}"]


def format_summary(summary: dict[str, Any]) -> str:
    """A few readable lines of the demo's result."""
    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.1f}%"

    def ci(pair: list[float]) -> str:
        return f"[{pct(pair[0])}, {pct(pair[1])}]"

    def gap(pair: list[float] | None) -> str:  # a gain's paired interval, when recorded
        return "" if pair is None else " " + ci(pair)

    k = str(summary["samples_per_task"])
    target = summary.get("demo_targets", {})
    lines = [
        f"held-out success, sampled at T={summary['temperature']} "
        f"({summary['samples_per_task']} per task, {summary['heldout_tasks']} tasks):",
        f"  SFT     {pct(summary['heldout_success_before'])} {ci(summary['heldout_ci95_before'])}"
        f"   greedy {pct(summary['heldout_greedy_before'])}"
        f"   pass@{k} {pct(summary['heldout_pass_at_k_before'].get(k))}",
        f"  RL      {pct(summary['heldout_success_after'])} {ci(summary['heldout_ci95_after'])}"
        f"   greedy {pct(summary['heldout_greedy_after'])}"
        f"   pass@{k} {pct(summary['heldout_pass_at_k_after'].get(k))}",
        f"  gain over SFT sampled {pct(target.get('sampled_gain'))}"
        f"{gap(target.get('sampled_gain_ci95'))} (target {pct(SAMPLED_MARGIN)}), over SFT "
        f"greedy {pct(target.get('greedy_gain'))}{gap(target.get('greedy_gain_ci95'))} "
        f"(target {pct(GREEDY_MARGIN)})",
        *_behaviour_lines(summary, pct),
        f"  {summary['rl_steps']} RL steps, {summary['wall_seconds']:.0f}s wall (target "
        f"{WALL_SECONDS:.0f}s), {summary['generated_tokens']} tokens generated, "
        f"{summary['tool_seconds']:.0f}s in tools",
        "  demo targets: " + ("met" if target.get("met") else
                              "NOT met (" + ", ".join(target.get("missed", [])) + ")"),
        f"  RL policy: {summary.get('policy', 'last checkpoint')} ({summary.get('policy_dir')})",
    ]
    return "\n".join(lines)
