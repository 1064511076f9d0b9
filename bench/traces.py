"""Trace store speed and size: write and read N attempts of T tokens.

Claim: >= 5 M tokens/s written and >= 20 M tokens/s read on 2 cores, at <= 12 bytes per token
including behavior logprobs. Anchor, measured in the same run: JSON lines with a per-record
checksum (the other format the design considered, and what most RL loggers write).

Each rate is given twice: per wall-clock second, and per CPU second of this process (all its
threads). On a machine shared with other work, wall time includes waiting for a core; CPU time
is what the store itself costs. The headline read is ``read_attempts``: every attempt rebuilt
as records whose segments hold their role, token ids and logprobs. ``read_token_batches`` is
the columnar path for trainers (flat arrays and offsets, no records).

    python bench/traces.py                 # 10,000 attempts x 2,000 tokens
    python bench/traces.py --attempts 1000 # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from tracerl.trace import (
    SEGMENTS_DIR,
    Attempt,
    Role,
    TraceStore,
    read_attempts,
    read_table,
    read_token_batches,
)
from tracerl.trace.synthetic import synthetic_attempt


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name != "LOCK")


class Clock:
    """Wall and process-CPU seconds of a block."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def timed_write(path: Path, attempts: list[Attempt], fsync: bool, batch: int,
                compression: str = "lz4") -> Clock:
    # Timed until close returns: every segment sealed, nothing left in the background.
    with Clock() as clock, TraceStore(path, fsync=fsync, seal_every=1000,
                                      compression=compression) as store:  # type: ignore[arg-type]
        for i in range(0, len(attempts), batch):
            store.append_many(attempts[i : i + batch])
    return clock


def jsonl_write(path: Path, attempts: list[Attempt]) -> float:
    # The anchor: one JSON object per line with a crc32 of its body, flushed per attempt.
    start = time.perf_counter()
    with open(path, "w") as f:
        for a in attempts:
            body = json.dumps({
                "attempt_id": a.attempt_id, "task_id": a.task_id, "group_id": a.group_id,
                "reward": a.reward, "end": a.end_reason.value,
                "segments": [
                    {"role": s.role.value, "token_ids": s.token_ids.tolist(),
                     "logprobs": None if s.logprobs is None else s.logprobs.tolist()}
                    for fr in a.fragments for t in fr.turns for s in t.segments
                ],
            })
            f.write(f"{zlib.crc32(body.encode()):08x} {body}\n")
            f.flush()
    return time.perf_counter() - start


def jsonl_read(path: Path) -> float:
    start = time.perf_counter()
    with open(path) as f:
        for line in f:
            crc, body = line.rstrip("\n").split(" ", 1)
            assert int(crc, 16) == zlib.crc32(body.encode())
            record = json.loads(body)
            for seg in record["segments"]:
                np.asarray(seg["token_ids"], dtype=np.int32)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=2_000)
    parser.add_argument("--anchor-attempts", type=int, default=1_000,
                        help="attempts for the JSON-lines anchor (rates are per token)")
    args = parser.parse_args()
    print("command: " + " ".join([os.path.basename(sys.executable), *sys.argv]))
    print(f"cpus: {os.cpu_count()}, load average: {os.getloadavg()[0]:.2f} "
          "(a shared machine: numbers are noisy)")

    rng = np.random.default_rng(0)
    attempts = [
        synthetic_attempt(rng, f"a{i}", task_id=f"t{i // 8}", group_id=f"t{i // 8}",
                          total_tokens=args.tokens, turns=10, reward=float(i % 2))
        for i in range(args.attempts)
    ]
    tokens = sum(len(s.token_ids) for a in attempts for f in a.fragments for t in f.turns
                 for s in t.segments)
    actions = sum(len(s.token_ids) for a in attempts for f in a.fragments for t in f.turns
                  for s in t.segments if s.role is Role.ACTION)
    print(f"{args.attempts} attempts, {tokens / 1e6:.1f} M tokens "
          f"({actions / tokens:.0%} actions, each with a float32 behavior logprob)")

    root = Path(tempfile.mkdtemp(prefix="tracerl-bench-"))
    try:
        # Warm imports and caches so the first timed run does not pay for them.
        timed_write(root / "warm", attempts[:50], fsync=False, batch=1)
        read_attempts(root / "warm")

        rows: list[tuple[str, float, float]] = []
        for label, fsync, batch in (
            ("append, written to OS (survives kill -9)", False, 1),
            ("append, fsync each (survives power loss)", True, 1),
            ("append_many(64), fsync each call", True, 64),
        ):
            path = root / label.split(",")[0].replace(" ", "_") / str(fsync) / str(batch)
            clock = timed_write(path, attempts, fsync=fsync, batch=batch)
            rows.append((f"write: {label}", tokens / clock.wall, tokens / clock.cpu))
            if not fsync:
                shutil.rmtree(path)  # keep the disk footprint of the bench small
        store = path
        size = directory_bytes(store)
        zstd = root / "zstd"
        clock = timed_write(zstd, attempts, fsync=False, batch=1, compression="zstd")
        rows.append(("write: append, zstd segments", tokens / clock.wall, tokens / clock.cpu))
        zstd_size = directory_bytes(zstd)

        with Clock() as clock:
            loaded = read_attempts(store)
        rows.append(("read: Attempt records (read_attempts)", tokens / clock.wall,
                     tokens / clock.cpu))
        assert len(loaded) == len(attempts) and loaded[-1] == attempts[-1]
        with Clock() as clock:
            read_attempts(zstd)
        rows.append(("read: Attempt records, zstd segments", tokens / clock.wall,
                     tokens / clock.cpu))
        with Clock() as clock:
            batches = list(read_token_batches(store))
        rows.append(("read: token batches (read_token_batches)", tokens / clock.wall,
                     tokens / clock.cpu))
        assert sum(len(b) for b in batches) == len(attempts)
        with Clock() as clock:
            table = read_table(store)
        rows.append(("read: Arrow table, all columns (read_table)", tokens / clock.wall,
                     tokens / clock.cpu))
        with Clock() as clock:
            raw = pq.read_table(store / SEGMENTS_DIR, columns=["token_ids", "action_logprobs"])
        rows.append(("read: pyarrow, token + logprob columns", tokens / clock.wall,
                     tokens / clock.cpu))
        assert table.num_rows == raw.num_rows == len(attempts)

        anchor = attempts[: args.anchor_attempts]
        anchor_tokens = sum(len(s.token_ids) for a in anchor for f in a.fragments
                            for t in f.turns for s in t.segments)
        jsonl = root / "anchor.jsonl"
        with Clock() as clock:
            jsonl_write(jsonl, anchor)
        anchor_write = (anchor_tokens / clock.wall, anchor_tokens / clock.cpu)
        with Clock() as clock:
            jsonl_read(jsonl)
        anchor_read = (anchor_tokens / clock.wall, anchor_tokens / clock.cpu)
        anchor_bytes = jsonl.stat().st_size / anchor_tokens
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'M tokens/s':>60s} {'x JSONL':>8s}  {'M tokens/CPU-s':>15s} {'x JSONL':>8s}")
    for label, wall, cpu in rows:
        base = anchor_write if label.startswith("write") else anchor_read
        print(f"{label:48s} {wall / 1e6:11.2f} {wall / base[0]:8.1f}  {cpu / 1e6:15.2f} "
              f"{cpu / base[1]:8.1f}")
    for label, rate in (("write", anchor_write), ("read", anchor_read)):
        print(f"{'anchor: JSON lines + crc32, ' + label:48s} {rate[0] / 1e6:11.2f} {'':8s}  "
              f"{rate[1] / 1e6:15.2f}")
    per_token = size / tokens
    raw_ids = 4.0
    raw_with_logprobs = 4.0 + 4.0 * actions / tokens
    print(f"\nbytes per token: {per_token:.2f} on disk (sealed Parquet, lz4; zstd: "
          f"{zstd_size / tokens:.2f}), "
          f"{per_token / raw_ids:.2f}x raw int32 ids ({raw_ids:.0f} B), "
          f"{per_token / raw_with_logprobs:.2f}x raw ids + float32 logprobs "
          f"({raw_with_logprobs:.1f} B); JSON lines: {anchor_bytes:.1f} B")
    print("targets: write >= 5 M tokens/s, read >= 20 M tokens/s, <= 12 bytes per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
