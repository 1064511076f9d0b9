"""The built-in suite: deterministic, every family present, splits disjoint, tasks valid."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import random
import sys
import types

import pytest

from tracerl.envs.sandbox import Sandbox
from tracerl.envs.suite import FAMILIES, TEMPLATES, Template, generate_split, make_task
from tracerl.envs.suite.compose import (
    VARIABLE_NAMES,
    composed_templates,
    doc_key,
    heldout_like,
    shape_key,
)
from tracerl.envs.tasks import Task, validate_tasks

REQUIRED_FAMILIES = {"wrong_operator", "wrong_comparison", "off_by_one", "wrong_constant",
                     "wrong_variable", "inverted_condition", "wrong_index"}


def _passes(files: dict[str, str], test_path: str) -> bool:
    """Run one generated test file in-process against ``files`` (fast, trusted code only)."""
    module_path = next(p for p in files if not p.startswith("test_"))
    name = module_path[:-3]
    module = types.ModuleType(name)
    exec(compile(files[module_path], module_path, "exec"), module.__dict__)
    sys.modules[name] = module
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(files[test_path], test_path, "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        return stop.code in (0, None)
    finally:
        del sys.modules[name]
    return True


def _hidden_passes(files: dict[str, str], hidden_path: str, values: dict[str, str]) -> bool:
    """Run a generated hidden test in-process, with a stand-in for the verifier's report
    module, and judge its value checks as the verifier does (every one reported, all equal)."""
    reported: dict[str, str] = {}
    ended: list[bool] = []
    report = types.ModuleType("tracerl_report")

    def value(name: str, fn: object) -> None:
        try:
            reported[name] = repr(fn())  # type: ignore[operator]
        except Exception as error:
            reported[name] = "raised " + type(error).__name__

    report.value = value  # type: ignore[attr-defined]
    report.end = lambda: ended.append(True)  # type: ignore[attr-defined]
    sys.modules["tracerl_report"] = report
    try:
        _passes(files, hidden_path)
    finally:
        del sys.modules["tracerl_report"]
    return ended == [True] and reported == values


def test_deterministic_and_extends() -> None:
    first = generate_split("train", seed=3, count=20)
    assert first == generate_split("train", seed=3, count=20)
    assert generate_split("train", seed=3, count=30)[:20] == first
    assert generate_split("train", seed=4, count=20) != first


def test_budget_is_the_only_thing_max_turns_changes() -> None:
    eight, twelve = generate_split("heldout", count=14), generate_split("heldout", count=14,
                                                                        max_turns=12)
    assert {t.budget.max_turns for t in eight} == {8} and {t.budget.max_turns for t in twelve} == {12}
    assert [dataclasses.replace(t, budget=None) for t in eight] == [
        dataclasses.replace(t, budget=None) for t in twelve]
    with pytest.raises(ValueError, match="max_turns"):
        generate_split("train", count=1, max_turns=0)


def test_sizes_and_families() -> None:
    train, heldout = generate_split("train"), generate_split("heldout")
    assert len(train) >= 300 and len(heldout) >= 100
    assert set(FAMILIES) >= REQUIRED_FAMILIES
    for split in (train, heldout):
        assert {task.family for task in split} == set(FAMILIES)
        assert len({task.id for task in split}) == len(split)
        assert len({tuple(sorted(task.files.items())) for task in split}) > 0.9 * len(split)


def test_splits_share_no_templates_names_or_bodies() -> None:
    train = [t for t in TEMPLATES if t.split == "train"]
    heldout = [t for t in TEMPLATES if t.split == "heldout"]
    assert not {n for t in train for n in t.names} & {n for t in heldout for n in t.names}
    def bodies(templates: list[Template]) -> set[str]:
        return {t.body.replace("{B}", t.good) for t in templates}

    assert not bodies(train) & bodies(heldout)
    train_modules = {p for task in generate_split("train") for p in task.files}
    heldout_modules = {p for task in generate_split("heldout") for p in task.files}
    assert not train_modules & heldout_modules


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_every_task_fails_at_start_and_passes_with_its_solution(split: str) -> None:
    for task in generate_split(split):  # type: ignore[arg-type]
        assert task.solution is not None
        (test_path,) = task.protected
        (hidden_path,) = task.hidden_files
        start = {**task.files, **task.hidden_files}
        fixed = {**start, **task.solution}
        assert not _passes(start, test_path), task.id
        assert not _hidden_passes(start, hidden_path, dict(task.hidden_values)), task.id
        assert _passes(fixed, test_path), task.id
        assert _hidden_passes(fixed, hidden_path, dict(task.hidden_values)), task.id
        assert "want" not in task.hidden_files[hidden_path]  # expected values stay outside
        module = next(iter(task.solution))
        assert 5 <= len(task.files[module].splitlines()) <= 15


def test_hidden_values_differ_from_visible() -> None:
    for task in generate_split("heldout", count=30):
        (test_path,) = task.protected
        (hidden_path,) = task.hidden_files
        visible = {ln.split("lambda: ")[1].rsplit(", ", 1)[0]
                   for ln in task.files[test_path].splitlines() if ln.startswith("bad +=")}
        hidden = {ln.split("lambda: ")[1][:-1]
                  for ln in task.hidden_files[hidden_path].splitlines()
                  if ln.startswith("value(")}
        assert len(hidden) == 5 and len(hidden - visible) >= 3


def test_sample_validates_in_the_sandbox(sandbox: Sandbox) -> None:
    sample: list[Task] = []
    for split in ("train", "heldout"):
        sample += generate_split(split, count=len(FAMILIES))  # type: ignore[arg-type]
    checks = validate_tasks(sample, sandbox, workers=2)
    assert all(check.ok for check in checks), [c for c in checks if not c.ok]


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_whole_split_validates_in_the_sandbox(sandbox: Sandbox, split: str) -> None:
    checks = validate_tasks(generate_split(split), sandbox, workers=2)  # type: ignore[arg-type]
    assert all(check.ok for check in checks), [c for c in checks if not c.ok][:3]


def test_shape_key_ignores_variable_names_only() -> None:
    first = Template("wrong_operator", "train", ("f",), "a, b", "Return a minus b.",
                     "    c = a {B} b\n    return c\n", "-", "+", "ab")
    renamed = Template("wrong_operator", "train", ("g",), "p, q", "Return p minus q.",
                       "    r = p {B} q\n    return r\n", "-", "+", "ab")
    other = Template("wrong_operator", "train", ("f",), "a, b", "Return a plus b.",
                     "    c = a {B} b\n    return c\n", "+", "-", "ab")
    assert shape_key(first) == shape_key(renamed)
    assert shape_key(first) != shape_key(other)


def test_composed_templates_are_valid_varied_and_not_heldout() -> None:
    composed = composed_templates()
    heldout = {shape_key(t) for t in TEMPLATES if t.split == "heldout"}
    heldout_names = {n for t in TEMPLATES if t.split == "heldout" for n in t.names}
    for family in FAMILIES:
        assert sum(t.family == family for t in composed) >= 25, family
    for index, template in enumerate(composed):
        assert template.split == "train"
        assert shape_key(template) not in heldout, template
        assert not heldout_like(template), template
        assert not set(template.names) & (heldout_names | VARIABLE_NAMES), template.names
        assert all(name not in sys.stdlib_module_names for name in template.names)
        task = make_task(template, random.Random(index), f"composed-{index}")
        (test_path,) = task.protected
        (hidden_path,) = task.hidden_files
        start = {**task.files, **task.hidden_files}
        fixed = {**start, **(task.solution or {})}
        values = dict(task.hidden_values)
        assert not _passes(start, test_path), template
        assert not _hidden_passes(start, hidden_path, values), template
        assert _passes(fixed, test_path) and _hidden_passes(fixed, hidden_path, values), template


def test_no_train_template_is_a_heldout_one_in_other_names() -> None:
    # A list named ``items`` once hid "Return the items of items that are at least limit."
    # (a held-out body in other names) from a docstring compared name by name.
    heldout = [t for t in TEMPLATES if t.split == "heldout"]
    train = [t for t in TEMPLATES if t.split == "train"] + list(composed_templates())
    assert all(heldout_like(t) for t in heldout)
    assert not [t.doc for t in train if heldout_like(t)]
    keep_big = next(t for t in heldout if t.names[0] == "keep_big")
    renamed = dataclasses.replace(keep_big, split="train", params="items, cap",
                                  body=keep_big.body.replace("xs", "items").replace("limit", "cap"))
    assert heldout_like(renamed)  # the same code in other names, whatever its docstring
    leak = Template("wrong_comparison", "train", ("f",), "items, limit",
                    "Return the items of items that are at least limit.",
                    "    return [v for v in items if v {B} limit]\n", "<=", "<", "xs_limit")
    assert doc_key(leak) == doc_key(keep_big)
    assert heldout_like(leak)


def test_composed_train_split() -> None:
    first = generate_split("train", seed=1, count=40, composed=True)
    assert first == generate_split("train", seed=1, count=40, composed=True)
    assert generate_split("train", seed=1, count=50, composed=True)[:40] == first
    assert first != generate_split("train", seed=1, count=40)
    assert {task.family for task in first} == set(FAMILIES)
    with pytest.raises(ValueError, match="composed: only the train split"):
        generate_split("heldout", count=4, composed=True)
