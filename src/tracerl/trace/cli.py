"""``tracerl traces``: statistics, validation and inspection of a trace store."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tracerl.trace.codec import (
    NO_VERSION,
    decode_attempt,
    end_reason,
    layout_segments,
    role_counts,
)
from tracerl.trace.schema import ROLES, Role, check_attempt
from tracerl.trace.segments import Quarantined, load_manifest
from tracerl.trace.store import scan_store

_ROLE_STYLE = {
    Role.PROMPT: "bold blue",
    Role.ACTION: "bold green",
    Role.OBSERVATION: "yellow",
    Role.SUMMARY: "magenta",
}


def register(subparsers: Any) -> None:
    """Add ``traces stats|validate|show``."""
    parser = subparsers.add_parser("traces", help="inspect and validate a trace store")
    sub = parser.add_subparsers(dest="traces_command", metavar="SUBCOMMAND", required=True)
    stats = sub.add_parser("stats", help="attempts by ending, tokens by role, groups, costs")
    stats.add_argument("directory", metavar="DIR")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(func=_stats)
    validate = sub.add_parser("validate", help="check segment checksums, schema and invariants; "
                              "exit 1 if broken")
    validate.add_argument("directory", metavar="DIR")
    validate.set_defaults(func=_validate)
    show = sub.add_parser("show", help="one attempt's turns, roles, endings and rewards")
    show.add_argument("directory", metavar="DIR")
    show.add_argument("attempt_id", metavar="ATTEMPT_ID")
    show.add_argument("--tokenizer", help="a tokenizer.json file to decode token ids to text")
    show.add_argument("--max-tokens", type=int, default=32,
                      help="token ids shown per segment when not decoding (default 32)")
    show.set_defaults(func=_show)


def store_stats(directory: str) -> dict[str, Any]:
    """The statistics ``traces stats`` prints, as a dict."""
    scan = scan_store(directory, warn=False)
    endings: Counter[str] = Counter()
    tokens_by_role: Counter[str] = Counter()
    versions: Counter[int] = Counter()
    horizons: list[int] = []
    turns: list[int] = []
    tool_calls: list[int] = []
    fragments: list[int] = []
    groups: dict[str, list[float]] = defaultdict(list)
    generated = 0
    tool_seconds = 0.0
    for record in scan.records:
        h = record.header
        endings[end_reason(record.layout).value] += 1
        counts = role_counts(record.layout)
        for role, n in counts.items():
            tokens_by_role[role.value] += n
        horizons.append(sum(counts.values()))
        fragments.append(int(record.layout[0]))
        segs = layout_segments(record.layout)
        for role, n, version in zip(segs[0].tolist(), segs[1].tolist(), segs[3].tolist(),
                                    strict=True):
            if ROLES[role] is Role.ACTION and version != NO_VERSION:
                versions[version] += n
        gen, seconds, calls, n_turns = h["costs"]
        generated += gen
        tool_seconds += seconds
        tool_calls.append(calls)
        turns.append(n_turns)
        if h["reward"] is not None:
            groups[h["group"]].append(h["reward"])
    uniform_zero = sum(1 for r in groups.values() if len(r) > 1 and all(x == 0 for x in r))
    uniform_one = sum(1 for r in groups.values() if len(r) > 1 and all(x == 1 for x in r))
    uniform_other = sum(
        1 for r in groups.values() if len(r) > 1 and len(set(r)) == 1 and r[0] not in (0, 1)
    )
    return {
        "attempts": len(scan.records),
        "damaged_ranges": len(scan.damage),
        "damaged_segments": len(scan.damaged_segments),
        "quarantined_segments": len(scan.quarantined),
        "lost_attempts": sum(q.attempts or 0 for q in scan.quarantined)
        + sum(d.attempts or 0 for d in scan.damaged_segments),
        "endings": dict(sorted(endings.items())),
        "tokens_by_role": {role.value: tokens_by_role[role.value] for role in ROLES},
        "horizon_tokens": _summary(horizons),
        "turns": _summary(turns),
        "tool_calls": _summary(tool_calls),
        "fragments_per_attempt": _summary(fragments),
        "action_tokens_by_policy_version": {str(k): v for k, v in sorted(versions.items())},
        "groups": {
            "scored_groups": len(groups),
            "singletons": sum(1 for r in groups.values() if len(r) == 1),
            "uniform_all_zero": uniform_zero,
            "uniform_all_one": uniform_one,
            "uniform_other": uniform_other,
            "mixed": sum(1 for r in groups.values() if len(r) > 1 and len(set(r)) > 1),
        },
        "costs": {
            "generated_tokens": generated,
            "tool_seconds": round(tool_seconds, 3),
            "tool_calls": sum(tool_calls),
        },
    }


def _summary(values: list[int]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "max": 0.0}
    return {
        "mean": round(statistics.fmean(values), 2),
        "median": float(statistics.median(values)),
        "max": float(max(values)),
    }


def _stats(args: argparse.Namespace) -> int:
    stats = store_stats(args.directory)
    if args.json:
        print(json.dumps(stats))
        return 0
    skipped = [f"{stats[key]} {key.replace('_', ' ')}" for key in
               ("damaged_ranges", "damaged_segments", "quarantined_segments", "lost_attempts")
               if stats[key]]
    print(f"{stats['attempts']} attempts in {args.directory}"
          + (f" ({', '.join(skipped)})" if skipped else ""))
    for section in ("endings", "tokens_by_role", "horizon_tokens", "turns", "tool_calls",
                    "fragments_per_attempt", "action_tokens_by_policy_version", "groups",
                    "costs"):
        values = ", ".join(f"{k}={v}" for k, v in stats[section].items())
        print(f"  {section.replace('_', ' ')}: {values or '-'}")
    return 0


def validation_errors(directory: str) -> tuple[int, list[str]]:
    """(attempts checked, one message per broken rule naming the record or the segment)."""
    scan = scan_store(directory, warn=False)
    errors = [damage.message() for damage in scan.damaged_segments]
    errors += [
        f"{d.path} at byte {d.offset}: damaged record ({d.reason}), {d.length} bytes skipped"
        for d in scan.damage
    ]
    errors.extend(
        f"attempt {attempt_id!r}: one record per attempt: stored more than once"
        for attempt_id in scan.duplicates
    )
    for record in scan.records:
        name = record.header.get("id")
        try:
            attempt = decode_attempt(record.header, record.layout, record.tokens,
                                     record.logprobs)
        except (ValueError, KeyError, IndexError, TypeError) as error:
            errors.append(f"attempt {name!r}: schema: {error}")
            continue
        errors.extend(f"attempt {name!r}: {problem}" for problem in check_attempt(attempt))
    return len(scan.records), errors


def quarantined_segments(directory: str) -> tuple[Quarantined, ...]:
    """Segments a writer found damaged and moved to ``quarantine/`` (from the manifest)."""
    return load_manifest(Path(directory)).quarantined


def _validate(args: argparse.Namespace) -> int:
    checked, errors = validation_errors(args.directory)
    for error in errors:
        print(error, file=sys.stderr)
    if errors:
        print(f"{len(errors)} problems in {checked} attempts", file=sys.stderr)
        return 1
    print(f"ok: {checked} attempts, every segment's checksum and every invariant holds")
    # Segments a writer quarantined earlier: the store is consistent, but they were lost.
    for entry in quarantined_segments(args.directory):
        held = "" if entry.attempts is None else f", {entry.attempts} attempts lost"
        print(f"note: {entry.segment} was quarantined ({entry.reason}{held}); "
              f"it is in {entry.moved_to}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text

    from tracerl.trace.store import read_attempt

    attempt = read_attempt(args.directory, args.attempt_id)
    decode = None
    if args.tokenizer:
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(args.tokenizer)
        except Exception as error:  # the tokenizers library raises its own exception type
            raise ValueError(f"--tokenizer: cannot load {args.tokenizer}: {error}") from error
        decode = tokenizer.decode
    console = Console(highlight=False)
    console.print(Text(f"attempt {attempt.attempt_id}", style="bold"),
                  f" task={attempt.task_id} group={attempt.group_id}")
    console.print(f"ending: {attempt.end_reason.value}   reward: {attempt.reward}   "
                  f"rewards: {dict(attempt.rewards)}")
    if attempt.verifier is not None:
        console.print(f"verifier: passed={attempt.verifier.passed} score={attempt.verifier.score}"
                      f" {dict(attempt.verifier.details)}")
    if attempt.audit is not None:
        console.print(f"audit: {attempt.audit}")
    console.print(f"costs: {attempt.costs}")
    _show_joint(console, attempt.metadata)
    for fragment in attempt.fragments:
        console.print(Text(f"-- fragment {fragment.index} (ends {fragment.end.value})",
                           style="bold"))
        for t, turn in enumerate(fragment.turns):
            reward = "" if turn.process_reward is None else f" process reward {turn.process_reward}"
            console.print(Text(f"  turn {t}{reward}", style="dim"))
            for seg in turn.segments:
                ids = seg.token_ids.tolist()
                if decode is not None:
                    body = decode(ids, skip_special_tokens=False)
                else:
                    shown = ids[: args.max_tokens]
                    body = " ".join(map(str, shown)) + (" ..." if len(ids) > len(shown) else "")
                label = f"    [{seg.role.value} {len(ids)} tok"
                if seg.agent is not None:
                    label += f", agent {seg.agent}"
                if seg.role is Role.ACTION:
                    label += f", v{seg.policy_version} {seg.engine}"
                line = Text(label + "] ", style=_ROLE_STYLE[seg.role])
                line.append(body)
                console.print(line)
        if len(fragment.continuation_ids):
            console.print(f"  continuation: {len(fragment.continuation_ids)} tokens")
    return 0


def _show_joint(console: Any, metadata: Mapping[str, Any]) -> None:
    """The agent, its policy and the joint attempt's record, for an agent's attempt."""
    if "agent" not in metadata:
        return
    console.print(f"agent: {metadata['agent']}   policy: {metadata.get('policy')}")
    joint = metadata.get("joint")
    if not isinstance(joint, Mapping):
        return
    console.print(f"joint attempt: {joint.get('id')}   rewards: {joint.get('rewards')}")
    for name, info in dict(joint.get("agents", {})).items():
        console.print(f"  {name}: policy {info.get('policy')}, version "
                      f"{info.get('version_start')} at start, {info.get('version_end')} at "
                      f"end, {info.get('actions')} actions")
    order = " ".join(f"{agent}:{turn}" for agent, turn in joint.get("order", []))
    console.print(f"  turns in order: {order}")
