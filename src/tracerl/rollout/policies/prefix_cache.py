"""Keys and values of earlier turns, kept so that a conversation's next turn computes only
its new tokens.

A multi-turn attempt's prompt at turn t+1 is its prompt at turn t, the action sampled there
and the observation that came back. Prefilling it from scratch recomputes every earlier
token, once per turn (prefills were about a quarter of the sampler's time in a profile of the
demo's collection; reusing the earlier turns saved 8% of it there, where a group's rows mostly
share their prompts, and halves it on 32 distinct six-turn conversations: ``bench/multi_turn.py``).
``HFPolicy`` (fused decode path) therefore
keeps, after each call, every row's cached keys and values under the exact token sequence they
were computed for (its prompt and all but the last sampled token), and a later prompt that
starts with such a sequence is prefilled from there (``FusedLlamaDecoder.prefill(past=...)``).
Serving stacks do the same with automatic prefix caching (vLLM) or a radix tree of prefixes
(SGLang).

Keys and values depend on the weights: the cache is emptied whenever they change (any
parameter written in place, as an optimizer step or ``load_state_dict`` does, or replaced),
so a trainer's update never meets keys and values of the previous weights. A sequence that
differs in any token (a compacted history, a re-tokenised context) simply misses. Entries are
evicted least recently used first once their bytes pass the budget.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence

import torch


class PrefixCache:
    """Token sequence -> the keys and values a decoder computed for it, within a byte budget."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes: must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._lengths: Counter[int] = Counter()
        self._bytes = 0
        self._weights: Hashable = None
        self.hits = 0
        """Prompts that found a stored prefix."""
        self.reused_tokens = 0
        """Tokens those prompts did not compute again."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self._bytes = 0

    def check_weights(self, weights: Hashable) -> None:
        """Empty the cache when ``weights`` (an identity of the weights) is not the last seen."""
        if weights != self._weights:
            self.clear()
            self._weights = weights

    def find(self, prompt: Sequence[int]) -> tuple[tuple[int, ...], torch.Tensor] | None:
        """The longest stored sequence that is a prefix of ``prompt`` and leaves at least one
        of its tokens to compute, with its keys and values cut to that many tokens."""
        for length in sorted(self._lengths, reverse=True):
            if length > len(prompt):
                continue
            key = tuple(prompt[:length])
            kv = self._entries.get(key)
            if kv is None:
                continue
            self._entries.move_to_end(key)
            used = min(length, len(prompt) - 1)
            if used < 1:
                return None
            self.hits += 1
            self.reused_tokens += used
            return key, kv[..., :used, :]
        return None

    def put(self, tokens: Sequence[int], kv: torch.Tensor) -> None:
        """Keep ``kv`` (``(..., len(tokens), D)``) for ``tokens``; evicts the oldest entries
        beyond the budget (an entry larger than the whole budget is not kept)."""
        if kv.shape[-2] != len(tokens):
            raise ValueError(f"kv holds {kv.shape[-2]} tokens, the sequence has {len(tokens)}")
        size = kv.numel() * kv.element_size()
        if size > self.max_bytes or not tokens:
            return
        key = tuple(tokens)
        self.discard(key)
        self._entries[key] = kv
        self._lengths[len(key)] += 1
        self._bytes += size
        while self._bytes > self.max_bytes:
            self.discard(next(iter(self._entries)))

    def discard(self, key: tuple[int, ...]) -> None:
        """Forget ``key`` (nothing happens when it is not stored)."""
        kv = self._entries.pop(key, None)
        if kv is None:
            return
        self._bytes -= kv.numel() * kv.element_size()
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]
