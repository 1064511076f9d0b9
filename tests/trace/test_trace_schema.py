from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tracerl.trace import (
    ATTEMPT_ENDINGS,
    EndReason,
    Fragment,
    Role,
    SamplingParams,
    Segment,
    Treatment,
    Turn,
    check_attempt,
    default_treatments,
    validate_treatments,
)
from tracerl.trace.synthetic import synthetic_attempt

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=50)


def test_every_enum_value_has_a_docstring() -> None:
    import inspect

    from tracerl.trace import schema

    source = inspect.getsource(schema)
    for enum in (Role, EndReason, Treatment):
        for member in enum:
            assert f'{member.name} = "{member.value}"\n    """' in source, member


def test_default_treatments_cover_every_ending_and_follow_the_documented_choice() -> None:
    with_critic = default_treatments(has_critic=True)
    without = default_treatments(has_critic=False)
    assert set(with_critic) == set(without) == set(ATTEMPT_ENDINGS)
    assert EndReason.CONTINUED not in with_critic
    for reason in (EndReason.TRUNCATED_TOKENS, EndReason.TRUNCATED_TURNS,
                   EndReason.BUDGET_EXHAUSTED):
        assert with_critic[reason] is Treatment.BOOTSTRAP
        assert without[reason] is Treatment.SCORE
    assert with_critic[EndReason.TIMEOUT] is Treatment.BOOTSTRAP
    assert without[EndReason.TIMEOUT] is Treatment.EXCLUDE
    for table in (with_critic, without):
        assert table[EndReason.TERMINATED] is Treatment.SCORE
        assert table[EndReason.TOOL_ERROR] is Treatment.EXCLUDE
        assert table[EndReason.CANCELLED] is Treatment.EXCLUDE
        assert validate_treatments(table, has_critic=table is with_critic) == table


def test_bootstrap_is_refused_without_a_critic() -> None:
    with pytest.raises(ValueError, match="needs a critic"):
        validate_treatments(default_treatments(has_critic=True), has_critic=False)


def test_infrastructure_failures_cannot_be_scored() -> None:
    table = {**default_treatments(False), EndReason.TOOL_ERROR: Treatment.SCORE}
    with pytest.raises(ValueError, match="infrastructure failure"):
        validate_treatments(table, has_critic=False)


def test_continued_has_no_treatment_and_missing_endings_are_named() -> None:
    with pytest.raises(ValueError, match="not an attempt ending"):
        validate_treatments({EndReason.CONTINUED: Treatment.SCORE}, has_critic=False)
    table = default_treatments(False)
    del table[EndReason.TIMEOUT]
    with pytest.raises(ValueError, match="timeout"):
        validate_treatments(table, has_critic=False)


def test_segments_are_immutable_int32_arrays_compared_by_content() -> None:
    a = Segment(Role.ACTION, [1, 2, 3], [-0.5, -0.25, -1.0], SAMPLING, 3, "hf")
    b = Segment(Role.ACTION, np.array([1, 2, 3]), np.array([-0.5, -0.25, -1.0]), SAMPLING, 3,
                "hf")
    assert a == b
    assert a.token_ids.dtype == np.int32 and a.logprobs is not None
    assert a.logprobs.dtype == np.float32
    with pytest.raises(ValueError):
        a.token_ids[0] = 5
    assert a != dataclasses.replace(a, policy_version=4)
    with pytest.raises(ValueError, match="token_ids"):
        Segment(Role.PROMPT, [-1])
    with pytest.raises(ValueError, match="token_ids"):
        Segment(Role.PROMPT, [2**31])


def _attempt_with(**changes: object) -> object:
    rng = np.random.default_rng(0)
    attempt = synthetic_attempt(rng, "a", total_tokens=60, turns=3, fragments=2)
    return dataclasses.replace(attempt, **changes)


def _first_action(attempt: object) -> tuple[int, int, int]:
    for f, fragment in enumerate(attempt.fragments):  # type: ignore[attr-defined]
        for t, turn in enumerate(fragment.turns):
            for s, seg in enumerate(turn.segments):
                if seg.role is Role.ACTION:
                    return f, t, s
    raise AssertionError


def _replace_segment(attempt: object, where: tuple[int, int, int], segment: Segment) -> object:
    f, t, s = where
    fragments = list(attempt.fragments)  # type: ignore[attr-defined]
    turns = list(fragments[f].turns)
    segs = list(turns[t].segments)
    segs[s] = segment
    turns[t] = dataclasses.replace(turns[t], segments=tuple(segs))
    fragments[f] = dataclasses.replace(fragments[f], turns=tuple(turns))
    return dataclasses.replace(attempt, fragments=tuple(fragments))  # type: ignore[type-var]


def test_valid_synthetic_attempts_pass() -> None:
    assert check_attempt(_attempt_with()) == []  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mutate", "rule"),
    [
        (lambda a, w: _replace_segment(a, w, dataclasses.replace(
            _seg(a, w), logprobs=_seg(a, w).logprobs[:-1])), "logprob count"),
        (lambda a, w: _replace_segment(a, w, dataclasses.replace(_seg(a, w), logprobs=None)),
         "logprob count"),
        (lambda a, w: _replace_segment(a, w, dataclasses.replace(
            _seg(a, w), logprobs=np.abs(_seg(a, w).logprobs) + 0.1)), "logprob range"),
        (lambda a, w: _replace_segment(a, w, dataclasses.replace(_seg(a, w), sampling=None)),
         "sampling params"),
        (lambda a, w: _replace_segment(a, w, dataclasses.replace(_seg(a, w),
                                                                 policy_version=None)),
         "policy version"),
        (lambda a, w: _replace_segment(a, w, dataclasses.replace(_seg(a, w), engine="")),
         "engine"),
        (lambda a, w: _replace_segment(a, (0, 0, 0), Segment(Role.OBSERVATION, [1], [-1.0])),
         "roles"),
        (lambda a, w: dataclasses.replace(a, fragments=(a.fragments[0],)),
         "one ending per attempt"),
        (lambda a, w: dataclasses.replace(a, fragments=(a.fragments[1],)), "fragment chain"),
        (lambda a, w: dataclasses.replace(a, fragments=(
            a.fragments[0], dataclasses.replace(a.fragments[1], index=5))), "fragment chain"),
        (lambda a, w: dataclasses.replace(a, fragments=(
            dataclasses.replace(a.fragments[0], end=EndReason.TIMEOUT), a.fragments[1])),
         "one ending per attempt"),
        (lambda a, w: dataclasses.replace(a, fragments=()), "fragment chain"),
        (lambda a, w: dataclasses.replace(a, reward=float("nan")), "reward"),
        (lambda a, w: dataclasses.replace(a, fragments=(
            dataclasses.replace(a.fragments[0], turns=(Turn(
                a.fragments[0].turns[0].segments[:1], process_reward=0.5),)),
            a.fragments[1])), "process reward"),
        (lambda a, w: dataclasses.replace(a, fragments=(
            dataclasses.replace(a.fragments[0], continuation_ids=(1, 2)), a.fragments[1])),
         "continuation"),
    ],
)
def test_check_attempt_names_each_broken_rule(mutate: object, rule: str) -> None:
    attempt = _attempt_with()
    broken = mutate(attempt, _first_action(attempt))  # type: ignore[operator]
    problems = check_attempt(broken)
    assert problems, rule
    assert any(p.startswith(rule) for p in problems), problems


def _seg(attempt: object, where: tuple[int, int, int]) -> Segment:
    f, t, s = where
    return attempt.fragments[f].turns[t].segments[s]  # type: ignore[attr-defined, no-any-return]


def test_fragment_starting_with_an_action_is_refused() -> None:
    attempt = _attempt_with()
    second = attempt.fragments[1]  # type: ignore[attr-defined]
    action_only = Turn(tuple(s for s in second.turns[0].segments if s.role is Role.ACTION))
    broken = dataclasses.replace(attempt, fragments=(  # type: ignore[type-var]
        attempt.fragments[0], Fragment(1, (action_only, *second.turns[1:]), second.end)))  # type: ignore[attr-defined]
    assert any("starts with an action" in p for p in check_attempt(broken))
