"""The columnar (Arrow / Parquet) form of stored attempts, converted in bulk.

One row per attempt. Summary columns for pandas users (ids, ending, reward, tokens per role,
costs), every token with its role, the logprobs, and the exact ``layout`` and ``header`` from
which a record is rebuilt. Conversions work on whole columns with numpy: per attempt, only
the small JSON header and a handful of slices are handled in Python.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from tracerl.trace.schema import END_REASONS, ROLES

_N_ROLES = len(ROLES)


class EncodedRecord(Protocol):
    """What a stored record provides (the store's log records and decoded rows)."""

    @property
    def header(self) -> dict[str, Any]: ...
    @property
    def header_bytes(self) -> bytes: ...
    @property
    def layout(self) -> np.ndarray: ...
    @property
    def tokens(self) -> np.ndarray: ...
    @property
    def logprobs(self) -> np.ndarray: ...


def _offsets(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("records: more than 2**31 values in one segment; seal more often")
    return offsets.astype(np.int32)


def records_to_table(records: Sequence[EncodedRecord]) -> pa.Table:
    """One row per attempt: summary columns for pandas, plus the exact header and arrays."""
    n = len(records)
    tokens = (np.concatenate([r.tokens for r in records]) if n else np.zeros(0, np.int32))
    logprobs = (np.concatenate([r.logprobs for r in records]) if n
                else np.zeros(0, np.float32))
    layouts = [r.layout for r in records]
    layout = np.concatenate(layouts) if n else np.zeros(0, np.int64)
    token_offsets = _offsets([len(r.tokens) for r in records])
    layout_offsets = _offsets([len(x) for x in layouts])
    # Per-record structure counts from the layouts' first three values, then the segment
    # table of every record located with array arithmetic (no per-segment Python).
    heads = layout[layout_offsets[:-1, None] + np.arange(3)] if n else np.zeros((0, 3), np.int64)
    nf, nt, ns = heads[:, 0], heads[:, 1], heads[:, 2]
    seg_start = layout_offsets[:-1] + 3 + 4 * nf + nt
    record_of_seg = np.repeat(np.arange(n), ns)
    seg_in_record = np.arange(int(ns.sum())) - np.repeat(np.cumsum(ns) - ns, ns)
    base = np.repeat(seg_start, ns) + seg_in_record
    seg_roles = layout[base]
    seg_lengths = layout[base + np.repeat(ns, ns)]
    n_context = np.diff(token_offsets) - np.bincount(record_of_seg, weights=seg_lengths,
                                                      minlength=n).astype(np.int64)
    # Roles of every token: the segments' roles, then -1 for each record's continuation ids.
    order_codes = np.concatenate([seg_roles, np.full(n, -1)])
    order_lengths = np.concatenate([seg_lengths, n_context])
    order_key = np.concatenate([record_of_seg * 2, np.arange(n) * 2 + 1])
    order = np.argsort(order_key, kind="stable")
    roles = np.repeat(order_codes[order].astype(np.int8), order_lengths[order])
    counts = np.bincount(record_of_seg * _N_ROLES + seg_roles, weights=seg_lengths,
                         minlength=n * _N_ROLES).reshape(n, _N_ROLES).astype(np.int64)
    last_end = layout[layout_offsets[:-1] + 3 + 4 * (nf - 1) + 1] if n else np.zeros(0, np.int64)
    headers = [r.header for r in records]
    costs = np.array([h["costs"] for h in headers], dtype=np.float64).reshape(n, 4)
    end_names = np.array([e.value for e in END_REASONS], dtype=object)
    arrays: dict[str, pa.Array] = {
        "attempt_id": pa.array([h["id"] for h in headers], pa.string()),
        "task_id": pa.array([h["task"] for h in headers], pa.string()),
        "group_id": pa.array([h["group"] for h in headers], pa.string()),
        "end_reason": pa.array(end_names[last_end], pa.string()),
        "reward": pa.array([h["reward"] for h in headers], pa.float64()),
        "num_fragments": pa.array(nf, pa.int32()),
        **{f"{role.value}_tokens": pa.array(counts[:, i], pa.int64())
           for i, role in enumerate(ROLES)},
        "generated_tokens": pa.array(costs[:, 0].astype(np.int64), pa.int64()),
        "tool_seconds": pa.array(costs[:, 1], pa.float64()),
        "tool_calls": pa.array(costs[:, 2].astype(np.int64), pa.int64()),
        "turns": pa.array(costs[:, 3].astype(np.int64), pa.int64()),
        # Every token in sequence order (continuation ids last), and its role as an index
        # into ROLES (-1 for continuation ids): pandas users can mask without the header.
        "token_ids": pa.ListArray.from_arrays(pa.array(token_offsets), pa.array(tokens)),
        "token_roles": pa.ListArray.from_arrays(pa.array(token_offsets), pa.array(roles)),
        "action_logprobs": pa.ListArray.from_arrays(
            pa.array(_offsets([len(r.logprobs) for r in records])), pa.array(logprobs)),
        "layout": pa.ListArray.from_arrays(pa.array(layout_offsets), pa.array(layout)),
        "header": pa.array([r.header_bytes.decode() for r in records], pa.string()),
    }
    return pa.table(arrays)


def _list_parts(column: pa.ChunkedArray) -> Iterator[tuple[np.ndarray, list[int]]]:
    # (flat values, offsets) per chunk, without copying: offsets index into .values even for
    # a sliced chunk, and Arrow buffers are immutable, so the numpy views are read-only.
    for chunk in column.chunks:
        values = chunk.values.to_numpy(zero_copy_only=False)
        if values.flags.writeable:
            values.flags.writeable = False
        yield values, chunk.offsets.to_numpy().tolist()


def iter_list_rows(column: pa.ChunkedArray) -> Iterator[np.ndarray]:
    """Each row of a list column as a read-only numpy view."""
    for values, offsets in _list_parts(column):
        for i in range(len(offsets) - 1):
            yield values[offsets[i] : offsets[i + 1]]


@dataclass(frozen=True)
class TokenBatch:
    """The tokens, roles and behavior logprobs of several attempts as flat arrays.

    Attempt ``i`` owns ``token_ids[token_offsets[i]:token_offsets[i+1]]`` (segments in order,
    then its continuation ids), the roles at the same positions, and
    ``logprobs[logprob_offsets[i]:logprob_offsets[i+1]]``, one per token whose role is
    ``action``, in order. All arrays are read-only views of the stored columns.
    """

    attempt_ids: tuple[str, ...]
    """The attempts, in store order."""
    token_ids: np.ndarray
    """Every token id (int32)."""
    token_roles: np.ndarray
    """Index into ``ROLES`` of every token (int8); -1 for continuation ids."""
    token_offsets: np.ndarray
    """Start of each attempt in ``token_ids`` (int64, length attempts + 1)."""
    logprobs: np.ndarray
    """Behavior logprob of every action token (float32)."""
    logprob_offsets: np.ndarray
    """Start of each attempt in ``logprobs`` (int64, length attempts + 1)."""

    def __len__(self) -> int:
        return len(self.attempt_ids)


def table_to_token_batch(table: pa.Table) -> TokenBatch:
    """The token columns of a store table as one :class:`TokenBatch` (copies only if chunked)."""
    def flat(name: str, dtype: type) -> tuple[np.ndarray, np.ndarray]:
        column = table.column(name)
        chunk = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        offsets = chunk.offsets.to_numpy().astype(np.int64)
        values = chunk.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        values = values.astype(dtype, copy=False)
        offsets = offsets - offsets[0]
        for array in (values, offsets):
            array.flags.writeable = False
        return values, offsets

    tokens, token_offsets = flat("token_ids", np.int32)
    roles, _ = flat("token_roles", np.int8)
    logprobs, logprob_offsets = flat("action_logprobs", np.float32)
    return TokenBatch(tuple(table.column("attempt_id").to_pylist()), tokens, roles,
                      token_offsets, logprobs, logprob_offsets)
