"""The packed batch goes straight into core's estimators, with no reshaping in between."""

from __future__ import annotations

import numpy as np
import torch

from tracerl.core import batch_gae, group_advantages, loss_weights
from tracerl.trace import EndReason, pack
from tracerl.trace.synthetic import synthetic_attempt


def _batch() -> list[object]:
    rng = np.random.default_rng(3)
    ends = [EndReason.TERMINATED, EndReason.TRUNCATED_TURNS, EndReason.TERMINATED,
            EndReason.TOOL_ERROR]
    return [
        synthetic_attempt(rng, f"a{i}", task_id=f"t{i // 2}", group_id=f"t{i // 2}",
                          total_tokens=60, turns=3, fragments=1 + i % 2, end=ends[i],
                          reward=None if ends[i] is EndReason.TOOL_ERROR else float(i % 2))
        for i in range(4)
    ]


def test_critic_path_batch_gae_and_loss_weights() -> None:
    packed = pack(_batch(), has_critic=True, padding_side="left")  # type: ignore[arg-type]
    values = torch.rand(packed.input_ids.shape) * packed.action_mask
    # The trainer runs the critic on continuation_ids; here a constant stands in for its output.
    bootstrap = torch.where(packed.needs_bootstrap, torch.tensor(0.5), torch.tensor(0.0))
    advantages, returns = batch_gae(packed.token_rewards, values, packed.action_mask, bootstrap,
                                    gamma=1.0, trace_decay=0.95)
    assert advantages.shape == packed.input_ids.shape
    assert bool((advantages[~packed.action_mask] == 0).all())
    on = packed.action_mask
    assert torch.allclose(returns[on], advantages[on] + values[on])
    weights = loss_weights(packed.action_mask, "task_mean", group_ids=packed.task_index)
    assert abs(float(weights.sum()) - 1.0) < 1e-9


def test_group_path_advantages_over_whole_attempts() -> None:
    packed = pack(_batch(), has_critic=False)  # type: ignore[arg-type]
    # Group t1 lost its tool_error attempt and fell below two attempts: dropped and counted.
    assert packed.report.excluded == {"tool_error": 1}
    assert packed.report.dropped_groups == ("t1",)
    advantages, report = group_advantages(packed.attempt_rewards, packed.attempt_group_index)
    assert report is not None
    per_row = torch.as_tensor(advantages)[packed.attempt_index]  # every fragment of an attempt
    token_advantages = per_row[:, None] * packed.action_mask
    assert token_advantages.shape == packed.input_ids.shape
    weights = loss_weights(packed.action_mask, "sequence_mean")
    assert abs(float(weights.sum()) - 1.0) < 1e-9
