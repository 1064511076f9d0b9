"""Rows of random tokens, actions, advantages and returns for the update's tests.

Not a test module itself: tests import it by adding this folder to ``sys.path``.
"""

from __future__ import annotations

import torch

from tracerl.train.update import RowBatch

VOCAB = 50
"""Token ids are drawn below this."""


def make_batch(rows: int = 6, width: int = 20, side: str = "right", extra_pad: int = 0,
               critic: bool = False) -> RowBatch:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(6, width + 1, (rows,), generator=generator)
    total = width + extra_pad
    ids = torch.zeros(rows, total, dtype=torch.long)
    attention = torch.zeros(rows, total, dtype=torch.long)
    action = torch.zeros(rows, total, dtype=torch.bool)
    advantages = torch.zeros(rows, total)
    behavior = torch.zeros(rows, total)
    returns = torch.zeros(rows, total)
    for b in range(rows):
        n = int(lengths[b])
        tokens = torch.randint(1, VOCAB, (n,), generator=generator)
        act = torch.rand(n, generator=generator) < 0.6
        act[0] = False
        act[-1] = True
        adv = torch.randn(n, generator=generator)
        beh = -torch.rand(n, generator=generator) * 3
        ret = torch.rand(n, generator=generator)
        cols = slice(0, n) if side == "right" else slice(total - n, total)
        ids[b, cols], attention[b, cols], action[b, cols] = tokens, 1, act
        advantages[b, cols] = adv * act
        behavior[b, cols] = beh * act
        returns[b, cols] = ret * act
    return RowBatch(ids, attention, action, advantages.double(), behavior.double(),
                    torch.tensor([b % 3 for b in range(rows)]),
                    returns=returns.double() if critic else None)
