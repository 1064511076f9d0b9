"""Sandboxed test runs per second on repository tasks, against the same runs unsandboxed.

Repository tasks run a real project's test suite (here: pytest on standard-library modules
with their own test files, the repositories of the built-in mined set), so a run costs far
more than a built-in task's script. The anchor is what a user would otherwise do: the same
``python -m pytest`` command with ``subprocess.run`` in the same workspace, no isolation.
Both take turns pass by pass (``--repeats`` passes each, same workers) and each rate is the
median of its passes, so a change of load on a shared machine hits both alike.

    python bench/repo_tasks.py [--modules colorsys getopt graphlib] [--workers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tracerl.envs.mine import STDLIB_MODULES, stdlib_repos
from tracerl.envs.sandbox import Sandbox, SandboxLimits
from tracerl.envs.tasks import write_files

COMMAND = "python -m pytest -q -p no:cacheprovider"


def _rate(run_one: Callable[[Path], int], jobs: list[Path], workers: int) -> tuple[float, int]:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        codes = list(pool.map(run_one, jobs))
    return len(jobs) / (time.perf_counter() - start), sum(code != 0 for code in codes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", nargs="+", default=list(STDLIB_MODULES[:4]))
    parser.add_argument("--runs", type=int, default=2, help="runs of each module per pass")
    parser.add_argument("--workers", type=int, default=2, help="parallel runs")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each (median)")
    args = parser.parse_args()
    if args.repeats < 1 or args.runs < 1:
        raise SystemExit("--repeats and --runs must be >= 1")
    sandbox = Sandbox(SandboxLimits(wall_seconds=120.0, cpu_seconds=120))
    bare_env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                "PYTHONDONTWRITEBYTECODE": "1", "HOME": tempfile.gettempdir()}

    def sandboxed(workspace: Path) -> int:
        return sandbox.run(workspace, COMMAND).exit_code

    def bare(workspace: Path) -> int:
        return subprocess.run(COMMAND, shell=True, cwd=workspace, env=bare_env,
                              capture_output=True, check=False).returncode

    with tempfile.TemporaryDirectory() as tmp:
        jobs: list[Path] = []
        for name, files in stdlib_repos(args.modules).items():
            workspace = Path(tmp) / name
            workspace.mkdir()
            write_files(workspace, files)
            jobs += [workspace] * args.runs
        _rate(sandboxed, jobs[:1], 1)  # warm the page cache for both
        _rate(bare, jobs[:1], 1)
        passes: dict[str, list[tuple[float, int]]] = {}
        for _ in range(args.repeats):
            for name, runner in (("bare subprocess", bare), ("sandbox", sandboxed)):
                passes.setdefault(name, []).append(_rate(runner, jobs, args.workers))
    results = {name: (statistics.median(r for r, _ in runs), runs[-1][1])
               for name, runs in passes.items()}
    print(f"{len(jobs)} pytest runs of {', '.join(args.modules)} per pass, workers="
          f"{args.workers}, median of {args.repeats} passes, {os.cpu_count()} CPUs visible, "
          f"load average {os.getloadavg()[0]:.2f} (shared machines make these numbers noisy)")
    for name, (rate, failed) in results.items():
        print(f"  {name:16s}: {rate:6.2f} runs/s ({1000 * args.workers / rate:6.0f} ms per run, "
              f"{failed} failed)")
    ratio = results["sandbox"][0] / results["bare subprocess"][0]
    print(f"sandbox / bare throughput: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
