from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from tracerl.trace import EndReason, Role, TraceStore
from tracerl.trace.cli import register
from tracerl.trace.store import encode_record
from tracerl.trace.synthetic import synthetic_attempt


def run(argv: list[str]) -> int:
    # The trace subcommands on their own parser: the same registration tracerl.cli uses.
    parser = argparse.ArgumentParser(prog="tracerl")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def _store(path: Path) -> list[object]:
    rng = np.random.default_rng(0)
    attempts = [
        synthetic_attempt(rng, "a0", group_id="g0", total_tokens=80, turns=2, reward=0.0),
        synthetic_attempt(rng, "a1", group_id="g0", total_tokens=80, turns=2, reward=0.0),
        synthetic_attempt(rng, "a2", group_id="g1", total_tokens=80, turns=2, reward=1.0,
                          fragments=2, policy_version=3),
        synthetic_attempt(rng, "a3", group_id="g1", total_tokens=80, turns=2, reward=1.0),
        synthetic_attempt(rng, "a4", group_id="g2", total_tokens=80, turns=2, reward=None,
                          end=EndReason.TOOL_ERROR),
    ]
    with TraceStore(path) as store:
        store.append_many(attempts)
    return attempts


def test_stats_counts_endings_roles_groups_and_versions(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    attempts = _store(tmp_path)
    assert run(["traces", "stats", str(tmp_path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["attempts"] == 5
    assert stats["endings"] == {"terminated": 4, "tool_error": 1}
    actions = sum(len(s.token_ids) for a in attempts for f in a.fragments  # type: ignore[attr-defined]
                  for t in f.turns for s in t.segments if s.role is Role.ACTION)
    assert stats["tokens_by_role"]["action"] == actions
    assert stats["tokens_by_role"]["summary"] > 0
    assert stats["groups"]["uniform_all_zero"] == 1 and stats["groups"]["uniform_all_one"] == 1
    assert set(stats["action_tokens_by_policy_version"]) == {"0", "3"}
    assert stats["fragments_per_attempt"]["max"] == 2.0
    assert run(["traces", "stats", str(tmp_path)]) == 0
    assert "tool_error=1" in capsys.readouterr().out


def test_validate_passes_on_a_good_store(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _store(tmp_path)
    assert run(["traces", "validate", str(tmp_path)]) == 0
    assert "ok: 5 attempts" in capsys.readouterr().out


def _broken(kind: str) -> object:
    attempt = synthetic_attempt(np.random.default_rng(1), "bad", total_tokens=60, turns=2,
                                fragments=2)
    first, second = attempt.fragments
    if kind == "logprob count":
        turn = first.turns[0]
        action = turn.segments[1]
        segs = (turn.segments[0], dataclasses.replace(action, logprobs=action.logprobs[:-2]),
                *turn.segments[2:])
        first = dataclasses.replace(first, turns=(dataclasses.replace(turn, segments=segs),
                                                  *first.turns[1:]))
        return dataclasses.replace(attempt, fragments=(first, second))
    if kind == "one ending per attempt":
        return dataclasses.replace(attempt, fragments=(
            dataclasses.replace(first, end=EndReason.TIMEOUT), second))
    if kind == "fragment chain":
        return dataclasses.replace(attempt, fragments=(
            first, dataclasses.replace(second, index=2)))
    raise AssertionError(kind)


@pytest.mark.parametrize("rule", ["logprob count", "one ending per attempt", "fragment chain"])
def test_validate_names_the_record_and_the_broken_rule(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], rule: str) -> None:
    _store(tmp_path)
    # Written past the store's own checks, as a buggy or foreign writer would.
    log = tmp_path / "log-000099.trl"
    log.write_bytes(encode_record(_broken(rule)))  # type: ignore[arg-type]
    assert run(["traces", "validate", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"attempt 'bad': {rule}" in err
    assert "1 problems in 6 attempts" in err or "problems in 6 attempts" in err


def test_validate_reports_damaged_bytes(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    _store(tmp_path)
    (tmp_path / "log-000099.trl").write_bytes(b"\x00" * 40)
    assert run(["traces", "validate", str(tmp_path)]) == 1
    assert "log-000099.trl at byte 0: damaged record (bad magic)" in capsys.readouterr().err


def test_show_prints_roles_endings_and_rewards(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _store(tmp_path)
    assert run(["traces", "show", str(tmp_path), "a2"]) == 0
    out = capsys.readouterr().out
    for text in ("attempt a2", "ending: terminated", "reward: 1.0", "fragment 0 (ends continued)",
                 "[prompt", "[action", "v3 synthetic", "[observation", "[summary"):
        assert text in out, text
    with pytest.raises(ValueError, match="not in"):
        run(["traces", "show", str(tmp_path), "missing"])
