"""The engine tests' model: the tiny Llama vLLM serves on two CPU cores (head width 32, which
vLLM's CPU attention supports), with a tokenizer trained here and a chat template.

Not a test module itself: tests import it by adding this folder to ``sys.path``."""

from __future__ import annotations

from typing import Any

import torch

from tracerl.models.tiny import TinyModelConfig, build_tiny_model, train_tokenizer
from tracerl.models.words import WORDS

SHAPE = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
                        max_positions=512)
"""Small enough that a server starts and a sync loads in seconds."""

CORPUS = ["Fix the bug in add.", "def add(a, b):\n    return a + b\n",
          "Finish the task: call submit.", "OK done PASS FAIL"] * 10


def tiny_model(seed: int = 0) -> tuple[Any, Any]:
    """A fresh tiny model and its tokenizer (the same tokenizer for every seed)."""
    tokenizer = train_tokenizer(CORPUS, vocab_size=400, words=WORDS)
    return build_tiny_model(tokenizer, SHAPE, seed=seed), tokenizer


def perturbed(model: Any, scale: float, seed: int) -> Any:
    """A copy of ``model`` with every weight moved by Gaussian noise of ``scale``."""
    import copy

    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return other
