"""The moving average of the policy's weights (``update.ema_decay``).

Rank 0 keeps it beside the weights it averages (the trainable ones: a LoRA policy's adapter,
not its frozen base): it starts at the weights RL starts from, moves once per RL step, is saved
in each checkpoint (the trainer file's ``ema``) and is the run's policy when the config asks
for one (the final evaluation and ``policy/`` use it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class WeightAverage:
    """``weights``: the average, by parameter name; ``decay``: what each step keeps of it."""

    def __init__(self, weights: dict[str, torch.Tensor], decay: float) -> None:
        self.weights = weights
        self.decay = decay

    @classmethod
    def start(cls, model: torch.nn.Module, decay: float) -> WeightAverage:
        """The average of ``model``'s weights as they are now (a copy)."""
        return cls({name: value.detach().clone() for name, value in _trained(model)}, decay)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """``average <- decay * average + (1 - decay) * weights``, once per RL step."""
        weight = 1.0 - self.decay
        for name, value in _trained(model):
            self.weights[name].lerp_(value.detach(), weight)

    @contextlib.contextmanager
    def held_by(self, model: torch.nn.Module) -> Iterator[None]:
        """``model`` holds the averaged weights inside the block, its own ones again after."""
        parameters = dict(_trained(model))
        own = {name: value.detach().clone() for name, value in parameters.items()}
        with torch.no_grad():
            for name, value in parameters.items():
                value.copy_(self.weights[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, value in parameters.items():
                    value.copy_(own[name])


def _trained(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the update trains, by name (a LoRA policy's adapter: its frozen base
    would only be copied)."""
    return [(name, value) for name, value in model.named_parameters() if value.requires_grad]
