"""A tiny policy taught, in seconds, to call tools: for collector tests, benches and demos.

An untrained tiny model writes text no tool parser accepts, so it never reaches a tool, a
sandbox or a submit. This fits the tiny Llama (``models.tiny``) on a few conversations in the
collector's own token format: call ``run_tests``, then ``submit`` whatever the tests said. That is enough to drive real sandboxed test runs, tool faults, multi-turn
attempts and compaction through the collector. It is a fixture for plumbing, not an agent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tracerl.hermes import render_tool_call
from tracerl.models.tiny import TinyModelConfig, build_tiny_model, train_tokenizer
from tracerl.rollout.collect.chat_tokens import ChatTokens
from tracerl.rollout.policies.hf import HFPolicy

TOY_MODEL = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
                            max_positions=1024)
"""Shape of the toy model: small enough to fit and sample quickly on two cores."""

FAILURES: tuple[str, ...] = (
    "FAIL\nf(1) got 2 want 3",
    "FAIL\ncount([1, 2]) got 1 want 2",
    "FAIL\nkilled: timeout",
)
"""Test outputs the toy policy is fitted on (besides ``PASS``)."""


def toy_tool_policy(observations: Sequence[str], *, tools: Sequence[Mapping[str, Any]],
                    steps: int = 120, seed: int = 0, learning_rate: float = 5e-3,
                    config: TinyModelConfig = TOY_MODEL,
                    test_outputs: Sequence[str] | None = None) -> HFPolicy:
    """A tiny policy that calls ``run_tests`` and then ``submit`` (reliably so when greedy).

    Args:
        observations: first observations it will meet (task statements), for the tokenizer
            and the fitting conversations.
        tools: the tool schemas the collector will render (keep them few: shorter prompts).
        steps: optimizer steps (full batch).
        test_outputs: what ``run_tests`` returned on these tasks (``observations[i]``'s at
            ``test_outputs[i]``), to fit on the outputs the environment really gives; None:
            ``FAILURES`` and ``PASS``. With real outputs the fitted policy submits after the
            test run on every task instead of only on outputs that resemble the canned ones.
    """
    if not observations:
        raise ValueError("observations: need at least one first observation")
    if steps < 0:
        raise ValueError(f"steps: must be >= 0, got {steps}")
    if test_outputs is not None and len(test_outputs) != len(observations):
        raise ValueError(f"test_outputs: need one per observation ({len(observations)}), "
                         f"got {len(test_outputs)}")
    run_tests = render_tool_call("run_tests", {})
    submit = render_tool_call("submit", {})
    corpus = [*observations, json.dumps(list(tools)), *FAILURES, "PASS",
              *(test_outputs or ())] + [run_tests, submit] * 4
    tokenizer = train_tokenizer(corpus, vocab_size=768)
    model = build_tiny_model(tokenizer, config, seed=seed)
    policy = HFPolicy(model, tokenizer)
    chat = ChatTokens(policy, tools=tools)
    eos = [int(tokenizer.eos_token_id)]
    call_ids = tokenizer.encode(run_tests, add_special_tokens=False) + eos
    submit_ids = tokenizer.encode(submit, add_special_tokens=False) + eos

    rows: list[tuple[list[int], list[bool]]] = []
    for i, first in enumerate(observations):
        results = ((FAILURES[i % len(FAILURES)], "PASS") if test_outputs is None
                   else (test_outputs[i],))
        for result in results:
            prompt = list(chat.first_prompt(first))
            between = chat.after_action(call_ids) + chat.observation(result)
            ids = prompt + call_ids + between + submit_ids
            targets = ([False] * len(prompt) + [True] * len(call_ids) + [False] * len(between)
                       + [True] * len(submit_ids))
            rows.append((ids, targets))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), int(tokenizer.pad_token_id), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (ids, targets) in enumerate(rows):
        row = torch.tensor(ids)
        input_ids[r, : len(ids)] = row
        attention[r, : len(ids)] = 1
        labels[r, : len(ids)] = torch.where(torch.tensor(targets), row, torch.tensor(-100))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    return policy
