"""``tracerl report RUN_DIR``: one static HTML page with the run's plots embedded as PNG.

The page needs no server and no network: every plot is a base64 PNG inside the file. A plot
whose data the run did not record is left out with a note saying which metric was missing;
nothing is drawn from numbers that are not in the run's files.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Figures are built with matplotlib's object API, not pyplot: no global backend or figure
# state is touched, so a report can be written from any thread or inside a training run.
from matplotlib.figure import Figure

from tracerl.eval.judge import independence_warning
from tracerl.eval.runs import RunFiles, number, read_run, series

# Metric names the trainer may use, most specific first (see tracerl.train.metrics).
REWARD_KEYS = ("reward.mean", "reward_mean", "reward")
SUCCESS_KEYS = ("success.mean", "success_mean", "success", "success_rate")
ALL_ZERO_KEYS = ("groups.all_zero_rate", "uniform_groups.all_zero_rate", "uniform.all_zero_rate", "uniform_all_zero_rate",
                 "groups.all_zero_rate", "uniform_all_zero", "uniform.all_zero",
                 "groups.all_zero")
ALL_ONE_KEYS = ("groups.all_one_rate", "uniform_groups.all_one_rate", "uniform.all_one_rate", "uniform_all_one_rate",
                "groups.all_one_rate", "uniform_all_one", "uniform.all_one", "groups.all_one")
EXPLAINED_VARIANCE_KEYS = ("critic.explained_variance_heldout", "critic.explained_variance",
                           "critic_explained_variance", "explained_variance")
PREDICTED_KEYS = ("critic.predicted_return_mean", "critic.predicted_returns", "critic.predicted", "critic.predicted_return",
                  "predicted_return", "predicted_returns")
COMPLETED_KEYS = ("critic.completed_return_mean", "critic.completed_returns", "critic.completed", "critic.completed_return",
                  "completed_return", "completed_returns")
ENDING_PREFIXES = ("endings.", "ending.", "by_ending.")
COST_KEYS: dict[str, tuple[str, ...]] = {
    "generated tokens": ("costs.generated_tokens", "generated_tokens", "tokens.generated"),
    "tool seconds": ("costs.tool_seconds", "tool_seconds"),
    "train seconds": ("time.train_seconds", "train_seconds", "seconds.train", "timing.update"),
}


@dataclass(frozen=True)
class Plot:
    """One section of the page: a figure, or a note saying why there is none."""

    title: str
    """Heading of the section."""
    png: bytes | None
    """The figure as PNG, or None when skipped."""
    note: str
    """What the figure shows, or why it was skipped."""


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return buffer.getvalue()


def _interval(metrics: Sequence[Mapping[str, Any]], key: str
              ) -> tuple[list[float], list[float], list[float]] | None:
    """Per-step [low, high] recorded beside ``key`` (``KEY_ci95``/``KEY.ci95``), else None."""
    base = key.removesuffix(".mean").removesuffix("_mean")
    for name in (f"{key}_ci95", f"{base}.ci95", f"{base}_ci95", f"{base}.ci95_low"):
        steps, lows, highs = [], [], []
        for position, record in enumerate(metrics):
            if name.endswith("_low"):
                low, high = record.get(name), record.get(name.replace("_low", "_high"))
            else:
                pair = record.get(name)
                low, high = (pair[0], pair[1]) if isinstance(pair, list | tuple) and len(
                    pair) == 2 else (None, None)
            low_value, high_value = number(low), number(high)
            if low_value is None or high_value is None:
                continue
            step = number(record.get("step"))
            steps.append(position if step is None else step)
            lows.append(low_value)
            highs.append(high_value)
        if steps:
            return steps, lows, highs
    return None


def learning_curves(run: RunFiles) -> Plot:
    title = "Learning curves"
    found = [(label, series(run.metrics, keys)) for label, keys in
             (("reward", REWARD_KEYS), ("success", SUCCESS_KEYS))]
    present = [(label, data) for label, data in found if data is not None]
    heldout = _heldout_points(run)
    if not present and not heldout and not run.step_success:
        return Plot(title, None, "skipped: the run recorded no reward or success per step "
                    f"(looked for {REWARD_KEYS + SUCCESS_KEYS})")
    figure = Figure(figsize=(7.5, 3.8))
    axis = figure.subplots()
    notes = []
    for label, data in present:
        assert data is not None
        key, steps, values = data
        line = axis.plot(steps, values, label=f"train {label} ({key})")[0]
        band = _interval(run.metrics, key)
        if band is not None:
            axis.fill_between(band[0], band[1], band[2], alpha=0.2, color=line.get_color())
            notes.append(f"{label}: shaded 95% interval as recorded by the trainer")
        else:
            notes.append(f"{label}: no per-step interval recorded")
    if run.step_success and not any(label == "success" and _interval(run.metrics, data[0])
                                    for label, data in present if data is not None):
        steps = [float(v) for v, *_ in run.step_success]
        line = axis.plot(steps, [m for _, m, _, _, _ in run.step_success],
                         label="train success (from traces)", linestyle="--")[0]
        axis.fill_between(steps, [lo for _, _, lo, _, _ in run.step_success],
                          [hi for _, _, _, hi, _ in run.step_success], alpha=0.2,
                          color=line.get_color())
        notes.append("train success from the trace store: hidden tests and audit per attempt, "
                     "shaded 95% bootstrap interval over tasks, by the policy version that "
                     "sampled it")
    for label, step, value, low, high in heldout:
        axis.errorbar([step], [value], yerr=[[value - low], [high - value]], fmt="s",
                      capsize=4, label=label)
    if heldout:
        notes.append("held-out points: hidden-test success with 95% bootstrap interval over "
                     "tasks")
    axis.set_xlabel("step")
    axis.set_ylabel("mean")
    axis.set_ylim(-0.05, 1.05)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="best")
    return Plot(title, _png(figure), "; ".join(notes))


def _heldout_points(run: RunFiles) -> list[tuple[str, float, float, float, float]]:
    points = []
    steps = [number(r.get("step")) for r in run.metrics]
    # Step k's attempts were sampled by policy version k; the final policy comes after the
    # last recorded step's update.
    last = max((s for s in steps if s is not None), default=float(len(run.metrics)) - 1) + 1
    for when, step in (("before", 0.0), ("after", last)):
        value = number(run.summary.get(f"heldout_success_{when}"))
        ci = run.summary.get(f"heldout_ci95_{when}")
        if value is None or not (isinstance(ci, list) and len(ci) == 2):
            continue
        low, high = number(ci[0]), number(ci[1])
        if low is not None and high is not None:
            points.append((f"held-out {when} (sampled)", step, value, low, high))
    for key in ("eval.success", "heldout.success", "eval_success"):
        for position, record in enumerate(run.metrics):
            mean = number(record.get(key))
            interval = record.get(key.replace("success", "ci95"))
            if mean is None or not (isinstance(interval, list) and len(interval) == 2):
                continue
            bounds = number(interval[0]), number(interval[1])
            if bounds[0] is None or bounds[1] is None:
                continue
            at = number(record.get("step"))
            at = float(position) if at is None else at
            points.append((f"held-out at step {at:g}", at, mean, bounds[0], bounds[1]))
    return points


def uniform_groups(run: RunFiles) -> Plot:
    title = "Uniform groups (no relative signal)"
    zero, one = series(run.metrics, ALL_ZERO_KEYS), series(run.metrics, ALL_ONE_KEYS)
    if zero is None and one is None:
        return Plot(title, None, "skipped: no uniform-group rate recorded "
                    f"(looked for {ALL_ZERO_KEYS[0]}, {ALL_ONE_KEYS[0]}, ...)")
    figure = Figure(figsize=(7.5, 3.2))
    axis = figure.subplots()
    for label, data in (("all-zero groups", zero), ("all-one groups", one)):
        if data is not None:
            axis.plot(data[1], data[2], label=f"{label} ({data[0]})")
    axis.set_xlabel("step")
    axis.set_ylabel("fraction of groups")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    return Plot(title, _png(figure), "all-zero and all-one groups apart: each gives no "
                "group-relative signal, for opposite reasons")


def critic_calibration(run: RunFiles) -> Plot:
    title = "Critic calibration"
    variance = series(run.metrics, EXPLAINED_VARIANCE_KEYS)
    predicted: list[float] = []
    completed: list[float] = []
    for record in run.metrics:
        p_key = next((k for k in PREDICTED_KEYS if k in record), None)
        c_key = next((k for k in COMPLETED_KEYS if k in record), None)
        if p_key is None or c_key is None:
            continue
        p, c = record[p_key], record[c_key]
        if isinstance(p, list) and isinstance(c, list) and len(p) == len(c):
            pairs = [(number(a), number(b)) for a, b in zip(p, c, strict=True)]
            predicted += [a for a, b in pairs if a is not None and b is not None]
            completed += [b for a, b in pairs if a is not None and b is not None]
        elif number(p) is not None and number(c) is not None:
            predicted.append(float(p))
            completed.append(float(c))
    if variance is None and not predicted:
        return Plot(title, None, "skipped: the run has no critic metrics (a group method "
                    "without a critic, or none recorded)")
    panels = int(variance is not None) + int(bool(predicted))
    figure = Figure(figsize=(4.2 * panels, 3.6))
    axes = figure.subplots(1, panels, squeeze=False)
    index = 0
    if predicted:
        axis = axes[0][index]
        axis.scatter(predicted, completed, s=8, alpha=0.5)
        ends = [min(predicted + completed), max(predicted + completed)]
        axis.plot(ends, ends, color="grey", linestyle="--", linewidth=1)
        axis.set_xlabel("predicted return")
        axis.set_ylabel("completed return")
        axis.set_title("held-out completed returns", fontsize=9)
        index += 1
    if variance is not None:
        axis = axes[0][index]
        axis.plot(variance[1], variance[2])
        axis.axhline(0.0, color="grey", linewidth=1)
        axis.set_xlabel("step")
        axis.set_ylabel("explained variance")
        axis.set_title(variance[0], fontsize=9)
    return Plot(title, _png(figure), "on completed returns the critic was not fitted on; "
                "the dashed line is perfect calibration")


def endings_over_time(run: RunFiles) -> Plot:
    title = "Endings over time"
    names = sorted({k for r in run.metrics for k in r if k.startswith(ENDING_PREFIXES)
                    and number(r.get(k)) is not None})
    if not names:
        return Plot(title, None, "skipped: no per-step endings recorded "
                    f"(keys starting with {ENDING_PREFIXES})")
    steps = [number(r.get("step")) for r in run.metrics]
    xs = [i if s is None else s for i, s in enumerate(steps)]
    figure = Figure(figsize=(7.5, 3.4))
    axis = figure.subplots()
    stacks = [[number(r.get(name)) or 0.0 for r in run.metrics] for name in names]
    labels = [name.split(".", 1)[1] for name in names]
    axis.stackplot(xs, stacks, labels=labels, alpha=0.85)
    axis.set_xlabel("step")
    axis.set_ylabel("attempts")
    axis.legend(fontsize=7, loc="upper left", ncol=2)
    return Plot(title, _png(figure), "why attempts stopped, per step; tool errors and "
                "cancellations are the infrastructure's, not the policy's")


def costs(run: RunFiles) -> Plot:
    title = "Costs (cumulative)"
    found = {label: series(run.metrics, keys) for label, keys in COST_KEYS.items()}
    present = {label: data for label, data in found.items() if data is not None}
    if not present:
        return Plot(title, None, "skipped: no per-step costs recorded "
                    f"(looked for {[keys[0] for keys in COST_KEYS.values()]})")
    figure = Figure(figsize=(3.4 * len(present), 3.2))
    axes = figure.subplots(1, len(present), squeeze=False)
    for axis, (label, data) in zip(axes[0], present.items(), strict=True):
        assert data is not None
        running = 0.0
        cumulative = []
        for value in data[2]:
            running += value
            cumulative.append(running)
        axis.plot(data[1], cumulative)
        axis.set_title(f"{label}", fontsize=9)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    missing = sorted(set(found) - set(present))
    return Plot(title, _png(figure),
                "per-step costs summed over training" + (f"; not recorded: {missing}"
                                                         if missing else ""))


def pass_at_k(run: RunFiles) -> Plot:
    title = "Held-out pass@k"
    curves: list[tuple[str, dict[str, Any]]] = []
    for when in ("before", "after") if not run.evaluations else ():
        table = run.summary.get(f"heldout_pass_at_k_{when}")
        if isinstance(table, Mapping) and table:
            curves.append((when, dict(table)))
    for name, result in run.evaluations.items():
        table = result.get("pass_at_k")
        if isinstance(table, Mapping) and table:
            curves.append((name, dict(table)))
    if not curves:
        return Plot(title, None, "skipped: no pass@k in summary.json or eval*.json")
    figure = Figure(figsize=(5.5, 3.4))
    axis = figure.subplots()
    for label, table in curves:
        points = sorted((int(k), number(v)) for k, v in table.items() if str(k).isdigit())
        axis.plot([k for k, v in points if v is not None],
                  [v for k, v in points if v is not None], marker="o", label=label)
    axis.set_xlabel("k")
    axis.set_ylabel("pass@k (unbiased)")
    axis.set_ylim(-0.05, 1.05)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    return Plot(title, _png(figure), "probability that at least one of k attempts passes the "
                "hidden tests")


SECTIONS: tuple[Callable[[RunFiles], Plot], ...] = (
    learning_curves, uniform_groups, critic_calibration, endings_over_time, costs, pass_at_k)
"""The plots of the page, in order."""


def _summary_rows(run: RunFiles) -> list[tuple[str, str]]:
    rows = []
    for key in ("heldout_success_before", "heldout_success_after", "heldout_greedy_before",
                "heldout_greedy_after", "heldout_ci95_before", "heldout_ci95_after",
                "samples_per_task", "temperature", "wall_seconds", "generated_tokens",
                "tool_seconds", "policy_dir", "sft_dir"):
        if key in run.summary:
            rows.append((key, _fmt(run.summary[key])))
    for name, result in run.evaluations.items():
        ci = result.get("ci95", [None, None])
        rows.append((f"{name}: success [95% CI]", f"{_fmt(result.get('success'))} "
                     f"[{_fmt(ci[0])}, {_fmt(ci[1])}]"))
        if result.get("visible_success") is not None:
            rows.append((f"{name}: visible-test vs hidden-test success",
                         f"{_fmt(result['visible_success'])} vs "
                         f"{_fmt(result.get('hidden_success'))}"))
        flags = result.get("hack_flags", {})
        if isinstance(flags, Mapping):
            rows.append((f"{name}: hack flags", _hack_flags(flags)))
        rows.extend(_fault_rows(name, result.get("fault_injection")))
    return rows


def _fault_rows(name: str, faults: Any) -> list[tuple[str, str]]:
    """Success with and without injected faults (infrastructure endings excluded and
    counted) and the recovery of faulted attempts, when the evaluation injected faults."""
    if not isinstance(faults, Mapping):
        return []
    return [
        (f"{name}: success without / with faults (infrastructure excluded)",
         f"{_fmt(faults.get('success_without_faults'))} / "
         f"{_fmt(faults.get('success_with_faults'))}"),
        (f"{name}: infrastructure endings without / with faults",
         f"{_fmt(faults.get('infrastructure_failures_without_faults'))} / "
         f"{_fmt(faults.get('infrastructure_failures_with_faults'))}"),
        (f"{name}: faulted attempts recovered",
         f"{_fmt(faults.get('recovered_attempts'))} of {_fmt(faults.get('faulted_attempts'))}"
         f" ({_fmt(faults.get('recovery_rate'))})"),
    ]


def _hack_flags(flags: Mapping[str, Any]) -> str:
    """The flag count and, when any, its kinds (``3 (early_exit 2, harness_patch 1)``)."""
    by_kind = flags.get("by_kind")
    kinds = ([f"{kind} {count}" for kind, count in by_kind.items() if count]
             if isinstance(by_kind, Mapping) else [])
    return _fmt(flags.get("count")) + (f" ({', '.join(kinds)})" if kinds else "")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _warnings(run: RunFiles) -> list[str]:
    warnings = []
    train_judge = run.config.get("judge") or run.config.get("reward", {}).get("judge") \
        if isinstance(run.config.get("reward", {}), Mapping) else run.config.get("judge")
    for name, result in run.evaluations.items():
        warning = independence_warning(train_judge if isinstance(train_judge, Mapping) else None,
                                       result.get("judge"))
        if warning:
            warnings.append(f"{name}: {warning}")
        if result.get("judge_warning"):
            warnings.append(f"{name}: {result['judge_warning']}")
        overfit = result.get("visible_not_hidden")
        if isinstance(overfit, int) and overfit:
            warnings.append(f"{name}: {overfit} attempt(s) passed the visible tests but not the "
                            "hidden ones")
    return warnings


def render_html(run: RunFiles, plots: Sequence[Plot]) -> str:
    """The page's HTML text."""
    esc = html.escape
    parts = ["<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
             f"<title>tracerl report: {esc(run.path.name)}</title>",
             "<style>body{font-family:sans-serif;max-width:960px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;"
             "text-align:left}.note{color:#555;font-size:90%}.warn{background:#fff3cd;"
             "padding:6px;border-left:4px solid #e0a800}img{max-width:100%}</style>",
             "</head><body>", f"<h1>Run {esc(run.path.name)}</h1>"]
    for warning in _warnings(run):
        parts.append(f"<p class='warn'>{esc(warning)}</p>")
    rows = _summary_rows(run)
    if rows:
        parts.append("<h2>Summary</h2><table>")
        parts += [f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows]
        parts.append("</table>")
    for plot in plots:
        parts.append(f"<h2>{esc(plot.title)}</h2>")
        if plot.png is not None:
            data = base64.b64encode(plot.png).decode("ascii")
            parts.append(f"<img class='plot' alt='{esc(plot.title)}' "
                         f"src='data:image/png;base64,{data}'>")
        parts.append(f"<p class='note'>{esc(plot.note)}</p>")
    if run.notes:
        parts.append("<h2>Notes on the run's files</h2><ul>")
        parts += [f"<li>{esc(note)}</li>" for note in run.notes]
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, list[Plot]]:
    """Write the report (default ``RUN_DIR/report.html``); returns its path and sections."""
    run = read_run(run_dir)
    plots = [section(run) for section in SECTIONS]
    target = Path(out) if out is not None else run.path / "report.html"
    target.write_text(render_html(run, plots), encoding="utf-8")
    return target, plots
