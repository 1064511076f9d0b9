"""``tracerl calc``: the core calculators from the command line.

``tracerl calc table``       mixed-group probability over success probabilities and group sizes
``tracerl calc group-size``  smallest group size giving a wanted fraction of mixed groups
``tracerl calc gae``         GAE of a short trajectory typed on the command line

Each prints a table a person can read, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tracerl.core.advantages import gae
from tracerl.core.probability import min_group_size_for_mixed, mixed_group_probability


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {text!r}") from None


def _ints(text: str, name: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None


def _flags(text: str | None, length: int, name: str) -> list[bool]:
    if text is None:
        return [False] * length
    flags = _ints(text, name)
    if any(flag not in (0, 1) for flag in flags):
        raise ValueError(f"{name} must be comma-separated 0/1 flags, got {text!r}")
    return [bool(flag) for flag in flags]


def _emit(payload: dict[str, Any], text: str, as_json: bool) -> int:
    print(json.dumps(payload) if as_json else text)
    return 0


def _table(args: argparse.Namespace) -> int:
    probabilities = _floats(args.p, "--p")
    sizes = _ints(args.group_sizes, "--group-sizes")
    rows = [
        {"p": p, "group_size": g, "mixed": mixed_group_probability(p, g)}
        for p in probabilities
        for g in sizes
    ]
    header = "p \\ G   " + "".join(f"{g:>8d}" for g in sizes)
    lines = [
        "Probability that a group has both a success and a failure, 1 - p^G - (1-p)^G",
        "(independent attempts, binary reward)",
        "",
        header,
    ]
    for p in probabilities:
        cells = "".join(f"{mixed_group_probability(p, g):>8.1%}" for g in sizes)
        lines.append(f"{p:<8.2%}{cells}")
    return _emit({"rows": rows}, "\n".join(lines), args.json)


def _group_size(args: argparse.Namespace) -> int:
    size = min_group_size_for_mixed(args.p, args.fraction)
    reached = mixed_group_probability(args.p, size)
    text = (
        f"At success probability {args.p:.2%}, a group of {size} attempts has both a success "
        f"and a failure with probability {reached:.1%} (wanted {args.fraction:.1%})."
    )
    payload = {"p": args.p, "wanted_fraction": args.fraction, "group_size": size, "mixed": reached}
    return _emit(payload, text, args.json)


def _gae(args: argparse.Namespace) -> int:
    rewards = _floats(args.rewards, "--rewards")
    values = _floats(args.values, "--values")
    next_values = _floats(args.next_values, "--next-values")
    terminated = _flags(args.terminated, len(rewards), "--terminated")
    truncated = _flags(args.truncated, len(rewards), "--truncated")
    advantages = gae(
        rewards,
        values,
        next_values,
        terminated,
        truncated,
        gamma=args.gamma,
        trace_decay=args.trace_decay,
    )
    lines = [
        f"gamma={args.gamma} trace_decay={args.trace_decay}",
        f"{'t':>3} {'reward':>8} {'V':>8} {'V_next':>8} {'end':>10} {'delta':>8} {'A':>8}",
    ]
    for t, advantage in enumerate(advantages):
        bootstrap = 0.0 if terminated[t] else next_values[t]
        delta = rewards[t] + args.gamma * bootstrap - values[t]
        end = "terminated" if terminated[t] else "truncated" if truncated[t] else ""
        lines.append(
            f"{t:>3} {rewards[t]:>8.3f} {values[t]:>8.3f} {next_values[t]:>8.3f} "
            f"{end:>10} {delta:>8.3f} {advantage:>8.3f}"
        )
    payload = {"gamma": args.gamma, "trace_decay": args.trace_decay, "advantages": advantages}
    return _emit(payload, "\n".join(lines), args.json)


def register(subparsers: Any) -> None:
    """Add ``calc`` to the ``tracerl`` parser."""
    calc = subparsers.add_parser("calc", help="mixed-group probabilities and GAE by hand")
    calc_sub = calc.add_subparsers(dest="calc_command", metavar="CALC", required=True)

    table = calc_sub.add_parser("table", help="mixed-group probability over p and G")
    table.add_argument(
        "--p",
        default="0.02,0.05,0.1,0.2,0.5,0.8,0.9,0.98",
        help="comma-separated success probabilities",
    )
    table.add_argument(
        "--group-sizes", default="2,4,8,16,32,64", help="comma-separated group sizes"
    )
    table.add_argument("--json", action="store_true", help="print JSON")
    table.set_defaults(func=_table)

    size = calc_sub.add_parser("group-size", help="smallest G for a wanted mixed fraction")
    size.add_argument("--p", type=float, required=True, help="success probability in [0, 1]")
    size.add_argument(
        "--fraction", type=float, required=True, help="wanted fraction of mixed groups in [0, 1)"
    )
    size.add_argument("--json", action="store_true", help="print JSON")
    size.set_defaults(func=_group_size)

    gae_parser = calc_sub.add_parser("gae", help="GAE of a short trajectory")
    gae_parser.add_argument("--rewards", required=True, help="comma-separated rewards")
    gae_parser.add_argument("--values", required=True, help="comma-separated V_t")
    gae_parser.add_argument(
        "--next-values", required=True, help="comma-separated value of the state after each step"
    )
    gae_parser.add_argument("--terminated", help="comma-separated 0/1: the task truly ended")
    gae_parser.add_argument("--truncated", help="comma-separated 0/1: cut off, task continues")
    gae_parser.add_argument("--gamma", type=float, default=1.0, help="discount in [0, 1]")
    gae_parser.add_argument("--trace-decay", type=float, default=1.0, help="GAE lambda in [0, 1]")
    gae_parser.add_argument("--json", action="store_true", help="print JSON")
    gae_parser.set_defaults(func=_gae)

