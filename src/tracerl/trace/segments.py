"""Checksums of sealed segments, checked on every read; damaged segments quarantined.

``DIR/manifest.json`` records, for each sealed segment, the sha256 of its bytes, its size and
its number of attempts (what ``sha256sum segments/segment-000001.parquet`` prints), and the
segments that were found damaged and moved aside. The writer records a segment's checksum
before renaming the segment into place, so every segment a reader can see has one; the file is
replaced atomically (temporary name, fsync, rename, directory fsync).

A segment whose size or sha256 differs from the record, or that is not readable Parquet, is
never decoded: readers skip it with a :class:`TraceStoreWarning` that names it and says how many
attempts it held, and the next writer to open the store moves it to ``quarantine/`` and records
it under ``quarantined``. A segment with no record (a store written before checksums) is read
unchecked; the first writer to open such a store reads it whole, and records its checksum if it
decodes (else quarantines it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracerl.trace.framing import TraceStoreWarning

MANIFEST = "manifest.json"
"""File of the store directory that records the segments' checksums."""
QUARANTINE_DIR = "quarantine"
"""Sub-directory that damaged logs (copies) and damaged segments (moved) go to."""
_FORMAT = 1
SEGMENTS_DIR = "segments"
"""Sub-directory of sealed Parquet segments (point pandas / datasets here)."""
_LOG = re.compile(r"^log-(\d{6})\.trl$")
_SEGMENT = re.compile(r"^segment-(\d{6})\.parquet$")


def _numbered(directory: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    if not directory.is_dir():
        return {}
    found = {}
    for entry in directory.iterdir():
        match = pattern.match(entry.name)
        if match:
            found[int(match.group(1))] = entry
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class SegmentChecksum:
    """What the writer recorded about one sealed segment."""

    sha256: str
    """Hex sha256 of the whole file."""
    size: int
    """Bytes in the file."""
    attempts: int
    """Attempts (rows) it holds."""


@dataclass(frozen=True)
class Quarantined:
    """A damaged segment moved out of ``segments/``; its attempts are lost to readers."""

    segment: str
    """The segment's file name (``segment-000002.parquet``)."""
    reason: str
    """What was wrong with it."""
    attempts: int | None
    """Attempts it held, from its checksum record (None for a segment written without one)."""
    moved_to: str
    """Where it is now, relative to the store directory."""


@dataclass(frozen=True)
class Manifest:
    """The contents of ``manifest.json`` (empty for a store written before checksums)."""

    segments: dict[str, SegmentChecksum] = field(default_factory=dict)
    quarantined: tuple[Quarantined, ...] = ()
    unreadable: str | None = None
    """Why the file could not be read (its checksums are then unknown), or None."""


@dataclass(frozen=True)
class SegmentDamage:
    """A sealed segment that failed its check and was not read."""

    path: str
    """The segment file."""
    reason: str
    """What was wrong (size, checksum, Parquet)."""
    attempts: int | None
    """Attempts it held according to its checksum record (None if it had none)."""

    def message(self) -> str:
        held = "" if self.attempts is None else f"; its {self.attempts} attempts are not read"
        return f"{self.path}: damaged segment ({self.reason}){held}"


class SegmentError(ValueError):
    """A sealed segment failed its check (see :class:`SegmentDamage`)."""

    def __init__(self, damage: SegmentDamage) -> None:
        super().__init__(damage.message())
        self.damage = damage


def sha256_hex(data: Any) -> str:
    """Hex sha256 of a bytes-like object (a pyarrow Buffer included, without a copy)."""
    return hashlib.sha256(memoryview(data)).hexdigest()


def load_manifest(root: Path) -> Manifest:
    """The store's manifest; an empty one if there is none; ``unreadable`` set if damaged."""
    path = root / MANIFEST
    try:
        data = json.loads(path.read_bytes())
        if data.get("format") != _FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {_FORMAT}")
        segments = {name: SegmentChecksum(**entry) for name, entry in data["segments"].items()}
        quarantined = tuple(Quarantined(**entry) for entry in data["quarantined"])
    except FileNotFoundError:
        return Manifest()
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return Manifest(unreadable=f"{path}: not a readable manifest ({error})")
    return Manifest(segments, quarantined)


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Replace ``manifest.json`` atomically (temporary file, fsync, rename, directory fsync)."""
    data = {"format": _FORMAT,
            "segments": {name: asdict(entry) for name, entry in sorted(manifest.segments.items())},
            "quarantined": [asdict(entry) for entry in manifest.quarantined]}
    tmp = root / f".{MANIFEST}.tmp"
    with open(tmp, "wb") as f:
        f.write(json.dumps(data, indent=1).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def segment_bytes(path: Path, record: SegmentChecksum | None) -> pa.Buffer:
    """The segment's bytes (memory-mapped), checked against ``record`` when there is one.

    Raises SegmentError when the size or the sha256 differs; FileNotFoundError when the file is
    gone (moved to quarantine by a writer after the caller listed it)."""
    attempts = None if record is None else record.attempts
    try:
        with pa.memory_map(str(path), "r") as source:
            data = source.read_buffer()
    except FileNotFoundError:
        raise
    except (OSError, pa.ArrowException) as error:
        raise SegmentError(SegmentDamage(str(path), f"cannot be read: {error}", attempts)) from None
    if record is not None:
        if data.size != record.size:
            raise SegmentError(SegmentDamage(
                str(path), f"truncated or overwritten: {data.size} bytes, {record.size} recorded",
                attempts))
        if sha256_hex(data) != record.sha256:
            raise SegmentError(SegmentDamage(
                str(path), "sha256 mismatch: its bytes changed after it was sealed", attempts))
    return data


def parse_segment(path: Path, data: pa.Buffer, columns: list[str] | None,
                  attempts: int | None = None) -> pa.Table:
    """The Parquet table in ``data`` (SegmentError if it is not one)."""
    try:
        return pq.read_table(pa.BufferReader(data), columns=columns)
    except (OSError, pa.ArrowException) as error:
        raise SegmentError(SegmentDamage(str(path), f"not a readable Parquet segment: {error}",
                                         attempts)) from None


class SegmentReader:
    """Reads a store's segments for one reader call: checked against the manifest, damaged ones
    skipped and collected in ``damaged`` (with a warning unless ``warn=False``)."""

    def __init__(self, root: Path, *, warn: bool = True) -> None:
        self.root = root
        self.warn = warn
        self.manifest = load_manifest(root)
        self.damaged: list[SegmentDamage] = []
        if self.manifest.unreadable is not None and warn:
            warnings.warn(f"{self.manifest.unreadable}; segments are read unchecked",
                          TraceStoreWarning, stacklevel=3)

    def read(self, path: Path, columns: list[str] | None) -> pa.Table | None:
        """The segment's table, or None if it is damaged or was moved to quarantine."""
        record = self.manifest.segments.get(path.name)
        if record is None:
            # Sealed after this reader loaded the manifest (its record is written before the
            # segment appears), or written before checksums: look once more.
            self.manifest = load_manifest(self.root)
            record = self.manifest.segments.get(path.name)
        try:
            data = segment_bytes(path, record)
            return parse_segment(path, data, columns, None if record is None else record.attempts)
        except FileNotFoundError:
            return None
        except SegmentError as error:
            self.damaged.append(error.damage)
            if self.warn:
                warnings.warn(error.damage.message(), TraceStoreWarning, stacklevel=3)
            return None
