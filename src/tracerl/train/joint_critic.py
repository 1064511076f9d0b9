"""The centralized critic: a value of the joint context, used only while training.

Centralized training with decentralized execution (MADDPG's critic, MAPPO's centralized value):
each actor samples from its own context alone, as it will when deployed, but the baseline its
update subtracts may use everything that happened in the joint attempt. The critic here reads
the *joint context*: every agent's context and actions, interleaved in the order the turns
happened (:func:`joint_sequence`), and its value at the token before an action is that
action's baseline. Advantages are the acting agent's reward minus that value; the critic is
then fitted to the rewards (squared error). Actors never see the joint sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tracerl.models.tiny import TinyModelConfig, build_tiny_model
from tracerl.rollout.collect.joint import JointAttempt
from tracerl.trace import PackedBatch, Role
from tracerl.train.algorithms import turn_spans


@dataclass(frozen=True)
class JointSequence:
    """One joint attempt as the critic reads it."""

    token_ids: tuple[int, ...]
    """Every agent's context and actions, in the order the turns happened."""
    positions: dict[tuple[str, int], int]
    """``(agent, turn)`` → position of the last token before that turn's action."""


def joint_sequence(joint: JointAttempt) -> JointSequence:
    """The joint context of ``joint``: for each turn in the order taken, the acting agent's new
    context tokens, then its action."""
    ids: list[int] = []
    positions: dict[tuple[str, int], int] = {}
    for agent, index in joint.order:
        turn = joint.attempts[agent].fragments[0].turns[index]
        for segment in turn.segments:
            if segment.role is Role.ACTION:
                positions[(agent, index)] = len(ids) - 1
            ids.extend(int(t) for t in segment.token_ids)
    return JointSequence(tuple(ids), positions)


class CentralizedCritic(torch.nn.Module):
    """A tiny Llama trunk and a linear value head over the joint context."""

    def __init__(self, tokenizer: object, shape: TinyModelConfig, *, seed: int) -> None:
        super().__init__()
        model = build_tiny_model(tokenizer, shape, seed=seed)  # type: ignore[arg-type]
        self.trunk: torch.nn.Module = model.model
        self.head = torch.nn.Linear(shape.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.inputs: list[torch.Tensor] = []
        """The token ids of the latest :meth:`values` call (what the critic was given)."""

    def values(self, sequences: Sequence[JointSequence], pad_id: int) -> list[torch.Tensor]:
        """Each sequence's value at its action positions, in ``positions`` order."""
        width = max(len(s.token_ids) for s in sequences)
        ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, :len(sequence.token_ids)] = torch.tensor(sequence.token_ids)
            mask[row, :len(sequence.token_ids)] = 1
        self.inputs = [ids[row, :len(s.token_ids)] for row, s in enumerate(sequences)]
        hidden = self.trunk(input_ids=ids, attention_mask=mask).last_hidden_state
        values = self.head(hidden).squeeze(-1)  # (B, T)
        return [values[row, list(s.positions.values())] for row, s in enumerate(sequences)]


def centralized_advantages(critic: CentralizedCritic, optimizer: torch.optim.Optimizer,
                           joints: Sequence[JointAttempt], pad_id: int, *, epochs: int = 1
                           ) -> tuple[dict[tuple[str, str, int], float], dict[str, float]]:
    """``(joint id, agent, turn)`` → the acting agent's reward minus the critic's value of
    the joint context before that action (values from the critic as it was before this call),
    then ``epochs`` full-batch steps fitting the critic to the rewards. Joint attempts without
    a reward (a tool error) are left out. Returns the advantages and the critic's metrics."""
    scored = [j for j in joints if all(r is not None for r in j.rewards.values()) and j.order]
    if not scored:
        return {}, {}
    sequences = [joint_sequence(j) for j in scored]
    targets = [torch.tensor([float(j.rewards[agent] or 0.0) for agent, _ in s.positions])
               for j, s in zip(scored, sequences, strict=True)]
    critic.eval()
    with torch.no_grad():
        before = critic.values(sequences, pad_id)
    advantages: dict[tuple[str, str, int], float] = {}
    for joint, sequence, value, target in zip(scored, sequences, before, targets, strict=True):
        for (agent, turn), v, r in zip(sequence.positions, value.tolist(), target.tolist(),
                                       strict=True):
            advantages[(joint.joint_id, agent, turn)] = r - v
    critic.train()
    losses = []
    for _ in range(epochs):
        predicted = critic.values(sequences, pad_id)
        loss = torch.cat([(p - t) ** 2 for p, t in zip(predicted, targets, strict=True)]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    flat_before = torch.cat(before)
    flat_targets = torch.cat(targets)
    variance = float(flat_targets.var(unbiased=False))
    explained = (1.0 - float(((flat_targets - flat_before) ** 2).mean()) / variance
                 if variance > 0 else 0.0)
    return advantages, {"value_loss": losses[-1], "explained_variance": explained,
                        "value_mean": float(flat_before.mean())}


def advantages_on_rows(batch: PackedBatch, per_turn: dict[tuple[str, str, int], float],
                       joint_of: dict[str, str], agent_of: dict[str, str]) -> torch.Tensor:
    """(B, T) advantages: each turn's value from ``per_turn`` on that turn's action tokens
    (``joint_of`` / ``agent_of``: attempt id → joint id / agent)."""
    out = torch.zeros(batch.action_mask.shape, dtype=torch.float32)
    for attempt, spans in zip(batch.attempt_ids, turn_spans(batch), strict=True):
        for span in spans:
            if span.first_action < 0:
                continue
            value = per_turn.get((joint_of[attempt], agent_of[attempt], span.turn), 0.0)
            out[span.row, span.first_action:span.last_action + 1] = value
    return out * batch.action_mask.float()
