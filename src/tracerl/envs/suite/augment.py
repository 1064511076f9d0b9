"""Renamed copies of tasks, so a small policy learns to copy names instead of memorising them.

The built-in train split draws function names from a small pool; a tiny model trained on it
learns the pool by heart and cannot even type the name of a held-out file it has never seen.
A renamed copy replaces the function and module name everywhere it is used as a name (the
module file, imports, definitions, calls, test files, commands, the instruction) with a fresh
identifier, and nothing else: docstrings that use the same word as prose keep it.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Mapping, Sequence

from tracerl.envs.suite.compose import usable_name
from tracerl.envs.tasks import Task
from tracerl.models.words import WORDS


def module_name(task: Task) -> str:
    """The name of the task's module (its one non-test ``.py`` file)."""
    modules = [p[:-3] for p in task.files if p.endswith(".py") and not p.startswith("test_")]
    if len(modules) != 1:
        raise ValueError(f"task {task.id}: expected one module besides the tests, got {modules}")
    return modules[0]


def fresh_name(rng: random.Random) -> str:
    """A fresh identifier made of common words (``models.words.WORDS``), such as ``tower`` or
    ``keep_score``: single tokens of the tiny model's vocabulary that the policy must copy."""
    parts = [rng.choice(WORDS)]
    if rng.random() < 0.3:
        parts.append(rng.choice(WORDS))
    name = "_".join(parts)
    return name if _usable(name) else fresh_name(rng)


def _usable(name: str) -> bool:
    """A name that cannot clash (``suite.compose.usable_name``) and is not one of the
    hand-written templates' variable names either."""
    return usable_name(name) and name not in _RESERVED


_RESERVED = frozenset(["a", "b", "c", "d", "n", "x", "xs", "i", "k", "out", "total", "count", "limit", "low", "high", "best", "item", "items", "value", "values", "result", "test"])


RENAMED_MARK = "~r"
"""Renamed copies have ids ``ID~rN``."""


def is_renamed(task_id: str) -> bool:
    """Whether ``task_id`` names a renamed copy made by ``renamed_copies``."""
    return RENAMED_MARK in task_id


def rename_text(text: str, old: str, new: str) -> str:
    """``text`` with the function/module name ``old`` replaced by ``new`` wherever it is used
    as a name (see the module docstring)."""
    patterns = (
        (rf"\b{old}(?=\()", new),                    # definitions and calls
        (rf"\bfrom {old} import {old}\b", f"from {new} import {new}"),
        (rf"\b(test_hidden_|test_)?{old}\.py\b", rf"\g<1>{new}.py"),
        (rf"\bThe {old} function\b", f"The {new} function"),
        (rf"'{old}\(", f"'{new}("),
    )
    for pattern, replacement in patterns:
        text = re.sub(pattern, replacement, text)
    return text


def _rename_files(files: Mapping[str, str], old: str, new: str) -> dict[str, str]:
    return {rename_text(path, old, new): rename_text(content, old, new)
            for path, content in files.items()}


def rename_task(task: Task, new: str, new_id: str) -> Task:
    """``task`` with its function and module called ``new`` (see the module docstring)."""
    old = module_name(task)
    return dataclasses.replace(
        task, id=new_id,
        instruction=rename_text(task.instruction, old, new),
        files=_rename_files(task.files, old, new),
        protected=tuple(rename_text(p, old, new) for p in task.protected),
        test_command=rename_text(task.test_command, old, new),
        hidden_files=_rename_files(task.hidden_files, old, new),
        hidden_test_command=rename_text(task.hidden_test_command, old, new),
        solution=None if task.solution is None else _rename_files(task.solution, old, new))


def renamed_copies(tasks: Sequence[Task], copies: int, seed: int) -> list[Task]:
    """The tasks followed by ``copies`` renamed copies of each (ids ``ID~rN``)."""
    rng = random.Random(f"rename:{seed}")
    out = list(tasks)
    for index in range(copies):
        for task in tasks:
            out.append(rename_task(task, fresh_name(rng), f"{task.id}{RENAMED_MARK}{index}"))
    return out
