from __future__ import annotations

import shutil

import pytest

from tracerl.envs.sandbox import Sandbox, SandboxLimits

requires_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                    reason="bubblewrap is not installed")


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    return Sandbox(SandboxLimits(wall_seconds=5.0, cpu_seconds=5, memory_bytes=512 << 20,
                                 max_processes=32))
