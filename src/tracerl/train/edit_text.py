"""Which action tokens are an edit's text, so RL can weigh them apart from the decisions.

A coding agent's action is a tool call: ``{"name": "replace", "arguments": {"line": 7, "old":
"n):", "new": "n + 1):"}}``. Its tokens hold two kinds of choice. The *decisions* (which tool,
which line, whether to test, undo or submit) are the multi-turn skill RL is for; the *edit
text* (``replace``'s ``old`` and ``new``, ``write_file``'s ``content``) is the fix itself,
and on held-out templates a policy that RL sharpened on the train templates' fixes can get
worse at it (docs/training.md, "The gradient on decisions only").
``update.edit_text_weight`` scales the policy-gradient and entropy terms on the edit text;
the KL to the reference still acts on every action token.

The mask is found in text: each action's tokens are decoded one by one (their texts add up to
the decoded whole for the tokenizers used here; where they do not, the spans found are only
as good as that sum), and a token is edit text when any of its characters lies inside the
value of one of the ``EDIT_KEYS`` string arguments, the closing quote included (it decides
where the edit ends). A string left open (a call cut off by the turn's token cap) runs to the
end of the action.
"""

from __future__ import annotations

import re

import torch

from tracerl.rollout.decoding.constraints import VocabularyTexts

EDIT_KEYS = ("old", "new", "content")
"""The string arguments that are an edit's text: ``replace``'s ``old`` and ``new``,
``write_file``'s ``content``."""

_OPEN = re.compile(r'"(' + "|".join(EDIT_KEYS) + r')"\s*:\s*"')


def string_value_spans(text: str) -> list[tuple[int, int]]:
    """``[start, end)`` character spans of the ``EDIT_KEYS`` string values in ``text``, each
    running through its closing quote (to the end of ``text`` if the string is never closed)."""
    spans: list[tuple[int, int]] = []
    position = 0
    while (match := _OPEN.search(text, position)) is not None:
        start = index = match.end()
        while index < len(text):
            char = text[index]
            if char == "\\":
                index += 2
                continue
            if char == '"':
                break
            index += 1
        end = min(index + 1, len(text))
        spans.append((start, end))
        position = end
    return spans


def edit_text_mask(input_ids: torch.Tensor, action_mask: torch.Tensor,
                   vocabulary: VocabularyTexts) -> torch.Tensor:
    """(B, T) bool: the action tokens that are edit text, read with ``vocabulary.texts`` (each
    token's decoded text; special tokens are empty, so never edit text). Each contiguous run
    of action tokens (one turn's action) is searched on its own."""
    if input_ids.shape != action_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"edit_text_mask: input_ids {tuple(input_ids.shape)} and action_mask "
                         f"{tuple(action_mask.shape)} must be the same (B, T)")
    out = torch.zeros(action_mask.shape, dtype=torch.bool)
    actions = action_mask.bool().cpu()
    ids = input_ids.cpu()
    texts = vocabulary.texts
    for row in range(ids.shape[0]):
        marked = actions[row]
        if not bool(marked.any()):
            continue
        # Boundaries of the runs of True in this row.
        flips = torch.diff(marked.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                           append=torch.zeros(1, dtype=torch.int8))
        starts = torch.nonzero(flips == 1).flatten().tolist()
        ends = torch.nonzero(flips == -1).flatten().tolist()
        for lo, hi in zip(starts, ends, strict=True):
            pieces = [texts[i] if 0 <= i < len(texts) else "" for i in ids[row, lo:hi].tolist()]
            spans = string_value_spans("".join(pieces))
            if not spans:
                continue
            offset = 0
            for k, piece in enumerate(pieces):
                first, last = offset, offset + len(piece)
                offset = last
                if last > first and any(first < end and start < last for start, end in spans):
                    out[row, lo + k] = True
    return out
