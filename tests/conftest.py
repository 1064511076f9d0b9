"""Fixtures shared across the test tiers."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from tracerl.models.tiny import TinyModelConfig, build_tiny_model, train_tokenizer
from tracerl.rollout import HFPolicy


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for the module: on tiny matrices a second thread only adds
    synchronisation, and on a shared machine it can make each step many times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_policy_on() -> Callable[[Sequence[str], int], HFPolicy]:
    """A function building a small untrained policy whose tokenizer is trained on ``corpus``
    (the decoding-rule tests' model: 2 layers of width 32, vocabulary 400)."""

    def build(corpus: Sequence[str], max_positions: int) -> HFPolicy:
        tokenizer = train_tokenizer(list(corpus), vocab_size=400)
        config = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2,
                                 intermediate_size=64, max_positions=max_positions)
        return HFPolicy(build_tiny_model(tokenizer, config, seed=0), tokenizer)

    return build
