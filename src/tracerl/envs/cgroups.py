"""A memory limit for a whole sandbox: one memory cgroup per sandboxed command.

``RLIMIT_AS`` limits each process on its own, so a command that starts many processes can use
many times its limit. A cgroup limits them together: every process the command starts is in
the cgroup, and when their memory (including what they write to the private ``/tmp``) passes
the limit, the kernel's OOM killer ends one of them.

Three modes, chosen once per process by :func:`cgroup_support`:

- ``cgroup2``: the unified hierarchy. A cgroup that holds processes cannot give the memory
  controller to children (except the root), so the sandboxes' cgroups are made below this
  process's cgroup only when that is the root, and otherwise beside it, below its parent,
  when the parent enables ``memory`` for its children (``cgroup.subtree_control``: the usual
  layout of a delegated cgroup, whose limit then covers tracerl and its sandboxes together);
  ``memory.max`` and ``memory.swap.max = 0``.
- ``cgroup1``: a legacy ``memory`` hierarchy (hybrid systems), below this process's own cgroup
  (so also within any limit set there); ``memory.limit_in_bytes`` and, when swap accounting
  is on, ``memory.memsw.limit_in_bytes`` at the same value.
- ``rlimit``: neither can be used (not root, no memory controller, a read-only mount); the
  sandbox then falls back to per-process limits (see ``Sandbox.memory_bound``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

MemoryMode = Literal["cgroup2", "cgroup1", "rlimit"]
"""How a sandbox's memory is limited (see the module docstring)."""

JOIN_FAILED = "tracerl-cgroup:"
"""Start of the message a command prints when it could not join its cgroup."""

_names = itertools.count()
_live: set[Path] = set()
_live_lock = threading.Lock()


@dataclass(frozen=True)
class CgroupSupport:
    """Whether per-sandbox memory cgroups can be used here, and where."""

    mode: MemoryMode
    """``cgroup2`` or ``cgroup1`` when cgroups are used, else ``rlimit``."""
    parent: Path | None
    """The cgroup directory sandboxes' cgroups are made in (None in ``rlimit`` mode)."""
    reason: str
    """Why this mode: where the cgroups go, or why none can be made."""


def _own_cgroups(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as controller list -> path (the unified hierarchy's key is "")."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out[parts[1]] = parts[2]
    return out


def _cgroup_mounts(text: str) -> list[tuple[str, str, str, set[str]]]:
    """``/proc/self/mountinfo``'s cgroup mounts as (type, mount point, root, super options)."""
    mounts = []
    for line in text.splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        mounts.append((tail[0], fields[4], fields[3], set(tail[2].split(","))))
    return mounts


def _under_mount(mount_point: str, mount_root: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` in a mount whose root is ``mount_root``."""
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root + "/")):
        return None
    relative = path[len(mount_root):] if mount_root != "/" else path
    return Path(mount_point) / relative.lstrip("/")


def _try_make(parent: Path) -> str | None:
    """Make a probe cgroup in ``parent``, move a short-lived process into it and remove it;
    None when all of that works, else why not."""
    probe = parent / f"tracerl-probe-{os.getpid()}-{next(_names)}"
    try:
        probe.mkdir()
    except OSError as error:
        return f"cannot create a cgroup in {parent}: {error.strerror or error}"
    try:
        joined = subprocess.run(["/bin/sh", "-c", 'echo $$ > "$0"', str(probe / "cgroup.procs")],
                                capture_output=True, text=True, timeout=10, check=False)
        if joined.returncode != 0:
            return f"cannot move a process into a cgroup in {parent}: {joined.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as error:
        return f"cannot move a process into a cgroup in {parent}: {error}"
    finally:
        for _ in range(100):  # the probe process may take a moment to leave it
            try:
                probe.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)
    return None


@functools.lru_cache(maxsize=1)
def cgroup_support() -> CgroupSupport:
    """Probe once per process which memory-limit mode sandboxes can use."""
    try:
        own = _own_cgroups(Path("/proc/self/cgroup").read_text())
        mounts = _cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    except OSError as error:
        return CgroupSupport("rlimit", None, f"cannot read this process's cgroups: {error}")
    return _choose(own, mounts)


def _choose(own: dict[str, str], mounts: list[tuple[str, str, str, set[str]]]) -> CgroupSupport:
    """The mode and parent directory for a process in cgroups ``own``, given the mounts."""
    reasons: list[str] = []
    for kind, point, root, _ in mounts:
        if kind != "cgroup2" or "" not in own:
            continue
        directory = _under_mount(point, root, own[""])
        if directory is None:
            continue
        # Below our own cgroup only at the root (the one cgroup that may hold processes and
        # give controllers to children); otherwise beside it, below its parent.
        parent = directory if directory == Path(point) else directory.parent
        if not (parent == Path(point) or parent.is_relative_to(point)):
            continue
        try:
            enabled = (parent / "cgroup.subtree_control").read_text().split()
        except OSError:
            enabled = []
        if "memory" not in enabled:
            reasons.append(f"cgroup v2: the memory controller is not enabled for the children "
                           f"of {parent} (cgroup.subtree_control)")
            continue
        problem = _try_make(parent)
        if problem is None:
            return CgroupSupport("cgroup2", parent, f"cgroup v2 below {parent}")
        reasons.append(f"cgroup v2: {problem}")
    memory_path = next((path for key, path in own.items() if "memory" in key.split(",")), None)
    for kind, point, root, options in mounts:
        if kind != "cgroup" or "memory" not in options or memory_path is None:
            continue
        directory = _under_mount(point, root, memory_path)
        if directory is None:
            continue
        problem = _try_make(directory)
        if problem is None:
            why_not_v2 = f" ({'; '.join(reasons)})" if reasons else ""
            return CgroupSupport("cgroup1", directory,
                                 f"cgroup v1 memory below {directory}{why_not_v2}")
        reasons.append(f"cgroup v1: {problem}")
    if not reasons:
        reasons.append("no cgroup hierarchy with a memory controller is mounted")
    return CgroupSupport("rlimit", None, "; ".join(reasons))


class SandboxCgroup:
    """One sandboxed command's memory cgroup; ``remove()`` it when the command is over."""

    def __init__(self, support: CgroupSupport, memory_bytes: int) -> None:
        """Make the cgroup and set its limit; OSError when that fails."""
        if support.parent is None:
            raise ValueError("support: no cgroup can be made in rlimit mode")
        self.mode = support.mode
        self.path = support.parent / f"tracerl-{os.getpid()}-{next(_names)}"
        self.path.mkdir()
        with _live_lock:
            _live.add(self.path)
        try:
            if self.mode == "cgroup2":
                (self.path / "memory.max").write_text(str(memory_bytes))
                if (self.path / "memory.swap.max").exists():
                    (self.path / "memory.swap.max").write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(memory_bytes))
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        except OSError:
            self.remove()
            raise

    @property
    def procs_file(self) -> str:
        """Where a process writes its pid to join the cgroup."""
        return str(self.path / "cgroup.procs")

    def join_prefix(self, shell: str = "/bin/sh") -> list[str]:
        """An argv prefix that moves the command into the cgroup before it runs (the shell
        joins, then ``exec``s the rest, so every process of the command is inside)."""
        script = (f'echo $$ > "$0" || {{ echo "{JOIN_FAILED} cannot join $0" >&2; exit 125; }}; '
                  'exec "$@"')
        return [shell, "-c", script, self.procs_file]

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer ended a process of this cgroup."""
        name = "memory.events" if self.mode == "cgroup2" else "memory.oom_control"
        try:
            text = (self.path / name).read_text()
        except OSError:
            return False
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value) > 0
        return False

    def remove(self, timeout: float = 5.0) -> None:
        """Kill whatever is left in the cgroup and delete it (retrying while processes exit)."""
        deadline = time.monotonic() + timeout
        while True:
            _kill_members(self.path)
            try:
                self.path.rmdir()
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    return  # still busy; the exit hook tries again
                time.sleep(0.01)
                continue
            break
        with _live_lock:
            _live.discard(self.path)


def _kill_members(path: Path) -> None:
    kill_file = path / "cgroup.kill"
    if kill_file.exists():
        with contextlib.suppress(OSError):
            kill_file.write_text("1")
            return
    try:
        pids = (path / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@atexit.register
def _remove_leftovers() -> None:
    """Remove cgroups whose removal failed earlier (a process was slow to exit)."""
    with _live_lock:
        leftovers = list(_live)
    for path in leftovers:
        _kill_members(path)
        with contextlib.suppress(OSError):
            path.rmdir()
