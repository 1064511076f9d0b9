"""Evaluate a run's checkpoints (or an average of their weights) exactly as the run did.

``tracerl train-eval RUN_DIR --step 12 --step 17 --average 12-17 --mix 0.5@17`` reads the
run's own ``config.yaml`` and runs its held-out evaluation (the same tasks, budget, temperature and
sampling seeds as the before/after evaluation) on each requested policy: the last checkpoint
evaluated this way reproduces the run's ``eval_after_*.json``. Step 0 is the warm start
(``RUN_DIR/sft``). It shows how held-out success moves from step to step, which one final
number cannot, whether averaging weights smooths that walk, and how a policy between the
warm start and an RL checkpoint does (``--mix``). Each evaluation is ``Trainer.evaluate``,
which runs :func:`tracerl.eval.evaluate.evaluate` (the function of ``tracerl eval``) with the
run's ``rollout`` config. Results go to
``OUT/evaluations.jsonl`` (one line per policy) and ``OUT/eval_<label>_*.json``; the run's
own files are never touched. ``KEY=VALUE`` overrides change the evaluation (e.g.
``rollout.temperature=0.7`` evaluates at another temperature: then it is no longer the run's
evaluation, and the output says which overrides were used).

A run keeps only ``keep_checkpoints`` checkpoints (2 by default): set it higher
(``keep_checkpoints=100``) on a run whose walk you want to read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tracerl.models.lora import is_adapter_dir, is_lora, load_adapter_weights
from tracerl.train.checkpoint import checkpoint_path, kept_steps

_RANGE = re.compile(r"^(\d+)-(\d+)$")


@dataclass(frozen=True)
class PolicySpec:
    """One policy to evaluate: a weighted mean of checkpoints' weights (one checkpoint: 1.0)."""

    label: str
    weights: tuple[tuple[int, float], ...]
    """(step, weight) pairs; the weights sum to 1. Step 0 is the warm start."""


def step_spec(step: int) -> PolicySpec:
    """The checkpoint after ``step`` RL steps (0: the warm start)."""
    if step < 0:
        raise ValueError(f"--step: must be >= 0, got {step}")
    return PolicySpec(f"step{step:05d}", ((step, 1.0),))


def average_spec(text: str) -> PolicySpec:
    """``FIRST-LAST``: the uniform mean of the checkpoints FIRST..LAST (both included)."""
    match = _RANGE.match(text.strip())
    if match is None:
        raise ValueError(f"--average: expected FIRST-LAST (e.g. 12-17), got {text!r}")
    first, last = int(match[1]), int(match[2])
    if first > last:
        raise ValueError(f"--average: FIRST must be <= LAST, got {text!r}")
    count = last - first + 1
    return PolicySpec(f"avg{first:05d}-{last:05d}",
                      tuple((s, 1.0 / count) for s in range(first, last + 1)))


def _value_at_step(text: str, run_dir: Path, option: str, form: str) -> tuple[float, int]:
    """``VALUE`` or ``VALUE@STEP`` as (value, step); STEP defaults to the run's newest
    checkpoint (0 when it has none). ``form`` names the two spellings in the error."""
    value, _, step = text.partition("@")
    try:
        steps = [int(step)] if step else kept_steps(run_dir)
        return float(value), steps[-1] if steps else 0
    except ValueError:
        raise ValueError(f"{option}: expected {form}, got {text!r}") from None


def parse_ema(text: str, run_dir: Path) -> PolicySpec:
    """``DECAY`` or ``DECAY@LAST`` (LAST defaults to the run's newest checkpoint)."""
    return ema_spec(*_value_at_step(text, run_dir, "--ema", "DECAY or DECAY@LAST (e.g. 0.8@17)"))


def ema_spec(decay: float, last: int) -> PolicySpec:
    """An exponential moving average of the weights, started at the warm start and updated
    after every step 1..``last``: ``w <- decay * w + (1 - decay) * w_step``."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"--ema: the decay must be in [0, 1), got {decay}")
    if last < 1:
        raise ValueError(f"--ema: needs at least one RL step, the run has {last}")
    pairs = [(0, decay ** last)]
    pairs += [(s, (1.0 - decay) * decay ** (last - s)) for s in range(1, last + 1)]
    return PolicySpec(f"ema{decay:g}-{last:05d}", tuple(pairs))


def parse_mix(text: str, run_dir: Path) -> PolicySpec:
    """``ALPHA`` or ``ALPHA@STEP`` (STEP defaults to the run's newest checkpoint)."""
    return mix_spec(*_value_at_step(text, run_dir, "--mix", "ALPHA or ALPHA@STEP (e.g. 0.5@17)"))


def mix_spec(alpha: float, step: int) -> PolicySpec:
    """The warm start's weights moved ``alpha`` of the way to step ``step``'s:
    ``(1 - alpha) * w_sft + alpha * w_step`` (weight-space interpolation between the
    fine-tuned start and the RL policy, as WiSE-FT does between a pretrained and a fine-tuned
    model)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--mix: ALPHA must be in [0, 1], got {alpha}")
    if step < 1:
        raise ValueError(f"--mix: needs a checkpoint after at least one RL step, got {step}")
    return PolicySpec(f"mix{alpha:g}-{step:05d}", ((0, 1.0 - alpha), (step, alpha)))


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where the policy after ``step`` RL steps is (step 0: ``sft``)."""
    path = run_dir / "sft" if step == 0 else checkpoint_path(run_dir, step)
    if not (path / _weights_file(path)).is_file():
        if step == 0:
            raise ValueError(f"step 0: no warm start at {path} (the run had no SFT phase)")
        raise ValueError(f"step {step}: no policy at {path} (the run kept steps "
                         f"{kept_steps(run_dir) or 'none'}; a run keeps `keep_checkpoints` "
                         "of them)")
    return path


def _weights_file(path: Path) -> str:
    """The file of a checkpoint's weights: the model's, or a LoRA run's adapter's."""
    return "adapter_model.safetensors" if is_adapter_dir(path) else "model.safetensors"


def mean_weights(run_dir: Path, spec: PolicySpec) -> dict[str, torch.Tensor]:
    """The weighted mean of the checkpoints' tensors, accumulated in float64 (a LoRA run's:
    of its adapters' factors, A and B each, on the run's one base)."""
    from safetensors.torch import load_file

    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for step, weight in spec.weights:
        directory = checkpoint_dir(run_dir, step)
        tensors = load_file(str(directory / _weights_file(directory)))
        if total and set(tensors) != set(total):
            raise ValueError(f"step {step}: its tensors differ from the other checkpoints'")
        for name, tensor in tensors.items():
            dtypes.setdefault(name, tensor.dtype)
            term = weight * tensor.double()
            total[name] = total[name] + term if name in total else term
    return {name: tensor.to(dtypes[name]) for name, tensor in total.items()}


def evaluate_run(run_dir: Path, specs: Sequence[PolicySpec], out: Path | None = None,
                 overrides: Sequence[str] = (), log: Any = print) -> list[dict[str, Any]]:
    """Evaluate each policy of ``specs`` with the run's held-out evaluation; returns (and
    appends to ``OUT/evaluations.jsonl``) one record per policy."""
    from tracerl.train.config import load_config
    from tracerl.train.trainer import Trainer

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"run_dir: {run_dir} holds no config.yaml (not a training run)")
    if not specs:
        raise ValueError("nothing to evaluate: give --step, --average, --ema or --mix")
    out = Path(out) if out is not None else run_dir / "checkpoint_eval"
    if out.resolve() == run_dir.resolve():
        raise ValueError("--out: must differ from the run's directory")
    # Every checkpoint is found before any compute; the first also gives the model's shape.
    found = [checkpoint_dir(run_dir, step) for step in spec_steps(specs)]
    config = load_config(run_dir / "config.yaml", [
        *overrides, f"run_dir={out}", f"model.path={found[0]}", "sft.enabled=false",
        "update.sft_coef=0",  # no update runs here; the mixed demonstrations need a warm start
        "progress=false", "tensorboard=false"])
    trainer = Trainer(config, log=log)
    trainer.setup()
    model = trainer.actor.policy
    records = []
    try:
        for spec in specs:
            state = mean_weights(run_dir, spec)
            if is_lora(model):
                load_adapter_weights(model, state, spec.label)
            else:
                _load_weights(model, state, spec.label)
            evaluated = trainer.evaluate(spec.label, policy=spec.label,
                                         steps=max(step for step, _ in spec.weights))
            record: dict[str, Any] = {"label": spec.label, "steps": [s for s, _ in spec.weights],
                                      "overrides": list(overrides)}
            for name, summary in evaluated.items():
                record[name] = {"success": summary["success"], "ci95": summary["ci95"],
                                "pass_at_k": summary["pass_at_k"]}
            records.append(record)
            with (out / "evaluations.jsonl").open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
            greedy = record.get("greedy", {}).get("success")
            log(f"{spec.label}: sampled {record['sampled']['success']:.3f}"
                + (f", greedy {greedy:.3f}" if greedy is not None else ""))
    finally:
        trainer.close()
    return records


def _load_weights(model: Any, state: dict[str, torch.Tensor], label: str) -> None:
    result = model.load_state_dict(state, strict=False)
    tied = {name for name in result.missing_keys if name.endswith("lm_head.weight")}
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise ValueError(f"{label}: the checkpoint does not fit the run's model "
                         f"(missing {result.missing_keys}, unexpected "
                         f"{result.unexpected_keys})")


def spec_steps(specs: Sequence[PolicySpec]) -> list[int]:
    """Every step the specs read, in first-use order."""
    seen: list[int] = []
    for spec in specs:
        for step, _ in spec.weights:
            if step not in seen:
                seen.append(step)
    return seen
