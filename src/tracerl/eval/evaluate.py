"""``tracerl eval``: a fixed-budget evaluation of a policy on a task set.

Every task gets the same budget: ``samples`` attempts, each with the same turn and token
limits and the same sampling settings, all recorded with the result. Attempts run through the
same collector and environment as training, and are scored by the hidden tests in a fresh
sandbox (see :mod:`tracerl.eval.summary` for what counts as a success). With
``inject_faults`` the same evaluation runs a second time with tools that fail on purpose (as
observations the policy can act on: :mod:`tracerl.envs.faults`), and both results are
reported, with infrastructure endings excluded and counted, and the share of faulted attempts
that still succeeded, so that recovery from tool failure is measured rather than assumed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tracerl.envs.coding import CodingEnv
from tracerl.envs.faults import FaultConfig
from tracerl.envs.sandbox import Sandbox
from tracerl.envs.tasks import Task
from tracerl.eval.behaviour import behaviour
from tracerl.eval.judge import Judge, JudgeConfig, independence_warning
from tracerl.eval.summary import fault_comparison, summarize
from tracerl.models.lora import is_adapter_dir
from tracerl.rollout.collect.chat_tokens import read_conversation
from tracerl.rollout.collect.collector import Collector, CollectorConfig
from tracerl.rollout.settings import RolloutConfig, collector_config, read_rollout
from tracerl.trace.schema import Attempt, Role
from tracerl.trace.store import TraceStore

TRAINING_COST_FILES = ("training_cost.json", "trainer_state.json", "checkpoint.json")
"""Files in a checkpoint directory that may say what training it cost."""
TRAINING_COST_KEYS = ("rl_steps", "step", "steps", "generated_tokens", "tool_seconds", "train_seconds",
                      "wall_seconds", "rollouts", "attempts")


@dataclass(frozen=True)
class EvalSettings:
    """The fixed budget and sampling of an evaluation; recorded in its output."""

    samples: int
    """Attempts per task (the K of pass@k)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How each attempt is decoded and budgeted: temperature (0 is greedy: then every sample
    of a task is the same), top-p, top-k, turns (``max_turns``, a cap on each task's own
    budget), tokens per turn (``max_turn_tokens``) and per attempt (``max_attempt_tokens``),
    seconds, conversation format and decoding rules. The same config a training run uses
    (and saves beside its policies, :func:`tracerl.rollout.settings.read_rollout`)."""
    seed: int = 0
    """Seed of sampling (per attempt), fault injection and the bootstrap."""
    inject_faults: float = 0.0
    """Probability per tool call of an injected tool fault (a failed or timed-out command, a
    flaky test run, a truncated output; ``FaultConfig.tool_faults``); > 0 adds a second,
    faulted run."""
    inject_infrastructure_faults: float = 0.0
    """Probability per test run, in the faulted run, that the sandbox fails to start (an
    infrastructure ending, excluded from success and counted); > 0 adds the faulted run."""
    bootstrap_resamples: int = 2000
    """Resamples of the task-level bootstrap."""

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"samples: must be an integer >= 1, got {self.samples!r}")
        for name in ("inject_faults", "inject_infrastructure_faults"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be a probability in [0, 1], got {value!r}")
        if not isinstance(self.rollout, RolloutConfig):
            raise ValueError(f"rollout: must be a RolloutConfig, got {type(self.rollout).__name__}")
        self.collector_config()  # validates the rollout's turns, tokens and sampling

    def collector_config(self, progress: bool = False) -> CollectorConfig:
        """The collector's settings (:func:`tracerl.rollout.settings.collector_config`)."""
        return collector_config(self.rollout, seed=self.seed, progress=progress)


def load_policy(path: str | Path, device: str = "cpu") -> Any:
    """Load a checkpoint directory as an ``HFPolicy`` on ``device`` (``cpu``, ``cuda``,
    ``cuda:N`` or ``auto``); ValueError says why it cannot."""
    import torch

    from tracerl.models.device import resolve_device
    from tracerl.rollout.policies.hf import HFPolicy

    where = resolve_device(device, field="--device")

    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"--policy {str(directory)!r}: not a directory")
    if not (directory / "config.json").is_file() and not is_adapter_dir(directory):
        raise ValueError(f"--policy {str(directory)!r}: holds no model (config.json is missing; "
                         "a checkpoint is written by save_pretrained) and no LoRA adapter "
                         "(adapter_config.json)")
    try:
        from tracerl.models.tiny import load_tiny

        model, tokenizer = load_tiny(directory)  # an adapter: on its base, merged
    except ValueError:
        raise  # load_tiny's own message (e.g. a tensor that is not finite) names the problem
    except Exception as error:  # transformers raises many kinds; say which and why
        raise ValueError(f"--policy {str(directory)!r}: could not be loaded: "
                         f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                         ) from None
    torch.nn.Module.to(model, where)  # in place: a module moves its own parameters
    return HFPolicy(model, tokenizer)


def checkpoint_rollout(path: str | Path) -> RolloutConfig | None:
    """The rollout config the policy in ``path`` was trained with, so that it is evaluated
    (and served) as its run decoded it: the saved ``tracerl_rollout.json``; for a policy saved
    before that file existed, the defaults with its recorded conversation format and
    decoding rules; None for a policy not trained by tracerl."""
    saved = read_rollout(path)
    if saved is not None:
        return saved
    conversation = read_conversation(path)
    if conversation is None:
        return None
    return RolloutConfig(
        show_tool_schemas=bool(conversation.get("tool_schemas_in_prompt", True)),
        system_prompt=conversation.get("system_prompt"),
        constrain_edits=bool(conversation.get("constrain_edits", False)),
        constrain_calls=bool(conversation.get("constrain_calls", False)))


def training_cost(policy_dir: str | Path) -> dict[str, Any] | None:
    """What training the checkpoint cost, when its directory or run recorded it, else None."""
    directory = Path(policy_dir).resolve()
    for name in TRAINING_COST_FILES:
        path = directory / name
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            found = {k: data[k] for k in TRAINING_COST_KEYS if isinstance(data, dict) and k in data}
            if found:
                return {"source": name, **found}
    for parent in (directory.parent, directory.parent.parent):
        summary = parent / "summary.json"
        if not summary.is_file():
            continue
        try:
            data = json.loads(summary.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        recorded = data.get("policy_dir") if isinstance(data, dict) else None
        # The run's summary names its final checkpoint, relative to where the run was started
        # or to the run directory.
        if isinstance(recorded, str) and directory in (Path(recorded).resolve(),
                                                       (parent / recorded).resolve()):
            found = {k: data[k] for k in TRAINING_COST_KEYS if k in data}
            if found:
                return {"source": "summary.json of the run", **found}
    return None


DEFAULT_TURNS = 8
"""The turn budget of a task that sets none, when no turn cap is given."""


def turn_cap(tasks: Sequence[Task], max_turns: int | None = None) -> int:
    """The cap on actions per attempt: ``max_turns``, or else the largest of the tasks' own
    budgets (each task's environment ends its attempts at its own)."""
    if max_turns is not None:
        return max_turns
    return max(((t.budget.max_turns or DEFAULT_TURNS) if t.budget is not None else DEFAULT_TURNS
                for t in tasks), default=DEFAULT_TURNS)


def _make_env_factory(tasks: Sequence[Task], sandbox: Sandbox, settings: EvalSettings,
                      faults: FaultConfig | None) -> Any:
    counter = itertools.count()

    def make_env() -> CodingEnv:
        # Each environment draws faults from its own stream, so attempts do not share one.
        config = None if faults is None else dataclasses.replace(
            faults, seed=settings.seed * 1_000_003 + next(counter))
        return CodingEnv(tasks, sandbox=sandbox, max_turns=settings.rollout.max_turns,
                         max_seconds=settings.rollout.max_seconds, faults=config)
    return make_env


def collect_attempts(policy: Any, tasks: Sequence[Task], settings: EvalSettings, *,
                     sandbox: Sandbox, faults: FaultConfig | None = None,
                     store_dir: str | Path | None = None, run_id: str = "eval",
                     progress: bool = False, fsync: bool = True,
                     make_env: Callable[[], Any] | None = None) -> tuple[list[Attempt], float]:
    """Run ``settings.samples`` attempts per task; returns them and the wall seconds.
    ``make_env``: the environment factory (default: a ``CodingEnv`` over ``tasks`` with the
    settings' turns and seconds, and ``faults``); a trainer passes its own, so a run with a
    custom environment is evaluated in it."""
    if make_env is not None and faults is not None:
        raise ValueError("faults: injected through the default environment; with make_env, "
                         "give the environment its faults")
    store = TraceStore(store_dir, fsync=fsync) if store_dir is not None else None
    started = time.perf_counter()
    try:
        factory = make_env or _make_env_factory(tasks, sandbox, settings, faults)
        collector = Collector(policy, factory, store, settings.collector_config(progress))
        result = collector.collect(list(tasks), settings.samples, run_id=run_id)
    finally:
        if store is not None:
            store.close()
    if result.not_started:
        raise RuntimeError(f"evaluation was cancelled: {result.not_started} attempt(s) never "
                           "started; the budget was not spent, so no result is reported")
    return list(result.attempts), time.perf_counter() - started


def transcript(policy: Any, attempt: Attempt) -> str:
    """The attempt's actions and observations as text (for a judge)."""
    parts = []
    for fragment in attempt.fragments:
        for turn in fragment.turns:
            for segment in turn.segments:
                if segment.role is Role.PROMPT:
                    continue
                label = "AGENT" if segment.role is Role.ACTION else segment.role.value.upper()
                parts.append(f"[{label}] {policy.decode(segment.token_ids.tolist())}")
    return "\n".join(parts)


def evaluate(policy: Any, tasks: Sequence[Task], settings: EvalSettings, *, sandbox: Sandbox,
             faults: FaultConfig | None = None, store_dir: str | Path | None = None,
             judge: JudgeConfig | None = None, training_judge: Mapping[str, Any] | None = None,
             progress: bool = False, run_id: str = "eval", fsync: bool = True,
             make_env: Callable[[], Any] | None = None) -> dict[str, Any]:
    """One fixed-budget run: the summary of :func:`summarize` plus settings and costs. The
    trainer's held-out evaluations run through here too (``Trainer.evaluate``)."""
    if not tasks:
        raise ValueError("tasks: nothing to evaluate")
    attempts, wall = collect_attempts(policy, tasks, settings, sandbox=sandbox, faults=faults,
                                      store_dir=store_dir, run_id=run_id, progress=progress,
                                      fsync=fsync, make_env=make_env)
    result = summarize(attempts, {t.id: t.family for t in tasks}, max_k=settings.samples,
                       seed=settings.seed, resamples=settings.bootstrap_resamples)
    result["wall_seconds"] = wall
    result["behaviour"] = behaviour(policy, attempts)
    result["settings"] = asdict(settings)
    result["faults"] = None if faults is None else asdict(faults)
    result["sandbox_memory"] = getattr(sandbox, "memory_note", None)
    if judge is not None:
        by_id = {t.id: t for t in tasks}
        client = Judge(judge)
        scores = [client.score(by_id[a.task_id].instruction, transcript(policy, a)).score
                  for a in attempts]
        result["judge"] = judge.to_dict()
        result["judge_score"] = sum(scores) / len(scores)
        result["judge_warning"] = independence_warning(training_judge, judge)
    return result


def run_evaluation(policy: Any, tasks: Sequence[Task], settings: EvalSettings, *,
                   sandbox: Sandbox, policy_dir: str | Path | None = None,
                   store_dir: str | Path | None = None, judge: JudgeConfig | None = None,
                   training_judge: Mapping[str, Any] | None = None,
                   progress: bool = False) -> dict[str, Any]:
    """The clean evaluation, plus a fault-injected re-run when ``settings.inject_faults > 0``.

    The top level is the clean run; ``fault_injection`` holds the faulted run (``result``)
    and :func:`~tracerl.eval.summary.fault_comparison` of the two.
    """
    clean_store = None if store_dir is None else Path(store_dir) / "clean"
    result = evaluate(policy, tasks, settings, sandbox=sandbox, store_dir=clean_store,
                      judge=judge, training_judge=training_judge, progress=progress,
                      run_id="eval")
    result["policy_dir"] = None if policy_dir is None else str(policy_dir)
    result["training_cost"] = None if policy_dir is None else training_cost(policy_dir)
    rate, infrastructure = settings.inject_faults, settings.inject_infrastructure_faults
    if rate > 0 or infrastructure > 0:
        faults = FaultConfig.tool_faults(rate, seed=settings.seed, infrastructure=infrastructure)
        faulted = evaluate(policy, tasks, settings, sandbox=sandbox, faults=faults,
                           store_dir=None if store_dir is None else Path(store_dir) / "faults",
                           progress=progress, run_id="eval-faults")
        result["fault_injection"] = {"rate": rate, "infrastructure_rate": infrastructure,
                                     **fault_comparison(result, faulted), "result": faulted}
    return result


def _fault_lines(faults: Mapping[str, Any]) -> list[str]:
    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    injected = faults.get("injected_faults") or {}
    return [
        f"fault injection (tool faults at rate {faults['rate']}, sandbox start failures at "
        f"{faults.get('infrastructure_rate', 0.0)}): success excluding infrastructure "
        f"{share(faults['success_without_faults'])} without faults, "
        f"{share(faults['success_with_faults'])} with",
        f"  infrastructure endings (excluded) {faults.get('infrastructure_failures_without_faults')}"
        f" without faults, {faults.get('infrastructure_failures_with_faults')} with;"
        f"  faulted attempts {faults.get('faulted_attempts')}, recovered "
        f"{faults.get('recovered_attempts')} ({share(faults.get('recovery_rate'))})",
        "  injected  " + ("  ".join(f"{k}:{v}" for k, v in injected.items()) or "none"),
    ]


def format_result(result: Mapping[str, Any]) -> str:
    """A readable terminal table of an evaluation result."""
    settings = result.get("settings", {})
    rollout = settings.get("rollout", {})
    low, high = result["ci95"]
    lines = [
        f"tasks {result['tasks']}  attempts {result['attempts']}  samples/task "
        f"{settings.get('samples')}  temperature {rollout.get('temperature')}  turns "
        f"{rollout.get('max_turns')}  tokens/turn {rollout.get('max_turn_tokens')}  "
        f"tokens/attempt {rollout.get('max_attempt_tokens')}",
        f"success (hidden tests, audited)  {result['success']:.3f}  95% CI [{low:.3f}, {high:.3f}]"
        "  (bootstrap over tasks)",
    ]
    visible = result.get("visible_success")
    lines.append(f"visible-test success             "
                 f"{'-' if visible is None else f'{visible:.3f}'}  passed visible but not hidden:"
                 f" {result.get('visible_not_hidden', 0)}")
    lines.append("pass@k  " + "  ".join(f"{k}:{v:.3f}" for k, v in result["pass_at_k"].items()))
    lines.append("")
    lines.append(f"{'family':<24}{'tasks':>6}{'attempts':>10}{'success':>9}   95% CI")
    for name, block in result["by_family"].items():
        lo, hi = block["ci95"]
        lines.append(f"{name:<24}{block['tasks']:>6}{block['attempts']:>10}"
                     f"{block['success']:>9.3f}   [{lo:.3f}, {hi:.3f}]")
    lines.append("")
    lines.append("endings  " + "  ".join(f"{k}:{v}" for k, v in result["by_ending"].items() if v))
    acts = result.get("behaviour")
    if acts and acts["actions"]:
        fail = acts["after_fail"]
        def share(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        lines.append(f"behaviour  edits {acts['edits']} (applied {share(acts['edits_applied'])})"
                     f"  malformed calls {share(acts['malformed'])}  failing test runs "
                     f"{fail['count']}, then tried again {share(fail['retry'])}")
    flags = result["hack_flags"]
    lines.append(f"hack flags {flags['count']}  " + "  ".join(
        f"{k}:{v}" for k, v in flags["by_kind"].items() if v))
    lines.append(f"costs  generated tokens {result['generated_tokens']}  tool seconds "
                 f"{result['tool_seconds']:.1f}  wall seconds {result['wall_seconds']:.1f}")
    cost = result.get("training_cost")
    lines.append("training cost  " + ("unknown (not recorded with the checkpoint)" if not cost
                                      else ", ".join(f"{k} {v}" for k, v in cost.items())))
    faults = result.get("fault_injection")
    if faults:
        lines.extend(_fault_lines(faults))
    if result.get("judge_warning"):
        lines.append(f"WARNING: {result['judge_warning']}")
    return "\n".join(lines)
