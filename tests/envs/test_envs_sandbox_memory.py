"""The sandbox's memory limit is per sandbox (a cgroup), not per process; the fallback says so."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tracerl.envs import cgroups
from tracerl.envs.cgroups import _cgroup_mounts, _choose, _own_cgroups, cgroup_support
from tracerl.envs.sandbox import Sandbox, SandboxLimits, SandboxStartError
from tracerl.envs.tools import failure_excerpt

MB = 1_000_000

# Each child takes 900 MB and writes one byte per page, so the memory is really used, holds
# it while its siblings do the same, and the parent fails when any child was killed.
_CHILD = ("b = bytearray(900 * 1000 * 1000)\nb[::4096] = b'\\x01' * len(range(0, len(b), 4096))\n"
          "import time\ntime.sleep(1.0)\n")


def _holders(count: int) -> list[str]:
    program = ("import subprocess, sys\n"
               f"children = [subprocess.Popen([sys.executable, '-c', {_CHILD!r}]) "
               f"for _ in range({count})]\n"
               "codes = [child.wait() for child in children]\nprint(codes)\n"
               "sys.exit(0 if all(code == 0 for code in codes) else 1)\n")
    return ["python", "-c", program]


def _leftover_cgroups() -> list[str]:
    parent = cgroup_support().parent
    if parent is None:
        return []
    return [p.name for p in parent.iterdir() if p.name.startswith(f"tracerl-{os.getpid()}-")]


@pytest.fixture(scope="module")
def limited() -> Sandbox:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    sandbox = Sandbox(SandboxLimits(memory_bytes=2000 * MB, wall_seconds=60, cpu_seconds=30))
    if sandbox.memory_mode == "rlimit":
        pytest.skip(f"no memory cgroup can be made here: {sandbox.memory_note}")
    return sandbox


def test_one_process_fits_but_four_together_pass_the_sandbox_limit(limited: Sandbox,
                                                                   tmp_path: Path) -> None:
    assert limited.memory_bound == 2000 * MB
    one = limited.run(tmp_path, _holders(1))
    assert one.exit_code == 0 and one.killed_reason is None, one.stderr
    assert failure_excerpt(one) == "PASS"
    # 3.6 GB in four processes, each well under its own address-space limit (2 GB): only a
    # limit on the sandbox as a whole stops them. It is the command's failure, reported as
    # such (no exception: the sandbox itself worked).
    four = limited.run(tmp_path, _holders(4))
    assert four.exit_code != 0 and not four.timed_out
    assert four.killed_reason == "memory"
    assert failure_excerpt(four) == "FAIL\nkilled: memory"
    assert _leftover_cgroups() == []


def test_the_cgroup_is_removed_when_the_sandbox_fails_to_start(
        limited: Sandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object, **__: object) -> None:
        raise SandboxStartError("could not start the sandbox: injected")

    monkeypatch.setattr(limited, "_execute", broken)
    with pytest.raises(SandboxStartError, match="injected"):
        limited.run(tmp_path, "true")
    assert _leftover_cgroups() == []


def test_without_cgroups_the_bound_is_address_space_times_a_lower_process_count(
        tmp_path: Path) -> None:
    limits = SandboxLimits(memory_bytes=512 * MB, max_processes=64, fallback_processes=8,
                           wall_seconds=10)
    sandbox = Sandbox(limits, unsafe=True, memory_cgroup=False)
    assert sandbox.memory_mode == "rlimit"
    assert sandbox.memory_bound == 512 * MB * 8
    assert "8 processes" in sandbox.memory_note and "turned off" in sandbox.memory_note
    result = sandbox.run(tmp_path, ["python", "-c", "print('ok')"])
    assert result.exit_code == 0 and result.stdout.strip() == "ok"
    with pytest.raises(ValueError, match="fallback_processes"):
        SandboxLimits(fallback_processes=0)


def test_cgroup_files_are_read_as_the_kernel_writes_them() -> None:
    own = _own_cgroups("12:memory:/jobs/a\n3:cpu,cpuacct:/jobs/a\n0::/user.slice/x\n")
    assert own == {"memory": "/jobs/a", "cpu,cpuacct": "/jobs/a", "": "/user.slice/x"}
    mountinfo = (
        "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
        "31 25 0:27 /jobs /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "32 25 0:28 / /proc rw - proc proc rw\n")
    assert _cgroup_mounts(mountinfo) == [
        ("cgroup2", "/sys/fs/cgroup", "/", {"rw", "nsdelegate"}),
        ("cgroup", "/sys/fs/cgroup/memory", "/jobs", {"rw", "memory"})]


def test_where_the_cgroups_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Path] = []
    monkeypatch.setattr(cgroups, "_try_make", lambda parent: made.append(parent))
    v2, v1 = tmp_path / "unified", tmp_path / "memory"
    (v2 / "jobs" / "me").mkdir(parents=True)
    (v1 / "jobs" / "me").mkdir(parents=True)
    mounts = [("cgroup2", str(v2), "/", {"rw"}), ("cgroup", str(v1), "/", {"rw", "memory"})]
    own = {"": "/jobs/me", "memory": "/jobs/me"}
    # v2: a cgroup holding processes cannot give memory to children, so the parent is used,
    # and only when it enables memory for its children.
    (v2 / "jobs" / "cgroup.subtree_control").write_text("cpu\n")
    chosen = _choose(own, mounts)
    assert (chosen.mode, chosen.parent) == ("cgroup1", v1 / "jobs" / "me")  # v1 below our own
    assert "not enabled for the children" in chosen.reason
    (v2 / "jobs" / "cgroup.subtree_control").write_text("cpu memory\n")
    assert _choose(own, mounts) == cgroups.CgroupSupport(
        "cgroup2", v2 / "jobs", f"cgroup v2 below {v2 / 'jobs'}")
    # At the root (in its own cgroup namespace, say) the cgroups go below it.
    (v2 / "cgroup.subtree_control").write_text("memory\n")
    assert _choose({"": "/"}, mounts[:1]).parent == v2
    # Nothing usable: per-process limits, and the reason says why.
    monkeypatch.setattr(cgroups, "_try_make", lambda parent: f"cannot create a cgroup in {parent}")
    fallback = _choose(own, mounts)
    assert fallback.mode == "rlimit" and fallback.parent is None
    assert "cgroup v1: cannot create" in fallback.reason
    assert _choose({}, []).reason == "no cgroup hierarchy with a memory controller is mounted"
    assert made == [v1 / "jobs" / "me", v2 / "jobs", v2]
