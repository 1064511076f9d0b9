"""``tracerl eval``, ``tracerl report`` and ``tracerl compare``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from tracerl.eval.compare import compare_runs, format_table, rows_to_json

RENAMED_FLAGS = {"--max-new-tokens": "--max-attempt-tokens",
                 "--max-new-tokens-per-turn": "--max-turn-tokens"}
"""Flags of ``tracerl eval`` that were renamed, and their new names."""


def register(subparsers: Any) -> None:
    """Add the ``eval``, ``report`` and ``compare`` subcommands."""
    ev = subparsers.add_parser(
        "eval", help="fixed-budget evaluation of a policy on a task file (hidden tests), or "
                     "of a multi-agent run's policies together (joint success)")
    ev.add_argument("--policy", required=True,
                    help="checkpoint directory (save_pretrained), or a multi-agent run's "
                         "directory (its agents are evaluated together on its held-out tasks)")
    ev.add_argument("--tasks", default=None,
                    help="JSON-lines task file (a multi-agent run: default its held-out tasks)")
    ev.add_argument("--samples", type=int, required=True, help="attempts per task (K of pass@k)")
    ev.add_argument("--temperature", type=float, default=None,
                    help="0 = greedy (default: the policy's run's, else 1)")
    ev.add_argument("--top-p", type=float, default=None, help="default: the run's, else 1")
    ev.add_argument("--top-k", type=int, default=None, help="default: the run's, else 0 (off)")
    ev.add_argument("--max-turns", type=int, default=None,
                    help="actions per attempt, a cap on each task's own budget (default: the "
                    "policy's run's; for a policy not trained by tracerl, each task's own "
                    "budget, else 8)")
    ev.add_argument("--max-turn-tokens", type=int, default=None,
                    help="tokens per action (default: the run's, else 128)")
    ev.add_argument("--max-attempt-tokens", type=int, default=None,
                    help="tokens per attempt (default: the run's, else 1024)")
    ev.add_argument("--max-seconds", type=float, default=None,
                    help="wall seconds per attempt (default: the run's, else none)")
    for old_flag in RENAMED_FLAGS:
        ev.add_argument(old_flag, dest=old_flag.strip("-").replace("-", "_"), default=None,
                        help=argparse.SUPPRESS)
    ev.add_argument("--seed", type=int, default=None,
                    help="default 0 (a multi-agent run: the run's seed)")
    ev.add_argument("--device", default="auto",
                    help="cpu, cuda, cuda:N or auto (a GPU where torch sees one)")
    ev.add_argument("--inject-faults", type=float, default=0.0, metavar="RATE",
                    help="re-run with tool faults (failed or timed-out commands, flaky test "
                         "runs, truncated outputs) at this rate per call; report both")
    ev.add_argument("--inject-infrastructure-faults", type=float, default=0.0, metavar="P",
                    help="in that re-run, test runs whose sandbox fails to start at this rate "
                         "(infrastructure endings, excluded from success and counted)")
    ev.add_argument("--judge", default=None, metavar="FILE",
                    help="JSON or YAML judge config (base_url, model, prompt) for a judge score")
    ev.add_argument("--training-judge", default=None, metavar="FILE",
                    help="the judge config used for the training reward, to check independence")
    ev.add_argument("--store", default=None, help="also record the attempts in this trace store")
    ev.add_argument("--json", dest="json_out", default=None, metavar="OUT",
                    help="write the result here")
    ev.add_argument("--progress", action="store_true", help="show a progress bar")
    ev.add_argument("--unsafe-no-sandbox", action="store_true",
                    help="run tests without bubblewrap (NO isolation)")
    ev.set_defaults(func=_eval)

    report = subparsers.add_parser("report", help="write a static HTML report of a run")
    report.add_argument("run_dir", help="run directory")
    report.add_argument("--out", default=None, help="HTML file (default RUN_DIR/report.html)")
    report.set_defaults(func=_report)

    compare = subparsers.add_parser(
        "compare", help="success beside rollouts, tokens, tool and training time, per run")
    compare.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    compare.add_argument("--markdown", action="store_true", help="print a Markdown table")
    compare.add_argument("--json", dest="json_out", default=None, metavar="OUT")
    compare.add_argument("--tolerance", type=float, default=0.10,
                         help="largest relative budget difference still called matched")
    compare.set_defaults(func=_compare)


def _read_config(path: str | None, flag: str) -> dict[str, Any] | None:
    if path is None:
        return None
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"{flag} {path!r}: could not be read ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag} {path!r}: must hold a mapping")
    return data


def _eval(args: argparse.Namespace) -> int:
    from tracerl.envs.sandbox import Sandbox, SandboxUnavailableError
    from tracerl.envs.tasks import load_tasks
    from tracerl.eval.evaluate import EvalSettings, format_result, load_policy, run_evaluation
    from tracerl.eval.judge import JudgeConfig

    for old_flag, new_flag in RENAMED_FLAGS.items():
        if getattr(args, old_flag.strip("-").replace("-", "_"), None) is not None:
            raise ValueError(f"{old_flag}: renamed; use {new_flag}")
    if args.tasks is None:
        raise ValueError("--tasks: required to evaluate one policy (a JSON-lines task file)")
    if not Path(args.tasks).is_file():
        raise ValueError(f"--tasks {args.tasks!r}: no such file")
    tasks = load_tasks(args.tasks)
    if not tasks:
        raise ValueError(f"--tasks {args.tasks!r}: holds no task")
    settings = EvalSettings(samples=args.samples, rollout=eval_rollout(args, tasks),
                            seed=0 if args.seed is None else args.seed,
                            inject_faults=args.inject_faults,
                            inject_infrastructure_faults=args.inject_infrastructure_faults)
    judge_data = _read_config(args.judge, "--judge")
    judge = None if judge_data is None else JudgeConfig.from_dict(judge_data)
    training_judge = _read_config(args.training_judge, "--training-judge")
    policy = load_policy(args.policy, device=args.device)
    try:
        sandbox = Sandbox(unsafe=args.unsafe_no_sandbox)
    except SandboxUnavailableError as error:
        raise ValueError(str(error)) from None
    result = run_evaluation(policy, tasks, settings, sandbox=sandbox, policy_dir=args.policy,
                            store_dir=args.store, judge=judge, training_judge=training_judge,
                            progress=args.progress)
    result["tasks_file"] = str(args.tasks)
    print(format_result(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n",
                                       encoding="utf-8")
    return 0


def eval_rollout(args: argparse.Namespace, tasks: Any) -> Any:
    """The rollout config of ``tracerl eval``: the one saved with the policy (so it is decoded
    as its run decoded it), else these defaults, with the flags given on top."""
    from tracerl.eval.evaluate import checkpoint_rollout, turn_cap
    from tracerl.rollout.settings import RolloutConfig

    saved = checkpoint_rollout(args.policy)
    if saved is None:
        saved = RolloutConfig(max_turns=turn_cap(tasks), max_turn_tokens=128,
                              max_attempt_tokens=1024)
    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
             "max_turns": args.max_turns, "max_turn_tokens": args.max_turn_tokens,
             "max_attempt_tokens": args.max_attempt_tokens, "max_seconds": args.max_seconds}
    given = {k: v for k, v in flags.items() if v is not None}
    for name in ("max_turns", "max_turn_tokens", "max_attempt_tokens"):
        if name in given and given[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {given[name]}")
    return dataclasses.replace(saved, **given)


def _report(args: argparse.Namespace) -> int:
    from tracerl.eval.report import write_report

    out, plots = write_report(args.run_dir, args.out)
    drawn = sum(plot.png is not None for plot in plots)
    print(f"wrote {out} ({drawn}/{len(plots)} plots)")
    for plot in plots:
        if plot.png is None:
            print(f"  {plot.title}: {plot.note}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    rows, warnings = compare_runs(args.run_dirs, tolerance=args.tolerance)
    print(format_table(rows, markdown=args.markdown))
    for warning in warnings:
        print(f"note: {warning}", file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows_to_json(rows, warnings), indent=2) + "\n",
                                       encoding="utf-8")
    return 0
