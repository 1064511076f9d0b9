"""Models built locally: the tiny Llama and tokenizer used by the demo and the tests."""

from __future__ import annotations

from tracerl.models.tiny import (
    CHAT_TEMPLATE,
    TinyModelConfig,
    build_tiny_model,
    count_parameters,
    load_tiny,
    render_tool_call,
    save_tiny,
    train_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "TinyModelConfig",
    "build_tiny_model",
    "count_parameters",
    "load_tiny",
    "render_tool_call",
    "save_tiny",
    "train_tokenizer",
]
