"""The PPO update: old logprobs frozen once, minibatch epochs, exact micro-batching and ranks.

Exactness: a minibatch's loss is ``sum(weights * token_loss)`` with ``weights`` from
``core.loss_weights`` computed once over the *whole minibatch* (all ranks' rows). A micro-batch
contributes ``sum(weights[rows] * token_loss[rows])``; gradients of micro-batches add up, and
data-parallel ranks add theirs with an all-reduce SUM (not a mean), so one full batch, any
micro-batch size and any number of ranks give the same gradient up to float summation order.
Each micro-batch is cut to its own longest row: padding columns carry weight 0 and never
reach the loss.

Three policies stay apart: ``behavior_logprobs`` (recorded by the sampler, used only for the
optional truncated importance weight), ``old_logprobs`` (this update's anchor, computed here
once with the weights the update starts from and frozen), and the reference model (KL anchor).

An update that takes exactly one optimizer step per batch (``epochs == minibatches == 1``) may
skip that extra forward (``freeze_old(..., policy=False)``): its loss forward runs with the
weights the update starts from, so the detached logprobs of that same forward are the old ones
(for a policy without dropout, as the tiny models and most fine-tuned LLMs are configured).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from tracerl.core import (
    entropy,
    kl_loss,
    loss_weights,
    ppo_sequence_loss,
    ppo_token_loss,
    truncated_importance_weights,
    value_loss,
)
from tracerl.models import lora
from tracerl.rollout.policies.fused_llama import (
    fused_head,
    fused_sequence_forward,
    unsupported_reason,
)
from tracerl.rollout.policies.sampling import logprobs_from_logits
from tracerl.train.config import CriticConfig, UpdateConfig
from tracerl.train.sft import demonstration_loss

DemonstrationBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Padded demonstrations ``(ids, attention, action)``, each (B, T), from
``train.sft.pad_sequences``: the batch ``update.sft_coef`` mixes into an optimizer step."""


@dataclass(frozen=True)
class RowBatch:
    """Per-row tensors of the rows to train on (fragments of included attempts)."""

    input_ids: torch.Tensor
    """(B, T) int64 token ids."""
    attention_mask: torch.Tensor
    """(B, T) int64, 1 on real tokens."""
    action_mask: torch.Tensor
    """(B, T) bool, True on action tokens only."""
    advantages: torch.Tensor
    """(B, T) float32, zero off actions."""
    behavior_logprobs: torch.Tensor
    """(B, T) float32 logprobs recorded by the sampler (never the PPO anchor)."""
    group_index: torch.Tensor
    """(B,) int64 task group of each row (for ``task_mean``)."""
    returns: torch.Tensor | None = None
    """(B, T) critic targets, or None without a critic."""
    old_logprobs: torch.Tensor | None = None
    """(B, T) anchor logprobs, filled by :meth:`ActorCritic.freeze_old`."""
    old_values: torch.Tensor | None = None
    """(B, T) critic values at the start of the update (value clipping anchor)."""
    ref_logprobs: torch.Tensor | None = None
    """(B, T) reference-model logprobs (KL anchor), or None without KL."""

    @property
    def rows(self) -> int:
        """Number of rows."""
        return int(self.input_ids.shape[0])

    def select(self, index: torch.Tensor) -> RowBatch:
        """The rows ``index``, cut to their own longest row (padding never matters)."""
        picked = {name: (None if value is None else value[index])
                  for name, value in self._tensors().items()}
        real = picked["attention_mask"].bool().any(0)  # type: ignore[union-attr]
        columns = torch.nonzero(real).flatten()
        if columns.numel():
            lo, hi = int(columns[0]), int(columns[-1]) + 1
            for name, value in picked.items():
                if value is not None and value.dim() == 2:
                    picked[name] = value[:, lo:hi]
        return RowBatch(**picked)  # type: ignore[arg-type]

    def to(self, device: torch.device) -> RowBatch:
        """The same rows on ``device`` (no copy where they already are)."""
        return RowBatch(**{name: (None if value is None else value.to(device))  # type: ignore[arg-type]
                           for name, value in self._tensors().items()})

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


class ActorCritic(torch.nn.Module):
    """The policy plus an optional critic: a value head on its trunk, or a separate model."""

    def __init__(self, policy: torch.nn.Module, critic: CriticConfig, temperature: float) -> None:
        super().__init__()
        self.policy = policy
        self.temperature = temperature
        """Logprobs in the loss are taken under ``log_softmax(logits / temperature)``, the
        distribution the rollouts were sampled from (smooth, so it can be differentiated)."""
        self.critic_kind = critic.kind
        self.fused = True
        """Compute Llama-architecture policies' logits with the fused forward (False: always
        the model's own ``forward``)."""
        hidden = int(getattr(policy, "config").hidden_size)  # noqa: B009 (a transformers model)
        self.critic_backbone: torch.nn.Module | None = None
        self.value_head: torch.nn.Linear | None = None
        if critic.kind != "none":
            self.value_head = torch.nn.Linear(hidden, 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
        if critic.kind == "separate":  # a LoRA policy's critic: the base with its own adapter
            backbone: torch.nn.Module = copy.deepcopy(lora.base_model(policy)).model
            self.critic_backbone = backbone

    def _use_fused(self) -> bool:
        """Whether the policy's forward can take the fused Llama path (same mathematics,
        a fraction of the operations; ``rollout.policies.fused_llama.fused_sequence_forward``)."""
        if not self.fused:
            return False
        config = getattr(self.policy, "config", None)
        if self.policy.training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
            return False
        return unsupported_reason(self.policy) is None

    def critic_state(self) -> dict[str, Any]:
        """The critic's own weights (the head, and the separate backbone if any)."""
        state: dict[str, Any] = {}
        if self.value_head is not None:
            state["head"] = self.value_head.state_dict()
        if self.critic_backbone is not None:
            state["backbone"] = self.critic_backbone.state_dict()
        return state

    def load_critic_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`critic_state` returned."""
        if self.value_head is not None and "head" in state:
            self.value_head.load_state_dict(state["head"])
        if self.critic_backbone is not None and "backbone" in state:
            self.critic_backbone.load_state_dict(state["backbone"])

    @property
    def has_critic(self) -> bool:
        """Whether values are computed."""
        return self.value_head is not None

    @property
    def device(self) -> torch.device:
        """Where the policy's weights are (micro-batches are moved there)."""
        return next(self.policy.parameters()).device

    def policy_parameters(self) -> list[torch.nn.Parameter]:
        """Trainable parameters of the policy (the trunk included when the critic shares it;
        a LoRA policy's adapter only: its base is frozen)."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def critic_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters only the critic has."""
        params: list[torch.nn.Parameter] = []
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        if self.critic_backbone is not None:
            params += list(self.critic_backbone.parameters())
        return [p for p in params if p.requires_grad]

    def evaluate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                 need_values: bool = False, need_entropy: bool = False,
                 needed: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Per-position logprobs (B, T), values (B, T) and entropies (B, T).

        ``logprobs[b, t]`` is the log-probability of token t given tokens < t; ``values[b, t]``
        is the critic's value of that same state (the context before token t);
        ``entropies[b, t]`` the entropy of the distribution token t was drawn from (with
        ``need_entropy``, else None). ``needed`` (B, T) bool: the positions the caller reads
        (the action tokens); the others may come back 0, and on the fused path the output head
        then runs on those positions only.
        """
        attention = attention_mask.long()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        shared = need_values and self.critic_kind == "value_head"
        last_hidden: torch.Tensor | None = None
        fused = self._use_fused()
        sparse = fused and needed is not None
        if fused:
            logits, last_hidden = fused_sequence_forward(self.policy, input_ids, attention,
                                                         positions, head=not sparse, check=False)
        else:
            out = self.policy(input_ids=input_ids, attention_mask=attention,
                              position_ids=positions, output_hidden_states=shared)
            logits = out.logits  # (B, T, V)
            if shared:
                last_hidden = out.hidden_states[-1]
        if sparse:
            assert needed is not None and last_hidden is not None
            targets = needed[:, 1:].bool()  # token t is needed: the state before it, t - 1
            rows, width = targets.shape
            flat = torch.nonzero(targets.reshape(-1)).squeeze(1)
            states = last_hidden[:, :-1].reshape(rows * width, -1).index_select(0, flat)
            head = fused_head(self.policy, states)  # (N, V) logits
            values_at = logprobs_from_logits(head, input_ids[:, 1:].reshape(-1)[flat],
                                             temperature=self.temperature,
                                             processing="temperature")
            logprobs = values_at.new_zeros(rows * width).index_add(0, flat, values_at)
            logprobs = logprobs.view(rows, width)
            if need_entropy:  # only where the caller reads it, like the logprobs
                at, _ = entropy((head / self.temperature)[None], torch.ones_like(flat)[None])
                entropies = at.new_zeros(rows * width).index_add(0, flat, at[0]).view(rows, width)
        else:
            assert logits is not None
            logprobs = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:],
                                            temperature=self.temperature,
                                            processing="temperature")
        logprobs = torch.cat([logprobs.new_zeros(logprobs.shape[0], 1), logprobs], dim=1)
        values = None
        if need_values and self.value_head is not None:
            if shared:
                assert last_hidden is not None
                hidden = last_hidden
            else:
                assert self.critic_backbone is not None
                hidden = self.critic_backbone(input_ids=input_ids, attention_mask=attention,
                                              position_ids=positions).last_hidden_state
            state_values = self.value_head(hidden).squeeze(-1)  # (B, T): value after token t
            values = torch.cat([state_values.new_zeros(state_values.shape[0], 1),
                                state_values[:, :-1]], dim=1)
        if need_entropy and not sparse:
            assert logits is not None
            scaled = logits[:, :-1] / self.temperature
            entropies, _ = entropy(scaled, torch.ones(scaled.shape[:2], dtype=torch.bool,
                                                      device=scaled.device))
        if need_entropy:
            entropies = torch.cat([entropies.new_zeros(entropies.shape[0], 1), entropies], dim=1)
            return logprobs, values, entropies
        return logprobs, values, None

    @torch.no_grad()
    def state_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) the critic's value of each whole sequence (the state after its last token)."""
        if self.value_head is None:
            raise ValueError("state_values: this model has no critic")
        if input_ids.shape[1] == 0:
            return torch.zeros(input_ids.shape[0])
        device = self.device
        input_ids, attention = input_ids.to(device), attention_mask.to(device).long()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        if self.critic_backbone is not None:
            hidden = self.critic_backbone(input_ids=input_ids, attention_mask=attention,
                                          position_ids=positions).last_hidden_state
        else:
            hidden = self.policy(input_ids=input_ids, attention_mask=attention,
                                 position_ids=positions, output_hidden_states=True
                                 ).hidden_states[-1]
        values = self.value_head(hidden).squeeze(-1)
        # The last real token of each row (left or right padding).
        index = torch.arange(attention.shape[1], device=device).expand_as(attention)
        last = torch.where(attention.bool(), index, torch.full_like(index, -1)).max(-1).values
        picked = values.gather(1, last.clamp(min=0)[:, None]).squeeze(1)
        return torch.where(last >= 0, picked, torch.zeros_like(picked)).float().cpu()


@torch.no_grad()
def freeze_old(model: ActorCritic, batch: RowBatch, micro_batch_rows: int,
               reference: ActorCritic | None = None, *, policy: bool = True) -> RowBatch:
    """Fill ``old_logprobs`` (and ``old_values``, ``ref_logprobs``) once, before any step.

    ``policy=False`` leaves ``old_logprobs`` unset for a single-step update to take from its
    own forward (see the module docstring); values and reference logprobs are still filled."""
    if not policy and not model.has_critic and reference is None:
        return batch
    was_training = model.training
    model.eval()
    old = torch.zeros(batch.input_ids.shape)
    values = torch.zeros(batch.input_ids.shape) if model.has_critic else None
    ref = torch.zeros(batch.input_ids.shape) if reference is not None else None
    order = micro_batch_order(batch, torch.arange(batch.rows))
    try:
        for start in range(0, batch.rows, micro_batch_rows):
            rows = order[start:start + micro_batch_rows]
            part = batch.select(rows).to(model.device)
            width = part.input_ids.shape[1]
            lo, hi = _column_span(batch.attention_mask[rows])
            logprobs, vals, _ = model.evaluate(part.input_ids, part.attention_mask,
                                               need_values=model.has_critic,
                                               needed=part.action_mask)
            old[rows, lo:hi] = logprobs.float().cpu()
            if values is not None and vals is not None:
                values[rows, lo:hi] = vals.float().cpu()
            if ref is not None and reference is not None:
                on_ref = part.to(reference.device)
                ref_lp, _, _ = reference.evaluate(on_ref.input_ids, on_ref.attention_mask,
                                                  needed=on_ref.action_mask)
                ref[rows, lo:hi] = ref_lp.float().cpu()
            assert hi - lo == width
    finally:
        model.train(was_training)
    mask = batch.action_mask.float()
    return replace(batch, old_logprobs=old * mask if policy else None,
                   old_values=None if values is None else values * mask,
                   ref_logprobs=None if ref is None else ref * mask)


def micro_batch_order(batch: RowBatch, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` in the order micro-batches take them: a group's rows together (they share
    their prompt, which the fused forward then computes once per micro-batch), longest first
    within a group. Any order gives the same result; this one gives it soonest."""
    lengths = batch.attention_mask[rows].sum(-1)
    rows = rows[torch.argsort(lengths, descending=True, stable=True)]
    return rows[torch.argsort(batch.group_index[rows], stable=True)]


def _column_span(attention: torch.Tensor) -> tuple[int, int]:
    columns = torch.nonzero(attention.bool().any(0)).flatten()
    if not columns.numel():
        return 0, 0
    return int(columns[0]), int(columns[-1]) + 1


def token_loss(model: ActorCritic, part: RowBatch, config: UpdateConfig, critic: CriticConfig
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, T) per-token total loss of a micro-batch (policy, KL, entropy, value terms)."""
    mask = part.action_mask
    if part.old_logprobs is None and not (config.epochs == 1 and config.minibatches == 1):
        raise ValueError("old_logprobs: not frozen; only an update of one optimizer step "
                         f"(epochs 1, minibatches 1; got {config.epochs}, {config.minibatches})"
                         " may take them from its own forward: run freeze_old first")
    logprobs, values, entropies = model.evaluate(
        part.input_ids, part.attention_mask, need_values=model.has_critic,
        need_entropy=config.entropy_coef != 0, needed=mask)
    if part.old_logprobs is None:  # one step from the starting weights: these are the old ones
        part = replace(part, old_logprobs=logprobs.detach() * mask)
    assert part.old_logprobs is not None
    metrics: dict[str, float] = {}
    weights = None
    if config.tis_cap is not None and bool(mask.any()):
        weights, tis = truncated_importance_weights(
            part.old_logprobs, part.behavior_logprobs, mask, cap=config.tis_cap,
            mode=config.tis_mode)
        metrics.update(tis)
    advantages = part.advantages
    if config.loss_level == "token":
        loss, pg = ppo_token_loss(logprobs, part.old_logprobs, advantages, mask,
                                  clip_low=config.clip_low, clip_high=config.clip_high,
                                  dual_clip=config.dual_clip, importance_weights=weights)
    else:
        maskf = mask.float()
        per_row = (advantages * maskf).sum(-1) / maskf.sum(-1).clamp(min=1)
        loss, pg = ppo_sequence_loss(logprobs, part.old_logprobs, per_row, mask,
                                     clip_low=config.clip_low, clip_high=config.clip_high,
                                     dual_clip=config.dual_clip)
    metrics.update(pg)
    if config.kl_coef > 0 and config.kl_in == "loss":
        assert part.ref_logprobs is not None
        kl, kl_metrics = kl_loss(logprobs, part.ref_logprobs, mask, config.kl_estimator,
                                     config.kl_clamp)
        loss = loss + config.kl_coef * kl
        metrics.update(kl_metrics)
    if entropies is not None:
        maskf = mask.to(entropies.dtype)
        loss = loss - config.entropy_coef * entropies * maskf
        if bool(mask.any()):
            metrics["entropy/mean"] = float((entropies.detach() * maskf).sum() / maskf.sum())
    if values is not None:
        assert part.returns is not None and part.old_values is not None
        vloss, v_metrics = value_loss(values, part.old_values, part.returns, mask,
                                      clip=critic.clip)
        loss = loss + critic.coef * vloss
        metrics.update(v_metrics)
    return loss, metrics


def minibatch_step(model: ActorCritic, optimizer: torch.optim.Optimizer, batch: RowBatch,
                   config: UpdateConfig, critic: CriticConfig,
                   rank_rows: torch.Tensor | None = None,
                   demonstrations: DemonstrationBatch | None = None,
                   observation_weight: float = 0.0) -> dict[str, float]:
    """One optimizer step on a whole minibatch ``batch`` (every rank passes the same one).

    ``rank_rows``: the rows this rank computes (default: all). The loss weights come from
    the whole minibatch; gradients are summed over micro-batches and over ranks.

    ``demonstrations`` (with ``config.sft_coef`` > 0): adds ``sft_coef`` times their supervised
    loss (``train.sft.demonstration_loss``, its own token-mean denominators) to this step.
    Exactly one rank passes them, so the all-reduce SUM counts the term once; it is one
    forward of its own, so the micro-batch size leaves it unchanged.
    """
    weights = loss_weights(batch.action_mask, config.loss_mode, batch.group_index,
                           config.loss_constant).float()
    rows = micro_batch_order(batch, torch.arange(batch.rows) if rank_rows is None else rank_rows)
    optimizer.zero_grad(set_to_none=False)
    totals: dict[str, float] = {}
    tokens = 0.0
    objective = 0.0
    for start in range(0, len(rows), config.micro_batch_rows):
        index = rows[start:start + config.micro_batch_rows]
        part = batch.select(index).to(model.device)
        lo, hi = _column_span(batch.attention_mask[index])
        loss, metrics = token_loss(model, part, config, critic)
        weighted = (weights[index, lo:hi].to(loss.device) * loss).sum()
        weighted.backward()
        objective += float(weighted.detach())
        count = float(part.action_mask.sum())
        tokens += count
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + value * count
    sft_loss = None
    if demonstrations is not None and config.sft_coef > 0:
        ids, attention, action = (t.to(model.device) for t in demonstrations)
        supervised = demonstration_loss(model.policy, ids, attention, action, observation_weight)
        (config.sft_coef * supervised).backward()
        sft_loss = float(supervised.detach())
        objective += config.sft_coef * sft_loss
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        for parameter in model.parameters():
            if not parameter.requires_grad:  # a LoRA policy's base
                continue
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)
        # The loss is reported whole; the per-token metrics stay this rank's own rows'.
        whole = torch.tensor([objective], dtype=torch.float64, device=model.device)
        dist.all_reduce(whole, op=dist.ReduceOp.SUM)
        objective = float(whole)
    if config.grad_clip is not None:  # returns the norm before clipping
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip))
    else:
        grad_norm = _grad_norm(model)
    optimizer.step()
    out = {name: value / tokens for name, value in totals.items()} if tokens else {}
    out["update/loss"] = objective
    out["update/grad_norm"] = grad_norm
    if sft_loss is not None:
        out["update/sft_loss"] = sft_loss
    return out


def make_adamw(param_groups: Any, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, with torch's fused kernel where the parameters' device and dtype have one (one
    kernel for all tensors instead of a dozen small ops per tensor: the same update)."""
    try:
        return torch.optim.AdamW(param_groups, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(param_groups, weight_decay=weight_decay)


def warm_up(optimizer: torch.optim.Optimizer, warmup_steps: int) -> None:
    """Set each parameter group's rate for the next step: its ``base_lr`` times
    min(1, (k + 1) / ``warmup_steps``), k the optimizer steps taken so far. The count is read
    from the optimizer's own state, so a resumed run (optimizer state restored) continues the
    same schedule."""
    if warmup_steps <= 0:
        return
    scale = min(1.0, (optimizer_steps(optimizer) + 1) / warmup_steps)
    for group in optimizer.param_groups:
        group.setdefault("base_lr", group["lr"])
        group["lr"] = group["base_lr"] * scale


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far, read from its own state (restored on resume)."""
    return next((int(state["step"]) for state in optimizer.state.values() if "step" in state), 0)


def _grad_norm(model: torch.nn.Module) -> float:
    squares = [p.grad.detach().double().pow(2).sum() for p in model.parameters()
               if p.grad is not None]
    return math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0


def split_minibatches(batch_attempts: torch.Tensor, minibatches: int,
                      generator: torch.Generator) -> list[torch.Tensor]:
    """Row indices of each minibatch: attempts shuffled, all rows of an attempt together."""
    attempts = torch.unique(batch_attempts)
    order = attempts[torch.randperm(len(attempts), generator=generator)]
    chunks = [c for c in torch.tensor_split(order, minibatches) if c.numel()]
    return [torch.nonzero(torch.isin(batch_attempts, chunk)).flatten() for chunk in chunks]


def ppo_update(model: ActorCritic, optimizer: torch.optim.Optimizer, batch: RowBatch,
               attempt_index: torch.Tensor, config: UpdateConfig, critic: CriticConfig,
               generator: torch.Generator, rank: int = 0, world_size: int = 1,
               demonstrations: Callable[[int], DemonstrationBatch] | None = None,
               observation_weight: float = 0.0) -> dict[str, float]:
    """``epochs`` passes of ``minibatches`` optimizer steps over ``batch`` (old logprobs
    already frozen). Each rank computes every ``world_size``-th row of each minibatch.

    ``demonstrations(k)``: the demonstration batch of optimizer step ``k`` (counted from the
    optimizer's state, so a resumed run draws what an uninterrupted one would), for
    ``config.sft_coef``; rank 0 computes it."""
    model.train()
    sums: dict[str, float] = {}
    steps = 0
    for _ in range(config.epochs):
        for rows in split_minibatches(attempt_index, config.minibatches, generator):
            warm_up(optimizer, config.warmup_steps)
            mini = batch.select(rows)
            mine = torch.arange(rank, mini.rows, world_size)
            shown = None
            if demonstrations is not None and config.sft_coef > 0 and rank == 0:
                shown = demonstrations(optimizer_steps(optimizer))
            metrics = minibatch_step(model, optimizer, mini, config, critic, mine, shown,
                                     observation_weight)
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value
            steps += 1
    return {name: value / steps for name, value in sums.items()} | {"update/steps": float(steps)}
