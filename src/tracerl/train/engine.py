"""The trainer's side of ``rollout.engine``: which policy samples a step's attempts.

``local`` (the default): the trainer's own ``HFPolicy``, on the weights it trains. ``vllm``:
a vLLM server (:mod:`tracerl.rollout.vllm`) started at the first collection on the run's
weights (or reached at ``vllm.url``); before every collection the trainer's weights are synced
into it and verified with the probe, so every action token is stamped with a version the
server was verified to serve. After a collection, a server that died under it stops the run
with what happened: the attempts it left end ``tool_error`` (an infrastructure failure,
excluded from training and never scored as the policy's), each recorded once.

Held-out evaluations sample locally with either engine (the same weights, so before/after
numbers do not depend on the engine).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tracerl.rollout.vllm import EngineUnavailable, VllmEngine
from tracerl.trace import Attempt

if TYPE_CHECKING:
    from tracerl.train.trainer import Trainer


class RolloutEngine:
    """The sampler of a trainer's training attempts (see the module docstring)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.kind = trainer.config.rollout.engine
        self.vllm: VllmEngine | None = None
        self.last_sync: dict[str, float] = {}
        """The latest sync's seconds and probe agreement (the step's ``engine`` metrics)."""

    def policy(self, model: Any = None, version: int | None = None) -> Any:
        """The policy to sample the next collection with: the local one, or the server synced
        to ``model`` at ``version`` (default: the trainer's current weights) and verified
        (SyncMismatch otherwise)."""
        trainer = self.trainer
        if self.kind == "local":
            return trainer.policy
        version = trainer.state.policy_version if version is None else version
        model = trainer.actor.policy if model is None else model
        if self.vllm is None:
            engine = VllmEngine(trainer.config.vllm, trainer.run_dir, trainer.tokenizer,
                                seed=trainer.config.seed)
            self.vllm = engine  # set first: close() stops a server whose start failed half-way
            self.last_sync = engine.start(model, version)
            trainer.log(f"vLLM engine at {engine.base_url} serves policy version {version} "
                        f"(verified; log: {engine.log_path})")
        elif self.vllm.verified_version != version:
            self.last_sync = self.vllm.sync(model, version)
        else:
            # Nothing to load, but the probe runs anyway: a sync that was skipped or lost
            # (the server restarted on older weights) shows here, before any sampling.
            started = time.perf_counter()
            result = self.vllm.verify(model, version)
            self.last_sync = {"verify_seconds": time.perf_counter() - started,
                              "probe_max_abs_diff": result.max_abs_diff}
        assert self.vllm.policy is not None
        return self.vllm.policy

    def check(self, attempts: Sequence[Attempt], step: int) -> None:
        """After a collection: EngineUnavailable saying what happened when the server failed
        under it (its exit status and log, the attempts it cut short)."""
        if self.vllm is None:
            return
        failure = self.vllm.failure()
        if failure is None:
            return
        endings = Counter(a.end_reason.value for a in attempts)
        raise EngineUnavailable(
            f"step {step}: {failure}\nThe collection recorded {len(attempts)} attempts once each "
            f"(endings {dict(endings)}); those the server left unfinished ended tool_error, an "
            "infrastructure failure excluded from training. The run stops here; run it again "
            "to resume from the last checkpoint (the step's groups are collected anew).")

    def metrics(self) -> dict[str, float]:
        """The ``engine`` section of a step's metrics (empty for the local engine)."""
        if self.vllm is None:
            return {}
        return {"verified_version": float(self.vllm.verified_version or 0),
                "syncs": float(self.vllm.syncs), **self.last_sync}

    def close(self) -> None:
        """Stop a server the run started."""
        if self.vllm is not None:
            self.vllm.close()
