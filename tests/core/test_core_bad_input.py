"""Bad input raises ValueError naming the argument, never a silent NaN."""

from __future__ import annotations

import math

import pytest
import torch

from tracerl import (
    aggregate_loss,
    batch_gae,
    gae,
    group_advantages,
    loss_weights,
    min_group_size_for_mixed,
    ppo_token_loss,
    rloo_advantages,
    sequence_ratio,
    token_ratios,
    whiten,
)

GOOD = dict(rewards=[[0.0, 1.0]], values=[[0.5, 0.5]], action_mask=[[1, 1]], bootstrap_values=[0.0])


def _batch(**change):
    return {**GOOD, **change}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"values": [[0.5, 0.5, 0.5]]}, "values"),
        ({"action_mask": [[1]]}, "action_mask"),
        ({"bootstrap_values": [0.0, 1.0]}, "bootstrap_values"),
        ({"rewards": [[math.nan, 1.0]]}, "rewards"),
        ({"values": [[0.5, math.inf]]}, "values"),
        ({"bootstrap_values": [math.nan]}, "bootstrap_values"),
        ({"action_mask": [[1, 2]]}, "action_mask"),
        ({"rewards": [[1.0, 1.0]], "action_mask": [[0, 1]]}, "rewards"),
        ({"rewards": [0.0, 1.0]}, "rewards"),
    ],
)
def test_batch_gae_rejects(change: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        batch_gae(**_batch(**change))


@pytest.mark.parametrize(
    ("gamma", "trace_decay", "named"),
    [
        (1.5, 1.0, "gamma"),
        (-0.1, 1.0, "gamma"),
        (1.0, 2.0, "trace_decay"),
        (1.0, math.nan, "trace_decay"),
    ],
)
def test_coefficients_outside_unit_interval(gamma: float, trace_decay: float, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        batch_gae(**GOOD, gamma=gamma, trace_decay=trace_decay)
    with pytest.raises(ValueError, match=named):
        gae([0.0], [0.0], [0.0], [True], [False], gamma=gamma, trace_decay=trace_decay)


def test_gae_rejects_mismatched_lengths_and_nan() -> None:
    with pytest.raises(ValueError, match="next_values"):
        gae([0.0, 1.0], [0.0, 0.0], [0.0], [False, True], [False, False])
    with pytest.raises(ValueError, match="values"):
        gae([0.0], [math.nan], [0.0], [True], [False])


def test_ratios_reject_nan_and_shapes() -> None:
    with pytest.raises(ValueError, match="old_logprobs"):
        token_ratios([0.0, 0.0], [0.0])
    with pytest.raises(ValueError, match="new_logprobs"):
        sequence_ratio([math.nan], [0.0])
    with pytest.raises(ValueError, match="old_logprobs"):
        ppo_token_loss(
            torch.zeros(1, 2), torch.tensor([[0.0, math.inf]]), torch.zeros(1, 2), torch.ones(1, 2)
        )


def test_groups_reject_singletons_and_empty() -> None:
    with pytest.raises(ValueError, match="group of one"):
        group_advantages([1.0, 0.0, 1.0], ["a", "a", "b"])
    with pytest.raises(ValueError, match="group of one"):
        rloo_advantages([1.0], ["a"])
    with pytest.raises(ValueError, match="rewards is empty"):
        group_advantages([], [])
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages([1.0, 0.0], ["a"])


def test_loss_weights_reject_rows_without_actions() -> None:
    mask = torch.tensor([[1, 1], [0, 0]])
    with pytest.raises(ValueError, match="row 1"):
        loss_weights(mask, "sequence_mean")
    with pytest.raises(ValueError, match="no action position"):
        loss_weights(torch.zeros(2, 2), "token_mean")
    with pytest.raises(ValueError, match="group_ids"):
        loss_weights(mask, "task_mean")
    with pytest.raises(ValueError, match="constant"):
        loss_weights(mask, "constant")
    with pytest.raises(ValueError, match="mode"):
        loss_weights(mask, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss"):
        aggregate_loss(torch.tensor([[math.nan, 0.0], [0.0, 0.0]]), torch.ones(2, 2), "token_mean")


def test_whiten_and_group_size_helper_reject() -> None:
    with pytest.raises(ValueError, match="mask"):
        whiten([1.0, 2.0], [0, 0])
    with pytest.raises(ValueError, match="wanted_fraction"):
        min_group_size_for_mixed(0.5, 1.0)
    with pytest.raises(ValueError, match="no group size"):
        min_group_size_for_mixed(1.0, 0.5)
    assert min_group_size_for_mixed(0.2, 0.832) == 8
