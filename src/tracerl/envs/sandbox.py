"""Run untrusted commands in a workspace under bubblewrap, with resource limits and a timeout.

The sandbox is built from four independent layers, each of which bites on its own:

1. **Namespaces** (bubblewrap): a new user, pid, network, ipc and uts namespace. The network
   namespace has only its own (down) loopback, so nothing on the host is reachable. The pid
   namespace means killing its init kills every process the command started, including ones
   that called ``setsid`` or double-forked.
2. **Filesystem view**: only the system directories the Python interpreter needs are mounted,
   read-only; ``/tmp`` is a private size-limited tmpfs; the workspace is the only writable
   bind. The host's home, other workspaces and tracerl's own source are not visible.
3. **An unprivileged host uid**: when tracerl runs as root, the command runs as a fresh uid
   (not root) on the host. Root is exempt from ``RLIMIT_NPROC`` and from file permissions, so
   without this a fork bomb would not be stopped and permissions would not matter.
4. **Resource limits** set with ``prlimit`` before bubblewrap starts (CPU seconds, address
   space, processes, file size, open files) plus a wall-clock timeout that kills the whole
   process group, and with it the pid namespace.
5. **A memory limit for the whole sandbox**: every command runs in its own memory cgroup
   (:mod:`tracerl.envs.cgroups`), so all its processes together stay under
   ``SandboxLimits.memory_bytes``. Where no cgroup can be made the sandbox says so
   (``Sandbox.memory_mode == "rlimit"``) and bounds the total by the address space of each
   process times a lower process count (``Sandbox.memory_bound``).

Without bubblewrap the sandbox refuses to run unless ``unsafe=True`` is given explicitly; the
unsafe mode keeps the limits and the timeout but offers no isolation at all.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tracerl.envs.cgroups import (
    JOIN_FAILED,
    CgroupSupport,
    MemoryMode,
    SandboxCgroup,
    cgroup_support,
)
from tracerl.envs.repos import environment_dirs

KilledReason = Literal["timeout", "cpu", "memory", "file_size", "processes"]
"""Why a limit stopped the command.

- ``timeout``: the wall-clock limit passed and the process tree was killed.
- ``cpu``: the CPU-time limit (``RLIMIT_CPU``) sent SIGXCPU/SIGKILL.
- ``memory``: the sandbox's cgroup ran out of memory and the kernel killed a process, or an
  allocation failed under the address-space limit (read from the output).
- ``file_size``: a write passed the file-size limit (SIGXFSZ).
- ``processes``: a fork failed under the process limit (read from the output).
"""

WORKSPACE_MOUNT = "/workspace"
"""Where the workspace appears inside the sandbox; paths printed by tests start here."""

_SANDBOX_UID_BASE = 200_000
"""First host uid handed to sandboxed commands when tracerl runs as root."""

_PLAIN_COMMAND = re.compile(r"[A-Za-z0-9_./:,+@-]+( [A-Za-z0-9_./:,+@-]+)*")
"""Commands that mean the same with or without a shell (no quotes, globs, variables, ...)."""

_uid_counter = itertools.count()
_uid_lock = threading.Lock()


class SandboxUnavailableError(RuntimeError):
    """bubblewrap is missing (or cannot create namespaces) and unsafe mode was not chosen."""


class SandboxStartError(RuntimeError):
    """The sandbox could not be started; the infrastructure's fault, not the command's."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandboxed command."""

    wall_seconds: float = 10.0
    """Wall-clock limit; past it the whole process tree is killed (``killed_reason='timeout'``)."""
    cpu_seconds: int = 10
    """CPU-time limit per process (``RLIMIT_CPU``)."""
    memory_bytes: int = 1 << 30
    """Memory of the whole sandbox, all its processes together (its cgroup's limit), and
    also the address-space limit of each process (``RLIMIT_AS``)."""
    max_processes: int = 64
    """Process limit for the sandbox's host uid (``RLIMIT_NPROC``)."""
    fallback_processes: int = 16
    """Process limit used instead of ``max_processes`` (when lower) where no memory cgroup
    can be made: the sandbox's memory is then bounded by ``memory_bytes`` times this."""
    file_size_bytes: int = 16 << 20
    """Largest file a process may write (``RLIMIT_FSIZE``); also bounds captured output."""
    open_files: int = 256
    """Open file descriptors per process (``RLIMIT_NOFILE``)."""
    tmp_bytes: int = 64 << 20
    """Size of the private ``/tmp`` tmpfs."""
    output_chars: int = 20_000
    """How much of stdout and stderr (each) is returned; the rest is dropped, marked."""

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "max_processes",
                     "fallback_processes", "file_size_bytes", "open_files", "tmp_bytes", "output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed command did."""

    exit_code: int
    """Exit status; 128 + N when killed by signal N (the shell convention)."""
    stdout: str
    """Captured standard output, truncated to ``SandboxLimits.output_chars``."""
    stderr: str
    """Captured standard error, truncated likewise."""
    seconds: float
    """Wall-clock seconds from start to the end of the process tree."""
    timed_out: bool
    """True when the wall-clock limit killed the command."""
    killed_reason: KilledReason | None
    """Which limit stopped the command, when one did (see ``KilledReason``)."""

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "exit_code": self.exit_code, "stdout": self.stdout, "stderr": self.stderr,
            "seconds": round(self.seconds, 4), "timed_out": self.timed_out,
        }
        if self.killed_reason is not None:
            out["killed_reason"] = self.killed_reason
        return out


def bwrap_path() -> str | None:
    """The bubblewrap executable on PATH, or None."""
    return shutil.which("bwrap")


def _interpreter_dirs() -> list[str]:
    """Directories the running Python needs: prefixes and the real executable's directory."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  str(Path(sys.executable).parent), str(Path(sys.executable).resolve().parent)}
    dirs = sorted(os.path.realpath(d) for d in candidates if d)
    # Keep only outermost directories; /usr is mounted anyway.
    kept: list[str] = []
    for d in dirs:
        if d == "/usr" or d.startswith("/usr/"):
            continue
        if any(d == k or d.startswith(k + "/") for k in kept):
            continue
        kept.append(d)
    # Non-resolved prefixes (a venv reached through a symlink) must exist at their own paths.
    for d in sorted({sys.prefix, str(Path(sys.executable).parent)}):
        if d not in kept and os.path.realpath(d) != d and not d.startswith("/usr"):
            kept.append(d)
    return kept


def _tracerl_package_dir() -> str:
    """tracerl's own source; hidden inside the sandbox (the suite generator knows hidden tests)."""
    return str(Path(__file__).resolve().parent.parent)


class Sandbox:
    """Runs commands in workspaces; one instance can serve many threads at once."""

    def __init__(self, limits: SandboxLimits | None = None, *, unsafe: bool = False,
                 memory_cgroup: bool = True) -> None:
        """Check that bubblewrap works, or that the caller opted into ``unsafe`` mode.

        ``memory_cgroup=False`` turns the per-sandbox memory cgroup off (``rlimit`` mode).
        Raises ``SandboxUnavailableError`` with the fix when bubblewrap is missing.
        """
        self.limits = limits or SandboxLimits()
        self.unsafe = unsafe
        self.memory_cgroup = memory_cgroup
        self._cgroups = (cgroup_support() if memory_cgroup else
                         CgroupSupport("rlimit", None, "memory cgroups turned off"))
        self._bwrap = bwrap_path()
        self._prlimit = shutil.which("prlimit")
        if self._bwrap is None and not unsafe:
            raise SandboxUnavailableError(
                "bubblewrap (bwrap) was not found on PATH; tracerl runs agent code only inside "
                "it. Install it (Debian/Ubuntu: apt-get install bubblewrap) or, knowing that "
                "the code will then run with NO isolation, pass unsafe=True / --unsafe-no-sandbox."
            )
        self._is_root = os.geteuid() == 0
        self._python_dir = str(Path(sys.executable).parent)
        self._interp_dirs = _interpreter_dirs()
        self._hidden_pkg = _tracerl_package_dir()
        self._setpriv = shutil.which("setpriv")
        self.environment: str | None = None
        self._derived: dict[str, Sandbox] = {}
        """Sandboxes derived for an environment or for other limits (no lock: a sandbox is
        pickled to Ray workers, and two threads deriving the same one at once are harmless,
        ``setdefault`` keeps one)."""

    def with_environment(self, environment: str | None) -> Sandbox:
        """This sandbox with commands run in ``environment`` (a virtualenv or a Python
        executable, bound read-only, its ``bin`` first on ``PATH``) instead of the interpreter
        tracerl runs under; ``None`` returns this sandbox. Derived sandboxes are cached."""
        if environment is None or environment == self.environment:
            return self
        if environment not in self._derived:
            bin_dir, dirs = environment_dirs(environment)
            derived = copy.copy(self)
            derived.environment = environment
            derived._python_dir, derived._interp_dirs = bin_dir, dirs
            derived._derived = {}
            self._derived.setdefault(environment, derived)
        return self._derived[environment]

    def with_limits(self, limits: SandboxLimits) -> Sandbox:
        """This sandbox (same environment) with other limits; derived sandboxes are cached."""
        if limits == self.limits:
            return self
        key = f"limits:{limits!r}"
        if key not in self._derived:
            derived = copy.copy(self)
            derived.limits = limits
            derived._derived = {}
            self._derived.setdefault(key, derived)
        return self._derived[key]

    @property
    def isolated(self) -> bool:
        """True when commands run under bubblewrap (not in unsafe mode)."""
        return self._bwrap is not None and not self.unsafe

    @property
    def memory_mode(self) -> MemoryMode:
        """How memory is limited: ``cgroup2`` or ``cgroup1`` (per sandbox), or ``rlimit``
        (per process, the fallback)."""
        return self._cgroups.mode

    @property
    def memory_bound(self) -> int:
        """Most bytes one command's processes can hold together: ``memory_bytes`` with a
        cgroup; without one, ``memory_bytes`` per process times the process limit."""
        if self.memory_mode != "rlimit":
            return self.limits.memory_bytes
        return self.limits.memory_bytes * self._process_limit()

    @property
    def memory_note(self) -> str:
        """The memory mode, its bound and why it was chosen, in one line."""
        lim = self.limits
        if self.memory_mode == "rlimit":
            return (f"rlimit: {lim.memory_bytes} bytes of address space per process x "
                    f"{self._process_limit()} processes = {self.memory_bound} bytes at most "
                    f"({self._cgroups.reason})")
        return f"{self.memory_mode}: {lim.memory_bytes} bytes per sandbox ({self._cgroups.reason})"

    def _process_limit(self) -> int:
        lim = self.limits
        if self.memory_mode == "rlimit":
            return min(lim.max_processes, lim.fallback_processes)
        return lim.max_processes

    # -- command construction -------------------------------------------------------------

    def _host_uid(self) -> int | None:
        """A host uid for this run when we are root; None to keep our own uid.

        Unsafe mode keeps our uid: without bubblewrap's mounts a fresh uid could not even
        reach an interpreter installed under a private home, and unsafe means no isolation.
        """
        if not self._is_root or not self.isolated:
            return None
        # A distinct uid per concurrent run, so one sandbox's fork bomb cannot use up the
        # process budget of another (RLIMIT_NPROC is counted per host uid).
        with _uid_lock:
            n = next(_uid_counter)
        return _SANDBOX_UID_BASE + (os.getpid() % 4096) * 64 + n % 64

    def _nproc_limit(self, uid: int | None) -> int:
        if uid is not None:
            return self._process_limit()
        # Not root: RLIMIT_NPROC counts every process of our uid, so the budget is on top of
        # what the user already runs.
        me = os.getuid()
        running = 0
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    if entry.stat().st_uid == me:
                        running += 1
                except OSError:
                    continue
        return self._process_limit() + running

    def _limit_prefix(self, uid: int | None) -> list[str]:
        lim = self.limits
        if self._prlimit is None:
            raise SandboxStartError("prlimit (util-linux) is needed to set resource limits")
        return [
            self._prlimit,
            f"--cpu={lim.cpu_seconds}:{lim.cpu_seconds + 1}",
            f"--as={lim.memory_bytes}",
            f"--nproc={self._nproc_limit(uid)}",
            f"--fsize={lim.file_size_bytes}",
            f"--nofile={lim.open_files}",
            "--core=0",
            "--",
        ]

    def _drop_prefix(self, uid: int | None) -> list[str]:
        if uid is None:
            return []
        if self._setpriv is None:
            raise SandboxStartError("setpriv (util-linux) is needed to drop root in the sandbox")
        return [self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                "--inh-caps=-all", "--no-new-privs", "--"]

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = {
            "PATH": f"{self._python_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        env.update(extra or {})
        return env

    def _bwrap_args(self, workspace: Path, env: Mapping[str, str], uid: int | None) -> list[str]:
        assert self._bwrap is not None
        if uid is None:
            # Not root: bubblewrap maps our own (unprivileged) uid to 65534 inside.
            user_args = ["--unshare-user", "--uid", "65534", "--gid", "65534",
                         "--disable-userns"]
        else:
            # Root: bubblewrap sets up the mounts with root's rights (it may need to walk a
            # 0700 home to reach the interpreter) and keeps only the two capabilities the
            # command's first step, setpriv, needs to become ``uid`` and drop them for good.
            user_args = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        args = [
            self._bwrap, *user_args,
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent", "--new-session",
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
            # /proc, /dev and the private /tmp come before the interpreter's directories: an
            # interpreter (a virtualenv) that lives under /tmp is then bound on top of the
            # tmpfs instead of being hidden by it.
            "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--size", str(self.limits.tmp_bytes), "--tmpfs", "/tmp",
        ]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        # bubblewrap would create mount points' parents 0700 (root's), which the sandbox's
        # uid could not walk; create them world-traversable first.
        parents = {"/etc"} | {str(parent) for d in self._interp_dirs
                              for parent in Path(d).parents
                              if str(parent) not in ("/", "/tmp")}
        for parent in sorted(parents, key=lambda p: p.count("/")):
            args += ["--perms", "0755", "--dir", parent]
        for etc_file in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime"):
            args += ["--ro-bind-try", etc_file, etc_file]
        for d in self._interp_dirs:
            args += ["--ro-bind", d, d]
        if any(self._hidden_pkg.startswith(d + "/") for d in self._interp_dirs):
            # tracerl installed inside the interpreter's prefix: cover it so code in the
            # sandbox cannot read the suite generator and rebuild the hidden tests.
            args += ["--tmpfs", self._hidden_pkg]
        args += [
            "--bind", str(workspace), WORKSPACE_MOUNT,
            "--chdir", WORKSPACE_MOUNT,
            "--clearenv",
        ]
        for key, value in env.items():
            args += ["--setenv", key, value]
        return args

    # -- running --------------------------------------------------------------------------

    def run(self, workspace: Path | str, command: str | Sequence[str], *,
            env: Mapping[str, str] | None = None,
            limits: SandboxLimits | None = None) -> SandboxResult:
        """Run ``command`` (a shell string, or an argv list) with ``workspace`` as its root.

        ``workspace`` must be an existing directory; it is the only writable place. Raises
        ``SandboxStartError`` when the sandbox itself could not start.
        """
        if limits is not None and limits != self.limits:
            return Sandbox(limits, unsafe=self.unsafe, memory_cgroup=self.memory_cgroup
                           ).with_environment(self.environment).run(workspace, command, env=env)
        workspace = Path(workspace).resolve()
        if not workspace.is_dir():
            raise ValueError(f"workspace must be an existing directory, got {workspace}")
        if isinstance(command, str):
            # A plain command (``python test_x.py``) is run without a shell: one process less.
            simple = _PLAIN_COMMAND.fullmatch(command) is not None
            argv = command.split() if simple else ["/bin/sh", "-c", command]
        else:
            argv = list(command)
        if not argv:
            raise ValueError("command must not be empty")
        full_env = self._env(env)
        uid = self._host_uid()
        if uid is not None:
            _chown_tree(workspace, uid)
        cgroup = self._make_cgroup()
        try:
            join = [] if cgroup is None else cgroup.join_prefix()
            if not self.isolated:
                outcome = self._execute(join + self._limit_prefix(uid) + argv, full_env,
                                        str(workspace), uid)
            else:
                outcome = self._run_isolated(join, workspace, full_env, uid, argv)
            oom_killed = cgroup is not None and cgroup.oom_killed()
        finally:
            if cgroup is not None:
                cgroup.remove()
        return self._result(*outcome, oom_killed=oom_killed)

    def _make_cgroup(self) -> SandboxCgroup | None:
        if self.memory_mode == "rlimit":
            return None
        try:
            return SandboxCgroup(self._cgroups, self.limits.memory_bytes)
        except OSError as error:
            raise SandboxStartError(f"could not make the sandbox's memory cgroup: {error}"
                                    ) from error

    def _run_isolated(self, join: list[str], workspace: Path, env: dict[str, str],
                      uid: int | None, argv: list[str]) -> tuple[int, str, str, float, bool]:
        info_read, info_write = os.pipe()
        try:
            full = (join + self._limit_prefix(uid) + self._bwrap_args(workspace, env, uid)
                    + ["--info-fd", str(info_write), "--", *self._drop_prefix(uid), *argv])
            outcome = self._execute(full, {"PATH": "/usr/bin:/bin"}, "/", None, info_write)
            # When the timeout killed bubblewrap, its pid namespace dies asynchronously. Kill
            # the namespace's init directly and wait until it is gone: the kernel reaps every
            # other process of the namespace before its init finishes exiting, so after this
            # nothing the command started is still running.
            namespace_init = _read_child_pid(info_read)
            if namespace_init is not None:
                _kill_and_wait(namespace_init, timeout=5.0)
        finally:
            os.close(info_read)
        return outcome

    def _execute(self, argv: list[str], env: dict[str, str], cwd: str, uid: int | None,
                 info_fd: int | None = None) -> tuple[int, str, str, float, bool]:
        lim = self.limits
        with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
            start = time.monotonic()
            try:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out_file, stderr=err_file,
                    env=env, cwd=cwd, start_new_session=True, close_fds=True,
                    pass_fds=() if info_fd is None else (info_fd,),
                    user=uid, group=uid, extra_groups=[] if uid is not None else None,
                )
            except OSError as error:
                raise SandboxStartError(f"could not start the sandbox: {error}") from error
            finally:
                if info_fd is not None:
                    os.close(info_fd)
            timed_out = False
            try:
                returncode = _wait(proc, lim.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                returncode = proc.wait()
            # Anything the command left in its process group goes too. Under bubblewrap the
            # pid namespace takes care of the rest (see ``run``); in unsafe mode a process
            # that called setsid escapes this.
            _kill_group(proc.pid)
            seconds = time.monotonic() - start
            stdout = _read_capped(out_file, lim.output_chars)
            stderr = _read_capped(err_file, lim.output_chars)
        return returncode, stdout, stderr, seconds, timed_out

    def _result(self, returncode: int, stdout: str, stderr: str, seconds: float,
                timed_out: bool, *, oom_killed: bool = False) -> SandboxResult:
        exit_code = 128 - returncode if returncode < 0 else returncode
        if self.isolated and exit_code == 1 and stderr.startswith("bwrap:"):
            raise SandboxStartError(f"bubblewrap failed: {stderr.strip()}")
        if exit_code == 125 and stderr.startswith(JOIN_FAILED):
            raise SandboxStartError(f"the sandbox's memory cgroup failed: {stderr.strip()}")
        reason = _killed_reason(exit_code, stderr, timed_out, oom_killed)
        return SandboxResult(exit_code, stdout, stderr, seconds, timed_out, reason)


def _chown_tree(root: Path, uid: int) -> None:
    os.chown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)


def _read_child_pid(info_read: int) -> int | None:
    """The host pid of the namespace's init, from bubblewrap's ``--info-fd`` JSON."""
    os.set_blocking(info_read, False)
    try:
        data = os.read(info_read, 4096)
    except BlockingIOError:
        return None
    try:
        pid = json.loads(data.decode()).get("child-pid")
    except (ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) and pid > 1 else None


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """``proc.wait(timeout)`` woken by the exit (a pidfd); Python's own polls with sleeps up to
    50 ms, ~30 ms added to a 35 ms test run. Without pidfds, Python's wait."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return proc.wait(timeout=timeout)
    ready = select.select([pidfd], [], [], timeout)[0]
    os.close(pidfd)
    if not ready:
        raise subprocess.TimeoutExpired(proc.args, timeout)
    return proc.wait()


def _kill_and_wait(pid: int, timeout: float) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in (b"Z", b"X"):  # exited; only its parent's reaping is left
            return
        time.sleep(0.002)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read_capped(handle: object, limit: int) -> str:
    assert hasattr(handle, "seek") and hasattr(handle, "read")
    handle.seek(0)
    data = handle.read(limit * 4 + 4)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit:
        text = text[:limit] + "\n[output truncated]"
    return str(text)


_OOM_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")
_NPROC_MARKERS = ("Resource temporarily unavailable", "BlockingIOError", "fork: retry",
                  "Cannot fork", "can't fork")


def _killed_reason(exit_code: int, stderr: str, timed_out: bool,
                   oom_killed: bool = False) -> KilledReason | None:
    """Which limit stopped the command. The cgroup says when its OOM killer ended a process;
    the address-space and process cases are read from stderr because a failed allocation or
    fork is an error the program reports, not a signal."""
    if timed_out:
        return "timeout"
    if exit_code == 0:
        return None
    if oom_killed:
        return "memory"
    if exit_code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return "cpu"
    if exit_code == 128 + signal.SIGXFSZ:
        return "file_size"
    if any(marker in stderr for marker in _OOM_MARKERS):
        return "memory"
    if any(marker in stderr for marker in _NPROC_MARKERS):
        return "processes"
    return None
