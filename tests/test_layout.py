"""The package layout: which parts of tracerl may import which, and how long a module may be.

Every ``import`` and ``from ... import`` of every module is read (those inside functions too),
so a lazy import cannot hide a dependency that points the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tracerl"

ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset({"core"}),
    "hermes": frozenset(),
    "trace": frozenset({"trace"}),
    "models": frozenset({"models", "hermes"}),
    "envs": frozenset({"envs", "hermes", "models"}),
    "rollout": frozenset({"rollout", "envs", "trace", "hermes", "models"}),
    "eval": frozenset({"eval", "envs", "rollout", "trace", "hermes", "models"}),
}
"""What each part may import of tracerl (itself included). ``train`` may import every part but
``testing``; ``eval`` never imports ``train``, so the trainer calling the evaluation library
(scores and summaries of attempts, the report) is the one direction between them."""

MAX_LINES = 600
"""The most lines a module may have."""
LONGER_MODULES: dict[str, int] = {"train/trainer.py": 700}
"""The modules allowed more lines, and how many: the training loop reads top to bottom."""


def _imports(path: Path) -> set[str]:
    """The tracerl parts (``core``, ``rollout``, ...) that ``path`` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {name.split(".")[1] for name in names
            if name.startswith("tracerl.") and name.count(".") >= 1}


def _part(path: Path) -> str:
    relative = path.relative_to(SRC)
    return relative.parts[0].removesuffix(".py")


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_the_source_tree_is_found() -> None:
    parts = {_part(p) for p in _modules()}
    assert {"core", "trace", "envs", "rollout", "train", "eval", "testing", "hermes"} <= parts


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_each_part_imports_only_what_it_may(part: str) -> None:
    wrong = {str(p.relative_to(SRC)): sorted(_imports(p) - ALLOWED[part])
             for p in _modules() if _part(p) == part}
    assert {k: v for k, v in wrong.items() if v} == {}


def test_no_library_module_imports_the_test_fixtures() -> None:
    users = [str(p.relative_to(SRC)) for p in _modules()
             if _part(p) != "testing" and "testing" in _imports(p)]
    assert users == []


def test_no_module_is_over_600_lines() -> None:
    lengths = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in _modules()}
    long = {name: lines for name, lines in lengths.items()
            if lines > LONGER_MODULES.get(name, MAX_LINES)}
    assert long == {}
    assert set(LONGER_MODULES) <= set(lengths)  # the exception names a module that exists


def test_the_rollout_rooms_hold_their_modules() -> None:
    rooms = {p.parent.name for p in (SRC / "rollout").rglob("*.py") if p.name != "__init__.py"}
    assert rooms == {"rollout", "policies", "decoding", "collect", "serve", "vllm"}
    # Beside the rooms: the package, its command line, and the one rollout config that the
    # trainer, the collector, the evaluation and the server all read.
    loose = sorted(p.name for p in (SRC / "rollout").glob("*.py"))
    assert loose == ["__init__.py", "cli.py", "settings.py"]


def test_the_tool_call_markers_are_written_in_one_module() -> None:
    writers = [str(p.relative_to(SRC)) for p in _modules()
               if "<tool_call>" in p.read_text() and p.name != "hermes.py"]
    # Docstrings may show a call; code builds it from tracerl.hermes.
    for name in writers:
        code = ast.parse((SRC / name).read_text())
        prose = {id(node.value) for node in ast.walk(code) if isinstance(node, ast.Expr)}
        literals = [node.value for node in ast.walk(code)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and "<tool_call>" in node.value and id(node) not in prose]
        assert literals == [], name
