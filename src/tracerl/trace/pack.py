"""Packing attempts into padded ``[B, T]`` tensors for the trainer, and back.

One row per fragment (compaction splits an attempt into fragments; each is a separate
sequence because its context was rebuilt). Only ``action`` tokens have ``action_mask`` 1;
prompt, observation and summary tokens are context even though they sit in the same row.
What happens to each attempt is decided by its ending's :class:`Treatment`:

* ``score``: the attempt's reward is added on the last action token of its final fragment;
  that row's future value is 0 (``needs_bootstrap`` False).
* ``bootstrap``: no verifier reward; the row needs the critic's value of the continuation
  state (``needs_bootstrap`` True and ``continuation_ids`` hold that state).
* ``exclude`` / ``retry``: the attempt is left out of the batch and counted in the report.

A fragment that ends ``continued`` always needs a bootstrap: its continuation state is the
next fragment's context up to its first action (summary, observation, ...), exactly what
the policy saw next. For a bootstrapped final fragment the state is the fragment itself
followed by its recorded ``continuation_ids``. ``continuation_ids[b]`` is that state as a
standalone sequence; the critic's value at its last real token is ``bootstrap_values[b]``.

Group baselines: excluded attempts leave their group, so the baseline is taken over the
remaining attempts; a group left with fewer than ``min_group_size`` attempts (default 2
without a critic, where a group of one has no baseline) is dropped from the batch and counted.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from tracerl.trace.schema import (
    END_REASONS,
    ROLES,
    Attempt,
    EndReason,
    Fragment,
    Role,
    SamplingParams,
    Segment,
    Treatment,
    Turn,
    check_attempt,
    default_treatments,
    validate_treatments,
)

PaddingSide = Literal["left", "right"]
_ACTION = ROLES.index(Role.ACTION)
_END_INDEX = {reason: i for i, reason in enumerate(END_REASONS)}


@dataclass(frozen=True)
class SegmentLayout:
    """Structure of one segment of a packed row (its tokens live in the tensors)."""

    role: Role
    """The segment's role."""
    length: int
    """Number of tokens."""
    sampling: SamplingParams | None
    """Action only: sampling parameters."""
    policy_version: int | None
    """Action only: the policy version (also in the tensor, per token)."""
    engine: str | None
    """Action only: the sampling engine."""
    agent: str | None = None
    """The agent whose context the segment stands in (several agents), else None."""


@dataclass(frozen=True, eq=False)
class RowLayout:
    """Structure of one packed row: enough, with the tensors, to rebuild its fragment."""

    turns: tuple[tuple[float | None, tuple[SegmentLayout, ...]], ...]
    """Per turn: its process reward and its segments."""
    end: EndReason
    """How the fragment ended."""
    continuation_ids: np.ndarray
    """The fragment's recorded continuation ids (final fragments only), read-only int32."""


@dataclass(frozen=True)
class PackReport:
    """What packing kept, left out and why."""

    rows: int
    """Rows in the batch (fragments of included attempts)."""
    attempts: int
    """Attempts in the batch."""
    excluded: Mapping[str, int] = field(default_factory=dict)
    """Attempts left out by treatment 'exclude', per end reason."""
    retry: Mapping[str, int] = field(default_factory=dict)
    """Attempts left out by treatment 'retry', per end reason (to be tried again)."""
    dropped_groups: tuple[str, ...] = ()
    """Groups left with fewer than ``min_group_size`` attempts, dropped whole."""
    dropped_attempts: int = 0
    """Attempts dropped with those groups."""
    rows_without_actions: int = 0
    """Fragments with no action position (left out unless ``keep_rows_without_actions``)."""


@dataclass(frozen=True)
class PackedBatch:
    """Padded tensors of a batch; ``B`` rows (fragments), ``T`` positions, ``A`` attempts."""

    input_ids: torch.Tensor
    """(B, T) int64 token ids; ``pad_token_id`` where attention_mask is 0."""
    attention_mask: torch.Tensor
    """(B, T) int64, 1 on real tokens, 0 on padding."""
    action_mask: torch.Tensor
    """(B, T) bool, True only on action tokens (never prompt, observation, summary, padding)."""
    role_ids: torch.Tensor
    """(B, T) int8 index into ``ROLES`` per token, -1 on padding."""
    behavior_logprobs: torch.Tensor
    """(B, T) float32 logprob under the sampling distribution; 0 off actions."""
    policy_version: torch.Tensor
    """(B, T) int64 version of the policy that sampled each action token; -1 off actions."""
    token_rewards: torch.Tensor
    """(B, T) float32: process rewards on the last action token of their turn, plus the
    attempt's reward on the last action token of its final fragment when it is scored."""
    attempt_index: torch.Tensor
    """(B,) int64 index into ``attempt_ids``."""
    task_index: torch.Tensor
    """(B,) int64 index into ``task_ids``."""
    group_index: torch.Tensor
    """(B,) int64 index into ``group_ids``."""
    fragment_index: torch.Tensor
    """(B,) int64 position of the row's fragment in its attempt."""
    end_reason: torch.Tensor
    """(B,) int64 index into ``END_REASONS`` of the fragment's ending."""
    needs_bootstrap: torch.Tensor
    """(B,) bool: True when the value after the row's last action is the critic's value of the
    continuation state; False when it is 0 (the attempt was scored)."""
    continuation_ids: torch.Tensor
    """(B, C) int64 the continuation state of rows that need a bootstrap, padded like rows."""
    continuation_mask: torch.Tensor
    """(B, C) int64, 1 on real continuation tokens."""
    attempt_rewards: torch.Tensor
    """(A,) float32 the attempt's reward (0 when not scored; see ``attempt_scored``)."""
    attempt_scored: torch.Tensor
    """(A,) bool: the attempt's treatment is 'score' (its reward is a training signal)."""
    attempt_group_index: torch.Tensor
    """(A,) int64 group of each attempt, for group-relative advantages over whole attempts."""
    attempt_ids: tuple[str, ...]
    """Attempt ids, in batch order."""
    task_ids: tuple[str, ...]
    """Distinct task ids, in order of first appearance."""
    group_ids: tuple[str, ...]
    """Distinct group ids, in order of first appearance."""
    padding_side: PaddingSide
    """Where padding sits in each row."""
    layouts: tuple[RowLayout, ...]
    """Per row structure for :func:`unpack`."""
    headers: tuple[Attempt, ...]
    """Per attempt, its fields other than fragments (fragments=())."""
    report: PackReport
    """What was kept and left out."""


def pack(
    attempts: Sequence[Attempt],
    *,
    has_critic: bool,
    treatments: Mapping[EndReason, Treatment] | None = None,
    padding_side: PaddingSide = "right",
    pad_token_id: int = 0,
    max_length: int | None = None,
    min_group_size: int | None = None,
    keep_rows_without_actions: bool = False,
) -> PackedBatch:
    """Pack attempts into a :class:`PackedBatch` (see the module docstring for the rules).

    ``treatments`` defaults to :func:`default_treatments(has_critic)`; ``bootstrap`` is refused
    without a critic. ``min_group_size`` defaults to 2 without a critic and 1 with one. A row
    longer than ``max_length`` raises ValueError: rows are never cut silently. A fragment with
    no action token (e.g. a tool failed right after compaction) carries no loss, and per-row
    means are undefined on it, so its row is left out and counted unless
    ``keep_rows_without_actions``; :func:`unpack` then returns the attempt without it.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side: must be 'left' or 'right', got {padding_side!r}")
    table = validate_treatments(
        default_treatments(has_critic) if treatments is None else treatments, has_critic
    )
    min_group = (1 if has_critic else 2) if min_group_size is None else min_group_size
    if min_group < 1:
        raise ValueError(f"min_group_size: must be >= 1, got {min_group}")
    seen: set[str] = set()
    excluded: Counter[str] = Counter()
    retry: Counter[str] = Counter()
    kept: list[Attempt] = []
    for attempt in attempts:
        if attempt.attempt_id in seen:
            raise ValueError(f"attempts: {attempt.attempt_id!r} appears twice")
        seen.add(attempt.attempt_id)
        problems = check_attempt(attempt)
        if problems:
            raise ValueError(f"attempts: {attempt.attempt_id!r}: " + "; ".join(problems))
        treatment = table[attempt.end_reason]
        if treatment is Treatment.EXCLUDE:
            excluded[attempt.end_reason.value] += 1
        elif treatment is Treatment.RETRY:
            retry[attempt.end_reason.value] += 1
        else:
            if treatment is Treatment.SCORE and attempt.reward is None:
                raise ValueError(
                    f"attempts: {attempt.attempt_id!r} ends {attempt.end_reason.value!r} "
                    "(treatment 'score') but has no reward"
                )
            kept.append(attempt)
    group_sizes = Counter(a.group_id for a in kept)
    small = {g for g, n in group_sizes.items() if n < min_group}
    dropped = sum(group_sizes[g] for g in small)
    kept = [a for a in kept if a.group_id not in small]

    rows: list[_Row] = []
    for a_index, attempt in enumerate(kept):
        scored = table[attempt.end_reason] is Treatment.SCORE
        for f_index, fragment in enumerate(attempt.fragments):
            following = (
                attempt.fragments[f_index + 1] if f_index + 1 < len(attempt.fragments) else None
            )
            rows.append(_build_row(attempt, a_index, fragment, following, scored))
    empty = sum(1 for r in rows if not r.action.any())
    if not keep_rows_without_actions:
        rows = [r for r in rows if r.action.any()]
    report = PackReport(
        rows=len(rows),
        attempts=len(kept),
        excluded=dict(excluded),
        retry=dict(retry),
        dropped_groups=tuple(sorted(small)),
        dropped_attempts=dropped,
        rows_without_actions=empty,
    )
    return _to_batch(kept, rows, table, padding_side, pad_token_id, max_length, report)


@dataclass
class _Row:
    attempt: int
    fragment: int
    tokens: np.ndarray
    roles: np.ndarray
    action: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    rewards: np.ndarray
    end: EndReason
    needs_bootstrap: bool
    continuation: np.ndarray
    layout: RowLayout


def _build_row(
    attempt: Attempt, a_index: int, fragment: Fragment, following: Fragment | None, scored: bool
) -> _Row:
    tokens: list[np.ndarray] = []
    roles: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    versions: list[np.ndarray] = []
    process: list[tuple[int, float]] = []
    turns = []
    length = 0
    for turn in fragment.turns:
        last_action = -1
        seg_layouts = []
        for seg in turn.segments:
            n = len(seg.token_ids)
            tokens.append(seg.token_ids)
            roles.append(np.full(n, ROLES.index(seg.role), dtype=np.int8))
            length += n
            if seg.role is Role.ACTION:
                assert seg.logprobs is not None  # check_attempt guarantees it
                logprobs.append(seg.logprobs)
                version = -1 if seg.policy_version is None else seg.policy_version
                versions.append(np.full(n, version, dtype=np.int64))
                if n:
                    last_action = length - 1
            else:
                logprobs.append(np.zeros(n, dtype=np.float32))
                versions.append(np.full(n, -1, dtype=np.int64))
            seg_layouts.append(
                SegmentLayout(seg.role, n, seg.sampling, seg.policy_version, seg.engine,
                              seg.agent)
            )
        if turn.process_reward is not None:
            process.append((last_action, turn.process_reward))
        turns.append((turn.process_reward, tuple(seg_layouts)))
    token_arr = _concat(tokens, np.int64)
    role_arr = _concat(roles, np.int8)
    action = role_arr == _ACTION
    rewards = np.zeros(length, dtype=np.float32)
    for position, value in process:
        rewards[position] += np.float32(value)
    if fragment.end is EndReason.CONTINUED:
        assert following is not None  # check_attempt guarantees the chain
        needs_bootstrap = True
        continuation = _context_before_first_action(following)
    else:
        needs_bootstrap = not scored
        if scored:
            positions = np.flatnonzero(action)
            if positions.size == 0:
                raise ValueError(
                    f"attempts: {attempt.attempt_id!r} is scored but its final fragment has no "
                    "action token to carry the reward"
                )
            rewards[positions[-1]] += np.float32(attempt.reward or 0.0)
            continuation = np.zeros(0, dtype=np.int64)
        else:
            continuation = _concat([token_arr, fragment.continuation_ids], np.int64)
    return _Row(
        attempt=a_index,
        fragment=fragment.index,
        tokens=token_arr,
        roles=role_arr,
        action=action,
        logprobs=_concat(logprobs, np.float32),
        versions=_concat(versions, np.int64),
        rewards=rewards,
        end=fragment.end,
        needs_bootstrap=needs_bootstrap,
        continuation=continuation,
        layout=RowLayout(tuple(turns), fragment.end, fragment.continuation_ids),
    )


def _concat(chunks: list[np.ndarray], dtype: type) -> np.ndarray:
    if not chunks:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(chunks).astype(dtype, copy=False)


def _context_before_first_action(fragment: Fragment) -> np.ndarray:
    context: list[np.ndarray] = []
    for turn in fragment.turns:
        for seg in turn.segments:
            if seg.role is Role.ACTION:
                return _concat(context, np.int64)
            context.append(seg.token_ids)
    return _concat(context, np.int64)


def _place(target: np.ndarray, b: int, values: np.ndarray, side: PaddingSide) -> None:
    n = len(values)
    if n == 0:
        return
    if side == "right":
        target[b, :n] = values
    else:
        target[b, target.shape[1] - n :] = values


def _to_batch(
    kept: list[Attempt],
    rows: list[_Row],
    table: Mapping[EndReason, Treatment],
    side: PaddingSide,
    pad_token_id: int,
    max_length: int | None,
    report: PackReport,
) -> PackedBatch:
    n_rows = len(rows)
    width = max((len(r.tokens) for r in rows), default=0)
    if max_length is not None and width > max_length:
        longest = max(rows, key=lambda r: len(r.tokens))
        raise ValueError(
            f"max_length: attempt {kept[longest.attempt].attempt_id!r} fragment "
            f"{longest.fragment} has {width} tokens > {max_length}; rows are never cut"
        )
    cont_width = max((len(r.continuation) for r in rows), default=0)
    input_ids = np.full((n_rows, width), pad_token_id, dtype=np.int64)
    attention = np.zeros((n_rows, width), dtype=np.int64)
    role_ids = np.full((n_rows, width), -1, dtype=np.int8)
    logprobs = np.zeros((n_rows, width), dtype=np.float32)
    versions = np.full((n_rows, width), -1, dtype=np.int64)
    rewards = np.zeros((n_rows, width), dtype=np.float32)
    cont_ids = np.full((n_rows, cont_width), pad_token_id, dtype=np.int64)
    cont_mask = np.zeros((n_rows, cont_width), dtype=np.int64)
    for b, row in enumerate(rows):
        _place(input_ids, b, row.tokens, side)
        _place(attention, b, np.ones(len(row.tokens), dtype=np.int64), side)
        _place(role_ids, b, row.roles, side)
        _place(logprobs, b, np.where(row.action, row.logprobs, 0.0), side)
        _place(versions, b, row.versions, side)
        _place(rewards, b, row.rewards, side)
        _place(cont_ids, b, row.continuation, side)
        _place(cont_mask, b, np.ones(len(row.continuation), dtype=np.int64), side)
    task_ids = tuple(dict.fromkeys(a.task_id for a in kept))
    group_ids = tuple(dict.fromkeys(a.group_id for a in kept))
    task_pos = {t: i for i, t in enumerate(task_ids)}
    group_pos = {g: i for i, g in enumerate(group_ids)}

    def column(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return PackedBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        action_mask=torch.from_numpy(role_ids == _ACTION),
        role_ids=torch.from_numpy(role_ids),
        behavior_logprobs=torch.from_numpy(logprobs),
        policy_version=torch.from_numpy(versions),
        token_rewards=torch.from_numpy(rewards),
        attempt_index=column([r.attempt for r in rows]),
        task_index=column([task_pos[kept[r.attempt].task_id] for r in rows]),
        group_index=column([group_pos[kept[r.attempt].group_id] for r in rows]),
        fragment_index=column([r.fragment for r in rows]),
        end_reason=column([_END_INDEX[r.end] for r in rows]),
        needs_bootstrap=torch.tensor([r.needs_bootstrap for r in rows], dtype=torch.bool),
        continuation_ids=torch.from_numpy(cont_ids),
        continuation_mask=torch.from_numpy(cont_mask),
        attempt_rewards=torch.tensor(
            [a.reward if a.reward is not None else 0.0 for a in kept], dtype=torch.float32
        ),
        attempt_scored=torch.tensor(
            [table[a.end_reason] is Treatment.SCORE for a in kept], dtype=torch.bool
        ),
        attempt_group_index=column([group_pos[a.group_id] for a in kept]),
        attempt_ids=tuple(a.attempt_id for a in kept),
        task_ids=task_ids,
        group_ids=group_ids,
        padding_side=side,
        layouts=tuple(r.layout for r in rows),
        headers=tuple(dataclasses.replace(a, fragments=()) for a in kept),
        report=report,
    )


def unpack(batch: PackedBatch) -> list[Attempt]:
    """Rebuild the batch's attempts from its tensors and layouts (exact inverse of pack)."""
    fragments: dict[int, list[Fragment]] = {}
    input_ids = batch.input_ids.numpy()
    attention = batch.attention_mask.numpy().astype(bool)
    logprobs = batch.behavior_logprobs.numpy()
    versions = batch.policy_version.numpy()
    for b, layout in enumerate(batch.layouts):
        real = np.flatnonzero(attention[b])
        ids = input_ids[b, real]
        lps = logprobs[b, real]
        vers = versions[b, real]
        expected = sum(s.length for _, segs in layout.turns for s in segs)
        if expected != len(ids):
            raise ValueError(f"batch: row {b} has {len(ids)} tokens, its layout {expected}")
        pos = 0
        turns: list[Turn] = []
        for process_reward, seg_layouts in layout.turns:
            segs: list[Segment] = []
            for s in seg_layouts:
                chunk = ids[pos : pos + s.length]
                if s.role is Role.ACTION:
                    segment_versions = set(vers[pos : pos + s.length].tolist())
                    if s.length and segment_versions != {s.policy_version}:
                        raise ValueError(
                            f"batch: row {b} policy_version tensor {sorted(segment_versions)} "
                            f"disagrees with the segment's version {s.policy_version}"
                        )
                    segs.append(Segment(
                        role=s.role,
                        token_ids=chunk,
                        logprobs=lps[pos : pos + s.length],
                        sampling=s.sampling,
                        policy_version=s.policy_version,
                        engine=s.engine,
                        agent=s.agent,
                    ))
                else:
                    segs.append(Segment(role=s.role, token_ids=chunk, agent=s.agent))
                pos += s.length
            turns.append(Turn(segments=tuple(segs), process_reward=process_reward))
        a_index = int(batch.attempt_index[b])
        fragments.setdefault(a_index, []).append(Fragment(
            index=int(batch.fragment_index[b]),
            turns=tuple(turns),
            end=layout.end,
            continuation_ids=layout.continuation_ids,
        ))
    return [
        dataclasses.replace(header, fragments=tuple(fragments.get(i, ())))
        for i, header in enumerate(batch.headers)
    ]
