"""The step's groups: which tasks a step draws, which groups a killed run already stored
complete, and each task's success estimate.

Plain functions of the trainer's state (:mod:`tracerl.train.trainer` calls them while
collecting and after each step).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence

from tracerl.envs import Task
from tracerl.eval.summary import succeeded
from tracerl.trace import Attempt, TraceStore, read_attempts
from tracerl.trace.schema import EndReason
from tracerl.train.config import DynamicSamplingConfig


def choose_tasks(train_tasks: Sequence[Task], step: int, count: int, exclude: set[str], *,
                 seed: int, dynamic: DynamicSamplingConfig, group_size: int,
                 task_success: dict[str, float]) -> list[Task]:
    """Tasks of one step: success-weighted (keeps groups mixed) or a seeded sweep."""
    rng = random.Random(f"{seed}:tasks:{step}:{len(exclude)}")
    pool = [t for t in train_tasks if t.id not in exclude]
    if dynamic.success_sampling:
        weights = []
        for task in pool:
            p = task_success.get(task.id, dynamic.success_prior)
            mixed = 1.0 - p**group_size - (1.0 - p) ** group_size  # P_mix: a group that varies
            weights.append(max(dynamic.min_weight, mixed))
        chosen: list[Task] = []
        while pool and len(chosen) < count:
            pick = rng.choices(range(len(pool)), weights=weights)[0]
            chosen.append(pool.pop(pick))
            weights.pop(pick)
        return chosen
    epoch_size = max(1, len(train_tasks) // count)
    order = list(train_tasks)
    random.Random(f"{seed}:sweep:{step // epoch_size}").shuffle(order)
    start = (step % epoch_size) * count
    chosen = [t for t in order[start:start + count] if t.id not in exclude]
    return chosen or rng.sample(pool, min(count, len(pool)))


def stored_groups(store: TraceStore, step: int) -> dict[str, list[Attempt]]:
    """Groups of ``step`` a previous process stored before it died (empty normally)."""
    prefix = f"s{step:05d}r"
    if not any(i.startswith(prefix) for i in store.attempt_ids):
        return {}
    groups: dict[str, list[Attempt]] = defaultdict(list)
    for attempt in read_attempts(store.directory):
        if attempt.group_id.startswith(prefix):
            groups[attempt.group_id].append(attempt)
    return {g: sorted(m, key=lambda a: a.attempt_id) for g, m in groups.items()}


def complete_group(stored: dict[str, list[Attempt]], run_id: str, task_id: str, size: int,
                   trained: frozenset[EndReason]) -> list[Attempt] | None:
    """A group of ``task_id`` stored under ``run_id`` or one of its retries that the step can
    use as it is: ``size`` members, each ended with an ending in ``trained`` (treated ``score``
    or ``bootstrap``). A group whose members a Ctrl-C cancelled has ``size`` members too, but
    reusing it would train the resumed step on fewer attempts than an uninterrupted one (the
    cancelled ones are excluded), so it is collected anew."""
    for group_id, members in sorted(stored.items()):
        base, _, task = group_id.partition(":")
        if (task == task_id and base.split("-re")[0] == run_id and len(members) == size
                and all(a.end_reason in trained for a in members)):
            return members
    return None


def task_success_estimates(estimates: dict[str, float], attempts: Sequence[Attempt], *,
                           prior: float, ema: float) -> dict[str, float]:
    """Each task's success estimate moved toward the share of ``attempts`` that solved it
    (``eval.summary.succeeded``: verified and not flagged by the audit, so success-weighted
    task sampling never takes a hacked attempt for a solved task); a task never tried before
    starts from ``prior``. Tasks without attempts keep their estimate."""
    out = dict(estimates)
    for task_id, members in by_task(attempts).items():
        rate = sum(float(succeeded(a)) for a in members) / len(members)
        out[task_id] = (1 - ema) * out.get(task_id, prior) + ema * rate
    return out


def by_group(attempts: Sequence[Attempt]) -> dict[str, list[Attempt]]:
    """``attempts`` by group id, in their order."""
    groups: dict[str, list[Attempt]] = defaultdict(list)
    for attempt in attempts:
        groups[attempt.group_id].append(attempt)
    return groups


def by_task(attempts: Sequence[Attempt]) -> dict[str, list[Attempt]]:
    """``attempts`` by task id, in their order."""
    tasks: dict[str, list[Attempt]] = defaultdict(list)
    for attempt in attempts:
        tasks[attempt.task_id].append(attempt)
    return tasks
