"""Single-turn GRPO: tracerl against TRL's ``GRPOTrainer``, seconds per step and reward.

What is compared, in one run and one process, with the same torch threads:

* **Model**: one tiny Llama (``tracerl.models.tiny``; the demo's shape by default), its
  tokenizer trained here on the task's texts. It is saved once with ``save_tiny``; both
  trainers load that directory, so they start from the same weights and the same token ids.
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
  AdamW (torch's fused kernel in both) at the same constant learning rate, weight decay 0,
  gradient norm clipped at 1.
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

Measured: wall and CPU (process, all threads) seconds per step (tracerl: the whole step call;
TRL: from the end of its previous step, so its logging and batch fetch count), the first step
excluded as warm-up; mean reward over
the last ``K`` steps. Printed: both, ``speed ratio = TRL s/step / tracerl s/step`` (wall and
CPU), and the reward difference with a standard error. The two trainers run interleaved, one
TRL step then one tracerl step, so a change of load on a shared machine hits both alike.
Threads default to 2; on a 2-core machine that other work keeps busy, two OpenMP threads spend
most of their time waiting for each other (tiny matrices, many ops), and ``--threads 1``
measures the trainers instead of that contention.

TRL is installed only in the bench environment (``make bench-trl``). Without it the script
measures tracerl alone and says so.

Usage: ``python bench/vs_trl.py [--steps 30] [--prompts 4] [--group 4] [--max-new-tokens 32]``
"""

from __future__ import annotations

import argparse
import importlib.util
import math
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
    samples: list[list[float]] = field(default_factory=list)
    """Each step's individual rewards (for the standard error)."""

    def per_step(self, skip: int = 1) -> tuple[float, float]:
        """Mean wall and CPU seconds per step, the first ``skip`` steps left out."""
        kept = self.seconds[skip:]
        if not kept:
            raise ValueError(f"{self.name}: no steps after the {skip} warm-up step(s)")
        return statistics.fmean(w for w, _ in kept), statistics.fmean(c for _, c in kept)

    def last_reward(self, last: int) -> tuple[float, float]:
        """Mean reward of the last ``last`` steps and its standard error over completions."""
        values = [r for step in self.samples[-last:] for r in step]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        return statistics.fmean(values), spread / math.sqrt(len(values))


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
        self.prompt_ids = [self.policy.chat_prompt(messages(p)) for p in problems]
        self.run = Run("tracerl")

    def step(self, step: int) -> None:
        """Sample, score, group advantages, freeze old logprobs, one optimizer step."""
        started = clocks()
        args = self.args
        chosen = [(step * args.prompts + i) % len(self.problems) for i in range(args.prompts)]
        # Each prompt G times in a row, as TRL's sampler repeats them.
        rows = [index for index in chosen for _ in range(args.group)]
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                                seed=args.seed * 100_003 + step)
        prompts = [self.prompt_ids[i] for i in rows]
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
        self.run.samples.append(scores)
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
    includes its logging and batch fetch of the previous step.
    """
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
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
                    **_: Any) -> list[float]:
        scores = [reward(c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]
        run.samples.append(scores)
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
        max_grad_norm=1.0, optim="adamw_torch", beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", shuffle_dataset=False, report_to="none", save_strategy="no",
        logging_steps=args.steps + 1, disable_tqdm=True, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward_func, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
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


def report(runs: Sequence[Run], last: int) -> None:
    """Print each trainer's numbers and, with two, the ratios."""
    print(f"{'trainer':<10}{'wall s/step':>13}{'cpu s/step':>12}{'reward (last ' + str(last) + ')':>20}"
          f"{'first-step reward':>19}")
    for run in runs:
        wall, cpu = run.per_step()
        mean, error = run.last_reward(last)
        print(f"{run.name:<10}{wall:>13.4f}{cpu:>12.4f}{mean:>13.3f} ± {error:.3f}"
              f"{run.rewards[0]:>19.3f}")
    if len(runs) == 2:
        ours, theirs = runs
        ours_wall, ours_cpu = ours.per_step()
        theirs_wall, theirs_cpu = theirs.per_step()
        ours_reward, ours_error = ours.last_reward(last)
        theirs_reward, theirs_error = theirs.last_reward(last)
        print(f"speed ratio (TRL s/step / tracerl s/step): wall {theirs_wall / ours_wall:.2f}x, "
              f"cpu {theirs_cpu / ours_cpu:.2f}x")
        print(f"reward difference (tracerl - TRL, last {last} steps): "
              f"{ours_reward - theirs_reward:+.3f} ± "
              f"{math.hypot(ours_error, theirs_error):.3f}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps N for each trainer")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step P")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt G")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="completion cap L")
    parser.add_argument("--last", type=int, default=10, help="reward averaged over the last K")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
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
    if args.group < 2:
        raise SystemExit("--group must be >= 2 (GRPO compares within a group)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    have_trl = importlib.util.find_spec("trl") is not None
    problems = make_problems(args.problems, args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "tiny"
        parameters = build_model(model_dir, problems, args)
        print(f"tiny Llama: {parameters:,} parameters, hidden {args.hidden_size}, "
              f"{args.num_layers} layers; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")
        print(f"task: sort 5 digits, SFT {args.sft_steps} steps, then {args.prompts} prompts x G={args.group} per step, "
              f"<= {args.max_new_tokens} new tokens, temperature 1, {args.steps} steps, "
              f"lr {args.lr}, beta 0; first step excluded from timing")
        ours = TracerlGRPO(model_dir, problems, args) if args.only != "trl" else None
        runs: list[Run] = []
        started = time.perf_counter()
        if args.only != "tracerl" and have_trl:
            import trl

            torch.manual_seed(args.seed)
            theirs = run_trl(model_dir, problems, args, Path(scratch) / "trl", between=ours)
            runs = [theirs] if ours is None else [ours.run, theirs]
            print(f"trl {trl.__version__}: {args.steps} steps"
                  f"{' interleaved with tracerl' if ours else ''} in "
                  f"{time.perf_counter() - started:.1f} s wall")
        elif ours is not None:
            if args.only != "tracerl":
                print("TRL is not installed here; run `make bench-trl` for the comparison.")
            runs = [ours.train()]
            print(f"tracerl: {args.steps} steps in {time.perf_counter() - started:.1f} s wall")
        report(runs, args.last)


if __name__ == "__main__":
    main()
