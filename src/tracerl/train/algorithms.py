"""Advantage estimators: a small registry of pure functions over a packed batch.

Each estimator takes an :class:`AdvantageInputs` (the packed batch, its token rewards and, for
critic methods, the old values and bootstraps) and the algorithm config, and returns
``[B, T]`` advantages that are zero off the action mask, plus returns for a critic and metrics.
The trainer never special-cases one: it looks the name up in :data:`ESTIMATORS`, whose entries
also say what the estimator needs (a critic, groups of attempts); the config's cross-field
checks read them, so a new estimator is declared in one place.

Group methods compare **whole attempts** at the same task (``attempt_rewards`` grouped by
``attempt_group_index``); the attempt's advantage is then written on every action token of
every fragment of that attempt. Fragments are never treated as independent responses.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tracerl.core import batch_gae, group_advantages, rloo_advantages, whiten
from tracerl.trace import PackedBatch, Role

if TYPE_CHECKING:
    from tracerl.train.config import AlgorithmConfig


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may use."""

    batch: PackedBatch
    """The packed batch (rows are fragments of the included attempts)."""
    token_rewards: torch.Tensor
    """(B, T) rewards per token: process rewards, the outcome on the last action of a scored
    attempt, minus a per-token KL penalty when KL is in the reward."""
    values: torch.Tensor | None = None
    """(B, T) old critic values per position (critic methods only)."""
    bootstrap_values: torch.Tensor | None = None
    """(B,) value after each row's last action: the critic's value of the continuation state
    where ``needs_bootstrap``, 0 where the attempt was scored (critic methods only)."""


@dataclass(frozen=True)
class AdvantageResult:
    """An estimator's output."""

    advantages: torch.Tensor
    """(B, T) float32, zero off the action mask."""
    returns: torch.Tensor | None = None
    """(B, T) regression targets for the critic, or None."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Group statistics and advantage statistics for logging."""


EstimatorFn = Callable[[AdvantageInputs, "AlgorithmConfig"], AdvantageResult]


@dataclass(frozen=True)
class EstimatorEntry:
    """A registered estimator and what a run must provide for it."""

    fn: EstimatorFn
    """The estimator itself."""
    needs_critic: bool
    """It reads the critic's values and bootstraps (``critic.kind`` must not be ``none``, and
    a critic is refused for every estimator without this)."""
    needs_groups: bool
    """It compares whole attempts at the same task (``rollout.group_size`` >= 2)."""


ESTIMATORS: dict[str, EstimatorEntry] = {}
"""Registered estimators by name; the config's ``algorithm.estimator`` is checked against the
same names, and against what each entry needs, when it loads."""


def register(name: str, *, needs_critic: bool = False, needs_groups: bool = False
             ) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator adding an estimator to :data:`ESTIMATORS`, with what it needs."""

    def add(fn: EstimatorFn) -> EstimatorFn:
        if name in ESTIMATORS:
            raise ValueError(f"estimator {name!r} is already registered")
        ESTIMATORS[name] = EstimatorEntry(fn, needs_critic, needs_groups)
        return fn

    return add


def compute_advantages(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageResult:
    """Run the configured estimator, then optional whitening, and add advantage statistics."""
    if config.estimator not in ESTIMATORS:
        raise ValueError(f"algorithm.estimator: unknown {config.estimator!r}; "
                         f"registered: {sorted(ESTIMATORS)}")
    result = ESTIMATORS[config.estimator].fn(inputs, config)
    mask = inputs.batch.action_mask
    advantages = result.advantages
    if config.whiten and bool(mask.any()):
        advantages = whiten(advantages, mask)
    metrics = dict(result.metrics)
    if bool(mask.any()):
        values = advantages[mask]
        metrics.update({
            "advantage/mean": float(values.mean()), "advantage/std": float(values.std(False)),
            "advantage/min": float(values.min()), "advantage/max": float(values.max()),
            "advantage/zero_fraction": float((values == 0).float().mean()),
        })
    return AdvantageResult(advantages.float() * mask, result.returns, metrics)


# -- layout helpers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnSpan:
    """Where one turn's action tokens sit in a padded row."""

    row: int
    """Row of the batch."""
    turn: int
    """Turn index within the attempt (counting over its fragments)."""
    first_action: int
    """Position of the turn's first action token (-1 if it has none)."""
    last_action: int
    """Position of the turn's last action token (-1 if it has none)."""
    process_reward: float | None
    """The turn's process reward, if any."""
    observation_key: bytes
    """Tokens of the latest context segment before the turn's first action."""


def turn_spans(batch: PackedBatch) -> list[list[TurnSpan]]:
    """Per attempt (in batch order), its turns in order across fragments."""
    width = batch.input_ids.shape[1]
    lengths = batch.attention_mask.sum(-1).tolist()
    per_attempt: dict[int, list[TurnSpan]] = defaultdict(list)
    order = sorted(range(len(batch.layouts)),
                   key=lambda b: (int(batch.attempt_index[b]), int(batch.fragment_index[b])))
    ids = batch.input_ids
    for b in order:
        offset = 0 if batch.padding_side == "right" else width - int(lengths[b])
        a = int(batch.attempt_index[b])
        position = offset
        last_context: tuple[int, int] = (offset, offset)
        for process_reward, segments in batch.layouts[b].turns:
            first = last = -1
            key = b""
            for segment in segments:
                if segment.role is Role.ACTION and segment.length:
                    if first < 0:
                        first = position
                        key = ids[b, last_context[0]:last_context[1]].numpy().tobytes()
                    last = position + segment.length - 1
                elif segment.role is not Role.ACTION and segment.length:
                    last_context = (position, position + segment.length)
                position += segment.length
            per_attempt[a].append(TurnSpan(b, len(per_attempt[a]), first, last,
                                           process_reward, key))
    return [per_attempt[a] for a in range(len(batch.attempt_ids))]


def _attempt_to_tokens(batch: PackedBatch, per_attempt: torch.Tensor) -> torch.Tensor:
    """(A,) values → (B, T) on each row's action tokens."""
    rows = per_attempt.to(torch.float32)[batch.attempt_index]
    return rows[:, None] * batch.action_mask.float()


def _group_report_metrics(report: object) -> dict[str, float]:
    num_groups = getattr(report, "num_groups", 0)
    return {"groups/count": float(num_groups),
            "groups/uniform_fraction": float(getattr(report, "fraction_uniform", 0.0))}


def _process_to_go(batch: PackedBatch, spans: list[list[TurnSpan]], gamma: float,
                   normalise: Callable[[list[float], int], list[float]]) -> torch.Tensor:
    """(B, T) sum of (normalised) process rewards of this and later turns, per action token."""
    out = torch.zeros(batch.action_mask.shape, dtype=torch.float32)
    for a, turns in enumerate(spans):
        rewards = [t.process_reward for t in turns]
        if all(r is None for r in rewards):
            continue
        present = [r for r in rewards if r is not None]
        scaled = iter(normalise(present, a))
        values = [next(scaled) if r is not None else 0.0 for r in rewards]
        to_go = 0.0
        for span, value in zip(reversed(turns), reversed(values), strict=True):
            to_go = value + gamma * to_go
            if span.first_action >= 0:
                out[span.row, span.first_action:span.last_action + 1] = to_go
    return out * batch.action_mask.float()


def _group_process_normaliser(batch: PackedBatch, spans: list[list[TurnSpan]],
                              config: AlgorithmConfig) -> Callable[[list[float], int], list[float]]:
    """DeepSeekMath §4.1.3: process rewards normalised by the mean/std of the whole group's."""
    by_group: dict[int, list[float]] = defaultdict(list)
    for a, turns in enumerate(spans):
        g = int(batch.attempt_group_index[a])
        by_group[g].extend(t.process_reward for t in turns if t.process_reward is not None)
    stats: dict[int, tuple[float, float]] = {}
    for g, values in by_group.items():
        tensor = torch.tensor(values, dtype=torch.float64)
        mean = float(tensor.mean()) if values else 0.0
        if config.scale == "std" and len(values) > 1:
            std = float(tensor.std(unbiased=config.std == "sample"))
        else:
            std = 1.0
        stats[g] = (mean, std)

    def normalise(values: list[float], attempt: int) -> list[float]:
        mean, std = stats[int(batch.attempt_group_index[attempt])]
        return [(v - mean) / (std + 1e-6) for v in values]

    return normalise


def _outcome_group(inputs: AdvantageInputs, config: AlgorithmConfig,
                   leave_one_out: bool) -> tuple[torch.Tensor, dict[str, float]]:
    batch = inputs.batch
    if not bool(batch.attempt_scored.all()):
        raise ValueError("group estimators need every attempt in the batch scored; an attempt "
                         "whose treatment is 'bootstrap' needs a critic estimator")
    rewards = batch.attempt_rewards.double()
    groups = batch.attempt_group_index
    _, report = group_advantages(rewards, groups, scale="std", std=config.std)
    if leave_one_out:
        per_attempt = rloo_advantages(rewards, groups)
    else:
        per_attempt, _ = group_advantages(
            rewards, groups, scale=None if config.scale == "none" else "std", std=config.std)
    advantages = _attempt_to_tokens(batch, per_attempt)
    spans = turn_spans(batch)
    if any(t.process_reward is not None for turns in spans for t in turns):
        normalise = _group_process_normaliser(batch, spans, config)
        advantages = advantages + _process_to_go(batch, spans, config.gamma, normalise)
    return advantages, _group_report_metrics(report)


@register("grpo", needs_groups=True)
def grpo(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageResult:
    """GRPO (Shao et al. 2024): ``(R - mean_g) / (std_g + eps)`` of whole-attempt outcomes,
    the same on every action token of the attempt; ``scale: none`` is Dr. GRPO. Process
    rewards, when present, are normalised over the group and summed to go (§4.1.3)."""
    advantages, metrics = _outcome_group(inputs, config, leave_one_out=False)
    return AdvantageResult(advantages, None, metrics)


@register("rloo", needs_groups=True)
def rloo(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageResult:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``R_i`` minus the mean of the other
    attempts of its group; unbiased, never divided by a std."""
    advantages, metrics = _outcome_group(inputs, config, leave_one_out=True)
    return AdvantageResult(advantages, None, metrics)


@register("gae", needs_critic=True)
def gae_estimator(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageResult:
    """GAE (Schulman et al. 2016) over action tokens with a learned critic.

    Observation, summary and padding positions are passed over; the value after a row's last
    action is its bootstrap: 0 for a scored (terminated) attempt, the critic's value of the
    continuation state for a truncated attempt or a ``continued`` fragment.
    """
    if inputs.values is None or inputs.bootstrap_values is None:
        raise ValueError("estimator 'gae' needs values and bootstrap_values from a critic")
    batch = inputs.batch
    bootstrap = torch.where(batch.needs_bootstrap, inputs.bootstrap_values.float(),
                            torch.zeros_like(inputs.bootstrap_values.float()))
    advantages, returns = batch_gae(inputs.token_rewards.float(), inputs.values.float(),
                                    batch.action_mask, bootstrap, gamma=config.gamma,
                                    trace_decay=config.gae_lambda)
    metrics = {"critic/bootstrapped_rows": float(batch.needs_bootstrap.sum())}
    return AdvantageResult(advantages, returns, metrics)


def group_outcome_metrics(rewards: torch.Tensor, group_index: torch.Tensor) -> dict[str, float]:
    """Uniform-group counts of whole-attempt rewards (all-zero and all-one apart), for any
    estimator; groups of one are counted as neither mixed nor uniform."""
    counts = torch.bincount(group_index)
    low = torch.full((len(counts),), float("inf"), dtype=torch.float64)
    high = torch.full((len(counts),), float("-inf"), dtype=torch.float64)
    low = low.scatter_reduce(0, group_index, rewards.double(), "amin")
    high = high.scatter_reduce(0, group_index, rewards.double(), "amax")
    real = counts >= 2
    uniform = real & (low == high)
    total = int(real.sum())
    return {
        "groups/count": float(total),
        "groups/uniform_fraction": float(uniform.sum()) / total if total else 0.0,
        "groups/uniform_zero": float((uniform & (low == 0)).sum()),
        "groups/uniform_one": float((uniform & (low == 1)).sum()),
        "groups/mixed": float((real & ~uniform).sum()),
    }


@register("gigpo", needs_groups=True)
def gigpo(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageResult:
    """GiGPO-style two-level groups (Feng et al. 2025): the episode-level GRPO advantage plus
    ``step_weight`` times a step-level one.

    Steps of different attempts at the same task whose states are identical (same token
    context before the action, or same latest observation at the same turn) form a step
    group; a step's return is its discounted outcome to go (``gamma`` per later turn) plus
    process rewards to go, normalised within its step group. Steps alone in their state get
    no step-level signal.
    """
    batch = inputs.batch
    episode, metrics = _outcome_group(inputs, config, leave_one_out=False)
    spans = turn_spans(batch)
    groups: dict[tuple[int, bytes], list[tuple[TurnSpan, float]]] = defaultdict(list)
    for a, turns in enumerate(spans):
        outcome = float(batch.attempt_rewards[a])
        process = [t.process_reward or 0.0 for t in turns]
        to_go = 0.0
        returns: list[float] = []
        for i in reversed(range(len(turns))):
            to_go = process[i] + (outcome if i == len(turns) - 1 else 0.0) + config.gamma * to_go
            returns.append(to_go)
        returns.reverse()
        g = int(batch.attempt_group_index[a])
        for i, span in enumerate(turns):
            if span.first_action < 0:
                continue
            if config.step_key == "context":
                row = span.row
                start = 0 if batch.padding_side == "right" else int(
                    batch.input_ids.shape[1] - batch.attention_mask[row].sum())
                context = batch.input_ids[row, start:span.first_action].numpy().tobytes()
                key = hashlib.sha1(int(batch.fragment_index[row]).to_bytes(4, "little")
                                   + context).digest()
            else:
                key = hashlib.sha1(i.to_bytes(4, "little") + span.observation_key).digest()
            groups[(g, key)].append((span, returns[i]))
    step = torch.zeros(batch.action_mask.shape, dtype=torch.float32)
    shared = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        shared += 1
        values = torch.tensor([r for _, r in members], dtype=torch.float64)
        centred = values - values.mean()
        if config.scale == "std":
            centred = centred / (values.std(unbiased=config.std == "sample") + 1e-6)
        for (span, _), value in zip(members, centred.tolist(), strict=True):
            step[span.row, span.first_action:span.last_action + 1] = value
    metrics["gigpo/step_groups"] = float(shared)
    metrics["gigpo/steps_grouped_fraction"] = float(
        sum(len(m) for m in groups.values() if len(m) > 1)) / max(
        1, sum(len(m) for m in groups.values()))
    advantages = episode + config.step_weight * step * batch.action_mask.float()
    return AdvantageResult(advantages, None, metrics)
