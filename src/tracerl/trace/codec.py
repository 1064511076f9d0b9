"""Lossless conversion of an :class:`Attempt` to a small JSON header plus two flat arrays.

The header holds the structure (fragments, turns, segment roles and lengths, sampling
parameters, policy versions, engines) and every attempt-level field; the arrays hold the bulk:
all token ids as int32 (segment tokens in sequence order, then each fragment's continuation
ids) and the behavior logprobs of action tokens as float32. Both the append log and the
Parquet segments store exactly this, so decoding is one function.

Logprobs are kept at float32 precision (what inference engines produce); a float64 value
that float32 cannot represent is rounded when stored.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from tracerl.trace.schema import (
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
    Turn,
    VerifierResult,
)

FORMAT_VERSION = 1
"""Version of the header layout; readers refuse versions they do not know."""

_ROLE_INDEX = {role: i for i, role in enumerate(ROLES)}
_END_INDEX = {reason: i for i, reason in enumerate(END_REASONS)}
_ACTION = _ROLE_INDEX[Role.ACTION]


def _new(cls: type, values: dict[str, Any]) -> Any:
    # Decoding builds hundreds of thousands of frozen records; filling __dict__ directly skips
    # the per-field object.__setattr__ of a frozen __init__ (about 5x faster). Only data that
    # passed its checksum and was validated when appended is decoded this way.
    obj: Any = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


def encode_attempt(attempt: Attempt) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """(header, token ids int32, action logprobs float32) for one attempt."""
    segments: list[list[Any]] = []
    fragments: list[list[Any]] = []
    token_chunks: list[np.ndarray] = []
    logprob_chunks: list[np.ndarray] = []
    continuation: list[np.ndarray] = []
    for fragment in attempt.fragments:
        turns: list[list[Any]] = []
        for turn in fragment.turns:
            turns.append([turn.process_reward, len(turn.segments)])
            for seg in turn.segments:
                role = _ROLE_INDEX[seg.role]
                n = len(seg.token_ids)
                token_chunks.append(seg.token_ids)
                if role == _ACTION:
                    if seg.logprobs is not None:
                        logprob_chunks.append(seg.logprobs)
                    sp = seg.sampling
                    sampling = (
                        None
                        if sp is None
                        else [sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens, sp.seed]
                    )
                    segments.append([role, n, seg.policy_version, seg.engine, sampling])
                else:
                    segments.append([role, n])
        fragments.append(
            [_END_INDEX[fragment.end], len(fragment.continuation_ids), turns, fragment.index]
        )
        continuation.append(fragment.continuation_ids)
    tokens = np.concatenate([*token_chunks, *continuation]).astype(np.int32, copy=False)
    logprobs = (
        np.concatenate(logprob_chunks).astype(np.float32, copy=False)
        if logprob_chunks
        else np.zeros(0, dtype=np.float32)
    )
    header: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "id": attempt.attempt_id,
        "task": attempt.task_id,
        "group": attempt.group_id,
        "reward": attempt.reward,
        "rewards": dict(attempt.rewards),
        "verifier": None if attempt.verifier is None else _verifier_to_json(attempt.verifier),
        "audit": None if attempt.audit is None else _audit_to_json(attempt.audit),
        "timings": [
            attempt.timings.started_at,
            attempt.timings.finished_at,
            attempt.timings.generation_seconds,
            attempt.timings.verification_seconds,
        ],
        "costs": [
            attempt.costs.generated_tokens,
            attempt.costs.tool_seconds,
            attempt.costs.tool_calls,
            attempt.costs.turns,
        ],
        "metadata": dict(attempt.metadata),
        "fragments": fragments,
        "segments": segments,
        "n_tokens": int(tokens.size),
        "n_logprobs": int(logprobs.size),
    }
    return header, tokens, logprobs


def header_to_bytes(header: Mapping[str, Any]) -> bytes:
    """Compact JSON; NaN and inf are refused (they are never valid in a record)."""
    try:
        return json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as error:
        raise ValueError(f"attempt {header.get('id')!r}: a field is NaN or infinite") from error
    except TypeError as error:
        raise ValueError(f"attempt {header.get('id')!r}: metadata is not JSON: {error}") from error


def decode_attempt(header: Mapping[str, Any], tokens: np.ndarray, logprobs: np.ndarray) -> Attempt:
    """Rebuild the attempt from its header and arrays (inverse of :func:`encode_attempt`)."""
    if header.get("v") != FORMAT_VERSION:
        raise ValueError(f"record format version {header.get('v')!r} is not {FORMAT_VERSION}")
    if len(tokens) != header["n_tokens"] or len(logprobs) != header["n_logprobs"]:
        raise ValueError(
            f"attempt {header.get('id')!r}: {len(tokens)} tokens / {len(logprobs)} logprobs "
            f"stored, header says {header['n_tokens']} / {header['n_logprobs']}"
        )
    # Segments are read-only views into the record's arrays: no per-token Python objects.
    if tokens.flags.writeable:
        tokens = tokens.copy()
        tokens.flags.writeable = False
    if logprobs.flags.writeable:
        logprobs = logprobs.copy()
        logprobs.flags.writeable = False
    seg_specs = header["segments"]
    seg_pos = tok_pos = lp_pos = 0
    cont_pos = sum(spec[1] for spec in seg_specs)
    fragments: list[Fragment] = []
    for end, n_cont, turn_specs, f_index in header["fragments"]:
        turns: list[Turn] = []
        for process_reward, n_segs in turn_specs:
            segs: list[Segment] = []
            for spec in seg_specs[seg_pos : seg_pos + n_segs]:
                n = spec[1]
                ids = tokens[tok_pos : tok_pos + n]
                tok_pos += n
                if spec[0] == _ACTION:
                    sampling = None if spec[4] is None else _sampling(tuple(spec[4]))
                    lps = logprobs[lp_pos : lp_pos + n]
                    lp_pos += n
                    values = {
                        "role": Role.ACTION,
                        "token_ids": ids,
                        "logprobs": lps,
                        "sampling": sampling,
                        "policy_version": spec[2],
                        "engine": spec[3],
                    }
                else:
                    values = {
                        "role": ROLES[spec[0]],
                        "token_ids": ids,
                        "logprobs": None,
                        "sampling": None,
                        "policy_version": None,
                        "engine": None,
                    }
                segs.append(_new(Segment, values))
            seg_pos += n_segs
            turns.append(_new(Turn, {"segments": tuple(segs), "process_reward": process_reward}))
        cont = tokens[cont_pos : cont_pos + n_cont]
        cont_pos += n_cont
        fragments.append(
            _new(
                Fragment,
                {
                    "index": f_index,
                    "turns": tuple(turns),
                    "end": END_REASONS[end],
                    "continuation_ids": cont,
                },
            )
        )
    timings, costs = header["timings"], header["costs"]
    return _new(
        Attempt,
        {
            "attempt_id": header["id"],
            "task_id": header["task"],
            "group_id": header["group"],
            "fragments": tuple(fragments),
            "reward": header["reward"],
            "rewards": header["rewards"],
            "verifier": None if header["verifier"] is None else _verifier(header["verifier"]),
            "audit": None if header["audit"] is None else _audit(header["audit"]),
            "timings": Timings(*timings),
            "costs": Costs(*costs),
            "metadata": header["metadata"],
        },
    )


@functools.lru_cache(maxsize=4096)
def _sampling(values: tuple[Any, ...]) -> SamplingParams:
    # Most segments of a run share their sampling parameters; the records are immutable, so
    # one object per distinct setting is shared.
    temperature, top_p, top_k, max_new_tokens, seed = values
    return SamplingParams(temperature, top_p, top_k, max_new_tokens, seed)


def _verifier_to_json(v: VerifierResult) -> dict[str, Any]:
    return {"passed": v.passed, "score": v.score, "details": dict(v.details), "log": v.log}


def _verifier(d: Mapping[str, Any]) -> VerifierResult:
    return VerifierResult(passed=d["passed"], score=d["score"], details=d["details"], log=d["log"])


def _audit_to_json(a: AuditRecord) -> dict[str, Any]:
    return {
        "protected_modified": list(a.protected_modified),
        "protected_reverted": a.protected_reverted,
        "hidden_access_attempts": a.hidden_access_attempts,
        "flagged": a.flagged,
        "reward_if_unaudited": a.reward_if_unaudited,
    }


def _audit(d: Mapping[str, Any]) -> AuditRecord:
    return AuditRecord(
        protected_modified=tuple(d["protected_modified"]),
        protected_reverted=d["protected_reverted"],
        hidden_access_attempts=d["hidden_access_attempts"],
        flagged=d["flagged"],
        reward_if_unaudited=d["reward_if_unaudited"],
    )


def role_counts(header: Mapping[str, Any]) -> dict[Role, int]:
    """Tokens per role of an encoded attempt (continuation ids not included)."""
    counts = dict.fromkeys(ROLES, 0)
    for spec in header["segments"]:
        counts[ROLES[spec[0]]] += spec[1]
    return counts


def end_reason(header: Mapping[str, Any]) -> EndReason:
    """The attempt's ending from its header."""
    return END_REASONS[header["fragments"][-1][0]]
