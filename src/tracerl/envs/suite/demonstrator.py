"""The built-in suite's scripted demonstrator: imperfect attempts played in the environment.

Demonstrations are played in the real environment (its tools, its observations, its sandboxed
test runs), so every observation the policy is trained to read is one the environment really
returns. They are deliberately imperfect: a share make a wrong edit, some of those run the
tests, see FAIL and submit anyway, and a few recover (edit again, PASS, submit). RL then has
something to amplify: the recovery behaviour exists, with small probability.

This is recipe, not library: it knows how the built-in tasks are made (one changed line per
task, ``augment``'s renamed copies). The supervised training that learns from any
demonstrations is :mod:`tracerl.train.sft`.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from tracerl.envs.suite.augment import RENAMED_MARK, rename_text
from tracerl.envs.tasks import Task
from tracerl.hermes import render_tool_call

DemoKind = Literal["correct", "checked", "wrong", "wrong_checked", "recovery", "retry",
                   "search"]
"""What a demonstration shows: ``correct`` (view, right edit, submit), ``checked`` (the same
with a passing test run before submitting), ``wrong`` (a wrong edit, submitted),
``wrong_checked`` (a wrong edit, FAIL, submitted anyway), ``recovery`` (a wrong edit, FAIL, the
right edit, PASS, submit), ``retry`` (an edit whose ``old`` is not in the line, the tool's
``error: ... not found``, the right edit, PASS, submit), ``search`` (one or two wrong
versions of the buggy part of the line, each tested and FAIL, then the right one, PASS,
submit: a demonstrator that does not know the fix and uses the tests to find it). With
``undo``, ``recovery`` and ``search`` undo each failed try (FAIL, ``undo``, the line shown as
the task gave it) and edit that line again; a wrong try then costs three turns, and
``search`` makes as many (one or two) as its turn budget leaves room for (one in the built-in
8 turns, two in 12: ``search_tries``)."""


@dataclass(frozen=True)
class Demonstration:
    """One scripted attempt: the first observation and (action, observation) turns."""

    task_id: str
    """The task it solves (or fails to)."""
    kind: DemoKind
    """What it shows."""
    first_observation: str
    """What ``env.reset`` returned."""
    turns: tuple[tuple[str, str | None], ...]
    """Action text and the observation that came back (None after the final submit)."""


_TOKEN = re.compile(r"\w+|[^\w\s]+")
_SWAPS: tuple[tuple[str, ...], ...] = (
    ("+", "-", "*"), ("<", "<=", ">", ">="), ("==", "!="), ("0", "1", "-1", "-2", "2"),
)


def bug_location(task: Task) -> tuple[str, int, str, str]:
    """(file, 1-based line number, buggy line, fixed line) of the one line the solution
    changes, lines given in full (indentation included)."""
    if not task.solution:
        raise ValueError(f"task {task.id}: a demonstration needs the task's solution")
    for path, fixed in task.solution.items():
        old_lines, new_lines = task.files.get(path, "").splitlines(), fixed.splitlines()
        changed = [i for i, (a, b) in enumerate(zip(old_lines, new_lines, strict=False)) if a != b]
        if len(changed) == 1 and len(old_lines) == len(new_lines):
            return path, changed[0] + 1, old_lines[changed[0]], new_lines[changed[0]]
    raise ValueError(f"task {task.id}: the solution does not change exactly one line")


def bug_line(task: Task) -> tuple[str, str, str]:
    """(file, buggy text, fixed text): the one line the solution changes, stripped of
    indentation (the shortest edit the ``replace`` tool accepts when it is unique)."""
    path, _, bad, good = bug_location(task)
    if task.files[path].count(bad.strip()) == 1:
        return path, bad.strip(), good.strip()
    return path, bad, good


_PIECE = re.compile(r"\s+|\w+|[^\w\s]+")
"""Pieces of a line for ``minimal_edit``: whitespace runs, words, symbol runs."""


def _common_ends(ta: list[str], tb: list[str]) -> tuple[int, int]:
    """How many pieces two piece lists share at the start, and then at the end."""
    head = 0
    while head < min(len(ta), len(tb)) and ta[head] == tb[head]:
        head += 1
    tail = 0
    while tail < min(len(ta), len(tb)) - head and ta[-1 - tail] == tb[-1 - tail]:
        tail += 1
    return head, tail


def minimal_edit(before: str, after: str) -> tuple[str, str]:
    """The shortest (old, new) pair, on token boundaries, that turns the line ``before`` into
    ``after`` with one replacement, ``old`` occurring exactly once in ``before``.

    The common prefix and suffix of the two token lists are left out; when that leaves
    ``old`` empty (a pure insertion) or not unique in the line, it grows by a token at a time,
    left then right."""
    if before == after:
        raise ValueError("minimal_edit: the lines are equal; there is nothing to replace")
    ta, tb = _PIECE.findall(before), _PIECE.findall(after)
    head, tail = _common_ends(ta, tb)
    lo_a, hi_a, lo_b, hi_b = head, len(ta) - tail, head, len(tb) - tail

    def piece() -> tuple[str, str]:
        return "".join(ta[lo_a:hi_a]), "".join(tb[lo_b:hi_b])

    grow_left = True
    while True:
        old, new = piece()
        if old.strip() and before.count(old) == 1:
            return old, new
        if grow_left and lo_a > 0:
            lo_a, lo_b = lo_a - 1, lo_b - 1
        elif hi_a < len(ta):
            hi_a, hi_b = hi_a + 1, hi_b + 1
        elif lo_a > 0:
            lo_a, lo_b = lo_a - 1, lo_b - 1
        else:
            return before, after
        grow_left = not grow_left


def _wrong_options(bad: str, good: str) -> list[tuple[int, int, str]]:
    """Plausible wrong versions of the line, each with the span of ``good`` it changes: one
    operator, comparison or number of the correct line changed to something that is neither
    the bug nor the fix."""
    options: list[tuple[int, int, str]] = []
    for match in _TOKEN.finditer(good):
        start, end, text = match.start(), match.end(), match.group()
        alternatives: list[str] = []
        for group in _SWAPS:
            if text in group:
                alternatives += [g for g in group if g != text]
        if text.isdigit():
            alternatives += [str(int(text) + d) for d in (-1, 1, 2) if int(text) + d >= 0]
        for alternative in alternatives:
            candidate = good[:start] + alternative + good[end:]
            if candidate not in (bad, good):
                options.append((start, end, candidate))
    if not options:
        # No operator or number to change (e.g. ``range(n):``): shift the last bracketed value.
        close = good.rfind(")")
        for shift in (" + 2", " - 2", " * 2"):
            candidate = good[:close] + shift + good[close:] if close > 0 else good + shift
            if candidate not in (bad, good):
                options.append((max(close, 0), max(close, 0), candidate))
    return options


def wrong_fix(bad: str, good: str, rng: random.Random) -> str:
    """A plausible but wrong version of the line: one operator, comparison or number of the
    correct line changed to something that is neither the bug nor the fix."""
    return rng.choice(sorted({candidate for _, _, candidate in _wrong_options(bad, good)}))


def search_candidates(bad: str, good: str, rng: random.Random, most: int = 2) -> list[str]:
    """One to ``most`` distinct wrong versions of the line for a demonstrator that searches:
    preferably ones that change the part of the line the bug changed (another operator where
    the bug's operator is), else any of ``wrong_fix``'s."""
    tb = _PIECE.findall(good)
    head, tail = _common_ends(_PIECE.findall(bad), tb)
    low = len("".join(tb[:head]))
    high = len(good) - len("".join(tb[len(tb) - tail:]))
    options = _wrong_options(bad, good)
    near = sorted({c for start, end, c in options if start < max(high, low + 1) and end > low})
    pool = near or sorted({c for _, _, c in options})
    return rng.sample(pool, rng.randint(1, min(most, len(pool))))


def misremembered_old(line: str, old: str, rng: random.Random) -> str:
    """An ``old`` text a policy might type from memory instead of copying it: an operator or
    number of the same kind as ``old`` (or any of the swap table's) that does not occur in
    ``line``, so the ``replace`` tool answers ``old text not found``."""
    pieces = _TOKEN.findall(old) or [old]
    options: list[str] = []
    for piece in pieces:
        for group in _SWAPS:
            if piece in group:
                options += [old.replace(piece, g, 1) for g in group if g != piece]
        if piece.isdigit():
            options += [old.replace(piece, str(int(piece) + d), 1) for d in (1, 2, 3)]
    absent = sorted({o for o in options if o.strip() and o not in line})
    # Nothing of the same kind is missing from the line: any operator of the table that is.
    options = absent or sorted({g for group in _SWAPS for g in group if g not in line})
    if not options:
        raise ValueError(f"misremembered_old: every candidate occurs in the line {line!r}")
    return rng.choice(options)


def _call(name: str, **arguments: str) -> str:
    return render_tool_call(name, dict(arguments))


def plan_kind(rng: random.Random, wrong_fraction: float, recovery_fraction: float,
              check_fraction: float, retry_fraction: float = 0.0,
              search_fraction: float = 0.0) -> DemoKind:
    """Draw what a demonstration shows from the configured fractions (``retry_fraction`` and
    ``search_fraction`` are drawn first; the others share what is left)."""
    if retry_fraction > 0 and rng.random() < retry_fraction:
        return "retry"
    if search_fraction > 0 and rng.random() < search_fraction:
        return "search"
    draw = rng.random()
    if draw < recovery_fraction:
        return "recovery"
    if draw < wrong_fraction:
        return "wrong_checked" if rng.random() < 0.5 else "wrong"
    return "checked" if rng.random() < check_fraction else "correct"


def _edit(path: str | None, line: int | None, before: str, after: str,
          old: str | None = None) -> str:
    """A ``replace`` call turning ``before`` into ``after``: the whole text, or (with ``line``)
    the minimal change within that line; ``path`` None relies on the open file. ``old``,
    when given, replaces the text to find (a wrong one, for a demonstration of the tool's
    error)."""
    where: dict[str, object] = {} if path is None else {"path": path}
    if line is None:
        return render_tool_call("replace", {**where, "old": old or before, "new": after})
    found, new = minimal_edit(before, after)
    return render_tool_call("replace", {**where, "line": line, "old": old or found, "new": new})


def search_tries(max_turns: int, undo: bool) -> int:
    """The most wrong tries a ``search`` demonstration makes within ``max_turns``: each costs
    an edit and a test run (and an ``undo``); the view, the right edit, its test run and the
    submit take four more turns. At least one, at most two."""
    return max(1, min(2, (max_turns - 4) // (3 if undo else 2)))


@dataclass(frozen=True)
class _Plan:
    """One demonstration's actions, decided before any is played: every random draw of a
    demonstration happens here, so plans made in order and played in any order (or at once)
    give the same demonstrations."""

    task_id: str
    kind: DemoKind
    path: str
    actions: tuple[str, ...]


def _plan_demonstration(task: Task, kind: DemoKind, rng: random.Random, *, line_edits: bool,
                        implicit_path: bool, undo: bool, max_turns: int) -> _Plan:
    if line_edits:
        path, number, bad, good = bug_location(task)
        line: int | None = number
    else:
        path, bad, good = bug_line(task)
        line = None
    wrong = wrong_fix(bad, good, rng)
    named: str | None = None if implicit_path else path

    def edit(before: str, after: str, old: str | None = None) -> str:
        return _edit(named, line, before, after, old=old)

    actions = [render_tool_call("view_file", {} if named is None else {"path": named})]
    if kind == "retry":
        found = minimal_edit(bad, good)[0] if line is not None else bad
        actions += [edit(bad, good, old=misremembered_old(bad, found, rng)), edit(bad, good),
                    _call("run_tests")]
    elif kind == "search":
        current = bad
        most = search_tries(max_turns, undo)
        for candidate in [*search_candidates(bad, good, rng, most=most), good]:
            actions += [edit(current, candidate), _call("run_tests")]
            if undo and candidate != good:
                actions.append(_call("undo"))
            else:
                current = candidate
    elif kind in ("correct", "checked"):
        actions.append(edit(bad, good))
        if kind == "checked":
            actions.append(_call("run_tests"))
    else:
        actions.append(edit(bad, wrong))
        if kind in ("wrong_checked", "recovery"):
            actions.append(_call("run_tests"))
        if kind == "recovery":
            if undo:
                actions += [_call("undo"), edit(bad, good)]
            else:
                actions.append(edit(wrong, good))
            actions.append(_call("run_tests"))
    return _Plan(task.id, kind, path, tuple(actions))


def _play(plan: _Plan, env: Any, implicit_path: bool) -> Demonstration:
    first, _ = env.reset(options={"task_id": plan.task_id})
    if implicit_path and getattr(env, "open_file", None) != plan.path:
        raise ValueError(f"task {plan.task_id}: the bug is in {plan.path}, not in the open file")
    turns: list[tuple[str, str | None]] = []
    for action in plan.actions:
        if turns and turns[-1][1] == "PASS":
            break  # a wrong try passed the visible tests: the demonstrator submits it
        observation, _, terminated, truncated, info = env.step(action)
        if terminated or truncated or info.get("tool_error"):
            raise ValueError(f"task {plan.task_id}: demonstration step {action!r} ended the "
                             "episode")
        turns.append((action, str(observation)))
    turns.append((_call("submit"), None))
    return Demonstration(plan.task_id, plan.kind, str(first), tuple(turns))


def play_demonstration(task: Task, kind: DemoKind, env: Any, rng: random.Random, *,
                       line_edits: bool = False, implicit_path: bool = False,
                       undo: bool = False, max_turns: int = 8) -> Demonstration:
    """Play one scripted attempt in ``env`` (a ``CodingEnv``); submit is not stepped (its
    observation is never shown to the policy, and verification would only cost time).

    ``line_edits``: edits name the line and replace only the changed tokens (see
    ``minimal_edit``); otherwise ``old`` is the whole stripped buggy line. ``implicit_path``:
    ``view_file`` and ``replace`` leave out ``path`` and act on the environment's open file
    (the task's first editable file, which is the one with the bug in the built-in suite).
    ``undo``: after a wrong edit's FAIL, ``recovery`` and ``search`` call ``undo`` and make the
    next edit on the original line (otherwise they edit the wrong version). ``max_turns``:
    the policy's turn budget, which bounds how many wrong tries ``search`` makes.
    Every demonstration submits at its first PASS: a wrong try that the visible tests happen
    to pass is submitted, as a demonstrator who cannot tell would."""
    plan = _plan_demonstration(task, kind, rng, line_edits=line_edits,
                               implicit_path=implicit_path, undo=undo, max_turns=max_turns)
    return _play(plan, env, implicit_path)


def make_demonstrations(tasks: Sequence[Task], make_env: Callable[[], Any], *,
                        demos_per_task: int, wrong_fraction: float, recovery_fraction: float,
                        check_fraction: float, seed: int, line_edits: bool = False,
                        implicit_path: bool = False, retry_fraction: float = 0.0,
                        search_fraction: float = 0.0, undo: bool = False,
                        max_turns: int = 8, workers: int = 8) -> list[Demonstration]:
    """``demos_per_task`` demonstrations of each task, kinds drawn from the fractions.

    ``workers`` environments play them at once (each test run is a sandboxed process, so the
    threads mostly wait); the result does not depend on ``workers``: every random draw is made
    first, in order (``_plan_demonstration``), and each environment is reset per task."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    rng = random.Random(seed)
    plans = [
        _plan_demonstration(task, plan_kind(rng, wrong_fraction, recovery_fraction,
                                            check_fraction, retry_fraction, search_fraction),
                            rng, line_edits=line_edits, implicit_path=implicit_path, undo=undo,
                            max_turns=max_turns)
        for task in tasks for _ in range(demos_per_task)]
    workers = min(workers, max(1, len(plans)))

    def play_share(share: int) -> list[Demonstration]:
        env = make_env()
        try:
            return [_play(plan, env, implicit_path) for plan in plans[share::workers]]
        finally:
            env.close()

    with ThreadPoolExecutor(workers, thread_name_prefix="tracerl-demo") as pool:
        shares = list(pool.map(play_share, range(workers)))
    # Share k holds plans k, k + workers, ...: interleave them back into the plans' order.
    return [shares[index % workers][index // workers] for index in range(len(plans))]


def rename_demonstration(demo: Demonstration, old: str, new: str) -> Demonstration:
    """``demo`` as it would have been played on the task renamed from ``old`` to ``new``: the
    environment's observations depend on the name only through the texts that
    ``augment.rename_task`` rewrites, so the same rewrite of every text gives that attempt
    without playing it again (a test checks this against a replay)."""
    first = rename_text(demo.first_observation, old, new)
    head, marker, listing = first.partition("\nFiles:\n")
    if marker:  # the environment lists files sorted: a new name may change the order
        first = head + marker + "\n".join(sorted(listing.split("\n")))
    return dataclasses.replace(
        demo, task_id=f"{demo.task_id}{RENAMED_MARK}{new}",
        first_observation=first,
        turns=tuple((rename_text(a, old, new), None if o is None else rename_text(o, old, new))
                    for a, o in demo.turns))


def demonstration_texts(demos: Sequence[Demonstration]) -> list[str]:
    """Texts for training a tokenizer: every observation and action."""
    texts: list[str] = []
    for demo in demos:
        texts.append(demo.first_observation)
        for action, observation in demo.turns:
            texts.append(action)
            if observation is not None:
                texts.append(observation)
    return texts
