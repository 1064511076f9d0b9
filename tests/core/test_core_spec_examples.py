"""Every worked example of the specification, one test each."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from tracerl import (
    aggregate_loss,
    batch_gae,
    gae,
    group_advantages,
    mixed_group_probability,
    sequence_ratio,
    token_ratios,
)

OLD = [0.5, 0.25, 0.5]
NEW = [0.6, 0.2, 0.6]


def test_three_token_ratios_are_per_token() -> None:
    ratios = token_ratios([math.log(p) for p in NEW], [math.log(p) for p in OLD])
    assert ratios == pytest.approx([1.2, 0.8, 1.2])


def test_three_token_sequence_ratio_is_the_product() -> None:
    ratio = sequence_ratio([math.log(p) for p in NEW], [math.log(p) for p in OLD])
    assert ratio == pytest.approx(1.152)
    assert ratio != pytest.approx(sum([1.2, 0.8, 1.2]) / 3)


def test_half_and_half_group_population_std() -> None:
    advantages, report = group_advantages([0, 0, 1, 1], ["task"] * 4)
    assert report.means == (0.5,) and report.stds == (0.5,)
    assert advantages == pytest.approx([-1, -1, 1, 1], abs=1e-5)
    assert report.num_uniform == 0


def test_uniform_groups_give_zero_and_are_counted_apart() -> None:
    advantages, report = group_advantages([0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1])
    assert advantages == [0.0] * 8
    assert report.num_uniform == 2
    assert report.num_uniform_zero == 1 and report.num_uniform_one == 1


@pytest.mark.parametrize(("p", "expected"), [(0.02, 0.149), (0.2, 0.832), (0.98, 0.149)])
def test_mixed_group_probability_for_eight_samples(p: float, expected: float) -> None:
    assert round(mixed_group_probability(p, 8), 3) == expected


def test_mixed_group_probability_validation() -> None:
    for bad_p in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="success_probability"):
            mixed_group_probability(bad_p, 8)
    for bad_g in (True, 2.0, 0, -3):
        with pytest.raises(ValueError, match="group_size"):
            mixed_group_probability(0.5, bad_g)  # type: ignore[arg-type]


SNIPPET_INPUT = dict(
    rewards=[0, 0, 1],
    values=[0.9, 0.3, 0.8],
    next_values=[0.3, 0.8, 0],
    terminated=[False, False, True],
    truncated=[False, False, False],
)


def test_three_step_gae_half_trace_decay() -> None:
    advantages = gae(**SNIPPET_INPUT, gamma=1.0, trace_decay=0.5)
    assert advantages == pytest.approx([-0.3, 0.6, 0.2])


def test_three_step_gae_full_trace_decay_is_return_minus_value() -> None:
    advantages = gae(**SNIPPET_INPUT, gamma=1.0, trace_decay=1.0)
    assert advantages == pytest.approx([0.1, 0.7, 0.2])


def test_three_step_batch_gae_matches() -> None:
    for trace_decay, expected in ((0.5, [-0.3, 0.6, 0.2]), (1.0, [0.1, 0.7, 0.2])):
        advantages, returns = batch_gae(
            [[0.0, 0.0, 1.0]], [[0.9, 0.3, 0.8]], [[1, 1, 1]], [0.0], 1.0, trace_decay
        )
        assert advantages[0] == pytest.approx(expected)
        assert returns[0] == pytest.approx(
            [a + v for a, v in zip(expected, [0.9, 0.3, 0.8], strict=True)]
        )


def test_spec_snippet_prints_the_spec_numbers() -> None:
    snippet = textwrap.dedent(
        """
        from tracerl import gae
        rewards = [0, 0, 1]
        values = [0.9, 0.3, 0.8]
        next_values = [0.3, 0.8, 0]
        terminated = [False, False, True]
        truncated = [False, False, False]
        for trace_decay in [0.5, 1.0]:
            advantages = gae(rewards, values, next_values, terminated, truncated,
                             gamma=1.0, trace_decay=trace_decay)
            print(trace_decay, [round(advantage, 3) for advantage in advantages])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, check=True
    )
    assert out.stdout.splitlines() == ["0.5 [-0.3, 0.6, 0.2]", "1.0 [0.1, 0.7, 0.2]"]


def test_compaction_is_not_termination() -> None:
    # Last step of a fragment: reward 0, V 0.6, continuation value 0.8, gamma 0.9.
    continued = gae([0], [0.6], [0.8], [False], [True], gamma=0.9, trace_decay=1.0)
    mistaken = gae([0], [0.6], [0.8], [True], [False], gamma=0.9, trace_decay=1.0)
    assert continued == pytest.approx([0.12])
    assert mistaken == pytest.approx([-0.6])
    fragment, _ = batch_gae([[0.0]], [[0.6]], [[1]], [0.8], 0.9, 0.95)
    terminal, _ = batch_gae([[0.0]], [[0.6]], [[1]], [0.0], 0.9, 0.95)
    assert fragment[0] == pytest.approx([0.12]) and terminal[0] == pytest.approx([-0.6])


def test_segmentation_changes_weights() -> None:
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, :2] = True
    mask[1, :] = True
    loss = torch.where(mask, torch.tensor([[1.0], [3.0]]).expand(2, 6), torch.zeros(2, 6))
    assert float(aggregate_loss(loss, mask, "sequence_mean")) == pytest.approx(2.0)
    assert float(aggregate_loss(loss, mask, "task_mean", group_ids=[0, 1])) == pytest.approx(2.0)
    assert float(aggregate_loss(loss, mask, "token_mean")) == pytest.approx(2.5)


def test_print_loop_of_the_probability_snippet() -> None:
    lines = [f"{p:.0%}: {mixed_group_probability(p, 8):.1%}" for p in [0.02, 0.2, 0.98]]
    assert lines == ["2%: 14.9%", "20%: 83.2%", "98%: 14.9%"]
