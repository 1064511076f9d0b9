"""A tiny causal language model and tokenizer built locally, with nothing downloaded.

The demo and the integration tests need a real transformers model that learns to emit code
edits and JSON tool calls within minutes on two CPU cores. This module trains a byte-level BPE
tokenizer on the caller's texts, wraps it as a ``PreTrainedTokenizerFast`` with a chat template,
and builds a small Llama from a config. Both round-trip through ``save_pretrained`` /
``from_pretrained`` (``AutoTokenizer`` / ``AutoModelForCausalLM``), so every other part of
tracerl treats the tiny model exactly like a downloaded one.

Tokenizer design, and why:

- Text is first split into chunks: an identifier or number, a run of punctuation, a run of
  spaces or tabs, or a newline together with the indentation that follows it. BPE never merges
  across chunks, so with a vocabulary large enough for the corpus every frequent identifier,
  operator (``==``, ``):``, ``{"``) and indentation level becomes a single token; the model then
  learns code at roughly word level, which is what makes a ~1M-parameter model usable.
- Chunks are then mapped to bytes (GPT-2's byte-level alphabet, all 256 bytes present from the
  start). A word the corpus never showed falls back to smaller pieces, down to single bytes, so
  ``decode(encode(x)) == x`` for any text, including newlines, indentation and non-ASCII.
- Training is deterministic: the same texts in the same order give the same vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from tracerl.hermes import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from tracerl.hermes import render_tool_call as render_tool_call

BOS_TOKEN = "<|bos|>"
"""Starts every rendered conversation."""
EOS_TOKEN = "<|end|>"
"""Ends every message; the model emits it to end its turn, so it is also the tokenizer's EOS."""
PAD_TOKEN = "<|pad|>"
"""Fills batches; never attended to and never trained on."""
ROLE_TOKENS: dict[str, str] = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
}
"""One special token opens each message, naming its role."""

SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS.values())

# Chunks that BPE may not merge across: a newline plus the indentation after it, a run of
# spaces/tabs, a word or number (identifiers are split at underscores, so ``keep_big`` is
# ``keep`` ``_`` ``big``), a run of underscores, one bracket, a run of JSON punctuation
# (``{}:,"``), or a run of other symbols (operators). Operators never merge with the quotes
# and commas of a tool call's JSON, nor with brackets, so ``>=`` or ``-`` typed as a
# ``replace`` argument (``"old": ">="``) is the same token as in the code it was read from:
# copying is then token identity. (Merged, a sampled ``"-"!=",`` broke the JSON and an
# operator had a different token in each place.) Every character of the input falls in
# exactly one chunk, so nothing is lost before the byte mapping.
_CHUNK_PATTERN = r'\n[ \t]*|[ \t]+|[^\W_]+|_+|[()\[\]]|[{}:,"]+|[^\w\s()\[\]{}:,"]+|\s'

# Jinja chat template. Messages are ``{role}content{end}`` with no extra whitespace, so the
# tokens the model samples after ``<|assistant|>`` are exactly the assistant message. Tool
# calls are rendered Hermes-style as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
# after the content; ``arguments`` may be a mapping or an already-serialised JSON string (the
# OpenAI wire format), and both render the same JSON text.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "<|system|>"
    "{%- if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "Tools:"
    "{%- for tool in tools %}{{ '\\n' }}"
    "{%- if tool['function'] is defined %}{{ tool['function'] | tojson }}"
    "{%- else %}{{ tool | tojson }}{% endif %}"
    "{%- endfor %}{{ '\\n' }}"
    f'Call a tool as {TOOL_CALL_OPEN}{{"name": NAME, "arguments": {{...}}}}{TOOL_CALL_CLOSE}'
    "<|end|>"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown chat role: ' ~ message['role']) }}"
    "{%- endif %}"
    "<|{{ message['role'] }}|>"
    "{%- if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}" +
    TOOL_CALL_OPEN + '{"name": {{ function["name"] | tojson }}, "arguments": '
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{%- else %}{{ function['arguments'] | tojson }}{% endif %}"
    "}" + TOOL_CALL_CLOSE +
    "{%- endfor %}"
    "{%- endif %}"
    "<|end|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 2048, min_frequency: int = 2,
    words: Iterable[str] = (),
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it with special tokens and a chat template.

    Args:
        texts: the corpus (e.g. demonstrations rendered through the chat template's shape, task
            statements, code). Iterated once.
        vocab_size: upper bound on the vocabulary, special tokens and the 256 byte tokens
            included. Training stops earlier when no pair reaches ``min_frequency``.
        min_frequency: a pair must occur this often to be merged; 2 keeps one-off strings from
            taking vocabulary rows the model would never learn.
        words: words that should become single tokens (e.g. ``models.words.WORDS``): each is
            added to the corpus ``min_frequency`` times, so it is merged whole when the
            vocabulary has room.

    Returns:
        A fast tokenizer whose EOS ends a message (see ``EOS_TOKEN``) and whose padding side is
        left, as batched generation needs.
    """
    n_fixed = len(SPECIAL_TOKENS) + 256
    if vocab_size < n_fixed:
        raise ValueError(f"vocab_size must be at least {n_fixed} (special and byte tokens), got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_CHUNK_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer counts words in parallel; one thread keeps the merge order reproducible.
    previous = os.environ.get("RAYON_NUM_THREADS")
    os.environ["RAYON_NUM_THREADS"] = "1"
    try:
        word_texts = [" ".join(words)] * min_frequency
        tokenizer.train_from_iterator([*texts, *word_texts], trainer=trainer)
    finally:
        if previous is None:
            os.environ.pop("RAYON_NUM_THREADS", None)
        else:
            os.environ["RAYON_NUM_THREADS"] = previous
    return wrap_tokenizer(tokenizer)


def wrap_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a trained ``tokenizers.Tokenizer`` as a transformers tokenizer with tracerl's specials."""
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    # The tool-call markers are ordinary added tokens: one id each, and kept by
    # ``decode(..., skip_special_tokens=True)`` because the environment parses them.
    wrapped.add_tokens([TOOL_CALL_OPEN, TOOL_CALL_CLOSE])
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny Llama. The defaults give ~0.85M parameters besides the embeddings."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads per block (also key/value heads: no grouped-query sharing)."""
    intermediate_size: int = 384
    """Width of the SwiGLU feed-forward layer."""
    max_positions: int = 2048
    """Context length; prompts longer than this are refused by the sampler."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head, halving the vocabulary's parameters."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase, config: TinyModelConfig | None = None, *, seed: int = 0
) -> LlamaForCausalLM:
    """Build a freshly initialised Llama sized to ``tokenizer``'s vocabulary, in float32.

    The same ``seed``, tokenizer and config give bit-identical weights; the global torch RNG is
    left as it was.
    """
    config = config or TinyModelConfig()
    llama_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(llama_config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def count_parameters(model: torch.nn.Module, *, exclude_embeddings: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once), optionally without embeddings."""
    seen: set[int] = set()
    total = 0
    embedding_ids: set[int] = set()
    if exclude_embeddings and isinstance(model, PreTrainedModel):
        embedding_ids.add(id(model.get_input_embeddings().weight))
        output = model.get_output_embeddings()
        if output is not None:
            embedding_ids.add(id(output.weight))
    for parameter in model.parameters():
        if id(parameter) in seen or id(parameter) in embedding_ids:
            continue
        seen.add(id(parameter))
        total += parameter.numel()
    return total


def save_tiny(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Save model and tokenizer into one directory that ``load_tiny`` (or the Auto classes) reads."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_tiny(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a directory written by ``save_tiny`` (or any local causal LM) in float32, offline;
    ValueError naming the tensor when a weight is NaN or infinite. A directory holding a LoRA
    adapter (PEFT's layout: a LoRA run's checkpoint or policy) gives its base with the adapter
    merged into the weights (``models.lora.load_adapter_dir``)."""
    from tracerl.models import lora
    from tracerl.models.weights import check_finite_weights

    directory = Path(path)
    if lora.is_adapter_dir(directory):
        model, tokenizer = lora.load_adapter_dir(directory, merge=True)
        return model, tokenizer
    if not (directory / "config.json").is_file():
        raise ValueError(f"path {str(directory)!r} holds no model (config.json is missing)")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, dtype=torch.float32
    )
    check_finite_weights(model, directory)
    return model, tokenizer

