"""Asynchronous training against synchronous: wall seconds per RL step, and held-out success.

Claim (issue 41's target): with ``asynchronous.max_staleness`` k >= 1 an RL step takes about
max(collection, update) instead of their sum, at a held-out success within the synchronous
run's interval. The anchor, measured in the same invocation, is the synchronous run (k = 0)
of the same recipe from the same warm start.

Runs the recipe (default: the demo's, ``configs/demo.yaml``, shortened by ``--steps``,
``--sft-steps`` and the overrides below) once synchronously, then once per k in
``--staleness``; every run starts from the synchronous run's warm start and its evaluation
before RL (both copied into the run's directory), with the same seed and step count, so the
runs differ only in k (and in the thread settings below). Prints for each run the median step
seconds and their total (step 0 left out: nothing overlaps it, and a synchronous vLLM run
starts its server in it), for the synchronous run its median
collection and update seconds (the update: verify, advantages and the update phases), and for
each asynchronous run the ratio of its step time to the synchronous step time and to
max(collection, update) of the synchronous run, and, in the same run step by step, the ratio
of its step time to max(the worker's collection, the learner's update) and to their sum (the
measure that machine load drifting between runs moves least), the same per generated token
(the runs' samples differ in length); then ``tracerl compare``'s table
(held-out success with its interval, generated tokens, tool and training seconds).
``--warm-start RUN`` copies that run's warm start and evaluation before RL into every run
instead of training one.

Threads: torch has one intra-op thread count per process, so an asynchronous run cannot give
its collection another count than its update (``rollout.threads`` is refused); the
asynchronous runs use ``--async-threads`` for both, the synchronous run keeps the recipe's own
settings (the demo: 2 for updates, 1 while collecting), or ``--async-threads`` as well with
``--same-threads``.

Run: ``python bench/async.py`` (``--help`` for the knobs; ``--out`` is the runs' directory).
Timings depend on the machine's load: run it on an otherwise idle machine, or say it was not.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from tracerl.eval.compare import compare_runs, format_table
from tracerl.train.config import load_config
from tracerl.train.trainer import Trainer

UPDATE_PHASES = ("verify", "advantages", "update")
"""The learner's phases of a step (the update, in the claim's words)."""


class PhaseClock:
    """A trainer hook: seconds of each phase, per RL step (from ``Trainer.timings``)."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = defaultdict(float)
        self.steps: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def __call__(self, phase: str, trainer: Trainer) -> None:
        spent = trainer.timings[phase] - self.seen[phase]
        self.seen[phase] = trainer.timings[phase]
        if phase in ("collect", *UPDATE_PHASES):
            self.steps[trainer.state.step][phase] += spent


def run(config: Path, out: Path, overrides: list[str], warm_from: Path | None,
        evaluation: bool = True) -> dict[str, Any]:
    """One run; with ``warm_from``, its warm start (and with ``evaluation`` its evaluation
    before RL) are copied first."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if warm_from is not None:
        shutil.copytree(warm_from / "sft", out / "sft")
    if warm_from is not None and evaluation:
        for path in warm_from.glob("eval_before_*.json"):
            shutil.copy2(path, out / path.name)
        for path in (warm_from / "eval").glob("before-*"):
            shutil.copytree(path, out / "eval" / path.name)
    clock = PhaseClock()
    started = time.perf_counter()
    Trainer(load_config(config, [*overrides, f"run_dir={out}"]), hooks=[clock],
            log=lambda line: print(f"  [{out.name}] {line}", flush=True)).run()
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    later = steps[1:] or steps
    collect = [clock.steps[r["step"]]["collect"] for r in later]
    update = [sum(clock.steps[r["step"]][p] for p in UPDATE_PHASES) for r in later]
    result: dict[str, Any] = {
        "run": out.name, "steps": len(steps), "wall_seconds": wall,
        "step_seconds": statistics.median(r["time"]["step_seconds"] for r in later),
        "steps_total_seconds": sum(r["time"]["step_seconds"] for r in later),
        "collect_seconds": statistics.median(collect),
        "update_seconds": statistics.median(update)}
    # Per generated token: two runs' samples differ in length (an asynchronous step's attempts
    # are sampled one version earlier), and collection and update scale with it.
    tokens = sum(r["costs"]["generated_tokens"] for r in later)
    result["generated_tokens"] = tokens
    result["step_ms_per_token"] = 1000 * result["steps_total_seconds"] / tokens
    result["collect_ms_per_token"] = 1000 * sum(collect) / tokens
    result["update_ms_per_token"] = 1000 * sum(update) / tokens
    if "async" in steps[-1]:
        worker = [r["async"]["collect_seconds"] for r in later]
        result["worker_collect_seconds"] = statistics.median(worker)
        # In the same run, step by step: the step against its own collection and update.
        step_times = [r["time"]["step_seconds"] for r in later]
        result["own_max_ratio"] = statistics.median(
            t / max(c, u) for t, c, u in zip(step_times, worker, update, strict=True))
        result["own_sum_ratio"] = statistics.median(
            t / (c + u) for t, c, u in zip(step_times, worker, update, strict=True))
        result["overlap"] = statistics.median(r["async"]["overlap"] for r in later)
        ages: Counter[int] = Counter()
        for record in steps:
            ages.update({int(k): int(v) for k, v in record["async"]["staleness_versions"].items()})
        result["staleness"] = dict(sorted(ages.items()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    parser.add_argument("--out", type=Path, default=Path("runs/bench-async"))
    parser.add_argument("--staleness", type=int, action="append", default=None,
                        help="the k of an asynchronous run, once per run (default: 1 and 2; "
                             "the synchronous one runs first)")
    parser.add_argument("--steps", type=int, default=4, help="RL steps of every run")
    parser.add_argument("--sft-steps", type=int, default=300, help="warm-start steps")
    parser.add_argument("--tasks-per-step", type=int, default=6)
    parser.add_argument("--eval-tasks", type=int, default=16, help="held-out tasks evaluated")
    parser.add_argument("--eval-samples", type=int, default=4, help="samples per held-out task")
    parser.add_argument("--async-threads", type=int, default=1,
                        help="torch threads of the asynchronous runs (collection and update)")
    parser.add_argument("--same-threads", action="store_true",
                        help="the synchronous run uses --async-threads too (not the recipe's)")
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="a run directory whose warm start (sft/) and evaluation before RL "
                             "every run copies (default: the synchronous run's own)")
    parser.add_argument("--fresh-eval", action="store_true",
                        help="every run evaluates before RL itself (with --warm-start: when "
                             "the rollout settings differ from the warm start's run)")
    parser.add_argument("--tis-cap", type=float, default=2.0,
                        help="update.tis_cap of every run (decoupled PPO needs one)")
    parser.add_argument("overrides", nargs="*", help="more KEY=VALUE overrides for every run")
    args = parser.parse_args()
    args.staleness = args.staleness or [1, 2]

    common = [f"steps={args.steps}", "max_seconds=null", f"sft.steps={args.sft_steps}",
              "sft.max_seconds=null", f"rollout.tasks_per_step={args.tasks_per_step}",
              f"eval.tasks={args.eval_tasks}", f"eval.samples_per_task={args.eval_samples}",
              f"update.tis_cap={args.tis_cap}", "progress=false", "tensorboard=false",
              *args.overrides]
    threads = [f"threads={args.async_threads}", "rollout.threads=null"]
    if args.warm_start is not None and args.warm_start.resolve() == (args.out / "sync").resolve():
        parser.error("--warm-start: must not be the synchronous run's directory (it is rebuilt)")
    copy_eval = not args.fresh_eval
    results = [run(args.config, args.out / "sync", [*common, *threads] if args.same_threads
                   else common, args.warm_start, copy_eval)]
    for k in args.staleness:
        extra = [f"asynchronous.max_staleness={k}", *threads]
        results.append(run(args.config, args.out / f"k{k}", [*common, *extra],
                           args.warm_start or args.out / "sync", copy_eval))
    sync = results[0]
    bound = max(sync["collect_seconds"], sync["update_seconds"])
    print(f"\nsynchronous: step {sync['step_seconds']:.1f}s = collection "
          f"{sync['collect_seconds']:.1f}s + update {sync['update_seconds']:.1f}s "
          f"(medians of steps 1-{sync['steps'] - 1}); max(collection, update) {bound:.1f}s; "
          f"steps 1-{sync['steps'] - 1} took {sync['steps_total_seconds']:.0f}s in all")
    token_bound = max(sync["collect_ms_per_token"], sync["update_ms_per_token"])
    print(f"per generated token (steps 1-{sync['steps'] - 1}): synchronous step "
          f"{sync['step_ms_per_token']:.2f} ms = collection {sync['collect_ms_per_token']:.2f} "
          f"+ update {sync['update_ms_per_token']:.2f}; "
          + "; ".join(f"{r['run']} step {r['step_ms_per_token']:.2f} ms, "
                      f"{r['step_ms_per_token'] / token_bound:.2f}x the synchronous "
                      f"max(collection, update) per token ({r['generated_tokens']:,} tokens "
                      f"against {sync['generated_tokens']:,})" for r in results[1:]))
    for result in results[1:]:
        total = result["steps_total_seconds"] / sync["steps_total_seconds"]
        print(f"{result['run']}: steps 1-{result['steps'] - 1} {result['steps_total_seconds']:.0f}s "
              f"in all, {total:.2f}x the synchronous run's; median step {result['step_seconds']:.1f}s, "
              f"{result['step_seconds'] / sync['step_seconds']:.2f}x the synchronous step, "
              f"{result['step_seconds'] / bound:.2f}x max(collection, update); worker "
              f"collection {result['worker_collect_seconds']:.1f}s, update "
              f"{result['update_seconds']:.1f}s, overlap {result['overlap']:.2f}, staleness "
              f"{result['staleness']}; in the same run, step by step (median): "
              f"{result['own_max_ratio']:.2f}x max(its collection, its update), "
              f"{result['own_sum_ratio']:.2f}x their sum")
    rows, warnings = compare_runs([args.out / r["run"] for r in results])
    print()
    print(format_table(rows, markdown=True))
    for warning in warnings:
        print(f"note: {warning}")
    (args.out / "bench.json").write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
