"""Lossless conversion of an :class:`Attempt` to a small JSON header plus three flat arrays.

* the **header** (JSON) holds the attempt-level fields: ids, rewards, verifier, audit,
  timings, costs, metadata, and the distinct sampling settings and engine names its segments
  refer to;
* the **layout** (int64) holds the structure: ``[n_fragments, n_turns, n_segments]``, then
  per fragment ``index, end, n_turns, n_continuation`` (row by row), then per turn its
  segment count, then per segment, column by column: role, token count, logprob count (-1:
  none), policy version (``NO_VERSION``: none), sampling index and engine index (-1: none);
* **tokens** (int32): every segment's token ids in sequence order, then each fragment's
  continuation ids; **logprobs** (float32): every segment's logprobs in order.

A multi-agent attempt's segments name their agent (``Segment.agent``): the header then holds
the distinct names (``agents``) and one index per segment (``segment_agents``, -1: none);
records without agents have neither key, so single-agent records are unchanged.

The structure is numbers, not JSON, because a JSON list per segment was the largest cost of
both writing and reading a record. Both the append log and the Parquet segments store exactly
these four parts, so decoding is one function. Logprobs are kept at float32 precision (what
inference engines produce); a float64 value that float32 cannot represent is rounded.

Encoding never refuses a broken attempt (a foreign writer can store one, and ``validate`` must
then name the broken rule), but it reports whether the attempt *may* break an invariant, with
checks that cost almost nothing next to the copy of its tokens: the store runs the full
:func:`check_attempt` only for those.
"""

from __future__ import annotations

import functools
import json
import math
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

FORMAT_VERSION = 2
"""Version of the record layout; readers refuse versions they do not know."""

NO_VERSION = -(2**63)
"""Layout value of a segment without a policy version (the smallest int64)."""

_ROLE_INDEX = {role: i for i, role in enumerate(ROLES)}
_END_INDEX = {reason: i for i, reason in enumerate(END_REASONS)}
_ACTION = _ROLE_INDEX[Role.ACTION]
_CONTINUED = EndReason.CONTINUED
_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_EMPTY_I32.flags.writeable = False
_EMPTY_F32 = np.zeros(0, dtype=np.float32)
_EMPTY_F32.flags.writeable = False
_SEG_FIELDS = 6  # role, tokens, logprobs, version, sampling, engine


def _new(cls: type, values: dict[str, Any]) -> Any:
    # Decoding builds hundreds of thousands of frozen records; filling __dict__ directly skips
    # the per-field object.__setattr__ of a frozen __init__ (about 5x faster). Only data that
    # passed its checksum is decoded this way.
    obj: Any = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


def encode_attempt(
    attempt: Attempt,
) -> tuple[dict[str, Any], np.ndarray, np.ndarray, np.ndarray, bool]:
    """(header, layout int64, token ids int32, logprobs float32, suspect) for one attempt.

    ``suspect`` is False only if :func:`check_attempt` would find nothing wrong with the
    structure (logprob values, checked on the returned array, are the caller's part).
    """
    frag_rows: list[int] = []
    turn_rows: list[int] = []
    roles: list[int] = []
    lengths: list[int] = []
    lp_counts: list[int] = []
    versions: list[int] = []
    sampling_index: list[int] = []
    engine_index: list[int] = []
    token_chunks: list[np.ndarray] = []
    lp_chunks: list[np.ndarray] = []
    continuation: list[np.ndarray] = []
    samplings: dict[int, int] = {}  # id(SamplingParams) -> index (objects live during encode)
    sampling_rows: list[list[Any]] = []
    engines: dict[str, int] = {}
    agents: dict[str, int] = {}
    agent_index: list[int] = []
    process: list[list[Any]] = []
    suspect = not attempt.attempt_id or not attempt.fragments
    last = len(attempt.fragments) - 1
    n_turn = 0
    for position, fragment in enumerate(attempt.fragments):
        end = fragment.end
        cont = fragment.continuation_ids
        if fragment.index != position or (end is _CONTINUED) != (position < last) or (
                position < last and len(cont)):
            suspect = True
        frag_rows += (fragment.index, _END_INDEX[end], len(fragment.turns), len(cont))
        first = True
        for turn in fragment.turns:
            segs = turn.segments
            turn_rows.append(len(segs))
            has_action = False
            for seg in segs:
                ids = seg.token_ids
                n = len(ids)
                token_chunks.append(ids)
                lp = seg.logprobs
                version = seg.policy_version
                if lp is None:
                    lp_counts.append(-1)
                else:
                    lp_counts.append(len(lp))
                    lp_chunks.append(lp)
                if version is None:
                    versions.append(NO_VERSION)
                elif version == NO_VERSION:
                    raise ValueError(f"attempt {attempt.attempt_id!r}: policy version "
                                     f"{NO_VERSION} is reserved")
                else:
                    versions.append(version)
                sp = seg.sampling
                if sp is None:
                    sampling_index.append(-1)
                else:
                    k = samplings.get(id(sp))
                    if k is None:
                        k = samplings[id(sp)] = len(sampling_rows)
                        sampling_rows.append(
                            [sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens, sp.seed,
                             sp.constraint])
                    sampling_index.append(k)
                engine = seg.engine
                if engine is None:
                    engine_index.append(-1)
                else:
                    e = engines.get(engine)
                    if e is None:
                        e = engines[engine] = len(engines)
                    engine_index.append(e)
                name = seg.agent
                if name is None:
                    agent_index.append(-1)
                else:
                    agent_index.append(agents.setdefault(name, len(agents)))
                role = _ROLE_INDEX[seg.role]
                roles.append(role)
                lengths.append(n)
                if role == _ACTION:
                    has_action = has_action or n > 0
                    if (first or lp is None or len(lp) != n or sp is None or version is None
                            or not engine):
                        suspect = True
                elif lp is not None or version is not None:
                    suspect = True
                first = False
            if turn.process_reward is not None:
                process.append([n_turn, turn.process_reward])
                if not has_action or not math.isfinite(turn.process_reward):
                    suspect = True
            n_turn += 1
        continuation.append(cont)
    if attempt.reward is not None and not math.isfinite(attempt.reward):
        suspect = True
    if not all(math.isfinite(v) for v in attempt.rewards.values()):
        suspect = True
    try:
        layout = np.array(
            [len(attempt.fragments), n_turn, len(roles), *frag_rows, *turn_rows, *roles,
             *lengths, *lp_counts, *versions, *sampling_index, *engine_index], dtype=np.int64)
    except OverflowError as error:
        raise ValueError(f"attempt {attempt.attempt_id!r}: a policy version does not fit in "
                         "int64") from error
    chunks = [*token_chunks, *continuation]
    tokens = np.concatenate(chunks) if chunks else _EMPTY_I32
    logprobs = np.concatenate(lp_chunks) if lp_chunks else _EMPTY_F32
    v, t, c = attempt.verifier, attempt.timings, attempt.costs
    header: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "id": attempt.attempt_id,
        "task": attempt.task_id,
        "group": attempt.group_id,
        "reward": attempt.reward,
        "rewards": dict(attempt.rewards),
        "verifier": None if v is None else [v.passed, v.score, dict(v.details), v.log],
        "audit": None if attempt.audit is None else _audit_to_json(attempt.audit),
        "timings": [t.started_at, t.finished_at, t.generation_seconds, t.verification_seconds],
        "costs": [c.generated_tokens, c.tool_seconds, c.tool_calls, c.turns],
        "metadata": dict(attempt.metadata),
        "sampling": sampling_rows,
        "engines": list(engines),
        "process_rewards": process,
        "n_tokens": int(tokens.size),
        "n_logprobs": int(logprobs.size),
    }
    if agents:
        header["agents"] = list(agents)
        header["segment_agents"] = agent_index
    return header, layout, tokens, logprobs, suspect


def header_to_bytes(header: Mapping[str, Any]) -> bytes:
    """Compact JSON; NaN and inf are refused (they are never valid in a record)."""
    try:
        return json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as error:
        raise ValueError(f"attempt {header.get('id')!r}: a field is NaN or infinite") from error
    except TypeError as error:
        raise ValueError(f"attempt {header.get('id')!r}: metadata is not JSON: {error}") from error


def check_sizes(header: Mapping[str, Any], layout: np.ndarray, n_tokens: int,
                n_logprobs: int) -> None:
    """ValueError unless the layout's counts and codes agree with the header and the arrays."""
    name = header.get("id")
    if header.get("v") != FORMAT_VERSION:
        raise ValueError(f"record format version {header.get('v')!r} is not {FORMAT_VERSION}")
    if n_tokens != header["n_tokens"] or n_logprobs != header["n_logprobs"]:
        raise ValueError(
            f"attempt {name!r}: {n_tokens} tokens / {n_logprobs} logprobs stored, header says "
            f"{header['n_tokens']} / {header['n_logprobs']}"
        )
    # Plain Python over ~100 small ints: cheaper than a dozen numpy calls on tiny arrays.
    lay = layout.tolist()
    if len(lay) < 3 or min(lay[:3]) < 0:
        raise ValueError(f"attempt {name!r}: layout too short")
    nf, nt, ns = lay[:3]
    if len(lay) != 3 + 4 * nf + nt + _SEG_FIELDS * ns:
        raise ValueError(f"attempt {name!r}: layout length does not match its counts")
    frags = lay[3 : 3 + 4 * nf]
    turns = lay[3 + 4 * nf : 3 + 4 * nf + nt]
    sb = 3 + 4 * nf + nt
    roles, lengths, lps = lay[sb : sb + ns], lay[sb + ns : sb + 2 * ns], lay[sb + 2 * ns : sb + 3 * ns]
    samplings, engines = lay[sb + 4 * ns : sb + 5 * ns], lay[sb + 5 * ns :]
    ends, conts = frags[1::4], frags[3::4]
    ok = (
        sum(frags[2::4]) == nt and sum(turns) == ns and min(turns, default=0) >= 0
        and min(lengths, default=0) >= 0 and min(conts, default=0) >= 0
        and sum(lengths) + sum(conts) == n_tokens
        and sum(n for n in lps if n > 0) == n_logprobs and min(lps, default=-1) >= -1
        and all(0 <= e < len(END_REASONS) for e in ends)
        and all(0 <= r < len(ROLES) for r in roles)
        and all(-1 <= k < len(header["sampling"]) for k in samplings)
        and all(-1 <= e < len(header["engines"]) for e in engines)
    )
    seg_agents = header.get("segment_agents")
    if seg_agents is not None:
        ok = ok and len(seg_agents) == ns and all(
            -1 <= a < len(header.get("agents", ())) for a in seg_agents)
    if not ok:
        raise ValueError(f"attempt {name!r}: layout counts do not match the stored arrays")


def decode_attempt(header: Mapping[str, Any], layout: np.ndarray | list[int],
                   tokens: np.ndarray, logprobs: np.ndarray) -> Attempt:
    """Rebuild the attempt (inverse of :func:`encode_attempt`).

    ``tokens`` and ``logprobs`` should be read-only (their slices become the segments' arrays;
    writeable ones are copied). The caller has checked sizes (:func:`check_sizes`) or read
    the record from a Parquet segment that was checked when it was sealed.
    """
    if tokens.flags.writeable:
        tokens = tokens.copy()
        tokens.flags.writeable = False
    if logprobs.flags.writeable:
        logprobs = logprobs.copy()
        logprobs.flags.writeable = False
    lay = layout if isinstance(layout, list) else layout.tolist()
    nf, nt, ns = lay[0], lay[1], lay[2]
    tb = 3 + 4 * nf  # turns start
    sb = tb + nt  # segment columns start
    samplings = [_sampling(tuple(row)) for row in header["sampling"]]
    engines = header["engines"]
    agent_names = header.get("agents", ())
    seg_agents = header.get("segment_agents")
    process = dict(header["process_rewards"]) if header["process_rewards"] else None
    cont_pos = sum(lay[sb + ns : sb + 2 * ns])
    seg = turn = tok_pos = lp_pos = 0
    fragments: list[Fragment] = []
    new, set_dict = object.__new__, object.__setattr__  # see _new: no frozen __init__
    for f in range(nf):
        f_index, end, f_turns, n_cont = lay[3 + 4 * f : 7 + 4 * f]
        turns: list[Turn] = []
        for _ in range(f_turns):
            segs: list[Segment] = []
            for s in range(seg, seg + lay[tb + turn]):
                n = lay[sb + ns + s]
                n_lp = lay[sb + 2 * ns + s]
                ids = tokens[tok_pos : tok_pos + n]
                tok_pos += n
                if n_lp >= 0:
                    lps = logprobs[lp_pos : lp_pos + n_lp]
                    lp_pos += n_lp
                else:
                    lps = None
                version = lay[sb + 3 * ns + s]
                k = lay[sb + 4 * ns + s]
                e = lay[sb + 5 * ns + s]
                obj = new(Segment)
                set_dict(obj, "__dict__", {
                    "role": ROLES[lay[sb + s]],
                    "token_ids": ids,
                    "logprobs": lps,
                    "sampling": None if k < 0 else samplings[k],
                    "policy_version": None if version == NO_VERSION else version,
                    "engine": None if e < 0 else engines[e],
                    "agent": (None if seg_agents is None or seg_agents[s] < 0
                              else agent_names[seg_agents[s]]),
                })
                segs.append(obj)
            seg += lay[tb + turn]
            turns.append(_new(Turn, {
                "segments": tuple(segs),
                "process_reward": None if process is None else process.get(turn),
            }))
            turn += 1
        fragments.append(_new(Fragment, {
            "index": f_index,
            "turns": tuple(turns),
            "end": END_REASONS[end],
            "continuation_ids": tokens[cont_pos : cont_pos + n_cont],
        }))
        cont_pos += n_cont
    if cont_pos != len(tokens) or lp_pos != len(logprobs) or seg != ns or turn != nt:
        raise ValueError(f"attempt {header.get('id')!r}: layout does not match the stored "
                         "arrays")
    timings, costs, v = header["timings"], header["costs"], header["verifier"]
    return _new(Attempt, {
        "attempt_id": header["id"],
        "task_id": header["task"],
        "group_id": header["group"],
        "fragments": tuple(fragments),
        "reward": header["reward"],
        "rewards": header["rewards"],
        "verifier": None if v is None else _new(VerifierResult, {
            "passed": v[0], "score": v[1], "details": v[2], "log": v[3]}),
        "audit": None if header["audit"] is None else _audit(header["audit"]),
        "timings": _new(Timings, dict(zip(_TIMING_FIELDS, timings, strict=True))),
        "costs": _new(Costs, dict(zip(_COST_FIELDS, costs, strict=True))),
        "metadata": header["metadata"],
    })


_TIMING_FIELDS = ("started_at", "finished_at", "generation_seconds", "verification_seconds")
_COST_FIELDS = ("generated_tokens", "tool_seconds", "tool_calls", "turns")


@functools.lru_cache(maxsize=4096)
def _sampling(values: tuple[Any, ...]) -> SamplingParams:
    # Most segments of a run share their sampling parameters; the records are immutable, so
    # one object per distinct setting is shared.
    # Records written before ``constraint`` existed have five values: no rule was applied.
    temperature, top_p, top_k, max_new_tokens, seed, *rest = values
    return SamplingParams(temperature, top_p, top_k, max_new_tokens, seed,
                          rest[0] if rest else None)


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


def layout_segments(layout: np.ndarray) -> np.ndarray:
    """The layout's per-segment table, shape (6, n_segments): role, tokens, logprobs, version,
    sampling index, engine index."""
    nf, nt, ns = (int(x) for x in layout[:3])
    return layout[3 + 4 * nf + nt :].reshape(_SEG_FIELDS, ns)


def role_counts(layout: np.ndarray) -> dict[Role, int]:
    """Tokens per role of an encoded attempt (continuation ids not included)."""
    segs = layout_segments(layout)
    counts = np.bincount(segs[0], weights=segs[1], minlength=len(ROLES))
    return {role: int(counts[i]) for i, role in enumerate(ROLES)}


def end_reason(layout: np.ndarray) -> EndReason:
    """The attempt's ending from its layout (the last fragment's end)."""
    nf = int(layout[0])
    if nf < 1:
        raise ValueError("layout: the attempt has no fragment")
    return END_REASONS[int(layout[3 + 4 * (nf - 1) + 1])]
