"""LoRA adapters (through ``peft``): the policy trains a low-rank update of chosen linear
layers while the base model's weights stay as they were loaded.

- :func:`apply_lora` wraps a transformers causal LM; only the adapter is trainable.
- :func:`save_adapter` writes the adapter in PEFT's layout (``adapter_config.json`` and
  ``adapter_model.safetensors``, what ``peft.PeftModel.from_pretrained`` and vLLM's
  ``/v1/load_lora_adapter`` read), atomically.
- :func:`load_with_adapter` puts a saved adapter back on its base: trainable (a resumed run),
  or merged into the base's weights (evaluation and serving: a plain model again; not when
  the adapter is on an output head tied to the input embedding, which merging would change).
- :class:`AdapterOff` is the same model with its adapter disabled (the KL reference of a LoRA
  run: no second copy of the base).

An adapter's ``adapter_config.json`` names its base (``base_model_name_or_path``): a local
directory (absolute) or a model name. A run directory moved elsewhere still finds its own
saved base: when the recorded directory is missing, ``base/`` beside the adapter's directory
or one level up (``RUN/base`` for ``RUN/policy`` and ``RUN/checkpoints/step-000012``) is used.

``peft`` is imported only when an adapter is asked for; without it the error says how to
install it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
"""PEFT's adapter description, beside ``adapter_model.safetensors``."""
BASE_DIR = "base"
"""Where a run saves the base its adapters apply to, when the base is not a named model."""
INSTALL_HINT = "pip install 'tracerl[lora]'"


@dataclass(frozen=True)
class LoraSettings:
    """What :func:`apply_lora` builds: an adapter of rank ``rank`` on every linear layer
    whose name is one of ``target_modules``, its output scaled by ``alpha / rank``."""

    rank: int
    """Rank of each adapter (>= 1)."""
    alpha: float
    """Scale numerator (> 0): the adapter's output is multiplied by ``alpha / rank``."""
    target_modules: tuple[str, ...]
    """Module names that get an adapter (``q_proj``; a dotted suffix such as
    ``self_attn.q_proj`` works too)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training, in [0, 1)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank: must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"alpha: must be > 0, got {self.alpha}")
        if not self.target_modules or any(not t.strip() for t in self.target_modules):
            raise ValueError(f"target_modules: must name at least one module, each non-empty, "
                             f"got {self.target_modules!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")


def _peft() -> Any:
    try:
        import peft
    except ImportError as error:  # pragma: no cover - peft is in the test extra
        raise ImportError(f"LoRA needs the peft package: {INSTALL_HINT}") from error
    return peft


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a peft-wrapped model (never imports peft itself)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def is_adapter_dir(directory: str | Path) -> bool:
    """Whether ``directory`` holds an adapter (PEFT layout) rather than a whole model."""
    path = Path(directory)
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def base_model(model: Any) -> Any:
    """The transformers model under a LoRA wrapper (with the adapter layers in it), or
    ``model`` itself."""
    return model.get_base_model() if is_lora(model) else model


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of ``model``'s linear layers (what a target may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and name})


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def apply_lora(model: Any, settings: LoraSettings, *, base_name: str | None = None,
               seed: int = 0) -> Any:
    """``model`` (a transformers causal LM) wrapped with a fresh adapter; every base weight is
    frozen, only the adapter trains. The adapter starts as the zero update (peft's
    initialisation: ``B = 0``), so the wrapped model computes what ``model`` computed.

    ``base_name``: recorded as the adapter's base (a directory or a model name). ``seed``:
    the adapter's random initialisation (the global torch generator is left as it was).
    ValueError naming each target that matches no module, with the names the model has."""
    names = [name for name, _ in model.named_modules() if name]
    missing = [t for t in settings.target_modules if not any(_matches(n, t) for n in names)]
    if missing:
        raise ValueError(
            f"model.lora.target_modules: {', '.join(missing)} "
            f"{'matches' if len(missing) == 1 else 'match'} no module of "
            f"{type(model).__name__}; its linear layers are named "
            f"{', '.join(linear_names(model))}")
    peft = _peft()
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                             target_modules=list(settings.target_modules),
                             lora_dropout=settings.dropout, bias="none",
                             task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, config)
    if base_name is not None:
        wrapped.peft_config["default"].base_model_name_or_path = base_name
    return wrapped


def adapter_parameters(model: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters of ``model`` by name (the adapter's, for a LoRA model)."""
    return ((name, p) for name, p in model.named_parameters() if p.requires_grad)


def load_adapter_weights(model: Any, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Put adapter tensors as ``adapter_model.safetensors`` holds them into ``model``'s
    adapter; ValueError naming ``source`` when some do not fit or some are missing."""
    peft = _peft()
    result = peft.set_peft_model_state_dict(model, tensors)
    expected = {name for name, _ in adapter_parameters(model)}
    missing = sorted(name for name in result.missing_keys if name in expected)
    if result.unexpected_keys or missing:
        raise ValueError(f"{source}: the adapter does not fit the run's model (missing "
                         f"{missing}, unexpected {list(result.unexpected_keys)})")


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())


def save_adapter(model: Any, directory: str | Path) -> Path:
    """Write ``model``'s adapter to ``directory`` in PEFT's layout, atomically: written to a
    temporary directory beside it, fsynced and renamed into place (a directory already there
    is replaced whole). Returns ``directory``."""
    if not is_lora(model):
        raise ValueError(f"save_adapter: {type(model).__name__} has no LoRA adapter")
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    _fsync_tree(tmp)
    old = final.parent / f".{final.name}.old"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def recorded_base(adapter_dir: str | Path) -> str:
    """The base the adapter in ``adapter_dir`` applies to: a directory that exists, or a model
    name. ValueError naming the directory when neither the recorded one nor a run's ``base/``
    is there."""
    directory = Path(adapter_dir)
    config_file = directory / ADAPTER_CONFIG
    if not config_file.is_file():
        raise ValueError(f"adapter {str(directory)!r}: {ADAPTER_CONFIG} is missing")
    recorded = json.loads(config_file.read_text(encoding="utf-8")).get("base_model_name_or_path")
    if recorded and Path(recorded).is_dir():
        return str(recorded)
    for parent in (directory.parent, directory.parent.parent):
        if (parent / BASE_DIR / "config.json").is_file():
            return str(parent / BASE_DIR)
    if recorded and not Path(recorded).is_absolute() and not recorded.startswith("."):
        return str(recorded)  # a model name (e.g. from the hub cache)
    raise ValueError(f"adapter {str(directory)!r}: its base {recorded!r} is not there, and no "
                     f"{BASE_DIR}/ directory is beside it")


def load_with_adapter(base: Any, adapter_dir: str | Path, *, trainable: bool = False,
                      merge: bool = False) -> Any:
    """The adapter in ``adapter_dir`` on ``base`` (a loaded model, a directory or a model
    name; ``None``: the base recorded with the adapter). ``trainable``: the adapter trains
    (a resumed run); ``merge``: the adapter is folded into the base's weights and a plain
    transformers model comes back (evaluation, serving)."""
    peft = _peft()
    directory = Path(adapter_dir)
    if base is None:
        base = recorded_base(directory)
    if isinstance(base, (str, Path)):
        base = _load_base(str(base))
    model = peft.PeftModel.from_pretrained(base, str(directory), is_trainable=trainable)
    if merge and not adapts_tied_weights(model):
        return model.merge_and_unload()
    return model


def adapts_tied_weights(model: Any) -> bool:
    """Whether an adapter sits on an output head that shares its weight with the input
    embedding: merged, it would change the embedding too, so such a model stays unmerged."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    return any(name.rsplit(".", 1)[-1] == "lm_head" and hasattr(module, "lora_A")
               for name, module in model.named_modules())


def _load_base(name: str) -> Any:
    from transformers import AutoModelForCausalLM

    if Path(name).is_dir():
        from tracerl.models.tiny import load_tiny

        return load_tiny(name)[0]
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)


def load_adapter_dir(directory: str | Path, *, trainable: bool = False,
                     merge: bool = False) -> tuple[Any, Any]:
    """Model and tokenizer of an adapter directory (a LoRA checkpoint or ``RUN/policy``): its
    recorded base with the adapter on it (see :func:`load_with_adapter`), and the tokenizer
    saved beside the adapter (else the base's)."""
    from transformers import AutoTokenizer

    path = Path(directory)
    base = recorded_base(path)
    source = path if (path / "tokenizer_config.json").is_file() else base
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=Path(source).is_dir())
    model = load_with_adapter(base, path, trainable=trainable, merge=merge)
    from tracerl.models.weights import check_finite_weights

    check_finite_weights(model, path)
    return model, tokenizer


class AdapterOff(torch.nn.Module):
    """``model`` (a LoRA model) with its adapter disabled: what the base alone computes. The
    same weights, not a copy; nothing of it trains through this view."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        if not is_lora(model):
            raise ValueError(f"AdapterOff: {type(model).__name__} has no LoRA adapter")
        self.adapted = model

    @property
    def config(self) -> Any:
        """The base model's transformers config."""
        return self.adapted.config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward with the adapter disabled."""
        with self.adapted.disable_adapter():
            return self.adapted(*args, **kwargs)
