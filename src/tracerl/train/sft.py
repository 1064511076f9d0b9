"""Supervised warm start on demonstrations, rendered exactly as the collector renders attempts.

Demonstrations are played in the real environment (its tools, its observations, its sandboxed
test runs), so every observation the policy is trained to read is one the environment really
returns. They are deliberately imperfect: a share make a wrong edit, some of those run the
tests, see FAIL and submit anyway, and a few recover (edit again, PASS, submit). RL then has
something to amplify: the recovery behaviour exists, with small probability.

Token layout: ``ChatTokens`` (the collector's own renderer) builds the first prompt, the
closing after each action and each observation, so the SFT sequences are token-for-token
the contexts the policy will be sampled from. Only action tokens carry loss.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tracerl.core import loss_weights
from tracerl.envs.tasks import Task
from tracerl.models.tiny import render_tool_call
from tracerl.rollout.chat_tokens import ChatTokens
from tracerl.rollout.sampling import logprobs_from_logits

DemoKind = Literal["correct", "checked", "wrong", "wrong_checked", "recovery"]
"""What a demonstration shows: ``correct`` (view, right edit, submit), ``checked`` (the same
with a passing test run before submitting), ``wrong`` (a wrong edit, submitted),
``wrong_checked`` (a wrong edit, FAIL, submitted anyway), ``recovery`` (a wrong edit, FAIL, the
right edit, PASS, submit)."""


@dataclass(frozen=True)
class Demonstration:
    """One scripted attempt: the first observation and (action, observation) turns."""

    task_id: str
    """The task it solves (or fails to)."""
    kind: DemoKind
    """What it shows."""
    first_observation: str
    """What ``env.reset`` returned."""
    turns: tuple[tuple[str, str | None], ...]
    """Action text and the observation that came back (None after the final submit)."""


_TOKEN = re.compile(r"\w+|[^\w\s]+")
_SWAPS: tuple[tuple[str, ...], ...] = (
    ("+", "-", "*"), ("<", "<=", ">", ">="), ("==", "!="), ("0", "1", "-1", "-2", "2"),
)


def bug_line(task: Task) -> tuple[str, str, str]:
    """(file, buggy text, fixed text): the one line the solution changes, stripped of
    indentation (the shortest edit the ``replace`` tool accepts when it is unique)."""
    if not task.solution:
        raise ValueError(f"task {task.id}: a demonstration needs the task's solution")
    for path, fixed in task.solution.items():
        original = task.files.get(path, "")
        old_lines, new_lines = original.splitlines(), fixed.splitlines()
        changed = [(a, b) for a, b in zip(old_lines, new_lines, strict=False) if a != b]
        if len(changed) == 1 and len(old_lines) == len(new_lines):
            bad, good = changed[0][0].strip(), changed[0][1].strip()
            if original.count(bad) == 1:
                return path, bad, good
            return path, changed[0][0], changed[0][1]
    raise ValueError(f"task {task.id}: the solution does not change exactly one line")


def wrong_fix(bad: str, good: str, rng: random.Random) -> str:
    """A plausible but wrong version of the line: one operator, comparison or number of the
    correct line changed to something that is neither the bug nor the fix."""
    pieces = [(m.start(), m.end(), m.group()) for m in _TOKEN.finditer(good)]
    options: list[str] = []
    for start, end, text in pieces:
        alternatives: list[str] = []
        for group in _SWAPS:
            if text in group:
                alternatives += [g for g in group if g != text]
        if text.isdigit():
            alternatives += [str(int(text) + d) for d in (-1, 1, 2) if int(text) + d >= 0]
        for alternative in alternatives:
            candidate = good[:start] + alternative + good[end:]
            if candidate not in (bad, good):
                options.append(candidate)
    if not options:
        # No operator or number to change (e.g. ``range(n):``): shift the last bracketed value.
        close = good.rfind(")")
        for shift in (" + 2", " - 2", " * 2"):
            candidate = good[:close] + shift + good[close:] if close > 0 else good + shift
            if candidate not in (bad, good):
                options.append(candidate)
    return rng.choice(sorted(set(options)))


def _call(name: str, **arguments: str) -> str:
    return render_tool_call(name, dict(arguments))


def plan_kind(rng: random.Random, wrong_fraction: float, recovery_fraction: float,
              check_fraction: float) -> DemoKind:
    """Draw what a demonstration shows from the configured fractions."""
    draw = rng.random()
    if draw < recovery_fraction:
        return "recovery"
    if draw < wrong_fraction:
        return "wrong_checked" if rng.random() < 0.5 else "wrong"
    return "checked" if rng.random() < check_fraction else "correct"


def play_demonstration(task: Task, kind: DemoKind, env: Any, rng: random.Random
                       ) -> Demonstration:
    """Play one scripted attempt in ``env`` (a ``CodingEnv``); submit is not stepped (its
    observation is never shown to the policy, and verification would only cost time)."""
    path, bad, good = bug_line(task)
    first, _ = env.reset(options={"task_id": task.id})
    wrong = wrong_fix(bad, good, rng)
    actions = [_call("view_file", path=path)]
    if kind in ("correct", "checked"):
        actions.append(_call("replace", path=path, old=bad, new=good))
        if kind == "checked":
            actions.append(_call("run_tests"))
    else:
        actions.append(_call("replace", path=path, old=bad, new=wrong))
        if kind in ("wrong_checked", "recovery"):
            actions.append(_call("run_tests"))
        if kind == "recovery":
            actions.append(_call("replace", path=path, old=wrong, new=good))
            actions.append(_call("run_tests"))
    turns: list[tuple[str, str | None]] = []
    for action in actions:
        observation, _, terminated, truncated, info = env.step(action)
        if terminated or truncated or info.get("tool_error"):
            raise ValueError(f"task {task.id}: demonstration step {action!r} ended the episode")
        turns.append((action, str(observation)))
    turns.append((_call("submit"), None))
    return Demonstration(task.id, kind, str(first), tuple(turns))


def make_demonstrations(tasks: Sequence[Task], make_env: Callable[[], Any], *,
                        demos_per_task: int, wrong_fraction: float, recovery_fraction: float,
                        check_fraction: float, seed: int) -> list[Demonstration]:
    """``demos_per_task`` demonstrations of each task, kinds drawn from the fractions."""
    rng = random.Random(seed)
    env = make_env()
    demos: list[Demonstration] = []
    try:
        for task in tasks:
            for _ in range(demos_per_task):
                kind = plan_kind(rng, wrong_fraction, recovery_fraction, check_fraction)
                demos.append(play_demonstration(task, kind, env, rng))
    finally:
        env.close()
    return demos


def demonstration_texts(demos: Sequence[Demonstration]) -> list[str]:
    """Texts for training a tokenizer: every observation and action."""
    texts: list[str] = []
    for demo in demos:
        texts.append(demo.first_observation)
        for action, observation in demo.turns:
            texts.append(action)
            if observation is not None:
                texts.append(observation)
    return texts


def tokenize_demonstration(demo: Demonstration, chat: ChatTokens, tokenizer: Any
                           ) -> tuple[list[int], list[bool]]:
    """Token ids and action mask of a demonstration, built the way the collector builds an
    attempt: first prompt, then per turn the action (ending in EOS), the template's closing,
    the observation and the next generation prompt."""
    ids = list(chat.first_prompt(demo.first_observation))
    mask = [False] * len(ids)
    eos = int(tokenizer.eos_token_id)
    for action, observation in demo.turns:
        action_ids = [*tokenizer.encode(action, add_special_tokens=False), eos]
        ids += action_ids
        mask += [True] * len(action_ids)
        if observation is None:
            break
        context = chat.after_action(action_ids) + chat.observation(observation)
        ids += context
        mask += [False] * len(context)
    return ids, mask


@dataclass(frozen=True)
class SFTResult:
    """What the warm start did."""

    steps: int
    """Optimizer steps taken."""
    seconds: float
    """Wall time."""
    final_loss: float
    """Mean action-token loss over the last 10 steps."""
    losses: tuple[float, ...]
    """Loss of every step."""


def _pad(rows: Sequence[tuple[list[int], list[bool]]], pad_id: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    action = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, (row_ids, row_mask) in enumerate(rows):
        ids[b, :len(row_ids)] = torch.tensor(row_ids)
        attention[b, :len(row_ids)] = 1
        action[b, :len(row_ids)] = torch.tensor(row_mask)
    return ids, attention, action


def supervised_finetune(model: torch.nn.Module, sequences: Sequence[tuple[list[int], list[bool]]],
                        *, steps: int, batch_size: int, lr: float, seed: int, pad_id: int,
                        max_seconds: float | None = None,
                        on_step: Callable[[int, float], None] | None = None) -> SFTResult:
    """Minimise the mean negative log-likelihood of action tokens (token-mean over the batch),
    AdamW with linear warm-up and cosine decay to 10%; stops at ``steps`` or ``max_seconds``."""
    if not sequences:
        raise ValueError("sequences: no demonstration to train on")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    started = time.perf_counter()
    losses: list[float] = []
    order = torch.randperm(len(sequences), generator=generator)
    cursor = 0
    step = 0
    for step in range(steps):
        if max_seconds is not None and time.perf_counter() - started > max_seconds:
            break
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(len(sequences), generator=generator), 0
        picked = [sequences[int(i)] for i in order[cursor:cursor + batch_size]]
        cursor += batch_size
        ids, attention, action = _pad(picked, pad_id)
        logits = model(input_ids=ids, attention_mask=attention).logits
        logprobs = logprobs_from_logits(logits[:, :-1], ids[:, 1:], processing="raw")
        weights = loss_weights(action[:, 1:], "token_mean").float()
        loss = -(weights * logprobs).sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    else:
        step = steps
    taken = len(losses)
    tail = losses[-10:] or [float("nan")]
    return SFTResult(taken, time.perf_counter() - started, sum(tail) / len(tail), tuple(losses))
