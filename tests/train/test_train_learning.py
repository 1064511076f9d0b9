"""The trainer learns: what it is rewarded for becomes more likely, with no entropy bonus.

A sign error in the advantage wiring would still pass every exactness test (the loss, its
denominators and micro-batching agree with themselves either way); these tests fail on it.

- A two-armed bandit through the trainer's own phases: real attempt records of one action
  token each, sampled from the policy, go through ``Trainer.verify`` (packing),
  ``Trainer.advantages`` (the configured estimator) and ``Trainer.update`` (PPO); the rewarded
  arm's probability rises, whichever arm is rewarded; with a LoRA adapter too (its base
  unchanged).
- A whole ``Trainer.run`` on a one-decision environment (``tiny_runs.OneCallEnv``: calling
  ``submit`` solves it, the other tool does not): held-out success before and after training,
  on the same evaluation seeds, rises by a clear margin.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tracerl.trace import Attempt, Role
from tracerl.trace.schema import (
    EndReason,
    Fragment,
    SamplingParams,
    Segment,
    Turn,
    VerifierResult,
    check_attempt,
)
from tracerl.train.config import config_from_dict
from tracerl.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_runs import OneCallTrainer

TARGETS = ["q_proj", "v_proj", "lm_head"]
"""The LoRA case's adapters. The output head is one: the final RMSNorm fixes the hidden
state's scale and a fresh tiny model's embeddings are small, so adapters on the blocks alone
cap the two arms' logit gap near 1 (the rewarded arm stalled at 0.73 with every projection of
the block adapted, at any rate tried)."""
MODEL = {"vocab_size": 400, "hidden_size": 32, "num_layers": 1, "num_heads": 2,
         "intermediate_size": 64}


def _bandit_trainer(root: Path, estimator: str, lora_rank: int = 0) -> Trainer:
    config = config_from_dict({
        "seed": 3, "steps": 1, "threads": 1, "tensorboard": False, "progress": False,
        "run_dir": str(root / "run"), "model": {**MODEL, "lora": {"rank": lora_rank, "target_modules": TARGETS}},
        "tasks": {"train_count": 2, "heldout_count": 1},
        "algorithm": {"estimator": estimator}, "rollout": {"show_tool_schemas": False},
        "update": {"entropy_coef": 0.0, "lr": 0.01, "micro_batch_rows": 8},
    })
    trainer = Trainer(config)
    trainer.setup()
    return trainer


def _arm_logits(trainer: Trainer, prompt: list[int], arms: tuple[int, int]) -> torch.Tensor:
    """(2,) the policy's logits of the two arms after ``prompt``."""
    policy: Any = trainer.actor.policy  # a transformers model
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([prompt])).logits[0, -1]
    return logits[list(arms)].float()


def _pull(trainer: Trainer, prompt: list[int], arms: tuple[int, int], rewarded: int,
          round_index: int, generator: torch.Generator) -> list[Attempt]:
    """Two groups of eight attempts, each one arm drawn from the policy restricted to the two
    arms (the behavior logprob is that restricted distribution's, as a constrained decoder
    records it); reward 1 for arm ``rewarded``."""
    log_probs = torch.log_softmax(_arm_logits(trainer, prompt, arms), -1)
    attempts = []
    for group in range(2):
        for member in range(8):
            pick = int(torch.multinomial(log_probs.exp(), 1, generator=generator))
            reward = float(pick == rewarded)
            action = Segment(Role.ACTION, [arms[pick]], [float(log_probs[pick])],
                             SamplingParams(temperature=1.0), trainer.state.policy_version,
                             "test")
            attempts.append(Attempt(
                attempt_id=f"r{round_index}-g{group}-{member}", task_id=f"bandit-{group}",
                group_id=f"r{round_index}:bandit-{group}",
                fragments=(Fragment(0, (Turn((Segment(Role.PROMPT, prompt), action)),),
                                    EndReason.TERMINATED),),
                reward=reward, rewards={"verifier": reward},
                verifier=VerifierResult(passed=reward > 0, score=reward)))
    assert all(not check_attempt(a) for a in attempts)
    return attempts


def _rewarded_probability(trainer: Trainer, prompt: list[int], arms: tuple[int, int],
                          rewarded: int) -> float:
    return float(torch.softmax(_arm_logits(trainer, prompt, arms), -1)[rewarded])


@pytest.mark.parametrize(("estimator", "rewarded", "lora_rank"),
                         [("grpo", 0, 0), ("grpo", 1, 0), ("rloo", 0, 0), ("grpo", 1, 8)])
def test_the_rewarded_arm_of_a_bandit_becomes_likelier(tmp_path: Path, estimator: str,
                                                       rewarded: int, lora_rank: int) -> None:
    """``lora_rank`` 8: the policy learns through its LoRA adapter alone."""
    trainer = _bandit_trainer(tmp_path, estimator, lora_rank)
    frozen = {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()
              if not p.requires_grad}
    assert bool(frozen) == (lora_rank > 0)
    prompt = trainer.chat_tokens().first_prompt("Pick one.")
    first, second = (trainer.tokenizer.encode(text, add_special_tokens=False)
                     for text in ("A", "B"))
    assert len(first) == len(second) == 1 and first != second  # one token each
    arms = (first[0], second[0])
    generator = torch.Generator().manual_seed(11)
    before = _rewarded_probability(trainer, prompt, arms, rewarded)
    assert 0.2 < before < 0.8  # a fresh model has no preference to ride on
    trained_rounds = 0
    for round_index in range(6):
        attempts = _pull(trainer, prompt, arms, rewarded, round_index, generator)
        batch, metrics = trainer.verify(attempts)
        assert batch is not None and metrics["attempts"]["in_batch"] == 16
        rows, _ = trainer.advantages(batch)
        picked = batch.input_ids[batch.action_mask]  # one action token per row
        sign = torch.where(picked == arms[rewarded], 1.0, -1.0)
        mixed = rows.advantages[batch.action_mask] != 0
        # Where a group is mixed, the rewarded arm has a positive advantage, the other a
        # negative one (the check a sign error fails first; the learning below is the point).
        assert bool((rows.advantages[batch.action_mask][mixed] * sign[mixed] > 0).all())
        trained_rounds += int(mixed.any())
        trainer.update(rows, batch.attempt_index)
    after = _rewarded_probability(trainer, prompt, arms, rewarded)
    assert trained_rounds >= 3
    assert after > before + 0.25, (before, after)
    assert after > 0.75, (before, after)
    now = dict(trainer.actor.policy.named_parameters())
    assert all(torch.equal(now[n], value) for n, value in frozen.items())


def _one_call_run(root: Path, steps: int) -> dict[str, Any]:
    config = config_from_dict({
        "seed": 1, "steps": steps, "threads": 1, "tensorboard": False, "progress": False,
        "run_dir": str(root / "run"), "model": MODEL,
        "tasks": {"train_count": 4, "heldout_count": 2},
        "rollout": {"tasks_per_step": 4, "group_size": 8, "max_turns": 1, "max_turn_tokens": 40,
                    "concurrency": 16, "env_workers": 1, "show_tool_schemas": False,
                    "constrain_calls": True},
        "update": {"entropy_coef": 0.0, "lr": 0.02, "micro_batch_rows": 16},
        "eval": {"samples_per_task": 32, "greedy": False, "bootstrap_resamples": 200},
    })
    return OneCallTrainer(config).run()


def test_a_short_run_learns_to_call_the_rewarded_tool(tmp_path: Path) -> None:
    summary = _one_call_run(tmp_path, steps=6)
    before, after = summary["heldout_success_before"], summary["heldout_success_after"]
    # 64 sampled attempts on the same evaluation seeds before and after: a fresh model calls
    # either tool, the trained one mostly submits.
    assert 0.15 < before < 0.65, before
    assert after > before + 0.25, (before, after)
    steps = [json.loads(line) for line in
             (tmp_path / "run" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    success = [s["success"]["mean"] for s in steps if "success" in s]
    assert len(success) == 6
    # 32 attempts a step: the last two steps succeed clearly more often than the first two.
    assert sum(success[-2:]) / 2 > sum(success[:2]) / 2 + 0.15, success
