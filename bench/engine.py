"""The vLLM rollout engine against the local sampler: seconds per weight sync, and generated
tokens per second on the same prompts.

Claim: the cost of training through vLLM is the sync, and it is small next to collection; the
anchor, measured in the same run, is what a run uses without vLLM: the local sampler
(``HFPolicy``) on the same prompts with the same sampling settings.

For each model size (the demo's tiny model, and one of about 100M parameters) it starts a vLLM
server on the model (``rollout.vllm.VllmEngine``, as a training run does), then

- syncs full weights ``--syncs`` times (each a new version: written, loaded with
  ``reload_weights``, verified by the probe) and reports the median seconds of each part;
- samples ``--prompts`` prompts of ``--prompt-tokens`` token ids, ``--new-tokens`` tokens each
  at temperature 1, once through the server and once through ``HFPolicy`` (batched, all
  prompts at once), and reports generated tokens per second of each;
- starts a second server on the same model as the base of a LoRA adapter (``--lora-rank``,
  ``alpha = 2 * rank``, on the attention projections: ``model.lora``'s defaults) and syncs
  the adapter ``--syncs`` times, each a new version (``VllmEngine.sync`` of the peft-wrapped
  policy, as a ``model.lora`` training run does: saved in PEFT's layout, loaded with
  ``/v1/load_lora_adapter``, the previous version unloaded, verified by the probe).

Run: ``python bench/engine.py --python .engine-venv/bin/python`` (``make engine-env`` builds
that environment; the server runs in it, this script in any environment with tracerl). Both
sides share the machine's cores: run it on an otherwise idle machine.

On a GPU, with vLLM's GPU build in ``--python``'s environment: ``--sizes 0.5B --device cuda
--server-args="--gpu-memory-utilization 0.5"`` (the trainer's copy and the local sampler on
the card too, the server leaving them room).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tracerl.models.lora import LoraSettings, adapter_parameters, apply_lora
from tracerl.models.tiny import (
    TinyModelConfig,
    build_tiny_model,
    count_parameters,
    save_tiny,
    train_tokenizer,
)
from tracerl.models.words import WORDS
from tracerl.rollout import HFPolicy, SamplingParams
from tracerl.rollout.vllm import VllmConfig, VllmEngine

SIZES: dict[str, tuple[int, TinyModelConfig]] = {
    "demo": (3072, TinyModelConfig(hidden_size=128, num_layers=3, num_heads=4,
                                   intermediate_size=320, max_positions=1024)),
    "100M": (8192, TinyModelConfig(hidden_size=768, num_layers=12, num_heads=12,
                                   intermediate_size=2048, max_positions=1024)),
    "0.5B": (8192, TinyModelConfig(hidden_size=1024, num_layers=24, num_heads=16,
                                   intermediate_size=4864, max_positions=1024)),
}
"""(vocabulary, shape) of each size: the demo's model (configs/demo.yaml), ~100M, and ~0.5B
(for a GPU; not in the default ``--sizes``)."""
CPU_SIZES = ["demo", "100M"]

CORPUS = ["def add(a, b):\n    return a + b\n", "Fix the bug in the function.",
          "run_tests submit replace open_file"] * 20


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""``model.lora.target_modules``' default: the attention projections."""


def medians(parts: dict[str, list[float]], prefix: str) -> dict[str, float]:
    """The median of each part's seconds, keyed ``{prefix}{part}_median``."""
    return {f"{prefix}{key}_median": statistics.median(values) for key, values in parts.items()}


def measure_lora(model: Any, tokenizer: Any, python: str, shape: TinyModelConfig,
                 args: argparse.Namespace, root: Path) -> dict[str, float]:
    """A server on ``model`` as a LoRA base, and ``args.syncs`` adapter versions synced into
    it; the median seconds of each part, keyed ``lora_...``."""
    base = save_tiny(model, tokenizer, root / "base")
    policy = apply_lora(copy.deepcopy(model),
                        LoraSettings(rank=args.lora_rank, alpha=2.0 * args.lora_rank,
                                     target_modules=LORA_TARGETS),
                        base_name=str(base.resolve()), seed=0)
    engine = VllmEngine(VllmConfig(python=python, max_model_len=shape.max_positions,
                                   extra_args=args.server_args),
                        root / "run", tokenizer, seed=0)
    generator = torch.Generator().manual_seed(1)
    started = time.perf_counter()
    try:
        engine.start(policy, 0)
        start_seconds = time.perf_counter() - started
        parts: dict[str, list[float]] = {}
        for version in range(1, args.syncs + 1):
            with torch.no_grad():  # what an update does: every adapter weight moves
                for _, parameter in adapter_parameters(policy):
                    parameter.add_(1e-2 * torch.randn(parameter.shape, generator=generator)
                                   .to(parameter.device))
            for key, value in engine.sync(policy, version).items():
                parts.setdefault(key, []).append(value)
    finally:
        engine.close()
    adapter = sum(p.numel() for _, p in adapter_parameters(policy))
    return {"lora_server_start_seconds": start_seconds, "lora_parameters": float(adapter),
            **medians(parts, "lora_")}


def measure(name: str, python: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    vocab, shape = SIZES[name]
    tokenizer = train_tokenizer(CORPUS, vocab_size=vocab, words=WORDS)
    model = build_tiny_model(tokenizer, shape, seed=0).to(args.device)
    lora = (measure_lora(model, tokenizer, python, shape, args, root / f"{name}-lora")
            if args.lora_rank > 0 else {})
    engine = VllmEngine(VllmConfig(python=python, max_model_len=shape.max_positions,
                                   extra_args=args.server_args),
                        root / name, tokenizer, seed=0)
    started = time.perf_counter()
    try:
        engine.start(model, 0)
        start_seconds = time.perf_counter() - started
        parts: dict[str, list[float]] = {}
        current = model
        for version in range(1, args.syncs + 1):
            current = copy.deepcopy(current)
            with torch.no_grad():
                for parameter in current.parameters():
                    parameter.mul_(1.0 + 1e-3)
            for key, value in engine.sync(current, version).items():
                parts.setdefault(key, []).append(value)
        generator = torch.Generator().manual_seed(0)
        prompts = [[int(t) for t in torch.randint(3, int(model.config.vocab_size),
                                                  (args.prompt_tokens,), generator=generator)]
                   for _ in range(args.prompts)]
        params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0,
                                stop_token_ids=())
        assert engine.policy is not None
        engine.policy.generate(prompts[:1], params)  # warm-up
        t0 = time.perf_counter()
        served = engine.policy.generate(prompts, params)
        served_seconds = time.perf_counter() - t0
    finally:
        engine.close()
    local = HFPolicy(current, tokenizer, max_batch_size=args.prompts)
    local.generate(prompts[:1], params)  # warm-up
    t0 = time.perf_counter()
    sampled = local.generate(prompts, params)
    local_seconds = time.perf_counter() - t0
    served_tokens = sum(len(c.token_ids) for c in served)
    local_tokens = sum(len(c.token_ids) for c in sampled)
    return {
        "model": name, "parameters": count_parameters(model),
        "server_start_seconds": start_seconds, **medians(parts, ""), **lora,
        "vllm_tokens_per_second": served_tokens / served_seconds,
        "local_tokens_per_second": local_tokens / local_seconds,
        "vllm_over_local": (served_tokens / served_seconds) / (local_tokens / local_seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=".engine-venv/bin/python",
                        help="the interpreter with vLLM (runs the server)")
    parser.add_argument("--sizes", nargs="+", default=CPU_SIZES, choices=list(SIZES))
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lora-rank", type=int, default=8,
                        help="rank of the LoRA adapter whose syncs are measured (0: none)")
    parser.add_argument("--device", default="cpu",
                        help="where the trainer's copy of the model and the local sampler run")
    parser.add_argument("--server-args", default="",
                        help="more vLLM server flags (vllm.extra_args)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of this process (the local sampler)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.sizes:
            rows.append(measure(name, args.python, args, Path(root)))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| model | parameters | full sync s (write + load + verify) | LoRA sync s "
          "(write + load + verify) | vLLM tok/s | local tok/s | vLLM / local |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['parameters'] / 1e6:.1f}M | {sync_cell(row, '')} | "
              f"{sync_cell(row, 'lora_')} | {row['vllm_tokens_per_second']:.0f} | "
              f"{row['local_tokens_per_second']:.0f} | {row['vllm_over_local']:.2f}x |")


def sync_cell(row: dict[str, Any], prefix: str) -> str:
    """A sync's median seconds, total and parts (``-`` when not measured)."""
    if f"{prefix}sync_seconds_median" not in row:
        return "-"
    parts = [row[f"{prefix}{part}_seconds_median"] for part in ("write", "load", "verify")]
    return f"{sum(parts):.3f} ({' + '.join(f'{p:.3f}' for p in parts)})"


if __name__ == "__main__":
    main()
