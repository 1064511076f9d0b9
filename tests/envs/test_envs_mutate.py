"""Mutants: every operator, one place changed, the rest of the file kept, seeded."""

from __future__ import annotations

import ast
import difflib

import pytest

from tracerl.envs.mutate import OPERATORS, mutants

SOURCE = '''"""A module."""


def window(items, size):  # keeps this comment
    """Sums of each run of size items."""
    total = 0
    out = []
    for i in range(len(items)):
        total += items[i]
        if i >= size:
            total -= items[i - size]
        if i + 1 >= size and size > 0:
            out.append(total)
    return out[0:size] if size < 0 else out


def scale(a, b):
    return divmod(a, b)[0] - a / b * 2 is not None
'''


def _changed_lines(before: str, after: str) -> list[str]:
    return [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(),
                                                  lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_every_operator_makes_mutants_that_parse_and_differ() -> None:
    found = mutants(SOURCE)
    assert {m.operator for m in found} == set(OPERATORS)
    for mutant in found:
        ast.parse(mutant.source)
        assert mutant.source != SOURCE
        changed = _changed_lines(SOURCE, mutant.source)
        # One place: a dropped statement removes one line, any other change rewrites one.
        assert 1 <= len(changed) <= 2, (mutant, changed)
        assert "# keeps this comment" in mutant.source
        assert mutant.function in ("window", "scale")


def test_operator_swap_keeps_the_line_formatting() -> None:
    found = [m for m in mutants(SOURCE) if m.description == "- -> +" and m.function == "scale"]
    assert len(found) == 1
    assert _changed_lines(SOURCE, found[0].source) == [
        "-    return divmod(a, b)[0] - a / b * 2 is not None",
        "+    return divmod(a, b)[0] + a / b * 2 is not None"]


def test_seed_orders_mutants_deterministically() -> None:
    assert mutants(SOURCE, seed=5) == mutants(SOURCE, seed=5)
    assert [m.source for m in mutants(SOURCE, seed=5)] != [m.source for m in mutants(SOURCE, seed=6)]
    assert len(mutants(SOURCE, seed=5, limit=3)) == 3
    assert all(m.function == "scale" for m in mutants(SOURCE, select=lambda n: n == "scale"))


def test_source_that_does_not_parse_is_refused() -> None:
    with pytest.raises(ValueError, match="source does not parse"):
        mutants("def broken(:\n")
