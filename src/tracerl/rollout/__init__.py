"""Rollouts: policies that sample with true behavior logprobs, and the collectors built on them.

Four rooms:

- ``policies``: samplers (``hf`` a local transformers model with the fused decoder,
  ``openai_api`` a vLLM or SGLang server) and ``sampling`` (their parameters and results);
- ``decoding``: rules on what may be sampled next (``constraints``, ``grammar``);
- ``collect``: attempts played against environments and recorded (``collector``);
- ``serve``: a local policy behind an OpenAI-compatible endpoint that records what it serves.

The tool-call text format they read and write is ``tracerl.hermes``.
"""

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
