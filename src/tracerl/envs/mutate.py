"""Bugs put into working Python functions with ``ast``: the mutants bug-fix tasks start from.

Each mutant changes one place of one function, by one of these operators:

- ``operator``: an arithmetic operator swapped (``+``/``-``, ``*``/``//`` or ``/``, ...).
- ``comparison``: a comparison turned into its neighbour (``<``/``<=``, ``==``/``!=``, ``in``/
  ``not in``, ``is``/``is not``).
- ``constant``: a number moved by one, or a boolean flipped.
- ``off_by_one``: an index, a slice bound or a ``range`` stop moved by one.
- ``swapped_names``: the two names of a non-commutative operation or of a call's arguments
  swapped.
- ``dropped_statement``: one simple statement (an assignment or a call) of a body with
  several removed.
- ``inverted_condition``: the test of an ``if``/``while``/conditional expression negated, or
  ``and``/``or`` swapped.

Only the changed place is rewritten in the source text; the rest of the file (comments,
formatting) stays as it was, so the fix is a small diff. A mutant whose text does not parse
back to exactly the mutated tree is left out.
"""

from __future__ import annotations

import ast
import copy
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

OPERATORS = ("operator", "comparison", "constant", "off_by_one", "swapped_names",
             "dropped_statement", "inverted_condition")
"""Every mutation operator, in the order sites are listed."""

_BINOP_SWAP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
}
_COMPARE_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_DROPPABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)
"""Statements a ``dropped_statement`` mutant may remove (one line's worth, not a block)."""
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift)


@dataclass(frozen=True)
class Mutant:
    """One mutated version of a source file."""

    operator: str
    """Which operator made it (one of ``OPERATORS``)."""
    function: str
    """Qualified name of the function changed (``Class.method`` for a method)."""
    line: int
    """First line (1-based) of the changed place in the original source."""
    description: str
    """What changed, e.g. ``'<' -> '<='``."""
    source: str
    """The whole mutated file."""


@dataclass(frozen=True)
class _Site:
    operator: str
    function: str
    node: ast.AST
    """The node replaced (an expression or a statement)."""
    replacement: ast.AST | None
    """Its replacement; None drops the statement."""
    description: str
    token: tuple[ast.AST, ast.AST, str, str] | None = None
    """For an operator swap: the nodes around the operator, its text and the new text, so
    only the operator is rewritten (the expression keeps its formatting)."""


def functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Top-level functions and methods of top-level classes, with qualified names."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{item.name}", item


def _is_docstring(statement: ast.stmt) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str))


def _sites_in(name: str, function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[_Site]:
    sites: list[_Site] = []

    def add(operator: str, node: ast.AST, replacement: ast.AST | None, text: str,
            token: tuple[ast.AST, ast.AST, str, str] | None = None) -> None:
        sites.append(_Site(operator, name, node, replacement, text, token))

    def shifted(expr: ast.expr, delta: int) -> ast.expr:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, int):
            return ast.Constant(expr.value + delta)
        op: ast.operator = ast.Add() if delta > 0 else ast.Sub()
        return ast.BinOp(copy.deepcopy(expr), op, ast.Constant(abs(delta)))

    body_nodes = [n for statement in function.body for n in ast.walk(statement)]
    for node in body_nodes:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP:
            new = copy.deepcopy(node)
            new.op = _BINOP_SWAP[type(node.op)]()
            add("operator", node, new, f"{_op(node.op)} -> {_op(new.op)}",
                (node.left, node.right, _op(node.op), _op(new.op)))
            if (isinstance(node.op, _NON_COMMUTATIVE) and isinstance(node.left, ast.Name)
                    and isinstance(node.right, ast.Name) and node.left.id != node.right.id):
                swapped = ast.BinOp(copy.deepcopy(node.right), node.op, copy.deepcopy(node.left))
                add("swapped_names", node, swapped, f"{node.left.id} <-> {node.right.id}")
        elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOP_SWAP:
            new_aug = copy.deepcopy(node)
            new_aug.op = _BINOP_SWAP[type(node.op)]()
            add("operator", node, new_aug, f"{_op(node.op)}= -> {_op(new_aug.op)}=",
                (node.target, node.value, _op(node.op) + "=", _op(new_aug.op) + "="))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 \
                and type(node.ops[0]) in _COMPARE_SWAP:
            new_cmp = copy.deepcopy(node)
            new_cmp.ops = [_COMPARE_SWAP[type(node.ops[0])]()]
            add("comparison", node, new_cmp, f"{_op(node.ops[0])} -> {_op(new_cmp.ops[0])}",
                (node.left, node.comparators[0], _op(node.ops[0]), _op(new_cmp.ops[0])))
        elif isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            if isinstance(node.value, bool):
                add("constant", node, ast.Constant(not node.value),
                    f"{node.value} -> {not node.value}")
            else:
                number: int | float = node.value
                value = number + 1 if number == 0 else number - 1
                add("constant", node, ast.Constant(value), f"{node.value!r} -> {value!r}")
        elif isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice) \
                and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Name):
            new_sub = copy.deepcopy(node)
            new_sub.slice = shifted(node.slice, 1)
            add("off_by_one", node, new_sub, f"[{node.slice.id}] -> [{node.slice.id} + 1]")
        elif isinstance(node, ast.Slice):
            for part in ("lower", "upper"):
                bound = getattr(node, part)
                if bound is not None and not isinstance(bound, ast.Constant):
                    new_slice = copy.deepcopy(node)
                    setattr(new_slice, part, shifted(bound, 1))
                    add("off_by_one", node, new_slice, f"slice {part} bound + 1")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "range" and node.args and not node.keywords:
                index = 0 if len(node.args) == 1 else 1
                new_call = copy.deepcopy(node)
                new_call.args[index] = shifted(node.args[index], 1)
                add("off_by_one", node, new_call, "range stop + 1")
            names = [a for a in node.args if isinstance(a, ast.Name)]
            if len(node.args) >= 2 and len(names) >= 2 and names[0].id != names[1].id:
                new_args = copy.deepcopy(node)
                first, second = (node.args.index(names[0]), node.args.index(names[1]))
                new_args.args[first], new_args.args[second] = (copy.deepcopy(names[1]),
                                                               copy.deepcopy(names[0]))
                add("swapped_names", node, new_args,
                    f"{node.func.id}({names[0].id}, {names[1].id}) arguments swapped")
        elif isinstance(node, ast.BoolOp):
            new_bool = copy.deepcopy(node)
            new_bool.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            add("inverted_condition", node, new_bool,
                f"{_op(node.op)} -> {_op(new_bool.op)}",
                (node.values[0], node.values[1], _op(node.op), _op(new_bool.op))
                if len(node.values) == 2 else None)
        if isinstance(node, ast.If | ast.While | ast.IfExp):
            test = node.test
            negated: ast.expr = (copy.deepcopy(test.operand)
                                 if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
                                 else ast.UnaryOp(ast.Not(), copy.deepcopy(test)))
            add("inverted_condition", test, negated, "condition negated")
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            statements = [s for s in block if isinstance(s, ast.stmt) and not _is_docstring(s)]
            if len(statements) >= 2:
                for statement in statements:
                    if isinstance(statement, _DROPPABLE):
                        add("dropped_statement", statement, None,
                            f"line {statement.lineno} dropped")
    statements = [s for s in function.body if not _is_docstring(s)]
    if len(statements) >= 2:
        for statement in statements:
            if isinstance(statement, _DROPPABLE):
                add("dropped_statement", statement, None, f"line {statement.lineno} dropped")
    return sites


def _op(op: ast.AST) -> str:
    text = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
            ast.Mod: "%", ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
            ast.RShift: ">>", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
            ast.Eq: "==", ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in", ast.Is: "is",
            ast.IsNot: "is not", ast.And: "and", ast.Or: "or"}
    return text.get(type(op), type(op).__name__)


def _offsets(source: str) -> list[int]:
    starts, total = [0], 0
    for line in source.splitlines(keepends=True):
        total += len(line.encode("utf-8"))
        starts.append(total)
    return starts


def _apply(source: str, site: _Site, tree: ast.Module) -> str | None:
    """The source with ``site`` applied as text, or None when the text does not parse back
    to the mutated tree."""
    node = site.node
    data = source.encode("utf-8")
    starts = _offsets(source)
    lineno, end_lineno = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
    col, end_col = getattr(node, "col_offset", None), getattr(node, "end_col_offset", None)
    if None in (lineno, end_lineno, col, end_col):
        return None
    assert lineno is not None and end_lineno is not None and col is not None
    assert end_col is not None
    begin, end = starts[lineno - 1] + col, starts[end_lineno - 1] + end_col
    expected = _mutated_tree(tree, site)
    candidates: list[bytes] = []
    if site.replacement is None:
        # Whole lines go when the statement has them to itself; else it becomes ``pass``.
        head, tail = data[starts[lineno - 1]:begin], data[end:starts[end_lineno]]
        if not head.strip() and (not tail.strip() or tail.strip().startswith(b"#")):
            candidates.append(data[:starts[lineno - 1]] + data[starts[end_lineno]:])
        candidates.append(data[:begin] + b"pass" + data[end:])
    else:
        if site.token is not None:
            left, right, old, new = site.token
            gap_from = _position(starts, left, end=True)
            gap_to = _position(starts, right, end=False)
            if gap_from is not None and gap_to is not None and gap_from < gap_to:
                gap = data[gap_from:gap_to].decode("utf-8")
                if gap.count(old) == 1:
                    candidates.append(data[:gap_from] + gap.replace(old, new).encode("utf-8")
                                      + data[gap_to:])
        text = ast.unparse(site.replacement).encode("utf-8")
        candidates += [data[:begin] + text + data[end:],
                       data[:begin] + b"(" + text + b")" + data[end:]]
    for raw in candidates:
        candidate = raw.decode("utf-8")
        try:
            parsed = ast.parse(candidate)
        except SyntaxError:
            continue
        if ast.dump(parsed) in expected:
            return candidate
    return None


def _position(starts: list[int], node: ast.AST, *, end: bool) -> int | None:
    line = getattr(node, "end_lineno" if end else "lineno", None)
    col = getattr(node, "end_col_offset" if end else "col_offset", None)
    if not isinstance(line, int) or not isinstance(col, int):
        return None
    return starts[line - 1] + col


def _mutated_tree(tree: ast.Module, site: _Site) -> tuple[str, ...]:
    """``ast.dump`` of ``tree`` with the site's change made on the tree itself (a dropped
    statement: removed, or replaced by ``pass``)."""
    if site.replacement is None:
        return (_swapped(tree, site, None), _swapped(tree, site, ast.Pass()))
    return (_swapped(tree, site, site.replacement),)


def _swapped(tree: ast.Module, site: _Site, replacement: ast.AST | None) -> str:
    mutated = copy.deepcopy(tree)
    target_dump = ast.dump(site.node, include_attributes=True)

    class _Swap(ast.NodeTransformer):
        done = False

        def generic_visit(self, node: ast.AST) -> ast.AST:
            for field, value in ast.iter_fields(node):
                if isinstance(value, list):
                    for index, item in enumerate(value):
                        if self._hit(item):
                            if replacement is None:
                                del value[index]
                            else:
                                value[index] = copy.deepcopy(replacement)
                            break
                elif isinstance(value, ast.AST) and self._hit(value):
                    setattr(node, field, copy.deepcopy(replacement))
            return super().generic_visit(node)

        def _hit(self, item: object) -> bool:
            if self.done or not isinstance(item, ast.AST):
                return False
            if ast.dump(item, include_attributes=True) == target_dump:
                self.done = True
                return True
            return False

    _Swap().visit(mutated)
    return ast.dump(mutated)


def mutants(source: str, *, seed: int = 0, limit: int | None = None,
            select: Callable[[str], bool] | None = None) -> list[Mutant]:
    """Mutants of ``source``, shuffled deterministically by ``seed`` (at most ``limit``).

    ``select`` keeps only functions whose qualified name it accepts. Raises ValueError when
    ``source`` does not parse.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        raise ValueError(f"source does not parse: {error}") from None
    sites = [site for name, function in functions(tree) if select is None or select(name)
             for site in _sites_in(name, function)]
    random.Random(seed).shuffle(sites)
    out: list[Mutant] = []
    seen: set[str] = set()
    for site in sites:
        if limit is not None and len(out) >= limit:
            break
        text = _apply(source, site, tree)
        if text is None or text in seen or text == source:
            continue
        seen.add(text)
        line = getattr(site.node, "lineno", 0)
        out.append(Mutant(site.operator, site.function, line, site.description, text))
    return out
