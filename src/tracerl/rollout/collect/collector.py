"""The multi-turn collector: many attempts at once, each recorded with its exact ending.

Every attempt is a loop of policy and environment. The context is grown by appending token ids
(see ``chat_tokens``), so the recorded segments are exactly what the policy was fed: the first
prompt (role ``prompt``), the sampled tokens with their behavior logprobs, sampling params,
policy version and engine (``action``), and what the template and the environment added after
them (``observation``; ``summary`` after a compaction). Attempts run as asyncio tasks; their
generation requests are batched into one sampler call (``batching``) and environment steps run
in a thread pool, so sandboxed test runs overlap with generation.

How an attempt ends (one reason, see ``trace.EndReason``):

- ``terminated``: the environment said so (submit); the reward comes with it.
- ``truncated_turns`` / ``timeout``: the turn or wall-clock budget ran out, the collector's or
  the environment's. ``truncated_tokens``: the attempt's generation budget, or the context,
  ran out. These are scored by ``env.verify()`` on the files left (``verify_truncated``); the
  trainer's treatment decides whether that score is used.
- ``tool_error``: a tool or the sandbox failed, the environment raised, or the verifier could
  not run. Never the agent's failure; no reward.
- ``cancelled``: ``cancel()``, SIGINT or SIGTERM stopped it; what it had done is recorded.

Finished attempts are appended to the store as they finish, so a crash or Ctrl-C loses none.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import signal
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tracerl.envs.tools import ARGUMENT_ALTERNATIVES, TOOL_SCHEMAS
from tracerl.rollout.collect.attempt import AttemptRunner, AttemptSpec
from tracerl.rollout.collect.batching import GenerationBatcher, SamplingPolicy
from tracerl.rollout.collect.chat_tokens import ChatTokens, ObservationRole
from tracerl.rollout.collect.compaction import CompactionConfig
from tracerl.rollout.collect.progress import CollectorProgress
from tracerl.rollout.decoding.constraints import EditConstraint, TokenConstraint, VocabularyTexts
from tracerl.rollout.decoding.grammar import AllRules, ToolCallGrammar, tool_specs
from tracerl.rollout.policies.sampling import SamplingParams
from tracerl.trace.schema import ATTEMPT_ENDINGS, Attempt, EndReason
from tracerl.trace.store import TraceStore


@dataclass(frozen=True)
class CollectorConfig:
    """Budgets, sampling and concurrency of a collection run. Validated on construction."""

    sampling: SamplingParams = field(
        default_factory=lambda: SamplingParams(temperature=1.0, max_new_tokens=128)
    )
    """How actions are sampled; ``max_new_tokens`` caps one turn. Its ``seed`` is ignored:
    each attempt gets its own seed from ``seed``, the task and the sample index."""
    max_turns: int = 8
    """Most actions per attempt (across fragments); then ``truncated_turns``. A cap: a task's
    own budget (``budget.max_turns``, enforced by the environment) may end it sooner."""
    max_attempt_tokens: int | None = 1024
    """Most tokens sampled per attempt, over all its turns (None: no limit); then
    ``truncated_tokens``. A task's own ``budget.max_new_tokens`` takes precedence. The limit
    per turn is ``sampling.max_new_tokens``."""
    max_context_tokens: int | None = None
    """Longest context (prompt plus action); None: the policy's ``context_length``. When the
    next turn would not fit, the attempt ends ``truncated_tokens``."""
    max_seconds: float | None = None
    """Wall-clock limit per attempt (None: none); then ``timeout``."""
    max_concurrent: int = 32
    """Attempts in flight at once."""
    max_batch_size: int = 32
    """Most prompts in one sampler call."""
    batch_wait_seconds: float = 0.05
    """Longest a request waits for others to join its batch."""
    env_workers: int = 4
    """Threads running environment steps (sandboxed tools) concurrently with generation."""
    seed: int = 0
    """Base seed; attempt (task, sample) gets a seed derived from it and from them."""
    system_prompt: str | None = None
    """Optional system message before the first observation."""
    observation_role: ObservationRole = "tool"
    """Chat role that carries observations after the first."""
    tools: tuple[Mapping[str, Any], ...] | None = None
    """Tool schemas given to the chat template; None: the environment's ``tool_schemas``
    attribute, else tracerl's coding tools."""
    verify_truncated: bool = True
    """Score truncated and timed-out attempts with ``env.verify()`` on their final files."""
    compaction: CompactionConfig | None = None
    """Replace long histories with a summary (None: never)."""
    constrain_edits: bool = False
    """Constrained decoding of ``replace``'s ``old`` (``rollout.decoding.constraints.EditConstraint``):
    inside that string the sampler may only write a piece of the line the call names (of the
    environment's open file), closed where it occurs once. Needs a policy that applies
    decoding rules (``HFPolicy``) and an environment with ``open_file_text()``."""
    constrain_calls: bool = False
    """Grammar-constrained tool calls (``rollout.decoding.grammar.ToolCallGrammar``): every action is
    one well-formed call of one of the environment's tools (its ``tool_schemas``, else
    tracerl's coding tools), then the end of the turn. Needs a policy that applies decoding
    rules (``HFPolicy``)."""
    progress: bool = False
    """Show a progress bar (attempts, tokens/s, endings) on the terminal."""
    handle_signals: bool = True
    """On SIGINT/SIGTERM (main thread only), cancel in-flight attempts and record them."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_concurrent", "max_batch_size", "env_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        for name in ("max_attempt_tokens", "max_context_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}: must be >= 1 or None, got {value!r}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds: must be > 0 or None, got {self.max_seconds!r}")
        if not self.batch_wait_seconds >= 0:
            raise ValueError(f"batch_wait_seconds: must be >= 0, got {self.batch_wait_seconds!r}")


@dataclass(frozen=True)
class CollectResult:
    """What one ``collect`` call produced."""

    attempts: tuple[Attempt, ...]
    """Every recorded attempt, ordered by task (as given) then sample index."""
    endings: Mapping[str, int]
    """Attempts per ending (every attempt ending listed, zeros included)."""
    generated_tokens: int
    """Action tokens recorded over all attempts."""
    tool_seconds: float
    """Seconds spent in environment steps, summed over attempts."""
    wall_seconds: float
    """Wall time of the whole call."""
    generation_seconds: float
    """Wall time inside the sampler."""
    sampler_calls: int
    """Batched sampler calls made."""
    not_started: int = 0
    """Attempts never started because the run was cancelled first (not recorded)."""

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0


def attempt_seed(base: int, task_id: str, sample_index: int) -> int:
    """A seed per (task, sample), stable across runs and machines (not Python's ``hash``)."""
    digest = hashlib.sha256(f"{base}:{task_id}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _task_id(task: Any) -> str:
    if isinstance(task, str):
        return task
    task_id = getattr(task, "id", None)
    if not isinstance(task_id, str) or not task_id:
        raise ValueError(f"tasks: each task must be a task id or have an 'id', got {task!r}")
    return task_id


class Collector:
    """Runs G attempts per task concurrently and records each (see the module docstring).

    ``make_env()`` returns a fresh environment with ``reset(seed=, options={'task_id': ...})``
    and ``step(text)`` (Gymnasium's five-tuple, ``info['tool_error']`` for infrastructure
    failures) and optionally ``verify()``/``audit()``/``close()``; one is made per attempt.
    """

    def __init__(self, policy: SamplingPolicy, make_env: Callable[[], Any],
                 store: TraceStore | None = None,
                 config: CollectorConfig | None = None) -> None:
        self.policy = policy
        self.make_env = make_env
        self.store = store
        self.config = config or CollectorConfig()
        self.engine: str = str(getattr(policy, "engine", type(policy).__name__))
        declared = getattr(policy, "context_length", None)
        limit = self.config.max_context_tokens
        if isinstance(declared, int):
            limit = declared if limit is None else min(limit, declared)
        self.context_limit: int | None = limit
        """Longest context an attempt may reach (config and policy combined)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[Attempt | None]] = []
        self._cancelled = threading.Event()
        self.duplicates = 0
        """Attempts the store already held (same id): not written again."""
        self._vocabulary: VocabularyTexts | None = None
        self._grammar: ToolCallGrammar | None = None
        for option in ("constrain_edits", "constrain_calls"):
            if getattr(self.config, option) and "constraints" not in inspect.signature(
                    policy.generate).parameters:
                raise ValueError(f"{option}: {type(policy).__name__} applies no decoding "
                                 "rules (an HFPolicy does; a served model's guided decoding "
                                 "is not wired in)")

    # -- public ---------------------------------------------------------------------------

    def decoding_rule(self, env: Any) -> TokenConstraint | None:
        """The decoding rules for ``env``'s next action (``constrain_calls`` and
        ``constrain_edits``, each where on), combined; None when neither applies."""
        rules: list[TokenConstraint] = []
        if self.config.constrain_calls:
            rules.append(self.call_grammar(env).rule())
        edit = self.edit_constraint(env)
        if edit is not None:
            rules.append(edit)
        if not rules:
            return None
        return rules[0] if len(rules) == 1 else AllRules(rules)

    def call_grammar(self, env: Any) -> ToolCallGrammar:
        """The tool-call grammar (``constrain_calls``), built once from the first environment's
        tool schemas and the policy's vocabulary."""
        if self._grammar is None:
            tokenizer, width = self._vocabulary_of_policy("constrain_calls")
            schemas = getattr(env, "tool_schemas", None) or TOOL_SCHEMAS
            end_ids = self.config.sampling.stop_token_ids
            if end_ids is None:
                end_ids = tuple(getattr(self.policy, "eos_ids", ()))
            self._grammar = ToolCallGrammar(tool_specs(schemas, ARGUMENT_ALTERNATIVES),
                                            tokenizer, width, end_ids)
        return self._grammar

    def _vocabulary_of_policy(self, option: str) -> tuple[Any, int]:
        """The policy's tokenizer and output width, which a decoding rule masks over."""
        tokenizer = getattr(self.policy, "tokenizer", None)
        model = getattr(self.policy, "model", None)
        if tokenizer is None or model is None:
            raise ValueError(f"{option}: the policy has no tokenizer and model to constrain "
                             "(use an HFPolicy, or turn it off)")
        return tokenizer, int(model.get_output_embeddings().weight.shape[0])

    def edit_constraint(self, env: Any) -> EditConstraint | None:
        """The decoding rule for ``env``'s next action (``constrain_edits``), or None."""
        if not self.config.constrain_edits:
            return None
        text = env.open_file_text() if hasattr(env, "open_file_text") else None
        if text is None:
            return None
        if self._vocabulary is None:
            self._vocabulary = VocabularyTexts(*self._vocabulary_of_policy("constrain_edits"))
        return EditConstraint(self._vocabulary, text)

    def collect(self, tasks: Sequence[Any], group_size: int, *,
                policy_version: int | None = None, run_id: str | None = None) -> CollectResult:
        """Run ``group_size`` attempts at each task and record them; blocks until done.

        ``tasks`` are task ids or objects with an ``id`` (e.g. ``envs.Task``). ``policy_version``,
        when given, must equal the policy's (a guard against sampling with stale weights).
        ``run_id`` prefixes attempt and group ids (default: a fresh random id), so repeated
        runs into one store never collide.
        """
        return asyncio.run(self.collect_async(
            tasks, group_size, policy_version=policy_version, run_id=run_id))

    def cancel(self) -> None:
        """Stop the run: in-flight attempts end ``cancelled`` and are recorded. Thread-safe."""
        self._cancelled.set()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._cancel_tasks)

    async def collect_async(self, tasks: Sequence[Any], group_size: int, *,
                            policy_version: int | None = None,
                            run_id: str | None = None) -> CollectResult:
        """The asyncio form of :meth:`collect`."""
        specs = self._specs(tasks, group_size, policy_version, run_id)
        self._cancelled.clear()
        self._loop = asyncio.get_running_loop()
        started = time.perf_counter()
        env_pool = ThreadPoolExecutor(self.config.env_workers, thread_name_prefix="tracerl-env")
        model_pool = ThreadPoolExecutor(1, thread_name_prefix="tracerl-sampler")
        batcher = GenerationBatcher(
            self.policy, self.config.sampling, model_pool,
            max_batch_size=self.config.max_batch_size,
            wait_seconds=self.config.batch_wait_seconds,
        )
        progress = CollectorProgress(len(specs), batcher.stats, enabled=self.config.progress)
        runner = AttemptRunner(self, batcher, env_pool, self._chat_tokens(env_pool), progress)
        batcher_task = asyncio.create_task(batcher.run())
        installed = self._install_signal_handlers()
        semaphore = asyncio.Semaphore(self.config.max_concurrent)
        recorded: dict[int, Attempt] = {}

        async def one(index: int, spec: AttemptSpec) -> Attempt | None:
            async with semaphore:
                if self._cancelled.is_set():
                    return None
                try:
                    attempt = await runner.run(spec)
                except ValueError:
                    # Bad input (a prompt that cannot fit, an unknown task): stop the run now;
                    # the attempts in flight are recorded as cancelled.
                    self._cancel_tasks()
                    raise
            self._record(attempt)
            recorded[index] = attempt
            progress.attempt_done(attempt.end_reason)
            return attempt

        try:
            with progress:
                self._tasks = [asyncio.create_task(one(i, s)) for i, s in enumerate(specs)]
                if self._cancelled.is_set():
                    self._cancel_tasks()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                for t in self._tasks:
                    error = None if t.cancelled() else t.exception()
                    if error is not None:
                        raise error
        finally:
            for sig in installed:
                asyncio.get_running_loop().remove_signal_handler(sig)
            batcher.close()
            await batcher_task
            model_pool.shutdown(wait=True, cancel_futures=True)
            env_pool.shutdown(wait=True, cancel_futures=True)
            self._loop = None
        attempts = tuple(recorded[i] for i in sorted(recorded))
        endings = Counter(a.end_reason.value for a in attempts)
        return CollectResult(
            attempts=attempts,
            endings={r.value: endings.get(r.value, 0) for r in ATTEMPT_ENDINGS},
            generated_tokens=sum(a.costs.generated_tokens for a in attempts),
            tool_seconds=sum(a.costs.tool_seconds for a in attempts),
            wall_seconds=time.perf_counter() - started,
            generation_seconds=batcher.stats.seconds,
            sampler_calls=batcher.stats.calls,
            not_started=len(specs) - len(attempts),
        )

    # -- internals ------------------------------------------------------------------------

    def _specs(self, tasks: Sequence[Any], group_size: int, policy_version: int | None,
               run_id: str | None) -> list[AttemptSpec]:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size: must be an integer >= 1, got {group_size!r}")
        if isinstance(tasks, (str, bytes)) or not tasks:
            raise ValueError("tasks: must be a non-empty sequence of tasks or task ids")
        if policy_version is not None and policy_version != self.policy.policy_version:
            raise ValueError(
                f"policy_version: asked for {policy_version} but the policy is at "
                f"{self.policy.policy_version} (stale or newer weights)"
            )
        run = run_id or uuid.uuid4().hex[:12]
        specs = []
        seen: set[str] = set()
        for task in tasks:
            task_id = _task_id(task)
            if task_id in seen:
                raise ValueError(f"tasks: {task_id!r} appears twice (use group_size for repeats)")
            seen.add(task_id)
            budget = getattr(task, "budget", None)
            token_budget = getattr(budget, "max_new_tokens", None) or self.config.max_attempt_tokens
            for sample in range(group_size):
                specs.append(AttemptSpec(
                    attempt_id=f"{run}:{task_id}:{sample}",
                    task_id=task_id,
                    group_id=f"{run}:{task_id}",
                    sample_index=sample,
                    seed=attempt_seed(self.config.seed, task_id, sample),
                    max_new_tokens=token_budget,
                ))
        return specs

    def _chat_tokens(self, pool: ThreadPoolExecutor) -> ChatTokens:
        tools = self.config.tools
        if tools is None:
            env = self.make_env()
            try:
                tools = getattr(env, "tool_schemas", None)
            finally:
                close = getattr(env, "close", None)
                if callable(close):
                    close()
        if tools is None:
            from tracerl.envs.tools import TOOL_SCHEMAS

            tools = tuple(TOOL_SCHEMAS)
        renderer = getattr(self.policy, "chat_prompt", None)
        if renderer is None:
            raise ValueError(
                f"policy: {type(self.policy).__name__} has no chat_prompt(); the collector "
                "renders conversations with the policy's chat template"
            )
        return ChatTokens(self.policy, tools=tools,  # type: ignore[arg-type]
                          system_prompt=self.config.system_prompt,
                          observation_role=self.config.observation_role)

    def _record(self, attempt: Attempt) -> None:
        if self.store is None:
            return
        if not self.store.append(attempt):
            self.duplicates += 1
            warnings.warn(f"attempt {attempt.attempt_id!r} was already in the store; pass a "
                          "new run_id for a new run", stacklevel=3)

    def _cancel_tasks(self) -> None:
        self._cancelled.set()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current and not task.done():
                task.cancel()

    def _install_signal_handlers(self) -> list[signal.Signals]:
        if not self.config.handle_signals or threading.current_thread() is not threading.main_thread():
            return []
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._cancel_tasks)
            except (NotImplementedError, RuntimeError, ValueError):
                continue
            installed.append(sig)
        return installed


__all__ = ["CollectResult", "Collector", "CollectorConfig", "EndReason", "attempt_seed"]
