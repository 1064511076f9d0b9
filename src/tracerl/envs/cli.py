"""``tracerl tasks validate|export|humaneval|mine`` and ``tracerl sandbox run``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tracerl.envs.mine import STDLIB_MODULES
from tracerl.envs.sandbox import Sandbox, SandboxLimits, SandboxUnavailableError
from tracerl.envs.suite import generate_split
from tracerl.envs.tasks import Budget, dump_tasks, load_tasks, validate_tasks, write_files


def register(subparsers: Any) -> None:
    """Add the ``tasks`` and ``sandbox`` subcommands."""
    tasks = subparsers.add_parser("tasks", help="check and export coding task sets")
    tasks_sub = tasks.add_subparsers(dest="tasks_command", metavar="ACTION", required=True)

    validate = tasks_sub.add_parser(
        "validate", help="check a task file: fields, start fails hidden tests, solution passes")
    validate.add_argument("file", help="JSON-lines task file")
    validate.add_argument("--workers", type=int, default=2, help="sandboxes run at once")
    _add_unsafe(validate)
    validate.set_defaults(func=_validate)

    export = tasks_sub.add_parser("export", help="write a split of the built-in suite")
    export.add_argument("--split", choices=("train", "heldout"), required=True)
    export.add_argument("--out", required=True, help="JSON-lines file to write")
    export.add_argument("--seed", type=int, default=0, help="generator seed")
    export.add_argument("--count", type=int, default=None,
                        help="number of tasks (default: the split's default size)")
    export.add_argument("--composed", action="store_true",
                        help="train split only: draw from the composed templates too")
    export.add_argument("--max-turns", type=int, default=8,
                        help="each task's budget of actions (default 8)")
    export.set_defaults(func=_export)

    humaneval = tasks_sub.add_parser(
        "humaneval", help="write HumanEval's 164 problems as tasks (needs tracerl[tasks])")
    humaneval.add_argument("--out", required=True, help="JSON-lines file to write")
    humaneval.add_argument("--kind", choices=("implement", "fix", "both"), default="both",
                           help="implement the function, fix a mutated solution, or both")
    humaneval.add_argument("--seed", type=int, default=0,
                           help="draws the visible tests and the mutants")
    humaneval.add_argument("--limit", type=int, default=None, help="first N problems only")
    humaneval.add_argument("--split", choices=("all", "train", "heldout"), default="all",
                           help="by problem: every 4th problem (HumanEval/0, /4, ...) is "
                                "held out, so no function is on both sides")
    humaneval.add_argument("--max-turns", type=int, default=None,
                           help="each task's budget of actions (default: the caller's)")
    _add_unsafe(humaneval)
    humaneval.set_defaults(func=_humaneval)

    mine = tasks_sub.add_parser(
        "mine", help="mine bug-fix tasks from a Python repository and its pytest tests")
    where = mine.add_mutually_exclusive_group(required=True)
    where.add_argument("--repo", help="the repository: a directory, or a git repository "
                       "with --commit")
    where.add_argument("--stdlib", nargs="*", metavar="MODULE",
                       help="the built-in set: standard-library modules with their own tests "
                            "(default: " + " ".join(STDLIB_MODULES) + ")")
    mine.add_argument("--commit", help="with --repo: mine this commit of a git repository")
    mine.add_argument("--test-command", default="python -m pytest -q",
                      help="the repository's pytest command (default: python -m pytest -q)")
    mine.add_argument("--sources", nargs="+", default=["*.py"],
                      help="glob patterns of the files to mutate (test files never are)")
    mine.add_argument("--environment", default=None,
                      help="virtualenv or Python executable the tests run in")
    mine.add_argument("--out", required=True, help="directory for train.jsonl, heldout.jsonl "
                      "and summary.json")
    mine.add_argument("--seed", type=int, default=0)
    mine.add_argument("--tries", type=int, default=4, help="mutants tried per function")
    mine.add_argument("--per-function", type=int, default=1, help="tasks kept per function")
    mine.add_argument("--max-tasks", type=int, default=None, help="most tasks in all")
    mine.add_argument("--heldout-fraction", type=float, default=0.25,
                      help="share of the modules held out")
    mine.add_argument("--name", default=None, help="task id prefix and family "
                      "(default: mined, or stdlib with --stdlib)")
    mine.add_argument("--workers", type=int, default=2, help="sandboxes run at once")
    mine.add_argument("--timeout", type=float, default=60.0,
                      help="wall-clock seconds of one test run; also the tasks' "
                           "budget.test_seconds")
    mine.add_argument("--validate", action="store_true",
                      help="also validate every task (3 more test runs each) and keep the "
                           "valid ones")
    _add_unsafe(mine)
    mine.set_defaults(func=_mine)

    sandbox = subparsers.add_parser("sandbox", help="run commands in a task's sandbox")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", metavar="ACTION", required=True)
    run = sandbox_sub.add_parser(
        "run", help="run CMD in a fresh workspace of a task (hidden files absent); prints JSON")
    run.add_argument("--tasks", required=True, help="JSON-lines task file")
    run.add_argument("--id", required=True, help="task id")
    run.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds")
    _add_unsafe(run)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(func=_sandbox_run)


def _add_unsafe(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="run without bubblewrap (NO isolation; limits and timeout only)")


def _sandbox(args: argparse.Namespace, limits: SandboxLimits | None = None) -> Sandbox:
    try:
        return Sandbox(limits, unsafe=args.unsafe_no_sandbox)
    except SandboxUnavailableError as error:
        raise ValueError(str(error)) from None


def _validate(args: argparse.Namespace) -> int:
    tasks = load_tasks(args.file)
    checks = validate_tasks(tasks, _sandbox(args), workers=args.workers)
    bad = [check for check in checks if not check.ok]
    for check in bad:
        for problem in check.problems:
            print(f"{check.task_id}: {problem}")
    print(f"{len(tasks) - len(bad)}/{len(tasks)} tasks valid")
    return 1 if bad else 0


def _export(args: argparse.Namespace) -> int:
    tasks = generate_split(args.split, seed=args.seed, count=args.count,
                           composed=args.composed, max_turns=args.max_turns)
    count = dump_tasks(tasks, args.out)
    print(f"wrote {count} {args.split} tasks to {args.out}")
    return 0


def _humaneval(args: argparse.Namespace) -> int:
    from tracerl.envs.humaneval import fix_tasks, implement_tasks, load_problems

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.max_turns is not None and args.max_turns < 1:
        raise ValueError(f"--max-turns must be >= 1, got {args.max_turns}")
    problems = [problem for index, problem in enumerate(load_problems()[: args.limit])
                if args.split == "all" or (index % 4 == 0) == (args.split == "heldout")]
    tasks = []
    if args.kind in ("implement", "both"):
        tasks += implement_tasks(problems, seed=args.seed)
    if args.kind in ("fix", "both"):
        fixes = fix_tasks(problems, _sandbox(args), seed=args.seed)
        print(f"{len(fixes)}/{len(problems)} problems gave a fix task (a mutant the tests "
              "catch)")
        tasks += fixes
    if args.max_turns is not None:
        tasks = [dataclasses.replace(t, budget=Budget(max_turns=args.max_turns)) for t in tasks]
    count = dump_tasks(tasks, args.out)
    print(f"wrote {count} HumanEval tasks to {args.out}")
    return 0


def _mine(args: argparse.Namespace) -> int:
    import time

    from tracerl.envs.mine import Miner, MineSettings, stdlib_repos
    from tracerl.envs.repos import RepoSource

    started = time.monotonic()
    if args.stdlib is not None:
        repos = stdlib_repos(args.stdlib or STDLIB_MODULES)
    else:
        source = (RepoSource(git=args.repo, commit=args.commit) if args.commit
                  else RepoSource(path=args.repo))
        repos = {Path(args.repo).resolve().name: source.read_files()}
    settings = MineSettings(
        test_command=args.test_command, sources=tuple(args.sources), seed=args.seed,
        tries_per_function=args.tries, tasks_per_function=args.per_function,
        max_tasks=args.max_tasks, heldout_fraction=args.heldout_fraction,
        environment=args.environment,
        name=args.name or ("stdlib" if args.stdlib is not None else "mined"),
        workers=args.workers, test_seconds=args.timeout)
    sandbox = _sandbox(args, SandboxLimits(wall_seconds=args.timeout,
                                           cpu_seconds=max(1, int(args.timeout))))
    result = Miner(settings, sandbox).mine(repos)
    invalid: list[str] = []
    if args.validate:
        for split in (result.train, result.heldout):
            checks = validate_tasks(split, sandbox, workers=args.workers)
            invalid += [f"{c.task_id}: {p}" for c in checks for p in c.problems]
            bad = {c.task_id for c in checks if not c.ok}
            split[:] = [t for t in split if t.id not in bad]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dump_tasks(result.train, out / "train.jsonl")
    dump_tasks(result.heldout, out / "heldout.jsonl")
    seconds = time.monotonic() - started
    summary = {"repos": sorted(repos), "seed": args.seed, "train": len(result.train),
               "heldout": len(result.heldout), "refused": dict(result.refused),
               "flaky_tests": sorted(result.flaky), "test_runs": result.tests_run,
               "invalid": invalid, "seconds": round(seconds, 1),
               "tasks_per_minute": round(60 * (len(result.train) + len(result.heldout))
                                         / seconds, 2)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"mined {len(result.train)} train and {len(result.heldout)} held-out tasks into "
          f"{out} in {seconds:.0f} s ({result.tests_run} test runs); refused: "
          + (", ".join(f"{k}: {v}" for k, v in sorted(result.refused.items())) or "none"))
    for line in invalid:
        print(f"invalid, left out: {line}")
    return 0


def _sandbox_run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("give the command after --, e.g. -- python -m pytest")
    by_id = {task.id: task for task in load_tasks(args.tasks)}
    if args.id not in by_id:
        raise ValueError(f"--id: no task {args.id!r} in {args.tasks}")
    sandbox = _sandbox(args, SandboxLimits(wall_seconds=args.timeout))
    with tempfile.TemporaryDirectory(prefix="tracerl-ws-") as tmp:
        write_files(Path(tmp), by_id[args.id].files)
        result = by_id[args.id].sandbox(sandbox).run(tmp, cmd)
    json.dump(result.to_dict(), sys.stdout)
    sys.stdout.write("\n")
    return 0
