"""Rollouts: policies that sample with true behavior logprobs, and the collectors built on them."""

from __future__ import annotations

from tracerl.rollout.policy_hf import Completion, FinishReason, HFPolicy
from tracerl.rollout.sampling import (
    LogprobProcessing,
    SamplingParams,
    logprobs_from_logits,
    processed_logprobs,
    sequence_logprobs,
)

__all__ = [
    "Completion",
    "FinishReason",
    "HFPolicy",
    "LogprobProcessing",
    "SamplingParams",
    "logprobs_from_logits",
    "processed_logprobs",
    "sequence_logprobs",
]
