"""Throughput of ``tracerl.batch_gae`` against what a user would otherwise run.

Compared in one run, on float32 [B, T] batches with agent-like action masks (a prompt, then
alternating action and tool-output spans, then padding), each contender timed the same
``--repeats`` times (after one warm-up call each), the contenders taking turns call by call so
a change of load on a shared machine hits all of them alike; every rate and ratio is of
medians, and each median is printed with the min-max of its calls:

* ``batch_gae`` writing into reused ``out=`` tensors (what a training loop does),
* the plain per-step loop (``batch_gae_reference``, the usual ``for t in reversed(range(T))``),
* verl's ``compute_gae_advantage_return`` when verl is importable (``make bench-gae`` runs this
  script in a separate environment that has it); verl whitens its advantages, so its
  ``returns - values`` is what is compared,
* the memory-bound floor: the bytes batch_gae must read and write divided by a copy bandwidth
  measured here.

Usage: ``python bench/gae.py [--threads 1] [--repeats 9] [--gamma 0.99 --trace-decay 0.95]
[--block-sweep 15,17,19,21]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tracerl import batch_gae, batch_gae_reference

SHAPES = ((256, 4096), (64, 16384))


def agent_like_mask(rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Prompt, then alternating action / observation spans of random length, then padding."""
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for b in range(rows):
        position = int(torch.randint(16, 256, (1,), generator=generator))
        end = length - int(torch.randint(0, length // 8, (1,), generator=generator))
        acting = True
        while position < end:
            span = int(torch.randint(8, 200, (1,), generator=generator))
            if acting:
                mask[b, position : min(position + span, end)] = True
            position += span
            acting = not acting
    return mask


def make_batch(rows: int, length: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * length)
    mask = agent_like_mask(rows, length, generator)
    rewards = torch.randn(rows, length, generator=generator) * 0.1 * mask
    values = torch.randn(rows, length, generator=generator)
    return {"rewards": rewards, "values": values, "mask": mask, "bootstrap": torch.zeros(rows)}


@dataclass
class Timing:
    """Wall seconds of each timed call of one contender."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def text(self) -> str:
        """``median ms [min-max]``."""
        return (f"median {self.median * 1e3:8.2f} ms [{min(self.samples) * 1e3:.2f}-"
                f"{max(self.samples) * 1e3:.2f}]")


def timed_together(functions: dict[str, Callable[[], object]], repeats: int) -> dict[str, Timing]:
    """``repeats`` timed calls of each function after one warm-up call each, taking turns."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for function in functions.values():
        function()
    timings = {name: Timing() for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            timings[name].samples.append(time.perf_counter() - start)
    return timings


def copy_bandwidth(repeats: int) -> float:
    """Bytes moved per second (read + write) by a large tensor copy (median of ``repeats``)."""
    source = torch.randn(64 * 1024 * 1024 // 4)
    target = torch.empty_like(source)
    seconds = timed_together({"copy": lambda: target.copy_(source)}, repeats)["copy"].median
    return 2 * source.numel() * source.element_size() / seconds


def load_verl() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    try:
        from verl.trainer.ppo.core_algos import compute_gae_advantage_return
    except Exception:  # verl absent or its import chain broken: report and go on without it
        return None
    return compute_gae_advantage_return  # type: ignore[no-any-return]


def measure_shape(
    rows: int,
    length: int,
    args: argparse.Namespace,
    bandwidth: float,
    verl_gae: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None,
) -> None:
    """Time one shape and print its lines."""
    batch = make_batch(rows, length)
    tokens = rows * length
    r, v, m, boot = batch["rewards"], batch["values"], batch["mask"], batch["bootstrap"]
    gamma, trace_decay = args.gamma, args.trace_decay
    outputs = (torch.empty_like(r), torch.empty_like(r))
    maskf = m.float()
    contenders: dict[str, Callable[[], object]] = {
        "batch_gae": lambda: batch_gae(r, v, m, boot, gamma, trace_decay),
        "batch_gae, out=": lambda: batch_gae(r, v, m, boot, gamma, trace_decay, out=outputs),
        "per-step loop": lambda: batch_gae_reference(r, v, m, boot, gamma, trace_decay),
    }
    if verl_gae is not None:
        contenders["verl"] = lambda: verl_gae(r, v, maskf, gamma, trace_decay)
    timings = timed_together(contenders, args.repeats)
    ours, reused = timings["batch_gae"].median, timings["batch_gae, out="].median
    # Reads rewards, values (4 B each) and the mask (1 B); writes advantages and returns.
    floor = (4 + 4 + 1 + 4 + 4) * tokens / bandwidth
    print(f"\n[{rows}, {length}]  ({m.float().mean():.0%} action tokens; {args.repeats} timed "
          f"calls each)")
    for name, timing in timings.items():
        line = f"  {name:<16} {tokens / timing.median / 1e6:8.1f} M tokens/s  ({timing.text()})"
        if name in ("per-step loop", "verl"):
            line += (f"  -> batch_gae is {timing.median / ours:5.1f}x faster "
                     f"({timing.median / reused:.1f}x with out=)")
        print(line)
    print(
        f"  memory floor     {tokens / floor / 1e6:8.1f} M tokens/s  "
        f"-> batch_gae takes {ours / floor:6.1f}x the floor"
    )
    if verl_gae is not None:
        _, verl_returns = verl_gae(r, v, maskf, gamma, trace_decay)
        advantages, _ = batch_gae(r, v, m, boot, gamma, trace_decay)
        difference = float(((verl_returns - v) * maskf - advantages).abs().max())
        print(f"  verl agrees: max |(returns - values) - batch_gae advantages| = {difference:.1e}")


def block_sweep(exponents: list[int], repeats: int) -> None:
    """Tokens/s of batch_gae at each time block of 2^e tokens (the kernel's one tuning knob;
    the default is ``tracerl.core._gae_kernel.BLOCK_ELEMENTS``)."""
    from tracerl.core import _gae_kernel

    default = _gae_kernel.BLOCK_ELEMENTS
    print(f"\ntime block sweep (default 2^{default.bit_length() - 1} tokens)")
    try:
        for rows, length in SHAPES:
            batch = make_batch(rows, length)
            inputs = (batch["rewards"], batch["values"], batch["mask"], batch["bootstrap"])
            call = lambda: batch_gae(*inputs, 0.99, 0.95)  # noqa: E731, B023 (called at once)
            for exponent in exponents:
                _gae_kernel.BLOCK_ELEMENTS = 1 << exponent
                median = timed_together({"gae": call}, repeats)["gae"].median
                print(f"  [{rows}, {length}] block 2^{exponent:<2}  "
                      f"{rows * length / median / 1e6:8.1f} M tokens/s (median of {repeats})")
    finally:
        _gae_kernel.BLOCK_ELEMENTS = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=9,
                        help="timed calls of every contender (medians are compared)")
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--trace-decay", type=float, default=0.95)
    parser.add_argument("--block-sweep", default="", metavar="E,E,...",
                        help="also time batch_gae with time blocks of 2^E tokens, e.g. 15,17,19,21")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    torch.set_num_threads(args.threads)
    bandwidth = copy_bandwidth(args.repeats)
    verl_gae = load_verl()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, "
        f"gamma={args.gamma} trace_decay={args.trace_decay}"
    )
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write); {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")
    if verl_gae is None:
        print("verl: not importable here (run `make bench-gae` for the comparison)")
    for rows, length in SHAPES:
        measure_shape(rows, length, args, bandwidth, verl_gae)
    if args.block_sweep:
        block_sweep([int(e) for e in args.block_sweep.split(",")], args.repeats)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
