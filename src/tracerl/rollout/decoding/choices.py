"""Action masking to a finite set of texts: the sampler may write only one of the choices.

An environment with a finite action set (a game's moves, ``MultiAgentEnv.choices``) would
refuse any other text; masking the invalid ones (Huang and Ontañón, 2020) leaves the policy
to learn only which choice to make. Each choice is written as the tokenizer encodes it: before
each token, only the next token of a choice whose tokens so far are the completion is allowed,
and once the completion is a whole choice only the end tokens are. So a choice is always the
same token ids (a one-token word is one decision, not one of several spellings), and
re-encoding the text gives back the recorded tokens.
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
        self.tokenizer = tokenizer
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
        self.next_ids: dict[str, set[int]] = {}
        """Completion text so far → the token ids that may follow it."""
        for choice in self.choices:
            ids = [int(i) for i in texts.tokenizer.encode(choice, add_special_tokens=False)]
            if "".join(texts.texts[i] for i in ids if i < texts.width) != choice:
                raise ValueError(f"choices: {choice!r} does not decode back from its tokens")
            for k, token_id in enumerate(ids):
                prefix = "".join(texts.texts[i] for i in ids[:k])
                self.next_ids.setdefault(prefix, set()).add(token_id)
            self.next_ids.setdefault(choice, set()).update(self.end_ids)

    def allowed(self, text: str) -> torch.Tensor:
        """The tokens that may follow ``text`` (end tokens once it is a whole choice)."""
        following = self.next_ids.get(text)
        if not following:
            raise ValueError(f"choices: {text!r} is not the start of one of "
                             f"{list(self.choices)}")
        mask = torch.zeros(self.texts.width, dtype=torch.bool)
        mask[sorted(following)] = True
        return mask
