"""The store's fast paths: cheap pre-checks, background sealing, columnar reads, codecs."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tracerl.trace import (
    ROLES,
    SEGMENTS_DIR,
    Attempt,
    EndReason,
    Role,
    TraceStore,
    TraceStoreWarning,
    check_attempt,
    read_attempts,
    read_token_batches,
    scan_store,
)
from tracerl.trace.cli import validation_errors
from tracerl.trace.codec import encode_attempt, header_to_bytes
from tracerl.trace.store import _frame, encode_record
from tracerl.trace.synthetic import synthetic_attempt


def make(i: int, fragments: int = 2) -> Attempt:
    return synthetic_attempt(np.random.default_rng(i), f"a{i}", task_id=f"t{i // 2}",
                             group_id=f"t{i // 2}", total_tokens=80, turns=4,
                             fragments=fragments, end=EndReason.TRUNCATED_TURNS,
                             reward=float(i % 2), policy_version=i)


def _replace_segment(attempt: Attempt, f: int, t: int, s: int, **changes: object) -> Attempt:
    fragment = attempt.fragments[f]
    turn = fragment.turns[t]
    segs = list(turn.segments)
    segs[s] = dataclasses.replace(segs[s], **changes)  # type: ignore[arg-type]
    turns = list(fragment.turns)
    turns[t] = dataclasses.replace(turn, segments=tuple(segs))
    frags = list(attempt.fragments)
    frags[f] = dataclasses.replace(fragment, turns=tuple(turns))
    return dataclasses.replace(attempt, fragments=tuple(frags))


def _replace_fragment(attempt: Attempt, f: int, **changes: object) -> Attempt:
    frags = list(attempt.fragments)
    frags[f] = dataclasses.replace(frags[f], **changes)  # type: ignore[arg-type]
    return dataclasses.replace(attempt, fragments=tuple(frags))


def _with_turn(attempt: Attempt, f: int, t: int, **changes: object) -> Attempt:
    fragment = attempt.fragments[f]
    turns = list(fragment.turns)
    turns[t] = dataclasses.replace(turns[t], **changes)  # type: ignore[arg-type]
    return _replace_fragment(attempt, f, turns=tuple(turns))


BREAKERS: dict[str, Callable[[Attempt], Attempt]] = {
    "empty id": lambda a: dataclasses.replace(a, attempt_id=""),
    "no fragment": lambda a: dataclasses.replace(a, fragments=()),
    "reward nan": lambda a: dataclasses.replace(a, reward=math.nan),
    "component inf": lambda a: dataclasses.replace(a, rewards={"x": math.inf}),
    "index gap": lambda a: _replace_fragment(a, 1, index=3),
    "early ending": lambda a: _replace_fragment(a, 0, end=EndReason.TIMEOUT),
    "last continued": lambda a: _replace_fragment(a, 1, end=EndReason.CONTINUED),
    "continuation mid-chain": lambda a: _replace_fragment(a, 0, continuation_ids=[1, 2]),
    "starts with action": lambda a: _with_turn(
        a, 0, 0, segments=a.fragments[0].turns[0].segments[1:]),
    "process reward nan": lambda a: _with_turn(a, 0, 0, process_reward=math.nan),
    "process reward without action": lambda a: _with_turn(
        a, 0, 0, segments=a.fragments[0].turns[0].segments[:1], process_reward=1.0),
    "missing logprobs": lambda a: _replace_segment(a, 0, 0, 1, logprobs=None),
    "short logprobs": lambda a: _replace_segment(
        a, 0, 0, 1, logprobs=a.fragments[0].turns[0].segments[1].logprobs[:-1]),
    "no sampling": lambda a: _replace_segment(a, 0, 0, 1, sampling=None),
    "no version": lambda a: _replace_segment(a, 0, 0, 1, policy_version=None),
    "no engine": lambda a: _replace_segment(a, 0, 0, 1, engine=""),
    "observation with logprobs": lambda a: _replace_segment(a, 0, 0, 2, logprobs=[-1.0] *
                                                            len(a.fragments[0].turns[0]
                                                                .segments[2].token_ids)),
    "observation with version": lambda a: _replace_segment(a, 0, 0, 2, policy_version=1),
}


@pytest.mark.parametrize("name", list(BREAKERS))
def test_cheap_precheck_flags_every_attempt_the_full_check_rejects(name: str) -> None:
    broken = BREAKERS[name](make(0))
    assert check_attempt(broken, check_values=False), name  # the mutation breaks a rule
    assert encode_attempt(broken)[4] is True  # so the store runs the full check


def test_valid_attempts_pass_the_precheck_and_round_trip_exactly(tmp_path: Path) -> None:
    attempts = [make(i, fragments=1 + i % 3) for i in range(6)]
    attempts.append(_with_turn(make(9), 0, 1, process_reward=0.25))
    for a in attempts:
        assert check_attempt(a) == [] and encode_attempt(a)[4] is False
    with TraceStore(tmp_path, fsync=False) as store:
        assert store.append_many(attempts) == len(attempts)
    assert read_attempts(tmp_path) == attempts


def test_broken_records_keep_their_fault_for_validate(tmp_path: Path) -> None:
    # A foreign writer can store what TraceStore refuses; decoding must not hide the fault.
    broken = BREAKERS["observation with logprobs"](make(0))
    with TraceStore(tmp_path) as store, pytest.raises(ValueError, match="roles"):
        store.append(broken)
    (tmp_path / "log-000099.trl").write_bytes(encode_record(broken))
    _, errors = validation_errors(str(tmp_path))
    assert len(errors) == 1 and "attempt 'a0': roles:" in errors[0]


def test_a_record_whose_layout_lies_is_damage_not_data(tmp_path: Path) -> None:
    header, layout, tokens, logprobs, _ = encode_attempt(make(0))
    bad = layout.copy()
    bad[3 + 4 * int(layout[0]) + int(layout[1])] = 7  # a role code that does not exist
    (tmp_path / "log-000001.trl").write_bytes(_frame(header_to_bytes(header), bad, tokens,
                                                     logprobs))
    with pytest.warns(TraceStoreWarning, match="undecodable payload"):
        assert read_attempts(tmp_path) == []


def test_background_seal_keeps_order_and_counts_each_attempt_once(tmp_path: Path) -> None:
    attempts = [make(i) for i in range(10)]
    with TraceStore(tmp_path, fsync=False, seal_every=3) as store:
        for a in attempts:
            store.append(a)
            scan = scan_store(tmp_path)  # readers never see an attempt twice or not at all
            assert scan.duplicates == ()
            assert [r.header["id"] for r in scan.records] == [
                x.attempt_id for x in attempts[: len(store)]]
    names = sorted(p.name for p in (tmp_path / SEGMENTS_DIR).iterdir())
    assert names == [f"segment-00000{i}.parquet" for i in range(1, 5)]
    assert read_attempts(tmp_path) == attempts


def test_crash_during_a_background_seal_is_resealed_on_restart(tmp_path: Path) -> None:
    attempts = [make(i) for i in range(5)]
    with TraceStore(tmp_path, fsync=False, seal_on_close=False) as store:
        store.append_many(attempts[:3])
        first_log = store._log_path.read_bytes()
        store.append_many(attempts[3:])
    # The state a kill leaves mid-seal: log 1 not yet sealed, log 2 already receiving appends,
    # and a half-written segment under its temporary name.
    (tmp_path / "log-000001.trl").rename(tmp_path / "log-000002.trl")
    (tmp_path / "log-000001.trl").write_bytes(first_log)
    (tmp_path / "log-000002.trl").write_bytes(
        b"".join(encode_record(a) for a in attempts[3:]))
    (tmp_path / SEGMENTS_DIR / ".segment-000001.tmp").write_bytes(b"PAR1 half")
    assert [a.attempt_id for a in read_attempts(tmp_path)] == [a.attempt_id for a in attempts]
    with TraceStore(tmp_path, fsync=False, seal_on_close=False) as store:
        assert len(store) == 5
        assert (tmp_path / SEGMENTS_DIR / "segment-000001.parquet").exists()
        assert not (tmp_path / "log-000001.trl").exists()
        assert store.append(make(7)) is True
    assert read_attempts(tmp_path) == [*attempts, make(7)]
    assert validation_errors(str(tmp_path)) == (6, [])


def test_a_failed_background_seal_is_reported_and_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tracerl.trace.store as store_module

    def broken_table(records: object) -> object:
        raise OSError("disk full")

    attempts = [make(i) for i in range(4)]
    store = TraceStore(tmp_path, fsync=False, seal_every=2)
    with monkeypatch.context() as patch:
        patch.setattr(store_module, "records_to_table", broken_table)
        store.append_many(attempts[:2])  # starts a seal that fails in the background
        with pytest.raises(OSError, match="safe in the log"):
            store.seal()
        store.close()
    assert read_attempts(tmp_path) == attempts[:2]  # still in the log
    with TraceStore(tmp_path, fsync=False) as reopened:
        reopened.append_many(attempts[2:])
    assert read_attempts(tmp_path) == attempts
    assert not list(tmp_path.glob("log-*.trl"))


def test_token_batches_match_the_records_sealed_and_unsealed(tmp_path: Path) -> None:
    attempts = [make(i) for i in range(7)]
    with TraceStore(tmp_path, fsync=False, seal_every=4, seal_on_close=False) as store:
        store.append_many(attempts[:4])
        store.seal()
        store.append_many(attempts[4:])
    batches = list(read_token_batches(tmp_path))
    assert [len(b) for b in batches] == [4, 3]  # one sealed segment, then the log
    rows = [(b, i) for b in batches for i in range(len(b))]
    for attempt, (batch, i) in zip(attempts, rows, strict=True):
        assert batch.attempt_ids[i] == attempt.attempt_id
        segs = [s for f in attempt.fragments for t in f.turns for s in t.segments]
        conts = [f.continuation_ids for f in attempt.fragments]
        lo, hi = batch.token_offsets[i], batch.token_offsets[i + 1]
        assert np.array_equal(batch.token_ids[lo:hi],
                              np.concatenate([*(s.token_ids for s in segs), *conts]))
        roles = np.concatenate([np.full(len(s.token_ids), ROLES.index(s.role)) for s in segs])
        assert np.array_equal(batch.token_roles[lo:hi][: len(roles)], roles)
        action = [s.logprobs for s in segs if s.role is Role.ACTION]
        lp = batch.logprobs[batch.logprob_offsets[i] : batch.logprob_offsets[i + 1]]
        assert np.array_equal(lp, np.concatenate(action))
        assert not batch.token_ids.flags.writeable


def test_zstd_segments_and_bad_compression(tmp_path: Path) -> None:
    attempts = [make(i) for i in range(3)]
    with TraceStore(tmp_path, compression="zstd") as store:
        store.append_many(attempts)
    frame = pd.read_parquet(tmp_path / SEGMENTS_DIR)
    assert list(frame["attempt_id"]) == ["a0", "a1", "a2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_attempts(tmp_path) == attempts
    with pytest.raises(ValueError, match="compression"):
        TraceStore(tmp_path / "other", compression="gzip")  # type: ignore[arg-type]
