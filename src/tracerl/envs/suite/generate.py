"""Deterministic generation of the built-in suite's tasks from a seed."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from tracerl.envs.suite.compose import composed_templates
from tracerl.envs.suite.templates import FAMILIES, TEMPLATES, ArgKind, Split, Template
from tracerl.envs.tasks import Budget, Task

DEFAULT_COUNTS: dict[str, int] = {"train": 350, "heldout": 140}
"""How many tasks ``generate_split`` makes when no count is given."""

VISIBLE_CASES = 3
"""Test cases in the visible test file."""
HIDDEN_CASES = 5
"""Test cases in the hidden test file (values different from the visible ones)."""

_CHECK = '''

def check(call, fn, want):
    try:
        got = fn()
    except Exception as error:
        got = error
    if type(got) is not type(want) or got != want:
        print("FAIL", call, "got", repr(got), "want", repr(want))
        return 1
    return 0


bad = 0
'''
# The type check keeps an object whose __eq__ always says True from passing.
_FOOTER = '''if bad:
    raise SystemExit(1)
print("PASS")
'''


def draw_args(kind: ArgKind, rng: random.Random, k: int, hidden: bool) -> tuple[Any, ...]:
    """One test case's arguments. Hidden cases draw from wider ranges than visible ones."""
    top = 25 if hidden else 9

    def items(length_low: int, length_high: int) -> list[int]:
        return [rng.randint(0, top) for _ in range(rng.randint(length_low, length_high))]

    if kind == "ab":
        return (rng.randint(0, top), rng.randint(0, top))
    if kind == "n":
        # Values near the constant exercise boundaries (n == k) as well as the bulk.
        near = [max(0, k + d) for d in (-1, 0, 1)]
        return (rng.choice(near) if rng.random() < 0.5 else rng.randint(0, min(top, 15)),)
    if kind == "xs":
        return (items(2 if hidden else 3, 6 if hidden else 5),)
    if kind == "xs_odd":
        return (items(1, 1) + items(1, 1) + [rng.randint(0, top) for _ in range(
            2 * rng.randint(0, 2 if hidden else 1))],)
    if kind == "xs_limit":
        xs = items(3, 6)
        return (xs, rng.choice(xs) if rng.random() < 0.6 else rng.randint(0, top))
    if kind == "xs_n":
        xs = items(3, 6)
        return (xs, rng.randint(1, len(xs)))
    if kind == "n_low_high":
        low = rng.randint(0, top - 3)
        high = low + rng.randint(1, 5)
        return (rng.choice([low, high, rng.randint(low, high), low - 1, high + 1]), low, high)
    raise ValueError(f"unknown argument kind {kind!r}")


def _render_module(template: Template, name: str, slot: str, k: int, k2: int) -> str:
    fill = {"k": str(k), "k2": str(k2)}
    doc = template.doc.format(**fill)
    body = template.body.replace("{B}", slot.format(**fill)).replace("{k}", str(k))
    return (f'"""The {name} function."""\n\n\ndef {name}({template.params}):\n'
            f'    """{doc}"""\n{body}')


def _load(source: str, name: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(compile(source, f"{name}.py", "exec"), namespace)  # trusted: our own template
    function: Callable[..., Any] = namespace[name]
    return function


def _outcome(function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bool, Any]:
    try:
        return True, function(*[list(a) if isinstance(a, list) else a for a in args])
    except Exception as error:  # a bug may raise (an index out of range): still a difference
        return False, type(error).__name__


def _case_name(index: int) -> str:
    return f"case-{index + 1}"


def _render_hidden_tests(name: str, cases: list[tuple[tuple[Any, ...], Any]]) -> str:
    """The hidden test: each case's result reported as a value check (``envs.verdict``);
    the expected values are not in the file, the verifier compares them outside the sandbox."""
    lines = ["from tracerl_report import end, value\n", f"from {name} import {name}\n\n"]
    for index, (args, _) in enumerate(cases):
        call = f"{name}({', '.join(repr(a) for a in args)})"
        lines.append(f"value({_case_name(index)!r}, lambda: {call})\n")
    lines.append("end()\n")
    return "".join(lines)


def _expected_values(cases: list[tuple[tuple[Any, ...], Any]]) -> dict[str, str]:
    return {_case_name(index): repr(want) for index, (_, want) in enumerate(cases)}


def _render_tests(name: str, cases: list[tuple[tuple[Any, ...], Any]]) -> str:
    lines = [f"from {name} import {name}\n", _CHECK]
    for args, want in cases:
        call = f"{name}({', '.join(repr(a) for a in args)})"
        lines.append(f"bad += check({call!r}, lambda: {call}, {want!r})\n")
    lines.append(_FOOTER)
    return "".join(lines)


def _draw_cases(template: Template, rng: random.Random, k: int, good: Callable[..., Any],
                buggy: Callable[..., Any], count: int, hidden: bool,
                avoid: set[str]) -> list[tuple[tuple[Any, ...], Any]]:
    """``count`` distinct cases, at least one of which the bug gets wrong, and most of which
    (all but two) are not in ``avoid``: some bugs show on one input only (``n == k``), which
    the hidden tests must then share with the visible ones."""
    for _ in range(200):
        cases: list[tuple[tuple[Any, ...], Any]] = []
        seen: set[str] = set()
        reused = 0
        differs = False
        for _ in range(count * 20):
            if len(cases) == count:
                break
            args = draw_args(template.args, rng, k, hidden)
            ok, want = _outcome(good, args)
            if not ok or repr(args) in seen or (repr(args) in avoid and reused >= 2):
                continue
            reused += repr(args) in avoid
            seen.add(repr(args))
            cases.append((args, want))
            differs = differs or _outcome(buggy, args) != (True, want)
        if len(cases) == count and differs:
            return cases
    raise RuntimeError(f"could not draw distinguishing cases for {template.names}")


def make_task(template: Template, rng: random.Random, task_id: str, max_turns: int = 8) -> Task:
    """One task from ``template``, with constants, name and test values drawn from ``rng``;
    ``max_turns`` is its budget of actions."""
    name = rng.choice(template.names)
    k = rng.randint(2, 9)
    k2 = rng.choice([v for v in range(1, 11) if v != k])
    good_src = _render_module(template, name, template.good, k, k2)
    bad_src = _render_module(template, name, template.bad, k, k2)
    good, buggy = _load(good_src, name), _load(bad_src, name)
    visible = _draw_cases(template, rng, k, good, buggy, VISIBLE_CASES, False, set())
    hidden = _draw_cases(template, rng, k, good, buggy, HIDDEN_CASES, True,
                         {repr(args) for args, _ in visible})
    module, test, hidden_test = f"{name}.py", f"test_{name}.py", f"test_hidden_{name}.py"
    return Task(
        id=task_id, family=template.family,
        instruction=f"Fix the bug in {module}. The tests are in {test}.",
        files={module: bad_src, test: _render_tests(name, visible)},
        protected=(test,),
        test_command=f"python {test}",
        hidden_files={hidden_test: _render_hidden_tests(name, hidden)},
        hidden_test_command=f"python {hidden_test}",
        hidden_values=_expected_values(hidden),
        solution={module: good_src},
        budget=Budget(max_turns=max_turns),
    )


def generate_split(split: Split, seed: int = 0, count: int | None = None, *,
                   composed: bool = False, max_turns: int = 8) -> list[Task]:
    """The tasks of ``split``: families in turn, templates and values drawn from ``seed``.

    The same (split, seed, count, composed) always gives the same tasks; a larger count
    extends a smaller one (task i depends only on the seed and i). ``composed`` (train split
    only) draws from the hand-written train templates and the composed ones
    (``suite.compose``): hundreds of bodies per family instead of four to six. ``max_turns``
    is every task's budget of actions (it changes nothing else).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if split not in DEFAULT_COUNTS:
        raise ValueError(f"split must be one of {sorted(DEFAULT_COUNTS)}, got {split!r}")
    count = DEFAULT_COUNTS[split] if count is None else count
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    families = sorted(FAMILIES)
    if composed and split != "train":
        raise ValueError(f"composed: only the train split has composed templates, not {split!r}")
    pool = TEMPLATES + composed_templates() if composed else TEMPLATES
    by_family = {f: [t for t in pool if t.family == f and t.split == split] for f in families}
    tasks: list[Task] = []
    for index in range(count):
        rng = random.Random(f"{split}:{seed}:{index}")
        family = families[index % len(families)]
        template = rng.choice(by_family[family])
        tasks.append(make_task(template, rng, f"{split}-{index:04d}-{family}", max_turns))
    return tasks
