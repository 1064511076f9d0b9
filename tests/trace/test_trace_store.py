from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tracerl.trace import (
    SEGMENTS_DIR,
    Attempt,
    EndReason,
    TraceStore,
    TraceStoreWarning,
    read_attempts,
    read_table,
    scan_store,
)
from tracerl.trace.cli import validation_errors
from tracerl.trace.store import encode_record
from tracerl.trace.synthetic import synthetic_attempt


def make(i: int, tokens: int = 120) -> Attempt:
    ends = [EndReason.TERMINATED, EndReason.TRUNCATED_TOKENS, EndReason.TOOL_ERROR]
    return synthetic_attempt(
        np.random.default_rng(i), f"a{i}", task_id=f"t{i // 4}", group_id=f"g{i // 4}",
        total_tokens=tokens, turns=3, fragments=1 + i % 2, end=ends[i % 3],
        reward=None if i % 3 == 2 else float(i % 2), policy_version=i // 10,
    )


def test_round_trip_through_log_and_segments(tmp_path: Path) -> None:
    attempts = [make(i) for i in range(12)]
    with TraceStore(tmp_path, seal_every=5) as store:
        for a in attempts:
            assert store.append(a) is True
        store.wait_for_seal()  # sealing runs in the background
        assert len(list((tmp_path / SEGMENTS_DIR).glob("*.parquet"))) == 2
        # Two segments sealed, two attempts still only in the log: both are read.
        assert read_attempts(tmp_path) == attempts
        table = read_table(tmp_path)
        assert table.column("attempt_id").to_pylist() == [a.attempt_id for a in attempts]
    assert len(list((tmp_path / SEGMENTS_DIR).glob("*.parquet"))) == 3
    assert not list(tmp_path.glob("log-*.trl"))
    assert read_attempts(tmp_path) == attempts


def test_append_is_idempotent_by_attempt_id_across_restarts(tmp_path: Path) -> None:
    with TraceStore(tmp_path, seal_every=3) as store:
        assert store.append_many([make(0), make(1), make(0)]) == 2
        assert store.append(make(1)) is False
    with TraceStore(tmp_path, seal_on_close=False) as store:
        assert "a0" in store and len(store) == 2
        assert store.append(make(0)) is False
        assert store.append(make(2)) is True
    with TraceStore(tmp_path) as store:
        assert store.append(make(2)) is False
    assert [a.attempt_id for a in read_attempts(tmp_path)] == ["a0", "a1", "a2"]


def test_only_one_writer_at_a_time(tmp_path: Path) -> None:
    with TraceStore(tmp_path), pytest.raises(ValueError, match="another writer"):
        TraceStore(tmp_path)


def test_invalid_attempts_are_refused_before_writing(tmp_path: Path) -> None:
    bad = dataclasses.replace(make(0), reward=float("inf"))
    with TraceStore(tmp_path) as store, pytest.raises(ValueError, match=r"a0.*reward"):
        store.append(bad)
    assert read_attempts(tmp_path) == []


def _write_log(path: Path, attempts: list[Attempt]) -> list[int]:
    offsets, data = [], b""
    for a in attempts:
        offsets.append(len(data))
        data += encode_record(a)
    path.write_bytes(data)
    return offsets


def test_half_written_record_is_skipped_with_a_warning_and_cut_on_restart(
        tmp_path: Path) -> None:
    attempts = [make(i) for i in range(4)]
    log = tmp_path / "log-000001.trl"
    _write_log(log, attempts)
    full = log.read_bytes()
    log.write_bytes(full[: len(full) - 37])  # the last record lost its tail
    with pytest.warns(TraceStoreWarning, match="half-written"):
        assert [a.attempt_id for a in read_attempts(tmp_path)] == ["a0", "a1", "a2"]
    with pytest.warns(TraceStoreWarning), TraceStore(tmp_path, seal_on_close=False) as store:
        assert store.attempt_ids == {"a0", "a1", "a2"}
        assert store.append(attempts[3]) is True  # the lost attempt is written again, whole
    assert list((tmp_path / "quarantine").iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_attempts(tmp_path) == attempts


def test_corrupt_record_in_the_middle_is_skipped_and_the_rest_is_read(
        tmp_path: Path) -> None:
    attempts = [make(i) for i in range(4)]
    log = tmp_path / "log-000001.trl"
    offsets = _write_log(log, attempts)
    data = bytearray(log.read_bytes())
    data[offsets[1] + 200] ^= 0xFF  # a flipped bit inside record 1's payload
    log.write_bytes(bytes(data))
    with pytest.warns(TraceStoreWarning, match="payload checksum mismatch"):
        assert [a.attempt_id for a in read_attempts(tmp_path)] == ["a0", "a2", "a3"]
    count, errors = validation_errors(str(tmp_path))
    assert count == 3
    assert len(errors) == 1 and "payload checksum mismatch" in errors[0]
    assert f"at byte {offsets[1]}" in errors[0]
    # A damaged frame header: resynchronised on the next record's magic.
    data = bytearray(log.read_bytes())
    data[offsets[2] + 5] ^= 0xFF
    log.write_bytes(bytes(data))
    with pytest.warns(TraceStoreWarning) as caught:
        assert [a.attempt_id for a in read_attempts(tmp_path)] == ["a0", "a3"]
    assert any("frame checksum mismatch" in str(w.message) for w in caught)
    with pytest.warns(TraceStoreWarning), TraceStore(tmp_path) as store:
        assert store.attempt_ids == {"a0", "a3"}
    assert read_attempts(tmp_path) == [attempts[0], attempts[3]]


def test_garbage_and_unreadable_segments_give_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "log-000001.trl").write_bytes(b"not a trace log at all" * 3)
    with pytest.warns(TraceStoreWarning, match="bad magic"):
        assert read_attempts(tmp_path) == []
    segments = tmp_path / SEGMENTS_DIR
    segments.mkdir()
    (segments / "segment-000001.parquet").write_bytes(b"PAR1 broken")
    # A segment that is not Parquet is named and skipped, never decoded (the rest stays
    # readable; tests/trace/test_trace_segments.py covers checksums and quarantine).
    with pytest.warns(TraceStoreWarning) as caught:  # the log's bad magic is warned again
        assert read_attempts(tmp_path) == []
    assert any("segment-000001.parquet: damaged segment (not a readable Parquet"
               in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="does not exist"):
        read_attempts(tmp_path / "missing")


def test_crash_between_segment_rename_and_log_removal_counts_nothing_twice(
        tmp_path: Path) -> None:
    attempts = [make(i) for i in range(3)]
    with TraceStore(tmp_path, seal_on_close=False) as store:
        store.append_many(attempts)
        log_bytes = store._log_path.read_bytes()
        store.seal()
    # Recreate the state of a crash right after the rename: the sealed log is still there.
    (tmp_path / "log-000001.trl").write_bytes(log_bytes)
    assert scan_store(tmp_path).duplicates == ()
    assert read_attempts(tmp_path) == attempts
    with TraceStore(tmp_path) as store:
        assert len(store) == 3
    assert not (tmp_path / "log-000001.trl").exists()


def test_pandas_pyarrow_and_datasets_read_the_segments(tmp_path: Path) -> None:
    attempts = [make(i) for i in range(6)]
    with TraceStore(tmp_path) as store:
        store.append_many(attempts)
    import pandas as pd

    frame = pd.read_parquet(tmp_path / SEGMENTS_DIR)
    assert list(frame["attempt_id"]) == [a.attempt_id for a in attempts]
    assert list(frame["end_reason"]) == [a.end_reason.value for a in attempts]
    first = attempts[0]
    expected_ids = np.concatenate([s.token_ids for f in first.fragments for t in f.turns
                                   for s in t.segments])
    assert np.array_equal(np.asarray(frame["token_ids"][0]), expected_ids)
    assert frame["action_tokens"][0] == sum(
        len(s.token_ids) for f in first.fragments for t in f.turns for s in t.segments
        if s.role.value == "action")
    table = pq.read_table(tmp_path / SEGMENTS_DIR)
    assert table.num_rows == 6 and read_table(tmp_path).num_rows == 6
    import datasets

    ds = datasets.load_dataset(
        "parquet", data_files=str(tmp_path / SEGMENTS_DIR / "*.parquet"), split="train",
        cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 6 and ds[2]["attempt_id"] == "a2"
    assert ds[2]["token_ids"] == frame["token_ids"][2].tolist()


WRITER = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[3])
from test_trace_store import make
from tracerl.trace import TraceStore

with TraceStore(sys.argv[1], seal_every=int(sys.argv[2]), fsync=False) as store:
    for i in range(10_000):
        if store.append(make(i, tokens=400)):
            print(f"a{i}", flush=True)  # printed only once append has returned
"""


@pytest.mark.timeout(240)
def test_kill_9_mid_stream_then_resume_loses_and_doubles_nothing(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    here = str(Path(__file__).parent)
    rng = np.random.default_rng(1)
    acknowledged: set[str] = set()
    for round_ in range(2):
        wait_for = int(rng.integers(5, 60))
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(store_dir), str(3 + round_), here],
            stdout=subprocess.PIPE, text=True,
        )
        assert writer.stdout is not None
        for seen, line in enumerate(writer.stdout, start=1):
            acknowledged.add(line.strip())
            if seen >= wait_for:
                break
        os.kill(writer.pid, signal.SIGKILL)  # no cleanup, no close, no seal
        writer.wait()
        assert writer.returncode == -signal.SIGKILL
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceStoreWarning)  # a cut tail is expected
            scan = scan_store(store_dir)
            found = read_attempts(store_dir)
        ids = [a.attempt_id for a in found]
        assert scan.duplicates == ()
        assert len(ids) == len(set(ids)), "an attempt is present twice"
        assert acknowledged <= set(ids), "an acknowledged attempt was lost"
        for attempt in found:  # present means present whole and exact
            assert attempt == make(int(attempt.attempt_id[1:]), tokens=400)
        # Resume: the next writer recovers the store and continues without doubling.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceStoreWarning)
        with TraceStore(store_dir) as store:
            before = len(store)
            wanted = {f"a{i}" for i in range(before + 5)}
            already = len(store.attempt_ids & wanted)
            added = store.append_many([make(i, tokens=400) for i in range(before + 5)])
            assert added == len(wanted) - already  # stored ones are not written again
    count, errors = validation_errors(str(store_dir))
    assert errors == []
    final = read_attempts(store_dir)
    final_ids = [a.attempt_id for a in final]
    assert len(final_ids) == len(set(final_ids)) == count
    assert {f"a{i}" for i in range(before + 5)} <= set(final_ids)
