"""The ``multiagent`` section of a training config: several agents in one task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class MultiAgentConfig:
    """Several agents in one task (``env`` other than ``none``): which task family, how the
    agents' weights are held, and the critic. The rest of the config applies as for one
    agent: ``rollout.tasks_per_step`` and ``group_size`` (joint attempts per task, compared
    with each other), ``rollout.temperature``, ``update.*``, ``algorithm.estimator``
    (``grpo`` or ``rloo``), ``model.*`` (each policy's size), ``steps``,
    ``max_generated_tokens`` and ``eval.samples_per_task``."""

    env: Literal["none", "referential", "coding_pair"] = "none"
    """``referential``: the speaker/listener game (``envs.referential``); ``coding_pair``: a
    tester and a fixer on the run's coding tasks (``envs.pair``, tasks from ``tasks.*``);
    ``none``: one agent."""
    weights: Literal["separate", "shared"] = "separate"
    """``separate``: each agent has its own policy (independent learners); ``shared``: one
    policy acts for every agent, with the agent named at the start of its instruction."""
    critic: Literal["none", "centralized"] = "none"
    """``centralized``: a critic that reads the joint context (every agent's history, in the
    order it happened) gives each action's baseline during training, while each actor still
    conditions only on its own context (centralized training, decentralized execution);
    ``none``: the group of joint attempts at the task is the baseline."""
    critic_lr: float = 3e-3
    """Learning rate of the centralized critic."""
    items: str = "red blue green gold"
    """``referential``: the items, separated by spaces."""
    symbols: str = "ka ki ko ku"
    """``referential``: the words the speaker may send, separated by spaces."""
    candidates: int = 2
    """``referential``: items the listener chooses from."""
    heldout_fraction: float = 0.25
    """``referential``: share of the rounds kept for evaluation."""
    max_turns: int = 12
    """Actions of all agents together before a joint attempt is truncated."""


def validate_multiagent(config: Any) -> None:
    """The ``multiagent`` section's rules, and the single-agent options a joint run does not
    use (refused rather than silently ignored); ValueError names the field."""
    multi: MultiAgentConfig = config.multiagent
    if multi.env == "none":
        return
    if config.algorithm.estimator not in ("grpo", "rloo"):
        raise ValueError(f"algorithm.estimator: {config.algorithm.estimator!r} is not available "
                         "for several agents (use grpo or rloo; multiagent.critic: centralized "
                         "for a learned baseline)")
    if config.rollout.group_size < 2 and multi.critic == "none":
        raise ValueError("rollout.group_size: group-relative advantages compare joint attempts "
                         "at the same task; use at least 2 (or multiagent.critic: centralized)")
    refused = {"critic.kind": config.critic.kind != "none", "sft.enabled": config.sft.enabled,
               "update.kl_coef": config.update.kl_coef > 0,
               "update.sft_coef": config.update.sft_coef > 0,
               "update.ema_decay": config.update.ema_decay is not None,
               "dynamic.filter_uniform": config.dynamic.filter_uniform,
               "dynamic.success_sampling": config.dynamic.success_sampling,
               "model.kind": config.model.kind != "tiny",
               "model.lora.rank": config.model.lora.rank > 0,
               "rollout.engine": config.rollout.engine != "local"}
    for name, used in refused.items():
        if used:
            raise ValueError(f"{name}: not available with multiagent.env "
                             f"{multi.env!r} (leave it at its default)")
    if multi.candidates < 2:
        raise ValueError(f"multiagent.candidates: must be >= 2, got {multi.candidates}")
    if not 0.0 <= multi.heldout_fraction < 1.0:
        raise ValueError(f"multiagent.heldout_fraction: must be in [0, 1), got "
                         f"{multi.heldout_fraction}")
    if multi.max_turns < 1:
        raise ValueError(f"multiagent.max_turns: must be >= 1, got {multi.max_turns}")
    if multi.critic_lr <= 0:
        raise ValueError(f"multiagent.critic_lr: must be > 0, got {multi.critic_lr}")
    for name in ("items", "symbols"):
        if len(getattr(multi, name).split()) < 2:
            raise ValueError(f"multiagent.{name}: needs at least two words separated by "
                             f"spaces, got {getattr(multi, name)!r}")
