"""Demonstrations: played in the real environment, imperfect as configured, and tokenized
exactly as the collector builds an attempt."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tracerl.envs import CodingEnv
from tracerl.envs.suite import generate_split
from tracerl.envs.suite.demonstrator import (
    DemoKind,
    Demonstration,
    bug_line,
    bug_location,
    demonstration_texts,
    make_demonstrations,
    minimal_edit,
    plan_kind,
    play_demonstration,
    search_candidates,
    search_tries,
    wrong_fix,
)
from tracerl.envs.tasks import Task
from tracerl.envs.tools import parse_tool_call
from tracerl.models.tiny import build_tiny_model, train_tokenizer
from tracerl.rollout import HFPolicy
from tracerl.rollout.collect.chat_tokens import ChatTokens
from tracerl.train.sft import supervised_finetune, tokenize_demonstration


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


@pytest.mark.parametrize("line_edits", [False, True])
def test_retry_demonstration_reads_the_not_found_error_and_edits_again(line_edits: bool) -> None:
    tasks = generate_split("train", 0, 30)
    env = CodingEnv(tasks)
    rng = random.Random(3)
    try:
        for task in tasks:
            demo = play_demonstration(task, "retry", env, rng, line_edits=line_edits,
                                      implicit_path=True)
            observations = [o for _, o in demo.turns]
            assert observations[1].startswith("error: replace: old text not found")
            assert observations[2:] == ["OK", "PASS", None]
    finally:
        env.close()
    assert plan_kind(random.Random(0), 0.4, 0.15, 0.3, retry_fraction=1.0) == "retry"
    kinds = {plan_kind(random.Random(s), 0.4, 0.15, 0.3) for s in range(200)}
    assert "retry" not in kinds


def test_demonstrations_do_not_depend_on_how_many_environments_play_them() -> None:
    # Scripts are not held to a task's turn budget (as the trainer plays them).
    tasks = [dataclasses.replace(t, budget=None)
             for t in generate_split("train", 0, 24, composed=True)]

    def env() -> CodingEnv:
        return CodingEnv(tasks, max_turns=32)

    options: dict[str, Any] = dict(
        demos_per_task=1, wrong_fraction=0.5, recovery_fraction=0.1, check_fraction=0.6,
        seed=3, line_edits=True, implicit_path=True, retry_fraction=0.15,
        search_fraction=0.2, undo=True, max_turns=12)
    one = make_demonstrations(tasks, env, workers=1, **options)
    five = make_demonstrations(tasks, env, workers=5, **options)
    assert [d.task_id for d in one] == [t.id for t in tasks]
    assert len({d.kind for d in one}) >= 4  # several kinds, so several random draws each
    assert five == one
    with pytest.raises(ValueError, match="workers"):
        make_demonstrations(tasks, env, workers=0, **options)


def _search_demonstrations(tasks: list[Task], env: CodingEnv,
                           **options: Any) -> Iterator[Demonstration]:
    """A ``search`` demonstration of each task, played in ``env`` (closed afterwards)."""
    rng = random.Random(5)
    try:
        for task in tasks:
            yield play_demonstration(task, "search", env, rng, line_edits=True,
                                     implicit_path=True, **options)
    finally:
        env.close()


def test_search_demonstration_tries_wrong_versions_then_the_fix() -> None:
    tasks = generate_split("train", 0, 28, composed=True)
    tries: list[int] = []
    for demo in _search_demonstrations(tasks, CodingEnv(tasks)):
        observations = [o for _, o in demo.turns]
        # view, then (edit OK, test) pairs: FAIL for the wrong versions, PASS for the fix;
        # a wrong version the visible tests happen to pass is submitted (the demonstrator
        # cannot tell), so the demonstration always ends at its first PASS.
        pairs = list(zip(observations[1:-1:2], observations[2:-1:2], strict=True))
        assert all(edit == "OK" for edit, _ in pairs)
        assert [test[:4] for _, test in pairs] == ["FAIL"] * (len(pairs) - 1) + ["PASS"]
        assert parse_tool_call(demo.turns[-1][0]).call.name == "submit"
        tries.append(len(pairs))
    assert {2, 3} <= set(tries) <= {1, 2, 3}  # mostly one or two wrong tries before the fix
    assert plan_kind(random.Random(0), 0.4, 0.15, 0.3, search_fraction=1.0) == "search"


def test_search_demonstrations_make_the_wrong_tries_the_turn_budget_has_room_for() -> None:
    # view + each wrong try (edit, test, undo) + the right edit, its test, submit
    assert [search_tries(turns, undo=True) for turns in (4, 8, 10, 12, 16)] == [1, 1, 2, 2, 2]
    assert search_tries(8, undo=False) == 2
    # the tasks' own 8-turn budget left out, as for the demonstrations of a run
    tasks = [dataclasses.replace(t, budget=None)
             for t in generate_split("train", 0, 28, composed=True)]
    tries: list[int] = []
    for demo in _search_demonstrations(tasks, CodingEnv(tasks, max_turns=12), undo=True,
                                       max_turns=12):
        names = [parse_tool_call(a).call.name for a, _ in demo.turns]  # type: ignore[union-attr]
        assert len(names) <= 12 and names.count("undo") == names.count("replace") - 1
        tries.append(names.count("replace"))
    assert {2, 3} <= set(tries) <= {1, 2, 3}


def test_search_candidates_change_what_the_bug_changed() -> None:
    rng = random.Random(0)
    for _ in range(20):
        for candidate in search_candidates("    d = a + b", "    d = a - b", rng):
            assert candidate == "    d = a * b"
    for _ in range(20):
        found = search_candidates("    return low < n", "    return low <= n", rng)
        assert 1 <= len(found) <= 2 and len(set(found)) == len(found)
        assert all(c.startswith("    return low ") and c.endswith(" n") for c in found)
        assert not {"    return low < n", "    return low <= n"} & set(found)


def test_renamed_copies_are_valid_tasks_with_fresh_names() -> None:
    from tracerl.envs import Sandbox, validate_task
    from tracerl.envs.suite.augment import module_name, renamed_copies

    originals = generate_split("train", 0, 7)
    copies = renamed_copies(originals, 1, seed=0)[7:]
    sandbox = Sandbox()
    for original, copy in zip(originals, copies, strict=True):
        old, new = module_name(original), module_name(copy)
        assert old != new and copy.id == f"{original.id}~r0"
        assert old not in copy.instruction and f"test_{new}.py" in copy.files
        assert validate_task(copy, sandbox).problems == ()


def test_minimal_edit_is_the_shortest_unique_change() -> None:
    assert minimal_edit("    return a - b * 3", "    return a + b * 3") == ("-", "+")
    assert minimal_edit("    if x % 2 != 0:", "    if x % 2 == 0:") == ("!=", "==")
    # "n" alone is not unique in the line ("in", "range"): the edit grows until it is.
    old, new = minimal_edit("    for i in range(1, n):", "    for i in range(1, n + 1):")
    assert "for i in range(1, n):".count(old) == 1
    assert "    for i in range(1, n):".replace(old, new) == "    for i in range(1, n + 1):"
    with pytest.raises(ValueError, match="equal"):
        minimal_edit("x", "x")


def test_line_edit_demonstrations_solve_every_family() -> None:
    tasks = generate_split("train", 0, 14)
    env = CodingEnv(tasks)
    rng = random.Random(0)
    try:
        for task in tasks:
            demo = play_demonstration(task, "recovery", env, rng, line_edits=True)
            edits = [a for a, _ in demo.turns if '"replace"' in a]
            assert len(edits) == 2 and all('"line": ' in a for a in edits)
            assert [o for _, o in demo.turns][-2] == "PASS"  # the second edit fixed it
    finally:
        env.close()


def test_renaming_a_demonstration_equals_playing_the_renamed_task() -> None:
    from tracerl.envs.suite.augment import module_name, rename_task
    from tracerl.envs.suite.demonstrator import rename_demonstration

    for task in generate_split("train", 0, 7):
        renamed = rename_task(task, "tower_bell", f"{task.id}~rX")
        env = CodingEnv([task, renamed])
        try:
            played = play_demonstration(task, "wrong_checked", env, random.Random(3),
                                        line_edits=True)
            replayed = play_demonstration(renamed, "wrong_checked", env, random.Random(3),
                                          line_edits=True)
        finally:
            env.close()
        rewritten = rename_demonstration(played, module_name(task), "tower_bell")
        assert rewritten.first_observation == replayed.first_observation
        assert rewritten.turns == replayed.turns


def test_observation_weight_and_redraw() -> None:
    task = generate_split("train", 0, 1)[0]
    env = CodingEnv([task])
    demo = play_demonstration(task, "checked", env, random.Random(0), line_edits=True)
    env.close()
    tokenizer = train_tokenizer(demonstration_texts([demo]), vocab_size=400)
    model = build_tiny_model(tokenizer)
    chat = ChatTokens(HFPolicy(model, tokenizer), tools=None)
    sequence = tokenize_demonstration(demo, chat, tokenizer)
    drawn: list[int] = []

    def redraw(index: int, rng: random.Random) -> tuple[list[int], list[bool]]:
        drawn.append(index)
        return sequence

    result = supervised_finetune(model, [sequence], steps=2, batch_size=1, lr=1e-3, seed=0,
                                 pad_id=tokenizer.pad_token_id, observation_weight=0.5,
                                 redraw=redraw)
    assert drawn == [0, 0] and result.steps == 2
    # The context term is in the loss: the same step with and without it differs.
    fresh = [build_tiny_model(tokenizer) for _ in range(2)]
    losses = [supervised_finetune(m, [sequence], steps=1, batch_size=1, lr=1e-3, seed=0,
                                  pad_id=tokenizer.pad_token_id, observation_weight=w).losses[0]
              for m, w in zip(fresh, (0.0, 1.0), strict=True)]
    assert losses[1] > losses[0] > 0
    with pytest.raises(ValueError, match="observation_weight"):
        supervised_finetune(model, [sequence], steps=1, batch_size=1, lr=1e-3, seed=0,
                            pad_id=tokenizer.pad_token_id, observation_weight=-1.0)


def test_fresh_names_are_words_that_cannot_clash() -> None:
    import builtins
    import keyword
    import sys

    from tracerl.envs.suite.augment import fresh_name
    from tracerl.models.words import WORDS

    rng = random.Random(0)
    for _ in range(500):
        name = fresh_name(rng)
        assert all(part in WORDS for part in name.split("_"))
        assert not keyword.iskeyword(name) and not hasattr(builtins, name)
        assert name not in sys.stdlib_module_names


def _tries(count: int, seed: int) -> Iterator[tuple[Task, Demonstration]]:
    """``recovery`` and ``search`` demonstrations (with ``undo``) of ``count`` train tasks."""
    tasks = generate_split("train", 0, count, composed=True)
    env = CodingEnv(tasks)
    rng = random.Random(seed)
    kinds: tuple[DemoKind, ...] = ("recovery", "search")
    try:
        for task in tasks:
            for kind in kinds:
                yield task, play_demonstration(task, kind, env, rng, line_edits=True,
                                               implicit_path=True, undo=True)
    finally:
        env.close()


def test_undo_demonstrations_make_every_try_on_the_original_line() -> None:
    passed_wrong = 0
    for task, demo in _tries(28, 5):
        _, number, bad, _ = bug_location(task)
        calls = [parse_tool_call(a).call for a, _ in demo.turns]
        assert all(c is not None for c in calls)
        names = [c.name for c in calls if c is not None]
        # Each wrong try: edit, FAIL, undo (the line shown as the task gave it); a
        # wrong try that passes the visible tests is submitted.
        tries = names.count("replace")
        assert len(names) <= 8 and demo.turns[-2][1] == "PASS"
        if tries == 1:
            passed_wrong += 1
            continue
        assert tries == 2 and names.count("undo") == 1
        for i, name in enumerate(names):
            if name == "undo":
                assert names[i - 2:i] == ["replace", "run_tests"]
                assert demo.turns[i - 1][1].startswith("FAIL")
                assert demo.turns[i][1] == f"OK\n{number}: {bad}"
        # Every edit's old text is a piece of the buggy line, never of a wrong version.
        assert all(c.arguments["old"] in bad for c in calls
                   if c is not None and c.name == "replace")
    assert passed_wrong < 10  # rare: most wrong tries fail the visible tests


def test_train_seed_redraws_the_train_split_only(tmp_path) -> None:
    """``tasks.train_seed`` draws other train tasks (and copies) and keeps the held-out split."""
    from tracerl.train.config import config_from_dict
    from tracerl.train.trainer import Trainer

    def tasks_of(seed: int | None) -> tuple[list[Task], list[Task]]:
        config = config_from_dict({
            "run_dir": str(tmp_path / f"run{seed}"), "threads": 1, "tensorboard": False,
            "progress": False,
            "tasks": {"train_count": 6, "renamed_copies": 1, "heldout_count": 3,
                      "composed_train": True, "train_seed": seed},
            # The tools' schemas do not fit the default tiny model's context (setup refuses).
            "rollout": {"show_tool_schemas": False},
        })
        trainer = Trainer(config)
        trainer.setup()
        trainer.close()
        return trainer.train_tasks, trainer.heldout_tasks

    default_train, default_heldout = tasks_of(None)
    zero_train, _ = tasks_of(0)
    other_train, other_heldout = tasks_of(5)
    assert zero_train == default_train
    assert other_heldout == default_heldout
    assert [t.files for t in other_train[:6]] == [
        t.files for t in generate_split("train", 5, 6, composed=True)]
    assert [t.files for t in other_train] != [t.files for t in default_train]


def test_length_window_regroups_each_window_by_length(monkeypatch: pytest.MonkeyPatch) -> None:
    import tracerl.train.sft as sft

    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n"] * 4, vocab_size=300)
    sequences = [([5 + (k % 7)] * (3 + k), [True] * (3 + k)) for k in range(16)]
    seen: list[list[int]] = []
    original = sft.pad_sequences

    def recording(rows: list[tuple[list[int], list[bool]]], pad_id: int):  # type: ignore[no-untyped-def]
        seen.append(sorted(len(ids) for ids, _ in rows))
        return original(rows, pad_id)

    monkeypatch.setattr(sft, "pad_sequences", recording)
    batches = {}
    for window in (1, 4):
        seen.clear()
        model = build_tiny_model(tokenizer)
        result = supervised_finetune(model, sequences, steps=8, batch_size=2, lr=1e-3, seed=0,
                                     pad_id=0, length_window=window)
        assert result.steps == 8
        batches[window] = [list(b) for b in seen]
    for start in (0, 4):  # each window of 4 batches holds the same 8 sequences either way
        plain = sorted(n for b in batches[1][start:start + 4] for n in b)
        grouped = batches[4][start:start + 4]
        assert sorted(n for b in grouped for n in b) == plain
        # Regrouped: the batches cut the window's sorted lengths into consecutive pairs.
        assert sorted(grouped) == [plain[k:k + 2] for k in range(0, 8, 2)]
    padded = {w: sum(max(b) * len(b) for b in batches[w]) for w in (1, 4)}
    assert padded[4] < padded[1]
    with pytest.raises(ValueError, match="length_window: must be an integer >= 1"):
        supervised_finetune(build_tiny_model(tokenizer), sequences, steps=1, batch_size=2,
                            lr=1e-3, seed=0, pad_id=0, length_window=0)
