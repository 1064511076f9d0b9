"""Gathering concurrent attempts' generation requests into one batched sampler call.

Each attempt awaits ``GenerationBatcher.generate`` for its next action. The batcher waits until
every attempt that could ask has asked (attempts busy in the environment cannot, so they are
not waited for), or ``wait_seconds`` passed, and then runs ONE ``policy.generate`` over the
gathered prompts in a worker thread, so the event loop keeps driving environment steps while
the model runs. Requests may ask for different generation caps (their budgets differ); the
batch runs to the largest and each completion is cut to its own cap, which gives exactly the
tokens a call with that cap would have sampled: sampling is step by step and each row has its
own seeded generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

from tracerl.rollout.decoding.constraints import TokenConstraint
from tracerl.rollout.policies.sampling import Completion, SamplingParams


class SamplingPolicy(Protocol):
    """What the batcher needs of a policy (``HFPolicy`` is one)."""

    policy_version: int

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 **kwargs: Any) -> list[Completion]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass
class _Request:
    prompt: list[int]
    max_new_tokens: int
    seed: int
    future: asyncio.Future[Completion]
    constraint: TokenConstraint | None = None


@dataclass
class BatcherStats:
    """What the batcher did; read by the progress bar and the collector's result."""

    calls: int = 0
    """``policy.generate`` calls."""
    rows: int = 0
    """Prompts sampled, over all calls."""
    tokens: int = 0
    """Tokens kept (after each completion was cut to its own cap)."""
    seconds: float = 0.0
    """Wall time inside ``policy.generate``."""


class GenerationBatcher:
    """One batched ``generate`` at a time over whatever the live attempts have asked for."""

    def __init__(self, policy: SamplingPolicy, params: SamplingParams, executor: Executor, *,
                 max_batch_size: int, wait_seconds: float) -> None:
        self.policy = policy
        self.params = params
        self.max_batch_size = max_batch_size
        self.wait_seconds = wait_seconds
        self.stats = BatcherStats()
        self._executor = executor
        self._pending: list[_Request] = []
        self._event = asyncio.Event()
        self._live = 0
        self._busy = 0
        self._dispatched = 0
        self._closed = False
        accepted = inspect.signature(policy.generate).parameters
        self._row_seeds = "row_seeds" in accepted
        self.constraints = "constraints" in accepted
        """Whether the policy applies per-row decoding rules (``HFPolicy`` does)."""

    # -- attempt state: how many attempts could still ask before a batch is complete -------

    def attempt_started(self) -> None:
        self._live += 1
        self._event.set()

    def attempt_finished(self) -> None:
        self._live -= 1
        self._event.set()

    @contextlib.asynccontextmanager
    async def busy(self) -> AsyncIterator[None]:
        """Mark the attempt as working elsewhere (environment, verifier): not waited for."""
        self._busy += 1
        self._event.set()
        try:
            yield
        finally:
            self._busy -= 1
            self._event.set()

    def close(self) -> None:
        self._closed = True
        self._event.set()

    # -- requests ------------------------------------------------------------------------

    async def generate(self, prompt: list[int], max_new_tokens: int, seed: int,
                       constraint: TokenConstraint | None = None) -> Completion:
        """Sample one completion of ``prompt`` with at most ``max_new_tokens`` tokens, under
        ``constraint`` when given (refused by a policy that takes no rules)."""
        if constraint is not None and not self.constraints:
            raise ValueError(f"constraint: {type(self.policy).__name__} applies no decoding rules")
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(prompt, max_new_tokens, seed, future, constraint))
        self._event.set()
        try:
            return await future
        finally:
            if future.done() and not future.cancelled():
                self._dispatched -= 1
                self._event.set()

    def _ready(self) -> bool:
        could_ask = self._live - self._busy - self._dispatched
        return len(self._pending) >= min(self.max_batch_size, max(could_ask, 1))

    async def run(self) -> None:
        """The batching loop; runs until ``close`` and no request is left."""
        loop = asyncio.get_running_loop()
        while True:
            self._pending = [r for r in self._pending if not r.future.done()]
            if not self._pending:
                if self._closed:
                    return
                self._event.clear()
                await self._event.wait()
                continue
            deadline = loop.time() + self.wait_seconds
            while not self._ready() and not self._closed:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._event.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._event.wait(), remaining)
            batch = [r for r in self._pending[: self.max_batch_size] if not r.future.done()]
            del self._pending[: self.max_batch_size]
            if batch:
                await self._run_batch(loop, batch)

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_Request]) -> None:
        cap = max(r.max_new_tokens for r in batch)
        params = dataclasses.replace(self.params, max_new_tokens=cap)
        prompts = [r.prompt for r in batch]
        seeds = [r.seed for r in batch]
        rules = [r.constraint for r in batch]
        self._dispatched += len(batch)
        started = time.perf_counter()
        try:
            completions = await loop.run_in_executor(
                self._executor, self._call, prompts, params, seeds, rules
            )
        except Exception as error:
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(error)
                else:
                    self._dispatched -= 1
            return
        finally:
            self.stats.seconds += time.perf_counter() - started
        self.stats.calls += 1
        self.stats.rows += len(batch)
        for request, completion in zip(batch, completions, strict=True):
            kept = self._cut(completion, request.max_new_tokens)
            if request.future.done():  # the attempt stopped waiting (cancelled, timed out)
                self._dispatched -= 1
                continue
            self.stats.tokens += len(kept.token_ids)
            request.future.set_result(kept)

    def _call(self, prompts: list[list[int]], params: SamplingParams,
              seeds: list[int], rules: list[TokenConstraint | None]) -> list[Completion]:
        extra: dict[str, Any] = {}
        if any(rule is not None for rule in rules):
            extra["constraints"] = rules
        if self._row_seeds:
            return self.policy.generate(prompts, params, row_seeds=seeds, **extra)
        # A policy without per-row generators gets one seed per call: reproducible only when
        # batches are.
        return self.policy.generate(prompts, dataclasses.replace(params, seed=seeds[0]), **extra)

    def _cut(self, completion: Completion, cap: int) -> Completion:
        if len(completion.token_ids) <= cap:
            return completion
        ids = completion.token_ids[:cap]
        return dataclasses.replace(
            completion, token_ids=ids, logprobs=completion.logprobs[:cap],
            finish_reason="length", stop_reason=None, text=self.policy.decode(ids),
        )
