"""The one description of a rollout: decoding, budgets and conversation format.

Training rollouts, the trainer's held-out evaluations, ``tracerl eval`` and ``tracerl serve``
all read a :class:`RolloutConfig` (the ``rollout`` section of a training recipe).
:func:`collector_config` is the only mapping from it to the collector's settings, and
:func:`write_rollout` saves it beside every checkpoint and policy a run writes, so that a
policy is evaluated and served with the turn and token limits, sampling and decoding rules
its run used (:func:`read_rollout`).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tracerl.rollout.collect.collector import CollectorConfig
from tracerl.rollout.collect.compaction import CompactionConfig
from tracerl.rollout.policies.sampling import SamplingParams

ROLLOUT_FILE = "tracerl_rollout.json"
"""Written beside every checkpoint and saved policy of a run: its :class:`RolloutConfig`."""


@dataclass(frozen=True)
class RolloutConfig:
    """How attempts are collected: by training, by every evaluation and by ``tracerl serve``
    (saved beside every checkpoint and policy as ``ROLLOUT_FILE``)."""

    RENAMED: ClassVar[dict[str, str]] = {"max_new_tokens": "max_turn_tokens"}
    """Keys of earlier versions and the field each became (a recipe using one is refused
    with the new name)."""

    engine: str = "local"
    """What samples the training attempts: ``local`` (the trainer's own sampler, in its
    process) or ``vllm`` (a vLLM server given the trainer's weights before every collection
    and verified to serve them; the ``vllm`` section says how to start or reach it). Held-out
    evaluations, ``tracerl eval`` and ``tracerl serve`` sample locally with either."""
    tasks_per_step: int = 16
    """Distinct tasks per training step."""
    group_size: int = 8
    """Attempts per task (G); group methods need >= 2."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (and of sampled evaluation)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off), for training rollouts and sampled evaluation alike.
    Below 1 the sampler's (behavior) distribution is the truncated one while the PPO ratio's
    old policy is the full softmax: the ``mismatch.*`` metrics show the gap, and
    ``update.tis_cap`` can correct for it. In the demo's setting 0.8 collapsed the policy
    within ten steps (docs/training.md): keep 1 for training unless measured otherwise."""
    top_k: int = 0
    """Top-k sampling (0 = off); like ``top_p``, for rollouts and sampled evaluation."""
    max_turns: int = 8
    """Most agent turns (tool calls) per attempt before truncation. The built-in suite's tasks
    take it as their budget; a task file's own ``budget.max_turns`` ends an attempt sooner
    when it is smaller."""
    max_turn_tokens: int = 64
    """Most tokens generated per turn (one action); a longer action is cut there."""
    max_attempt_tokens: int | None = None
    """Most tokens generated over a whole attempt (all its turns); then it ends
    ``truncated_tokens``. None: no limit beyond turns and context. A task's own
    ``budget.max_new_tokens`` takes precedence."""
    max_seconds: float | None = None
    """Wall-clock limit per attempt; None: none."""
    compact_at_tokens: int | None = None
    """Context length at which the history is compacted into a summary and the attempt goes on
    as a new fragment; None: never compact."""
    concurrency: int = 32
    """Attempts in flight at once (also the sampler's largest batch)."""
    env_workers: int = 4
    """Threads running environment steps (sandboxed test runs) beside generation."""
    threads: int | None = None
    """torch intra-op threads while attempts are collected (training steps and evaluations);
    None: the run's ``threads``. Sampling a small model is a stream of small operations that
    a second thread mostly waits on, and the sandboxed test runs want a core of their own: on
    2 CPU cores, with 1 the demo's sampler took about 35% less time and its collection about
    15% less wall time (measured, docs/training.md), while its updates (large matrix products)
    took about 40% less with 2."""
    system_prompt: str | None = None
    """System message before the first observation."""
    constrain_edits: bool = False
    """Constrained decoding of ``replace``'s ``old`` (``rollout.decoding.constraints``): inside that
    string the sampler may only write a piece of the named line of the open file, closed
    where it occurs once, as grammar-constrained decoding keeps tool calls well-formed. The
    policy still chooses the tool, the line, the piece and the ``new`` text. Applies to
    training rollouts and to every evaluation of the run (and is recorded beside saved
    policies, so ``tracerl eval`` decodes them the same way); the behavior logprob is the
    masked distribution's, the PPO ratio's old policy the unmasked one (``mismatch.*``)."""
    constrain_calls: bool = False
    """Grammar-constrained tool calls (``rollout.decoding.grammar``): the sampler only draws tokens
    that keep an action one well-formed call of one of the environment's tools, as serving
    stacks' structured output for function calling does; what the call says stays the
    policy's. Recorded beside saved policies like ``constrain_edits``, with the same
    accounting (behavior logprob masked, old/new unmasked: ``mismatch.*``)."""
    show_tool_schemas: bool = True
    """Render the tools' JSON schemas into the prompt (long); off: the system prompt alone
    tells the policy about the tools (the tiny demo model's choice)."""
    process_reward: bool = False
    """Give each turn that ran the visible tests a process reward (the pass rate). Off by
    default: it rewards what the visible tests measure, a possible source of bias."""
    process_reward_coef: float = 0.1
    """Scale of the process reward."""


def collector_config(rollout: RolloutConfig, *, seed: int, temperature: float | None = None,
                     progress: bool = False, handle_signals: bool = False) -> CollectorConfig:
    """The collector's settings for ``rollout`` (``temperature`` overrides the rollout's, e.g.
    0 for a greedy evaluation: top-p and top-k are then off). Every collection of a run
    (training steps, evaluations, ``tracerl eval``) builds its collector with this."""
    t = rollout.temperature if temperature is None else temperature
    sampling = SamplingParams(temperature=t, top_p=rollout.top_p if t else 1.0,
                              top_k=rollout.top_k if t else 0,
                              max_new_tokens=rollout.max_turn_tokens)
    compaction = (CompactionConfig(threshold_tokens=rollout.compact_at_tokens)
                  if rollout.compact_at_tokens is not None else None)
    return CollectorConfig(
        sampling=sampling, max_turns=rollout.max_turns,
        max_attempt_tokens=rollout.max_attempt_tokens, max_seconds=rollout.max_seconds,
        max_concurrent=rollout.concurrency, max_batch_size=rollout.concurrency,
        env_workers=rollout.env_workers, seed=seed, system_prompt=rollout.system_prompt,
        tools=None if rollout.show_tool_schemas else (), compaction=compaction,
        progress=progress, handle_signals=handle_signals, verify_truncated=True,
        constrain_edits=rollout.constrain_edits, constrain_calls=rollout.constrain_calls)


def rollout_json(rollout: RolloutConfig) -> str:
    """The content of ``ROLLOUT_FILE`` for ``rollout``."""
    return json.dumps(dataclasses.asdict(rollout), indent=1)


def write_rollout(directory: str | Path, rollout: RolloutConfig) -> Path:
    """Save ``rollout`` in ``directory`` (beside a policy); returns the file."""
    path = Path(directory) / ROLLOUT_FILE
    path.write_text(rollout_json(rollout), encoding="utf-8")
    return path


def rollout_from_dict(data: Mapping[str, Any], where: str = "rollout") -> RolloutConfig:
    """A :class:`RolloutConfig` from a mapping; ValueError naming ``where`` and the key for an
    unknown or renamed key or a value of the wrong type."""
    known = {f.name for f in dataclasses.fields(RolloutConfig)}
    hints = typing.get_type_hints(RolloutConfig)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in RolloutConfig.RENAMED:
            raise ValueError(f"{where}.{key}: renamed; use {where}.{RolloutConfig.RENAMED[key]}")
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown key; RolloutConfig accepts "
                             f"{', '.join(sorted(known))}")
        if not _fits(value, hints[key]):
            raise ValueError(f"{where}.{key}: got {value!r}, accepts {hints[key]}")
        kwargs[key] = float(value) if hints[key] is float else value
    return RolloutConfig(**kwargs)


def _fits(value: Any, hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return False


def read_rollout(directory: str | Path) -> RolloutConfig | None:
    """The rollout config saved beside the policy in ``directory``; None when there is none
    (a policy not written by a tracerl run, or by one from before the file existed)."""
    path = Path(directory) / ROLLOUT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: could not be read ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return rollout_from_dict(data, where=str(path))
