"""What a run is built from before its first step: its tasks, its policy (loaded, or built
from the config), its conversation format, the check that the longest first prompt leaves
room to act, and the run directory's ``config.yaml``.

Plain functions of the run's :class:`TrainConfig`; :meth:`tracerl.train.trainer.Trainer.setup`
calls them in that order.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from tracerl.envs import Task, load_tasks
from tracerl.envs.coding import task_statement
from tracerl.envs.suite import generate_split
from tracerl.envs.suite.augment import renamed_copies
from tracerl.models import lora
from tracerl.models.tiny import load_tiny, save_tiny
from tracerl.rollout import HFPolicy
from tracerl.rollout.collect.chat_tokens import ChatTokens
from tracerl.rollout.settings import RolloutConfig
from tracerl.train.config import TrainConfig, config_changes, dump_config


def check_config_file(config: TrainConfig, log: Callable[[str], None]) -> None:
    """Write the run's ``config.yaml``; a different one already there (the recipe changed
    under a resume) is kept beside it, and ``log`` says what changed."""
    run_dir = Path(config.run_dir)
    path = run_dir / "config.yaml"
    text = dump_config(config)
    if path.is_file() and path.read_text(encoding="utf-8") != text:
        # The run's recipe changed under a resume: keep the old one visible, use the new,
        # and say what changed (a run dir reused for a new experiment resumes the old run).
        kept = run_dir / f"config.{int(time.time())}.yaml"
        path.rename(kept)
        changes = config_changes(yaml.safe_load(kept.read_text(encoding="utf-8")) or {},
                                 yaml.safe_load(text))
        log(f"{run_dir} already holds a run; its config changed ("
            + "; ".join(changes) + f"); the old one is kept as {kept.name}")
    path.write_text(text, encoding="utf-8")


def run_tasks(config: TrainConfig) -> tuple[list[Task], list[Task]]:
    """The train tasks (followed by their renamed copies, ``tasks.renamed_copies`` of each)
    and the held-out tasks."""
    copies = config.tasks.renamed_copies
    train = _load_tasks(config, "train")
    if copies:
        train = renamed_copies(train, copies, _train_seed(config))
    return train, _load_tasks(config, "heldout")


def _load_tasks(config: TrainConfig, split: str) -> list[Task]:
    """The tasks of "train" or "heldout", without renamed copies."""
    tasks = config.tasks
    source = tasks.train_file if split == "train" else tasks.heldout_file
    if source is not None:
        return list(load_tasks(source))
    # The built-in tasks' budget is the rollout's turn cap, in training and evaluation.
    turns = config.rollout.max_turns
    if split == "heldout":
        return generate_split("heldout", tasks.suite_seed, tasks.heldout_count,
                              max_turns=turns)
    return generate_split("train", _train_seed(config), tasks.train_count,
                          composed=tasks.composed_train, max_turns=turns)


def _train_seed(config: TrainConfig) -> int:
    tasks = config.tasks
    return tasks.suite_seed if tasks.train_seed is None else tasks.train_seed


def load_model(directory: Path) -> tuple[Any, Any]:
    """The model and tokenizer saved in ``directory`` (refused if a weight is not finite); a
    LoRA adapter saved there comes back on its base, trainable."""
    if lora.is_adapter_dir(directory):
        return lora.load_adapter_dir(directory, trainable=True)
    return load_tiny(directory)


def lora_policy(config: TrainConfig, model: Any, tokenizer: Any, source: Path | None) -> Any:
    """The policy a run trains: ``model`` as it is when ``model.lora`` is off or ``model``
    already holds an adapter (a LoRA checkpoint), else ``model`` with a fresh adapter.
    ``source``: the directory ``model`` was loaded from (the warm start's), None for a model
    built or loaded from ``model.path`` now; that directory, ``model.path``, or else ``base/``
    in the run directory (written here, once) is recorded as the adapter's base."""
    settings = config.model.lora
    if lora.is_lora(model) or settings.rank == 0:
        if lora.is_lora(model) and settings.rank == 0:
            raise ValueError(f"model.lora.rank: {source} holds a LoRA adapter, so the run it "
                             "resumes needs model.lora.rank > 0")
        return model
    if source is not None and source.parent.name == "checkpoints":
        raise ValueError(f"model.lora.rank: {source} was trained without LoRA; a LoRA run "
                         "cannot resume it (use a new run_dir)")
    base: str | None = None if source is None else str(source.resolve())
    if base is None and config.model.path is not None:
        path = Path(config.model.path)
        base = str(path.resolve()) if path.is_dir() else config.model.path
    if base is None:
        base = str(save_tiny(model, tokenizer, Path(config.run_dir) / lora.BASE_DIR).resolve())
    adapter = lora_settings(config)
    assert adapter is not None
    return lora.apply_lora(model, adapter, base_name=base, seed=config.seed)


def lora_settings(config: TrainConfig) -> lora.LoraSettings | None:
    """``model.lora`` as :func:`tracerl.models.lora.apply_lora` takes it; None when off."""
    settings = config.model.lora
    if settings.rank == 0:
        return None
    return lora.LoraSettings(rank=settings.rank, alpha=settings.alpha,
                             target_modules=settings.target_modules, dropout=settings.dropout)


def reference_policy(policy: Any, run_dir: Path) -> Any:
    """The KL anchor's model, frozen: with LoRA the policy with its adapter disabled (the
    same weights, no copy); else the warm start's policy, or a copy of the policy as it is
    (RL has not changed it yet when this is first asked for)."""
    if lora.is_lora(policy):
        return lora.AdapterOff(policy)
    if (run_dir / "sft" / "DONE").is_file():
        model, _ = load_model(run_dir / "sft")
    else:
        model = copy.deepcopy(policy)
    return model.requires_grad_(False)


def build_model(config: TrainConfig, tokenizer_texts: Callable[[], Sequence[str]]
                ) -> tuple[Any, Any]:
    """The policy a new run starts from: ``model.path``'s, or a tiny model with a tokenizer
    trained on ``tokenizer_texts()``. A ``model.path`` holding a LoRA adapter (a LoRA run's
    checkpoint) gives its base with the adapter on it, trainable."""
    if config.model.path is not None and lora.is_adapter_dir(config.model.path):
        return load_model(Path(config.model.path))
    if config.model.kind == "pretrained":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        assert config.model.path is not None
        tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
        return model, tokenizer
    if config.model.path is not None:
        return load_model(Path(config.model.path))
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model, train_tokenizer
    from tracerl.models.words import WORDS

    tokenizer = train_tokenizer(tokenizer_texts(),
                                vocab_size=config.model.vocab_size, words=WORDS)
    shape = TinyModelConfig(
        hidden_size=config.model.hidden_size, num_layers=config.model.num_layers,
        num_heads=config.model.num_heads, intermediate_size=config.model.intermediate_size,
        max_positions=config.model.max_positions)
    return build_tiny_model(tokenizer, shape, seed=config.seed), tokenizer


def chat_tokens(rollout: RolloutConfig, policy: HFPolicy) -> ChatTokens:
    """The collector's conversation format for a run with ``rollout``."""
    from tracerl.envs.tools import TOOL_SCHEMAS

    tools = TOOL_SCHEMAS if rollout.show_tool_schemas else None
    return ChatTokens(policy, tools=tools, system_prompt=rollout.system_prompt)


def check_first_prompts(rollout: RolloutConfig, policy: HFPolicy, tasks: Sequence[Task],
                        candidates: int = 8) -> int:
    """Refuse, before any compute, a recipe whose first prompt leaves no room to act: the
    longest task statements of ``tasks`` (``candidates`` of the longest by characters),
    rendered as the run renders them, plus one turn's ``max_turn_tokens`` must fit the
    policy's context. Returns the longest first prompt's token count."""
    by_id = {t.id: t for t in tasks}
    statements = sorted((task_statement(t) for t in by_id.values()), key=len,
                        reverse=True)[:candidates]
    chat = chat_tokens(rollout, policy)
    longest = max((len(chat.first_prompt(text)) for text in statements), default=0)
    context = policy.context_length
    if context is not None and longest + rollout.max_turn_tokens > context:
        schemas = "with" if rollout.show_tool_schemas else "without"
        raise ValueError(
            f"rollout: the longest first prompt is {longest} tokens ({schemas} the tools' "
            f"schemas) and a turn may add rollout.max_turn_tokens {rollout.max_turn_tokens}"
            f", but the policy's context is {context} tokens; set "
            "rollout.show_tool_schemas: false, a smaller rollout.max_turn_tokens, or a "
            "larger context (model.max_positions for a tiny model)")
    return longest
