"""The run's held-out evaluations and its summary: the evaluation before RL, every
``eval.every`` steps and after the last step (each the function of ``tracerl eval`` with the
run's ``rollout`` config), a restarted run's reuse of the evaluations it already wrote, and
``summary.json``.

Functions of the :class:`~tracerl.train.trainer.Trainer` they evaluate for.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracerl.eval.summary import gain_ci as paired_gain_ci

if TYPE_CHECKING:
    from tracerl.train.trainer import Trainer


def policy_kind(trainer: Trainer) -> str:
    """What the run's policy is: its last iterate or the weight average."""
    if trainer.ema is None:
        return "last checkpoint"
    return f"weight average, update.ema_decay {trainer.config.update.ema_decay}"


def evaluate(trainer: Trainer, label: str, policy: str = "last checkpoint",
             steps: int | None = None) -> dict[str, Any]:
    """Held-out success with a fixed budget: K samples per task at the rollout temperature,
    and one greedy attempt per task; hidden-test verdicts, task-level bootstrap CIs. Each
    is :func:`tracerl.eval.evaluate.evaluate`, the function of ``tracerl eval``, with the
    run's ``rollout`` config. The files record ``policy`` (what the model holds) and
    ``steps``, the RL steps behind it (default: the steps completed)."""
    from tracerl.eval.evaluate import EvalSettings
    from tracerl.eval.evaluate import evaluate as evaluate_policy

    tasks = trainer.heldout_tasks[: trainer.config.eval.tasks or len(trainer.heldout_tasks)]
    seed = trainer.config.seed + 7919  # the same evaluation seeds before and after training
    out: dict[str, Any] = {}
    rollout = trainer.config.rollout
    runs = [("sampled", rollout, trainer.config.eval.samples_per_task)]
    if trainer.config.eval.greedy:
        runs.append(("greedy", dataclasses.replace(rollout, temperature=0.0), 1))
    for name, decoding, samples in runs:
        settings = EvalSettings(samples=samples, rollout=decoding, seed=seed,
                                bootstrap_resamples=trainer.config.eval.bootstrap_resamples)
        with trainer.collecting_threads():
            summary = evaluate_policy(trainer.policy, tasks, settings, sandbox=trainer.sandbox,
                                      store_dir=trainer.run_dir / "eval" / f"{label}-{name}",
                                      run_id=f"{label}-{name}", fsync=False,
                                      make_env=trainer.make_env_factory(tasks))
        summary["temperature"] = decoding.temperature
        summary["rl_steps"] = trainer.state.step if steps is None else steps
        summary["policy"] = policy
        (trainer.run_dir / f"eval_{label}_{name}.json").write_text(
            json.dumps(summary, indent=1), encoding="utf-8")
        out[name] = {k: summary[k] for k in ("success", "ci95", "pass_at_k",
                                             "generated_tokens", "tool_seconds", "turns",
                                             "attempts", "behaviour", "per_task")}
    return out


def evaluate_once(trainer: Trainer, label: str, *, steps: int, policy: str) -> dict[str, Any]:
    """``evaluate`` unless this run already wrote that evaluation of ``policy`` after
    ``steps`` RL steps (a run restarted after its last step); a finished run continued
    with more steps, or another kind of policy, is evaluated again."""
    files = {n: trainer.run_dir / f"eval_{label}_{n}.json" for n in ("sampled", "greedy")}
    wanted = ["sampled", "greedy"] if trainer.config.eval.greedy else ["sampled"]
    if all(files[n].is_file() for n in wanted):
        found = {n: json.loads(files[n].read_text(encoding="utf-8")) for n in wanted}
        # Files written before these fields existed are taken for what they can only be
        # sure to hold: an evaluation before any RL step.
        if all(f.get("rl_steps", 0) == steps and f.get("policy", policy) == policy
               for f in found.values()):
            return found
        trainer.log(f"evaluation {label}: the files hold another policy or step count; "
                    "evaluating again (the earlier attempts are kept beside the new ones)")
        for name, found_file in found.items():
            recorded = found_file.get("rl_steps")
            keep_aside(trainer.run_dir / "eval" / f"{label}-{name}",
                       None if recorded is None else int(recorded))
    started = time.perf_counter()
    with trainer.phase("evaluate"):
        result = trainer.evaluate(label, policy, steps)
    trainer.timings[f"evaluate_{label}"] = time.perf_counter() - started
    trainer.log(f"evaluation {label}: sampled {result['sampled']['success']:.3f}"
                + (f", greedy {result['greedy']['success']:.3f}" if "greedy" in result else "")
                + f" ({trainer.timings[f'evaluate_{label}']:.0f}s)")
    return result


def keep_aside(store_dir: Path, steps: int | None) -> None:
    """Rename an evaluation's trace store so that a new evaluation under the same label
    writes a store of its own (attempt ids repeat, and a store keeps the first of each).
    ``steps``: the RL steps behind it (None: not recorded)."""
    if not store_dir.exists():
        return
    for copy_number in range(1000):
        suffix = ".earlier" if steps is None else f".rl_steps-{steps:05d}"
        suffix += f".{copy_number}" if copy_number else ""
        target = store_dir.with_name(store_dir.name + suffix)
        if not target.exists():
            store_dir.rename(target)
            return
    raise RuntimeError(f"{store_dir}: too many earlier evaluations kept beside it")


def write_summary(trainer: Trainer, before: dict[str, Any], after: dict[str, Any],
                  policy_dir: Path, last_checkpoint: Path) -> dict[str, Any]:
    """``summary.json``: held-out success before and after, costs, where the policy is
    (``policy_dir``: the one evaluated after training; ``last_checkpoint``: the raw
    weights of the last step)."""
    greedy = trainer.config.eval.greedy
    sampled_b, sampled_a = before["sampled"], after["sampled"]
    train_tokens = trainer.state.totals.get("generated_tokens", 0.0)
    eval_tokens = sum(r[n]["generated_tokens"] for r in (before, after) for n in r)
    summary: dict[str, Any] = {
        "heldout_success_before": sampled_b["success"],
        "heldout_success_after": sampled_a["success"],
        "heldout_greedy_before": before["greedy"]["success"] if greedy else None,
        "heldout_greedy_after": after["greedy"]["success"] if greedy else None,
        "heldout_ci95_before": sampled_b["ci95"],
        "heldout_ci95_after": sampled_a["ci95"],
        "heldout_greedy_ci95_before": before["greedy"]["ci95"] if greedy else None,
        "heldout_greedy_ci95_after": after["greedy"]["ci95"] if greedy else None,
        "heldout_pass_at_k_before": sampled_b["pass_at_k"],
        "heldout_pass_at_k_after": sampled_a["pass_at_k"],
        # The gains, each with a bootstrap interval paired by task (eval.stats).
        "heldout_gain": sampled_a["success"] - sampled_b["success"],
        "heldout_gain_ci95": gain_ci(trainer, sampled_b, sampled_a),
        "heldout_gain_over_greedy": (sampled_a["success"] - before["greedy"]["success"]
                                     if greedy else None),
        "heldout_gain_over_greedy_ci95": (gain_ci(trainer, before["greedy"], sampled_a)
                                          if greedy else None),
        # Sampled attempts: edits that applied, what followed a FAIL (eval.behaviour).
        "heldout_behaviour_before": sampled_b.get("behaviour"),
        "heldout_behaviour_after": sampled_a.get("behaviour"),
        "samples_per_task": trainer.config.eval.samples_per_task,
        "heldout_tasks": len(trainer.heldout_tasks[: trainer.config.eval.tasks
                                                   or len(trainer.heldout_tasks)]),
        "temperature": trainer.config.rollout.temperature,
        "top_p": trainer.config.rollout.top_p,
        "top_k": trainer.config.rollout.top_k,
        "policy_dir": str(policy_dir),
        "policy": policy_kind(trainer),
        "last_checkpoint": str(last_checkpoint),
        "sft_dir": str(trainer.run_dir / "sft") if trainer.config.sft.enabled else None,
        "rl_steps": trainer.state.step,
        "wall_seconds": time.perf_counter() - trainer.started,
        "generated_tokens": int(train_tokens + eval_tokens),
        "tool_seconds": trainer.state.totals.get("tool_seconds", 0.0) + sum(
            r[n]["tool_seconds"] for r in (before, after) for n in r),
        "phase_seconds": {k: v for k, v in trainer.timings.items()},
    }
    (trainer.run_dir / "summary.json").write_text(json.dumps(summary, indent=1),
                                                  encoding="utf-8")
    trainer.close()
    return summary


def gain_ci(trainer: Trainer, before: dict[str, Any], after: dict[str, Any]) -> list[float]:
    """Paired task-level bootstrap interval of ``after``'s success minus ``before``'s."""
    return paired_gain_ci(before, after, seed=trainer.config.seed,
                          resamples=trainer.config.eval.bootstrap_resamples)
