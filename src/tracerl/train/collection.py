"""One step's collection: the groups to train on, with stored groups reused and uniform groups
refilled (``dynamic``); the trainer's ``collect`` (and the asynchronous worker's)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from tracerl.envs import Task
from tracerl.trace import Attempt
from tracerl.trace.schema import Treatment, default_treatments
from tracerl.train import groups

if TYPE_CHECKING:
    from tracerl.train.trainer import Trainer


def collect_step(trainer: Trainer, step: int, policy: Any = None
                 ) -> tuple[list[Attempt], list[Attempt], dict[str, Any]]:
    """Collect the step's groups with ``policy`` (default: ``rollout.engine``'s), reusing
    complete groups a killed run already stored (every member ended with an ending the
    step trains on; see :func:`tracerl.train.groups.complete_group`).

    Returns the attempts to train on (uniform groups left out when dynamic sampling filters
    them), every attempt the step produced (for outcomes and costs), and metrics."""
    rollout, dynamic = trainer.config.rollout, trainer.config.dynamic
    stored = groups.stored_groups(trainer.store, step)
    trained = frozenset(reason for reason, treatment
                        in default_treatments(trainer.actor.has_critic).items()
                        if treatment in (Treatment.SCORE, Treatment.BOOTSTRAP))
    kept: list[Attempt] = []
    spent: list[Attempt] = []  # every attempt of the step, filtered or not: what it cost
    filtered = Counter[str]()
    used: set[str] = set()
    generation_seconds = 0.0
    reused = 0
    policy = policy or trainer.engine.policy()  # rollout.engine: vllm syncs and verifies
    for round_index in range(1 + (dynamic.max_refills if dynamic.refill else 0)):
        missing = rollout.tasks_per_step - len({a.group_id for a in kept})
        if missing <= 0:
            break
        tasks = trainer.choose_tasks(step, missing, used)
        used.update(t.id for t in tasks)
        run_id = f"s{step:05d}r{round_index}"
        attempts: list[Attempt] = []
        fresh: list[Task] = []
        for task in tasks:
            group = groups.complete_group(stored, run_id, task.id, rollout.group_size,
                                          trained)
            if group is not None:
                attempts.extend(group)
                reused += 1
            else:
                fresh.append(task)
        # A group a killed run left incomplete (or with members it cancelled) is collected
        # again under a new id, so the store never holds two different attempts under one
        # id; the partial one stays in the store, unused and counted.
        retry = 0
        while any(g.startswith(f"{run_id}-re{retry}:" if retry else f"{run_id}:")
                  for g in stored):
            retry += 1
        run_id = f"{run_id}-re{retry}" if retry else run_id
        if fresh:
            with trainer.collecting_threads():
                result = trainer.collector(fresh, temperature=rollout.temperature,
                                        seed=trainer.config.seed, store=trainer.store,
                                        policy=policy
                                        ).collect(fresh, rollout.group_size,
                                                  policy_version=policy.policy_version,
                                                  run_id=run_id)
            trainer.engine.check(result.attempts, step)
            attempts.extend(result.attempts)
            generation_seconds += result.generation_seconds
        spent.extend(attempts)
        for members in groups.by_group(attempts).values():
            rewards = [a.reward for a in members if a.reward is not None]
            uniform = len(set(rewards)) <= 1
            if dynamic.filter_uniform and uniform:
                filtered["all_one" if rewards and rewards[0] >= 1 else "all_zero"] += 1
                continue
            kept.extend(members)
        if not dynamic.filter_uniform:
            break
    metrics: dict[str, Any] = {"dynamic": {"reused_groups": reused,
                                           "filtered_all_zero": filtered["all_zero"],
                                           "filtered_all_one": filtered["all_one"],
                                           "rounds": len(used) and round_index + 1},
                               "time": {"generation_seconds": generation_seconds}}
    if engine := trainer.engine.metrics():
        metrics["engine"] = engine
    return kept, spent, metrics
