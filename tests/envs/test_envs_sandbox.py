"""The sandbox's contract: results, limits, output capping, refusal without bubblewrap."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tracerl.envs import sandbox as sandbox_module
from tracerl.envs.sandbox import Sandbox, SandboxLimits, SandboxUnavailableError


def test_runs_python_of_the_host_interpreter_in_the_workspace(sandbox: Sandbox,
                                                              tmp_path: Path) -> None:
    (tmp_path / "hello.py").write_text("import sys\nprint('hi', sys.version_info[:2])\n")
    result = sandbox.run(tmp_path, "python hello.py && pwd")
    assert result.exit_code == 0, result.stderr
    import sys
    assert f"hi {tuple(sys.version_info[:2])}" in result.stdout
    assert "/workspace" in result.stdout
    assert not result.timed_out and result.killed_reason is None
    assert set(result.to_dict()) == {"exit_code", "stdout", "stderr", "seconds", "timed_out"}


def test_workspace_writes_come_back_and_exit_codes_pass_through(sandbox: Sandbox,
                                                                tmp_path: Path) -> None:
    result = sandbox.run(tmp_path, "echo made > out.txt; echo oops >&2; exit 3")
    assert result.exit_code == 3
    assert result.stderr.strip() == "oops"
    assert (tmp_path / "out.txt").read_text() == "made\n"


def test_file_size_limit_and_output_cap(tmp_path: Path) -> None:
    sandbox = Sandbox(SandboxLimits(file_size_bytes=1 << 20, output_chars=1000))
    big = sandbox.run(tmp_path, "head -c 5000000 /dev/zero > big")
    assert big.killed_reason == "file_size"
    assert (tmp_path / "big").stat().st_size <= 1 << 20
    chatty = sandbox.run(tmp_path, ["python", "-c", "print('x' * 100000)"])
    assert chatty.stdout.endswith("[output truncated]")
    assert len(chatty.stdout) < 1100


def test_environment_is_clean(sandbox: Sandbox, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACERL_SECRET_TOKEN", "leak-me")
    result = sandbox.run(tmp_path, "env", env={"EXTRA": "1"})
    assert "leak-me" not in result.stdout
    assert "EXTRA=1" in result.stdout


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="wall_seconds"):
        SandboxLimits(wall_seconds=0)
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits(max_processes=-1)


def test_refuses_loudly_without_bubblewrap(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    real_which = shutil.which
    monkeypatch.setattr(sandbox_module.shutil, "which",
                        lambda name: None if name == "bwrap" else real_which(name))
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
        Sandbox()
    unsafe = Sandbox(SandboxLimits(wall_seconds=5), unsafe=True)
    assert not unsafe.isolated
    (tmp_path / "a.py").write_text("print(6 * 7)\n")
    result = unsafe.run(tmp_path, "python a.py")
    assert result.exit_code == 0 and result.stdout.strip() == "42"
    slow = Sandbox(SandboxLimits(wall_seconds=0.5), unsafe=True).run(tmp_path, "sleep 30")
    assert slow.timed_out and slow.killed_reason == "timeout"


def test_bad_workspace_is_a_value_error(sandbox: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="workspace"):
        sandbox.run(tmp_path / "missing", "true")
    with pytest.raises(ValueError, match="command"):
        sandbox.run(tmp_path, [])
