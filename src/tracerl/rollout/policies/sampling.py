"""Sampling parameters and the one definition of "the distribution actually sampled from".

The sampler and the trainer must agree on what a token's probability was. Both go through
``processed_logprobs``: temperature first, then top-k, then top-p (nucleus), then
renormalisation. The sampler draws from it and records the drawn token's log-probability (the
*behavior* logprob); ``sequence_logprobs`` recomputes the same numbers for whole sequences in
one forward pass, which is how the trainer gets old- and new-policy logprobs.

Three processings are offered, because they answer different questions:

- ``"sampling"``: temperature, top-k and top-p, exactly as sampled. Behavior logprobs.
- ``"temperature"``: ``log_softmax(logits / T)`` only. Smooth in the logits everywhere, so it is
  what a PPO update differentiates; it differs from ``"sampling"`` only where top-k/top-p
  truncated (there, ``"sampling"`` renormalises over fewer tokens).
- ``"raw"``: ``log_softmax(logits)``, the model's own distribution at temperature 1.

Greedy decoding (temperature 0) samples from a point mass on the arg-max token, so under
``"sampling"`` the chosen token's logprob is exactly 0 and every other token's is ``-inf``.
That is the honest behavior probability; it also means greedy samples carry no usable
importance ratio. Use ``"raw"`` for the model's own probability of a greedy token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

LogprobProcessing = Literal["sampling", "temperature", "raw"]
"""Which distribution a logprob is taken under (see the module docstring)."""

PROCESSINGS: tuple[str, ...] = ("sampling", "temperature", "raw")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of completions. Validated on construction."""

    temperature: float = 1.0
    """Divides the logits before softmax; 0 means greedy (arg-max, behavior logprob 0)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``; 1 = off."""
    top_k: int = 0
    """Keep only the ``top_k`` most likely tokens (ties at the boundary kept too); 0 = off."""
    max_new_tokens: int = 256
    """Most tokens generated per prompt; also capped by the model's context length."""
    stop_token_ids: tuple[int, ...] | None = None
    """Tokens that end a completion (kept as its last token). None: the tokenizer's EOS; ``()``:
    no stop token, every completion runs to its length limit or a stop string."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end a completion once the decoded completion text contains one. The token
    that completed the string is kept whole, so the text may run a little past it."""
    seed: int | None = None
    """Seed of the sampling generator; None draws one from torch's global RNG."""

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if (
            not isinstance(self.max_new_tokens, int)
            or isinstance(self.max_new_tokens, bool)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
            ):
                raise ValueError(
                    f"stop_token_ids must be a tuple of token ids >= 0, got {self.stop_token_ids!r}"
                )
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.stop_strings, str) or not all(
            isinstance(s, str) and s for s in self.stop_strings
        ):
            raise ValueError(
                f"stop_strings must be a tuple of non-empty strings, got {self.stop_strings!r}"
            )
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when temperature is 0: the arg-max token is taken."""
        return self.temperature == 0


def _check_processing(processing: str, temperature: float, top_k: int, top_p: float) -> None:
    if processing not in PROCESSINGS:
        raise ValueError(f"processing must be one of {PROCESSINGS}, got {processing!r}")
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if processing == "temperature" and temperature == 0:
        raise ValueError("temperature-only processing needs temperature > 0 (0 is greedy)")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def processed_logprobs(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    processing: LogprobProcessing = "sampling",
) -> torch.Tensor:
    """Log-probabilities over the vocabulary under the chosen processing.

    Args:
        logits: ``(..., V)`` raw model logits, any float dtype (computed in float32).
        temperature, top_k, top_p: as in ``SamplingParams``.
        processing: ``"sampling"``, ``"temperature"`` or ``"raw"`` (module docstring).

    Returns:
        ``(..., V)`` float32 log-probabilities; tokens outside the sampling support are ``-inf``.
        Differentiable with respect to ``logits`` except through the support selection.
    """
    _check_processing(processing, temperature, top_k, top_p)
    logits = logits.float()
    if processing == "raw":
        return torch.log_softmax(logits, dim=-1)
    if temperature == 0:
        # Point mass on the arg-max (first index on ties, as torch.argmax).
        best = logits.argmax(dim=-1, keepdim=True)
        out = torch.full_like(logits, -math.inf)
        return out.scatter(-1, best, 0.0)
    scaled = logits / temperature
    if processing == "temperature":
        return torch.log_softmax(scaled, dim=-1)
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if top_p < 1.0:
        # Sort descending; drop a token when the mass strictly before it already reaches top_p,
        # which keeps the smallest prefix whose mass is >= top_p (the most likely token always).
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, -math.inf)
    return torch.log_softmax(scaled, dim=-1)


def logprobs_from_logits(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    processing: LogprobProcessing = "sampling",
) -> torch.Tensor:
    """Log-probability of ``token_ids`` under the processed distribution of ``logits``.

    ``logits`` is ``(..., V)`` and ``token_ids`` is ``(...)``; the result is ``(...)`` float32.
    Use this when the caller already ran the forward pass (e.g. a model with a value head).
    """
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"token_ids shape {tuple(token_ids.shape)} must equal logits shape without the "
            f"vocabulary dimension {tuple(logits.shape[:-1])}"
        )
    logprobs = processed_logprobs(
        logits, temperature=temperature, top_k=top_k, top_p=top_p, processing=processing
    )
    return logprobs.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    params: SamplingParams | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    processing: LogprobProcessing = "sampling",
) -> torch.Tensor:
    """Per-token log-probabilities of whole sequences in ONE forward pass.

    Args:
        model: a causal LM whose forward takes ``input_ids``, ``attention_mask`` and
            ``position_ids`` and returns ``.logits`` of shape ``(B, T, V)``.
        input_ids: ``(B, T)`` token ids; left or right padding both work.
        attention_mask: ``(B, T)``, 1 for real tokens, 0 for padding; None means no padding.
        params: if given, its temperature, top_k and top_p are used (the keyword arguments are
            then ignored), so a completion's logprobs can be recomputed with the params that
            sampled it.
        processing: ``"sampling"`` (behavior), ``"temperature"`` (what PPO differentiates) or
            ``"raw"``.

    Returns:
        ``(B, T)`` float32: entry ``[b, t]`` is ``log p(input_ids[b, t] | input_ids[b, :t])``.
        Column 0 (no context) and padding positions are 0; mask them with your action mask.
        Gradients flow when called outside ``torch.no_grad``.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, time), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
            f"{tuple(input_ids.shape)}"
        )
    if params is not None:
        temperature, top_k, top_p = params.temperature, params.top_k, params.top_p
    _check_processing(processing, temperature, top_k, top_p)
    attention_mask = attention_mask.long()
    # Positions count real tokens only, so a left-padded row sees the same positions as unpadded.
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    ).logits  # (B, T, V)
    token_logprobs = logprobs_from_logits(
        logits[:, :-1],
        input_ids[:, 1:],
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        processing=processing,
    )  # (B, T-1)
    # A padded target, or a target whose context is padding only, has no defined logprob.
    valid = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    token_logprobs = token_logprobs.masked_fill(~valid, 0.0)
    return torch.cat([token_logprobs.new_zeros(token_logprobs.shape[0], 1), token_logprobs], dim=1)


FinishReason = Literal["stop", "length"]
"""Why a completion ended: ``"stop"`` at a stop token or string; ``"length"`` at the token limit
(``max_new_tokens`` or the model's context)."""


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: tuple[int, ...]
    """Sampled tokens, in order; a stop token, when one ended the completion, is the last."""
    logprobs: tuple[float, ...]
    """Behavior logprob of each sampled token under the processed distribution it was drawn
    from; 0.0 for every token of a greedy completion (a point mass)."""
    finish_reason: FinishReason
    """``"stop"`` (stop token or stop string) or ``"length"`` (token limit or context full)."""
    text: str
    """``tokenizer.decode(token_ids, skip_special_tokens=True)``; nothing is cut at a stop string."""
    stop_reason: int | str | None
    """The stop token id or stop string that ended the completion; None for ``"length"``."""
    policy_version: int
    """The policy version that sampled these tokens (``HFPolicy.policy_version``)."""
