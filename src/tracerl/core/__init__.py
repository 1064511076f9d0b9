"""Pure math of agent RL: advantages, ratios, losses, loss reduction, group probabilities.

Imports only torch, numpy and the standard library. Functions accept torch tensors, NumPy
arrays or plain sequences and return the caller's kind where that makes sense; losses take
and return torch tensors.
"""

from __future__ import annotations

from tracerl.core.advantages import (
    GroupReport,
    batch_gae,
    batch_gae_reference,
    gae,
    group_advantages,
    rloo_advantages,
    whiten,
)
from tracerl.core.aggregate import LOSS_MODES, LossMode, aggregate_loss, loss_weights
from tracerl.core.losses import (
    KLEstimator,
    SequenceRatio,
    entropy,
    kl_estimate,
    kl_loss,
    kl_reward_penalty,
    ppo_sequence_loss,
    ppo_token_loss,
    value_loss,
)
from tracerl.core.probability import min_group_size_for_mixed, mixed_group_probability
from tracerl.core.ratios import (
    ImportanceLevel,
    ImportanceMode,
    mismatch_metrics,
    sequence_ratio,
    token_ratios,
    truncated_importance_weights,
)

__all__ = [
    "LOSS_MODES",
    "GroupReport",
    "ImportanceLevel",
    "ImportanceMode",
    "KLEstimator",
    "LossMode",
    "SequenceRatio",
    "aggregate_loss",
    "batch_gae",
    "batch_gae_reference",
    "entropy",
    "gae",
    "group_advantages",
    "kl_estimate",
    "kl_loss",
    "kl_reward_penalty",
    "loss_weights",
    "min_group_size_for_mixed",
    "mismatch_metrics",
    "mixed_group_probability",
    "ppo_sequence_loss",
    "ppo_token_loss",
    "rloo_advantages",
    "sequence_ratio",
    "token_ratios",
    "truncated_importance_weights",
    "value_loss",
    "whiten",
]
