"""``tracerl compare RUN_DIR...``: the table a comparison of training designs should publish.

Matching update counts is not matching budgets: eight samples per task cost eight times the
generation of one, and a critic costs its own training. So beside held-out success (with its
interval) each row carries what the run spent: complete rollouts, generated tokens, tool time
and training time. A comparison is at matched budgets when generated tokens or complete
rollouts agree within ``tolerance``; the table notes how far the other differs, and warns when
neither agrees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tracerl.eval.runs import RunFiles, number, read_run, total

ENDING_PREFIXES = ("endings.", "ending.", "by_ending.")
ROLLOUT_KEYS = ("attempts.collected", "attempts", "rollouts", "attempts.total", "collect.attempts")
TOKEN_KEYS = ("costs.generated_tokens", "generated_tokens", "tokens.generated")
TOOL_KEYS = ("costs.tool_seconds", "tool_seconds")
TRAIN_KEYS = ("time.train_seconds", "train_seconds", "seconds.train")


@dataclass(frozen=True)
class RunRow:
    """One run's line of the comparison; None where the run did not record the number."""

    run: str
    """Run directory name."""
    estimator: str | None
    """Advantage estimator (``algorithm.estimator`` of the run's config); for several agents
    followed by ``multiagent.weights`` (separate or shared)."""
    critic: str | None
    """Critic kind (``critic.kind``; ``multiagent.critic`` for several agents), ``none`` for
    critic-free methods."""
    success: float | None
    """Held-out hidden-test success after training, sampled."""
    ci95: tuple[float, float] | None
    """95% bootstrap interval of ``success`` over tasks."""
    success_before: float | None
    """The same before RL (the warm-started checkpoint)."""
    greedy: float | None
    """Held-out success of greedy decoding after training."""
    rollouts: float | None
    """Complete attempts collected for training (every ending counted once)."""
    terminated: float | None
    """Of those, attempts that ended with the task over (submitted)."""
    generated_tokens: float | None
    """Tokens sampled by the policy during training."""
    tool_seconds: float | None
    """Seconds spent in tools and sandboxes during training."""
    train_seconds: float | None
    """Seconds spent in updates (policy and critic)."""
    wall_seconds: float | None
    """Wall-clock seconds of the run."""
    others_shift: float | None = None
    """Several agents: how much the rest of an agent's environment changed per step, the mean
    over steps and agents of ``nonstationarity.others_shift`` (the other agents' policy shift,
    KL(old || new) per action token); None for one agent."""


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _pair(value: Any) -> tuple[float, float] | None:
    if isinstance(value, list | tuple) and len(value) == 2:
        low, high = number(value[0]), number(value[1])
        if low is not None and high is not None:
            return low, high
    return None


def _store_counts(directory: Path) -> dict[str, Any] | None:
    """Attempts, endings and costs of a run's training trace store, or None without one."""
    if not directory.is_dir():
        return None
    from tracerl.trace.cli import store_stats

    stats = store_stats(str(directory))
    return stats if stats["attempts"] else None


def run_row(run: RunFiles) -> RunRow:
    """The comparison row of one run directory."""
    summary, metrics = run.summary, run.metrics
    ending_keys = sorted({k for r in metrics for k in r if k.startswith(ENDING_PREFIXES)})
    endings = {k.split(".", 1)[1]: total(metrics, (k,)) or 0.0 for k in ending_keys}
    rollouts = total(metrics, ROLLOUT_KEYS)
    if rollouts is None and endings:
        rollouts = sum(endings.values())
    success, ci95 = number(summary.get("heldout_success_after")), _pair(
        summary.get("heldout_ci95_after"))
    if success is None and run.evaluations:  # fall back on an eval*.json in the run dir
        last = run.evaluations[sorted(run.evaluations)[-1]]
        success, ci95 = number(last.get("success")), _pair(last.get("ci95"))
    generated = total(metrics, TOKEN_KEYS) if metrics else number(summary.get("generated_tokens"))
    tool = total(metrics, TOOL_KEYS) if metrics else number(summary.get("tool_seconds"))
    terminated = endings.get("terminated", 0.0) if endings else None
    stored = _store_counts(run.path / "traces")
    if stored is not None:  # the store holds every attempt generated: the first source
        rollouts, terminated = stored["attempts"], stored["endings"].get("terminated", 0)
        generated, tool = stored["costs"]["generated_tokens"], stored["costs"]["tool_seconds"]
    estimator = _get(run.config, "algorithm.estimator")
    critic = _get(run.config, "critic.kind")
    if _get(run.config, "multiagent.env") not in (None, "none"):  # several agents
        estimator = f"{estimator} ({_get(run.config, 'multiagent.weights')} weights)"
        critic = _get(run.config, "multiagent.critic")
    shifts = [v for r in metrics for k, v in r.items()
               if k.startswith("nonstationarity.others_shift.") and number(v) is not None]
    return RunRow(
        run=run.path.name,
        estimator=None if estimator is None else str(estimator),
        critic=None if critic is None else str(critic),
        success=success, ci95=ci95,
        success_before=number(summary.get("heldout_success_before")),
        greedy=number(summary.get("heldout_greedy_after")),
        rollouts=rollouts,
        terminated=terminated,
        generated_tokens=generated,
        tool_seconds=tool,
        train_seconds=total(metrics, TRAIN_KEYS),
        wall_seconds=number(summary.get("wall_seconds")),
        others_shift=sum(shifts) / len(shifts) if shifts else None,
    )


def compare_runs(directories: Sequence[str | Path], *, tolerance: float = 0.10
                 ) -> tuple[list[RunRow], list[str]]:
    """Rows for each run and warnings (unmatched budgets, missing numbers, file notes)."""
    if len(directories) < 1:
        raise ValueError("give at least one run directory")
    runs = [read_run(d) for d in directories]
    rows = [run_row(run) for run in runs]
    warnings: list[str] = []
    for run in runs:
        warnings += [f"{run.path.name}: {note}" for note in run.notes]
    # A comparison is matched when one budget agrees across runs: generated tokens (what a
    # run trained with ``max_generated_tokens`` holds fixed) or complete rollouts (equal steps
    # of equal groups). The other is then reported, not warned about: at equal tokens a design
    # with longer attempts completes fewer of them, and that is part of the result.
    spreads: dict[str, float] = {}
    for label, values in (("generated tokens", [r.generated_tokens for r in rows]),
                          ("complete rollouts", [r.rollouts for r in rows])):
        known = [v for v in values if v is not None]
        if len(known) < len(values):
            warnings.append(f"{label}: not recorded by every run; budgets cannot be matched")
        elif len(known) > 1 and min(known) > 0:
            spreads[label] = max(known) / min(known) - 1
    matched = [label for label, spread in spreads.items() if spread <= tolerance]
    for label, spread in spreads.items():
        if spread <= tolerance:
            continue
        if matched:
            warnings.append(f"{label} differ by {spread:.0%} between runs at matched "
                            f"{matched[0]} (within {spreads[matched[0]]:.1%})")
        else:
            warnings.append(f"{label} differ by {spread:.0%} between runs (more than "
                            f"{tolerance:.0%}): not a matched-budget comparison")
    return rows, warnings


COLUMNS: tuple[tuple[str, str], ...] = (
    ("run", "run"), ("estimator", "estimator"), ("critic", "critic"),
    ("success_before", "success before"), ("success", "success after [95% CI]"),
    ("greedy", "greedy after"), ("rollouts", "rollouts"), ("terminated", "terminated"),
    ("generated_tokens", "gen. tokens"), ("tool_seconds", "tool s"),
    ("train_seconds", "train s"), ("wall_seconds", "wall s"),
    ("others_shift", "others' shift/step"),
)
"""Table columns: RunRow field and heading (the last only when a run has several agents)."""


def _cell(row: RunRow, name: str) -> str:
    value = getattr(row, name)
    if value is None:
        return "-"
    if name == "success":
        interval = f" [{row.ci95[0]:.3f}, {row.ci95[1]:.3f}]" if row.ci95 else " [no CI]"
        return f"{value:.3f}{interval}"
    if name in ("success_before", "greedy"):
        return f"{value:.3f}"
    if name == "others_shift":
        return f"{value:.2g}"
    if name in ("rollouts", "terminated", "generated_tokens"):
        return f"{value:,.0f}"  # counts
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"
    return str(value)


def format_table(rows: Sequence[RunRow], *, markdown: bool = False) -> str:
    """The rows as an aligned text table, or a Markdown table."""
    columns = [(name, heading) for name, heading in COLUMNS
               if name != "others_shift" or any(row.others_shift is not None for row in rows)]
    headings = [heading for _, heading in columns]
    cells = [[_cell(row, name) for name, _ in columns] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
        lines += ["| " + " | ".join(line) + " |" for line in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(line[i]) for line in cells)) for i, h in enumerate(headings)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headings, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(lines)


def rows_to_json(rows: Sequence[RunRow], warnings: Sequence[str]) -> dict[str, Any]:
    return {"runs": [asdict(row) for row in rows], "warnings": list(warnings)}
