"""Renamed copies of tasks, so a small policy learns to copy names instead of memorising them.

The built-in train split draws function names from a small pool; a tiny model trained on it
learns the pool by heart and cannot even type the name of a held-out file it has never seen.
A renamed copy replaces the function and module name everywhere it is used as a name (the
module file, imports, definitions, calls, test files, commands, the instruction) with a fresh
identifier, and nothing else: docstrings that use the same word as prose keep it.

Fresh local names (``fresh_locals``) do the same for the variables a function binds in its
body (``d = a - b``, loop variables): the built-in composed templates fix one set of local
names per body, so a small policy that must return ``e`` instead of ``d`` recalls a local it
saw in training (``part``) instead of copying the one on the line above. Only locals that
occur nowhere else as a word (docstrings, strings, instruction, tests) are renamed, so a
whole-word rewrite of every text is exact.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import keyword
import random
import re
import string
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


def renamed_copies(tasks: Sequence[Task], copies: int, seed: int, *,
                   fresh_locals: bool = False) -> list[Task]:
    """The tasks followed by ``copies`` renamed copies of each (ids ``ID~rN``); with
    ``fresh_locals`` the copies' local variables get fresh names too."""
    rng = random.Random(f"rename:{seed}")
    local_rng = random.Random(f"rename-locals:{seed}")
    out = list(tasks)
    for index in range(copies):
        for task in tasks:
            copy = rename_task(task, fresh_name(rng), f"{task.id}{RENAMED_MARK}{index}")
            if fresh_locals:
                copy = rename_task_locals(copy, fresh_local_names(copy, local_rng))
            out.append(copy)
    return out


_WORD = re.compile(r"\w+")
_TOOL_WORDS = frozenset({"line", "old", "new", "path", "name", "arguments", "error", "text",
                         "found"})
"""Words of the tools' calls and answers: never given to a local (a transcript would read
``"old": "old"``)."""


def _module_path(task: Task) -> str:
    return f"{module_name(task)}.py"


def _task_texts(task: Task) -> list[str]:
    return [task.instruction, task.test_command, task.hidden_test_command,
            *task.files.keys(), *task.files.values(), *task.hidden_files.keys(),
            *task.hidden_files.values(), *(task.solution or {}).values()]


def local_names(task: Task) -> tuple[str, ...]:
    """Names the task's module binds inside its functions (assignments, loop and comprehension
    targets; not parameters) that occur as a word nowhere but in that module's code: not in a
    docstring, a string constant, the instruction, another file or the hidden tests."""
    path = _module_path(task)
    tree = ast.parse(task.files[path])
    bound: set[str] = set()
    params: set[str] = set()
    prose: list[str] = [task.instruction, task.test_command, task.hidden_test_command,
                        *(c for p, c in task.files.items() if p != path),
                        *task.hidden_files.values()]
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            arguments = node.args
            params |= {a.arg for a in (*arguments.posonlyargs, *arguments.args,
                                       *arguments.kwonlyargs)}
            params |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
            bound |= {n.id for n in ast.walk(node)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            prose.append(node.value)  # docstrings and string literals
    words = set(_WORD.findall("\n".join(prose)))
    return tuple(sorted(n for n in bound - params if n not in words))


def fresh_local_names(task: Task, rng: random.Random,
                      taken: frozenset[str] = frozenset()) -> dict[str, str]:
    """A fresh name for each of ``local_names(task)``: half the time a single letter, else a
    common word (one token of the tiny model's vocabulary), never a word of any of the task's
    texts, of ``taken``, of the tools' answers, a keyword or a builtin."""
    used = set(taken) | _TOOL_WORDS
    for text in _task_texts(task):
        used.update(_WORD.findall(text))
    mapping: dict[str, str] = {}
    for name in local_names(task):
        while True:
            new = (rng.choice(string.ascii_lowercase) if rng.random() < 0.5
                   else rng.choice(WORDS))
            if (new.isidentifier() and not keyword.iskeyword(new)
                    and not hasattr(builtins, new) and new not in used):
                break
        used.add(new)
        mapping[name] = new
    return mapping


def rename_locals_text(text: str, mapping: Mapping[str, str]) -> str:
    """``text`` with every whole-word occurrence of a key of ``mapping`` replaced by its value
    (all at once, so ``{"d": "e", "e": "d"}`` swaps)."""
    if not mapping:
        return text
    pattern = re.compile(r"\b(?:" + "|".join(re.escape(k) for k in
                                               sorted(mapping, key=len, reverse=True)) + r")\b")
    return pattern.sub(lambda m: mapping[m.group()], text)


def rename_task_locals(task: Task, mapping: Mapping[str, str]) -> Task:
    """``task`` with its module's locals renamed by ``mapping`` (keys from ``local_names``,
    which occur nowhere else, so only the module and its solution change)."""
    unknown = sorted(set(mapping) - set(local_names(task)))
    if unknown:
        raise ValueError(f"rename_task_locals: {unknown} are not renamable locals of task "
                         f"{task.id}")
    path = _module_path(task)
    files = dict(task.files)
    files[path] = rename_locals_text(files[path], mapping)
    solution = None if task.solution is None else {
        p: rename_locals_text(c, mapping) if p == path else c for p, c in task.solution.items()}
    return dataclasses.replace(task, files=files, solution=solution)
