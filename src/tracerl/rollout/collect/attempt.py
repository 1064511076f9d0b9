"""One attempt's loop for the collector: sample, step the environment, compact, end once.

Token bookkeeping: ``context`` holds the current fragment's tokens as fed to the policy and
``pending`` the context tokens that arrived since the last action (first prompt, closing and
observation, or the summary after a compaction, or the task statement after ``restart``).
A turn is recorded as ``(pending, action)``, so concatenating a fragment's segments up to any
action gives exactly the prompt that action was sampled from.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from tracerl.rollout.collect.batching import GenerationBatcher
from tracerl.rollout.collect.chat_tokens import ChatTokens
from tracerl.rollout.collect.compaction import History, HistoryTurn
from tracerl.rollout.collect.progress import CollectorProgress
from tracerl.rollout.policies.openai_api import EndpointError
from tracerl.trace.schema import (
    Attempt,
    AuditRecord,
    Costs,
    EndReason,
    Fragment,
    Role,
    SamplingParams,
    Segment,
    Timings,
    Turn,
    VerifierResult,
    logprob_array,
    token_array,
)

if TYPE_CHECKING:
    from tracerl.rollout.collect.collector import Collector

T = TypeVar("T")


class PromptTooLongError(ValueError):
    """An attempt's first prompt does not fit the context: the task cannot be attempted."""


@dataclass(frozen=True)
class AttemptSpec:
    """Which attempt to run."""

    attempt_id: str
    """Id of the attempt record."""
    task_id: str
    """The task."""
    group_id: str
    """The group it is compared within."""
    sample_index: int
    """Index within the group."""
    seed: int
    """Seed of the environment reset and of the attempt's sampling."""
    max_new_tokens: int | None
    """Generation budget of the whole attempt (None: none)."""


@dataclass
class _Ending:
    reason: EndReason
    continuation: list[int] = field(default_factory=list)
    reward: float | None = None
    verify: Any = None
    audit: Any = None
    score: bool = False  # ask env.verify() for the reward
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class _State:
    fragments: list[Fragment] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    pending_role: Role = Role.PROMPT
    history: list[HistoryTurn] = field(default_factory=list)
    instruction: str = ""
    generated: int = 0
    actions: int = 0
    tool_calls: int = 0
    tool_seconds: float = 0.0
    generation_seconds: float = 0.0
    verification_seconds: float = 0.0
    faults: list[str] = field(default_factory=list)  # faults the environment injected
    in_flight: concurrent.futures.Future[Any] | None = None


def _turn_seed(seed: int, turn: int) -> int:
    return (seed * 1_000_003 + turn * 7919 + 1) & 0x7FFFFFFF


class AttemptRunner:
    """Runs attempts for one ``Collector.collect`` call."""

    def __init__(self, collector: Collector, batcher: GenerationBatcher,
                 pool: concurrent.futures.ThreadPoolExecutor, chat: ChatTokens,
                 progress: CollectorProgress) -> None:
        self.collector = collector
        self.config = collector.config
        self.batcher = batcher
        self.pool = pool
        self.chat = chat
        self.progress = progress
        self.limit = collector.context_limit

    async def _in_pool(self, state: _State, fn: Callable[..., T], *args: Any,
                       timeout: float | None = None, **kwargs: Any) -> T:
        """Run ``fn`` in the environment pool; the attempt is not waited for meanwhile."""
        async with self.batcher.busy():
            future = self.pool.submit(fn, *args, **kwargs)
            state.in_flight = future
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    async def run(self, spec: AttemptSpec) -> Attempt:
        """Run one attempt to its ending and return its record (never raises but for bad input)."""
        state = _State()
        started_wall, started = time.time(), time.monotonic()
        deadline = None if self.config.max_seconds is None else started + self.config.max_seconds
        env: Any = None
        self.batcher.attempt_started()
        try:
            try:
                env = await self._in_pool(state, self.collector.make_env)
                ending = await self._loop(spec, state, env, deadline)
                if ending.score:
                    ending = await self._score(state, env, ending)
            except asyncio.CancelledError:
                # Python >= 3.11: the cancel request is handled here, so clear it.
                uncancel = getattr(asyncio.current_task(), "uncancel", None)
                if uncancel is not None:
                    uncancel()
                ending = _Ending(EndReason.CANCELLED, list(state.pending))
        finally:
            self.batcher.attempt_finished()
            self._close(env, state)
        return self._record(spec, state, ending, started_wall)

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else deadline - time.monotonic()

    async def _loop(self, spec: AttemptSpec, state: _State, env: Any,
                    deadline: float | None) -> _Ending:
        try:
            observation, _ = await self._in_pool(
                state, env.reset, seed=spec.seed, options={"task_id": spec.task_id},
                timeout=self._remaining(deadline))
        except ValueError:
            raise  # unknown task, bad options: the caller's input, not infrastructure
        except TimeoutError:
            return _Ending(EndReason.TIMEOUT)
        except Exception as error:
            return _Ending(EndReason.TOOL_ERROR, metadata={"error": _describe(error)})
        state.instruction = str(observation)
        state.pending = self.chat.first_prompt(state.instruction)
        if self.limit is not None and len(state.pending) >= self.limit:
            raise PromptTooLongError(
                f"task {spec.task_id!r}: the first prompt has {len(state.pending)} tokens and the "
                f"context holds {self.limit}; nothing is left to generate (shorten the task or "
                "the tools, or raise max_context_tokens)"
            )
        sampling = self.config.sampling
        while True:
            if state.actions >= self.config.max_turns:
                return _Ending(EndReason.TRUNCATED_TURNS, list(state.pending), score=True)
            remaining = self._remaining(deadline)
            if remaining is not None and remaining <= 0:
                return _Ending(EndReason.TIMEOUT, list(state.pending), score=True)
            prompt = state.context + state.pending
            caps = [sampling.max_new_tokens]
            if spec.max_new_tokens is not None:
                caps.append(spec.max_new_tokens - state.generated)
            if self.limit is not None:
                caps.append(self.limit - len(prompt))
            cap = min(caps)
            if cap <= 0:
                return _Ending(EndReason.TRUNCATED_TOKENS, list(state.pending), score=True)
            t0 = time.perf_counter()
            rule = self.collector.decoding_rule(env)
            try:
                completion = await asyncio.wait_for(
                    self.batcher.generate(prompt, cap, _turn_seed(spec.seed, state.actions),
                                          rule),
                    remaining)
            except EndpointError as error:
                # The sampling server failed (unreachable, died, timed out, answered nonsense):
                # infrastructure, never the policy's failure; checked before TimeoutError
                # because a server's timeout is one too.
                return _Ending(EndReason.TOOL_ERROR, list(state.pending), metadata={
                    "error": _describe(error), "failed": "sampler"})
            except TimeoutError:
                return _Ending(EndReason.TIMEOUT, list(state.pending), score=True)
            state.generation_seconds += time.perf_counter() - t0
            self.progress.refresh()
            action = list(completion.token_ids)
            state.turns.append(Turn((
                Segment(state.pending_role, token_array(state.pending)),
                Segment(Role.ACTION, token_array(action),
                        logprobs=logprob_array(completion.logprobs),
                        sampling=SamplingParams(
                            temperature=sampling.temperature, top_p=sampling.top_p,
                            top_k=sampling.top_k or None, max_new_tokens=cap,
                            seed=_turn_seed(spec.seed, state.actions),
                            constraint=None if rule is None else rule.name),
                        policy_version=completion.policy_version,
                        engine=self.collector.engine),
            )))
            state.context = prompt + action
            state.pending, state.pending_role = [], Role.OBSERVATION
            state.generated += len(action)
            state.actions += 1
            closing = self.chat.after_action(action)
            if completion.finish_reason == "length" and cap < sampling.max_new_tokens:
                # Cut by the attempt's token budget or the context, not by the turn cap: the
                # action is incomplete, so it is not sent to the environment.
                return _Ending(EndReason.TRUNCATED_TOKENS, closing, score=True)
            ending = await self._step(spec, state, env, completion.text, closing, deadline)
            if ending is not None:
                return ending

    async def _step(self, spec: AttemptSpec, state: _State, env: Any, text: str,
                    closing: list[int], deadline: float | None) -> _Ending | None:
        t0 = time.perf_counter()
        try:
            result = await self._in_pool(state, env.step, text, timeout=self._remaining(deadline))
        except TimeoutError:
            return _Ending(EndReason.TIMEOUT, closing)
        except Exception as error:  # the environment itself crashed: infrastructure
            state.tool_seconds += time.perf_counter() - t0
            return _Ending(EndReason.TOOL_ERROR, metadata={"error": _describe(error)})
        observation, reward, terminated, truncated, info = result
        info = dict(info or {})
        state.tool_seconds += float(info.get("tool_seconds", time.perf_counter() - t0))
        state.tool_calls += 1 if info.get("tool") else 0
        observation = str(observation)
        state.history.append(HistoryTurn(text, observation, info.get("tool")))
        if info.get("fault"):
            state.faults.append(str(info["fault"]))
        if info.get("tool_error"):
            meta = {"error": observation, "fault": info.get("fault")}
            if info.get("verify_error"):
                meta["verify_error"] = info["verify_error"]
            return _Ending(EndReason.TOOL_ERROR, metadata=meta)
        delta = closing + self.chat.observation(observation)
        if terminated:
            return _Ending(EndReason.TERMINATED, reward=float(reward),
                           verify=info.get("verify"), audit=info.get("audit"))
        if truncated:
            reason = (EndReason.TIMEOUT if info.get("truncated_reason") == "max_seconds"
                      else EndReason.TRUNCATED_TURNS)
            return _Ending(reason, delta, score=True)
        budget_left = None if spec.max_new_tokens is None else spec.max_new_tokens - state.generated
        if state.actions >= self.config.max_turns:
            return _Ending(EndReason.TRUNCATED_TURNS, delta, score=True)
        if budget_left is not None and budget_left <= 0:
            return _Ending(EndReason.TRUNCATED_TOKENS, delta, score=True)
        if info.get("fresh_context"):
            # The environment started the task over (``restart``): the attempt goes on in a
            # new context whose first message is what it answered, so the next try is not
            # conditioned on the one given up. Not an ending: the fragment is ``continued``.
            self._new_fragment(state, observation)
            return None
        compaction = self.config.compaction
        if compaction is not None and len(state.context) + len(delta) > compaction.threshold_tokens:
            if len(state.fragments) + 2 > compaction.max_fragments:
                return _Ending(EndReason.TRUNCATED_TOKENS, delta, score=True,
                               metadata={"compaction": "max_fragments reached"})
            await self._compact(spec, state)
            return None
        state.pending = delta
        return None

    async def _compact(self, spec: AttemptSpec, state: _State) -> None:
        """Close the fragment as ``continued``; the next one starts from the summary prompt."""
        assert self.config.compaction is not None
        compaction = self.config.compaction
        history = History(state.instruction, tuple(state.history), len(state.fragments))

        async def generate_text(message: str) -> str:
            prompt = self.chat._renderer.chat_prompt([{"role": "user", "content": message}])
            cap = compaction.summary_max_new_tokens
            if self.limit is not None:
                cap = min(cap, self.limit - len(prompt))
            if cap <= 0:
                return ""
            seed = _turn_seed(spec.seed ^ 0x5EED, len(state.fragments))
            completion = await self.batcher.generate(list(prompt), cap, seed)
            return completion.text

        summary = await compaction.summarizer.summarize(history, generate_text)
        self._new_fragment(state, summary)

    def _new_fragment(self, state: _State, text: str) -> None:
        """Close the fragment as ``continued``; the next one starts from ``text`` as its first
        user message (a compaction's summary, or the statement after ``restart``)."""
        state.fragments.append(Fragment(len(state.fragments), tuple(state.turns),
                                        EndReason.CONTINUED))
        state.turns, state.context = [], []
        state.pending, state.pending_role = self.chat.first_prompt(text), Role.SUMMARY

    async def _score(self, state: _State, env: Any, ending: _Ending) -> _Ending:
        """Ask the environment's verifier about the files a truncated attempt left."""
        verify = getattr(env, "verify", None)
        busy = state.in_flight is not None and not state.in_flight.done()
        if not self.config.verify_truncated or verify is None or busy:
            return ending
        t0 = time.perf_counter()
        try:
            ending.verify = await self._in_pool(state, verify)
            audit = getattr(env, "audit", None)
            ending.audit = await self._in_pool(state, audit) if audit is not None else None
        except Exception as error:
            # The verifier could not run: no reward can be trusted, so it is the
            # infrastructure's failure; the budget ending is kept in the metadata.
            return _Ending(EndReason.TOOL_ERROR, metadata={
                "verify_error": _describe(error), "ending_before_verify": ending.reason.value})
        finally:
            state.verification_seconds += time.perf_counter() - t0
        ending.reward = float(getattr(ending.verify, "reward", 0.0))
        return ending

    def _close(self, env: Any, state: _State) -> None:
        close = getattr(env, "close", None)
        if not callable(close):
            return
        if state.in_flight is not None and not state.in_flight.done():
            # A step still runs in its thread (timeout, cancel): close the env after it.
            state.in_flight.add_done_callback(lambda _: close())
        else:
            close()

    def _record(self, spec: AttemptSpec, state: _State, ending: _Ending,
                started_wall: float) -> Attempt:
        fragments = list(state.fragments)
        turns = list(state.turns)
        continuation = ending.continuation
        if not turns and fragments and ending.reason is not EndReason.CONTINUED:
            # Ended right after a compaction, before any action of the new fragment: the
            # closed fragment takes the ending, and the summary prompt is its continuation.
            last = fragments.pop()
            turns = list(last.turns)
        elif not turns and state.pending and ending.reason is EndReason.CANCELLED:
            turns = [Turn((Segment(state.pending_role, token_array(state.pending)),))]
            continuation = []
        if ending.reason is EndReason.TERMINATED:
            continuation = []
        fragments.append(Fragment(len(fragments), tuple(turns), ending.reason,
                                  continuation_ids=token_array(continuation)))
        reward, audit_record, verifier, metadata = self._outcome(ending)
        metadata.update(sample_index=spec.sample_index, seed=spec.seed,
                        engine=self.collector.engine)
        if state.faults:
            metadata["injected_faults"] = list(state.faults)
        versions = {s.policy_version for f in fragments for t in f.turns for s in t.segments
                    if s.role is Role.ACTION}
        if len(versions) > 1:  # the weights changed between its turns (a partial rollout)
            metadata["policy_versions"] = sorted(v for v in versions if v is not None)
        return Attempt(
            attempt_id=spec.attempt_id, task_id=spec.task_id, group_id=spec.group_id,
            fragments=tuple(fragments), reward=reward,
            rewards={} if reward is None else {"verifier": reward},
            verifier=verifier, audit=audit_record,
            timings=Timings(started_at=started_wall, finished_at=time.time(),
                            generation_seconds=state.generation_seconds,
                            verification_seconds=state.verification_seconds),
            costs=Costs(generated_tokens=state.generated, tool_seconds=state.tool_seconds,
                        tool_calls=state.tool_calls, turns=state.actions),
            metadata=metadata,
        )

    @staticmethod
    def _outcome(ending: _Ending) -> tuple[float | None, AuditRecord | None,
                                           VerifierResult | None, dict[str, Any]]:
        metadata = {k: v for k, v in ending.metadata.items() if v is not None}
        if ending.reason in (EndReason.TOOL_ERROR, EndReason.CANCELLED):
            return None, None, None, metadata
        verifier = None
        if ending.verify is not None:
            v = ending.verify
            verifier = VerifierResult(
                passed=bool(getattr(v, "hidden_passed", getattr(v, "reward", 0.0) >= 1.0)),
                score=float(getattr(v, "reward", 0.0)),
                details={"hidden_pass": float(bool(getattr(v, "hidden_passed", False))),
                         "visible_pass": float(bool(getattr(v, "visible_passed", False)))},
                log=str(getattr(v, "output", "")))
        reward = ending.reward
        audit_record = None
        if ending.audit is not None:
            a = ending.audit
            flagged = bool(getattr(a, "flagged", False))
            audit_record = AuditRecord(
                protected_modified=tuple(getattr(a, "protected_modified", ())),
                protected_reverted=bool(getattr(a, "reverted", False)),
                hidden_access_attempts=len(tuple(getattr(a, "hidden_access_attempts", ()))),
                flagged=flagged,
                reward_if_unaudited=reward if flagged else None)
            if flagged and reward is not None:
                reward = 0.0  # a flagged attempt never counts as solving
            findings = getattr(a, "findings", None)
            if callable(findings) and findings():
                metadata["audit"] = findings()  # what the trace's record has no field for
        return reward, audit_record, verifier, metadata


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
