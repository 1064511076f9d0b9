"""``tracerl train CONFIG [key=value ...]`` and the demo (``tracerl demo``)."""

from __future__ import annotations

import argparse
import json
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
                      help="exit 1 when the demo misses its held-out targets")
    demo.set_defaults(func=_demo)
