"""CPU utilisation of the collector during a run with sandboxed test runs.

Claim: with environment steps (bubblewrap-sandboxed test runs and verification) overlapping
batched generation, the collector keeps at least 80% of 2 CPU cores busy. The anchor, measured
in the same run, is what a user would otherwise write: one attempt at a time, each turn a
single-prompt generation followed by the environment step (the same collector with
``max_concurrent=1``, so both sides do identical work per attempt).

Utilisation is the share of the machine's cores that were busy during the run, read from
``/proc/stat`` (busy = all but idle and iowait time, summed over the cores): it counts the
sandboxed commands, which the process's own accounting cannot: under bubblewrap the test
process is a child of the sandbox's namespace init, is reaped there, and its CPU time never
reaches this process's ``RUSAGE_CHILDREN``. Run it on an otherwise idle machine (everything
running counts). The process-tree figure (this process plus waited-for children: the model,
the event loop, bubblewrap itself) is printed beside it. The policy is the toy tiny model fitted to call
``run_tests`` and then ``submit`` (``testing.toy_agent``), sampled greedily, so every attempt
runs the visible tests once and the verifier twice (hidden and visible tests).

Run: ``python bench/collector.py`` (``--help`` for sizes). Needs bubblewrap.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from tracerl.envs import TOOL_SCHEMAS, CodingEnv, Sandbox
from tracerl.envs.suite import generate_split
from tracerl.models.tiny import render_tool_call
from tracerl.rollout.collect.collector import Collector, CollectorConfig
from tracerl.rollout.policies.sampling import SamplingParams
from tracerl.testing.toy_agent import toy_tool_policy

TOOLS = tuple(s for s in TOOL_SCHEMAS if s["function"]["name"] in ("run_tests", "submit"))


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have been waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies over all cores since boot, from ``/proc/stat``."""
    with open("/proc/stat", encoding="ascii") as handle:
        fields = [float(x) for x in handle.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    return total - idle, total


def measure(collector: Collector, tasks: list, group_size: int, cores: int) -> dict[str, float]:
    busy0, total0 = machine_busy()
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    result = collector.collect(tasks, group_size)
    wall = time.perf_counter() - wall0
    cpu = cpu_seconds() - cpu0
    busy1, total1 = machine_busy()
    return {
        "attempts": len(result.attempts),
        "wall_s": wall,
        "utilisation": (busy1 - busy0) / max(total1 - total0, 1.0),
        "process_utilisation": cpu / wall / cores,
        "attempts_per_s": len(result.attempts) / wall,
        "tool_s": result.tool_seconds,
        "sampler_calls": result.sampler_calls,
        "generation_s": result.generation_seconds,
        "terminated": result.endings["terminated"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--fit-steps", type=int, default=100)
    parser.add_argument("--env-workers", type=int, default=None,
                        help="threads running environment steps (default: 2 per core)")
    parser.add_argument("--max-batch", type=int, default=32, help="most prompts per sampler call")
    args = parser.parse_args()
    torch.set_num_threads(args.cores)
    tasks = generate_split("train", seed=0, count=args.tasks)
    sandbox = Sandbox()
    env = CodingEnv(tasks, sandbox=sandbox)
    first, outputs = [], []
    for task in tasks:  # what the policy will read: the statement, then the real test output
        first.append(env.reset(options={"task_id": task.id})[0])
        outputs.append(env.step(render_tool_call("run_tests", {}))[0])
    env.close()
    policy = toy_tool_policy(first, tools=TOOLS, steps=args.fit_steps, test_outputs=outputs)

    def make_env() -> CodingEnv:
        return CodingEnv(tasks, sandbox=sandbox, max_turns=4)

    sampling = SamplingParams(temperature=0.0, max_new_tokens=40)
    common = dict(sampling=sampling, tools=TOOLS, max_turns=4, handle_signals=False)
    concurrent = Collector(policy, make_env, config=CollectorConfig(
        **common, max_concurrent=args.tasks * args.group_size, max_batch_size=args.max_batch,
        env_workers=args.env_workers or 2 * args.cores))
    sequential = Collector(policy, make_env, config=CollectorConfig(
        **common, max_concurrent=1, env_workers=1))
    busy0, total0 = machine_busy()
    time.sleep(2.0)
    busy1, total1 = machine_busy()
    print(f"before the runs, 2 s of sleep: cores busy {(busy1 - busy0) / (total1 - total0):.0%} "
          "(other work on the machine; it counts in the figures below)")
    measure(concurrent, tasks[:2], 1, args.cores)  # warm-up: first sandbox and model calls
    seq = measure(sequential, tasks, args.group_size, args.cores)
    con = measure(concurrent, tasks, args.group_size, args.cores)
    for name, row in (("one attempt at a time", seq), ("tracerl collector", con)):
        print(f"{name:>22}: {row['attempts']:.0f} attempts in {row['wall_s']:.1f}s, "
              f"cores busy {row['utilisation']:.0%} (process tree "
              f"{row['process_utilisation']:.0%} of {args.cores}), "
              f"{row['attempts_per_s']:.2f} attempts/s, {row['sampler_calls']:.0f} sampler "
              f"calls ({row['generation_s']:.1f}s inside generate), {row['terminated']:.0f} "
              f"terminated, tool {row['tool_s']:.1f}s")
    print(f"utilisation: {con['utilisation']:.0%} (target >= 80%), "
          f"{con['utilisation'] / seq['utilisation']:.2f}x the sequential loop's; "
          f"throughput {con['attempts_per_s'] / seq['attempts_per_s']:.2f}x")


if __name__ == "__main__":
    main()
