"""Action masking to a finite set of texts: the sampler may write only one of the choices.

An environment with a finite action set (a game's moves, ``MultiAgentEnv.choices``) would
refuse any other text; masking the invalid ones (Huang and Ontañón, 2020) leaves the policy
to learn only which choice to make. Before each token, only tokens that keep the completion
a prefix of some choice are allowed, and once it equals a choice only the end tokens are.
As with every rule of :mod:`tracerl.rollout.decoding.constraints`, the recorded behavior
logprob is the masked distribution's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class TokenTexts:
    """Each token's text, decoded once per tokenizer (special tokens: empty, never allowed);
    ``width`` is the model's output width, which may exceed the tokenizer's size."""

    def __init__(self, tokenizer: Any, width: int) -> None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        size = min(len(tokenizer), width)
        self.width = width
        self.texts = ["" if i in special else str(tokenizer.decode([i])) for i in range(size)]
        self.texts.extend("" for _ in range(size, width))


class ChoiceConstraint:
    """Only one of ``choices`` (then an end token) may be written."""

    name = "choice"

    def __init__(self, texts: TokenTexts, choices: Sequence[str], end_ids: Sequence[int]) -> None:
        if not choices or any(not c for c in choices):
            raise ValueError(f"choices: must be non-empty texts, got {list(choices)!r}")
        if not end_ids:
            raise ValueError("end_ids: a choice must be closable by an end token")
        self.texts = texts
        self.choices = tuple(choices)
        self.end_ids = tuple(end_ids)

    def allowed(self, text: str) -> torch.Tensor:
        """The tokens that keep ``text`` a prefix of a choice (end tokens once it is one)."""
        mask = torch.zeros(self.texts.width, dtype=torch.bool)
        if text in self.choices:
            mask[list(self.end_ids)] = True
            return mask
        open_choices = [c[len(text):] for c in self.choices if c.startswith(text)]
        for token_id, piece in enumerate(self.texts.texts):
            if piece and any(rest.startswith(piece) for rest in open_choices):
                mask[token_id] = True
        if not bool(mask.any()):
            raise ValueError(f"choices: no token continues {text!r} toward one of "
                             f"{list(self.choices)} (the tokenizer cannot write them)")
        return mask
