"""Constrained decoding of an edit's ``old`` text: the sampler writes only text the file holds.

A line-scoped ``replace`` (``{"line": 7, "old": ">", "new": ">="}``) fails when ``old`` is not
in the line, and the demo's small policy fails that way in most of its edits: it finds the
line and then types an operator it recalls from other tasks instead of the one that is there
(docs/training.md). Agent frameworks answer malformed tool calls with grammar-constrained
decoding (vLLM's guided decoding, Outlines, XGrammar); RL on discrete action spaces answers
invalid actions with action masking (Huang and Ontañón, 2020). ``EditConstraint`` is both for
this one argument: while the sampler is inside the ``old`` string of a ``replace`` call, only
tokens that keep it a piece of the named line (the open file when no line is named) may be
drawn, and the string may only be closed once it occurs there exactly once, as the tool
requires. Everything else the policy writes (which tool, which line, the ``new`` text, when to
stop) is unconstrained, so the choices that decide a fix stay the policy's.

Accounting: the mask is part of the distribution actually sampled from, so the recorded
behavior logprob is the masked one. The trainer's old and new logprobs are the unmasked
policy's (temperature only), as with top-k/top-p: the gap is reported by the ``mismatch.*``
metrics and ``update.tis_cap`` can weight it. Pushing up a good masked token's unmasked
probability is what the update should do anyway; the mask never needs to be recomputed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Protocol

import torch

_REPLACE = re.compile(r'"name"\s*:\s*"replace"')
_OLD_OPEN = re.compile(r'"old"\s*:\s*"')
_LINE = re.compile(r'"line"\s*:\s*"?(\d+)')
_PATH = re.compile(r'"path"\s*:')


class TokenConstraint(Protocol):
    """A rule the sampler applies to one row: which tokens may come next, given its text."""

    name: str
    """How traces name the rule (``SamplingParams.constraint``)."""

    def allowed(self, text: str) -> torch.Tensor | None:
        """A bool mask over the vocabulary for the next token after ``text`` (the completion
        so far, decoded), or None where the rule says nothing."""
        ...


class VocabularyTexts:
    """Each token's text, made once per tokenizer, split at its first ``"``.

    ``width`` is the model's output width, which may exceed the tokenizer's size (padded
    embeddings): the ids past the tokenizer are never allowed inside a constrained string.
    """

    def __init__(self, tokenizer: Any, width: int) -> None:
        size = min(len(tokenizer), width)
        self.heads: list[str] = []
        """The text of each token before its first quote (the whole text without one)."""
        self.quoted: list[bool] = []
        """Whether each token's text contains a quote: such a token closes the string."""
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for token_id in range(size):
            text = "" if token_id in special else str(tokenizer.decode([token_id]))
            head, quote, _ = text.partition('"')
            self.heads.append(head if text else "\0")  # "\0" is in no line: never allowed
            self.quoted.append(bool(quote))
        self.heads.extend("\0" for _ in range(size, width))
        self.quoted.extend(False for _ in range(size, width))


def _json_body(text: str) -> str:
    """``text`` as it is written inside a JSON string (quotes and backslashes escaped)."""
    return json.dumps(text)[1:-1]


def open_string(text: str) -> str | None:
    """The part of ``old`` written so far when ``text`` (a completion) is inside the ``old``
    string of a ``replace`` call; None when it is not."""
    call = _REPLACE.search(text)
    if call is None:
        return None
    starts = [match.end() for match in _OLD_OPEN.finditer(text, call.end())]
    if not starts:
        return None
    body = text[starts[-1]:]
    escaped = False
    for char in body:  # a string still open has no unescaped quote
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            return None
    return body


class EditConstraint:
    """Keeps ``replace``'s ``old`` a piece of the line it names, in one file's text.

    Args:
        vocabulary: the policy's token texts (``VocabularyTexts``).
        file_text: the text of the file a call without ``path`` edits (the environment's open
            file). A call that names a ``path`` is left alone.
    """

    name = "edit_old"
    """How traces name this rule (``SamplingParams.constraint``)."""

    def __init__(self, vocabulary: VocabularyTexts, file_text: str) -> None:
        self.vocabulary = vocabulary
        self.lines = file_text.splitlines()
        self.file_text = file_text
        self._cache: dict[tuple[str, str], torch.Tensor | None] = {}

    def scope(self, arguments: str) -> str | None:
        """The text ``old`` is searched in, given the call's arguments written before it."""
        if _PATH.search(arguments):
            return None
        line = _LINE.search(arguments)
        if line is None:
            return self.file_text
        number = int(line.group(1))
        return self.lines[number - 1] if 1 <= number <= len(self.lines) else None

    def allowed(self, text: str) -> torch.Tensor | None:
        written = open_string(text)
        if written is None:
            return None
        scope = self.scope(text[: len(text) - len(written)])
        if scope is None:
            return None
        key = (scope, written)
        if key not in self._cache:  # a group's samples write the same prefixes
            self._cache[key] = self._mask(scope, written)
        return self._cache[key]

    def _mask(self, scope: str, written: str) -> torch.Tensor | None:
        body = _json_body(scope)
        if written not in body:
            return None  # already off the text (cannot happen under the mask): say nothing
        closable = bool(written) and not _odd_backslashes(written) and _count(scope, written) == 1
        keep: list[bool] = []
        for head, quoted in zip(self.vocabulary.heads, self.vocabulary.quoted, strict=True):
            if not quoted:
                keep.append(bool(head) and (written + head) in body)
            elif not head:
                keep.append(closable)
            else:
                # Closes the string after `head`: allowed when what is then written is a
                # piece of the text occurring once.
                whole = written + head
                keep.append(whole in body and not _odd_backslashes(whole)
                            and _count(scope, whole) == 1)
        return torch.tensor(keep, dtype=torch.bool) if any(keep) else None


def _odd_backslashes(written: str) -> bool:
    """Whether ``written`` ends inside an escape (an odd run of trailing backslashes)."""
    return (len(written) - len(written.rstrip("\\"))) % 2 == 1


def _count(scope: str, written: str) -> int:
    """How often the JSON-string body ``written`` occurs in ``scope`` once decoded."""
    try:
        decoded = json.loads(f'"{written}"')
    except json.JSONDecodeError:
        return 0
    return scope.count(decoded) if decoded else 0


def apply_constraints(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``logits`` (B, V) with the tokens each row's mask forbids set to -inf (rows whose mask
    is None untouched)."""
    if all(mask is None for mask in masks):
        return logits
    width = logits.shape[-1]
    everything = torch.ones(width, dtype=torch.bool)
    keep = torch.stack([everything if mask is None else mask[:width] for mask in masks])
    return logits.masked_fill(~keep.to(logits.device), float("-inf"))
