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

from tracerl.envs.tasks import Task

_SYLLABLES = ("ba", "ko", "ri", "te", "mu", "sa", "li", "no", "pe", "du", "xa", "vo", "zi",
              "fe", "go", "ha", "ju", "qi", "ro", "wy")


def module_name(task: Task) -> str:
    """The name of the task's module (its one non-test ``.py`` file)."""
    modules = [p[:-3] for p in task.files if p.endswith(".py") and not p.startswith("test_")]
    if len(modules) != 1:
        raise ValueError(f"task {task.id}: expected one module besides the tests, got {modules}")
    return modules[0]


def fresh_name(rng: random.Random) -> str:
    """A pronounceable identifier such as ``koriba`` or ``mu_tesa``."""
    parts = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))]
    if rng.random() < 0.3:
        parts.append("".join(rng.choice(_SYLLABLES) for _ in range(2)))
    return "_".join(parts)


def _rename_text(text: str, old: str, new: str) -> str:
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
    return {_rename_text(path, old, new): _rename_text(content, old, new)
            for path, content in files.items()}


def rename_task(task: Task, new: str, new_id: str) -> Task:
    """``task`` with its function and module called ``new`` (see the module docstring)."""
    old = module_name(task)
    return dataclasses.replace(
        task, id=new_id,
        instruction=_rename_text(task.instruction, old, new),
        files=_rename_files(task.files, old, new),
        protected=tuple(_rename_text(p, old, new) for p in task.protected),
        test_command=_rename_text(task.test_command, old, new),
        hidden_files=_rename_files(task.hidden_files, old, new),
        hidden_test_command=_rename_text(task.hidden_test_command, old, new),
        solution=None if task.solution is None else _rename_files(task.solution, old, new))


def renamed_copies(tasks: Sequence[Task], copies: int, seed: int) -> list[Task]:
    """The tasks followed by ``copies`` renamed copies of each (ids ``ID~rN``)."""
    rng = random.Random(f"rename:{seed}")
    out = list(tasks)
    for index in range(copies):
        for task in tasks:
            out.append(rename_task(task, fresh_name(rng), f"{task.id}~r{index}"))
    return out
