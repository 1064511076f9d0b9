"""Readers of a trace store: every valid attempt once, damaged records and segments skipped
and reported (see ``store`` for the layout, ``segments`` for the checks)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from tracerl.trace.codec import decode_attempt
from tracerl.trace.columnar import (
    TokenBatch,
    iter_list_rows,
    records_to_table,
    table_to_token_batch,
)
from tracerl.trace.framing import Damage, _Record, _warn, scan_log
from tracerl.trace.schema import Attempt
from tracerl.trace.segments import (
    _LOG,
    _SEGMENT,
    SEGMENTS_DIR,
    Quarantined,
    SegmentDamage,
    SegmentReader,
    _numbered,
)


def _table_records(table: pa.Table) -> Iterator[_Record]:
    headers = table.column("header").to_pylist()
    rows = zip(headers, iter_list_rows(table.column("layout")),
               iter_list_rows(table.column("token_ids")),
               iter_list_rows(table.column("action_logprobs")), strict=True)
    for text, layout, tokens, logprobs in rows:
        yield _Record(json.loads(text), text.encode(), layout, tokens, logprobs)


_RECORD_COLUMNS = ["header", "layout", "token_ids", "action_logprobs"]


def _segment_tables(root: Path, reader: SegmentReader, columns: list[str] | None,
                    logs_left: dict[int, Path]) -> Iterator[pa.Table]:
    """The tables of the checked segments, one at a time; ``logs_left`` is filled with the logs
    left to read: those not sealed, and the log of a damaged segment a crash left in place."""
    # Logs are listed before segments: a seal that finishes in between then shows up as a
    # segment whose log is skipped, never as neither.
    logs = _numbered(root, _LOG)
    segments = _numbered(root / SEGMENTS_DIR, _SEGMENT)
    logs_left.update((n, p) for n, p in logs.items() if n not in segments)
    for n, path in segments.items():
        table = reader.read(path, columns)
        if table is not None:
            yield table
        elif n in logs:
            logs_left[n] = logs[n]
    ordered = dict(sorted(logs_left.items()))
    logs_left.clear()
    logs_left.update(ordered)


def _scan_logs(root: Path, logs: dict[int, Path], reader: SegmentReader,
               columns: list[str] | None) -> tuple[list[list[_Record] | pa.Table], list[Damage]]:
    # Per log, in order: its valid records, or, when a seal finished and removed it after the
    # listing, the table of the segment that now holds them.
    parts: list[list[_Record] | pa.Table] = []
    damage: list[Damage] = []
    for n, path in logs.items():
        try:
            found, bad, _ = scan_log(path)
        except FileNotFoundError:
            segment = root / SEGMENTS_DIR / f"segment-{n:06d}.parquet"
            table = reader.read(segment, columns) if segment.exists() else None
            if table is not None:
                parts.append(table)
            continue
        parts.append(found)
        damage.extend(bad)
    return parts, damage


@dataclass(frozen=True)
class StoreScan:
    """Everything readable in a store directory, each attempt once."""

    records: tuple[_Record, ...]
    """Valid records: sealed segments first, then unsealed log records."""
    damage: tuple[Damage, ...]
    """Damaged ranges skipped in logs."""
    duplicates: tuple[str, ...]
    """Ids seen more than once (kept once; a writer never produces these)."""
    damaged_segments: tuple[SegmentDamage, ...] = ()
    """Sealed segments that failed their checksum (or are not Parquet) and were not read."""
    quarantined: tuple[Quarantined, ...] = ()
    """Segments a writer found damaged earlier and moved to ``quarantine/`` (from the
    manifest): their attempts are lost."""


def _root(directory: str | os.PathLike[str]) -> Path:
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"directory: {root} does not exist")
    return root


def scan_store(directory: str | os.PathLike[str], *, warn: bool = True) -> StoreScan:
    """Read every valid record of a store, skipping (and reporting) damaged ones."""
    root = _root(directory)
    reader = SegmentReader(root, warn=warn)
    logs: dict[int, Path] = {}
    records: list[_Record] = []
    for table in _segment_tables(root, reader, _RECORD_COLUMNS, logs):
        records.extend(_table_records(table))
    parts, damage = _scan_logs(root, logs, reader, _RECORD_COLUMNS)
    for part in parts:
        records.extend(_table_records(part) if isinstance(part, pa.Table) else part)
    if warn:
        _warn(damage)
    seen: set[str] = set()
    unique: list[_Record] = []
    duplicates: list[str] = []
    for record in records:
        attempt_id = record.header["id"]
        if attempt_id in seen:
            duplicates.append(attempt_id)
            continue
        seen.add(attempt_id)
        unique.append(record)
    return StoreScan(tuple(unique), tuple(damage), tuple(duplicates), tuple(reader.damaged),
                     reader.manifest.quarantined)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    # Decoding allocates ~40 acyclic objects per attempt; each allocation burst triggers the
    # cyclic collector, whose full passes walk every object the program holds (measured: 3x
    # slower reads in a process that keeps its attempts in memory). Nothing decoded here can
    # form a cycle, so collection is paused for the read and restored after.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_attempts(directory: str | os.PathLike[str]) -> list[Attempt]:
    """Every complete attempt in the store, once each (damaged records skipped with a warning)."""
    with _no_gc():
        return [decode_attempt(r.header, r.layout, r.tokens, r.logprobs)
                for r in scan_store(directory).records]


def read_table(directory: str | os.PathLike[str],
               columns: Sequence[str] | None = None) -> pa.Table:
    """The whole store as one Arrow table (sealed segments plus unsealed log records).

    Sealed segments are read column-wise as they are; only unsealed log records are converted.
    ``columns`` selects columns (default: all). Damaged segments are skipped with a warning.
    """
    root = _root(directory)
    wanted = None if columns is None else list(columns)
    if wanted is not None and "attempt_id" not in wanted:
        read_columns: list[str] | None = ["attempt_id", *wanted]
    else:
        read_columns = wanted
    reader = SegmentReader(root)
    logs: dict[int, Path] = {}
    tables = list(_segment_tables(root, reader, read_columns, logs))
    parts, damage = _scan_logs(root, logs, reader, read_columns)
    _warn(damage)
    tables.extend(p for p in parts if isinstance(p, pa.Table))
    sealed = {i for t in tables for i in t.column("attempt_id").to_pylist()}
    pending = [r for p in parts if not isinstance(p, pa.Table) for r in p
               if r.header["id"] not in sealed]
    if pending or not tables:
        extra = records_to_table(pending)
        if read_columns is not None:
            extra = extra.select(read_columns)
        tables.append(extra.cast(tables[0].schema) if tables else extra)
    table = pa.concat_tables(tables)
    return table if wanted is None else table.select(wanted)


def read_token_batches(directory: str | os.PathLike[str]) -> Iterator[TokenBatch]:
    """The columnar fast path: tokens, roles and logprobs of every attempt, one batch per
    sealed segment (plus one for unsealed log records), without building ``Attempt`` records.

    For trainers and packers that want flat arrays; :func:`read_attempts` gives the records.
    Damaged segments are skipped with a warning.
    """
    root = _root(directory)
    columns = ["attempt_id", "token_ids", "token_roles", "action_logprobs"]
    reader = SegmentReader(root)
    logs: dict[int, Path] = {}
    sealed: set[str] = set()
    for table in _segment_tables(root, reader, columns, logs):
        batch = table_to_token_batch(table)
        sealed.update(batch.attempt_ids)
        yield batch
    parts, damage = _scan_logs(root, logs, reader, columns)
    _warn(damage)
    for part in parts:
        if isinstance(part, pa.Table):
            batch = table_to_token_batch(part)
            sealed.update(batch.attempt_ids)
            yield batch
    pending = [r for p in parts if not isinstance(p, pa.Table) for r in p
               if r.header["id"] not in sealed]
    if pending:
        yield table_to_token_batch(records_to_table(pending))


def read_attempt(directory: str | os.PathLike[str], attempt_id: str) -> Attempt:
    """One attempt by id; ValueError if it is not in the store."""
    for record in scan_store(directory).records:
        if record.header["id"] == attempt_id:
            return decode_attempt(record.header, record.layout, record.tokens, record.logprobs)
    raise ValueError(f"attempt_id: {attempt_id!r} is not in {directory}")
