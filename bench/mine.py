"""Tasks mined per minute, sandboxed, against the same mining with no isolation.

Mining runs a repository's pytest suite for every mutant it tries (twice for the ones its
tests catch), so its rate is bounded by test runs. The anchor is the same miner, same
modules, same seed, with the test runs made unsandboxed (``Sandbox(unsafe=True)``: limits
and timeout only), which is what running the mutants by hand would cost. The two runs
alternate ``--repeats`` times; each rate is the median of its runs.

    python bench/mine.py [--modules colorsys] [--tries 2] [--workers 2] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from tracerl.envs.mine import Miner, MineSettings, stdlib_repos
from tracerl.envs.sandbox import Sandbox, SandboxLimits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", nargs="+", default=["colorsys"])
    parser.add_argument("--tries", type=int, default=2, help="mutants tried per function")
    parser.add_argument("--workers", type=int, default=2, help="sandboxes run at once")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (median)")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    repos = stdlib_repos(args.modules)
    settings = MineSettings(test_command="python -m pytest -q", seed=0,
                            tries_per_function=args.tries, workers=args.workers,
                            name="stdlib")
    limits = SandboxLimits(wall_seconds=120.0, cpu_seconds=120)
    modes = {"unsandboxed": Sandbox(limits, unsafe=True), "sandbox": Sandbox(limits)}
    rates: dict[str, list[tuple[float, int, int]]] = {}
    for _ in range(args.repeats):
        for name, sandbox in modes.items():
            start = time.perf_counter()
            result = Miner(settings, sandbox).mine(repos)
            minutes = (time.perf_counter() - start) / 60
            tasks = len(result.train) + len(result.heldout)
            rates.setdefault(name, []).append((tasks / minutes, tasks, result.tests_run))
    print(f"mining {', '.join(args.modules)} (tries {args.tries} per function, seed 0), "
          f"workers={args.workers}, {os.cpu_count()} CPUs visible, load average "
          f"{os.getloadavg()[0]:.2f} (shared machines make these numbers noisy)")
    medians = {}
    for name, runs in rates.items():
        medians[name] = statistics.median(rate for rate, _, _ in runs)
        _, tasks, test_runs = runs[-1]
        print(f"  {name:12s}: {medians[name]:6.2f} tasks/minute ({tasks} tasks, "
              f"{test_runs} test runs)")
    print(f"sandbox / unsandboxed mining rate: {medians['sandbox'] / medians['unsandboxed']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
