"""The demonstrations a run learns from: made once, tokenized once, drawn per batch.

A run with ``sft.enabled`` plays scripted, imperfect demonstrations of its train split
(:func:`tracerl.envs.suite.demonstrator.make_demonstrations`) and uses them three times: their
texts train the tiny model's tokenizer, the warm start fine-tunes on them, and ``update.sft_coef`` mixes a
fresh batch of them into every RL optimizer step. :class:`DemonstrationSet` holds them for the
trainer so that all three see the same demonstrations and the same renaming per draw
(``sft.fresh_names``), and so that a resumed run draws what it drew.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

from tracerl.envs import CodingEnv, Sandbox, Task
from tracerl.envs.suite.augment import fresh_name, is_renamed, module_name
from tracerl.envs.suite.demonstrator import (
    Demonstration,
    demonstration_texts,
    make_demonstrations,
    rename_demonstration,
)
from tracerl.rollout.collect.chat_tokens import ChatTokens
from tracerl.train.config import TrainConfig
from tracerl.train.sft import pad_sequences, tokenize_demonstration
from tracerl.train.update import DemonstrationBatch

SCRIPT_TURNS = 32
"""Turn limit of the environments that play the scripted demonstrations."""

TokenizedDemo = tuple[list[int], list[bool]]
"""A tokenized demonstration: token ids and which of them are actions."""
Redraw = Callable[[int, random.Random, random.Random], TokenizedDemo]
"""``redraw(index, rng, names)``: demonstration ``index`` as drawn for one SFT batch."""


class DemonstrationSet:
    """The demonstrations of ``tasks`` (a run's train split, renamed copies included) as
    ``config.sft`` describes them; each part is made on first use and kept."""

    def __init__(self, config: TrainConfig, tasks: Sequence[Task], sandbox: Sandbox) -> None:
        self.config = config
        self.tasks = list(tasks)
        self.sandbox = sandbox
        self._demos: list[Demonstration] | None = None
        self._sequences: tuple[list[TokenizedDemo], Redraw | None] | None = None
        self._chat: ChatTokens | None = None
        self._tokenizer: Any = None

    def bind(self, chat: ChatTokens, tokenizer: Any) -> None:
        """The run's conversation format and tokenizer, which :meth:`sequences` and
        :meth:`batch` render with (the tokenizer may itself be trained on
        :meth:`tokenizer_texts`, so it cannot be given at construction)."""
        self._chat, self._tokenizer = chat, tokenizer
        self._sequences = None

    def demonstrations(self) -> list[Demonstration]:
        """The (imperfect) demonstrations: ``sft.demos_per_task`` of each train task."""
        if self._demos is None:
            sft = self.config.sft
            # Scripted attempts are not held to the rollout's turn budget (the longest script
            # has 8 actions; a short budget is a constraint on the policy, not the teacher).
            shown = [dataclasses.replace(t, budget=None) for t in self.tasks]
            self._demos = make_demonstrations(
                shown, lambda: CodingEnv(shown, sandbox=self.sandbox, max_turns=SCRIPT_TURNS),
                demos_per_task=sft.demos_per_task, wrong_fraction=sft.wrong_edit_fraction,
                recovery_fraction=sft.recovery_fraction, check_fraction=sft.check_fraction,
                seed=self.config.seed, line_edits=sft.line_edits,
                implicit_path=sft.implicit_path, retry_fraction=sft.retry_fraction,
                search_fraction=sft.search_fraction, undo=sft.undo,
                max_turns=self.config.rollout.max_turns)
        return self._demos

    def tokenizer_texts(self) -> list[str]:
        """What the tiny model's tokenizer is trained on: the original tasks' demonstrations
        only. The fresh names of renamed copies then stay split into small pieces, exactly
        like the names of held-out tasks, and the policy has to learn to copy pieces rather
        than recall one token per name."""
        texts = demonstration_texts(
            [d for d in self.demonstrations() if not is_renamed(d.task_id)])
        if self.config.rollout.system_prompt:
            texts.append(self.config.rollout.system_prompt)
        return texts

    def sequences(self) -> tuple[list[TokenizedDemo], Redraw | None]:
        """The demonstrations tokenized, and ``redraw(index, rng, names)`` that gives one of
        them as SFT trains on it (with probability ``sft.fresh_names`` a fresh name drawn from
        ``names``; None when it is off). Made on the first call
        after :meth:`bind`."""
        if self._sequences is not None:
            return self._sequences
        chat, tokenizer = self._chat, self._tokenizer
        if chat is None:
            raise RuntimeError("DemonstrationSet.sequences: call bind(chat, tokenizer) first")
        sft = self.config.sft
        demos = self.demonstrations()
        sequences = [tokenize_demonstration(d, chat, tokenizer) for d in demos]
        modules = {t.id: module_name(t) for t in self.tasks}

        def redraw(index: int, rng: random.Random, names: random.Random) -> TokenizedDemo:
            if not rng.random() < sft.fresh_names:
                return sequences[index]
            demo = demos[index]
            demo = rename_demonstration(demo, modules[demo.task_id], fresh_name(names))
            return tokenize_demonstration(demo, chat, tokenizer)

        self._sequences = sequences, (redraw if sft.fresh_names > 0 else None)
        return self._sequences

    def batch(self, optimizer_step: int) -> DemonstrationBatch:
        """The demonstrations ``update.sft_coef`` mixes into optimizer step ``optimizer_step``:
        ``sft.batch_size`` of them, drawn (and renamed, as the warm start does) by a generator
        seeded with the run's seed and the step, so a resumed run draws the same ones."""
        sequences, redraw = self.sequences()
        rng = random.Random(f"{self.config.seed}:sft-mix:{optimizer_step}")
        picked = rng.sample(range(len(sequences)), min(self.config.sft.batch_size,
                                                       len(sequences)))
        rows = [sequences[i] if redraw is None else redraw(i, rng, rng) for i in picked]
        return pad_sequences(rows, int(self._tokenizer.pad_token_id))
