"""The ``asynchronous`` section of a training config: collection running ahead of the update
by at most ``max_staleness`` policy versions (:mod:`tracerl.train.asynchronous`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class AsyncConfig:
    """Asynchronous training: a rollout worker collects the next steps' attempts while the
    learner updates on the current one (see docs/training.md, "Asynchronous training")."""

    max_staleness: int = 0
    """k: how many policy versions an attempt's oldest action token may lag the weights its
    update starts from. The worker starts collecting step ``s`` once the learner has finished
    step ``s - k``, so at most k updates separate sampling from training. 0: the synchronous
    loop, exactly (collect, then update, in turn)."""
    weight_sync: Literal["between_attempts", "mid_attempt"] = "between_attempts"
    """When the worker takes the learner's newest weights: ``between_attempts``, only before
    a step's collection starts (no attempt is in flight; every attempt of a step is sampled by
    one version); ``mid_attempt``, also before every sampler call, between the turns of the
    attempts in flight (partial rollouts: an attempt's turns may come from several versions,
    each action segment stamped with its own, and ``metadata.policy_versions`` lists them)."""
    stale: Literal["drop", "capped"] = "drop"
    """A group holding an attempt older than ``max_staleness`` versions at its update (only a
    resumed run or a config change can produce one; the worker's wait rules them out):
    ``drop``, left out of the update whole and counted; ``capped``, trained like any other,
    its tokens weighted by the truncated importance weight (``update.tis_cap``) and counted."""


def validate_async(config: Any) -> None:
    """The ``asynchronous`` section's rules, and the options an asynchronous run cannot
    support (refused when the config loads); ValueError names the key."""
    section: AsyncConfig = config.asynchronous
    k = section.max_staleness
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"asynchronous.max_staleness: must be an integer >= 0 (0: "
                         f"synchronous), got {k!r}")
    if k == 0:
        return
    world = os.environ.get("WORLD_SIZE", "1")
    refused = {
        "multiagent.env": (config.multiagent.env != "none",
                           "a joint run has its own synchronous loop"),
        "update.loss_level": (config.update.loss_level != "token",
                              "a sequence-level ratio takes no per-token importance weight, "
                              "which decoupled PPO needs; use update.loss_level: token"),
        "update.tis_cap": (config.update.tis_cap is None,
                           "decoupled PPO weights each token by pi_proximal / pi_behavior, "
                           "truncated or masked at a cap; set update.tis_cap (e.g. 2.0)"),
        "rollout.threads": (config.rollout.threads is not None,
                            "torch has one thread count per process, and the collection and "
                            "the update run at once; leave it null (threads sets both)"),
        "WORLD_SIZE": (world != "1",
                       f"torchrun ranks (WORLD_SIZE={world}) share each update step by step; "
                       "run one process"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"{name}: not available with asynchronous.max_staleness {k}: {why}")
