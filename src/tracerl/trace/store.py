"""Append-only, crash-safe storage of finished attempts.

A store is a directory::

    DIR/log-000003.trl            append log of attempts not yet sealed
    DIR/segments/segment-000001.parquet   sealed, immutable Parquet segments
    DIR/segments/segment-000002.parquet
    DIR/quarantine/                copies of logs in which damaged bytes were found
    DIR/LOCK                       held (flock) by the one writer

Each log record is framed as ``magic (4) | payload length (u32) | payload crc32 (u32) |
frame crc32 (u32) | payload``, little-endian; the payload is a JSON header, the attempt's
layout (int64), token ids (int32) and logprobs (float32) as raw bytes (see ``codec``). An
attempt is durable when :meth:`TraceStore.append` returns: written to the OS (survives the
process being killed), and with ``fsync=True`` also on disk (survives power loss). A record
whose frame or payload checksum fails is never decoded: readers skip it with a warning and
resynchronise on the next magic. Sealing closes the log, starts the next one, and writes the
closed log as the segment of the same number in a background thread: to a temporary name,
fsynced, renamed into place, and only then the log removed, so a crash at any point leaves
every attempt readable exactly once (a log whose segment already exists is redundant and
ignored; a writer that finds two logs seals the older one first).
pandas, pyarrow and datasets read ``DIR/segments`` directly.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import re
import shutil
import struct
import threading
import warnings
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tracerl.trace.codec import check_sizes, decode_attempt, encode_attempt, header_to_bytes
from tracerl.trace.columnar import (
    TokenBatch,
    iter_list_rows,
    records_to_table,
    table_to_token_batch,
)
from tracerl.trace.schema import Attempt, check_attempt

MAGIC = b"TRL\x01"
_FRAME = struct.Struct("<4sIII")  # magic, payload length, payload crc32, frame crc32
_U32 = struct.Struct("<I")
_LOG = re.compile(r"^log-(\d{6})\.trl$")
_SEGMENT = re.compile(r"^segment-(\d{6})\.parquet$")
Compression = Literal["lz4", "zstd", "snappy", "none"]
COMPRESSIONS: tuple[str, ...] = ("lz4", "zstd", "snappy", "none")
"""Parquet codecs a store can seal with (every reader named in the docs handles them)."""
SEGMENTS_DIR = "segments"
"""Sub-directory of sealed Parquet segments (point pandas / datasets here)."""


class TraceStoreWarning(UserWarning):
    """A damaged or half-written record was found and skipped."""


@dataclass(frozen=True)
class Damage:
    """A byte range of a log that did not hold a valid record."""

    path: str
    """The log file."""
    offset: int
    """Byte offset where the damage starts."""
    length: int
    """Number of bytes skipped."""
    reason: str
    """What was wrong (truncated frame, checksum mismatch, ...)."""


@dataclass(frozen=True)
class _Record:
    header: dict[str, Any]
    header_bytes: bytes
    layout: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray


def _frame(header_bytes: bytes, layout: np.ndarray, tokens: np.ndarray,
           logprobs: np.ndarray) -> bytes:
    # The arrays go in as buffers (no tobytes copies); one crc32 over the joined payload.
    payload = b"".join((_U32.pack(len(header_bytes)), header_bytes, _U32.pack(len(layout)),
                        layout.astype("<i8", copy=False).data,
                        tokens.astype("<i4", copy=False).data,
                        logprobs.astype("<f4", copy=False).data))
    payload_crc = zlib.crc32(payload)
    frame_crc = zlib.crc32(struct.pack("<4sII", MAGIC, len(payload), payload_crc))
    return _FRAME.pack(MAGIC, len(payload), payload_crc, frame_crc) + payload


def encode_record(attempt: Attempt) -> bytes:
    """One framed log record for an attempt (no validation: see ``TraceStore.append``)."""
    header, layout, tokens, logprobs, _ = encode_attempt(attempt)
    return _frame(header_to_bytes(header), layout, tokens, logprobs)


def _decode_payload(payload: bytes) -> _Record:
    (n_header,) = _U32.unpack_from(payload, 0)
    header_bytes = payload[4 : 4 + n_header]
    header = json.loads(header_bytes)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    (n_layout,) = _U32.unpack_from(payload, 4 + n_header)
    start = 8 + n_header
    n_tokens, n_logprobs = header["n_tokens"], header["n_logprobs"]
    if len(payload) != start + 8 * n_layout + 4 * n_tokens + 4 * n_logprobs:
        raise ValueError("payload length does not match its header")
    layout = np.frombuffer(payload, dtype="<i8", count=n_layout, offset=start)
    start += 8 * n_layout
    tokens = np.frombuffer(payload, dtype="<i4", count=n_tokens, offset=start)
    logprobs = np.frombuffer(payload, dtype="<f4", count=n_logprobs, offset=start + 4 * n_tokens)
    check_sizes(header, layout, n_tokens, n_logprobs)
    return _Record(header, header_bytes, layout, tokens, logprobs)


def scan_log(path: Path) -> tuple[list[_Record], list[Damage], int]:
    """Valid records of a log, the damaged ranges, and the end offset of the last valid record."""
    data = path.read_bytes()
    records: list[_Record] = []
    damage: list[Damage] = []
    pos = good_end = 0
    size = len(data)
    while pos < size:
        problem = None
        if size - pos < _FRAME.size:
            problem = "truncated frame (half-written record)"
        else:
            magic, length, payload_crc, frame_crc = _FRAME.unpack_from(data, pos)
            if magic != MAGIC:
                problem = "bad magic"
            elif zlib.crc32(data[pos : pos + 12]) != frame_crc:
                problem = "frame checksum mismatch"
            elif pos + _FRAME.size + length > size:
                problem = "truncated payload (half-written record)"
            else:
                payload = data[pos + _FRAME.size : pos + _FRAME.size + length]
                if zlib.crc32(payload) != payload_crc:
                    problem = "payload checksum mismatch"
                else:
                    try:
                        records.append(_decode_payload(payload))
                    except (ValueError, KeyError, TypeError, struct.error) as error:
                        problem = f"undecodable payload ({error})"
        if problem is None:
            pos += _FRAME.size + length
            good_end = pos
            continue
        # Resynchronise on the next magic: a damaged record in the middle must not hide the
        # valid records after it.
        found = data.find(MAGIC, pos + 1)
        next_pos = size if found < 0 else found
        damage.append(Damage(str(path), pos, next_pos - pos, problem))
        pos = next_pos
    return records, damage, good_end


def _warn(damage: Iterable[Damage]) -> None:
    for d in damage:
        warnings.warn(
            f"{d.path}: skipped {d.length} bytes at offset {d.offset}: {d.reason}; "
            "the record is not read",
            TraceStoreWarning,
            stacklevel=3,
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _numbered(directory: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    if not directory.is_dir():
        return {}
    found = {}
    for entry in directory.iterdir():
        match = pattern.match(entry.name)
        if match:
            found[int(match.group(1))] = entry
    return dict(sorted(found.items()))


class TraceStore:
    """The one writer of a store directory (use as a context manager).

    ``append`` is idempotent by attempt id: an id already in the store (sealed or in the log)
    is not written again and ``append`` returns False. On opening, the store recovers: it
    reads every sealed id and the valid records of the logs, removes logs whose segment was
    already written, seals logs a crash left unsealed, and cuts a half-written tail off the
    log (a copy of the damaged log is kept in ``quarantine/`` first, with a warning).

    Sealing runs in a background thread: the full log is closed, a new one started, and the
    attempts are written to Parquet while appends go on. The closed log stays the durable
    record until its segment is renamed into place. At most one seal is in flight; the next
    waits for it, so at most two logs exist at any time.
    """

    def __init__(self, directory: str | os.PathLike[str], *, fsync: bool = True,
                 seal_every: int = 1000, seal_on_close: bool = True,
                 compression: Compression = "lz4") -> None:
        if seal_every < 1:
            raise ValueError(f"seal_every: must be >= 1, got {seal_every}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression: must be one of {COMPRESSIONS}, got {compression!r}")
        self.directory = Path(directory)
        self.fsync = fsync
        """fsync after every append (power-loss safe); False: written to the OS only."""
        self.seal_every = seal_every
        """Seal the log into a Parquet segment once it holds this many attempts."""
        self.seal_on_close = seal_on_close
        """Seal what the log holds when the store is closed."""
        self.compression = compression
        """Parquet compression of sealed segments."""
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / SEGMENTS_DIR).mkdir(exist_ok=True)
        self._lock = open(self.directory / "LOCK", "a+b")  # noqa: SIM115 (held until close)
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            self._lock.close()
            raise ValueError(f"directory: {self.directory} is open by another writer") from error
        self._ids: set[str] = set()
        self._pending: list[_Record] = []
        self._sealer: threading.Thread | None = None
        self._seal_error: BaseException | None = None
        self.recovered_damage: list[Damage] = []
        """Damaged ranges found (and quarantined) when the store was opened."""
        self._recover()
        self._log = open(self._log_path, "ab")  # noqa: SIM115 (held until close)

    # -- recovery ---------------------------------------------------------------------------

    def _recover(self) -> None:
        segments = _numbered(self.directory / SEGMENTS_DIR, _SEGMENT)
        for path in segments.values():
            ids = pq.read_table(path, columns=["attempt_id"]).column(0).to_pylist()
            self._ids.update(ids)
        for tmp in (self.directory / SEGMENTS_DIR).glob(".segment-*.tmp"):
            tmp.unlink()  # a seal that crashed before its rename; the log still holds the data
        logs = _numbered(self.directory, _LOG)
        unsealed: list[tuple[int, Path, list[_Record]]] = []
        for n, path in logs.items():
            if n in segments:
                # Crash after the segment's rename, before the log's removal: the segment has
                # every record of this log, so the log is redundant.
                path.unlink()
                continue
            records, damage, good_end = scan_log(path)
            if damage:
                quarantine = self.directory / "quarantine"
                quarantine.mkdir(exist_ok=True)
                shutil.copyfile(path, quarantine / f"{path.name}.{os.getpid()}.damaged")
                _warn(damage)
                self.recovered_damage.extend(damage)
                # Rewrite the log with only its valid records, so appends never follow garbage.
                trailing = all(d.offset >= good_end for d in damage)
                self._rewrite_log(path, records, good_end, truncated_only=trailing)
            fresh = [r for r in records if r.header["id"] not in self._ids]
            self._ids.update(r.header["id"] for r in fresh)
            unsealed.append((n, path, fresh))
        # A crash during a background seal leaves two logs: the older one is sealed now, so
        # segment n always holds exactly log n and appends go to the newest log only.
        for n, path, records in unsealed[:-1]:
            self._write_segment(n, records, path)
        if unsealed:
            self._number, self._log_path, self._pending = unsealed[-1]
        else:
            self._number = max([*segments, *logs, 0]) + 1
            self._log_path = self.directory / f"log-{self._number:06d}.trl"

    def _rewrite_log(self, path: Path, records: list[_Record], good_end: int,
                     truncated_only: bool) -> None:
        if truncated_only:
            with open(path, "r+b") as f:
                f.truncate(good_end)
                os.fsync(f.fileno())
            return
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            for r in records:
                f.write(_frame(r.header_bytes, r.layout, r.tokens, r.logprobs))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.directory)

    # -- writing ----------------------------------------------------------------------------

    def __contains__(self, attempt_id: object) -> bool:
        return attempt_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def attempt_ids(self) -> frozenset[str]:
        """Ids of every attempt in the store (sealed or logged)."""
        return frozenset(self._ids)

    def append(self, attempt: Attempt) -> bool:
        """Record one finished attempt; True if written, False if its id was already stored."""
        return self.append_many([attempt]) == 1

    def append_many(self, attempts: Sequence[Attempt]) -> int:
        """Record several attempts with one flush (and fsync); returns how many were new."""
        if self._log.closed:
            raise ValueError("store: closed")
        self._raise_seal_error()
        frames: list[bytes] = []
        new: list[_Record] = []
        seen: set[str] = set()
        for attempt in attempts:
            if attempt.attempt_id in self._ids or attempt.attempt_id in seen:
                continue
            header, layout, tokens, logprobs, suspect = encode_attempt(attempt)
            # The encoder's cheap structural checks clear almost every attempt; the full
            # check (with its messages) runs only for the rest. Logprob values are checked
            # once on the concatenated array. Token ids were range-checked when the
            # immutable segments were built.
            problems = check_attempt(attempt, check_values=False) if suspect else []
            if logprobs.size and not (logprobs.max() <= 0.0 and logprobs.min() > -np.inf):
                problems.append("logprob range: a behavior logprob is > 0 or not finite")
            if problems:
                raise ValueError(f"attempt {attempt.attempt_id!r}: " + "; ".join(problems))
            header_bytes = header_to_bytes(header)
            frames.append(_frame(header_bytes, layout, tokens, logprobs))
            new.append(_Record(header, header_bytes, layout, tokens, logprobs))
            seen.add(attempt.attempt_id)
        if not frames:
            return 0
        self._log.write(b"".join(frames) if len(frames) > 1 else frames[0])
        self._log.flush()
        if self.fsync:
            os.fsync(self._log.fileno())
        self._ids.update(seen)
        self._pending.extend(new)
        if len(self._pending) >= self.seal_every:
            self.seal(wait=False)
        return len(frames)

    def seal(self, *, wait: bool = True) -> Path | None:
        """Move the log's attempts into a new Parquet segment; returns its path (None if empty).

        ``wait=False`` writes the segment in a background thread (the log stays the durable
        record until the segment is in place); ``wait=True`` returns once it is written.
        """
        if self._log.closed:
            raise ValueError("store: closed")
        self._join_sealer()
        if not self._pending:
            return None
        number, records, log_path = self._number, self._pending, self._log_path
        # Rotate first: appends continue in the next log while this one is sealed.
        self._log.close()
        self._pending = []
        self._number += 1
        self._log_path = self.directory / f"log-{self._number:06d}.trl"
        self._log = open(self._log_path, "ab")  # noqa: SIM115 (held until close)
        if wait:
            return self._write_segment(number, records, log_path)
        self._sealer = threading.Thread(target=self._seal_job, args=(number, records, log_path),
                                        name=f"tracerl-seal-{number}", daemon=True)
        self._sealer.start()
        return self.directory / SEGMENTS_DIR / f"segment-{number:06d}.parquet"

    def wait_for_seal(self) -> None:
        """Return once a background seal in flight has written its segment (or raise its
        error)."""
        self._join_sealer()

    def _seal_job(self, number: int, records: list[_Record], log_path: Path) -> None:
        try:
            self._write_segment(number, records, log_path)
        except BaseException as error:  # handed to the writer's thread, never lost
            self._seal_error = error

    def _join_sealer(self) -> None:
        if self._sealer is not None:
            self._sealer.join()
            self._sealer = None
        self._raise_seal_error()

    def _raise_seal_error(self) -> None:
        error, self._seal_error = self._seal_error, None
        if error is not None:
            raise OSError(f"store: sealing a segment failed ({error}); its attempts are safe "
                          "in the log and are sealed when the store is reopened") from error

    def _write_segment(self, number: int, records: list[_Record], log_path: Path) -> Path:
        segments = self.directory / SEGMENTS_DIR
        final = segments / f"segment-{number:06d}.parquet"
        tmp = segments / f".segment-{number:06d}.tmp"
        if records:
            # Dictionary encoding of token columns costs 5x the write time for no gain (ids
            # are high-entropy); byte-stream-split lets the codec compress float32 logprobs.
            # lz4 by default: zstd saves ~30 % of the bytes but halves read speed.
            pq.write_table(records_to_table(records), tmp, compression=self.compression,
                           use_dictionary=["task_id", "group_id", "end_reason", "token_roles"],
                           use_byte_stream_split=["action_logprobs.list.element"])
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(segments)
        # From here the segment holds every record; the log is redundant and can go.
        log_path.unlink()
        _fsync_dir(self.directory)
        return final

    def close(self) -> None:
        """Seal (if ``seal_on_close``), close the log and release the writer lock."""
        if self._lock.closed:
            return
        try:
            if self.seal_on_close:
                self.seal(wait=True)
            else:
                self._join_sealer()
        finally:
            self._log.close()
            if self._log_path.exists() and self._log_path.stat().st_size == 0:
                self._log_path.unlink()
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
            self._lock.close()


def _table_records(table: pa.Table) -> Iterator[_Record]:
    headers = table.column("header").to_pylist()
    rows = zip(headers, iter_list_rows(table.column("layout")),
               iter_list_rows(table.column("token_ids")),
               iter_list_rows(table.column("action_logprobs")), strict=True)
    for text, layout, tokens, logprobs in rows:
        yield _Record(json.loads(text), text.encode(), layout, tokens, logprobs)


# -- reading ----------------------------------------------------------------------------------

_RECORD_COLUMNS = ["header", "layout", "token_ids", "action_logprobs"]


def _read_segment(path: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns, memory_map=True)
    except (OSError, pa.ArrowException) as error:
        raise ValueError(f"{path}: not a readable Parquet segment: {error}") from error


def _unsealed_logs(root: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    # Logs are listed before segments: a seal that finishes in between then shows up as a
    # segment whose log is skipped, never as neither.
    logs = _numbered(root, _LOG)
    segments = _numbered(root / SEGMENTS_DIR, _SEGMENT)
    return segments, {n: p for n, p in logs.items() if n not in segments}


def _scan_logs(root: Path, logs: dict[int, Path]) -> tuple[list[list[_Record] | Path],
                                                          list[Damage]]:
    # Per log, in order: its valid records, or, when a seal finished and removed it after the
    # listing, the path of the segment that now holds them.
    parts: list[list[_Record] | Path] = []
    damage: list[Damage] = []
    for n, path in logs.items():
        try:
            found, bad, _ = scan_log(path)
        except FileNotFoundError:
            segment = root / SEGMENTS_DIR / f"segment-{n:06d}.parquet"
            if segment.exists():
                parts.append(segment)
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


def scan_store(directory: str | os.PathLike[str], *, warn: bool = True) -> StoreScan:
    """Read every valid record of a store, skipping (and reporting) damaged ones."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"directory: {root} does not exist")
    segments, logs = _unsealed_logs(root)
    records: list[_Record] = []
    for path in segments.values():
        records.extend(_table_records(_read_segment(path, _RECORD_COLUMNS)))
    parts, damage = _scan_logs(root, logs)
    for part in parts:
        records.extend(_table_records(_read_segment(part, _RECORD_COLUMNS))
                       if isinstance(part, Path) else part)
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
    return StoreScan(tuple(unique), tuple(damage), tuple(duplicates))


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
    ``columns`` selects columns (default: all).
    """
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"directory: {root} does not exist")
    segments, logs = _unsealed_logs(root)
    wanted = None if columns is None else list(columns)
    if wanted is not None and "attempt_id" not in wanted:
        read_columns: list[str] | None = ["attempt_id", *wanted]
    else:
        read_columns = wanted
    tables = [_read_segment(path, read_columns) for path in segments.values()]
    parts, damage = _scan_logs(root, logs)
    _warn(damage)
    tables.extend(_read_segment(p, read_columns) for p in parts if isinstance(p, Path))
    sealed = {i for t in tables for i in t.column("attempt_id").to_pylist()}
    pending = [r for p in parts if not isinstance(p, Path) for r in p
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
    """
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"directory: {root} does not exist")
    segments, logs = _unsealed_logs(root)
    sealed: set[str] = set()
    columns = ["attempt_id", "token_ids", "token_roles", "action_logprobs"]
    for path in segments.values():
        batch = table_to_token_batch(_read_segment(path, columns))
        sealed.update(batch.attempt_ids)
        yield batch
    parts, damage = _scan_logs(root, logs)
    _warn(damage)
    for part in parts:
        if isinstance(part, Path):
            batch = table_to_token_batch(_read_segment(part, columns))
            sealed.update(batch.attempt_ids)
            yield batch
    pending = [r for p in parts if not isinstance(p, Path) for r in p
               if r.header["id"] not in sealed]
    if pending:
        yield table_to_token_batch(records_to_table(pending))


def read_attempt(directory: str | os.PathLike[str], attempt_id: str) -> Attempt:
    """One attempt by id; ValueError if it is not in the store."""
    for record in scan_store(directory).records:
        if record.header["id"] == attempt_id:
            return decode_attempt(record.header, record.layout, record.tokens, record.logprobs)
    raise ValueError(f"attempt_id: {attempt_id!r} is not in {directory}")
