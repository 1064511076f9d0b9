"""Demonstrations: played in the real environment, imperfect as configured, and tokenized
exactly as the collector builds an attempt."""

from __future__ import annotations

import random

from tracerl.envs import CodingEnv
from tracerl.envs.suite import generate_split
from tracerl.models.tiny import build_tiny_model, train_tokenizer
from tracerl.rollout import HFPolicy
from tracerl.rollout.chat_tokens import ChatTokens
from tracerl.train.sft import (
    bug_line,
    demonstration_texts,
    play_demonstration,
    supervised_finetune,
    tokenize_demonstration,
    wrong_fix,
)


def test_bug_line_and_wrong_fix() -> None:
    rng = random.Random(0)
    for task in generate_split("train", 0, 14):
        path, bad, good = bug_line(task)
        assert task.files[path].count(bad) == 1 and bad != good
        wrong = wrong_fix(bad, good, rng)
        assert wrong not in (bad, good)


def test_recovery_demonstration_is_played_in_the_environment() -> None:
    task = generate_split("train", 0, 3)[2]
    env = CodingEnv([task])
    demo = play_demonstration(task, "recovery", env, random.Random(1))
    env.close()
    observations = [o for _, o in demo.turns]
    assert observations[0].startswith("1: ")  # view_file shows numbered lines
    assert observations[1] == "OK" and observations[2].startswith("FAIL")
    assert observations[3] == "OK" and observations[4] == "PASS" and observations[5] is None
    assert '"submit"' in demo.turns[-1][0]

    tokenizer = train_tokenizer(demonstration_texts([demo]), vocab_size=400)
    model = build_tiny_model(tokenizer)
    chat = ChatTokens(HFPolicy(model, tokenizer), tools=None)
    ids, mask = tokenize_demonstration(demo, chat, tokenizer)
    actions = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert actions.count("<tool_call>") == 6 and "FAIL" not in actions and "PASS" not in actions
    assert ids[: len(chat.first_prompt(demo.first_observation))] == chat.first_prompt(
        demo.first_observation)
    before = supervised_finetune(model, [(ids, mask)], steps=1, batch_size=1, lr=1e-3, seed=0,
                                 pad_id=tokenizer.pad_token_id)
    after = supervised_finetune(model, [(ids, mask)], steps=30, batch_size=1, lr=3e-3, seed=0,
                                pad_id=tokenizer.pad_token_id)
    assert after.final_loss < 0.5 * before.final_loss


def test_renamed_copies_are_valid_tasks_with_fresh_names() -> None:
    from tracerl.envs import Sandbox, validate_task
    from tracerl.train.augment import module_name, renamed_copies

    originals = generate_split("train", 0, 7)
    copies = renamed_copies(originals, 1, seed=0)[7:]
    sandbox = Sandbox()
    for original, copy in zip(originals, copies, strict=True):
        old, new = module_name(original), module_name(copy)
        assert old != new and copy.id == f"{original.id}~r0"
        assert old not in copy.instruction and f"test_{new}.py" in copy.files
        assert validate_task(copy, sandbox).problems == ()
