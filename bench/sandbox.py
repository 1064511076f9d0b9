"""Sandboxed test runs per second on the built-in suite, against a bare subprocess.

Claim: at least 20 sandboxed visible-test runs per second on 2 cores. The anchor is what a
user would otherwise do: ``subprocess.run(test_command, shell=True, cwd=workspace)`` with no
isolation. Both run the same tasks' visible tests, in the same process, with the same number
of parallel workers; the two take turns pass by pass (``--repeats`` passes each), so a change
of load on a shared machine hits both alike, and each rate is the median of its passes.

    python bench/sandbox.py [--tasks 60] [--workers 2] [--repeats 3]
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

from tracerl.envs.sandbox import Sandbox
from tracerl.envs.suite import generate_split
from tracerl.envs.tasks import Task, write_files


def _prepare(tasks: list[Task], root: Path) -> list[tuple[Path, str]]:
    jobs = []
    for task in tasks:
        workspace = root / task.id
        workspace.mkdir()
        write_files(workspace, task.files)
        jobs.append((workspace, task.test_command))
    return jobs


def _rate(run_one: Callable[[tuple[Path, str]], int], jobs: list[tuple[Path, str]],
          workers: int) -> tuple[float, int]:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        codes = list(pool.map(run_one, jobs))
    elapsed = time.perf_counter() - start
    return len(jobs) / elapsed, sum(code != 0 for code in codes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=60, help="test runs per measurement")
    parser.add_argument("--workers", type=int, default=2, help="parallel runs")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each (median)")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")

    sandbox = Sandbox()
    tasks = generate_split("train", count=args.tasks)
    python_dir = str(Path(sys.executable).parent)
    bare_env = {"PATH": f"{python_dir}:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}

    def sandboxed(job: tuple[Path, str]) -> int:
        return sandbox.run(job[0], job[1]).exit_code

    def bare(job: tuple[Path, str]) -> int:
        return subprocess.run(job[1], shell=True, cwd=job[0], env=bare_env,
                              capture_output=True, check=False).returncode

    with tempfile.TemporaryDirectory() as tmp:
        jobs = _prepare(tasks, Path(tmp))
        _rate(sandboxed, jobs[:4], 1)  # warm the page cache for both
        _rate(bare, jobs[:4], 1)
        passes: dict[tuple[str, int], list[tuple[float, int]]] = {}
        for _ in range(args.repeats):
            for name, runner in (("bare subprocess", bare), ("sandbox", sandboxed)):
                for workers in sorted({1, args.workers}):
                    passes.setdefault((name, workers), []).append(_rate(runner, jobs, workers))
        results = {key: (statistics.median(rate for rate, _ in runs), runs[-1][1])
                   for key, runs in passes.items()}

    print(f"{len(tasks)} visible-test runs of the built-in train split, median of "
          f"{args.repeats} passes each, {os.cpu_count()} CPUs visible, load average "
          f"{os.getloadavg()[0]:.2f} (shared machines make these numbers noisy)")
    for (name, workers), (rate, failed) in results.items():
        print(f"  {name:16s} workers={workers}: {rate:6.1f} runs/s  "
              f"({1000 / rate * workers:5.1f} ms per run, {failed} failing as expected)")
    sandbox_rate = results[("sandbox", args.workers)][0]
    bare_rate = results[("bare subprocess", args.workers)][0]
    print(f"sandbox / bare throughput at workers={args.workers}: {sandbox_rate / bare_rate:.2f}x "
          f"(overhead {1000 / sandbox_rate - 1000 / bare_rate:+.1f} ms per run of wall time)")
    target = 20.0
    print(f"target >= {target:.0f} sandboxed runs/s: "
          f"{'met' if sandbox_rate >= target else 'NOT met'} ({sandbox_rate:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
