"""Mining bug-fix tasks from a Python repository and its own tests.

For each function of the repository's source files, mutants (``envs.mutate``) are tried in
the seed's order; a mutant becomes a task only when the repository's tests catch it:

1. The unmutated code is run twice with per-test reporting (the verifier's harness and its
   pytest plugin, ``-p tracerl_report``). Tests that did not pass both times are flaky (or
   failing) and are left out of every later run and of the tasks (``-k 'not (...)'``); with
   no stable test left, nothing is mined.
2. Each mutant is run the same way. A run that did not report every stable test (a mutant
   that breaks collection or import: pytest reports no outcome for the tests it could not
   collect) is refused, whatever its exit status; so is a mutant none of whose stable tests
   fail (not caught). A caught mutant is run a second time, and only tests that failed both
   times count as failing; tests that passed once and failed once are flaky and left out.
3. The task: the mutated file, the repository's other files, and the test files with some of
   the failing tests removed (a ``visible_fraction`` of them, at least one, stay visible);
   the hidden tests are the full test files that hold failing tests, run with pytest. The
   unmutated file is the ``solution``. Source files are split by module into train and
   held-out sets, so the same function is never on both sides.

The test command must run pytest (``python -m pytest ...``): the miner adds
``-p tracerl_report`` to it to read each test's outcome.
"""

from __future__ import annotations

import ast
import fnmatch
import math
import random
import re
import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from tracerl.envs.mutate import Mutant, functions, mutants
from tracerl.envs.sandbox import Sandbox
from tracerl.envs.tasks import Budget, Task
from tracerl.envs.verdict import Verdict, run_verdict

DEFAULT_TESTS = ("test_*.py", "*_test.py", "tests/*", "test/*", "*/tests/*", "conftest.py",
                 "*/conftest.py")
"""Glob patterns of test files: never mutated, protected in the tasks."""


@dataclass(frozen=True)
class MineSettings:
    """How to mine one repository."""

    test_command: str
    """The repository's test command, a pytest run (``python -m pytest -q tests``)."""
    sources: tuple[str, ...] = ("*.py",)
    """Glob patterns of the files whose functions are mutated (test files never are)."""
    tests: tuple[str, ...] = DEFAULT_TESTS
    """Glob patterns of test files."""
    seed: int = 0
    """Orders the mutants, draws the visible tests and the held-out modules."""
    tries_per_function: int = 4
    """Mutants tried per function."""
    tasks_per_function: int = 1
    """Tasks kept per function at most."""
    max_tasks: int | None = None
    """Most tasks in all (functions in the seed's order)."""
    visible_fraction: float = 0.5
    """Share of a task's failing tests left visible (at least one)."""
    heldout_fraction: float = 0.25
    """Share of the source modules whose tasks go to the held-out set (at least one when
    there are two modules or more)."""
    environment: str | None = None
    """Virtualenv or Python executable the tests run in (the tasks' ``environment``)."""
    name: str = "mined"
    """Prefix of the task ids and the tasks' family."""
    workers: int = 2
    """Sandboxes run at once."""
    test_seconds: float | None = None
    """The tasks' ``budget.test_seconds`` (their tests' time limit in the sandbox)."""

    def __post_init__(self) -> None:
        if "pytest" not in self.test_command.split() and "pytest" not in self.test_command:
            raise ValueError("test_command must run pytest (e.g. 'python -m pytest -q'), "
                             f"got {self.test_command!r}")
        for name in ("tries_per_function", "tasks_per_function", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tasks is not None and self.max_tasks < 1:
            raise ValueError(f"max_tasks must be >= 1, got {self.max_tasks}")
        if not 0.0 < self.visible_fraction <= 1.0:
            raise ValueError(f"visible_fraction must be in (0, 1], got {self.visible_fraction}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"name must be letters, digits, '_', '.', '-', got {self.name!r}")


@dataclass
class MineResult:
    """What mining produced and what it refused, with the reasons counted."""

    train: list[Task] = field(default_factory=list)
    heldout: list[Task] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    """Mutants refused, by reason (``not caught``, ``breaks collection``, ...)."""
    flaky: set[str] = field(default_factory=set)
    """Tests left out because they did not give the same outcome twice."""
    tests_run: int = 0
    """Sandboxed test runs made."""


def with_report_plugin(command: str, exclude: Sequence[str] = ()) -> str:
    """``command`` with ``-p tracerl_report`` after ``pytest`` and the ``exclude``d test
    names deselected (``-k``)."""
    words = shlex.split(command)
    at = next((i for i, w in enumerate(words) if w == "pytest" or w.endswith("/pytest")
               or w == "py.test"), None)
    if at is None:
        raise ValueError(f"test_command must run pytest, got {command!r}")
    extra = ["-p", "tracerl_report", "-p", "no:cacheprovider"]
    if exclude:
        extra += ["-k", "not (" + " or ".join(sorted(exclude)) + ")"]
    return shlex.join(words[:at + 1] + extra + words[at + 1:])


def _test_name(nodeid: str) -> str:
    """The name ``-k`` matches for a node id: its last part without parameters."""
    return nodeid.split("::")[-1].split("[", 1)[0]


def _split_id(nodeid: str) -> tuple[str, str | None, str]:
    parts = nodeid.split("::")
    name = parts[-1].split("[", 1)[0]
    return parts[0], (parts[1] if len(parts) == 3 else None), name


def remove_tests(source: str, remove: set[tuple[str | None, str]]) -> str | None:
    """``source`` without the test functions ``(class or None, name)`` named; None when one
    of them is not defined right there (an inherited method)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    cut: list[tuple[int, int, str]] = []
    found: set[tuple[str | None, str]] = set()

    def span(node: ast.AST) -> tuple[int, int]:
        decorators = getattr(node, "decorator_list", [])
        start = min([node.lineno, *(d.lineno for d in decorators)])  # type: ignore[attr-defined]
        return start, node.end_lineno or node.lineno  # type: ignore[attr-defined]

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (None, node.name) in remove:
            cut.append((*span(node), ""))
            found.add((None, node.name))
        elif isinstance(node, ast.ClassDef):
            methods = [m for m in node.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)
                       and (node.name, m.name) in remove]
            found.update((node.name, m.name) for m in methods)
            for index, method in enumerate(methods):
                left = len(node.body) - len(methods)
                indent = " " * method.col_offset
                cut.append((*span(method), f"{indent}pass\n" if left == 0 and index == 0 else ""))
    if found != remove:
        return None
    for start, end, replacement in sorted(cut, reverse=True):
        lines[start - 1:end] = [replacement] if replacement else []
    text = "".join(lines)
    ast.parse(text)
    return text


@dataclass(frozen=True)
class _Repo:
    files: Mapping[str, str]
    sources: tuple[str, ...]
    test_files: tuple[str, ...]


def _is(path: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(PurePosixPath(path).name, p)
               for p in patterns if "/" not in p) or any(fnmatch.fnmatchcase(path, p)
                                                         for p in patterns if "/" in p)


class Miner:
    """Mines one or more repositories with the same settings (see the module docstring)."""

    def __init__(self, settings: MineSettings, sandbox: Sandbox) -> None:
        self.settings = settings
        self.sandbox = sandbox.with_environment(settings.environment)

    def _run(self, files: Mapping[str, str], exclude: Sequence[str]) -> Verdict:
        return run_verdict(self.sandbox, files, {},
                           with_report_plugin(self.settings.test_command, exclude))

    def mine(self, repos: Mapping[str, Mapping[str, str]]) -> MineResult:
        """Mine ``repos`` (a name for each: its files); modules are split into train and
        held-out across all of them."""
        result = MineResult()
        prepared: dict[str, _Repo] = {}
        for name, files in sorted(repos.items()):
            test_files = tuple(sorted(p for p in files if _is(p, self.settings.tests)))
            sources = tuple(sorted(p for p in files if p.endswith(".py")
                                   and p not in test_files and _is(p, self.settings.sources)))
            if not test_files or not sources:
                raise ValueError(f"repository {name!r}: needs source files and test files "
                                 f"(found {len(sources)} and {len(test_files)})")
            prepared[name] = _Repo(files, sources, test_files)
        modules = sorted((name, path) for name, repo in prepared.items() for path in repo.sources)
        rng = random.Random(self.settings.seed)
        order = modules[:]
        rng.shuffle(order)
        held = (math.ceil(len(order) * self.settings.heldout_fraction)
                if len(order) >= 2 and self.settings.heldout_fraction > 0 else 0)
        heldout_modules = set(order[:held])
        jobs: list[tuple[str, str, str]] = []
        for name, path in order:
            tree = ast.parse(prepared[name].files[path])
            jobs += [(name, path, qualified) for qualified, _ in functions(tree)]
        with ThreadPoolExecutor(max_workers=self.settings.workers) as pool:
            baselines = dict(zip(prepared, pool.map(lambda n: self.baseline(prepared[n].files,
                                                                            result),
                                                    prepared), strict=True))
            runnable = [job for job in jobs if baselines[job[0]] is not None]
            for name in prepared:
                if baselines[name] is None:
                    result.refused["tests do not pass twice on the unmutated code"] += 1
            mined = list(pool.map(lambda job: self._function(prepared[job[0]], job[1], job[2],
                                                             baselines[job[0]], result),
                                  runnable))
        count = 0
        for (name, path, _), tasks in zip(runnable, mined, strict=True):
            for task in tasks:
                if self.settings.max_tasks is not None and count >= self.settings.max_tasks:
                    break
                target = result.heldout if (name, path) in heldout_modules else result.train
                target.append(task)
                count += 1
        return result

    def baseline(self, files: Mapping[str, str], result: MineResult) -> tuple[frozenset[str], frozenset[str]] | None:
        """The stable passing tests and the excluded (flaky or failing) test names."""
        first, second = self._run(files, ()), self._run(files, ())
        result.tests_run += 2
        both = set(first.outcomes) | set(second.outcomes)
        stable = {t for t in both if first.outcomes.get(t) and second.outcomes.get(t)}
        excluded = {_test_name(t) for t in both - stable}
        result.flaky.update(both - stable)
        stable = {t for t in stable if _test_name(t) not in excluded}
        if not stable:
            return None
        if excluded:  # the stable tests must pass on their own, without the others
            check = self._run(files, sorted(excluded))
            result.tests_run += 1
            if not check.passed or not stable <= set(check.outcomes):
                return None
        return frozenset(stable), frozenset(excluded)

    def _function(self, repo: _Repo, path: str, function: str,
                  baseline: tuple[frozenset[str], frozenset[str]] | None,
                  result: MineResult) -> list[Task]:
        assert baseline is not None
        tasks: list[Task] = []
        source = repo.files[path]
        seed = self.settings.seed
        for number, mutant in enumerate(mutants(source, seed=seed,
                                                limit=self.settings.tries_per_function,
                                                select=lambda n: n == function)):
            if len(tasks) >= self.settings.tasks_per_function:
                break
            task = self.attempt(repo.files, path, mutant, number, baseline, result)
            if task is not None:
                tasks.append(task)
        return tasks

    def attempt(self, repo_files: Mapping[str, str], path: str, mutant: Mutant, number: int,
                baseline: tuple[frozenset[str], frozenset[str]],
                result: MineResult) -> Task | None:
        """The task ``mutant`` of ``path`` makes, or None (the reason counted in
        ``result.refused``)."""
        stable, excluded = baseline
        files = {**repo_files, path: mutant.source}
        runs: list[Verdict] = []
        for _ in range(2):
            run = self._run(files, sorted(excluded))
            result.tests_run += 1
            if run.result.timed_out:
                result.refused["runs out of time"] += 1
                return None
            if not stable <= set(run.outcomes):
                result.refused["breaks collection (tests not reported)"] += 1
                return None
            runs.append(run)
            if not any(not run.outcomes[t] for t in stable):
                result.refused["not caught by the tests"] += 1
                return None
        failing = sorted(t for t in stable if not runs[0].outcomes[t] and not runs[1].outcomes[t])
        flaky = sorted(t for t in stable if runs[0].outcomes[t] != runs[1].outcomes[t])
        result.flaky.update(flaky)
        if not failing:
            result.refused["caught only by flaky tests"] += 1
            return None
        return self._task(repo_files, path, mutant, number, failing,
                          sorted(excluded | {_test_name(t) for t in flaky}))

    def _task(self, repo_files: Mapping[str, str], path: str, mutant: Mutant, number: int,
              failing: list[str], excluded: list[str]) -> Task | None:
        settings = self.settings
        rng = random.Random(f"{settings.seed}:{path}:{mutant.function}:{number}")
        shown = max(1, round(len(failing) * settings.visible_fraction))
        visible = set(rng.sample(failing, shown))
        hidden_only = [t for t in failing if t not in visible]
        files = {**repo_files, path: mutant.source}
        by_file: dict[str, set[tuple[str | None, str]]] = {}
        for nodeid in hidden_only:
            test_file, cls, name = _split_id(nodeid)
            by_file.setdefault(test_file, set()).add((cls, name))
        for test_file, remove in by_file.items():
            if test_file not in files:
                return None
            stripped = remove_tests(files[test_file], remove)
            if stripped is None:  # an inherited test: it cannot be hidden on its own
                return None
            files[test_file] = stripped
        catching = sorted({_split_id(t)[0] for t in failing})
        hidden: dict[str, str] = {}
        for test_file in catching:
            if test_file not in repo_files:
                return None
            pure = PurePosixPath(test_file)
            hidden[str(pure.with_name(f"{pure.stem}_hidden{pure.suffix}"))] = repo_files[test_file]
        deselect = (" -k " + shlex.quote("not (" + " or ".join(excluded) + ")")) if excluded else ""
        command = settings.test_command + deselect
        module = PurePosixPath(path).with_suffix("").as_posix().replace("/", ".")
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{module}.{mutant.function}")
        return Task(
            id=f"{settings.name}-{slug}-{number}", family=settings.name,
            instruction=(f"A bug in {mutant.function} ({path}) makes tests fail. Find it and "
                         "fix it; run the tests to see which fail."),
            files=files, protected=tuple(settings.tests), test_command=command,
            hidden_files=hidden,
            hidden_test_command=("python -m pytest -q -p no:cacheprovider -p tracerl_report "
                                 + " ".join(sorted(hidden)) + deselect),
            solution={path: repo_files[path]}, environment=settings.environment,
            budget=(None if settings.test_seconds is None
                    else Budget(test_seconds=settings.test_seconds)),
            extra={"mutation": {"operator": mutant.operator, "function": mutant.function,
                                "path": path, "line": mutant.line,
                                "description": mutant.description},
                   "failing_tests": failing, "visible_failing_tests": sorted(visible)},
        )


STDLIB_MODULES = ("colorsys", "getopt", "graphlib", "fractions", "sched", "netrc", "filecmp")
"""The standard-library modules of the built-in mined suite: pure Python, tested by their own
``test_<module>.py``, and not imported by pytest itself (which would shadow the copy)."""


def stdlib_repos(modules: Sequence[str] = STDLIB_MODULES) -> dict[str, dict[str, str]]:
    """A repository per module of the running Python's standard library: ``<module>.py``
    and its ``test_<module>.py`` (from the ``test`` package the interpreter ships)."""
    import sysconfig

    root = PurePosixPath(sysconfig.get_paths()["stdlib"])
    repos: dict[str, dict[str, str]] = {}
    for module in modules:
        source, test = root / f"{module}.py", root / "test" / f"test_{module}.py"
        try:
            with open(source, encoding="utf-8") as handle:
                source_text = handle.read()
            with open(test, encoding="utf-8") as handle:
                test_text = handle.read()
        except OSError as error:
            raise ValueError(f"module {module!r}: this Python does not ship {error.filename} "
                             "(its test package is needed)") from None
        repos[module] = {f"{module}.py": source_text, f"test_{module}.py": test_text}
    return repos
