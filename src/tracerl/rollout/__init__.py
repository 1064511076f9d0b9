"""Rollouts: policies that sample with true behavior logprobs, and the collectors built on them."""

from __future__ import annotations

from tracerl.rollout.collect.collector import Collector, CollectorConfig, CollectResult
from tracerl.rollout.collect.compaction import (
    CompactionConfig,
    PolicySummarizer,
    Summarizer,
    TemplateSummarizer,
)
from tracerl.rollout.policies.hf import HFPolicy
from tracerl.rollout.policies.sampling import (
    Completion,
    FinishReason,
    LogprobProcessing,
    SamplingParams,
    logprobs_from_logits,
    processed_logprobs,
    sequence_logprobs,
)

__all__ = [
    "CollectResult",
    "Collector",
    "CollectorConfig",
    "CompactionConfig",
    "Completion",
    "FinishReason",
    "HFPolicy",
    "LogprobProcessing",
    "PolicySummarizer",
    "SamplingParams",
    "Summarizer",
    "TemplateSummarizer",
    "logprobs_from_logits",
    "processed_logprobs",
    "sequence_logprobs",
]
