"""Generated tokens per second: tracerl's batched sampler against transformers' ``generate``.

Claim: on the demo's tiny model (``tracerl.models.tiny``, default shape) and 2 CPU threads,
``HFPolicy.generate`` produces at least 5x the tokens/s of a per-prompt ``model.generate`` loop
and at least 1.5x the tokens/s of one batched ``model.generate`` call.

``HFPolicy`` is timed on both of its decode paths: ``decode="fused"`` (the default for this
Llama model: ``rollout.policies.fused_llama``) and ``decode="hf"`` (the same sampling loop over the
transformers forward), so the share of each part of the speed-up is visible.

All three sample the same prompts (varied lengths, left-padded where batched) at temperature 1
with no top-k/top-p, and every completion has exactly ``--new-tokens`` tokens: EOS does not stop
any of them (``stop_token_ids=()`` for tracerl, no ``eos_token_id`` for transformers), so the
same amount of work is timed. Every method's timing is the median of ``--repeats`` runs after a
warm-up, the methods alternating run by run (the slow per-prompt loop included).

Run: ``python bench/sampling.py`` (add ``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch
from transformers import GenerationConfig

from tracerl.models.tiny import TinyModelConfig, build_tiny_model, count_parameters, train_tokenizer
from tracerl.rollout import HFPolicy, SamplingParams


def synthetic_code_corpus(n_texts: int, seed: int) -> list[str]:
    """Small Python functions and tool calls, shaped like the demo's demonstrations."""
    rng = random.Random(seed)
    names = ["total", "items", "value", "count", "result", "index", "text", "key", "node", "left"]
    ops = ["+", "-", "*", "//", "%", "==", "<", ">="]
    texts = []
    for i in range(n_texts):
        a, b, c = rng.sample(names, 3)
        body = [f"def f{i % 50}({a}, {b}):"]
        for _ in range(rng.randint(2, 6)):
            body.append(f"    {c} = {a} {rng.choice(ops)} {b}")
            body.append(f"    if {c} {rng.choice(ops)} {rng.randint(0, 9)}:")
            body.append(f"        return [{a}, {c}]")
        body.append(f"    return {c}\n")
        texts.append("\n".join(body))
        texts.append(
            '<tool_call>{"name": "edit", "arguments": {"path": "solution.py", "line": '
            f'{rng.randint(1, 30)}, "text": "return {a} {rng.choice(ops)} {b}"}}}}</tool_call>'
        )
    return texts


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--repeats``, ``--threads`` and ``--seed``, as the sampling benches share them."""
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (median)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)


def bench_model(seed: int) -> tuple[Any, Any]:
    """The demo-shaped tiny model and its tokenizer, with no EOS (every completion runs to its
    token limit, so every method does the same work)."""
    tokenizer = train_tokenizer(synthetic_code_corpus(400, seed), vocab_size=2048)
    model = build_tiny_model(tokenizer, TinyModelConfig(), seed=seed).eval()
    # generate() falls back to the model's own EOS when the call passes None: remove it there too.
    model.generation_config.eos_token_id = None
    return tokenizer, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32, help="number of prompts (one batch)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--min-prompt", type=int, default=48, help="shortest prompt, in tokens")
    parser.add_argument("--max-prompt", type=int, default=160, help="longest prompt, in tokens")
    add_common_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer, model = bench_model(args.seed)
    rng = random.Random(args.seed)
    corpus_ids = tokenizer.encode("\n".join(synthetic_code_corpus(200, args.seed + 1)))
    prompts = []
    for _ in range(args.prompts):
        length = rng.randint(args.min_prompt, args.max_prompt)
        start = rng.randint(0, len(corpus_ids) - length)
        prompts.append(corpus_ids[start : start + length])
    n = args.new_tokens

    fused_policy = HFPolicy(model, tokenizer, max_batch_size=args.prompts, decode="fused")
    hf_policy = HFPolicy(model, tokenizer, max_batch_size=args.prompts, decode="hf")
    params = SamplingParams(temperature=1.0, max_new_tokens=n, stop_token_ids=(), seed=args.seed)

    def ours(policy: HFPolicy) -> int:
        completions = policy.generate(prompts, params)
        assert all(len(c.token_ids) == n for c in completions)
        return sum(len(c.token_ids) for c in completions)

    # transformers samples with top_k=50 by default; 0 turns it off to match. No EOS: fixed length.
    gen_config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n,
        eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
    )

    def hf_batched() -> int:
        batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**batch, generation_config=gen_config)
        generated = out.shape[1] - batch["input_ids"].shape[1]
        assert generated == n
        return generated * len(prompts)

    def hf_per_prompt() -> int:
        total = 0
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt])
                out = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_config
                )
                assert out.shape[1] - ids.shape[1] == n
                total += n
        return total

    print(
        f"model: Llama {count_parameters(model, exclude_embeddings=True):,} params + "
        f"{model.get_input_embeddings().weight.numel():,} embedding, vocab {len(tokenizer)}; "
        f"{args.prompts} prompts of {args.min_prompt}-{args.max_prompt} tokens, {n} new tokens "
        f"each; {torch.get_num_threads()} threads"
    )
    # All methods alternate run by run, so that load from other processes falls on all alike, and
    # each is timed --repeats times (median); the per-prompt loop too, though it is the slowest.
    fused_name, hf_name = "tracerl HFPolicy.generate, fused decode", "tracerl HFPolicy.generate, hf forward"
    methods = {
        fused_name: lambda: ours(fused_policy),
        hf_name: lambda: ours(hf_policy),
        "transformers generate, batched": hf_batched,
        "transformers generate, per-prompt loop": hf_per_prompt,
    }
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    tokens: dict[str, int] = {}
    for fn in methods.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in methods.items():
            began, began_cpu = time.perf_counter(), time.process_time()
            tokens[name] = fn()
            seconds[name].append(time.perf_counter() - began)
            cpu[name].append(time.process_time() - began_cpu)
    # Wall time is what a user waits for; this process's CPU time is printed too because on a
    # shared machine it is far less disturbed by other processes.
    results, cpu_results = {}, {}
    for name, runs in seconds.items():
        median, median_cpu = statistics.median(runs), statistics.median(cpu[name])
        results[name] = tokens[name] / median
        cpu_results[name] = tokens[name] / median_cpu
        print(
            f"{name:42s} {tokens[name]:6d} tokens in {median:7.2f} s = {results[name]:8.1f} tokens/s"
            f" (CPU {median_cpu:7.2f} s = {cpu_results[name]:8.1f} tokens per CPU-second)"
        )
    for name in (fused_name, hf_name):
        vs_loop = results[name] / results["transformers generate, per-prompt loop"]
        vs_batched = results[name] / results["transformers generate, batched"]
        cpu_vs_loop = cpu_results[name] / cpu_results["transformers generate, per-prompt loop"]
        cpu_vs_batched = cpu_results[name] / cpu_results["transformers generate, batched"]
        print(f"{name}:")
        print(f"  ratio vs per-prompt generate loop: {vs_loop:.2f}x (target >= 5x)")
        print(f"  ratio vs batched generate:         {vs_batched:.2f}x (target >= 1.5x)")
        print(
            f"  per CPU-second: {cpu_vs_loop:.2f}x vs per-prompt loop, "
            f"{cpu_vs_batched:.2f}x vs batched"
        )


if __name__ == "__main__":
    main()
