"""Sealed segments are checksummed: a damaged one is named, never decoded, and quarantined by the
next writer, while the rest of the store stays readable and writable."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from tracerl.trace import SEGMENTS_DIR, Attempt, TraceStore, TraceStoreWarning, read_attempts
from tracerl.trace.cli import register, store_stats, validation_errors
from tracerl.trace.reading import read_table, read_token_batches, scan_store
from tracerl.trace.segments import MANIFEST
from tracerl.trace.synthetic import synthetic_attempt


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tracerl")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def make(i: int) -> Attempt:
    return synthetic_attempt(np.random.default_rng(i), f"a{i}", task_id=f"t{i // 2}",
                             group_id=f"g{i // 2}", total_tokens=150, turns=3, reward=float(i % 2))


def three_segments(directory: Path) -> list[Attempt]:
    """A store of three sealed segments of 4 attempts each."""
    attempts = [make(i) for i in range(12)]
    with TraceStore(directory, seal_every=4) as store:
        store.append_many(attempts[:4])
        store.wait_for_seal()
        store.append_many(attempts[4:8])
        store.wait_for_seal()
        store.append_many(attempts[8:])
    return attempts


def segment(directory: Path, n: int) -> Path:
    return directory / SEGMENTS_DIR / f"segment-{n:06d}.parquet"


def overwrite_16_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2  # inside the column data, away from the header and the footer
    data[middle:middle + 16] = bytes(16)
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def test_every_sealed_segment_has_its_sha256_in_the_manifest(tmp_path: Path) -> None:
    three_segments(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert sorted(manifest["segments"]) == [segment(tmp_path, n).name for n in (1, 2, 3)]
    for name, record in manifest["segments"].items():
        data = (tmp_path / SEGMENTS_DIR / name).read_bytes()
        assert record == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                          "attempts": 4}
    assert manifest["quarantined"] == []
    assert validation_errors(str(tmp_path)) == (12, [])


@pytest.mark.parametrize("damage", [overwrite_16_bytes, truncate], ids=["16_bytes", "truncated"])
def test_a_damaged_segment_is_named_skipped_quarantined_and_the_store_goes_on(
        tmp_path: Path, damage: object, capsys: pytest.CaptureFixture[str]) -> None:
    attempts = three_segments(tmp_path)
    bad = segment(tmp_path, 2)
    damage(bad)  # type: ignore[operator]
    kept = attempts[:4] + attempts[8:]

    # Readers: the segment is named, never decoded; the others are read whole and exact.
    with pytest.warns(TraceStoreWarning, match=r"segment-000002\.parquet: damaged segment .*"
                                               r"its 4 attempts are not read"):
        assert read_attempts(tmp_path) == kept
    with pytest.warns(TraceStoreWarning, match="segment-000002"):
        assert read_table(tmp_path).column("attempt_id").to_pylist() == [
            a.attempt_id for a in kept]
    with pytest.warns(TraceStoreWarning, match="segment-000002"):
        assert sum(len(b.attempt_ids) for b in read_token_batches(tmp_path)) == 8

    # validate exits 1 and names the segment.
    assert run(["traces", "validate", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "segment-000002.parquet: damaged segment" in err
    assert "4 attempts are not read" in err

    # The next writer quarantines it, reports the lost attempts, and appends after it.
    with pytest.warns(TraceStoreWarning, match=r"segment-000002\.parquet: damaged segment .*"
                                               r"moved to quarantine/.*its 4 attempts are lost"):
        store = TraceStore(tmp_path, seal_every=4)
    with store:
        (entry,) = store.quarantined
        assert entry.segment == "segment-000002.parquet" and entry.attempts == 4
        assert (tmp_path / entry.moved_to).is_file() and not bad.exists()
        assert store.attempt_ids == {a.attempt_id for a in kept}
        # The lost attempts are not in the store, so a resumed run collects them again.
        assert "a5" not in store
        assert store.append_many([*attempts[4:8], make(12)]) == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing damaged is left in the store
        again = read_attempts(tmp_path)
    assert sorted(a.attempt_id for a in again) == sorted(
        a.attempt_id for a in [*attempts, make(12)])
    assert {a.attempt_id: a for a in again}["a5"] == attempts[5]
    # The new segment took a fresh number: a name always means one segment.
    assert not segment(tmp_path, 2).exists() and segment(tmp_path, 4).exists()

    assert run(["traces", "validate", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "note: segment-000002.parquet was quarantined" in out and "4 attempts lost" in out
    stats = store_stats(str(tmp_path))
    assert stats["quarantined_segments"] == 1 and stats["lost_attempts"] == 4
    assert stats["attempts"] == 13


def test_a_damaged_segment_whose_log_survived_a_crash_is_rebuilt_from_the_log(
        tmp_path: Path) -> None:
    attempts = [make(i) for i in range(3)]
    with TraceStore(tmp_path, seal_on_close=False) as store:
        store.append_many(attempts)
    log = tmp_path / "log-000001.trl"
    saved = log.read_bytes()
    with TraceStore(tmp_path):
        pass  # sealed on close
    log.write_bytes(saved)  # as if the crash came between the segment's rename and log removal
    overwrite_16_bytes(segment(tmp_path, 1))
    with pytest.warns(TraceStoreWarning, match="segment-000001"):
        assert read_attempts(tmp_path) == attempts  # read from the log instead
    with pytest.warns(TraceStoreWarning, match="moved to quarantine"), TraceStore(tmp_path):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_attempts(tmp_path) == attempts
    assert validation_errors(str(tmp_path)) == (3, [])


def test_a_store_written_before_checksums_opens_and_gets_them(tmp_path: Path) -> None:
    attempts = three_segments(tmp_path)
    (tmp_path / MANIFEST).unlink()  # segments as an older version wrote them
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_attempts(tmp_path) == attempts  # read unchecked, no complaint
    # A segment of an old store that does not decode is still caught (as not Parquet).
    truncate(segment(tmp_path, 3))
    with pytest.warns(TraceStoreWarning, match=r"segment-000003.*not a readable Parquet"):
        assert read_attempts(tmp_path) == attempts[:8]
    # The first writer checks the old segments whole, records their checksums, and
    # quarantines the one that does not decode (its attempt count was never recorded).
    with pytest.warns(TraceStoreWarning, match="segment-000003"), TraceStore(tmp_path) as store:
        assert [q.attempts for q in store.quarantined] == [None]
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert sorted(manifest["segments"]) == ["segment-000001.parquet", "segment-000002.parquet"]
    overwrite_16_bytes(segment(tmp_path, 1))  # from now on, damage is caught by the checksum
    with pytest.warns(TraceStoreWarning, match="segment-000001.*sha256 mismatch"):
        assert read_attempts(tmp_path) == attempts[4:8]


def test_a_damaged_manifest_is_kept_aside_and_rebuilt(tmp_path: Path) -> None:
    attempts = three_segments(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.warns(TraceStoreWarning, match="not a readable manifest"):
        assert read_attempts(tmp_path) == attempts
    with pytest.warns(TraceStoreWarning, match="not a readable manifest"), TraceStore(tmp_path):
        pass
    assert list((tmp_path / "quarantine").glob(f"{MANIFEST}.*.damaged"))
    assert len(json.loads((tmp_path / MANIFEST).read_text())["segments"]) == 3
    assert scan_store(tmp_path).damaged_segments == ()
