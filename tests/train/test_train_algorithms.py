"""Advantage estimators on packed attempts: whole attempts grouped by task, fragments never
independent, bootstraps from the endings, GiGPO step groups."""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest
import torch

from tracerl.trace import Attempt, EndReason, Fragment, Role, SamplingParams, Segment, Turn, pack
from tracerl.train.algorithms import ESTIMATORS, AdvantageInputs, compute_advantages
from tracerl.train.config import AlgorithmConfig, Estimator, config_from_dict, validate

SAMPLING = SamplingParams(temperature=1.0)


def act(ids: list[int]) -> Segment:
    return Segment(Role.ACTION, ids, logprobs=[-0.5] * len(ids), sampling=SAMPLING,
                   policy_version=0, engine="test")


def obs(ids: list[int], role: Role = Role.OBSERVATION) -> Segment:
    return Segment(role, ids)


def attempt(name: str, task: str, reward: float, actions: list[list[int]],
            split_after: int | None = None, process: list[float | None] | None = None
            ) -> Attempt:
    """Prompt [1, 2]; each turn: context then action; optionally compacted after a turn."""
    turns = []
    for i, ids in enumerate(actions):
        context = obs([1, 2], Role.PROMPT) if i == 0 else obs([3, 4 + i])
        reward_i = None if process is None else process[i]
        turns.append(Turn((context, act(ids)), reward_i))
    if split_after is None:
        fragments = (Fragment(0, tuple(turns), EndReason.TERMINATED),)
    else:
        head = turns[:split_after]
        rest = [Turn((obs([9, 9], Role.SUMMARY), *t.segments[1:]), t.process_reward)
                for t in turns[split_after:split_after + 1]] + turns[split_after + 1:]
        fragments = (Fragment(0, tuple(head), EndReason.CONTINUED),
                     Fragment(1, tuple(rest), EndReason.TERMINATED))
    return Attempt(name, task, f"g-{task}", fragments, reward=reward)


def batch_of(attempts: list[Attempt], critic: bool = False):  # type: ignore[no-untyped-def]
    return pack(attempts, has_critic=critic)


def test_registry_names_match_the_config_literal() -> None:
    assert set(ESTIMATORS) == {"grpo", "rloo", "gae", "gigpo"} == set(get_args(Estimator))


def test_registry_entries_say_what_each_estimator_needs() -> None:
    needs = {name: (e.needs_critic, e.needs_groups) for name, e in ESTIMATORS.items()}
    assert needs == {"grpo": (False, True), "rloo": (False, True), "gigpo": (False, True),
                     "gae": (True, False)}


def test_config_checks_read_the_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    # Declaring an estimator's needs on its entry is all the config checks use: flip what
    # grpo needs and the same config is judged by the new needs.
    monkeypatch.setitem(ESTIMATORS, "grpo", dataclasses.replace(
        ESTIMATORS["grpo"], needs_critic=True, needs_groups=False))
    with pytest.raises(ValueError, match=r"algorithm.estimator: 'grpo' needs a critic"):
        config_from_dict({"algorithm": {"estimator": "grpo"}, "rollout": {"group_size": 1}})
    config_from_dict({"algorithm": {"estimator": "grpo"}, "rollout": {"group_size": 1},
                      "critic": {"kind": "value_head"}})


def test_an_estimator_missing_from_the_registry_is_refused_by_name() -> None:
    config = config_from_dict({})
    broken = dataclasses.replace(config, algorithm=dataclasses.replace(
        config.algorithm, estimator="nope"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"algorithm.estimator: unknown 'nope'"):
        validate(broken)


def test_grpo_gives_every_token_of_an_attempt_its_group_advantage_across_fragments() -> None:
    attempts = [attempt("a", "t", 1.0, [[5, 6], [7]], split_after=1),
                attempt("b", "t", 0.0, [[5], [8, 8]]),
                attempt("c", "u", 1.0, [[5]]), attempt("d", "u", 1.0, [[6]])]
    batch = batch_of(attempts)
    result = compute_advantages(AdvantageInputs(batch, batch.token_rewards),
                                AlgorithmConfig(estimator="grpo"))
    adv = result.advantages
    for row in range(len(batch.layouts)):
        values = adv[row][batch.action_mask[row]]
        name = batch.attempt_ids[int(batch.attempt_index[row])]
        expected = {"a": 1.0, "b": -1.0, "c": 0.0, "d": 0.0}[name]
        assert torch.allclose(values, torch.full_like(values, expected), atol=1e-5)
    assert float(adv[~batch.action_mask].abs().sum()) == 0.0
    assert result.metrics["groups/uniform_fraction"] == 0.5


def test_rloo_and_dr_grpo() -> None:
    attempts = [attempt(str(i), "t", r, [[5]]) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])]
    batch = batch_of(attempts)
    rloo = compute_advantages(AdvantageInputs(batch, batch.token_rewards),
                              AlgorithmConfig(estimator="rloo")).advantages
    first = rloo[batch.action_mask].tolist()
    assert first == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    centred = compute_advantages(AdvantageInputs(batch, batch.token_rewards),
                                 AlgorithmConfig(estimator="grpo", scale="none")).advantages
    assert centred[batch.action_mask].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_process_rewards_are_group_normalised_and_summed_to_go() -> None:
    attempts = [attempt("a", "t", 1.0, [[5], [6]], process=[1.0, None]),
                attempt("b", "t", 0.0, [[5], [6]], process=[0.0, None])]
    batch = batch_of(attempts)
    adv = compute_advantages(AdvantageInputs(batch, batch.token_rewards),
                             AlgorithmConfig(estimator="grpo")).advantages
    a, b = (adv[i][batch.action_mask[i]].tolist() for i in range(2))
    # Outcome: +1 / -1. Process (normalised over the group's process rewards [1, 0]): +1 / -1,
    # on the first turn only (the reward to go of turn 2 has no process reward left).
    assert a == pytest.approx([2.0, 1.0], abs=1e-4) and b == pytest.approx([-2.0, -1.0], abs=1e-4)


def test_gae_bootstraps_a_continued_fragment_from_its_continuation_value() -> None:
    # The specification: last step of a continued fragment, reward 0, value 0.6, continuation
    # value 0.8, gamma 0.9 -> residual 0.12 (and -0.6 if it were wrongly terminal).
    one = attempt("a", "t", 1.0, [[5], [6]], split_after=1)
    batch = batch_of([one], critic=True)
    values = torch.zeros(batch.action_mask.shape)
    values[batch.action_mask] = 0.6
    bootstrap = torch.tensor([0.8, 0.0])
    config = AlgorithmConfig(estimator="gae", gamma=0.9, gae_lambda=0.0)
    result = compute_advantages(AdvantageInputs(batch, batch.token_rewards, values, bootstrap),
                                config)
    first = result.advantages[0][batch.action_mask[0]]
    assert float(first[-1]) == pytest.approx(0.12, abs=1e-6)
    assert result.returns is not None


def test_gigpo_compares_steps_from_identical_states() -> None:
    # Both attempts start in the same state (same prompt); their first actions differ, so
    # the second states differ and are not grouped.
    attempts = [attempt("a", "t", 1.0, [[5], [6]]), attempt("b", "t", 0.0, [[7], [6]])]
    batch = batch_of(attempts)
    config = AlgorithmConfig(estimator="gigpo", step_weight=1.0, gamma=0.5)
    result = compute_advantages(AdvantageInputs(batch, batch.token_rewards), config)
    a = result.advantages[0][batch.action_mask[0]].tolist()
    b = result.advantages[1][batch.action_mask[1]].tolist()
    # Episode level: +1 / -1. First step: returns 0.5 vs 0 in one step group -> +1 / -1.
    assert a == pytest.approx([2.0, 1.0], abs=1e-4)
    assert b == pytest.approx([-2.0, -1.0], abs=1e-4)
    assert result.metrics["gigpo/step_groups"] == 1.0
