"""The ``tracerl`` command line.

Each area of the package owns its subcommands in its own ``cli`` module, which exposes
``register(subparsers)``; this file only lists those modules. A subcommand's handler is
stored as ``func`` on the parsed namespace and returns the process exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that add subcommands, in the order they appear in ``tracerl --help``.
COMMAND_MODULES: tuple[str, ...] = (
    "tracerl.core.cli",
    "tracerl.trace.cli",
    "tracerl.envs.cli",
    "tracerl.eval.cli",
    "tracerl.rollout.cli",
    "tracerl.train.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tracerl",
        description="Reinforcement learning for multi-turn LLM agents, with explicit accounting.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except ValueError as error:
        # Bad input is reported as one clear line, not a traceback.
        print(f"tracerl {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
