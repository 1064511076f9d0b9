"""``tracerl eval``, ``tracerl report`` and ``tracerl compare``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tracerl.eval.compare import compare_runs, format_table, rows_to_json


def register(subparsers: Any) -> None:
    """Add the ``eval``, ``report`` and ``compare`` subcommands."""
    ev = subparsers.add_parser(
        "eval", help="fixed-budget evaluation of a policy on a task file (hidden tests)")
    ev.add_argument("--policy", required=True, help="checkpoint directory (save_pretrained)")
    ev.add_argument("--tasks", required=True, help="JSON-lines task file")
    ev.add_argument("--samples", type=int, required=True, help="attempts per task (K of pass@k)")
    ev.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1)")
    ev.add_argument("--top-p", type=float, default=1.0)
    ev.add_argument("--top-k", type=int, default=0)
    ev.add_argument("--max-turns", type=int, default=None,
                    help="actions per attempt (default: each task's own budget, else 8)")
    ev.add_argument("--max-new-tokens", type=int, default=1024, help="tokens per attempt")
    ev.add_argument("--max-new-tokens-per-turn", type=int, default=128, help="tokens per action")
    ev.add_argument("--max-seconds", type=float, default=None, help="wall seconds per attempt")
    ev.add_argument("--seed", type=int, default=0)
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

    settings = EvalSettings(
        samples=args.samples, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_new_tokens_per_turn=args.max_new_tokens_per_turn,
        max_new_tokens=args.max_new_tokens, max_turns=args.max_turns,
        max_seconds=args.max_seconds, seed=args.seed, inject_faults=args.inject_faults,
        inject_infrastructure_faults=args.inject_infrastructure_faults)
    if not Path(args.tasks).is_file():
        raise ValueError(f"--tasks {args.tasks!r}: no such file")
    tasks = load_tasks(args.tasks)
    if not tasks:
        raise ValueError(f"--tasks {args.tasks!r}: holds no task")
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
