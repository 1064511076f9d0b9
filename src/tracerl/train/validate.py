"""The cross-field rules of a training config, checked once by
:func:`tracerl.train.config.config_from_dict` before any model is built or any attempt is
sampled: ranges of counts, rates and fractions, an estimator that needs a critic (or groups)
and gets one, options that only make sense together. Each refusal names the fields.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from tracerl.models.device import resolve_device
from tracerl.rollout.vllm.config import ENGINES
from tracerl.rollout.vllm.server import served_lora_rank
from tracerl.train.algorithms import ESTIMATORS
from tracerl.train.async_config import validate_async
from tracerl.train.joint_config import validate_multiagent

if TYPE_CHECKING:
    from tracerl.train.config import TrainConfig


def validate(config: TrainConfig) -> None:
    """Cross-field rules, checked once before any compute; ValueError names the fields."""
    validate_multiagent(config)
    validate_async(config)
    r, a, c, u = config.rollout, config.algorithm, config.critic, config.update
    positive_ints = {
        "steps": config.steps, "checkpoint_every": config.checkpoint_every,
        "rollout.tasks_per_step": r.tasks_per_step, "rollout.group_size": r.group_size,
        "rollout.max_turns": r.max_turns, "rollout.max_turn_tokens": r.max_turn_tokens,
        "rollout.concurrency": r.concurrency,
        "rollout.env_workers": r.env_workers, "update.epochs": u.epochs,
        "update.minibatches": u.minibatches, "update.micro_batch_rows": u.micro_batch_rows,
        "eval.samples_per_task": config.eval.samples_per_task,
        "sft.batch_size": config.sft.batch_size, "sft.demos_per_task": config.sft.demos_per_task,
        "sft.length_window": config.sft.length_window,
        "model.hidden_size": config.model.hidden_size, "model.num_layers": config.model.num_layers,
        "model.num_heads": config.model.num_heads, "tasks.train_count": config.tasks.train_count,
        "tasks.heldout_count": config.tasks.heldout_count,
    }
    for name, value in positive_ints.items():
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    if not 0.0 <= config.sft.fresh_names <= 1.0:
        raise ValueError(f"sft.fresh_names: must be a probability in [0, 1], "
                         f"got {config.sft.fresh_names}")
    if not config.update.sft_coef >= 0.0:
        raise ValueError(f"update.sft_coef: must be >= 0, got {config.update.sft_coef}")
    if config.update.sft_coef > 0 and not config.sft.enabled:
        raise ValueError("update.sft_coef: mixes the warm start's demonstrations into RL, "
                         "so it needs sft.enabled: true")
    if not config.sft.observation_weight >= 0.0:
        raise ValueError(f"sft.observation_weight: must be >= 0, "
                         f"got {config.sft.observation_weight}")
    resolve_device(config.model.device)
    for name, threads in (("threads", config.threads), ("rollout.threads", r.threads)):
        if threads is not None and threads < 1:
            raise ValueError(f"{name}: must be >= 1 or null, got {threads}")
    if config.max_generated_tokens is not None and config.max_generated_tokens < 1:
        raise ValueError(f"max_generated_tokens: must be >= 1 or null, "
                         f"got {config.max_generated_tokens}")
    if config.update.kl_clamp is not None and not config.update.kl_clamp > 0:
        raise ValueError(f"update.kl_clamp: must be > 0 or null, got {config.update.kl_clamp}")
    if u.ema_decay is not None and not 0.0 <= u.ema_decay < 1.0:
        raise ValueError(f"update.ema_decay: must be in [0, 1) or null, got {u.ema_decay}")
    if config.update.warmup_steps < 0:
        raise ValueError(f"update.warmup_steps: must be >= 0, got {config.update.warmup_steps}")
    if config.tasks.renamed_copies < 0:
        raise ValueError(f"tasks.renamed_copies: must be >= 0, got {config.tasks.renamed_copies}")
    if config.sft.steps < 0:
        raise ValueError(f"sft.steps: must be >= 0, got {config.sft.steps}")
    fractions: dict[str, float] = {"algorithm.gamma": a.gamma, "algorithm.gae_lambda": a.gae_lambda,
                        "sft.wrong_edit_fraction": config.sft.wrong_edit_fraction,
                        "sft.recovery_fraction": config.sft.recovery_fraction,
                        "sft.check_fraction": config.sft.check_fraction,
                        "sft.retry_fraction": config.sft.retry_fraction,
                        "sft.search_fraction": config.sft.search_fraction,
                        "dynamic.success_prior": config.dynamic.success_prior,
                        "dynamic.success_ema": config.dynamic.success_ema}
    for name, fraction in fractions.items():
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{name}: must be in [0, 1], got {fraction}")
    if config.sft.recovery_fraction > config.sft.wrong_edit_fraction:
        raise ValueError("sft.recovery_fraction: recoveries follow wrong edits, so it must be "
                         f"<= sft.wrong_edit_fraction ({config.sft.wrong_edit_fraction})")
    if not r.temperature > 0:
        raise ValueError(f"rollout.temperature: must be > 0 for training rollouts "
                         f"(greedy samples have no usable ratio), got {r.temperature}")
    for name, rate in {"update.lr": u.lr, "sft.lr": config.sft.lr, "critic.lr": c.lr}.items():
        if not rate > 0:
            raise ValueError(f"{name}: must be > 0, got {rate}")
    if a.estimator not in ESTIMATORS:
        raise ValueError(f"algorithm.estimator: unknown {a.estimator!r}; "
                         f"registered: {sorted(ESTIMATORS)}")
    needs = ESTIMATORS[a.estimator]
    if needs.needs_critic and c.kind == "none":
        raise ValueError(f"algorithm.estimator: {a.estimator!r} needs a critic; set "
                         "critic.kind to 'value_head' or 'separate'")
    if needs.needs_groups and r.group_size < 2:
        raise ValueError(f"rollout.group_size: {a.estimator!r} compares attempts at the same "
                         f"task and needs groups of at least 2, got {r.group_size}")
    if c.kind != "none" and not needs.needs_critic:
        raise ValueError(f"critic.kind: {c.kind!r} is set but algorithm.estimator "
                         f"{a.estimator!r} does not use a critic; set critic.kind: none")
    if u.kl_in == "reward" and u.kl_coef > 0 and not needs.needs_critic:
        raise ValueError("update.kl_in: a per-token KL reward needs a token-level estimator "
                         "(gae); use kl_in: loss with group methods")
    if u.loss_mode == "constant" and (u.loss_constant is None or u.loss_constant <= 0):
        raise ValueError("update.loss_constant: loss_mode 'constant' needs a positive constant")
    if u.kl_coef < 0:
        raise ValueError(f"update.kl_coef: must be >= 0, got {u.kl_coef}")
    if u.tis_cap is not None and not u.tis_cap >= 1:
        raise ValueError(f"update.tis_cap: must be >= 1 or null, got {u.tis_cap}")
    if config.model.kind == "pretrained" and not config.model.path:
        raise ValueError("model.path: a pretrained model needs a name or directory")
    if config.model.hidden_size % config.model.num_heads:
        raise ValueError("model.hidden_size: must be divisible by model.num_heads")
    if r.engine not in ENGINES:
        raise ValueError(f"rollout.engine: unknown {r.engine!r}; accepts "
                         + ", ".join(repr(e) for e in ENGINES))
    if r.engine != "local":
        for option in ("constrain_edits", "constrain_calls"):
            if getattr(r, option):
                raise ValueError(f"rollout.{option}: decoding rules run in the local sampler; "
                                 f"rollout.engine {r.engine!r} applies none (turn it off, or use "
                                 "rollout.engine: local)")
        if config.model.lora.rank > 0:
            served_lora_rank(config.model.lora.rank)  # vLLM's --max-lora-rank has a ceiling
    _validate_lora(config)
    if config.dynamic.refill and not config.dynamic.filter_uniform:
        raise ValueError("dynamic.refill: refilling needs dynamic.filter_uniform: true")


def _validate_lora(config: TrainConfig) -> None:
    """``model.lora``'s values (checked whether or not it is on), and peft when it is."""
    lora = config.model.lora
    if lora.rank < 0:
        raise ValueError(f"model.lora.rank: must be >= 0 (0: off), got {lora.rank}")
    if not lora.alpha > 0:
        raise ValueError(f"model.lora.alpha: must be > 0, got {lora.alpha}")
    if not lora.target_modules or any(not name.strip() for name in lora.target_modules):
        raise ValueError("model.lora.target_modules: must name at least one module, each "
                         f"non-empty, got {list(lora.target_modules)}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ValueError(f"model.lora.dropout: must be in [0, 1), got {lora.dropout}")
    if lora.rank > 0 and importlib.util.find_spec("peft") is None:
        raise ValueError("model.lora.rank: LoRA needs the peft package, which is not "
                         "installed: pip install 'tracerl[lora]'")
