"""Append-only, crash-safe storage of finished attempts.

A store is a directory::

    DIR/log-000003.trl            append log of attempts not yet sealed
    DIR/segments/segment-000001.parquet   sealed, immutable Parquet segments
    DIR/segments/segment-000002.parquet
    DIR/manifest.json              sha256, size and attempts of each sealed segment
    DIR/quarantine/                copies of damaged logs, damaged segments moved aside
    DIR/LOCK                       held (flock) by the one writer

Each log record is framed and checksummed (see ``framing``). An attempt is durable when
:meth:`TraceStore.append` returns: written to the OS (survives the process being killed), and
with ``fsync=True`` also on disk (survives power loss). A record whose frame or payload checksum
fails is never decoded: readers skip it with a warning and resynchronise on the next magic.
Sealing closes the log, starts the next one, and writes the closed log as the segment of the
same number in a background thread: to a temporary name, fsynced, its checksum recorded in the
manifest, renamed into place, and only then the log removed, so a crash at any point leaves
every attempt readable exactly once (a log whose segment already exists is redundant and
ignored; a writer that finds two logs seals the older one first). Every segment read is checked
against its checksum first (see ``segments``): a damaged one is skipped and named, never decoded.
pandas, pyarrow and datasets read ``DIR/segments`` directly.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tracerl.trace.codec import encode_attempt, header_to_bytes
from tracerl.trace.columnar import records_to_table
from tracerl.trace.framing import (
    MAGIC,
    Damage,
    TraceStoreWarning,
    _frame,
    _Record,
    _warn,
    encode_record,
    scan_log,
)
from tracerl.trace.reading import (
    StoreScan,
    read_attempt,
    read_attempts,
    read_table,
    read_token_batches,
    scan_store,
)
from tracerl.trace.schema import Attempt, check_attempt
from tracerl.trace.segments import (
    _LOG,
    _SEGMENT,
    MANIFEST,
    QUARANTINE_DIR,
    SEGMENTS_DIR,
    Manifest,
    Quarantined,
    SegmentChecksum,
    SegmentDamage,
    SegmentError,
    _numbered,
    load_manifest,
    parse_segment,
    segment_bytes,
    sha256_hex,
    write_manifest,
)

__all__ = [
    "COMPRESSIONS", "MAGIC", "MANIFEST", "SEGMENTS_DIR", "Compression", "Damage", "Quarantined",
    "SegmentDamage", "StoreScan", "TraceStore", "TraceStoreWarning", "encode_record",
    "read_attempt", "read_attempts", "read_table", "read_token_batches",
    "scan_log", "scan_store",
]

Compression = Literal["lz4", "zstd", "snappy", "none"]
COMPRESSIONS: tuple[str, ...] = ("lz4", "zstd", "snappy", "none")
"""Parquet codecs a store can seal with (every reader named in the docs handles them)."""
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self.quarantined: list[Quarantined] = []
        """Damaged segments moved to ``quarantine/`` when the store was opened."""
        self._manifest = Manifest()
        self._manifest_lock = threading.Lock()
        self._recover()
        self._log = open(self._log_path, "ab")  # noqa: SIM115 (held until close)

    # -- recovery ---------------------------------------------------------------------------

    def _recover(self) -> None:
        found = _numbered(self.directory / SEGMENTS_DIR, _SEGMENT)
        segments = self._check_segments(found)
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
                quarantine = self.directory / QUARANTINE_DIR
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
            # Numbers of quarantined segments are not reused: a name means one segment.
            gone = [int(m.group(1)) for q in self._manifest.quarantined
                    if (m := _SEGMENT.match(q.segment))]
            self._number = max([*found, *logs, *gone, 0]) + 1
            self._log_path = self.directory / f"log-{self._number:06d}.trl"

    def _check_segments(self, found: dict[int, Path]) -> dict[int, Path]:
        """Check every sealed segment against its checksum and read its ids; move damaged
        ones to quarantine (recorded in the manifest); record the checksum of segments sealed
        before checksums existed. Returns the segments kept."""
        manifest = load_manifest(self.directory)
        changed = manifest.unreadable is not None
        if manifest.unreadable is not None:
            quarantine = self.directory / QUARANTINE_DIR
            quarantine.mkdir(exist_ok=True)
            shutil.copyfile(self.directory / MANIFEST,
                            quarantine / f"{MANIFEST}.{os.getpid()}.damaged")
            warnings.warn(f"{manifest.unreadable}; a copy is in {QUARANTINE_DIR}/ and the "
                          "segments' checksums are recorded again from their current bytes",
                          TraceStoreWarning, stacklevel=4)
        records = {name: r for name, r in manifest.segments.items()
                   if name in {p.name for p in found.values()}}
        changed |= len(records) != len(manifest.segments)
        quarantined = list(manifest.quarantined)
        kept: dict[int, Path] = {}
        for n, path in found.items():
            record = records.get(path.name)
            try:
                data = segment_bytes(path, record)
                # Unchecked segments are decoded whole before their checksum is recorded.
                table = parse_segment(path, data, ["attempt_id"] if record else None,
                                      None if record is None else record.attempts)
            except SegmentError as error:
                records.pop(path.name, None)
                quarantined.append(self._quarantine(path, error.damage))
                changed = True
                continue
            if record is None:
                records[path.name] = SegmentChecksum(sha256_hex(data), data.size, table.num_rows)
                changed = True
            self._ids.update(table.column("attempt_id").to_pylist())
            kept[n] = path
        self._manifest = Manifest(records, tuple(quarantined))
        if changed:
            write_manifest(self.directory, self._manifest)
        return kept

    def _quarantine(self, path: Path, damage: SegmentDamage) -> Quarantined:
        quarantine = self.directory / QUARANTINE_DIR
        quarantine.mkdir(exist_ok=True)
        moved = quarantine / f"{path.name}.{os.getpid()}.damaged"
        os.replace(path, moved)
        _fsync_dir(path.parent)
        lost = "" if damage.attempts is None else f"; its {damage.attempts} attempts are lost"
        entry = Quarantined(path.name, damage.reason, damage.attempts,
                            str(moved.relative_to(self.directory)))
        warnings.warn(f"{path}: damaged segment ({damage.reason}); moved to {entry.moved_to}"
                      f"{lost}", TraceStoreWarning, stacklevel=5)
        self.quarantined.append(entry)
        return entry

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
            sink = pa.BufferOutputStream()
            pq.write_table(records_to_table(records), sink, compression=self.compression,
                           use_dictionary=["task_id", "group_id", "end_reason", "token_roles"],
                           use_byte_stream_split=["action_logprobs.list.element"])
            data = sink.getvalue()
            with open(tmp, "wb") as f:
                f.write(memoryview(data))
                f.flush()
                os.fsync(f.fileno())
            # The checksum is recorded before the segment appears: every segment a reader can
            # see has one (a crash in between leaves a record of a segment that is resealed).
            with self._manifest_lock:
                checksums = {**self._manifest.segments,
                             final.name: SegmentChecksum(sha256_hex(data), data.size,
                                                         len(records))}
                self._manifest = Manifest(checksums, self._manifest.quarantined)
                write_manifest(self.directory, self._manifest)
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


