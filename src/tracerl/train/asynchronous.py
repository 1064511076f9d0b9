"""Asynchronous training (``asynchronous.max_staleness`` k >= 1): a rollout worker thread
collects the next steps' attempts while the learner updates on the current one.

The learner (the trainer's main thread) takes step ``s``'s collection, trains on it exactly
as the synchronous loop does (:meth:`Trainer.train_step`), and publishes its new weights with
their version. The worker collects step ``s`` once the learner has finished step ``s - k``,
so at most k updates separate an attempt's sampling from its update; it never runs further
ahead. It samples from weights of its own:

- ``rollout.engine: local``: a copy of the policy (an ``HFPolicy`` on it), into which the
  worker loads the newest published weights at a safe point;
- ``rollout.engine: vllm``: the server, into which the worker syncs the newest published
  weights (through its copy) and verifies them with the probe before sampling from them.

The safe point is ``asynchronous.weight_sync``: ``between_attempts``, before a step's
collection starts (no attempt in flight); ``mid_attempt``, also before every sampler call,
between the turns of the attempts in flight (a partial rollout). Either way each action
segment is stamped with the version that sampled it (the sampler's, read at that call), and
an attempt whose turns came from several versions lists them in ``metadata.policy_versions``.

At each update the learner measures every attempt's staleness, the weights the update starts
from minus the oldest version among its action tokens, and a group holding an attempt older
than k is dropped whole (``asynchronous.stale: drop``) or kept and counted (``capped``): a
GRPO baseline is never computed from part of a group. The objective is decoupled PPO (see
docs/training.md): the clipped ratio current/proximal, where the proximal logprobs are frozen
once from the weights the update starts from, times the importance weight proximal/behavior
truncated or masked at ``update.tis_cap``.

The metrics of each step gain an ``async`` section: staleness in versions (a histogram) and in
seconds, dropped and kept-stale attempts, attempts whose versions changed mid-attempt, and the
overlap achieved (seconds of the step's collection hidden behind the learner's work).
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tracerl.rollout import HFPolicy
from tracerl.rollout.collect.collector import Collector
from tracerl.trace import Attempt, Role
from tracerl.train import groups

if TYPE_CHECKING:
    from tracerl.train.engine import RolloutEngine
    from tracerl.train.metrics import StepProgress
    from tracerl.train.trainer import Trainer

SECONDS_BUCKETS = (1.0, 10.0, 60.0, 300.0)
"""Upper edges of the staleness-in-seconds histogram (the last bucket is open)."""


def action_versions(attempt: Attempt) -> list[int]:
    """The policy version of each action segment of ``attempt``, in order."""
    return [seg.policy_version for fragment in attempt.fragments for turn in fragment.turns
            for seg in turn.segments
            if seg.role is Role.ACTION and seg.policy_version is not None]


def staleness(attempt: Attempt, learner_version: int) -> int | None:
    """``learner_version`` minus the oldest version among the attempt's action tokens; None
    for an attempt without action tokens (nothing of it is trained)."""
    versions = action_versions(attempt)
    return learner_version - min(versions) if versions else None


def stale_groups(attempts: Sequence[Attempt], learner_version: int, max_staleness: int
                 ) -> tuple[list[Attempt], list[Attempt]]:
    """``(fresh, stale)``: the attempts of groups whose every member is at most
    ``max_staleness`` versions older than ``learner_version``, and the attempts of the other
    groups, whole (a group is never split: its baseline needs every member)."""
    fresh: list[Attempt] = []
    stale: list[Attempt] = []
    for members in groups.by_group(attempts).values():
        ages = [staleness(a, learner_version) for a in members]
        old = any(age is not None and age > max_staleness for age in ages)
        (stale if old else fresh).extend(members)
    return fresh, stale


@dataclass(frozen=True)
class Collection:
    """What the worker collected for one step (``Trainer.collect``'s results and when)."""

    step: int
    attempts: list[Attempt]
    collected: list[Attempt]
    metrics: dict[str, Any]
    started: float
    """``time.perf_counter()`` when the collection started."""
    finished: float


class WorkerWeights:
    """The worker's copy of the policy, the weights the learner published for it, and what
    samples from the copy (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, version: int, *,
                 max_batch_size: int, engine: RolloutEngine | None = None) -> None:
        """A copy of ``model`` at ``version``; ``engine``: the vLLM engine to sync the copy
        into (None: sample from the copy here, with an ``HFPolicy``)."""
        self.model: Any = copy.deepcopy(model)
        self.model.requires_grad_(False)
        self.version = version
        self.engine = engine
        self.local = engine is None
        self.policy: Any = None
        if self.local:
            self.policy = HFPolicy(self.model, tokenizer, policy_version=version,
                                   max_batch_size=max_batch_size)
        self._lock = threading.Lock()
        self._published: tuple[int, dict[str, torch.Tensor]] | None = None

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """The learner's side: ``model``'s weights (copied now) become the newest, ``version``."""
        snapshot = {name: value.detach().clone() for name, value in model.state_dict().items()}
        with self._lock:
            self._published = (version, snapshot)

    def take(self) -> bool:
        """The worker's side: load the newest published weights into the copy, if any came
        since the last call (vLLM: and sync them into the server); whether it did."""
        with self._lock:
            published, self._published = self._published, None
        if published is None:
            return False
        self.version, state = published
        self.model.load_state_dict(state)
        if self.local:
            self.policy.policy_version = self.version
        else:
            assert self.engine is not None
            self.policy = self.engine.policy(self.model, self.version)
        return True

    def at_step_start(self) -> Any:
        """The sampler for a step's collection: the newest weights loaded; the vLLM server
        synced (or, when nothing changed, its weights verified again with the probe)."""
        if not self.take() and self.engine is not None:
            self.policy = self.engine.policy(self.model, self.version)
        return self.policy


class StampedSampler:
    """What the worker's collector samples with: the current sampler of :class:`WorkerWeights`,
    taking newer weights before each call when they may change mid-attempt. Calls come one at
    a time (the collector's batcher), so no request is in flight while weights change."""

    def __init__(self, weights: WorkerWeights, mid_attempt: bool) -> None:
        self.weights = weights
        self.mid_attempt = mid_attempt

    @property
    def policy_version(self) -> int:
        """The version stamped on what the next call samples (until weights change)."""
        return int(self.weights.policy.policy_version)

    def generate(self, prompts: Sequence[Sequence[int]], params: Any, *,
                 row_seeds: Sequence[int] | None = None,
                 constraints: Sequence[Any] | None = None) -> list[Any]:
        """The inner sampler's ``generate``, after taking newer weights (``mid_attempt``)."""
        if self.mid_attempt:
            self.weights.take()
        extra: dict[str, Any] = {}
        if row_seeds is not None:
            extra["row_seeds"] = row_seeds
        if constraints is not None:  # only an HFPolicy takes them (validate refuses others)
            extra["constraints"] = constraints
        completions: list[Any] = self.weights.policy.generate(prompts, params, **extra)
        return completions

    def __getattr__(self, name: str) -> Any:  # decode, chat_prompt, tokenizer, engine, ...
        return getattr(self.weights.policy, name)


class AsyncLoop:
    """The learner's loop and the rollout worker of one asynchronous run."""

    def __init__(self, trainer: Trainer) -> None:
        section = trainer.config.asynchronous
        self.trainer = trainer
        self.k = section.max_staleness
        self.stale = section.stale
        local = trainer.config.rollout.engine == "local"
        self.weights = WorkerWeights(trainer.actor.policy, trainer.tokenizer,
                                     trainer.state.policy_version,
                                     max_batch_size=trainer.config.rollout.concurrency,
                                     engine=None if local else trainer.engine)
        self.sampler = StampedSampler(self.weights, section.weight_sync == "mid_attempt")
        self.changed = threading.Condition()
        self.finished = trainer.state.step
        """Steps the learner has finished (the worker's gate)."""
        self.ready: dict[int, Collection] = {}
        self.failure: BaseException | None = None
        self.stopping = False
        self.collecting = -1
        """The step whose collection the worker started last."""
        self.collector: Collector | None = None
        """The worker's latest collector (cancelled when the run stops)."""
        self.published = trainer.state.policy_version
        self.worker = threading.Thread(target=self.work, name="tracerl-rollout", daemon=True)

    # -- the learner ---------------------------------------------------------------------------

    def run(self, progress: StepProgress) -> None:
        """Train while the run has steps left (``Trainer.more_steps``), then stop the worker."""
        trainer = self.trainer
        trainer.async_loop = self  # type: ignore[attr-defined]  # for hooks and tests
        if not self.weights.local:
            self.weights.at_step_start()  # the server starts here, on the main thread
        trainer.collector = self._collector  # type: ignore[method-assign]
        self.worker.start()
        try:
            while trainer.more_steps():
                started = time.perf_counter()
                with trainer.phase("collect"):
                    got = self.take(trainer.state.step)
                attempts, section = self.account(got, started)
                trainer.train_step(attempts, got.collected, {**got.metrics, "async": section},
                                   started, progress)
                self.publish()
        finally:
            self.stop()
            del trainer.collector  # the method again

    def take(self, step: int) -> Collection:
        """Step ``step``'s collection, once the worker has it (its failure, if it failed)."""
        with self.changed:
            while step not in self.ready and self.failure is None:
                self.changed.wait(timeout=1.0)
            if self.failure is not None:
                raise self.failure
            return self.ready.pop(step)

    def publish(self) -> None:
        """The weights after the step the learner finished, for the worker; opens its gate."""
        trainer = self.trainer
        if trainer.state.policy_version != self.published:
            self.weights.publish(trainer.state.policy_version, trainer.actor.policy)
            self.published = trainer.state.policy_version
        with self.changed:
            self.finished = trainer.state.step
            self.changed.notify_all()

    def account(self, got: Collection, wait_started: float
                ) -> tuple[list[Attempt], dict[str, Any]]:
        """The attempts the update trains on (stale groups dropped, ``stale: drop``) and the
        step's ``async`` metrics."""
        version = self.trainer.state.policy_version  # the weights the update starts from
        fresh, stale = stale_groups(got.attempts, version, self.k)
        trained = fresh if self.stale == "drop" else [*fresh, *stale]
        ages = Counter(age for a in trained if (age := staleness(a, version)) is not None)
        now = time.time()
        seconds = [max(0.0, now - a.timings.started_at) for a in trained]
        labels = [f"<{edge:g}" for edge in SECONDS_BUCKETS] + [f">={SECONDS_BUCKETS[-1]:g}"]
        found = Counter(next((i for i, edge in enumerate(SECONDS_BUCKETS) if s < edge),
                             len(SECONDS_BUCKETS)) for s in seconds)
        buckets = {labels[i]: found[i] for i in sorted(found)}
        took = got.finished - got.started
        hidden = min(max(wait_started - got.started, 0.0), took)
        section: dict[str, Any] = {
            "max_staleness": self.k, "learner_version": version,
            "staleness_versions": {str(age): ages[age] for age in sorted(ages)},
            "staleness_seconds": {"mean": statistics.fmean(seconds) if seconds else 0.0,
                                  "max": max(seconds, default=0.0), **buckets},
            "dropped_attempts": len(stale) if self.stale == "drop" else 0,
            "dropped_groups": (len(groups.by_group(stale)) if self.stale == "drop" else 0),
            "kept_stale_attempts": len(stale) if self.stale == "capped" else 0,
            "versions_changed_attempts": sum(len(set(action_versions(a))) > 1
                                             for a in got.collected),
            "collect_seconds": took, "hidden_seconds": hidden,
            "overlap": hidden / took if took > 0 else 0.0}
        return trained, section

    def stop(self) -> None:
        """Stop the worker: its collection in flight, if any, is cancelled (its attempts end
        ``cancelled`` and are recorded); collections no step trained on are reported."""
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        while self.worker.is_alive():
            if self.collector is not None:
                self.collector.cancel()
            self.worker.join(timeout=0.5)
        left = sum(len(c.collected) for c in self.ready.values())
        if left:
            self.trainer.log(f"asynchronous: {left} attempts collected for steps "
                             f"{sorted(self.ready)} were not trained on (they stay in the "
                             "trace store; a resumed run reuses their complete groups)")

    # -- the worker ------------------------------------------------------------------------------

    def may_collect(self, step: int) -> bool:
        """Whether the worker may start ``step``'s collection: the learner finished step - k."""
        return self.finished >= step - self.k

    def work(self) -> None:
        """The worker thread: collect each step in turn, as far ahead as the gate allows."""
        trainer = self.trainer
        step = trainer.state.step
        try:
            while step < trainer.config.steps:
                with self.changed:
                    while not self.stopping and not self.may_collect(step):
                        self.changed.wait(timeout=1.0)
                    if self.stopping:
                        return
                self.weights.at_step_start()
                if self.stopping:  # while the weights loaded (a vLLM sync takes a while)
                    return
                self.collecting = step
                started = time.perf_counter()
                attempts, collected, metrics = trainer.collect(step, self.sampler)
                got = Collection(step, attempts, collected, metrics, started,
                                 time.perf_counter())
                with self.changed:
                    self.ready[step] = got
                    self.changed.notify_all()
                step += 1
        except BaseException as error:  # handed to the learner, which raises it
            with self.changed:
                self.failure = error
                self.changed.notify_all()

    def _collector(self, *args: Any, **kwargs: Any) -> Collector:
        """``Trainer.collector``, remembering the worker's collectors (to cancel them)."""
        built: Collector = type(self.trainer).collector(self.trainer, *args, **kwargs)
        if threading.current_thread() is self.worker:
            self.collector = built
        return built
