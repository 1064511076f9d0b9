"""The ``multiagent`` section of a training config: several agents in one task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class MultiAgentConfig:
    """Several agents in one task (``env`` other than ``none``): which task family, how the
    agents' weights are held, and the critic. The rest of the config applies as for one
    agent: ``rollout.tasks_per_step`` and ``group_size`` (joint attempts per task, compared
    with each other), ``rollout.temperature``, ``update.*``, ``algorithm.estimator``
    (``grpo`` or ``rloo``), ``model.*`` (each policy's size), ``steps``,
    ``max_generated_tokens`` and ``eval.samples_per_task``."""

    env: Literal["none", "referential"] = "none"
    """``referential``: the speaker/listener game (``envs.referential``); ``none``: one
    agent."""
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
