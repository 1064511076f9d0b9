"""CPU utilisation of the collector during a run with sandboxed test runs.

Claim: with environment steps (bubblewrap-sandboxed test runs and verification) overlapping
batched generation, the collector keeps at least 80% of 2 CPU cores busy. The anchor, measured
in the same run, is what a user would otherwise write: one attempt at a time, each turn a
single-prompt generation followed by the environment step (the same collector with
``max_concurrent=1``, so both sides do identical work per attempt).

Utilisation = (user + system CPU seconds of this process and its waited-for children, i.e.
the sandboxes) / wall seconds / cores. The policy is the toy tiny model fitted to call
``run_tests`` and then ``submit`` (``rollout.toy_agent``), sampled greedily, so every attempt
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
from tracerl.rollout.collector import Collector, CollectorConfig
from tracerl.rollout.sampling import SamplingParams
from tracerl.rollout.toy_agent import toy_tool_policy

TOOLS = tuple(s for s in TOOL_SCHEMAS if s["function"]["name"] in ("run_tests", "submit"))


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have been waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(collector: Collector, tasks: list, group_size: int, cores: int) -> dict[str, float]:
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    result = collector.collect(tasks, group_size)
    wall = time.perf_counter() - wall0
    cpu = cpu_seconds() - cpu0
    return {
        "attempts": len(result.attempts),
        "wall_s": wall,
        "utilisation": cpu / wall / cores,
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
        **common, max_concurrent=args.tasks * args.group_size, env_workers=2 * args.cores))
    sequential = Collector(policy, make_env, config=CollectorConfig(
        **common, max_concurrent=1, env_workers=1))
    measure(concurrent, tasks[:2], 1, args.cores)  # warm-up: first sandbox and model calls
    seq = measure(sequential, tasks, args.group_size, args.cores)
    con = measure(concurrent, tasks, args.group_size, args.cores)
    for name, row in (("one attempt at a time", seq), ("tracerl collector", con)):
        print(f"{name:>22}: {row['attempts']:.0f} attempts in {row['wall_s']:.1f}s, "
              f"CPU utilisation {row['utilisation']:.0%} of {args.cores} cores, "
              f"{row['attempts_per_s']:.2f} attempts/s, {row['sampler_calls']:.0f} sampler "
              f"calls ({row['generation_s']:.1f}s inside generate), {row['terminated']:.0f} "
              f"terminated, tool {row['tool_s']:.1f}s")
    print(f"utilisation: {con['utilisation']:.0%} (target >= 80%), "
          f"{con['utilisation'] / seq['utilisation']:.2f}x the sequential loop's; "
          f"throughput {con['attempts_per_s'] / seq['attempts_per_s']:.2f}x")


if __name__ == "__main__":
    main()
