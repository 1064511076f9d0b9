"""Append-only, crash-safe storage of finished attempts.

A store is a directory::

    DIR/log-000003.trl            append log of attempts not yet sealed
    DIR/segments/segment-000001.parquet   sealed, immutable Parquet segments
    DIR/segments/segment-000002.parquet
    DIR/quarantine/                copies of logs in which damaged bytes were found
    DIR/LOCK                       held (flock) by the one writer

Each log record is framed as ``magic (4) | payload length (u32) | payload crc32 (u32) |
frame crc32 (u32) | payload``, little-endian; the payload is a JSON header followed by the
attempt's token ids (int32) and action logprobs (float32) as raw bytes (see ``codec``). An
attempt is durable when :meth:`TraceStore.append` returns: written to the OS (survives the
process being killed), and with ``fsync=True`` also on disk (survives power loss). A record
whose frame or payload checksum fails is never decoded: readers skip it with a warning and
resynchronise on the next magic. Sealing writes a Parquet segment to a temporary name, fsyncs
it, renames it into place and only then removes the log, so a crash at any point leaves every
attempt readable exactly once (a log whose segment already exists is redundant and ignored).
pandas, pyarrow and datasets read ``DIR/segments`` directly.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import struct
import warnings
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tracerl.trace.codec import decode_attempt, encode_attempt, end_reason, header_to_bytes
from tracerl.trace.schema import ROLES, Attempt, Role, check_attempt

MAGIC = b"TRL\x01"
_FRAME = struct.Struct("<4sIII")  # magic, payload length, payload crc32, frame crc32
_U32 = struct.Struct("<I")
_LOG = re.compile(r"^log-(\d{6})\.trl$")
_SEGMENT = re.compile(r"^segment-(\d{6})\.parquet$")
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
    tokens: np.ndarray
    logprobs: np.ndarray


def _frame(header_bytes: bytes, tokens: np.ndarray, logprobs: np.ndarray) -> bytes:
    payload = b"".join((_U32.pack(len(header_bytes)), header_bytes,
                        tokens.astype("<i4").tobytes(), logprobs.astype("<f4").tobytes()))
    payload_crc = zlib.crc32(payload)
    frame_crc = zlib.crc32(struct.pack("<4sII", MAGIC, len(payload), payload_crc))
    return _FRAME.pack(MAGIC, len(payload), payload_crc, frame_crc) + payload


def encode_record(attempt: Attempt) -> bytes:
    """One framed log record for an attempt (no validation: see ``TraceStore.append``)."""
    header, tokens, logprobs = encode_attempt(attempt)
    return _frame(header_to_bytes(header), tokens, logprobs)


def _decode_payload(payload: bytes) -> _Record:
    (n_header,) = _U32.unpack_from(payload, 0)
    header_bytes = payload[4 : 4 + n_header]
    header = json.loads(header_bytes)
    start = 4 + n_header
    n_tokens, n_logprobs = header["n_tokens"], header["n_logprobs"]
    if len(payload) != start + 4 * n_tokens + 4 * n_logprobs:
        raise ValueError("payload length does not match its header")
    tokens = np.frombuffer(payload, dtype="<i4", count=n_tokens, offset=start)
    logprobs = np.frombuffer(payload, dtype="<f4", count=n_logprobs, offset=start + 4 * n_tokens)
    return _Record(header, header_bytes, tokens, logprobs)


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
                    except (ValueError, KeyError, TypeError) as error:
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
    reads every sealed id and the valid records of the log, removes logs whose segment was
    already written, and cuts a half-written tail off the log (a copy of the damaged log is
    kept in ``quarantine/`` first, with a warning).
    """

    def __init__(self, directory: str | os.PathLike[str], *, fsync: bool = True,
                 seal_every: int = 1000, seal_on_close: bool = True) -> None:
        if seal_every < 1:
            raise ValueError(f"seal_every: must be >= 1, got {seal_every}")
        self.directory = Path(directory)
        self.fsync = fsync
        """fsync after every append (power-loss safe); False: written to the OS only."""
        self.seal_every = seal_every
        """Seal the log into a Parquet segment once it holds this many attempts."""
        self.seal_on_close = seal_on_close
        """Seal what the log holds when the store is closed."""
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
        number = max([*segments, *logs, 0]) + 1
        for n, path in logs.items():
            records, damage, good_end = scan_log(path)
            if n in segments:
                # Crash after the segment's rename, before the log's removal: the segment has
                # every record of this log, so the log is redundant.
                path.unlink()
                continue
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
            self._pending.extend(fresh)
            number = n
        self._number = number
        self._log_path = self.directory / f"log-{number:06d}.trl"

    def _rewrite_log(self, path: Path, records: list[_Record], good_end: int,
                     truncated_only: bool) -> None:
        if truncated_only:
            with open(path, "r+b") as f:
                f.truncate(good_end)
                os.fsync(f.fileno())
            return
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            for record in records:
                f.write(_frame(record.header_bytes, record.tokens, record.logprobs))
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
        frames: list[bytes] = []
        new: list[_Record] = []
        seen: set[str] = set()
        for attempt in attempts:
            if attempt.attempt_id in self._ids or attempt.attempt_id in seen:
                continue
            # Structure per segment; logprob values once on the concatenated array (a check
            # per segment costs more than the rest of the write). Token ids were range-checked
            # when the immutable segments were built.
            problems = check_attempt(attempt, check_values=False)
            header, tokens, logprobs = encode_attempt(attempt)
            if not bool(np.all(np.isfinite(logprobs) & (logprobs <= 0.0))):
                problems.append("logprob range: a behavior logprob is > 0 or not finite")
            if problems:
                raise ValueError(f"attempt {attempt.attempt_id!r}: " + "; ".join(problems))
            header_bytes = header_to_bytes(header)
            frames.append(_frame(header_bytes, tokens, logprobs))
            new.append(_Record(header, header_bytes, tokens, logprobs))
            seen.add(attempt.attempt_id)
        if not frames:
            return 0
        self._log.write(b"".join(frames))
        self._log.flush()
        if self.fsync:
            os.fsync(self._log.fileno())
        self._ids.update(seen)
        self._pending.extend(new)
        if len(self._pending) >= self.seal_every:
            self.seal()
        return len(frames)

    def seal(self) -> Path | None:
        """Move the log's attempts into a new Parquet segment; returns its path (None if empty)."""
        if not self._pending:
            return None
        segments = self.directory / SEGMENTS_DIR
        final = segments / f"segment-{self._number:06d}.parquet"
        tmp = segments / f".segment-{self._number:06d}.tmp"
        # Dictionary encoding of token columns costs 5x the write time for no gain (ids are
        # high-entropy); byte-stream-split lets zstd compress float32 logprobs.
        pq.write_table(records_to_table(self._pending), tmp, compression="zstd",
                       compression_level=1, use_dictionary=["task_id", "group_id", "end_reason"],
                       use_byte_stream_split=["action_logprobs.list.element"])
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(segments)
        # From here the segment holds every record; the log is redundant and can go.
        self._log.close()
        self._log_path.unlink()
        _fsync_dir(self.directory)
        self._pending = []
        self._number += 1
        self._log_path = self.directory / f"log-{self._number:06d}.trl"
        self._log = open(self._log_path, "ab")  # noqa: SIM115 (held until close)
        return final

    def close(self) -> None:
        """Seal (if ``seal_on_close``), close the log and release the writer lock."""
        if self._lock.closed:
            return
        if self.seal_on_close:
            self.seal()
        self._log.close()
        if self._log_path.exists() and self._log_path.stat().st_size == 0:
            self._log_path.unlink()
        fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
        self._lock.close()


# -- columnar form ----------------------------------------------------------------------------

_ROLE_CODES = {role: np.int8(i) for i, role in enumerate(ROLES)}


def records_to_table(records: Sequence[_Record]) -> pa.Table:
    """One row per attempt: summary columns for pandas, plus the exact header and arrays."""
    tokens = np.concatenate([r.tokens for r in records]) if records else np.zeros(0, np.int32)
    logprobs = (np.concatenate([r.logprobs for r in records]) if records
                else np.zeros(0, np.float32))
    token_offsets = np.zeros(len(records) + 1, dtype=np.int32)
    token_offsets[1:] = np.cumsum([len(r.tokens) for r in records])
    lp_offsets = np.zeros(len(records) + 1, dtype=np.int32)
    lp_offsets[1:] = np.cumsum([len(r.logprobs) for r in records])
    role_codes: list[np.ndarray] = []
    columns: dict[str, list[Any]] = {name: [] for name in (
        "attempt_id", "task_id", "group_id", "end_reason", "reward", "num_fragments",
        "prompt_tokens", "action_tokens", "observation_tokens", "summary_tokens",
        "generated_tokens", "tool_seconds", "tool_calls", "turns", "header")}
    for r in records:
        h = r.header
        codes = [spec[0] for spec in h["segments"]]
        lengths = [spec[1] for spec in h["segments"]]
        n_context = len(r.tokens) - sum(lengths)
        role_codes.append(np.repeat(np.array([*codes, -1], dtype=np.int8),
                                    np.array([*lengths, n_context], dtype=np.int64)))
        counts = dict.fromkeys(ROLES, 0)
        for code, length in zip(codes, lengths, strict=True):
            counts[ROLES[code]] += length
        columns["attempt_id"].append(h["id"])
        columns["task_id"].append(h["task"])
        columns["group_id"].append(h["group"])
        columns["end_reason"].append(end_reason(h).value)
        columns["reward"].append(h["reward"])
        columns["num_fragments"].append(len(h["fragments"]))
        for role in ROLES:
            columns[f"{role.value}_tokens"].append(counts[role])
        generated, tool_seconds, tool_calls, turns = h["costs"]
        columns["generated_tokens"].append(generated)
        columns["tool_seconds"].append(float(tool_seconds))
        columns["tool_calls"].append(tool_calls)
        columns["turns"].append(turns)
        columns["header"].append(r.header_bytes.decode())
    roles = np.concatenate(role_codes) if role_codes else np.zeros(0, np.int8)
    arrays = {
        "attempt_id": pa.array(columns["attempt_id"], pa.string()),
        "task_id": pa.array(columns["task_id"], pa.string()),
        "group_id": pa.array(columns["group_id"], pa.string()),
        "end_reason": pa.array(columns["end_reason"], pa.string()),
        "reward": pa.array(columns["reward"], pa.float64()),
        "num_fragments": pa.array(columns["num_fragments"], pa.int32()),
        **{f"{role.value}_tokens": pa.array(columns[f"{role.value}_tokens"], pa.int64())
           for role in ROLES},
        "generated_tokens": pa.array(columns["generated_tokens"], pa.int64()),
        "tool_seconds": pa.array(columns["tool_seconds"], pa.float64()),
        "tool_calls": pa.array(columns["tool_calls"], pa.int64()),
        "turns": pa.array(columns["turns"], pa.int64()),
        # Every token in sequence order (continuation ids last), and its role as an index
        # into ROLES (-1 for continuation ids): pandas users can mask without the header.
        "token_ids": pa.ListArray.from_arrays(pa.array(token_offsets), pa.array(tokens)),
        "token_roles": pa.ListArray.from_arrays(pa.array(token_offsets), pa.array(roles)),
        "action_logprobs": pa.ListArray.from_arrays(pa.array(lp_offsets), pa.array(logprobs)),
        "header": pa.array(columns["header"], pa.string()),
    }
    return pa.table(arrays)


def _table_records(table: pa.Table) -> Iterator[_Record]:
    headers = table.column("header").to_pylist()
    token_col = table.column("token_ids").combine_chunks()
    lp_col = table.column("action_logprobs").combine_chunks()
    tokens = token_col.values.to_numpy(zero_copy_only=False)
    token_offsets = token_col.offsets.to_numpy()
    logprobs = lp_col.values.to_numpy(zero_copy_only=False)
    lp_offsets = lp_col.offsets.to_numpy()
    for i, text in enumerate(headers):
        yield _Record(
            json.loads(text),
            text.encode(),
            tokens[token_offsets[i] : token_offsets[i + 1]],
            logprobs[lp_offsets[i] : lp_offsets[i + 1]],
        )


# -- reading ----------------------------------------------------------------------------------


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
    segments = _numbered(root / SEGMENTS_DIR, _SEGMENT)
    logs = _numbered(root, _LOG)
    records: list[_Record] = []
    damage: list[Damage] = []
    for path in segments.values():
        try:
            table = pq.read_table(path)
        except (OSError, pa.ArrowException) as error:
            raise ValueError(f"{path}: not a readable Parquet segment: {error}") from error
        records.extend(_table_records(table))
    for n, path in logs.items():
        if n in segments:
            continue  # redundant: sealed already, removed by the next writer
        found, bad, _ = scan_log(path)
        records.extend(found)
        damage.extend(bad)
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


def read_attempts(directory: str | os.PathLike[str]) -> list[Attempt]:
    """Every complete attempt in the store, once each (damaged records skipped with a warning)."""
    return [decode_attempt(r.header, r.tokens, r.logprobs)
            for r in scan_store(directory).records]


def read_table(directory: str | os.PathLike[str]) -> pa.Table:
    """The whole store as one Arrow table (sealed segments plus unsealed log records).

    Sealed segments are read column-wise as they are; only unsealed log records are converted.
    """
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"directory: {root} does not exist")
    segments = _numbered(root / SEGMENTS_DIR, _SEGMENT)
    tables = []
    for path in segments.values():
        try:
            tables.append(pq.read_table(path))
        except (OSError, pa.ArrowException) as error:
            raise ValueError(f"{path}: not a readable Parquet segment: {error}") from error
    sealed = {i for t in tables for i in t.column("attempt_id").to_pylist()}
    pending: list[_Record] = []
    damage: list[Damage] = []
    for n, path in _numbered(root, _LOG).items():
        if n in segments:
            continue
        found, bad, _ = scan_log(path)
        pending.extend(r for r in found if r.header["id"] not in sealed)
        damage.extend(bad)
    _warn(damage)
    if pending or not tables:
        tables.append(records_to_table(pending).cast(tables[0].schema) if tables
                      else records_to_table(pending))
    return pa.concat_tables(tables)


def read_attempt(directory: str | os.PathLike[str], attempt_id: str) -> Attempt:
    """One attempt by id; ValueError if it is not in the store."""
    for record in scan_store(directory).records:
        if record.header["id"] == attempt_id:
            return decode_attempt(record.header, record.tokens, record.logprobs)
    raise ValueError(f"attempt_id: {attempt_id!r} is not in {directory}")


def role_of_code(code: int) -> Role | None:
    """The role a ``token_roles`` code stands for (None for -1: continuation ids)."""
    return None if code < 0 else ROLES[code]

