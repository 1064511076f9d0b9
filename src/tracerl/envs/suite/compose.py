"""Composed train templates: many small function bodies built from parts, one bug slot each.

The hand-written train split has 30 templates; a small policy trained on them learns each
template's fix by heart (which line, which operator) and carries nothing to the held-out
templates. Composing bodies from parts (operators and the words that name them, comparisons,
loop shapes, indices, constants, variable names) gives the train split hundreds of bodies per
bug family, so that what pays is the general rule of a family (the docstring says ``minus``,
the code has ``+``; the docstring's constant differs from the code's; the function returns
an intermediate variable) rather than one body's answer.

The held-out templates stay unseen: a composed template whose correct program equals a
held-out template's up to the names of variables (``shape_key``), or whose docstring does
(``doc_key``), is left out (``heldout_like``), and a test checks it.
``composed_templates()`` is deterministic.
"""

from __future__ import annotations

import builtins
import functools
import keyword
import random
import re
import sys
from collections.abc import Iterator

from tracerl.envs.suite.templates import TEMPLATES, ArgKind, Template

OPS: dict[str, str] = {"+": "plus", "-": "minus", "*": "times"}
"""Arithmetic operators and the docstring word for each."""
CMPS: dict[str, str] = {"<=": "at most", ">=": "at least", "<": "below", ">": "above"}
"""Comparisons and the docstring words for each."""
STRICT_SWAP: dict[str, str] = {"<=": "<", "<": "<=", ">=": ">", ">": ">="}
"""The comparison bug: strict for non-strict and back."""
NEGATE: dict[str, str] = {"<=": ">", ">": "<=", ">=": "<", "<": ">="}
"""The comparison that is true exactly when the key is false."""
INDEX_WORDS: dict[str, str] = {"0": "first", "1": "second", "-1": "last", "-2": "second to last"}
"""List positions and the docstring words for each."""
INDEX_BUGS: dict[str, tuple[str, ...]] = {"0": ("1", "-1"), "1": ("0", "2"), "-1": ("-2", "0"),
                                          "-2": ("-1", "-3")}
"""Wrong positions for each right one."""

PAIRS = (("a", "b"), ("p", "q"), ("x", "y"), ("m", "n"), ("u", "v"), ("s", "t"))
SINGLES = ("n", "m", "a", "p", "x", "v", "num", "val")
LISTS = ("xs", "ys", "nums", "vals", "items")
LIMITS = ("limit", "cap", "top", "bound")
LOCALS = ("c", "d", "e", "r", "w", "z", "res", "tmp", "mid", "part")
ACCS = ("total", "acc", "out", "res", "run")
COUNTERS = ("count", "cnt", "hits")
ITEMS = ("x", "v", "y", "item")
WORD_PAIRS = (("big", "small"), ("yes", "no"), ("high", "low"), ("pos", "neg"), ("on", "off"),
              ("hot", "cold"), ("up", "down"))

VARIABLE_NAMES: frozenset[str] = frozenset(
    {n for group in (SINGLES, LISTS, LIMITS, LOCALS, ACCS, COUNTERS, ITEMS, ("i", "j"),
                     ("best", "top", "keep", "size", "cut", "start", "out", "res"))
     for n in group} | {n for pair in PAIRS for n in pair})
"""Every variable name a composed template may use (function names avoid them)."""

_RESERVED = set(keyword.kwlist) | {"len", "range", "append", "True", "False"}
_LEXEME = re.compile(r"'[^']*'|\w+|\S")


def usable_name(name: str) -> bool:
    """Whether ``name`` can name a task's function and module: an identifier that is not a
    keyword, a builtin, a standard-library module (a file of that name would shadow it), a
    variable name of the composed templates, or a name that starts like a test file."""
    return (name.isidentifier() and not keyword.iskeyword(name) and name not in _RESERVED
            and name not in VARIABLE_NAMES and not name.startswith("test")
            and name not in sys.stdlib_module_names and not hasattr(builtins, name))


def _correct_code(template: Template) -> str:
    """The parameter list and the body with the correct code in its slot."""
    return f"({template.params})\n" + template.body.replace("{B}", template.good)


def _code_names(code: str) -> list[str]:
    """The names ``code`` uses, in order of appearance (keywords and builtins left out)."""
    return [lexeme for lexeme in _LEXEME.findall(code)
            if (lexeme[0].isalpha() or lexeme[0] == "_") and lexeme not in _RESERVED]


def shape_key(template: Template) -> tuple[str, str]:
    """(docstring, correct code) with the template's variable names replaced by ``v0, v1, ...``
    in order of first appearance: two templates with equal keys differ only in names."""
    code = _correct_code(template)
    names: dict[str, str] = {}
    for name in _code_names(code):
        names.setdefault(name, f"v{len(names)}")

    def rename(text: str) -> str:
        return " ".join(names.get(lexeme, lexeme) for lexeme in _LEXEME.findall(text))

    return rename(template.doc), rename(code)


_HAND_WRITTEN_NAMES = {n for t in TEMPLATES for n in _code_names(_correct_code(t))}
"""Every name the hand-written templates' code uses."""


def doc_key(template: Template) -> str:
    """The docstring with every word that could be a variable name (of this template's code,
    of any template's code, or of the composed pools) replaced by ``V`` and with commas and
    full stops left out: ``"Return the items of items that are at least limit."`` and
    ``"Return the items of xs that are at least limit."`` both read ``Return the V of V that
    are at least V``. Coarser than ``shape_key``'s docstring on purpose: a word that is also
    a list's name (``items``) must not make a held-out docstring look new."""
    names = set(VARIABLE_NAMES) | set(_code_names(_correct_code(template))) | _HAND_WRITTEN_NAMES
    return " ".join("V" if lexeme in names else lexeme
                    for lexeme in _LEXEME.findall(template.doc) if lexeme not in ",.")


def heldout_like(template: Template) -> bool:
    """Whether ``template`` is a held-out template in other names: its correct code equals a
    held-out template's up to variable names (whatever its docstring and bug), or its
    docstring does (``doc_key``, whatever its code)."""
    codes, docs = _heldout_keys()
    return shape_key(template)[1] in codes or doc_key(template) in docs


@functools.cache
def _heldout_keys() -> tuple[frozenset[str], frozenset[str]]:
    heldout = [t for t in TEMPLATES if t.split == "heldout"]
    return (frozenset(shape_key(t)[1] for t in heldout), frozenset(doc_key(t) for t in heldout))


def _precedence_ok(first: str, second: str) -> bool:
    """Whether ``a first b second c`` evaluates left to right in Python (as the docstrings
    read: "a plus b, times c" means (a + b) * c)."""
    return first == "*" or second in "+-"


Shape = tuple[str, str, str, str, str, str, ArgKind]
"""(family, params, doc, body, good, bad, args) of one composed template."""


def _shapes(rng: random.Random) -> Iterator[Shape]:
    """(family, params, doc, body, good, bad, args) of every composed template, names drawn
    from ``rng``."""

    def pair() -> tuple[str, str]:
        return rng.choice(PAIRS)

    def local(*taken: str) -> str:
        return rng.choice([n for n in LOCALS if n not in taken])

    def tally(what: str, word: str, right: str, wrong: str, pool: tuple[str, ...],
              add_item: bool) -> Shape:
        """A loop that counts (or sums) the items of a list that pass a comparison."""
        xs, lim, x, v = rng.choice(LISTS), rng.choice(LIMITS), rng.choice(ITEMS), rng.choice(pool)
        return ("wrong_comparison", f"{xs}, {lim}", f"{what} {xs} that are {word} {lim}.",
                f"    {v} = 0\n    for {x} in {xs}:\n        if {x} {{B}} {lim}:\n"
                f"            {v} = {v} + {x if add_item else 1}\n    return {v}\n",
                right, wrong, "xs_limit")

    # -- wrong_operator ------------------------------------------------------------------------
    for o1, w1 in OPS.items():
        for bad in (o for o in OPS if o != o1):
            p = rng.choice(SINGLES)
            yield ("wrong_operator", p, f"Return {p} {w1} {{k}}.",
                   f"    return {p} {{B}} {{k}}\n", o1, bad, "n")
            a, b = pair()
            yield ("wrong_operator", f"{a}, {b}", f"Return {a} {w1} {b}.",
                   f"    return {a} {{B}} {b}\n", o1, bad, "ab")
            for o2, w2 in OPS.items():
                a, b = pair()
                r = local(a, b)
                doc = f"Return {a} {w1} {b}, {w2} {{k}}."
                yield ("wrong_operator", f"{a}, {b}", doc,
                       f"    {r} = {a} {{B}} {b}\n    return {r} {o2} {{k}}\n", o1, bad, "ab")
                yield ("wrong_operator", f"{a}, {b}", f"Return {a} {w2} {b}, {w1} {{k}}.",
                       f"    {r} = {a} {o2} {b}\n    return {r} {{B}} {{k}}\n", o1, bad, "ab")
                a, b = pair()
                r = local(a, b)
                yield ("wrong_operator", f"{a}, {b}", f"Return {a} {w1} {{k}}, {w2} {b}.",
                       f"    {r} = {a} {{B}} {{k}}\n    return {r} {o2} {b}\n", o1, bad, "ab")
                if _precedence_ok(o1, o2):
                    p = rng.choice(SINGLES)
                    yield ("wrong_operator", p, f"Return {p} {w1} {p}, {w2} {{k}}.",
                           f"    return {p} {{B}} {p} {o2} {{k}}\n", o1, bad, "n")
    for op, word, start in (("+", "sum", "0"), ("*", "product", "1")):
        for bad in (o for o in OPS if o != op):
            xs, acc, x = rng.choice(LISTS), rng.choice(ACCS), rng.choice(ITEMS)
            loop = f"    {acc} = {start}\n    for {x} in {xs}:\n"
            yield ("wrong_operator", xs, f"Return the {word} of the items of {xs}.",
                   loop + f"        {acc} = {acc} {{B}} {x}\n    return {acc}\n", op, bad, "xs")
            for o2, w2 in OPS.items():
                xs, acc, x = rng.choice(LISTS), rng.choice(ACCS), rng.choice(ITEMS)
                loop = f"    {acc} = {start}\n    for {x} in {xs}:\n"
                yield ("wrong_operator", xs, f"Return the {word} of the items of {xs}, {w2} {{k}}.",
                       loop + f"        {acc} = {acc} {{B}} {x}\n    return {acc} {o2} {{k}}\n",
                       op, bad, "xs")
                yield ("wrong_operator", xs, f"Return the {word} of the items of {xs}, {w2} {{k}}.",
                       loop + f"        {acc} = {acc} {op} {x}\n    return {acc} {{B}} {{k}}\n",
                       o2, rng.choice([o for o in OPS if o != o2]), "xs")
    # -- wrong_comparison ----------------------------------------------------------------------
    for c, word in CMPS.items():
        bad = STRICT_SWAP[c]
        n = rng.choice(SINGLES)
        yield ("wrong_comparison", n, f"Return True when {n} is {word} {{k}}.",
               f"    return {n} {{B}} {{k}}\n", c, bad, "n")
        n = rng.choice(SINGLES)
        yield ("wrong_comparison", n, f"Return {n} when {n} is {word} {{k}}, else 0.",
               f"    if {n} {{B}} {{k}}:\n        return {n}\n    return 0\n", c, bad, "n")
        for yes, no in rng.sample(WORD_PAIRS, 2):
            n = rng.choice(SINGLES)
            yield ("wrong_comparison", n, f"Return '{yes}' when {n} is {word} {{k}}, else '{no}'.",
                   f"    if {n} {{B}} {{k}}:\n        return '{yes}'\n    return '{no}'\n",
                   c, bad, "n")
        for _ in range(2):
            yield tally("Count the items of", word, c, bad, COUNTERS, False)
            xs, lim, x = rng.choice(LISTS), rng.choice(LIMITS), rng.choice(ITEMS)
            yield ("wrong_comparison", f"{xs}, {lim}",
                   f"Return the items of {xs} that are {word} {lim}.",
                   f"    return [{x} for {x} in {xs} if {x} {{B}} {lim}]\n", c, bad, "xs_limit")
            yield tally("Return the sum of the items of", word, c, bad, ACCS, True)
            xs, lim, x = rng.choice(LISTS), rng.choice(LIMITS), rng.choice(ITEMS)
            inverse = NEGATE[c]
            yield ("wrong_comparison", f"{xs}, {lim}",
                   f"Return True when every item of {xs} is {word} {lim}.",
                   f"    for {x} in {xs}:\n        if {x} {{B}} {lim}:\n            return False\n"
                   "    return True\n", inverse, STRICT_SWAP[inverse], "xs_limit")
    # -- off_by_one ----------------------------------------------------------------------------
    terms = (("{i}", "the sum of the numbers from <lo> to <n>"),
             ("{i} * {i}", "the sum of the squares of the numbers from <lo> to <n>"),
             ("{i} * {{k}}", "the sum of the numbers from <lo> to <n>, each times {{k}}"))
    for lo in ("0", "1"):
        for term, text in terms:
            for _ in range(2):
                n, acc, i = rng.choice(SINGLES), rng.choice(ACCS), rng.choice(("i", "j"))
                head = "range({B})" if lo == "0" else f"range({lo}, {{B}})"
                doc = "Return " + text.replace("<lo>", lo).replace("<n>", n).replace(
                    "{{k}}", "{k}") + "."
                step = term.format(i=i).replace("{{k}}", "{k}")
                yield ("off_by_one", n, doc,
                       f"    {acc} = 0\n    for {i} in {head}:\n        {acc} = {acc} + {step}\n"
                       f"    return {acc}\n", f"{n} + 1", n, "n")
        for op, word in OPS.items():
            n, out, i = rng.choice(SINGLES), rng.choice(("out", "res", "items", "vals")), "i"
            head = "range({B})" if lo == "0" else f"range({lo}, {{B}})"
            yield ("off_by_one", n, f"Return the list of {i} {word} {{k}} for {i} from {lo} to {n}.",
                   f"    {out} = []\n    for {i} in {head}:\n        {out}.append({i} {op} {{k}})\n"
                   f"    return {out}\n", f"{n} + 1", n, "n")
        n, out = rng.choice(SINGLES), rng.choice(("out", "res", "vals"))
        head = "range({B})" if lo == "0" else f"range({lo}, {{B}})"
        yield ("off_by_one", n, f"Return the list of the numbers from {lo} to {n}.",
               f"    {out} = []\n    for i in {head}:\n        {out}.append(i)\n    return {out}\n",
               f"{n} + 1", n, "n")
        n, acc = rng.choice(SINGLES), rng.choice(ACCS)
        yield ("off_by_one", n, f"Return the product of the numbers from 1 to {n}, times {{k}}.",
               f"    {acc} = {{k}}\n    for i in range(1, {{B}}):\n        {acc} = {acc} * i\n"
               f"    return {acc}\n", f"{n} + 1", n, "n")
    for bad_shift in (" - 1", " + 1"):
        for _ in range(3):
            xs, n, acc = rng.choice(LISTS), rng.choice(("n", "m", "size", "cut")), rng.choice(ACCS)
            yield ("off_by_one", f"{xs}, {n}", f"Return the sum of the first {n} items of {xs}.",
                   f"    {acc} = 0\n    for i in range({{B}}):\n        {acc} = {acc} + {xs}[i]\n"
                   f"    return {acc}\n", n, n + bad_shift, "xs_n")
            xs, n, out = rng.choice(LISTS), rng.choice(("n", "m", "size", "cut")), "out"
            yield ("off_by_one", f"{xs}, {n}",
                   f"Return the list of the first {n} items of {xs}.",
                   f"    {out} = []\n    for i in range({{B}}):\n        {out}.append({xs}[i])\n"
                   f"    return {out}\n", n, n + bad_shift, "xs_n")
            xs, n, acc = rng.choice(LISTS), rng.choice(("n", "m", "start", "cut")), rng.choice(ACCS)
            yield ("off_by_one", f"{xs}, {n}",
                   f"Return the sum of the items of {xs} from index {n} to the end.",
                   f"    {acc} = 0\n    for i in range({{B}}, len({xs})):\n"
                   f"        {acc} = {acc} + {xs}[i]\n    return {acc}\n", n, n + bad_shift, "xs_n")
    # -- wrong_constant ------------------------------------------------------------------------
    for o1, w1 in OPS.items():
        n = rng.choice(SINGLES)
        yield ("wrong_constant", n, f"Return {n} {w1} {{k}}.",
               f"    return {n} {o1} {{B}}\n", "{k}", "{k2}", "n")
        n, r = rng.choice(SINGLES), rng.choice(LOCALS)
        yield ("wrong_constant", n, f"Return {n} {w1} {{k}}.",
               f"    {r} = {n} {o1} {{B}}\n    return {r}\n", "{k}", "{k2}", "n")
        for o2, w2 in OPS.items():
            c = str(rng.randint(2, 9))
            n = rng.choice(SINGLES)
            if _precedence_ok(o1, o2):
                yield ("wrong_constant", n, f"Return {n} {w1} {c}, {w2} {{k}}.",
                       f"    return {n} {o1} {c} {o2} {{B}}\n", "{k}", "{k2}", "n")
                yield ("wrong_constant", n, f"Return {n} {w1} {{k}}, {w2} {c}.",
                       f"    return {n} {o1} {{B}} {o2} {c}\n", "{k}", "{k2}", "n")
            else:
                yield ("wrong_constant", n, f"Return {n} {w1} {c}, {w2} {{k}}.",
                       f"    return ({n} {o1} {c}) {o2} {{B}}\n", "{k}", "{k2}", "n")
            a, b = pair()
            r = local(a, b)
            yield ("wrong_constant", f"{a}, {b}", f"Return {a} {w1} {{k}}, {w2} {b}.",
                   f"    {r} = {a} {o1} {{B}}\n    return {r} {o2} {b}\n", "{k}", "{k2}", "ab")
    for _ in range(3):
        xs, acc, x = rng.choice(LISTS), rng.choice(ACCS), rng.choice(ITEMS)
        yield ("wrong_constant", xs, f"Return the sum of the items of {xs}, plus {{k}}.",
               f"    {acc} = {{B}}\n    for {x} in {xs}:\n        {acc} = {acc} + {x}\n"
               f"    return {acc}\n", "{k}", "{k2}", "xs")
        xs, acc, x = rng.choice(LISTS), rng.choice(ACCS), rng.choice(ITEMS)
        yield ("wrong_constant", xs, f"Return the sum of the items of {xs}, each times {{k}}.",
               f"    {acc} = 0\n    for {x} in {xs}:\n        {acc} = {acc} + {x} * {{B}}\n"
               f"    return {acc}\n", "{k}", "{k2}", "xs")
    # -- wrong_variable ------------------------------------------------------------------------
    for o1, w1 in OPS.items():
        for o2, w2 in OPS.items():
            a, b = pair()
            r = local(a, b)
            s = local(a, b, r)
            body = f"    {r} = {a} {o1} {b}\n    {s} = {r} {o2} {{k}}\n    return {{B}}\n"
            for bad in (r, a):
                yield ("wrong_variable", f"{a}, {b}", f"Return {a} {w1} {b}, {w2} {{k}}.",
                       body, s, bad, "ab")
            n = rng.choice(SINGLES)
            r = local(n)
            s = local(n, r)
            c = str(rng.randint(2, 9))
            yield ("wrong_variable", n, f"Return {n} {w1} {c}, {w2} {{k}}.",
                   f"    {r} = {n} {o1} {c}\n    {s} = {r} {o2} {{k}}\n    return {{B}}\n",
                   s, r, "n")
    for cmp, word in ((">", "largest"), ("<", "smallest")):
        for _ in range(3):
            xs, best, x = rng.choice(LISTS), rng.choice(("best", "top", "res", "keep")), \
                rng.choice(ITEMS)
            yield ("wrong_variable", xs, f"Return the {word} item of {xs}.",
                   f"    {best} = {xs}[0]\n    for {x} in {xs}:\n        if {x} {cmp} {best}:\n"
                   f"            {best} = {x}\n    return {{B}}\n", best, x, "xs")
    for cmp, word in ((">", "larger"), ("<", "smaller")):
        for _ in range(2):
            a, b = pair()
            best = local(a, b)
            yield ("wrong_variable", f"{a}, {b}", f"Return the {word} of {a} and {b}.",
                   f"    {best} = {a}\n    if {b} {cmp} {a}:\n        {best} = {b}\n"
                   f"    return {{B}}\n", best, a, "ab")
    for _ in range(3):
        xs, acc, x = rng.choice(LISTS), rng.choice(ACCS), rng.choice(ITEMS)
        yield ("wrong_variable", xs, f"Return the sum of the items of {xs}.",
               f"    {acc} = 0\n    for {x} in {xs}:\n        {acc} = {acc} + {x}\n"
               "    return {B}\n", acc, x, "xs")
        xs, cnt, x = rng.choice(LISTS), rng.choice(COUNTERS), rng.choice(ITEMS)
        yield ("wrong_variable", xs, f"Count the even items of {xs}.",
               f"    {cnt} = 0\n    for {x} in {xs}:\n        if {x} % 2 == 0:\n"
               f"            {cnt} = {cnt} + 1\n    return {{B}}\n", cnt, x, "xs")
    # -- inverted_condition --------------------------------------------------------------------
    for c, word in CMPS.items():
        for bad_style in ("not", "negate"):
            n = rng.choice(SINGLES)
            good = f"{n} {c} {{k}}"
            bad = f"not {good}" if bad_style == "not" else f"{n} {NEGATE[c]} {{k}}"
            for yes, no in rng.sample(WORD_PAIRS, 2):
                yield ("inverted_condition", n,
                       f"Return '{yes}' when {n} is {word} {{k}}, else '{no}'.",
                       f"    if {{B}}:\n        return '{yes}'\n    return '{no}'\n", good, bad, "n")
            op, w = rng.choice(list(OPS.items()))
            yield ("inverted_condition", n, f"Return {n} {w} {{k}} when {n} is {word} {{k}}, else 0.",
                   f"    if {{B}}:\n        return {n} {op} {{k}}\n    return 0\n", good, bad, "n")
            xs, lim, x, cnt = (rng.choice(LISTS), rng.choice(LIMITS), rng.choice(ITEMS),
                               rng.choice(COUNTERS))
            good = f"{x} {c} {lim}"
            bad = f"not {good}" if bad_style == "not" else f"{x} {NEGATE[c]} {lim}"
            yield ("inverted_condition", f"{xs}, {lim}",
                   f"Count the items of {xs} that are {word} {lim}.",
                   f"    {cnt} = 0\n    for {x} in {xs}:\n        if {{B}}:\n"
                   f"            {cnt} = {cnt} + 1\n    return {cnt}\n", good, bad, "xs_limit")
            yield ("inverted_condition", f"{xs}, {lim}",
                   f"Return the items of {xs} that are {word} {lim}.",
                   f"    return [{x} for {x} in {xs} if {{B}}]\n", good, bad, "xs_limit")
    for parity, good_test, bads in (("even", "== 0", ("!= 0", "== 1")),
                                    ("odd", "== 1", ("== 0", "!= 1"))):
        for bad_test in bads:
            for _ in range(2):
                xs, x, cnt, acc = (rng.choice(LISTS), rng.choice(ITEMS), rng.choice(COUNTERS),
                                   rng.choice(ACCS))
                good, bad = f"{x} % 2 {good_test}", f"{x} % 2 {bad_test}"
                yield ("inverted_condition", xs, f"Return the {parity} items of {xs}.",
                       f"    return [{x} for {x} in {xs} if {{B}}]\n", good, bad, "xs")
                yield ("inverted_condition", xs, f"Count the {parity} items of {xs}.",
                       f"    {cnt} = 0\n    for {x} in {xs}:\n        if {{B}}:\n"
                       f"            {cnt} = {cnt} + 1\n    return {cnt}\n", good, bad, "xs")
                yield ("inverted_condition", xs, f"Return the sum of the {parity} items of {xs}.",
                       f"    {acc} = 0\n    for {x} in {xs}:\n        if {{B}}:\n"
                       f"            {acc} = {acc} + {x}\n    return {acc}\n", good, bad, "xs")
    # -- wrong_index ---------------------------------------------------------------------------
    for index, word in INDEX_WORDS.items():
        for bad in INDEX_BUGS[index]:
            xs = rng.choice(LISTS)
            yield ("wrong_index", xs, f"Return the {word} item of {xs}.",
                   f"    return {xs}[{{B}}]\n", index, bad, "xs")
            for op, w in OPS.items():
                xs = rng.choice(LISTS)
                yield ("wrong_index", xs, f"Return the {word} item of {xs}, {w} {{k}}.",
                       f"    return {xs}[{{B}}] {op} {{k}}\n", index, bad, "xs")
                xs, r = rng.choice(LISTS), rng.choice(LOCALS)
                yield ("wrong_index", xs, f"Return the {word} item of {xs}, {w} {{k}}.",
                       f"    {r} = {xs}[{{B}}]\n    return {r} {op} {{k}}\n", index, bad, "xs")
            other = rng.choice([i for i in INDEX_WORDS if i != index])
            op, w = rng.choice(list(OPS.items()))
            xs = rng.choice(LISTS)
            yield ("wrong_index", xs,
                   f"Return the {INDEX_WORDS[other]} item of {xs} {w} the {word} item.",
                   f"    return {xs}[{other}] {op} {xs}[{{B}}]\n", index, bad, "xs")
    for op, w in OPS.items():
        for bad in ("len(<xs>) // 2 - 1", "len(<xs>) // 2 + 1"):
            xs = rng.choice(LISTS)
            yield ("wrong_index", xs, f"Return the middle item of {xs}, {w} {{k}}.",
                   f"    return {xs}[{{B}}] {op} {{k}}\n", f"len({xs}) // 2",
                   bad.replace("<xs>", xs), "xs_odd")


@functools.cache
def composed_templates() -> tuple[Template, ...]:
    """Every composed train template, in a fixed order; none is ``heldout_like``, and none
    repeats another's ``shape_key`` and bug."""
    taken_names = {n for t in TEMPLATES for n in t.names}
    rng = random.Random("tracerl-composed-templates")
    from tracerl.models.words import WORDS

    names = [w for w in WORDS if usable_name(w) and w not in taken_names]
    seen: set[tuple[str, str, str]] = set()
    out: list[Template] = []
    for family, params, doc, body, good, bad, args in _shapes(rng):
        template = Template(family, "train", tuple(rng.sample(names, 2)), params, doc, body,
                            good, bad, args)
        shape = shape_key(template)
        key = (*shape, bad)
        if heldout_like(template) or key in seen:
            continue
        seen.add(key)
        out.append(template)
    return tuple(out)
