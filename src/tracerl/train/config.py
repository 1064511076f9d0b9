"""One typed configuration tree for training, loaded from YAML plus ``key=value`` overrides.

Every section is a frozen dataclass with a docstring per field (``describe_config`` turns them
into help text). Loading is strict: an unknown key, or a value of the wrong type, is refused
with the dotted name of the field and what it accepts. Cross-field rules (an estimator that
needs a critic, group methods with groups of one, ...) are checked once by ``validate``
(:mod:`tracerl.train.validate`), before any model is built or any attempt is sampled. Nothing
mutates a config while a run is going; a resumed run compares its config with the one stored
next to its checkpoints.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from tracerl.rollout.settings import RolloutConfig
from tracerl.rollout.vllm.config import VllmConfig
from tracerl.train.async_config import AsyncConfig
from tracerl.train.joint_config import MultiAgentConfig
from tracerl.train.validate import validate

Estimator = Literal["grpo", "rloo", "gae", "gigpo"]
"""Advantage estimators of :mod:`tracerl.train.algorithms` (the registry's names; what each
needs, a critic or groups, is on its registry entry)."""


@dataclass(frozen=True)
class LoraConfig:
    """LoRA: train a low-rank adapter on chosen linear layers instead of every weight (needs
    the ``peft`` package: ``pip install 'tracerl[lora]'``). The KL reference is then the same
    model with its adapter disabled, and checkpoints hold the adapter (see docs/training.md)."""

    rank: int = 0
    """Rank of each adapter; 0: off (every weight of the policy trains, the keys below are
    ignored)."""
    alpha: float = 16.0
    """Scale of the adapter: its output is multiplied by ``alpha / rank``."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Names of the linear layers that get an adapter (a YAML list, or one comma-separated
    string as in ``model.lora.target_modules=q_proj,v_proj``); the default is the attention
    projections of Llama-style models. A name no module has is refused, listing the names the
    model has."""
    dropout: float = 0.0
    """Dropout on the adapter's input while the policy trains, in [0, 1)."""


@dataclass(frozen=True)
class ModelConfig:
    """The policy: a tiny Llama built here, or a transformers model by name or path."""

    kind: Literal["tiny", "pretrained"] = "tiny"
    """``tiny``: tokenizer trained on the task corpus and a Llama built from the sizes below;
    ``pretrained``: ``AutoModelForCausalLM`` / ``AutoTokenizer`` from ``path``."""
    path: str | None = None
    """Hugging Face name or local directory (``pretrained``), or a tiny model saved earlier."""
    vocab_size: int = 1024
    """Tiny only: upper bound of the locally trained tokenizer's vocabulary."""
    hidden_size: int = 128
    """Tiny only: width of the residual stream."""
    num_layers: int = 4
    """Tiny only: number of transformer blocks."""
    num_heads: int = 4
    """Tiny only: attention heads per block."""
    intermediate_size: int = 384
    """Tiny only: width of the feed-forward layer."""
    max_positions: int = 1024
    """Tiny only: context length."""
    initializer_range: float = 0.02
    """Tiny only: standard deviation of the initial weights. A larger one makes a fresh
    model's choices depend on its input from the start (the referential game's recipe)."""
    device: str = "auto"
    """Where the policy, critic and reference live and train: ``cpu``, ``cuda``, ``cuda:N``
    or ``auto`` (the first GPU when torch sees one, else the CPU). Batches are assembled on the
    CPU and each micro-batch is moved to this device; checkpoints are the same either way."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """A LoRA adapter instead of training every weight (``model.lora.rank > 0``)."""


@dataclass(frozen=True)
class TasksConfig:
    """Where training and evaluation tasks come from."""

    train_file: str | None = None
    """JSON-lines task file for training; None uses the built-in suite's train split."""
    heldout_file: str | None = None
    """JSON-lines task file for evaluation; None uses the built-in suite's held-out split."""
    suite_seed: int = 0
    """Seed of the built-in suite's generator."""
    train_seed: int | None = None
    """Seed of the built-in train split alone (its draws of templates, names and values, and
    its renamed copies); None: ``suite_seed``. Changing it leaves the held-out split as it is,
    so runs that differ only in which train tasks they drew can be compared."""
    train_count: int = 128
    """Built-in train tasks to generate (ignored with ``train_file``)."""
    heldout_count: int = 48
    """Built-in held-out tasks to generate (ignored with ``heldout_file``)."""
    composed_train: bool = False
    """Draw built-in train tasks from the composed templates too (``envs.suite.compose``:
    hundreds of function bodies per bug family), so that a small policy learns each family's
    rule rather than a few bodies' answers. The held-out split is unchanged either way."""
    renamed_copies: int = 0
    """Renamed copies of each train task (function and module given fresh names), so a small
    policy learns to copy names from what it reads instead of memorising the suite's."""


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start on demonstrations (imperfect ones, for the demo)."""

    enabled: bool = False
    """Run the warm start before RL (skipped when resuming past it)."""
    steps: int = 300
    """Optimizer steps (a time limit, ``max_seconds``, may stop earlier)."""
    max_seconds: float | None = None
    """Wall-clock limit of the warm start; None: run all steps."""
    batch_size: int = 16
    """Demonstrations per optimizer step."""
    length_window: int = 1
    """Batches drawn at a time and regrouped by length (transformers' ``group_by_length``):
    the ``length_window * batch_size`` demonstrations drawn next are sorted by token count,
    cut into batches, and the batches shuffled, so a batch pads to a similar length. 1: each
    batch as drawn. Which demonstrations each window holds is unchanged; which ones share a
    batch (and the padding computed) changes, and so do their fresh names (``fresh_names``
    draws from the same generator as the shuffle)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW, cosine decay to 10% after a short warm-up)."""
    demos_per_task: int = 4
    """Demonstrations generated per train task."""
    wrong_edit_fraction: float = 0.4
    """Fraction of demonstrations whose (first) edit is wrong."""
    recovery_fraction: float = 0.15
    """Fraction of demonstrations that run the tests after a wrong edit, see FAIL, edit again
    and pass: the recovery behaviour then exists in the policy with small probability."""
    check_fraction: float = 0.3
    """Fraction of the remaining demonstrations that run the tests once before submitting."""
    retry_fraction: float = 0.0
    """Fraction of demonstrations whose first ``replace`` gives an ``old`` that is not in the
    line (an operator typed from memory), read the tool's ``not found`` error, and make the
    right edit: without them the policy has never seen an error and submits after one."""
    search_fraction: float = 0.0
    """Fraction of demonstrations that search with the tests: one or two wrong versions of the
    buggy part of the line, each followed by a FAIL test run, then the right one, PASS,
    submit (with ``undo``, as many wrong tries as ``rollout.max_turns`` leaves room for: one in
    8 turns, two in 12). Unlike ``recovery`` (whose second edit needs the same knowledge as a
    right first edit), the second try only has to change what the first try changed."""
    observation_weight: float = 0.0
    """Weight of a side loss on the context tokens (task statement, tool outputs), relative to
    the action loss; 0 trains on actions only. The demo uses it: a tiny model learns to copy
    names from what it reads much sooner when it also learns to predict what it reads."""
    fresh_names: float = 0.0
    """Probability that a demonstration, each time it is drawn for a batch, is renamed with a
    freshly drawn function/module name (see ``envs.suite.augment``): the policy must then copy the
    name it reads, as it will have to on held-out tasks, instead of recalling it."""
    implicit_path: bool = False
    """Demonstrations call ``view_file`` and ``replace`` without ``path``, relying on the
    environment's open file (see ``CodingEnv.open_file``): names need not be typed at all."""
    line_edits: bool = True
    """Demonstrations edit with ``replace`` scoped to one line (``line``, and ``old``/``new`` as
    short as the change): a small model then copies a line number and one operator instead of
    a whole line of code. False: ``old`` is the whole (stripped) buggy line."""
    undo: bool = False
    """``recovery`` and ``search`` demonstrations call ``undo`` after a wrong edit's FAIL, so
    every try is made on the line as the task gave it (one text to copy from, the first
    view); off: the next edit changes the wrong version."""


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """Keeping groups informative (the mixed-group probability argument)."""

    filter_uniform: bool = False
    """Drop groups whose rewards are all equal (no relative signal) from the update."""
    refill: bool = False
    """After filtering, collect more groups (up to ``max_refills`` rounds) to fill the step."""
    max_refills: int = 2
    """Extra collection rounds per step when refilling."""
    success_sampling: bool = False
    """Sample tasks with weight ``p(1-p)``-like by their estimated success (an EMA), so groups
    keep varying; tasks never tried get the prior."""
    success_prior: float = 0.5
    """Estimated success of a task never tried."""
    success_ema: float = 0.5
    """Weight of the newest step in the success estimate."""
    min_weight: float = 0.05
    """Floor of a task's sampling weight, so no task is starved."""


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantage estimation."""

    estimator: Estimator = "grpo"
    """``grpo`` (group-relative outcome), ``rloo`` (leave-one-out), ``gae`` (learned critic,
    GAE over action tokens with bootstraps from the endings), ``gigpo`` (episode groups plus
    step groups of identical states)."""
    scale: Literal["std", "none"] = "std"
    """Group methods: divide by the group's std (``std``, GRPO) or only centre (``none``,
    Dr. GRPO)."""
    std: Literal["population", "sample"] = "population"
    """Group std convention: divide by G (population) or G - 1 (sample)."""
    gamma: float = 1.0
    """Discount over action tokens (GAE) or turns (GiGPO step returns)."""
    gae_lambda: float = 0.95
    """GAE trace decay λ."""
    whiten: bool = False
    """Whiten advantages over the batch's action tokens."""
    step_weight: float = 1.0
    """GiGPO: weight of the step-group advantage added to the episode advantage."""
    step_key: Literal["context", "observation"] = "context"
    """GiGPO: what makes two steps' states identical: the whole token context before the
    action (``context``) or the latest observation and the turn number (``observation``)."""


@dataclass(frozen=True)
class CriticConfig:
    """The learned value function (GAE only)."""

    kind: Literal["none", "value_head", "separate"] = "none"
    """``value_head``: a linear head on the policy's last hidden state (shared trunk);
    ``separate``: a copy of the policy's architecture with its own weights and a head."""
    lr: float = 1e-3
    """Learning rate of the critic's parameters."""
    coef: float = 0.5
    """Weight of the value loss in the total loss."""
    clip: float | None = 0.2
    """Value clipping around the old values; None: plain squared error."""


@dataclass(frozen=True)
class UpdateConfig:
    """The PPO update."""

    epochs: int = 1
    """Passes over the batch."""
    minibatches: int = 1
    """Optimizer steps per epoch (the batch's rows split evenly)."""
    micro_batch_rows: int = 16
    """Rows per forward/backward; gradients accumulate exactly (weights from the minibatch)."""
    lr: float = 1e-3
    """Policy learning rate (AdamW)."""
    warmup_steps: int = 0
    """Optimizer steps over which the learning rates rise linearly to ``lr`` (and the
    critic's). A fresh AdamW's first steps move every weight by about ``lr`` whatever the
    gradient's size (m/sqrt(v) is near ±1 at first). 0: the full rate from the first step."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm; None: off."""
    loss_level: Literal["token", "sequence"] = "token"
    """Token-level ratios (PPO/GRPO) or one sequence ratio per row (GSPO)."""
    loss_mode: Literal["token_mean", "sequence_mean", "task_mean", "constant"] = "token_mean"
    """Denominator of the loss, computed once per minibatch (see ``core.loss_weights``)."""
    loss_constant: float | None = None
    """Divisor for ``loss_mode: constant`` (Dr. GRPO)."""
    clip_low: float = 0.2
    """PPO clip below 1."""
    clip_high: float | None = None
    """PPO clip above 1 (None: same as ``clip_low``; larger is DAPO's clip-higher)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages; None: off."""
    entropy_coef: float = 0.0
    """Weight of the policy's entropy on its action tokens: above 0 a bonus (keeps sampling
    diverse), below 0 a penalty (entropy minimisation: the policy sharpens toward what it
    already prefers, so its samples at a fixed temperature come closer to its greedy
    decoding). 0: off."""
    sft_coef: float = 0.0
    """Weight of the warm start's supervised loss mixed into every optimizer step of RL, on a
    fresh batch of ``sft.batch_size`` demonstrations of the train split (drawn as the warm
    start draws them, ``sft.fresh_names`` included, and weighted the same way,
    ``sft.observation_weight`` included): InstructGPT's PPO-ptx, with the demonstrations in
    place of pretraining data. It anchors what SFT taught (reading and copying the line) while
    RL changes the decisions; unlike ``kl_coef`` it acts on the demonstrations' tokens, not on
    the sampled ones. Needs ``sft.enabled``. 0: off."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference (the SFT or initial policy); 0: no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator. In the loss, k2's gradient grows with the log-ratio (linearly);
    k3's with its exponential, so a few tokens far below the reference's probability can
    dominate an update (see ``kl_clamp``)."""
    kl_clamp: float | None = 10.0
    """Cap on each token's KL estimate in the loss (as verl caps its k3); tokens above it give
    no KL gradient. One update of a small fine-tuned policy can lower a sampled token's
    log-probability by 10 nats (k3 about 22,000 there). None: no cap."""
    kl_in: Literal["loss", "reward"] = "loss"
    """KL as a loss term (GRPO-style) or as a per-token reward penalty (needs ``gae``)."""
    tis_cap: float | None = None
    """Truncated importance sampling: weight tokens by ``min(pi_old / pi_behavior, cap)``;
    None: off."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """With ``tis_cap``: ``truncate`` weights a token whose ratio exceeds the cap by the cap;
    ``mask`` gives it weight 0 (it leaves the loss; the denominator is unchanged)."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the policy's weights, started at the weights RL
    starts from (the warm start) and moved after every RL step:
    ``ema <- decay * ema + (1 - decay) * weights``. The final held-out evaluation and the
    summary's ``policy_dir`` then use the average (written to ``RUN/policy``); training
    itself, the checkpoints it resumes from and ``eval.every`` use the raw weights, and each
    checkpoint carries the average so a resumed run continues it. After ``n`` steps the warm
    start's share is ``decay ** n``. None: off (the last iterate is the run's policy)."""


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation with a fixed budget."""

    every: int = 0
    """Evaluate every this many RL steps (0: only before and after training)."""
    tasks: int | None = None
    """Held-out tasks evaluated (None: all loaded)."""
    samples_per_task: int = 8
    """Sampled attempts per task at the rollout temperature (pass@k up to this k)."""
    greedy: bool = True
    """Also evaluate one greedy attempt per task."""
    bootstrap_resamples: int = 2000
    """Resamples of the task-level bootstrap for confidence intervals."""


@dataclass(frozen=True)
class TrainConfig:
    """A whole run."""

    run_dir: str = "runs/train"
    """Directory of the run: checkpoints, trace store, metrics, summary."""
    seed: int = 0
    """Seeds every generator (model init, sampling, shuffling, task choice)."""
    steps: int = 20
    """RL steps (collect, verify, advantages, update)."""
    max_seconds: float | None = None
    """Stop RL after this many seconds (the step in progress finishes)."""
    max_generated_tokens: int | None = None
    """Stop RL at the step boundary nearest to this many generated tokens (every collected
    attempt counts, kept or filtered): the budget that makes two designs comparable, since
    equal steps or attempts can differ in tokens by a third (``tracerl compare`` checks it)."""
    checkpoint_every: int = 1
    """Checkpoint every this many steps (the last step is always saved)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk (older ones are deleted)."""
    threads: int | None = None
    """torch intra-op threads; None leaves torch's default."""
    tensorboard: bool = True
    """Write TensorBoard event files beside the JSON-lines metrics."""
    progress: bool = True
    """Show a progress bar."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    """Training and evaluation tasks."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Collection of attempts."""
    dynamic: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """Filtering uniform groups and choosing tasks by success."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The learned critic."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """The PPO update."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """The vLLM server of ``rollout.engine: vllm``."""
    multiagent: MultiAgentConfig = field(default_factory=MultiAgentConfig)
    """Several agents in one task (off unless ``multiagent.env`` is set)."""
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    """Collection running ahead of the update (off: ``max_staleness`` 0)."""


# -- loading ---------------------------------------------------------------------------------


def _type_name(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(hint))
    if hint is type(None):
        return "null"
    if origin is tuple:
        return f"a list of {_type_name(get_args(hint)[0])}"
    if is_dataclass(hint):
        return f"a mapping ({getattr(hint, '__name__', 'section')})"
    return getattr(hint, "__name__", str(hint))


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """``value`` checked against the type ``hint``; ValueError naming ``name`` otherwise."""
    origin = get_origin(hint)
    if origin is Literal:
        if value in get_args(hint) and not isinstance(value, bool):
            return value
        raise ValueError(f"{name}: got {value!r}, accepts {_type_name(hint)}")
    if origin in (Union, types.UnionType):
        for option in get_args(hint):
            try:
                return _coerce(value, option, name)
            except ValueError:
                continue
        raise ValueError(f"{name}: got {value!r}, accepts {_type_name(hint)}")
    if hint is type(None):
        if value is None:
            return None
        raise ValueError(f"{name}: got {value!r}, accepts null")
    if origin is tuple:
        if isinstance(value, str):  # ``a,b`` from an override
            value = [part.strip() for part in value.split(",")]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}: got {value!r}, accepts a list")
        item = get_args(hint)[0]
        return tuple(_coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value))
    if is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{name}: got {value!r}, accepts {_type_name(hint)}")
        return _build(hint, value, name)  # type: ignore[arg-type]
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        # An integer written in YAML (``lr: 1``) is a fine float; a bool is not.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - every field type above is handled
        raise ValueError(f"{name}: unsupported field type {hint!r}")
    raise ValueError(f"{name}: got {value!r} ({type(value).__name__}), accepts {_type_name(hint)}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = _hints(cls)
    known = {f.name for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        renamed: dict[str, str] = getattr(cls, "RENAMED", {})
        if key in renamed:
            new_name = f"{prefix}.{renamed[key]}" if prefix else renamed[key]
            raise ValueError(f"{name}: renamed; use {new_name}")
        if key not in known:
            raise ValueError(
                f"{name}: unknown key; {cls.__name__} accepts {', '.join(sorted(known))}"
            )
        kwargs[key] = _coerce(value, hints[key], name)
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any] | None) -> TrainConfig:
    """A checked :class:`TrainConfig` from nested mappings (as YAML gives them)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config: the top level must be a mapping, got {type(data).__name__}")
    config: TrainConfig = _build(TrainConfig, data, "")
    validate(config)
    return config


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"update.lr=3e-4"`` → ``("update.lr", 3e-4)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ValueError(f"override {text!r}: expected KEY=VALUE (e.g. update.lr=3e-4)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ValueError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        raise ValueError(f"override {key}: value {raw!r} is not valid YAML") from error
    # YAML reads ``1e-3`` (no dot) as a string; a number was meant.
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value) if any(c in value for c in ".eE") else value
    return key, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
                ) -> TrainConfig:
    """Read a YAML recipe (or start from the defaults) and apply ``key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        source = Path(path)
        if not source.is_file():
            raise ValueError(f"config: {str(source)!r} is not a file")
        try:
            loaded = yaml.safe_load(source.read_text(encoding="utf-8"))
        except yaml.YAMLError as error:
            raise ValueError(f"config: {source} is not valid YAML: {error}") from error
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config: {source} must hold a mapping at the top level")
        data = loaded or {}
    for text in overrides:
        key, value = parse_override(text)
        _set_path(data, key, value)
    return config_from_dict(data)


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain nested mappings (YAML- and JSON-ready: tuples become lists)."""
    return _lists(dataclasses.asdict(config))


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value


def config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: old -> new`` for every field whose value differs between two config dicts
    (nested sections by dotted key; a field only one side has shows ``(none)`` on the other)."""
    changes: list[str] = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "(none)"), new.get(key, "(none)")
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return changes


def dump_config(config: TrainConfig) -> str:
    """The config as YAML text that :func:`load_config` reads back to an equal config."""
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


# -- help text ----------------------------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a config dataclass, read from its source."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    statements = body.body
    for current, following in itertools.pairwise(statements):
        if (isinstance(current, ast.AnnAssign) and isinstance(current.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[current.target.id] = " ".join(following.value.value.split())
    return docs


def describe_config(config: Any = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted name, current value, docstring)`` for every leaf field, for ``--help``."""
    config = TrainConfig() if config is None else config
    rows: list[tuple[str, str, str]] = []
    docs = field_docs(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        name = f"{prefix}{f.name}"
        if is_dataclass(value):
            rows.extend(describe_config(value, f"{name}."))
        else:
            rows.append((name, repr(value), docs.get(f.name, "")))
    return rows
