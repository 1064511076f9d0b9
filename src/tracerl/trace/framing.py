"""The framing of the append log: one checksummed record per attempt.

Each record is ``magic (4) | payload length (u32) | payload crc32 (u32) | frame crc32 (u32) |
payload``, little-endian; the payload is a JSON header, the attempt's layout (int64), token ids
(int32) and logprobs (float32) as raw bytes (see ``codec``). A record whose frame or payload
checksum fails is never decoded: :func:`scan_log` skips it and resynchronises on the next magic.
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tracerl.trace.codec import check_sizes, encode_attempt, header_to_bytes
from tracerl.trace.schema import Attempt

MAGIC = b"TRL\x01"
_FRAME = struct.Struct("<4sIII")  # magic, payload length, payload crc32, frame crc32
_U32 = struct.Struct("<I")

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
