"""Tasks that live in a repository: starting files read from a directory or a git commit,
and the environment (a virtualenv or a Python executable) their commands run in.

A task names its repository with ``repo`` (``{"path": DIR}`` or ``{"git": REPO, "commit":
SHA}``); its ``files`` are then that repository's text files with the task's own ``files``
laid over them. Relative paths are read from the task file's directory. Only text files are
read (UTF-8; binary files, ``.git`` and caches are left out, as the task format holds text),
and the snapshot is read once, when the task is loaded, so a later change to the directory
does not change a loaded task.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

SKIPPED_DIRS = frozenset({".git", "__pycache__", ".venv", "venv", ".tox", ".nox",
                          ".mypy_cache", ".pytest_cache", ".ruff_cache", "node_modules",
                          ".hg", ".svn", ".eggs", "build", "dist"})
"""Directories never read into a task's files."""
MAX_FILE_BYTES = 1 << 20
"""Larger files are left out of a repository snapshot."""
MAX_REPO_FILES = 5000
"""A repository with more text files than this is refused (point ``path`` at a part)."""


@dataclass(frozen=True)
class RepoSource:
    """Where a task's starting files come from: a directory, or a git repository at a commit."""

    path: str | None = None
    """A directory, as written in the task (absolute, or relative to the task file)."""
    git: str | None = None
    """A git repository (a directory or anything ``git`` can read locally), with ``commit``."""
    commit: str | None = None
    """The commit (or any revision) of ``git`` whose tree is the starting files."""
    base_dir: str | None = field(default=None, compare=False)
    """Directory relative paths are read from (the task file's); not written back."""

    def __post_init__(self) -> None:
        if (self.path is None) == (self.git is None):
            raise ValueError("repo must name exactly one of path or git")
        if self.git is not None and not (isinstance(self.commit, str) and self.commit):
            raise ValueError("repo.git needs repo.commit (a commit id or revision)")
        if self.path is not None and self.commit is not None:
            raise ValueError("repo.commit goes with repo.git, not repo.path")
        for name in ("path", "git"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"repo.{name} must be a non-empty string")

    @classmethod
    def from_value(cls, value: Any, base_dir: str | Path | None = None) -> RepoSource:
        if not isinstance(value, Mapping):
            raise ValueError("repo must be an object: {\"path\": DIR} or "
                             "{\"git\": REPO, \"commit\": SHA}")
        unknown = sorted(set(value) - {"path", "git", "commit"})
        if unknown:
            raise ValueError(f"repo: unknown keys {unknown}")
        return cls(value.get("path"), value.get("git"), value.get("commit"),
                   None if base_dir is None else str(base_dir))

    def to_dict(self) -> dict[str, str]:
        out = {"path": self.path, "git": self.git, "commit": self.commit}
        return {k: v for k, v in out.items() if v is not None}

    def _resolve(self, where: str) -> Path:
        path = Path(where).expanduser()
        if not path.is_absolute() and self.base_dir is not None:
            path = Path(self.base_dir) / path
        return path

    def read_files(self) -> dict[str, str]:
        """The repository's text files, relative path to content. Raises ValueError naming
        the problem when the directory or commit cannot be read."""
        if self.path is not None:
            root = self._resolve(self.path)
            if not root.is_dir():
                raise ValueError(f"repo.path {self.path!r}: no such directory ({root})")
            return read_directory(root)
        assert self.git is not None and self.commit is not None
        return read_git_commit(self._resolve(self.git), self.commit)


def _keep(relative: str) -> bool:
    parts = PurePosixPath(relative).parts
    return not any(p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts[:-1]) and \
        not relative.endswith((".pyc", ".pyo"))


def _text(data: bytes) -> str | None:
    if len(data) > MAX_FILE_BYTES or b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _checked(files: dict[str, str], where: str) -> dict[str, str]:
    if not files:
        raise ValueError(f"{where}: holds no text file")
    if len(files) > MAX_REPO_FILES:
        raise ValueError(f"{where}: {len(files)} text files, more than {MAX_REPO_FILES}")
    return dict(sorted(files.items()))


def read_directory(root: Path) -> dict[str, str]:
    """The text files under ``root`` (symlinks and skipped directories left out)."""
    files: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS
                             and not d.endswith(".egg-info")
                             and not os.path.islink(os.path.join(dirpath, d)))
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            relative = os.path.relpath(full, root).replace(os.sep, "/")
            if os.path.islink(full) or not os.path.isfile(full) or not _keep(relative):
                continue
            with open(full, "rb") as handle:
                text = _text(handle.read(MAX_FILE_BYTES + 1))
            if text is not None:
                files[relative] = text
    return _checked(files, str(root))


def read_git_commit(repository: Path, commit: str) -> dict[str, str]:
    """The text files of ``commit``'s tree in ``repository`` (read with ``git archive``)."""
    if commit.startswith("-"):
        raise ValueError(f"repo.commit {commit!r}: not a revision")
    try:
        done = subprocess.run(["git", "-C", str(repository), "archive", "--format=tar",
                               commit], capture_output=True, check=False, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"repo.git {str(repository)!r}: git failed ({error})") from None
    if done.returncode != 0:
        message = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise ValueError(f"repo.git {str(repository)!r} at {commit!r}: "
                         + (message[-1] if message else f"git exited {done.returncode}"))
    files: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        for member in archive.getmembers():
            if not member.isfile() or not _keep(member.name):
                continue
            handle = archive.extractfile(member)
            text = None if handle is None else _text(handle.read())
            if text is not None:
                files[member.name] = text
    return _checked(files, f"{repository}@{commit}")


def environment_dirs(environment: str | Path) -> tuple[str, list[str]]:
    """The ``bin`` directory and the directories to bind of a task's environment: a
    virtualenv directory or a Python executable (whose prefix is its directory's parent).

    A virtualenv's base interpreter (``home`` in its ``pyvenv.cfg``) is bound too. Raises
    ValueError naming the problem when ``environment`` is neither.
    """
    path = Path(environment)
    if not path.is_absolute():
        raise ValueError(f"environment must be an absolute path, got {str(environment)!r}")
    if path.is_dir():
        python = path / "bin" / "python"
        if not python.exists():
            raise ValueError(f"environment {str(path)!r}: a directory without bin/python "
                             "(give a virtualenv or a Python executable)")
        bin_dir, dirs = str(path / "bin"), [str(path), os.path.realpath(path)]
        config = path / "pyvenv.cfg"
        if config.is_file():
            for line in config.read_text(encoding="utf-8", errors="replace").splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "home" and value.strip():
                    home = Path(value.strip())
                    dirs += [str(home.parent), os.path.realpath(home.parent)]
        python_path = python
    elif path.is_file() and os.access(path, os.X_OK):
        bin_dir, python_path = str(path.parent), path
        dirs = [str(path.parent.parent)]
    else:
        raise ValueError(f"environment {str(path)!r}: no such virtualenv or executable")
    real = Path(os.path.realpath(python_path))
    dirs.append(str(real.parent.parent))
    kept: list[str] = []
    for d in sorted(set(dirs), key=len):
        if d in ("/", "/usr") or d.startswith("/usr/") or not os.path.isdir(d):
            continue
        if any(d == k or d.startswith(k + "/") for k in kept):
            continue
        kept.append(d)
    return bin_dir, kept

