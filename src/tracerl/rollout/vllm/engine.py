"""The vLLM rollout engine: a server holding the trainer's weights, verified after every sync.

:class:`VllmEngine` owns everything the trainer needs of it:

- ``start(model)``: the run's weights and tokenizer saved under ``RUN/engine/base``, a server
  started on them (:class:`~tracerl.rollout.vllm.server.VllmServer`, log in
  ``RUN/engine/server.log``) or the user's server at ``vllm.url`` reached, and an
  :class:`~tracerl.rollout.policies.openai_api.OpenAIPolicy` that samples from it;
- ``sync(model, version)`` before each collection: the full weights written to a directory of
  their own, ``RUN/engine/weights/sNNNNN-vVVVVVV`` (written under a temporary name and renamed,
  so the server never reads half a version), loaded with the dev-mode
  ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``, the
  prefix cache reset (cached keys and values of the old weights must not be reused), then
  verified: the server's logprobs of a fixed probe sequence must equal the trainer's
  (:mod:`tracerl.rollout.vllm.probe`), else :class:`SyncMismatch` stops the run. Only then
  does the policy stamp ``version`` on what it samples. Older version directories are
  deleted, ``vllm.keep_versions`` kept;
- ``failure()`` after a collection: what happened when the server died under it.

A LoRA policy (``model.lora``) syncs its adapter instead: the server starts on the adapter's
base with ``--enable-lora``; each version's adapter is saved in PEFT's layout to its own
directory, loaded with ``POST /v1/load_lora_adapter`` under a name of its own
(``policy-sNNNNN-vVVVVVV``), the previous one unloaded (``/v1/unload_lora_adapter``), and
requests name the current adapter; the probe runs against that name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from tracerl.models import lora
from tracerl.rollout.policies.openai_api import OpenAIPolicy, OpenAIPolicyConfig
from tracerl.rollout.vllm import probe
from tracerl.rollout.vllm.config import VllmConfig
from tracerl.rollout.vllm.server import (
    EngineError,
    EngineUnavailable,
    VllmServer,
    get_json,
    log_tail,
    post_json,
)

ENGINE_DIR = "engine"
"""The engine's files under the run directory: ``base`` (the weights the server started
from), ``weights`` (one directory per synced version), ``server.log``."""


def version_name(sync: int, version: int) -> str:
    """The directory name of the ``sync``-th sync, of policy version ``version``."""
    if sync < 0 or version < 0:
        raise ValueError(f"sync and version must be >= 0, got {sync} and {version}")
    return f"s{sync:05d}-v{version:06d}"


LM_HEAD_FILE = "lm_head.safetensors"
"""Where :func:`save_for_engine` writes the output layer of a model with tied embeddings."""
BODY_FILE = "model-body.safetensors"
"""Where it moves the other weights of a single-file checkpoint (an index names both)."""


def save_for_engine(model: Any, directory: Path) -> None:
    """``model.save_pretrained(directory)``, with the output layer saved separately when it is
    tied to the input embeddings (``lm_head.weight`` in ``LM_HEAD_FILE``, and the config
    marked untied). vLLM's in-place ``reload_weights`` does not carry a tied output layer
    along (its CPU build keeps a processed copy of it): without this the server keeps the old
    output layer after every sync, which the probe catches. Untied on the server, with equal
    copies, the model computes exactly what the tied one does."""
    model.save_pretrained(directory, safe_serialization=True)
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if head is None or embed is None or head.weight.data_ptr() != embed.weight.data_ptr():
        return
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file({"lm_head.weight": head.weight.detach().to("cpu").contiguous().clone()},
              str(directory / LM_HEAD_FILE), metadata={"format": "pt"})
    # An index names the file of every weight, so transformers and vLLM both read the extra
    # file: a single-file checkpoint becomes a sharded one (transformers reads a file named
    # model.safetensors alone, ignoring any index).
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
    else:
        single = directory / "model.safetensors"
        with safe_open(str(single), framework="pt") as handle:
            names = list(handle.keys())
        single.rename(directory / BODY_FILE)
        data = {"metadata": {}, "weight_map": dict.fromkeys(names, BODY_FILE)}
    data.setdefault("weight_map", {})["lm_head.weight"] = LM_HEAD_FILE
    index.write_text(json.dumps(data, indent=1), encoding="utf-8")
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tie_word_embeddings"] = False
    config_path.write_text(json.dumps(config, indent=1), encoding="utf-8")


def write_version(model: Any, directory: Path, name: str) -> Path:
    """``model``'s weights saved (``save_pretrained``) as ``directory/name``, atomically: written
    under a temporary name, then renamed. Returns the final path; an existing one is refused
    (every sync gets a directory of its own)."""
    final = directory / name
    if final.exists():
        raise FileExistsError(f"{final} exists: a weight version is written once")
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".partial-{name}"
    shutil.rmtree(partial, ignore_errors=True)
    save_for_engine(model, partial)
    partial.rename(final)
    return final


def prune_versions(directory: Path, keep: int, *, current: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` version directories in ``directory`` (never
    ``current``) and any partial one a killed run left; returns what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if not directory.is_dir():
        return []
    removed: list[Path] = []
    for leftover in [*directory.glob(".partial-*"), *directory.glob(".*.tmp")]:
        shutil.rmtree(leftover, ignore_errors=True)
        removed.append(leftover)
    versions = sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith("s"))
    for old in versions[:-keep]:
        if current is not None and old.resolve() == current.resolve():
            continue
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old)
    return removed


class VllmEngine:
    """A vLLM server serving the trainer's weights (see the module docstring)."""

    def __init__(self, config: VllmConfig, run_dir: str | Path, tokenizer: Any, *,
                 seed: int = 0) -> None:
        self.config = config
        self.directory = Path(run_dir) / ENGINE_DIR
        self.tokenizer = tokenizer
        self.seed = seed
        self.server: VllmServer | None = None
        self.policy: OpenAIPolicy | None = None
        """The sampler of every attempt; its ``policy_version`` is the verified one."""
        self.verified_version: int | None = None
        """The policy version the server was last verified to serve."""
        self.syncs = 0
        self.probe: list[int] = []
        self.adapter: str | None = None
        """The name of the LoRA adapter requests use (None: full weights)."""

    @property
    def base_url(self) -> str:
        """The server's root URL."""
        if self.server is not None:
            return self.server.base_url
        assert self.config.base_url is not None, "start() first"
        return self.config.base_url

    @property
    def served_name(self) -> str:
        """The model name requests use: the current adapter's, or the served model's."""
        return self.adapter or self.config.served_model

    @property
    def log_path(self) -> Path:
        """The started server's output."""
        return self.directory / "server.log"

    def start(self, model: Any, version: int) -> dict[str, float]:
        """Start (or reach) the server and verify it serves ``model`` at ``version``; returns
        the first sync's metrics."""
        config = self.config
        vocab = int(model.get_output_embeddings().weight.shape[0])
        self.probe = probe.probe_ids(vocab, config.probe_tokens, seed=self.seed)
        context = config.max_model_len or getattr(model.config, "max_position_embeddings", None)
        adapter = lora.is_lora(model)
        if config.url is None:
            base = self.directory / "base"
            rank = 0
            if adapter:  # the server holds the base; each version's adapter is loaded
                lora_config = model.peft_config["default"]
                base, rank = Path(lora_config.base_model_name_or_path), int(lora_config.r)
            else:
                shutil.rmtree(base, ignore_errors=True)
                save_for_engine(model, base)
                self.tokenizer.save_pretrained(base)
            self.server = VllmServer(config, base, self.log_path, seed=self.seed,
                                     lora_rank=rank).start()
        else:
            self._check_serves_model()
        self.policy = OpenAIPolicy(
            OpenAIPolicyConfig(base_url=self.base_url + "/v1", model=config.served_model,
                               timeout=config.request_seconds, engine="vllm",
                               context_length=int(context) if context else None),
            tokenizer=self.tokenizer, policy_version=version)
        if config.url is None and not adapter:  # started on these weights: nothing to load
            started = time.perf_counter()
            result = self.verify(model, version)
            return {"sync_seconds": 0.0, "verify_seconds": time.perf_counter() - started,
                    "probe_max_abs_diff": result.max_abs_diff}
        return self.sync(model, version)

    def _check_serves_model(self) -> None:
        listed = get_json(self.base_url, "/v1/models", timeout=30.0)
        names = [m.get("id") for m in (listed or {}).get("data", []) if isinstance(m, dict)]
        if self.config.served_model not in names:
            raise EngineError(f"vllm.url {self.config.url} serves {names}, not "
                              f"vllm.served_model {self.config.served_model!r}")

    def sync(self, model: Any, version: int) -> dict[str, float]:
        """Put ``model``'s weights into the server as ``version`` and verify them (see the
        module docstring); returns seconds spent and the probe's agreement."""
        if self.policy is None:
            raise EngineError("the engine is not started")
        started = time.perf_counter()
        self.syncs += 1
        weights = self.directory / "weights"
        name = version_name(self.syncs, version)
        if lora.is_lora(model):
            path = weights / name
            if path.exists():
                raise FileExistsError(f"{path} exists: a weight version is written once")
            lora.save_adapter(model, path)
            written = time.perf_counter()
            self.load_adapter(path, f"{self.config.served_model}-{name}")
        else:
            path = write_version(model, weights, name)
            written = time.perf_counter()
            self.load(path)
        loaded = time.perf_counter()
        result = self.verify(model, version)
        prune_versions(weights, self.config.keep_versions, current=path)
        return {"sync_seconds": loaded - started, "write_seconds": written - started,
                "load_seconds": loaded - written, "verify_seconds": time.perf_counter() - loaded,
                "probe_max_abs_diff": result.max_abs_diff}

    def load(self, path: Path) -> None:
        """Have the server load the full weights in ``path``, then drop its prefix cache."""
        self._alive("loading weights")
        timeout = self.config.request_seconds
        post_json(self.base_url, "/collective_rpc",
                  {"method": "reload_weights", "kwargs": {"weights_path": str(path.resolve())}},
                  timeout=timeout)
        post_json(self.base_url, "/reset_prefix_cache", timeout=timeout)

    def load_adapter(self, path: Path, name: str) -> None:
        """Have the server load the LoRA adapter in ``path`` as ``name``, unload the one
        requests named so far, and name ``name`` in requests from now on."""
        self._alive("loading an adapter")
        timeout = self.config.request_seconds
        post_json(self.base_url, "/v1/load_lora_adapter",
                  {"lora_name": name, "lora_path": str(path.resolve())}, timeout=timeout)
        previous, self.adapter = self.adapter, name
        if previous is not None:
            post_json(self.base_url, "/v1/unload_lora_adapter", {"lora_name": previous},
                      timeout=timeout)
        assert self.policy is not None
        self.policy.config = dataclasses.replace(self.policy.config, model=name)

    def verify(self, model: Any, version: int) -> probe.ProbeResult:
        """The probe compared (SyncMismatch when the server does not serve ``model``); on
        success the policy stamps ``version`` from now on."""
        assert self.policy is not None
        self._alive("verifying the weights")
        expected = probe.trainer_logprobs(model, self.probe)
        served = probe.server_logprobs(self.base_url, self.served_name, self.probe,
                                       timeout=self.config.request_seconds)
        result = probe.compare(expected, served, tolerance=self.config.probe_tolerance,
                               version=version)
        self.verified_version = version
        self.policy.policy_version = version
        return result

    def _alive(self, doing: str) -> None:
        if self.server is not None and not self.server.alive():
            raise EngineUnavailable(self.failure() or f"the vLLM server is not running ({doing})")

    def failure(self) -> str | None:
        """What went wrong with the server, or None while it runs (a started server: its exit
        status and log tail; a server at ``vllm.url``: whether it answers)."""
        if self.server is not None:
            code = self.server.returncode()
            if code is None:
                return None
            return (f"the vLLM server exited with code {code} (log: {self.log_path}); its last "
                    f"lines:\n{log_tail(self.log_path, 15)}")
        try:
            get_json(self.base_url, "/v1/models", timeout=30.0)
        except EngineError as error:
            return f"the vLLM server at {self.base_url} does not answer: {error}"
        return None

    def close(self) -> None:
        """Stop a started server (a server at ``vllm.url`` is left running)."""
        if self.server is not None:
            self.server.stop()
