"""Single-turn GRPO: tracerl against TRL's ``GRPOTrainer``, seconds per step, per token, reward.

What is compared, per seed in one process, with the same torch threads (1 by default):

* **Model**: one tiny Llama (``tracerl.models.tiny``; the demo's shape by default), its
  tokenizer trained here on the task's texts. It is saved once per seed with ``save_tiny``;
  both trainers load that directory, so they start from the same weights and token ids.
* **Task**: ``sort 7 3 9 1 5``, one user message; the reply's digits are checked position by
  position against the sorted ones (partial credit, extra digits cost; ``reward``). Before
  saving, the model gets a short SFT on demonstrations half of which swap two digits (as the
  demo warm-starts), so both trainers start from a policy that answers in the right shape
  but is often wrong. The same reward function scores both.
* **Shape**: the same prompts in the same order (TRL's dataset shuffle off), ``P`` prompts per
  step, ``G`` completions per prompt, at most ``L`` new tokens, temperature 1, no top-k/top-p.
* **Update**: GRPO with one optimizer step per batch (TRL: ``num_iterations=1``; tracerl:
  ``epochs=1, minibatches=1``), clip 0.2, no KL (``beta=0``), advantages
  ``(r - mean_g) / (std_g + 1e-4)`` with the sample std (TRL's ``scale_rewards="group"``),
  token-mean loss over the batch (TRL's default ``loss_type="dapo"``; tracerl's ``token_mean``),
  at the same constant learning rate, weight decay 0, gradient norm clipped at 1.
* **Optimizer kernel**: TRL keeps its default ``optim`` (what a user gets; with this
  transformers and torch that is ``adamw_torch_fused``, torch's fused AdamW), and tracerl's
  trainer builds the same fused kernel (``make_adamw``). The kernel each side actually got is
  read from the optimizers after the run and printed; the script stops if they differ.
* **tracerl side**: the library's public pieces, driven single-turn here because its trainer is
  the multi-turn loop: ``HFPolicy.generate`` samples (recording behavior logprobs),
  ``core.group_advantages`` scores groups, and ``train.update``'s ``freeze_old`` +
  ``ppo_update`` (``core.loss_weights``, ``ppo_token_loss``) take the optimizer step. With one
  optimizer step per batch both take the old-policy logprobs from the update's own forward
  (TRL's ``num_iterations=1``; tracerl's ``freeze_old(..., policy=False)``), so neither runs
  an extra no-grad forward. tracerl's update forward is its fused Llama path (packed real
  tokens, a group's shared prompt computed once, output head on action positions only);
  TRL's is the ``transformers`` module.
* **TRL side**: ``GRPOTrainer`` on CPU, ``bf16=False``, ``gradient_checkpointing=False``,
  generation by ``transformers``' ``generate`` (no vLLM on CPU), logging and saving off.

Timer boundaries are the same on both sides: each step's clock covers picking the step's
prompts, rendering them with the chat template and tokenizing them, sampling, scoring,
advantages, batch packing and the optimizer step (TRL: from the end of its previous step to
the end of this one, so its batch fetch, tokenization and per-step bookkeeping count; tracerl:
the whole step call, which tokenizes its prompts inside it). The two trainers run interleaved,
one TRL step then one tracerl step (off TRL's clock), so a change of load on a shared machine
hits both alike. The first step of each is excluded as warm-up.

Measured per seed: the median wall and CPU (process, all threads) seconds per step, the
median seconds per generated token (the two samplers draw completions of different lengths,
so per-step time alone can flatter the side that stops earlier), and the mean reward of the
first and last ``K`` steps. Over ``--seeds`` seeds (each its own SFT warm start, task draw and
sampling) the script prints the median speed ratio ``TRL / tracerl`` with its min-max and
interquartile range, the reward difference (tracerl - TRL, last ``K`` steps) as a mean with
its standard error over seeds, and for each side whether its reward moved from the first
``K`` steps to the last (mean change, standard error over seeds).

TRL is installed only in the bench environment (``make bench-trl``). Without it the script
measures tracerl alone and says so.

Usage: ``python bench/vs_trl.py [--seeds 8] [--steps 30] [--threads 1] [--prompts 4]
[--group 4] [--max-new-tokens 32]``
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import random
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from tracerl.core import group_advantages
from tracerl.models.tiny import (
    TinyModelConfig,
    build_tiny_model,
    count_parameters,
    load_tiny,
    save_tiny,
    train_tokenizer,
)
from tracerl.rollout.policies.hf import HFPolicy
from tracerl.rollout.policies.sampling import SamplingParams
from tracerl.train.config import CriticConfig, UpdateConfig
from tracerl.train.update import ActorCritic, RowBatch, freeze_old, make_adamw, ppo_update

ADVANTAGE_EPS = 1e-4
"""TRL's constant in ``(r - mean) / (std + eps)``; tracerl is given the same."""

_DIGIT = re.compile(r"\d")
DIGITS_PER_PROBLEM = 5


@dataclass(frozen=True)
class Problem:
    """One prompt of the task."""

    question: str
    """The user message, e.g. ``"sort 7 3 9 1 5"``."""
    answer: str
    """The digits in ascending order, space-separated, e.g. ``"1 3 5 7 9"``."""


def make_problems(count: int, seed: int) -> list[Problem]:
    """``count`` problems of five random digits each, in a fixed order."""
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        digits = [rng.randint(0, 9) for _ in range(DIGITS_PER_PROBLEM)]
        problems.append(Problem("sort " + " ".join(map(str, digits)),
                                " ".join(map(str, sorted(digits)))))
    return problems


def reward(text: str, answer: str) -> float:
    """Share of the answer's positions the reply's digits get right, minus extra digits.

    The reply's digits are read in order; position i scores when it equals the sorted digit i.
    Digits beyond the answer's count each cost one position (floored at 0), so padding a reply
    with digits never pays.
    """
    got = _DIGIT.findall(text)
    want = answer.split()
    hits = sum(g == w for g, w in zip(got, want, strict=False))
    extra = max(0, len(got) - len(want))
    return max(0.0, hits - extra) / len(want)


def demonstration(problem: Problem, rng: random.Random, wrong_fraction: float) -> str:
    """The answer, or (with probability ``wrong_fraction``) it with two digits swapped."""
    digits = problem.answer.split()
    if rng.random() < wrong_fraction:
        i, j = rng.sample(range(len(digits)), 2)
        digits[i], digits[j] = digits[j], digits[i]
    return " ".join(digits)


def messages(problem: Problem) -> list[dict[str, str]]:
    """The conversation both trainers render with the tokenizer's chat template."""
    return [{"role": "user", "content": problem.question}]


# ----------------------------------------------------------------------------- measurement


@dataclass
class Run:
    """What one trainer did, step by step."""

    name: str
    """Which trainer."""
    seconds: list[tuple[float, float]] = field(default_factory=list)
    """(wall, cpu) seconds of each step."""
    rewards: list[float] = field(default_factory=list)
    """Mean reward of each step's completions."""
    tokens: list[int] = field(default_factory=list)
    """Generated (completion) tokens of each step."""
    optimizer: str = "?"
    """The AdamW kernel the trainer used (``fused``, ``foreach`` or ``for-loop``)."""

    def per_step(self, skip: int = 1) -> tuple[float, float]:
        """Median wall and CPU seconds per step, the first ``skip`` steps left out."""
        kept = self.kept(skip)
        return statistics.median(w for w, _ in kept), statistics.median(c for _, c in kept)

    def per_token(self, skip: int = 1) -> float:
        """Median over steps of wall seconds per generated token, the first ``skip`` left out."""
        kept = self.kept(skip)
        counts = self.tokens[skip:len(self.seconds)]
        if len(counts) != len(kept) or min(counts) <= 0:
            raise ValueError(f"{self.name}: generated-token counts missing for some steps")
        return statistics.median(w / n for (w, _), n in zip(kept, counts, strict=True))

    def kept(self, skip: int) -> list[tuple[float, float]]:
        kept = self.seconds[skip:]
        if not kept:
            raise ValueError(f"{self.name}: no steps after the {skip} warm-up step(s)")
        return kept

    def first_reward(self, count: int) -> float:
        """Mean reward of the first ``count`` steps."""
        return statistics.fmean(self.rewards[:count])

    def last_reward(self, count: int) -> float:
        """Mean reward of the last ``count`` steps."""
        return statistics.fmean(self.rewards[-count:])


def adamw_kernel(optimizer: Any) -> str:
    """Which AdamW implementation ``optimizer`` (or the torch optimizer it wraps) runs."""
    inner = getattr(optimizer, "optimizer", optimizer)
    defaults = getattr(inner, "defaults", {})
    kind = type(inner).__name__
    if defaults.get("fused"):
        return f"{kind} fused"
    if defaults.get("foreach"):
        return f"{kind} foreach"
    return f"{kind} single-tensor"  # foreach=None is the per-tensor loop on CPU


def clocks() -> tuple[float, float]:
    """Wall and CPU (this process, all threads) clocks now."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    """Wall and CPU seconds since ``start``."""
    wall, cpu = clocks()
    return wall - start[0], cpu - start[1]


# ----------------------------------------------------------------------------- tracerl


class TracerlGRPO:
    """GRPO with tracerl's sampler, advantages and PPO update, single-turn, one step per call."""

    def __init__(self, model_dir: Path, problems: Sequence[Problem],
                 args: argparse.Namespace) -> None:
        model, tokenizer = load_tiny(model_dir)
        self.args = args
        self.problems = problems
        self.pad_id = int(tokenizer.pad_token_id)
        self.update = UpdateConfig(epochs=1, minibatches=1,
                                   micro_batch_rows=args.prompts * args.group, lr=args.lr,
                                   weight_decay=0.0, grad_clip=1.0, clip_low=0.2,
                                   loss_mode="token_mean", kl_coef=0.0)
        self.critic = CriticConfig(kind="none")
        self.actor = ActorCritic(model, self.critic, temperature=1.0)
        self.policy = HFPolicy(model, tokenizer, max_batch_size=args.prompts * args.group)
        self.optimizer = make_adamw([{"params": self.actor.policy_parameters(), "lr": args.lr}],
                                    0.0)  # the trainer's optimizer
        self.generator = torch.Generator().manual_seed(args.seed)
        self.run = Run("tracerl", optimizer=adamw_kernel(self.optimizer))

    def step(self, step: int) -> None:
        """Tokenize, sample, score, group advantages, freeze old logprobs, one optimizer step."""
        started = clocks()
        args = self.args
        chosen = [(step * args.prompts + i) % len(self.problems) for i in range(args.prompts)]
        # The step's prompts are rendered and tokenized on the step's clock, as TRL's are.
        prompt_ids = {i: self.policy.chat_prompt(messages(self.problems[i])) for i in chosen}
        # Each prompt G times in a row, as TRL's sampler repeats them.
        rows = [index for index in chosen for _ in range(args.group)]
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                                seed=args.seed * 100_003 + step)
        prompts = [prompt_ids[i] for i in rows]
        completions = self.policy.generate(prompts, params)
        scores = [reward(c.text, self.problems[i].answer)
                  for c, i in zip(completions, rows, strict=True)]
        group_ids = torch.arange(args.prompts).repeat_interleave(args.group)
        advantages, _ = group_advantages(torch.tensor(scores), group_ids, scale="std",
                                         std="sample", eps=ADVANTAGE_EPS)
        batch = pack_rows(prompts, completions, advantages, group_ids, self.pad_id)
        # One optimizer step per batch: the old logprobs come from the update's own forward
        # (as TRL's num_iterations=1 does); freeze_old still fills whatever else is needed.
        batch = freeze_old(self.actor, batch, self.update.micro_batch_rows, policy=False)
        ppo_update(self.actor, self.optimizer, batch, torch.arange(batch.rows), self.update,
                   self.critic, self.generator)
        self.policy.policy_version += 1
        self.run.seconds.append(since(started))
        self.run.tokens.append(sum(len(c.token_ids) for c in completions))
        self.run.rewards.append(statistics.fmean(scores))

    def train(self) -> Run:
        """All steps back to back."""
        for step in range(self.args.steps):
            self.step(step)
        return self.run


def pack_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Any],
              advantages: torch.Tensor, group_ids: torch.Tensor, pad_id: int) -> RowBatch:
    """Prompt + completion per row, right-padded; actions are the completion tokens."""
    lengths = [len(p) + len(c.token_ids) for p, c in zip(prompts, completions, strict=True)]
    width = max(lengths)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(prompts), width, dtype=torch.long)
    actions = torch.zeros(len(prompts), width, dtype=torch.bool)
    behavior = torch.zeros(len(prompts), width)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start, end = len(prompt), len(prompt) + len(completion.token_ids)
        input_ids[row, :start] = torch.tensor(prompt)
        input_ids[row, start:end] = torch.tensor(completion.token_ids)
        attention[row, :end] = 1
        actions[row, start:end] = True
        behavior[row, start:end] = torch.tensor(completion.logprobs)
    token_advantages = advantages.float()[:, None] * actions
    return RowBatch(input_ids, attention, actions, token_advantages, behavior, group_ids)


# ----------------------------------------------------------------------------- TRL


def run_trl(model_dir: Path, problems: Sequence[Problem], args: argparse.Namespace,
            out_dir: Path, between: TracerlGRPO | None = None) -> Run:
    """The same GRPO through TRL's ``GRPOTrainer``.

    With ``between``, one tracerl step runs after each TRL step (off TRL's clock, on its own),
    so a change of load on a shared machine hits both trainers alike. TRL's step i is timed
    from the end of the previous tracerl step to the end of its own optimizer step, which
    includes its batch fetch, prompt tokenization and bookkeeping. ``optim`` is left at
    TRL's default.
    """
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    check_same_prompt_ids(tokenizer, problems[0])
    # Enough rows that the dataloader never starts a second epoch (which would reshuffle nothing
    # but would add an epoch boundary to one step's time).
    rows_needed = args.steps * args.prompts
    data = [problems[i % len(problems)] for i in range(rows_needed)]
    dataset = Dataset.from_list([{"prompt": messages(p), "answer": p.answer} for p in data])
    run = Run("TRL")

    def reward_func(completions: list[list[dict[str, str]]], answer: list[str],
                    completion_ids: list[list[int]], **_: Any) -> list[float]:
        scores = [reward(c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]
        run.tokens.append(sum(len(ids) for ids in completion_ids))
        run.rewards.append(statistics.fmean(scores))
        return scores

    started = clocks()

    class Clock(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            nonlocal started
            started = clocks()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            nonlocal started
            run.seconds.append(since(started))
            if between is not None:
                between.step(len(between.run.rewards))
            # TRL's next step is timed from here: it includes TRL's own logging and batch fetch
            # between steps, and never the tracerl step above.
            started = clocks()

    config = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, seed=args.seed, data_seed=args.seed,
        per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, max_steps=args.steps, num_iterations=1,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", shuffle_dataset=False, report_to="none", save_strategy="no",
        logging_steps=args.steps + 1, disable_tqdm=True, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward_func, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # its end-of-training metrics dict, off the clocks
    trainer.train()
    run.optimizer = adamw_kernel(trainer.optimizer)
    return run


def check_same_prompt_ids(tokenizer: Any, problem: Problem) -> None:
    """Both trainers must feed the model the same prompt tokens."""
    ours = HFPolicy(build_tiny_model(tokenizer, TinyModelConfig(hidden_size=8, num_layers=1,
                                                                 num_heads=1,
                                                                 intermediate_size=8)),
                    tokenizer).chat_prompt(messages(problem))
    theirs = tokenizer.apply_chat_template(conversation=[messages(problem)],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"][0]
    if list(ours) != [int(t) for t in theirs]:
        raise ValueError(f"prompt token ids differ: tracerl {ours} vs TRL {list(theirs)}")


# ----------------------------------------------------------------------------- main


def build_model(model_dir: Path, problems: Sequence[Problem], args: argparse.Namespace) -> int:
    """Train the tokenizer, build the Llama, warm-start it, save it once; returns its size."""
    corpus = [f"{p.question} {p.answer}" for p in problems]
    tokenizer = train_tokenizer(corpus, vocab_size=args.vocab_size)
    shape = TinyModelConfig(hidden_size=args.hidden_size, num_layers=args.num_layers,
                            num_heads=args.num_heads, intermediate_size=args.intermediate_size,
                            max_positions=256)
    model = build_tiny_model(tokenizer, shape, seed=args.seed)
    warm_start(model, tokenizer, problems, args)
    save_tiny(model, tokenizer, model_dir)
    return count_parameters(model)


def warm_start(model: Any, tokenizer: Any, problems: Sequence[Problem],
               args: argparse.Namespace) -> None:
    """Supervised fine-tuning on imperfect demonstrations, as the demo does before RL.

    A random model almost never starts its reply with a digit, so GRPO from scratch spends
    its first hundred steps finding the format; a short SFT on demonstrations of which
    ``--wrong-fraction`` are wrong gives both trainers a policy that answers in the right
    shape but is often wrong, which is where RL has something to learn.
    """
    rng = random.Random(args.seed)
    sequences: list[tuple[list[int], int]] = []
    for problem in problems:
        prompt = tokenizer.apply_chat_template(messages(problem), add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        reply = demonstration(problem, rng, args.wrong_fraction)
        full = tokenizer.apply_chat_template(
            [*messages(problem), {"role": "assistant", "content": reply}], tokenize=True,
            return_dict=False)
        sequences.append(([int(t) for t in full], len(prompt)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    model.train()
    for _ in range(args.sft_steps):
        picked = torch.randint(len(sequences), (16,), generator=generator).tolist()
        width = max(len(sequences[i][0]) for i in picked)
        ids = torch.full((16, width), int(tokenizer.pad_token_id), dtype=torch.long)
        labels = torch.full((16, width), -100, dtype=torch.long)
        attention = torch.zeros(16, width, dtype=torch.long)
        for row, index in enumerate(picked):
            tokens, prompt_length = sequences[index]
            ids[row, :len(tokens)] = torch.tensor(tokens)
            labels[row, prompt_length:len(tokens)] = torch.tensor(tokens[prompt_length:])
            attention[row, :len(tokens)] = 1
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def spread(values: Sequence[float]) -> str:
    """``median [min-max], IQR q1-q3`` of ``values`` (the IQR from two values up)."""
    text = f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        text += f", IQR {q1:.2f}-{q3:.2f}"
    return text


def mean_error(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error over ``values`` (error NaN-free: 0 for one value)."""
    error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.fmean(values), error


def verdict(mean: float, error: float, seeds: int) -> str:
    """Plain words for a change ``mean`` ± ``error`` over ``seeds`` seeds."""
    if seeds < 2:
        return "one seed: no standard error, no claim"
    if mean > 2 * error:
        return "rose (more than 2 standard errors)"
    if mean < -2 * error:
        return "fell (more than 2 standard errors)"
    return "no change distinguishable from zero (within 2 standard errors): it does not learn here"


def report_seed(seed: int, runs: Sequence[Run], last: int) -> None:
    """One line per trainer for one seed."""
    for run in runs:
        wall, cpu = run.per_step()
        tokens = statistics.fmean(run.tokens[1:])
        print(f"  seed {seed:<3}{run.name:<9}{wall:>9.4f}{cpu:>9.4f}{run.per_token() * 1e3:>10.3f}"
              f"{tokens:>9.1f}{run.first_reward(last):>9.3f}{run.last_reward(last):>9.3f}")


def report(results: Sequence[Sequence[Run]], last: int) -> None:
    """Across seeds: ratios of medians with their spread, reward difference, learning."""
    seeds = len(results)
    names = [run.name for run in results[0]]
    for index, name in enumerate(names):
        change = [runs[index].last_reward(last) - runs[index].first_reward(last) for runs in results]
        mean, error = mean_error(change)
        print(f"{name} reward, last {last} steps - first {last}, over {seeds} seed(s): "
              f"{mean:+.3f} ± {error:.3f} -> {verdict(mean, error, seeds)}")
    if len(names) != 2:
        return
    wall = [trl.per_step()[0] / ours.per_step()[0] for ours, trl in results]
    cpu = [trl.per_step()[1] / ours.per_step()[1] for ours, trl in results]
    token = [trl.per_token() / ours.per_token() for ours, trl in results]
    print(f"speed ratio TRL / tracerl over {seeds} seed(s), each seed's medians "
          f"(median [min-max], IQR):")
    print(f"  wall s/step             {spread(wall)}")
    print(f"  cpu s/step              {spread(cpu)}")
    print(f"  wall s/generated token  {spread(token)}")
    difference = [ours.last_reward(last) - trl.last_reward(last) for ours, trl in results]
    mean, error = mean_error(difference)
    print(f"reward difference (tracerl - TRL, mean of the last {last} steps), over {seeds} "
          f"seed(s): {mean:+.3f} ± {error:.3f} (standard error over seeds)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps N for each trainer")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step P")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt G")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="completion cap L")
    parser.add_argument("--last", type=int, default=10, help="reward averaged over the last K")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=int, default=8,
                        help="seeds run one after another (--seed, --seed + 1, ...)")
    parser.add_argument("--problems", type=int, default=256, help="distinct prompts, cycled")
    parser.add_argument("--sft-steps", type=int, default=150, help="warm-start SFT steps")
    parser.add_argument("--sft-lr", type=float, default=3e-3, help="warm-start learning rate")
    parser.add_argument("--wrong-fraction", type=float, default=0.5,
                        help="share of SFT demonstrations that are wrong")
    # The demo's model shape (configs/demo.yaml).
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=320)
    parser.add_argument("--only", choices=("both", "tracerl", "trl"), default="both")
    args = parser.parse_args(argv)
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is a warm-up)")
    if not 1 <= args.last <= args.steps:
        raise SystemExit("--last must be in 1..steps")
    if args.seeds < 1:
        raise SystemExit("--seeds must be >= 1")
    if args.group < 2:
        raise SystemExit("--group must be >= 2 (GRPO compares within a group)")
    return args


def run_seed(args: argparse.Namespace, scratch: Path, have_trl: bool, announce: bool) -> list[Run]:
    """One seed: its problems and warm-started model, then both trainers interleaved."""
    problems = make_problems(args.problems, args.seed)
    model_dir = scratch / f"tiny-{args.seed}"
    parameters = build_model(model_dir, problems, args)
    if announce:
        print(f"tiny Llama: {parameters:,} parameters, hidden {args.hidden_size}, "
              f"{args.num_layers} layers")
    ours = TracerlGRPO(model_dir, problems, args) if args.only != "trl" else None
    if args.only == "tracerl" or not have_trl:
        assert ours is not None
        return [ours.train()]
    torch.manual_seed(args.seed)
    theirs = run_trl(model_dir, problems, args, scratch / f"trl-{args.seed}", between=ours)
    if ours is None:
        return [theirs]
    if ours.run.optimizer != theirs.optimizer:
        raise SystemExit(f"AdamW kernels differ: tracerl {ours.run.optimizer}, "
                         f"TRL {theirs.optimizer}; the comparison would not be like with like")
    return [ours.run, theirs]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    have_trl = importlib.util.find_spec("trl") is not None
    if not have_trl and args.only != "tracerl":
        print("TRL is not installed here; run `make bench-trl` for the comparison.")
    if have_trl:
        import trl

        print(f"trl {trl.__version__}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s); "
          f"{args.seeds} seed(s) from {args.seed}; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"task: sort 5 digits, SFT {args.sft_steps} steps, then {args.prompts} prompts x "
          f"G={args.group} per step, <= {args.max_new_tokens} new tokens, temperature 1, "
          f"{args.steps} steps per seed, lr {args.lr}, beta 0; first step excluded from timing")
    results: list[list[Run]] = []
    started = time.perf_counter()
    first_seed = args.seed
    with tempfile.TemporaryDirectory() as scratch:
        for seed in range(first_seed, first_seed + args.seeds):
            seed_args = argparse.Namespace(**{**vars(args), "seed": seed})
            runs = run_seed(seed_args, Path(scratch), have_trl, announce=not results)
            if not results:
                print("AdamW: " + ", ".join(f"{run.name} {run.optimizer}" for run in runs))
                print(f"  {'seed':<8}{'trainer':<9}{'wall s':>9}{'cpu s':>9}{'ms/token':>10}"
                      f"{'tok/step':>9}{'r first':>9}{'r last':>9}   (per step, medians; "
                      f"rewards: means of {args.last} steps)")
            report_seed(seed, runs, args.last)
            results.append(runs)
    print(f"{args.seeds} seed(s) in {time.perf_counter() - started:.0f} s wall; load average "
          f"now {os.getloadavg()[0]:.2f}")
    report(results, args.last)


if __name__ == "__main__":
    main()
