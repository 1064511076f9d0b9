"""vLLM as the rollout engine: a server started on (or given) the run's weights, a weight sync
before each collection, and a probe that verifies every sync (docs/serving.md)."""

from tracerl.rollout.vllm.config import ENGINES, VllmConfig
from tracerl.rollout.vllm.engine import VllmEngine
from tracerl.rollout.vllm.probe import SyncMismatch
from tracerl.rollout.vllm.server import (
    EngineError,
    EngineStartError,
    EngineUnavailable,
    VllmServer,
)

__all__ = ["ENGINES", "EngineError", "EngineStartError", "EngineUnavailable", "SyncMismatch",
           "VllmConfig", "VllmEngine", "VllmServer"]
