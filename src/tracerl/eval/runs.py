"""Reading a run directory written by the trainer, tolerantly.

A run may be in progress (a half-written last metrics line), old (fewer metrics) or from a
different recipe (no critic). Readers here never invent a number: a value that is not in the
files is None, and the caller says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

METRICS_FILES = ("metrics.jsonl", "metrics/metrics.jsonl", "train/metrics.jsonl")
"""Where the trainer's per-step metrics may be, relative to the run directory, in order."""
CONFIG_FILES = ("config.yaml", "config.yml", "config.json")
"""Where the run's resolved config may be."""
SUMMARY_FILE = "summary.json"
"""The run's final summary (held-out success before and after, costs)."""
TRACES_DIR = "traces"
"""The run's trace store of training attempts, relative to the run directory."""


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level with dotted keys (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``)."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


@dataclass(frozen=True)
class RunFiles:
    """What was found in a run directory."""

    path: Path
    """The run directory."""
    metrics: tuple[dict[str, Any], ...]
    """Per-step metric records, flattened, in file order."""
    summary: Mapping[str, Any]
    """``summary.json`` (empty when absent)."""
    config: Mapping[str, Any]
    """The run's config (empty when absent)."""
    evaluations: Mapping[str, Mapping[str, Any]]
    """Evaluation JSON files found in the run directory, by file name."""
    step_success: tuple[tuple[int, float, float, float, int], ...] = ()
    """(policy version, success, ci95 low, ci95 high, attempts) of the training attempts in
    the run's trace store, per policy version that sampled them; empty without a store."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What was missing or skipped while reading."""


def _read_json(path: Path, notes: list[str]) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        notes.append(f"{path.name}: could not be read ({error})")
        return {}
    if not isinstance(data, dict):
        notes.append(f"{path.name}: not a JSON object")
        return {}
    return data


def read_metrics(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """JSON-lines metric records, flattened; unparseable lines are skipped and noted."""
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                bad.append(line_number)
                continue
            # Only training steps make curves; other kinds (e.g. "sft") are logged apart.
            if isinstance(record, dict) and record.get("kind", "train") == "train":
                records.append(flatten(record))
            elif not isinstance(record, dict):
                bad.append(line_number)
    if bad:
        notes.append(f"{path.name}: skipped {len(bad)} unreadable line(s) (first: {bad[0]})")
    return records


def read_run(directory: str | Path) -> RunFiles:
    """Everything the report and the comparison use from one run directory."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"run directory {str(path)!r} does not exist")
    notes: list[str] = []
    metrics: list[dict[str, Any]] = []
    for name in METRICS_FILES:
        if (path / name).is_file():
            metrics = read_metrics(path / name, notes)
            break
    else:
        notes.append("no per-step metrics file (" + ", ".join(METRICS_FILES) + ")")
    summary = _read_json(path / SUMMARY_FILE, notes) if (path / SUMMARY_FILE).is_file() else {}
    if not summary:
        notes.append(f"no {SUMMARY_FILE}")
    config: dict[str, Any] = {}
    for name in CONFIG_FILES:
        if (path / name).is_file():
            try:
                loaded = (yaml.safe_load((path / name).read_text(encoding="utf-8"))
                          if not name.endswith(".json") else
                          json.loads((path / name).read_text(encoding="utf-8")))
            except (OSError, yaml.YAMLError, json.JSONDecodeError) as error:
                notes.append(f"{name}: could not be read ({error})")
                loaded = None
            config = loaded if isinstance(loaded, dict) else {}
            break
    evaluations = {}
    for candidate in sorted(path.glob("eval*.json")):
        data = _read_json(candidate, notes)
        if "success" in data:
            evaluations[candidate.name] = data
    steps = step_success(path / TRACES_DIR, notes)
    return RunFiles(path, tuple(metrics), summary, config, evaluations, steps, tuple(notes))


def step_success(store: Path, notes: list[str]) -> tuple[tuple[int, float, float, float, int],
                                                         ...]:
    """Training success per policy version, with a bootstrap interval over tasks.

    Read from the attempts themselves (hidden-test verdict and audit, as in an evaluation),
    so the interval treats the samples of one task as the correlated samples they are.
    """
    if not store.is_dir():
        notes.append(f"no trace store at {TRACES_DIR}/: training curves have no interval")
        return ()
    from tracerl.eval.stats import bootstrap_ci
    from tracerl.eval.summary import succeeded
    from tracerl.trace.schema import Role
    from tracerl.trace.store import read_attempts

    try:
        attempts = read_attempts(store)
    except (OSError, ValueError) as error:
        notes.append(f"{TRACES_DIR}/: could not be read ({error})")
        return ()
    by_version: dict[int, dict[str, list[float]]] = {}
    for attempt in attempts:
        version = next((seg.policy_version for f in attempt.fragments for t in f.turns
                        for seg in t.segments
                        if seg.role is Role.ACTION and seg.policy_version is not None), None)
        if version is None:
            continue
        tasks = by_version.setdefault(int(version), {})
        tasks.setdefault(attempt.task_id, []).append(1.0 if succeeded(attempt) else 0.0)
    out = []
    for version in sorted(by_version):
        per_task = list(by_version[version].values())
        count = sum(len(s) for s in per_task)
        low, high = bootstrap_ci(per_task, seed=version, resamples=1000)
        out.append((version, sum(sum(s) for s in per_task) / count, low, high, count))
    return tuple(out)


def number(value: Any) -> float | None:
    """``value`` as a finite float, else None (booleans are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def series(metrics: Sequence[Mapping[str, Any]], names: Sequence[str]
           ) -> tuple[str, list[float], list[float]] | None:
    """(key, steps, values) of the first alias in ``names`` that any record has, else None.

    The step is the record's ``step`` when numeric, else its position.
    """
    for name in names:
        steps: list[float] = []
        values: list[float] = []
        for position, record in enumerate(metrics):
            value = number(record.get(name))
            if value is None:
                continue
            step = number(record.get("step"))
            steps.append(position if step is None else step)
            values.append(value)
        if values:
            return name, steps, values
    return None


def total(metrics: Sequence[Mapping[str, Any]], names: Sequence[str]) -> float | None:
    """Sum over steps of the first alias present, or None."""
    found = series(metrics, names)
    return None if found is None else float(sum(found[2]))
