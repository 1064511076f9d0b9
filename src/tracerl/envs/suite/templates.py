"""Templates of the built-in suite: one small function, one bug slot, per template.

Each template is a function body with a slot ``{B}`` that holds either the correct code or
the bug, a docstring saying what the function should do (so the fix is decidable from the
task alone), a pool of function names, and the kind of arguments it takes. Train and held-out
templates are disjoint: different names, different bodies, different argument ranges.

The code vocabulary is deliberately small and regular (a, b, n, xs, x, i, total, count, ...)
because the demo's policy is a tiny model with a word-level tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "heldout"]
"""Which split a template belongs to: ``train`` for training, ``heldout`` for evaluation."""

ArgKind = Literal["ab", "n", "xs", "xs_limit", "xs_n", "n_low_high", "xs_odd"]
"""How test arguments are drawn (see ``suite.generate.draw_args``)."""


@dataclass(frozen=True)
class Template:
    """One buggy-function template."""

    family: str
    """The bug family (a key of ``FAMILIES``)."""
    split: Split
    """The split this template is used in."""
    names: tuple[str, ...]
    """Function (and module) names to choose from."""
    params: str
    """The parameter list, e.g. ``"a, b"``."""
    doc: str
    """One-line docstring; ``{k}`` and ``{k2}`` are replaced by the task's constants."""
    body: str
    """Function body (indented 4 spaces) with the slot ``{B}``."""
    good: str
    """Correct code for the slot."""
    bad: str
    """Buggy code for the slot."""
    args: ArgKind
    """Kind of test arguments."""


FAMILIES: dict[str, str] = {
    "wrong_operator": "an arithmetic operator is wrong (+ for -, * for +, ...)",
    "wrong_comparison": "a comparison is strict where it should not be (< for <=)",
    "off_by_one": "a range bound is one too small",
    "wrong_constant": "a constant has the wrong value",
    "wrong_variable": "the wrong variable is returned",
    "inverted_condition": "a condition is negated",
    "wrong_index": "a list is indexed at the wrong position",
}
"""The bug families of the built-in suite, with what each bug is."""


def _t(family: str, split: Split, names: str, params: str, doc: str, body: str,
       good: str, bad: str, args: ArgKind) -> Template:
    return Template(family, split, tuple(names.split()), params, doc, body, good, bad, args)


TEMPLATES: tuple[Template, ...] = (
    # -- wrong_operator ----------------------------------------------------------------------
    _t("wrong_operator", "train", "total mix join", "a, b",
       "Return a plus b times {k}.",
       "    return a {B} b * {k}\n", "+", "-", "ab"),
    _t("wrong_operator", "train", "weigh sum_all add_up", "xs",
       "Return the sum of the items of xs, each times {k}.",
       "    total = 0\n    for x in xs:\n        total = total {B} x * {k}\n    return total\n",
       "+", "-", "xs"),
    _t("wrong_operator", "train", "area grow", "a, b",
       "Return a times b, minus {k}.",
       "    c = a {B} b\n    return c - {k}\n", "*", "+", "ab"),
    _t("wrong_operator", "heldout", "spread gap", "a, b",
       "Return a minus b, times {k}.",
       "    d = a {B} b\n    return d * {k}\n", "-", "+", "ab"),
    _t("wrong_operator", "heldout", "product prod_all", "xs",
       "Return the product of the items of xs.",
       "    out = 1\n    for x in xs:\n        out = out {B} x\n    return out\n",
       "*", "+", "xs"),
    # -- wrong_comparison --------------------------------------------------------------------
    _t("wrong_comparison", "train", "count_small at_most", "xs, limit",
       "Count the items of xs that are at most limit.",
       "    count = 0\n    for x in xs:\n        if x {B} limit:\n            count = count + 1\n"
       "    return count\n", "<=", "<", "xs_limit"),
    _t("wrong_comparison", "train", "is_big at_least", "n",
       "Return True when n is at least {k}.",
       "    return n {B} {k}\n", ">=", ">", "n"),
    _t("wrong_comparison", "heldout", "in_range between", "n, low, high",
       "Return True when n is between low and high, both included.",
       "    return low {B} n and n <= high\n", "<=", "<", "n_low_high"),
    _t("wrong_comparison", "heldout", "keep_big above_min", "xs, limit",
       "Return the items of xs that are at least limit.",
       "    return [x for x in xs if x {B} limit]\n", ">=", ">", "xs_limit"),
    # -- off_by_one --------------------------------------------------------------------------
    _t("off_by_one", "train", "sum_to tri", "n",
       "Return the sum of the numbers from 1 to n.",
       "    total = 0\n    for i in range(1, {B}):\n        total = total + i\n    return total\n",
       "n + 1", "n", "n"),
    _t("off_by_one", "train", "head_sum first_sum", "xs, n",
       "Return the sum of the first n items of xs.",
       "    total = 0\n    for i in range({B}):\n        total = total + xs[i]\n    return total\n",
       "n", "n - 1", "xs_n"),
    _t("off_by_one", "heldout", "steps ladder", "n",
       "Return the list of i times {k} for i from 0 to n.",
       "    out = []\n    for i in range({B}):\n        out.append(i * {k})\n    return out\n",
       "n + 1", "n", "n"),
    _t("off_by_one", "heldout", "fact factorial", "n",
       "Return the product of the numbers from 1 to n.",
       "    out = 1\n    for i in range(1, {B}):\n        out = out * i\n    return out\n",
       "n + 1", "n", "n"),
    # -- wrong_constant ----------------------------------------------------------------------
    _t("wrong_constant", "train", "scale times", "a",
       "Return a times {k}.",
       "    return a * {B}\n", "{k}", "{k2}", "n"),
    _t("wrong_constant", "train", "shift bump", "n",
       "Return n plus {k}.",
       "    return n + {B}\n", "{k}", "{k2}", "n"),
    _t("wrong_constant", "heldout", "cost price", "n",
       "Return n times 3, plus {k}.",
       "    return n * 3 + {B}\n", "{k}", "{k2}", "n"),
    _t("wrong_constant", "heldout", "lower drop", "a",
       "Return a minus {k}.",
       "    return a - {B}\n", "{k}", "{k2}", "n"),
    # -- wrong_variable ----------------------------------------------------------------------
    _t("wrong_variable", "train", "both mix_up", "a, b",
       "Return a plus b, times {k}.",
       "    c = a + b\n    d = c * {k}\n    return {B}\n", "d", "c", "ab"),
    _t("wrong_variable", "train", "largest top", "xs",
       "Return the largest item of xs.",
       "    best = xs[0]\n    for x in xs:\n        if x > best:\n            best = x\n"
       "    return {B}\n", "best", "x", "xs"),
    _t("wrong_variable", "heldout", "offset move", "a, b",
       "Return a minus b, plus {k}.",
       "    d = a - b\n    e = d + {k}\n    return {B}\n", "e", "d", "ab"),
    _t("wrong_variable", "heldout", "smallest low", "xs",
       "Return the smallest item of xs.",
       "    low = xs[0]\n    for x in xs:\n        if x < low:\n            low = x\n"
       "    return {B}\n", "low", "x", "xs"),
    # -- inverted_condition ------------------------------------------------------------------
    _t("inverted_condition", "train", "excess over", "a",
       "Return a minus {k} when a is above {k}, else 0.",
       "    if {B}:\n        return a - {k}\n    return 0\n", "a > {k}", "not a > {k}", "n"),
    _t("inverted_condition", "train", "evens keep_even", "xs",
       "Return the even items of xs.",
       "    return [x for x in xs if {B}]\n", "x % 2 == 0", "x % 2 != 0", "xs"),
    _t("inverted_condition", "heldout", "size label", "n",
       "Return 'big' when n is above {k}, else 'small'.",
       "    if {B}:\n        return 'big'\n    return 'small'\n", "n > {k}", "not n > {k}", "n"),
    _t("inverted_condition", "heldout", "count_odd odds", "xs",
       "Count the odd items of xs.",
       "    count = 0\n    for x in xs:\n        if {B}:\n            count = count + 1\n"
       "    return count\n", "x % 2 == 1", "x % 2 == 0", "xs"),
    # -- wrong_index -------------------------------------------------------------------------
    _t("wrong_index", "train", "ends first_last", "xs",
       "Return the first item of xs plus the last item.",
       "    return xs[0] + xs[{B}]\n", "-1", "-2", "xs"),
    _t("wrong_index", "train", "second next", "xs",
       "Return the second item of xs.",
       "    return xs[{B}]\n", "1", "0", "xs"),
    _t("wrong_index", "heldout", "last_times tail", "xs",
       "Return the last item of xs times {k}.",
       "    return xs[{B}] * {k}\n", "-1", "0", "xs"),
    _t("wrong_index", "heldout", "middle mid", "xs",
       "Return the middle item of xs.",
       "    return xs[{B}]\n", "len(xs) // 2", "len(xs) // 2 - 1", "xs_odd"),
    # -- more train templates: a wider train split, so what is learnt is less tied to a few
    #    bodies (the held-out templates above are unchanged) --------------------------------
    _t("wrong_operator", "train", "diff minus_plus", "a, b",
       "Return a plus b, minus {k}.",
       "    c = a {B} b\n    return c - {k}\n", "+", "-", "ab"),
    _t("wrong_operator", "train", "double_sum twice", "xs",
       "Return twice the sum of xs.",
       "    total = 0\n    for x in xs:\n        total = total + x\n    return total {B} 2\n",
       "*", "+", "xs"),
    _t("wrong_operator", "train", "square sq_plus", "n",
       "Return n times n, plus {k}.",
       "    return n {B} n + {k}\n", "*", "+", "n"),
    _t("wrong_comparison", "train", "all_small none_over", "xs, limit",
       "Return True when every item of xs is at most limit.",
       "    for x in xs:\n        if x {B} limit:\n            return False\n    return True\n",
       ">", ">=", "xs_limit"),
    _t("wrong_comparison", "train", "keep_low small_or_zero", "n",
       "Return n when n is at most {k}, else 0.",
       "    if n {B} {k}:\n        return n\n    return 0\n", "<=", "<", "n"),
    _t("off_by_one", "train", "count_up upto", "n",
       "Return the list of the numbers from 1 to n.",
       "    out = []\n    for i in range(1, {B}):\n        out.append(i)\n    return out\n",
       "n + 1", "n", "n"),
    _t("off_by_one", "train", "tail_sum rest_sum", "xs, n",
       "Return the sum of the items of xs from index n to the end.",
       "    total = 0\n    for i in range({B}, len(xs)):\n        total = total + xs[i]\n"
       "    return total\n", "n", "n + 1", "xs_n"),
    _t("wrong_constant", "train", "add_twice plus_double", "a",
       "Return a plus {k}, times 2.",
       "    return (a + {B}) * 2\n", "{k}", "{k2}", "n"),
    _t("wrong_constant", "train", "start_at sum_from", "xs",
       "Return the sum of xs plus {k}.",
       "    total = {B}\n    for x in xs:\n        total = total + x\n    return total\n",
       "{k}", "{k2}", "xs"),
    _t("wrong_variable", "train", "bigger max_of", "a, b",
       "Return the larger of a and b.",
       "    best = a\n    if b > a:\n        best = b\n    return {B}\n", "best", "a", "ab"),
    _t("wrong_variable", "train", "running sum_up", "xs",
       "Return the sum of xs.",
       "    total = 0\n    for x in xs:\n        total = total + x\n    return {B}\n",
       "total", "x", "xs"),
    _t("inverted_condition", "train", "sign_word pos_neg", "n",
       "Return 'pos' when n is at least {k}, else 'neg'.",
       "    if {B}:\n        return 'pos'\n    return 'neg'\n", "n >= {k}", "n < {k}", "n"),
    _t("inverted_condition", "train", "count_big above", "xs, limit",
       "Count the items of xs that are above limit.",
       "    count = 0\n    for x in xs:\n        if {B}:\n            count = count + 1\n"
       "    return count\n", "x > limit", "not x > limit", "xs_limit"),
    _t("wrong_index", "train", "second_last before_last", "xs",
       "Return the second to last item of xs.",
       "    return xs[{B}]\n", "-2", "-1", "xs"),
    _t("wrong_index", "train", "first_plus head_plus", "xs",
       "Return the first item of xs plus {k}.",
       "    return xs[{B}] + {k}\n", "0", "1", "xs"),
)
"""Every template; ``suite.generate`` picks from those of the requested split."""
