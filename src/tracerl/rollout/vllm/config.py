"""The ``vllm`` section of a training recipe: how the trainer starts (or finds) the vLLM server
that samples its rollouts when ``rollout.engine: vllm``, and how each weight sync is checked."""

from __future__ import annotations

from dataclasses import dataclass

ENGINES: tuple[str, ...] = ("local", "vllm")
"""Values of ``rollout.engine``: ``local`` samples in the trainer's process (``HFPolicy``);
``vllm`` samples through a vLLM server that receives the trainer's weights before every
collection (:mod:`tracerl.rollout.vllm`)."""


@dataclass(frozen=True)
class VllmConfig:
    """The vLLM server of ``rollout.engine: vllm`` (ignored by the local engine)."""

    url: str | None = None
    """Base URL of a vLLM server that is already running (``http://host:8000``, with or
    without ``/v1``), started with ``VLLM_SERVER_DEV_MODE=1`` on a model of the run's
    architecture and ``--served-model-name`` equal to ``served_model``; None: the trainer
    starts one itself on the run's weights and stops it when the run ends."""
    python: str | None = None
    """The Python interpreter that has vLLM installed (the server runs as
    ``PYTHON -m vllm.entrypoints.openai.api_server``); None: the trainer's own."""
    host: str = "127.0.0.1"
    """Address a started server listens on."""
    port: int = 0
    """Port of a started server; 0: a free port chosen at start."""
    served_model: str = "policy"
    """The model name the server serves (``--served-model-name``); requests name it."""
    dtype: str = "float32"
    """``--dtype`` of a started server. ``float32`` keeps the engine's logprobs equal to the
    trainer's forward (vLLM's ``auto`` downcasts); with ``bfloat16`` raise
    ``probe_tolerance``."""
    max_model_len: int | None = None
    """``--max-model-len`` of a started server; None: the model's own context
    (``max_position_embeddings``)."""
    start_seconds: float = 600.0
    """Longest wait for a started server to answer; then the start fails with its log's tail."""
    request_seconds: float = 300.0
    """Longest wait for one completion; then the attempt ends ``tool_error`` (the engine's
    failure, never the policy's)."""
    probe_tokens: int = 32
    """Length of the fixed probe sequence whose logprobs the server must give as the trainer
    computes them after every weight sync."""
    probe_tolerance: float = 1e-4
    """Largest ``|server logprob - trainer logprob|`` on the probe accepted as the same
    weights (nats); float32 on CPU agrees to about 1e-6."""
    keep_versions: int = 2
    """Weight versions kept on disk under ``RUN/engine/weights`` (older ones are deleted once
    the server holds a newer one)."""
    cpu_kv_cache_gb: int = 1
    """``VLLM_CPU_KVCACHE_SPACE`` of a started server (GiB of KV cache on vLLM's CPU build;
    ignored on a GPU), unless the environment sets it."""
    extra_args: str = ""
    """More command-line flags for a started server, split on spaces (on a GPU, e.g.
    ``--gpu-memory-utilization 0.5`` to leave the trainer room)."""

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"vllm.url: must start with http:// or https://, got {self.url!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"vllm.port: must be in [0, 65535] (0: a free port), got {self.port}")
        if not self.served_model:
            raise ValueError("vllm.served_model: must be a non-empty name")
        for name in ("start_seconds", "request_seconds", "probe_tolerance"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"vllm.{name}: must be > 0, got {value}")
        for name in ("probe_tokens", "keep_versions", "cpu_kv_cache_gb"):
            if getattr(self, name) < 1:
                raise ValueError(f"vllm.{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"vllm.max_model_len: must be >= 2 or null, got {self.max_model_len}")

    @property
    def base_url(self) -> str | None:
        """``url`` without a trailing ``/v1`` or slash (the server's root), or None."""
        if self.url is None:
            return None
        root = self.url.rstrip("/")
        return root[:-3] if root.endswith("/v1") else root
