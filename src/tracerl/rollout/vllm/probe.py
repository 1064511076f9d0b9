"""The check that a weight sync happened: a fixed probe sequence scored by the server and by
the trainer must give the same logprobs.

The server scores the probe through ``/v1/completions`` with ``prompt_logprobs``: the
log-softmax of its logits (temperature 1, nothing else applied) at every position of a
token-id prompt, for the token that follows. The trainer computes the same numbers with a
forward pass of its model. Equal within ``vllm.probe_tolerance``: the server holds the
trainer's weights. A sync that never reached the server, reached it half, or loaded another
file shows here, before any attempt is sampled from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tracerl.rollout.vllm.server import EngineError, post_json


class SyncMismatch(EngineError):
    """The server's probe logprobs differ from the trainer's: it does not serve the weights
    the trainer holds."""


@dataclass(frozen=True)
class ProbeResult:
    """How the server's probe logprobs compare with the trainer's."""

    max_abs_diff: float
    """Largest ``|server - trainer|`` over the probe's positions (nats)."""
    mean_abs_diff: float
    """Mean ``|server - trainer|``."""
    position: int
    """Position (index into the scored tokens) of the largest difference."""


def probe_ids(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """The probe: ``length`` token ids drawn uniformly from ``[0, vocab_size)`` by a generator
    seeded with ``seed`` (the same sequence every sync)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if length < 2:
        raise ValueError(f"length must be >= 2 (one token scored after another), got {length}")
    generator = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab_size, (length,), generator=generator)]


def trainer_logprobs(model: Any, ids: Sequence[int]) -> list[float]:
    """``log p(ids[i] | ids[:i])`` for i = 1..n-1 under ``model`` (a transformers causal LM),
    at temperature 1, in the model's dtype, as float."""
    parameter = next(model.parameters())
    tokens = torch.tensor([list(ids)], dtype=torch.long, device=parameter.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=tokens).logits[0, :-1]  # (n-1, V)
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            picked = logprobs.gather(-1, tokens[0, 1:, None])[:, 0]
    finally:
        model.train(was_training)
    return [float(v) for v in picked.cpu()]


def server_logprobs(base_url: str, model: str, ids: Sequence[int], *,
                    timeout: float = 300.0) -> list[float]:
    """The server's ``log p(ids[i] | ids[:i])`` for i = 1..n-1 (``prompt_logprobs``), from
    ``base_url`` (the server's root) serving ``model``."""
    answer = post_json(base_url, "/v1/completions", {
        "model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0,
        "prompt_logprobs": 0, "return_tokens_as_token_ids": True}, timeout=timeout)
    return parse_prompt_logprobs(answer, ids)


def parse_prompt_logprobs(answer: Any, ids: Sequence[int]) -> list[float]:
    """The prompt tokens' logprobs in a ``/v1/completions`` answer to a ``prompt_logprobs``
    request for ``ids`` (EngineError when the answer has none or they do not fit)."""
    try:
        entries = answer["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"the server's answer has no prompt_logprobs: {str(answer)[:500]}"
                          ) from None
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise EngineError(f"prompt_logprobs: expected {len(ids)} entries (one per prompt "
                          f"token), got {entries if not isinstance(entries, list) else len(entries)}")
    values: list[float] = []
    for position in range(1, len(ids)):
        entry = entries[position]
        if not isinstance(entry, dict):
            raise EngineError(f"prompt_logprobs[{position}] is {entry!r}, not a mapping")
        found = None
        for key, item in entry.items():
            token = str(key).removeprefix("token_id:")
            if token.lstrip("-").isdigit() and int(token) == ids[position]:
                found = item.get("logprob") if isinstance(item, dict) else item
        if found is None or not math.isfinite(float(found)):
            raise EngineError(f"prompt_logprobs[{position}] has no finite logprob for token "
                              f"{ids[position]}: {entry!r}")
        values.append(float(found))
    return values


def compare(trainer: Sequence[float], served: Sequence[float], *, tolerance: float,
            version: int) -> ProbeResult:
    """The comparison of the probe's logprobs; SyncMismatch naming ``version`` (the weights
    the trainer holds) and what the server answered when they differ by more than
    ``tolerance`` anywhere."""
    if len(trainer) != len(served) or not trainer:
        raise ValueError(f"the probe has {len(trainer)} trainer logprobs and {len(served)} "
                         "served ones; they must be equally many and not none")
    diffs = [abs(float(s) - float(t)) for t, s in zip(trainer, served, strict=True)]
    worst = max(range(len(diffs)), key=lambda i: diffs[i])
    result = ProbeResult(max_abs_diff=diffs[worst], mean_abs_diff=sum(diffs) / len(diffs),
                         position=worst)
    if not all(math.isfinite(d) for d in diffs) or result.max_abs_diff > tolerance:
        raise SyncMismatch(
            f"weight sync not verified: the trainer holds policy version {version}, but the "
            f"server's probe logprobs differ from it by up to {result.max_abs_diff:.3g} nats "
            f"(mean {result.mean_abs_diff:.3g}, tolerance vllm.probe_tolerance "
            f"{tolerance:g}); at probe position {worst} the server answered "
            f"{float(served[worst]):.6f} and the trainer computes {float(trainer[worst]):.6f}; "
            "the server does not serve the trainer's weights (a sync that did not load, "
            "loaded another file, or was skipped)")
    return result
