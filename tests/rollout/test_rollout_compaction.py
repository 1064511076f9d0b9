"""Compaction: the summary keeps what matters, and a continued fragment bootstraps correctly
through the whole path (collector -> store -> pack -> batch_gae)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tracerl.core.advantages import batch_gae
from tracerl.envs import TOOL_SCHEMAS, CodingEnv, Sandbox
from tracerl.envs.suite import generate_split
from tracerl.models.tiny import build_tiny_model, train_tokenizer
from tracerl.rollout.collect.collector import Collector, CollectorConfig
from tracerl.rollout.collect.compaction import (
    CompactionConfig,
    History,
    HistoryTurn,
    PolicySummarizer,
    TemplateSummarizer,
)
from tracerl.rollout.policies.hf import HFPolicy
from tracerl.rollout.policies.sampling import Completion, SamplingParams
from tracerl.testing.toy_agent import TOY_MODEL
from tracerl.trace import EndReason, Role, TraceStore, pack, read_attempts

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
TOOLS = tuple(s for s in TOOL_SCHEMAS if s["function"]["name"] in ("run_tests", "submit"))


class RecordingPolicy(HFPolicy):
    """The real HF policy, remembering every prompt it was fed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fed: list[list[int]] = []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 **kwargs: Any) -> list[Completion]:
        self.fed.extend([list(p) for p in prompts])
        return super().generate(prompts, params, **kwargs)


@pytest.fixture(scope="module")
def tasks() -> list[Any]:
    return generate_split("train", seed=0, count=2)


@pytest.fixture(scope="module")
def policy(tasks: list[Any]) -> RecordingPolicy:
    torch.set_num_threads(1)
    corpus = [t.instruction for t in tasks] + ["error: no tool call", "Actions already tried"]
    tokenizer = train_tokenizer(corpus, vocab_size=600)
    return RecordingPolicy(build_tiny_model(tokenizer, TOY_MODEL, seed=1), tokenizer)


def test_template_summary_keeps_instruction_test_output_and_actions_tried() -> None:
    history = History(
        instruction="Fix the bug in calc.py.",
        turns=(
            HistoryTurn('<tool_call>{"name": "view_file", "arguments": {"path": "calc.py"}}'
                        "</tool_call>", "1: def add(a, b):", "view_file"),
            HistoryTurn('<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>',
                        "FAIL\nadd(1, 2) got -1 want 3", "run_tests"),
            HistoryTurn("I think approach A", "error: no tool call", None),
        ),
        fragment_index=0,
    )
    text = TemplateSummarizer().render(history)
    assert text.startswith("Fix the bug in calc.py.")
    assert 'view_file {"path": "calc.py"}' in text  # approach already tried
    assert "run_tests -> FAIL" in text
    assert "Latest test output:\nFAIL\nadd(1, 2) got -1 want 3" in text
    assert "Latest observation:\nerror: no tool call" in text
    assert "Actions already tried (3)" in text


def _collect(policy: RecordingPolicy, tasks: list[Any], store_dir: Path,
             compaction: CompactionConfig, max_turns: int = 3) -> list[Any]:
    sandbox = Sandbox()
    config = CollectorConfig(
        sampling=SamplingParams(temperature=1.0, max_new_tokens=12),
        max_turns=max_turns, tools=TOOLS, compaction=compaction, seed=3,
    )
    policy.fed.clear()
    with TraceStore(store_dir, fsync=False) as store:
        result = Collector(policy, lambda: CodingEnv(tasks, sandbox=sandbox, max_turns=8),
                           store, config).collect(tasks[:1], 1, run_id="c")
    return list(result.attempts)


def test_compaction_spec_example_through_collector_store_pack_and_gae(
    policy: RecordingPolicy, tasks: list[Any], tmp_path: Path
) -> None:
    # Threshold just above the first prompt: every observation triggers a compaction.
    first = policy.chat_prompt([{"role": "user", "content": "x"}], tools=list(TOOLS))
    compaction = CompactionConfig(threshold_tokens=len(first) + 40)
    (attempt,) = _collect(policy, tasks, tmp_path / "store", compaction, max_turns=2)
    assert len(attempt.fragments) == 2
    assert attempt.fragments[0].end is EndReason.CONTINUED
    assert attempt.end_reason is EndReason.TRUNCATED_TURNS

    # What was fed next is exactly the new fragment's first context (a summary segment).
    second_context = attempt.fragments[1].turns[0].segments[0]
    assert second_context.role is Role.SUMMARY
    assert policy.fed[1] == second_context.token_ids.tolist()
    assert tasks[0].instruction in policy.decode(second_context.token_ids)

    (stored,) = read_attempts(tmp_path / "store")
    assert stored == attempt
    batch = pack([stored], has_critic=True)
    row = int((batch.fragment_index == 0).nonzero()[0])
    assert bool(batch.needs_bootstrap[row])
    state = batch.continuation_ids[row][batch.continuation_mask[row].bool()].tolist()
    assert state == policy.fed[1]  # the continuation state is what the task continued from

    def value_of(state_ids: list[int]) -> float:
        """A fixed value function: 0.8 for the continuation state, 0.5 for any other."""
        return 0.8 if state_ids == policy.fed[1] else 0.5

    mask = batch.action_mask
    values = 0.6 * mask.to(torch.float32)
    bootstrap = torch.tensor([
        value_of(batch.continuation_ids[b][batch.continuation_mask[b].bool()].tolist())
        if bool(batch.needs_bootstrap[b]) else 0.0
        for b in range(mask.shape[0])
    ])
    last = int(mask[row].nonzero()[-1])
    assert float(batch.token_rewards[row, last]) == 0.0
    advantages, _ = batch_gae(batch.token_rewards, values, mask, bootstrap, gamma=0.9,
                              trace_decay=0.95)
    assert float(advantages[row, last]) == pytest.approx(0.12, abs=1e-6)
    mislabeled = bootstrap.clone()
    mislabeled[row] = 0.0  # what a terminal flag on the compaction boundary would do
    wrong, _ = batch_gae(batch.token_rewards, values, mask, mislabeled, gamma=0.9,
                         trace_decay=0.95)
    assert float(wrong[row, last]) == pytest.approx(-0.6, abs=1e-6)


def test_policy_summarizer_keeps_the_instruction_verbatim(
    policy: RecordingPolicy, tasks: list[Any], tmp_path: Path
) -> None:
    first = policy.chat_prompt([{"role": "user", "content": "x"}], tools=list(TOOLS))
    compaction = CompactionConfig(threshold_tokens=len(first) + 40,
                                  summarizer=PolicySummarizer(), summary_max_new_tokens=8)
    (attempt,) = _collect(policy, tasks, tmp_path / "store", compaction, max_turns=3)
    assert [f.end for f in attempt.fragments[:-1]] == [EndReason.CONTINUED] * (
        len(attempt.fragments) - 1)
    assert len(attempt.fragments) >= 2
    summary = attempt.fragments[1].turns[0].segments[0]
    text = policy.decode(summary.token_ids)
    assert tasks[0].instruction in text and "Summary of what was tried:" in text


def test_compaction_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="threshold_tokens"):
        CompactionConfig(threshold_tokens=0)
    with pytest.raises(ValueError, match="max_fragments"):
        CompactionConfig(threshold_tokens=10, max_fragments=1)
    assert asyncio.run(TemplateSummarizer().summarize(
        History("do it", (), 0), generate=lambda _: asyncio.sleep(0, ""))).startswith("do it")
