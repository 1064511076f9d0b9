"""``tracerl train CONFIG [key=value ...]`` and the demo (``tracerl demo``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tracerl.train.config import describe_config, load_config


def _train(args: argparse.Namespace) -> int:
    from tracerl.train.trainer import Trainer

    config = load_config(args.config, args.overrides)
    if args.check:
        print(f"{args.config}: ok")
        return 0
    if config.multiagent.env != "none":
        from tracerl.train.joint import JointTrainer

        summary = JointTrainer(config, log=print).run()
    else:
        summary = Trainer(config, log=print).run()
    if summary:  # under torchrun, ranks other than 0 return none
        print(json.dumps({k: v for k, v in summary.items() if k != "phase_seconds"}, indent=1))
    return 0


def _options(args: argparse.Namespace) -> int:
    for name, value, doc in describe_config():
        print(f"{name} = {value}\n    {doc}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tracerl.train.demo import run_demo

    summary = run_demo(args.overrides)
    return 0 if summary["demo_targets"]["met"] or not args.strict else 1


def _train_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tracerl.train.run_eval import average_spec, evaluate_run, parse_ema, parse_mix, step_spec

    run_dir = Path(args.run_dir)
    specs = [step_spec(step) for step in args.step]
    specs += [average_spec(text) for text in args.average]
    specs += [parse_ema(text, run_dir) for text in args.ema]
    specs += [parse_mix(text, run_dir) for text in args.mix]
    evaluate_run(run_dir, specs, args.out, args.overrides)
    return 0


JOINT_REFUSED = {"--top-p": "top_p", "--top-k": "top_k", "--max-attempt-tokens":
                 "max_attempt_tokens", "--max-seconds": "max_seconds", "--judge": "judge",
                 "--training-judge": "training_judge", "--inject-faults": "inject_faults",
                 "--inject-infrastructure-faults": "inject_infrastructure_faults",
                 "--unsafe-no-sandbox": "unsafe_no_sandbox", "--progress": "progress"}
"""Flags of ``tracerl eval`` that a multi-agent run's evaluation does not use (refused)."""


def _eval_joint(args: argparse.Namespace, run_dir: Path) -> int:
    """``tracerl eval`` of a multi-agent run: its policies together, joint success."""
    from tracerl.train.joint_eval import evaluate_joint_run, format_joint_result

    for flag, name in JOINT_REFUSED.items():
        if getattr(args, name) not in (None, False, 0.0):
            raise ValueError(f"{flag}: not available for a multi-agent run "
                             f"({str(run_dir)!r}); leave it out")
    if args.device not in ("auto", "cpu"):
        raise ValueError(f"--device {args.device!r}: a multi-agent run is evaluated on the CPU")
    result = evaluate_joint_run(run_dir, samples=args.samples, temperature=args.temperature,
                                seed=args.seed, max_turns=args.max_turns,
                                max_turn_tokens=args.max_turn_tokens, tasks_file=args.tasks,
                                store_dir=args.store)
    print(format_joint_result(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n",
                                       encoding="utf-8")
    return 0


def _joint_eval(subparsers: Any) -> None:
    """Let ``tracerl eval --policy RUN`` evaluate a multi-agent run's agents together
    (:mod:`tracerl.train.joint_eval`). The evaluation library never imports the trainer, so
    the trainer's command line extends ``eval`` (registered before it): a ``--policy`` that
    names a joint run goes here, anything else to ``eval``'s own handler."""
    parser = subparsers.choices.get("eval")
    if parser is None:
        return
    single = parser.get_default("func")

    def evaluate(args: argparse.Namespace) -> int:
        from tracerl.train.joint_eval import joint_run_dir

        run_dir = joint_run_dir(args.policy)
        if run_dir is None:
            return int(single(args))
        return _eval_joint(args, run_dir)

    parser.set_defaults(func=evaluate)


def register(subparsers: Any) -> None:
    """Add ``train``, ``train-options``, ``train-eval`` and ``demo``."""
    train = subparsers.add_parser(
        "train", help="train a policy from a YAML recipe (see configs/)",
        description="Run a training recipe. Overrides are dotted keys: update.lr=3e-4 "
                    "rollout.group_size=8. `tracerl train-options` lists every key.")
    train.add_argument("config", help="YAML recipe")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    train.add_argument("--check", action="store_true",
                       help="only load and validate the config")
    train.set_defaults(func=_train)
    options = subparsers.add_parser("train-options",
                                    help="list every training config key with its help")
    options.set_defaults(func=_options)
    evaluate = subparsers.add_parser(
        "train-eval", help="evaluate a run's checkpoints (or averaged weights) with the run's "
                           "own held-out evaluation",
        description="Evaluate checkpoints of a run exactly as its before/after evaluation did "
                    "(same tasks, budget, temperature and seeds). Step 0 is the warm start. "
                    "Results: OUT/evaluations.jsonl. KEY=VALUE overrides change the "
                    "evaluation (e.g. rollout.temperature=0.7).")
    evaluate.add_argument("run_dir", help="the run's directory (holds config.yaml)")
    evaluate.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                          help="evaluation overrides")
    evaluate.add_argument("--step", type=int, action="append", default=[],
                          help="a checkpoint by its step count (repeatable; 0: the warm start)")
    evaluate.add_argument("--average", action="append", default=[], metavar="FIRST-LAST",
                          help="the uniform mean of the weights of steps FIRST..LAST")
    evaluate.add_argument("--ema", action="append", default=[], metavar="DECAY[@LAST]",
                          help="an exponential moving average of the weights from the warm "
                               "start through step LAST (default: the last checkpoint)")
    evaluate.add_argument("--mix", action="append", default=[], metavar="ALPHA[@STEP]",
                          help="the weights (1 - ALPHA) * warm start + ALPHA * step STEP "
                               "(default: the last checkpoint)")
    evaluate.add_argument("--out", default=None,
                          help="output directory (default RUN_DIR/checkpoint_eval)")
    evaluate.set_defaults(func=_train_eval)
    demo = subparsers.add_parser(
        "demo", help="SFT then multi-turn GRPO on the built-in suite (2 CPU cores, "
                           "about 15 minutes), judged on held-out tasks")
    demo.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    demo.add_argument("--strict", action="store_true",
                      help="exit 1 when the demo misses a target (its held-out "
                           "margins, or 15 minutes of wall time)")
    demo.set_defaults(func=_demo)
    _joint_eval(subparsers)
