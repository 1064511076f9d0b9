"""Traces: what every token was (role, policy, logprob), why each attempt ended, and a store.

See ``docs/traces.md``. This package knows nothing of models: it records, stores and packs.
"""

from __future__ import annotations

from tracerl.trace.columnar import TokenBatch
from tracerl.trace.pack import PackedBatch, PackReport, RowLayout, SegmentLayout, pack, unpack
from tracerl.trace.schema import (
    ATTEMPT_ENDINGS,
    END_REASONS,
    ROLES,
    Attempt,
    AuditRecord,
    Costs,
    EndReason,
    Fragment,
    Role,
    SamplingParams,
    Segment,
    Timings,
    Treatment,
    Turn,
    VerifierResult,
    check_attempt,
    default_treatments,
    validate_treatments,
)
from tracerl.trace.store import (
    SEGMENTS_DIR,
    Damage,
    StoreScan,
    TraceStore,
    TraceStoreWarning,
    read_attempt,
    read_attempts,
    read_table,
    read_token_batches,
    scan_store,
)

__all__ = [
    "ATTEMPT_ENDINGS",
    "END_REASONS",
    "ROLES",
    "SEGMENTS_DIR",
    "Attempt",
    "AuditRecord",
    "Costs",
    "Damage",
    "EndReason",
    "Fragment",
    "PackReport",
    "PackedBatch",
    "Role",
    "RowLayout",
    "SamplingParams",
    "Segment",
    "SegmentLayout",
    "StoreScan",
    "Timings",
    "TokenBatch",
    "TraceStore",
    "TraceStoreWarning",
    "Treatment",
    "Turn",
    "VerifierResult",
    "check_attempt",
    "default_treatments",
    "pack",
    "read_attempt",
    "read_attempts",
    "read_table",
    "read_token_batches",
    "scan_store",
    "unpack",
    "validate_treatments",
]
