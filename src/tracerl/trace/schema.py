"""The trace data model: attempts, fragments, turns and role-tagged token segments.

An *attempt* is one try at one task. Compaction may split it into several *fragments*; each
fragment is a sequence of *turns*, and each turn is a sequence of *segments* of token ids that
share one role. Only ``action`` tokens were sampled by the policy, and only they carry behavior
logprobs, sampling parameters, a policy version and an engine. Every record is a frozen
dataclass so it crosses process boundaries (files, Ray) intact.

The reason an attempt stopped is an :class:`EndReason`; what training does with it is a
:class:`Treatment`, declared per reason (see :func:`default_treatments`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
from numpy.typing import ArrayLike


class Role(str, Enum):
    """Who produced a segment's tokens."""

    PROMPT = "prompt"
    """System prompt or task instruction: context given before the agent acts."""
    ACTION = "action"
    """Tokens sampled by the policy: the only positions that get advantages and loss."""
    OBSERVATION = "observation"
    """Tool or environment output. Concatenated into the sequence, still never an action."""
    SUMMARY = "summary"
    """Text inserted by compaction in place of dropped history; context, not an action."""


class EndReason(str, Enum):
    """Why a fragment stopped. All values but ``continued`` are endings of the attempt."""

    TERMINATED = "terminated"
    """The task is over: the agent submitted, or the episode ended naturally. Future value 0."""
    TRUNCATED_TOKENS = "truncated_tokens"
    """The attempt's stated token budget (context or generation) ran out; the task was not over."""
    TRUNCATED_TURNS = "truncated_turns"
    """The attempt's stated turn budget ran out; the task was not over."""
    TIMEOUT = "timeout"
    """The attempt's wall-clock limit passed. Wall time also depends on machine load."""
    TOOL_ERROR = "tool_error"
    """A tool or the sandbox failed (not the agent): infrastructure, never the policy's fault."""
    CANCELLED = "cancelled"
    """The collector stopped the attempt (shutdown, pre-emption, a stale policy); not the agent."""
    BUDGET_EXHAUSTED = "budget_exhausted"
    """The attempt's stated cost budget (tool calls, tool seconds, spend) ran out."""
    CONTINUED = "continued"
    """Compaction closed this fragment and the task goes on in the next one: not an ending."""


ATTEMPT_ENDINGS: tuple[EndReason, ...] = tuple(r for r in EndReason if r is not EndReason.CONTINUED)
"""Every reason that can end an attempt (all but ``continued``)."""

END_REASONS: tuple[EndReason, ...] = tuple(EndReason)
"""Stable order of end reasons; packed tensors store an index into it."""

ROLES: tuple[Role, ...] = tuple(Role)
"""Stable order of roles; packed tensors and stored records use an index into it."""


class Treatment(str, Enum):
    """What training does with an attempt that ended for a given reason."""

    SCORE = "score"
    """Use the verifier's reward, placed on the last action token; future value 0."""
    BOOTSTRAP = "bootstrap"
    """No verifier reward; the trainer adds the critic's value of the continuation state."""
    EXCLUDE = "exclude"
    """Kept and counted in the store, left out of the batch (and out of its group's baseline)."""
    RETRY = "retry"
    """Left out of the batch like ``exclude``, counted apart, and the task is to be tried again."""


def default_treatments(has_critic: bool) -> dict[EndReason, Treatment]:
    """The documented default treatment of every attempt ending.

    With a critic, the budget endings (tokens, turns, wall clock, cost) bootstrap from the
    state the task would have continued from: the task was not over, so a future value of 0
    would be wrong. Without a critic nothing can bootstrap; group methods then score token,
    turn and cost truncations with the verifier, because those budgets are stated to the agent
    and are part of the task. A wall-clock timeout is excluded without a critic: wall time
    depends on machine load and server latency the policy does not control. Tool errors and
    cancellations are infrastructure failures: excluded and counted, never scored as the
    policy's failure.
    """
    budget = Treatment.BOOTSTRAP if has_critic else Treatment.SCORE
    return {
        EndReason.TERMINATED: Treatment.SCORE,
        EndReason.TRUNCATED_TOKENS: budget,
        EndReason.TRUNCATED_TURNS: budget,
        EndReason.TIMEOUT: Treatment.BOOTSTRAP if has_critic else Treatment.EXCLUDE,
        EndReason.TOOL_ERROR: Treatment.EXCLUDE,
        EndReason.CANCELLED: Treatment.EXCLUDE,
        EndReason.BUDGET_EXHAUSTED: budget,
    }


def validate_treatments(
    treatments: Mapping[EndReason, Treatment], has_critic: bool
) -> dict[EndReason, Treatment]:
    """Check a treatment table: every attempt ending named once, ``bootstrap`` only with a critic.

    ``continued`` is not an attempt ending and may not appear: a continued fragment always
    continues in the next fragment of the same attempt.
    """
    table: dict[EndReason, Treatment] = {}
    for reason, treatment in treatments.items():
        reason, treatment = EndReason(reason), Treatment(treatment)
        if reason is EndReason.CONTINUED:
            raise ValueError("treatments: 'continued' is not an attempt ending and has no treatment")
        if treatment is Treatment.BOOTSTRAP and not has_critic:
            raise ValueError(
                f"treatments: {reason.value!r} -> 'bootstrap' needs a critic (has_critic=False); "
                "use 'score' or 'exclude'"
            )
        if treatment is Treatment.SCORE and reason in (EndReason.TOOL_ERROR, EndReason.CANCELLED):
            raise ValueError(
                f"treatments: {reason.value!r} is an infrastructure failure and cannot be scored "
                "as the policy's failure; use 'exclude' or 'retry'"
            )
        table[reason] = treatment
    missing = [r.value for r in ATTEMPT_ENDINGS if r not in table]
    if missing:
        raise ValueError(f"treatments: no treatment for {missing}")
    return table


@dataclass(frozen=True)
class SamplingParams:
    """The distribution an action segment was sampled from."""

    temperature: float
    """Softmax temperature (0 means greedy)."""
    top_p: float = 1.0
    """Nucleus mass kept (1.0 = off)."""
    top_k: int | None = None
    """Number of most likely tokens kept (None = off)."""
    max_new_tokens: int | None = None
    """Generation cap for this segment (None = none stated)."""
    seed: int | None = None
    """Sampler seed, when the engine was given one."""
    constraint: str | None = None
    """The decoding rule that masked the distribution (``"edit_old"``: constrained ``replace``
    ``old``, ``rollout.decoding.constraints``), None when there was none. The segment's logprobs are
    the masked distribution's."""


def token_array(values: ArrayLike, name: str = "token_ids") -> np.ndarray:
    """A read-only int32 array of token ids (ValueError if an id does not fit)."""
    if isinstance(values, np.ndarray) and values.dtype == np.int32 and not values.flags.writeable:
        return values
    array = np.asarray(values)
    if array.size == 0:
        array = np.zeros(0, dtype=np.int32)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{name}: must be a 1-D sequence of integers, got {array.dtype} "
                         f"with shape {array.shape}")
    if array.size and (array.min() < 0 or array.max() > 2**31 - 1):
        raise ValueError(f"{name}: token ids must be in [0, 2**31 - 1]")
    array = array.astype(np.int32)  # a copy: the record never aliases the caller's buffer
    array.flags.writeable = False
    return array


def logprob_array(values: ArrayLike) -> np.ndarray:
    """A read-only float32 array of logprobs (the precision engines report and we store)."""
    if isinstance(values, np.ndarray) and values.dtype == np.float32 and not values.flags.writeable:
        return values
    array = np.asarray(values, dtype=np.float32).copy()
    if array.ndim != 1:
        raise ValueError(f"logprobs: must be 1-D, got shape {array.shape}")
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class Segment:
    """A run of tokens with one role.

    Token ids and logprobs are read-only numpy arrays (int32 and float32): any sequence given
    is converted once. Equality compares their contents.
    """

    role: Role
    """Who produced these tokens."""
    token_ids: np.ndarray
    """Token ids, in order (int32, read-only)."""
    logprobs: np.ndarray | None = None
    """Action only: behavior logprob of each token under the distribution actually sampled
    from (temperature, top-p and top-k applied), float32. None for every other role."""
    sampling: SamplingParams | None = None
    """Action only: the sampling parameters."""
    policy_version: int | None = None
    """Action only: version of the policy weights that sampled these tokens."""
    engine: str | None = None
    """Action only: the engine that sampled them (e.g. 'hf', 'vllm')."""
    agent: str | None = None
    """Several agents in one task: the agent whose context this segment stands in. An action
    segment is that agent's own sample (its policy version is that agent's policy's); what
    another agent sent it is an ``observation`` segment of the receiver. None in a
    single-agent attempt."""

    def __post_init__(self) -> None:
        if self.agent is not None and (not isinstance(self.agent, str) or not self.agent):
            raise ValueError(f"agent: must be a non-empty name or None, got {self.agent!r}")
        object.__setattr__(self, "role", Role(self.role))
        object.__setattr__(self, "token_ids", token_array(self.token_ids))
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", logprob_array(self.logprobs))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Segment):
            return NotImplemented
        return (
            self.role is other.role
            and np.array_equal(self.token_ids, other.token_ids)
            and (
                (self.logprobs is None and other.logprobs is None)
                or (
                    self.logprobs is not None
                    and other.logprobs is not None
                    and np.array_equal(self.logprobs, other.logprobs, equal_nan=True)
                )
            )
            and self.sampling == other.sampling
            and self.policy_version == other.policy_version
            and self.engine == other.engine
            and self.agent == other.agent
        )

    __hash__ = None  # type: ignore[assignment]  # contents are arrays: not hashable


@dataclass(frozen=True)
class Turn:
    """One exchange: context segments, the agent's action(s) and what came back."""

    segments: tuple[Segment, ...]
    """The turn's segments, in sequence order."""
    process_reward: float | None = None
    """Optional intermediate reward for this turn, placed on its last action token."""


@dataclass(frozen=True, eq=False)
class Fragment:
    """A contiguous training sequence of one attempt; compaction starts a new one."""

    index: int
    """Position in the attempt's chain: 0, 1, 2, ... without gaps."""
    turns: tuple[Turn, ...]
    """The fragment's turns in order."""
    end: EndReason
    """``continued`` if compaction closed it; for the last fragment, the attempt's ending."""
    continuation_ids: np.ndarray = field(default_factory=lambda: token_array(()))
    """Last fragment only: tokens that followed the last action (e.g. the observation that came
    back) when the attempt was cut off. Appended to the fragment they form the state a critic
    bootstraps from. Empty when nothing followed (int32, read-only)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "end", EndReason(self.end))
        object.__setattr__(self, "turns", tuple(self.turns))
        object.__setattr__(
            self, "continuation_ids", token_array(self.continuation_ids, "continuation_ids")
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fragment):
            return NotImplemented
        return (
            self.index == other.index
            and self.turns == other.turns
            and self.end is other.end
            and np.array_equal(self.continuation_ids, other.continuation_ids)
        )

    __hash__ = None  # type: ignore[assignment]  # contents are arrays: not hashable


@dataclass(frozen=True)
class VerifierResult:
    """What the verifier said about the attempt's final state."""

    passed: bool
    """Whether the attempt counts as solved."""
    score: float
    """The verifier's scalar score."""
    details: Mapping[str, float] = field(default_factory=dict)
    """Named sub-scores, e.g. {'visible_pass': 1.0, 'hidden_pass': 0.5}."""
    log: str = ""
    """Free-form verifier output, kept for inspection."""


@dataclass(frozen=True)
class AuditRecord:
    """What the anti-hacking audit found; the reward already reflects it."""

    protected_modified: tuple[str, ...] = ()
    """Protected paths (tests, answers) the agent changed."""
    protected_reverted: bool = False
    """Whether those changes were reverted before verification."""
    hidden_access_attempts: int = 0
    """Attempts to read hidden tests or answers."""
    flagged: bool = False
    """Whether the attempt was judged a hack (never counts as solving)."""
    reward_if_unaudited: float | None = None
    """The reward the attempt would have had without the audit, for reporting."""


@dataclass(frozen=True)
class Timings:
    """Wall-clock times of the attempt, in seconds."""

    started_at: float = 0.0
    """Unix time the attempt started."""
    finished_at: float = 0.0
    """Unix time the attempt finished."""
    generation_seconds: float = 0.0
    """Time spent sampling actions."""
    verification_seconds: float = 0.0
    """Time spent running the verifier."""


@dataclass(frozen=True)
class Costs:
    """What the attempt consumed."""

    generated_tokens: int = 0
    """Tokens sampled by the policy (may exceed stored action tokens if some were dropped)."""
    tool_seconds: float = 0.0
    """Seconds spent in tools and the sandbox."""
    tool_calls: int = 0
    """Number of tool invocations."""
    turns: int = 0
    """Number of agent turns."""


@dataclass(frozen=True)
class Attempt:
    """One try at one task, as recorded when it finished."""

    attempt_id: str
    """Unique id; the store is idempotent by it."""
    task_id: str
    """The task attempted."""
    group_id: str
    """The group this attempt is compared within (group-relative methods)."""
    fragments: tuple[Fragment, ...]
    """The fragment chain; all but the last end ``continued``."""
    reward: float | None = None
    """The attempt's scalar reward (None when not scored, e.g. after a tool error)."""
    rewards: Mapping[str, float] = field(default_factory=dict)
    """Reward components, e.g. {'hidden_pass': 1.0, 'visible_pass': 1.0}."""
    verifier: VerifierResult | None = None
    """The verifier's result, if it ran."""
    audit: AuditRecord | None = None
    """The audit's result, if it ran."""
    timings: Timings = field(default_factory=Timings)
    """Wall-clock times."""
    costs: Costs = field(default_factory=Costs)
    """Resources consumed."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """JSON-serialisable extras (model name, sandbox image, ...)."""

    @property
    def end_reason(self) -> EndReason:
        """The attempt's ending: the last fragment's end."""
        return self.fragments[-1].end


def check_attempt(attempt: Attempt, *, check_values: bool = True) -> list[str]:
    """Every broken invariant of an attempt, as 'rule: detail' messages (empty if valid).

    ``check_values=False`` skips the logprob value check (finite, <= 0) for callers that do
    it once on the concatenated array.
    """
    problems: list[str] = []
    if not attempt.attempt_id:
        problems.append("attempt_id: empty")
    if not attempt.fragments:
        return [*problems, "fragment chain: the attempt has no fragment"]
    if attempt.reward is not None and not math.isfinite(attempt.reward):
        problems.append(f"reward: not finite ({attempt.reward})")
    for name, value in attempt.rewards.items():
        if not math.isfinite(value):
            problems.append(f"rewards: {name!r} is not finite ({value})")
    last = len(attempt.fragments) - 1
    for position, fragment in enumerate(attempt.fragments):
        where = f"fragment {position}"
        if fragment.index != position:
            problems.append(
                f"fragment chain: {where} has index {fragment.index} (chain must be 0..{last})"
            )
        if position < last and fragment.end is not EndReason.CONTINUED:
            problems.append(
                f"one ending per attempt: {where} ends {fragment.end.value!r} but is followed by "
                "another fragment (only 'continued' may be)"
            )
        if position == last and fragment.end is EndReason.CONTINUED:
            problems.append(f"one ending per attempt: last {where} ends 'continued'")
        if position < last and len(fragment.continuation_ids):
            problems.append(
                f"continuation: {where} continues in the next fragment and must not record "
                "continuation_ids"
            )
        first = next((s for turn in fragment.turns for s in turn.segments), None)
        if first is not None and first.role is Role.ACTION:
            problems.append(f"fragment chain: {where} starts with an action (no context)")
        for t, turn in enumerate(fragment.turns):
            has_action = False
            for s, seg in enumerate(turn.segments):
                problems.extend(
                    _check_segment(seg, f"{where} turn {t} segment {s}", check_values)
                )
                has_action = has_action or (seg.role is Role.ACTION and len(seg.token_ids) > 0)
            if turn.process_reward is not None:
                if not math.isfinite(turn.process_reward):
                    problems.append(f"process reward: {where} turn {t} is not finite")
                if not has_action:
                    problems.append(
                        f"process reward: {where} turn {t} has a process reward but no action token"
                    )
    return problems


def _check_segment(seg: Segment, where: str, check_values: bool) -> list[str]:
    problems: list[str] = []
    if seg.role is Role.ACTION:
        n_logprobs = -1 if seg.logprobs is None else len(seg.logprobs)
        if n_logprobs != len(seg.token_ids):
            problems.append(
                f"logprob count: {where} has {max(n_logprobs, 0)} behavior logprobs for "
                f"{len(seg.token_ids)} action tokens"
            )
        elif check_values and seg.logprobs is not None and not bool(
            np.all(np.isfinite(seg.logprobs) & (seg.logprobs <= 0.0))
        ):
            problems.append(f"logprob range: {where} has a logprob that is > 0 or not finite")
        if seg.sampling is None:
            problems.append(f"sampling params: {where} is an action without sampling params")
        if seg.policy_version is None:
            problems.append(f"policy version: {where} is an action without a policy version")
        if not seg.engine:
            problems.append(f"engine: {where} is an action without an engine")
    elif seg.logprobs is not None or seg.policy_version is not None:
        problems.append(
            f"roles: {where} is {seg.role.value!r} but carries behavior logprobs or a policy "
            "version (only actions are sampled by the policy)"
        )
    return problems
