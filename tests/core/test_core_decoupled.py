"""Decoupled PPO with behavior != proximal != current: the loss and its gradient by hand.

Per action token: ``w = pi_prox / pi_behav`` truncated at the cap (or masked to 0 above it),
``r = pi_cur / pi_prox``, loss ``w * max(-r A, -clip(r, 1 - eps, 1 + eps) A)``, averaged over
the action tokens (``token_mean``). The values below are chosen so each case is visible:

=====  ======  ======  ======  ====  ==========================  ====================
token  behav   prox    cur     A     w (truncate / mask, cap 2)  r, surrogate
=====  ======  ======  ======  ====  ==========================  ====================
1      0.5     0.4     0.44    +1    0.8 / 0.8                   1.1 inside: -1.1
2      0.1     0.3     0.45    +2    3 -> 2 / 0                  1.5 clipped: -2.4
3      0.2     0.25    0.225   -1    1.25 / 1.25                 0.9 inside: 0.9
=====  ======  ======  ======  ====  ==========================  ====================

d loss_t / d log pi_cur = -w r A where the ratio is inside the clip range, 0 where clipped.
"""

from __future__ import annotations

import math

import pytest
import torch

from tracerl.core import loss_weights, ppo_token_loss, truncated_importance_weights

BEHAVIOR = [0.5, 0.1, 0.2]
PROXIMAL = [0.4, 0.3, 0.25]
CURRENT = [0.44, 0.45, 0.225]
ADVANTAGES = [1.0, 2.0, -1.0]


def _loss(mode: str, behavior: list[float] = BEHAVIOR
          ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    log = lambda values: torch.tensor([[math.log(v) for v in values]],  # noqa: E731
                                      dtype=torch.float64)
    current = log(CURRENT).requires_grad_(True)
    proximal, behav = log(PROXIMAL), log(behavior)
    mask = torch.ones(1, 3, dtype=torch.bool)
    weights, metrics = truncated_importance_weights(proximal, behav, mask, cap=2.0,
                                                    mode=mode)  # type: ignore[arg-type]
    per_token, _ = ppo_token_loss(current, proximal, torch.tensor([ADVANTAGES],
                                                                  dtype=torch.float64),
                                  mask, clip_low=0.2, importance_weights=weights)
    loss = (loss_weights(mask, "token_mean") * per_token).sum()
    loss.backward()
    assert current.grad is not None
    return loss.detach(), current.grad[0], metrics


@pytest.mark.parametrize(("mode", "w2"), [("truncate", 2.0), ("mask", 0.0)])
def test_decoupled_loss_and_gradient_by_hand(mode: str, w2: float) -> None:
    loss, grad, metrics = _loss(mode)
    w = [0.8, w2, 1.25]
    surrogate = [-1.1 * 1.0, -1.2 * 2.0, 0.9]  # token 2: clip(1.5) = 1.2
    assert float(loss) == pytest.approx(sum(a * b for a, b in zip(w, surrogate, strict=True)) / 3)
    # Token 2 is clipped (no gradient); 1 and 3 have -w r A.
    expected = torch.tensor([-0.8 * 1.1 * 1.0, 0.0, -1.25 * 0.9 * -1.0], dtype=torch.float64) / 3
    assert torch.allclose(grad, expected, atol=1e-12)
    assert metrics["mismatch/fraction_over_cap"] == pytest.approx(1 / 3)  # token 2


def test_behavior_enters_only_the_importance_weight() -> None:
    """The clipped ratio is current/proximal: with behavior equal to proximal (the synchronous
    case, k = 0) the weights are 1 and the loss is plain PPO's on current/proximal."""
    loss, grad, metrics = _loss("truncate", behavior=PROXIMAL)
    plain = (-1.1 * 1.0 - 1.2 * 2.0 + 0.9) / 3
    assert float(loss) == pytest.approx(plain)
    expected = torch.tensor([-1.1, 0.0, 0.9], dtype=torch.float64) / 3
    assert torch.allclose(grad, expected, atol=1e-12)
    assert metrics["mismatch/fraction_over_cap"] == 0.0


def test_mask_mode_is_refused_when_misspelt() -> None:
    with pytest.raises(ValueError, match="mode must be 'truncate' or 'mask'"):
        truncated_importance_weights(torch.zeros(1, 2), torch.zeros(1, 2),
                                     torch.ones(1, 2, dtype=torch.bool), mode="clip")  # type: ignore[arg-type]
