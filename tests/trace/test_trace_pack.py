from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracerl.trace import (
    ATTEMPT_ENDINGS,
    END_REASONS,
    ROLES,
    Attempt,
    EndReason,
    Fragment,
    Role,
    SamplingParams,
    Segment,
    Treatment,
    Turn,
    default_treatments,
    pack,
    unpack,
)
from tracerl.trace.synthetic import synthetic_attempt

SAMPLING = SamplingParams(temperature=1.0)
ACTION = ROLES.index(Role.ACTION)

token_lists = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5)
float32s = st.floats(-8.0, 0.0, width=32)


@st.composite
def segments(draw: st.DrawFn, role: Role) -> Segment:
    ids = draw(token_lists)
    if role is Role.ACTION:
        logprobs = draw(st.lists(float32s, min_size=len(ids), max_size=len(ids)))
        return Segment(role, ids, logprobs, SAMPLING, draw(st.integers(0, 5)),
                       draw(st.sampled_from(["hf", "vllm"])))
    return Segment(role, ids)


@st.composite
def turns(draw: st.DrawFn, head: Role | None) -> Turn:
    segs = [] if head is None else [draw(segments(head))]
    for _ in range(draw(st.integers(1, 2))):
        segs.append(draw(segments(Role.ACTION)))
        if draw(st.booleans()):
            segs.append(draw(segments(Role.OBSERVATION)))
    reward = draw(st.none() | st.floats(-1.0, 1.0, width=32))
    return Turn(tuple(segs), reward)


@st.composite
def attempts(draw: st.DrawFn, attempt_id: str, group_id: str) -> Attempt:
    n_fragments = draw(st.integers(1, 3))
    end = draw(st.sampled_from(ATTEMPT_ENDINGS))
    chain = []
    for f in range(n_fragments):
        head = Role.PROMPT if f == 0 else Role.SUMMARY
        body = [draw(turns(head))] + [draw(turns(None)) for _ in range(draw(st.integers(0, 2)))]
        last = f == n_fragments - 1
        continuation = draw(st.lists(st.integers(0, 1000), max_size=3)) if last else []
        chain.append(Fragment(f, tuple(body), end if last else EndReason.CONTINUED,
                              continuation))
    reward = draw(st.floats(0.0, 1.0, width=32))
    return Attempt(attempt_id, f"task-{group_id}", group_id, tuple(chain), reward=reward)


@st.composite
def batches(draw: st.DrawFn) -> list[Attempt]:
    n = draw(st.integers(1, 5))
    return [draw(attempts(f"a{i}", f"g{draw(st.integers(0, 1))}")) for i in range(n)]


def _included(batch: list[Attempt], table: dict[EndReason, Treatment]) -> list[Attempt]:
    return [a for a in batch if table[a.end_reason] in (Treatment.SCORE, Treatment.BOOTSTRAP)]


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(["left", "right"]), st.booleans())
def test_unpack_inverts_pack_exactly(batch: list[Attempt], side: str, critic: bool) -> None:
    table = default_treatments(critic)
    packed = pack(batch, has_critic=critic, padding_side=side, min_group_size=1)  # type: ignore[arg-type]
    assert unpack(packed) == _included(batch, table)
    assert packed.report.excluded.keys() <= {r.value for r in ATTEMPT_ENDINGS}


@settings(max_examples=25, deadline=None)
@given(batches())
def test_padding_side_never_changes_a_row(batch: list[Attempt]) -> None:
    right = pack(batch, has_critic=True, padding_side="right", pad_token_id=7)
    left = pack(batch, has_critic=True, padding_side="left", pad_token_id=7)
    assert right.input_ids.shape == left.input_ids.shape
    for name in ("input_ids", "action_mask", "role_ids", "behavior_logprobs", "policy_version",
                 "token_rewards"):
        for b in range(right.input_ids.shape[0]):
            r = getattr(right, name)[b][right.attention_mask[b] == 1]
            l_ = getattr(left, name)[b][left.attention_mask[b] == 1]
            assert torch.equal(r, l_), name
            # Off the real tokens everything is the documented neutral value.
            pad = getattr(right, name)[b][right.attention_mask[b] == 0]
            assert bool((pad == {"input_ids": 7, "role_ids": -1, "policy_version": -1}
                         .get(name, 0)).all()), name
    for b in range(right.continuation_ids.shape[0]):
        assert torch.equal(right.continuation_ids[b][right.continuation_mask[b] == 1],
                           left.continuation_ids[b][left.continuation_mask[b] == 1])
    for name in ("needs_bootstrap", "attempt_index", "group_index", "fragment_index",
                 "end_reason", "attempt_rewards", "attempt_scored"):
        assert torch.equal(getattr(right, name), getattr(left, name)), name


@settings(max_examples=25, deadline=None)
@given(batches())
def test_only_action_tokens_are_action_positions(batch: list[Attempt]) -> None:
    packed = pack(batch, has_critic=True)
    roles = packed.role_ids
    assert torch.equal(packed.action_mask, roles == ACTION)
    off = ~packed.action_mask
    assert bool((packed.behavior_logprobs[off] == 0).all())
    assert bool((packed.policy_version[off] == -1).all())
    assert bool((packed.token_rewards[off] == 0).all())
    assert bool((packed.action_mask <= packed.attention_mask.bool()).all())


def _simple(attempt_id: str, group: str, end: EndReason, reward: float | None = 1.0,
            fragments: int = 1) -> Attempt:
    rng = np.random.default_rng(abs(hash(attempt_id)) % 2**32)
    return synthetic_attempt(rng, attempt_id, task_id=group, group_id=group,
                             total_tokens=40, turns=2, fragments=fragments, end=end,
                             reward=reward)


def test_reward_sits_on_the_last_action_token_of_the_final_fragment() -> None:
    attempt = _simple("a", "g", EndReason.TERMINATED, reward=0.75, fragments=2)
    packed = pack([attempt], has_critic=True)
    assert packed.input_ids.shape[0] == 2
    final = packed.token_rewards[1]
    last_action = int(torch.nonzero(packed.action_mask[1]).max())
    assert float(final[last_action]) == 0.75
    assert float(final.sum()) == 0.75 and float(packed.token_rewards[0].sum()) == 0.0
    # The continued fragment bootstraps from the next fragment's context before its first
    # action (summary + observation), the terminated one does not bootstrap.
    assert packed.needs_bootstrap.tolist() == [True, False]
    second = attempt.fragments[1].turns[0].segments
    assert second[0].role is Role.SUMMARY and second[1].role is Role.ACTION
    expected = second[0].token_ids.tolist()
    assert packed.continuation_ids[0][packed.continuation_mask[0] == 1].tolist() == expected
    assert int(packed.continuation_mask[1].sum()) == 0
    assert packed.end_reason.tolist() == [END_REASONS.index(EndReason.CONTINUED),
                                          END_REASONS.index(EndReason.TERMINATED)]


def test_truncation_bootstraps_from_the_row_plus_its_continuation_with_a_critic() -> None:
    attempt = _simple("a", "g", EndReason.TRUNCATED_TURNS)
    last = dataclasses.replace(attempt.fragments[-1], continuation_ids=[5, 6, 7])
    attempt = dataclasses.replace(attempt, fragments=(last,))
    packed = pack([attempt], has_critic=True)
    assert packed.needs_bootstrap.tolist() == [True]
    assert float(packed.token_rewards.sum()) == 0.0
    row = packed.input_ids[0][packed.attention_mask[0] == 1].tolist()
    assert packed.continuation_ids[0].tolist() == [*row, 5, 6, 7]
    assert packed.attempt_scored.tolist() == [False]
    # Without a critic the truncation is scored by the verifier instead.
    scored = pack([attempt, _simple("b", "g", EndReason.TERMINATED)], has_critic=False)
    assert scored.needs_bootstrap.tolist() == [False, False]
    assert float(scored.token_rewards[0].sum()) == 1.0


def test_excluded_attempts_leave_the_group_and_small_groups_are_dropped() -> None:
    batch = [
        _simple("a1", "g1", EndReason.TERMINATED, 1.0),
        _simple("a2", "g1", EndReason.TOOL_ERROR, None),
        _simple("a3", "g1", EndReason.TERMINATED, 0.0),
        _simple("b1", "g2", EndReason.TERMINATED, 1.0),
        _simple("b2", "g2", EndReason.CANCELLED, None),
    ]
    packed = pack(batch, has_critic=False)
    assert packed.attempt_ids == ("a1", "a3")
    assert packed.group_ids == ("g1",)
    assert packed.report.excluded == {"tool_error": 1, "cancelled": 1}
    assert packed.report.dropped_groups == ("g2",)
    assert packed.report.dropped_attempts == 1
    assert packed.attempt_rewards.tolist() == [1.0, 0.0]
    assert packed.attempt_group_index.tolist() == [0, 0]
    with_critic = pack(batch, has_critic=True)
    assert with_critic.attempt_ids == ("a1", "a3", "b1")
    retry = {**default_treatments(False), EndReason.TOOL_ERROR: Treatment.RETRY}
    assert pack(batch, has_critic=False, treatments=retry).report.retry == {"tool_error": 1}


def test_bad_input_is_refused_with_the_argument_named() -> None:
    ok = _simple("a", "g", EndReason.TERMINATED)
    with pytest.raises(ValueError, match="needs a critic"):
        pack([ok], has_critic=False, treatments=default_treatments(True))
    with pytest.raises(ValueError, match="has no reward"):
        pack([_simple("b", "g", EndReason.TERMINATED, None)], has_critic=True)
    with pytest.raises(ValueError, match="appears twice"):
        pack([ok, ok], has_critic=True)
    with pytest.raises(ValueError, match="max_length"):
        pack([ok], has_critic=True, max_length=5)
    with pytest.raises(ValueError, match="padding_side"):
        pack([ok], has_critic=True, padding_side="middle")  # type: ignore[arg-type]
    broken = dataclasses.replace(ok, fragments=(dataclasses.replace(
        ok.fragments[0], end=EndReason.CONTINUED),))
    with pytest.raises(ValueError, match="one ending per attempt"):
        pack([broken], has_critic=True)


def test_process_rewards_land_on_the_last_action_token_of_their_turn() -> None:
    ctx = Segment(Role.PROMPT, [1, 2])
    act1 = Segment(Role.ACTION, [3, 4], [-0.5, -0.5], SAMPLING, 0, "hf")
    obs = Segment(Role.OBSERVATION, [5])
    act2 = Segment(Role.ACTION, [6], [-0.25], SAMPLING, 1, "hf")
    attempt = Attempt("a", "t", "g", (Fragment(0, (
        Turn((ctx, act1, obs), process_reward=0.25), Turn((act2,), process_reward=None)),
        EndReason.TERMINATED),), reward=1.0)
    packed = pack([attempt], has_critic=True)
    assert packed.token_rewards[0].tolist() == [0, 0, 0, 0.25, 0, 1.0]
    assert packed.policy_version[0].tolist() == [-1, -1, 0, 0, -1, 1]
    assert packed.action_mask[0].tolist() == [False, False, True, True, False, True]
