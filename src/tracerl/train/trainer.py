"""The training loop, top to bottom: collect → verify → advantages → update → evaluate →
checkpoint, each phase timed, with hooks after every phase.

``Trainer(config).run()`` builds (or resumes) everything from the config: tasks, sandbox and
environment, the policy (a tiny Llama with a locally trained tokenizer, optionally warm-started
on demonstrations, or a transformers model), the critic, the reference model, the trace store
and the optimizer. Attempts go to the trace store as they finish; a checkpoint after each step
records what the step did, so a killed run restarts from the last checkpoint, reuses the
complete groups the store already holds for the step in progress, and neither repeats nor
loses an update.

Under torchrun, rank 0 runs this loop and the other ranks only share each update
(:mod:`tracerl.train.ranks`); ``model.device`` says where the weights live, while batches,
advantages and accounting stay on the CPU.

The phases live here; what they call lives beside them: :mod:`tracerl.train.setup` (tasks,
the policy loaded or built, the conversation format, the first-prompt check, ``config.yaml``),
:mod:`tracerl.train.groups` (which tasks a step draws, the groups a killed run stored, task
success estimates), :mod:`tracerl.train.reports` (each task's share of the loss weight, the
critic's explained variance), :mod:`tracerl.train.average` (the weight average of
``update.ema_decay``) and :mod:`tracerl.train.heldout` (the held-out evaluations and
``summary.json``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tracerl.core import kl_reward_penalty, mismatch_metrics
from tracerl.envs import CodingEnv, Sandbox, Task
from tracerl.envs.tools import parse_tool_call
from tracerl.eval.summary import succeeded
from tracerl.models.device import resolve_device
from tracerl.rollout import HFPolicy
from tracerl.rollout.collect.chat_tokens import (
    CONVERSATION_FILE,
    ChatTokens,
    conversation_json,
    write_conversation,
)
from tracerl.rollout.collect.collector import Collector
from tracerl.rollout.settings import ROLLOUT_FILE, collector_config, rollout_json, write_rollout
from tracerl.trace import Attempt, PackedBatch, Role, TraceStore, Turn, pack
from tracerl.train import checkpoint as ckpt
from tracerl.train import collection, groups, heldout, ranks, reports, setup
from tracerl.train.algorithms import (
    AdvantageInputs,
    compute_advantages,
    group_outcome_metrics,
)
from tracerl.train.asynchronous import AsyncLoop
from tracerl.train.average import WeightAverage
from tracerl.train.config import TrainConfig
from tracerl.train.demos import DemonstrationSet
from tracerl.train.engine import RolloutEngine
from tracerl.train.metrics import MetricsWriter, StepProgress
from tracerl.train.sft import supervised_finetune
from tracerl.train.update import (
    ActorCritic,
    DemonstrationBatch,
    RowBatch,
    freeze_old,
    make_adamw,
    ppo_update,
)

POLICY_DIR = "policy"
"""Where every run writes its policy, the one its final evaluation evaluated (under the run
directory): the weight average with ``update.ema_decay``, else the last iterate. Loadable as
``tracerl eval --policy`` and ``tracerl serve --model`` load a directory, with the run's
rollout config beside it."""

Hook = Callable[[str, "Trainer"], None]
"""Called after every phase with its name (``collect``, ``verify``, ``advantages``, ``update``,
``evaluate``, ``checkpoint``, ``sft``) and the trainer."""


class Trainer:
    """One run of :class:`TrainConfig` (see the module docstring)."""

    def __init__(self, config: TrainConfig, *, hooks: Sequence[Hook] = (),
                 log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.hooks = list(hooks)
        self.log = log or (lambda message: None)
        self.run_dir = Path(config.run_dir)
        self.state = ckpt.TrainerState()
        self.timings: dict[str, float] = defaultdict(float)
        """Seconds spent per phase in this process."""
        self.started = time.perf_counter()
        self.last_metrics: dict[str, Any] = {}
        self.steps_here = 0
        """RL steps run by this process (a resumed run counts from its restart)."""
        self.step_seconds = 0.0
        """Wall seconds of those steps."""
        self.before_turns = 0.0
        """Mean turns per attempt of the sampled evaluation before RL."""
        self.recent_turns = 0.0
        """Mean turns per attempt of the latest RL step's attempts."""

    # -- phases -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run (or resume) the whole recipe; returns the summary written to ``summary.json``.
        A vLLM server the run started is stopped however the run ends."""
        try:
            return self._run()
        finally:
            if hasattr(self, "engine"):  # what samples the attempts (``rollout.engine``)
                self.engine.close()

    def _run(self) -> dict[str, Any]:
        self.setup()
        if not self.lead:  # another torchrun rank: it only shares the updates (train/ranks.py)
            return self.follow()
        if self.config.sft.enabled and not (self.run_dir / "sft" / "DONE").is_file():
            with self.phase("sft"):
                self.warm_start()
        ranks.sync_parameters(self.actor, self.world_size)
        self.start_weight_average()
        before = heldout.evaluate_once(self, "before", steps=0, policy="warm start")
        sampled = before["sampled"]
        self.before_turns = sampled.get("turns", 0) / max(sampled.get("attempts", 0), 1)
        with StepProgress(self.config.steps, enabled=self.config.progress,
                          done=self.state.step) as progress:
            if self.config.asynchronous.max_staleness:  # the worker collects ahead
                AsyncLoop(self).run(progress)
            while ranks.share(self.more_steps(), self.world_size, self.device):
                step_started = time.perf_counter()
                with self.phase("collect"):
                    attempts, collected, collect_metrics = self.collect(self.state.step)
                self.train_step(attempts, collected, collect_metrics, step_started, progress)
        final = self.final_checkpoint()
        kind = heldout.policy_kind(self)
        with (contextlib.nullcontext() if self.ema is None  # update.ema_decay: the run's
              else self.ema.held_by(self.actor.policy)):  # policy is the weight average
            policy_dir = self.save_policy(self.run_dir / POLICY_DIR)
            after = heldout.evaluate_once(self, "after", steps=self.state.step, policy=kind)
        return heldout.write_summary(self, before, after, policy_dir, final)

    def more_steps(self) -> bool:
        """Whether the run trains another step (steps, time and token budgets)."""
        return (self.state.step < self.config.steps and self.time_left_for_step()
                and self.tokens_left_for_step())

    def train_step(self, attempts: list[Attempt], collected: list[Attempt],
                   collect_metrics: dict[str, Any], step_started: float, progress: StepProgress
                   ) -> None:
        """Verify, advantages, update, evaluate and finish the step of ``collect``'s attempts."""
        with self.phase("verify"):
            batch, verify_metrics = self.verify(attempts, collected)
        advantage_metrics: dict[str, Any] = {}
        update_metrics: dict[str, Any] = {"update": {"skipped": True}}
        if batch is not None:  # else every group was uniform: nothing to learn from
            with self.phase("advantages"):
                rows, advantage_metrics = self.advantages(batch)
        ranks.share(None if batch is None else (rows, batch.attempt_index),
                    self.world_size, self.device)
        if batch is not None:
            with self.phase("update"):
                update_metrics = self.update(rows, batch.attempt_index)
        metrics = {**collect_metrics, **verify_metrics, **advantage_metrics, **update_metrics}
        if self.config.eval.every and (self.state.step + 1) % self.config.eval.every == 0:
            with self.phase("evaluate"):
                metrics["eval"] = self.evaluate(f"step{self.state.step + 1:05d}",
                                                steps=self.state.step + 1)["sampled"]
        step_seconds = time.perf_counter() - step_started
        self.finish_step(metrics, step_seconds)
        progress.advance(f"reward {metrics['reward']['mean']:.2f}  {step_seconds:.0f}s/step")

    def follow(self) -> dict[str, Any]:
        """The loop of a rank other than 0: take rank 0's weights, then for each step its
        frozen rows, and compute this rank's share of each update. Returns {}."""
        ranks.sync_parameters(self.actor, self.world_size)
        while ranks.share(False, self.world_size, self.device):
            shared = ranks.share(None, self.world_size, self.device)
            if shared is not None:
                rows, attempt_index = shared
                self.update(rows, attempt_index)
            self.state.step += 1
        return {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase and call the hooks after it."""
        started = time.perf_counter()
        yield
        self.timings[name] += time.perf_counter() - started
        for hook in self.hooks:
            hook(name, self)

    # -- set-up -----------------------------------------------------------------------------

    def setup(self) -> None:
        """Tasks, environment, model, critic, reference, optimizer, store; resume if possible."""
        config = self.config
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.rank, self.world_size, self.device = ranks.start(resolve_device(config.model.device))
        self.lead = self.rank == 0
        """Rank 0 (the only rank without torchrun) collects, evaluates and writes the run."""
        if self.lead:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            setup.check_config_file(config, self.log)
        self.train_tasks, self.heldout_tasks = setup.run_tasks(config)
        self.sandbox = Sandbox()
        self.demos = DemonstrationSet(config, self.train_tasks, self.sandbox)
        """The train split's demonstrations (warm start, tokenizer, ``update.sft_coef``)."""
        latest = ckpt.latest_checkpoint(self.run_dir)
        sft_dir = self.run_dir / "sft"
        if latest is not None:
            self.log(f"resuming from {latest}")
        source = latest or (sft_dir if (sft_dir / "DONE").is_file() else None)
        model, tokenizer = (setup.load_model(source) if source is not None
                            else setup.build_model(config, self.demos.tokenizer_texts))
        model = setup.lora_policy(config, model, tokenizer, source)  # model.lora: an adapter
        self.tokenizer = tokenizer
        self.actor = ActorCritic(model, config.critic, config.rollout.temperature).to(self.device)
        self.policy = HFPolicy(model, tokenizer, max_batch_size=config.rollout.concurrency)
        self.demos.bind(self.chat_tokens(), tokenizer)
        self.check_first_prompts()
        self.optimizer = make_adamw(
            [{"params": self.actor.policy_parameters(), "lr": config.update.lr},
             {"params": self.actor.critic_parameters(), "lr": config.critic.lr}],
            config.update.weight_decay)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.ema: WeightAverage | None = None
        """The moving average of the policy's weights (``update.ema_decay``), on rank 0."""
        if latest is not None:
            self.state, extra = ckpt.load_trainer_file(latest)
            self.optimizer.load_state_dict(extra["optimizer"])
            if extra.get("critic") is not None and self.actor.value_head is not None:
                self.actor.load_critic_state(extra["critic"])
            self.generator.set_state(extra["generator"])
            ckpt.set_rng_state(extra["rng"])
            if extra.get("ema") is not None and config.update.ema_decay is not None:
                self.ema = WeightAverage({name: value.to(self.device)
                                          for name, value in extra["ema"].items()},
                                         config.update.ema_decay)
        self.policy.policy_version = self.state.policy_version
        self.engine = RolloutEngine(self)
        self.reference: ActorCritic | None = None
        if self.lead:
            self.store = TraceStore(self.run_dir / "traces", fsync=False)
            self.metrics = MetricsWriter(self.run_dir, tensorboard=config.tensorboard)

    def make_env_factory(self, tasks: Sequence[Task]) -> Callable[[], CodingEnv]:
        """A factory of fresh environments over ``tasks`` (one per attempt)."""
        turns = self.config.rollout.max_turns
        return lambda: CodingEnv(tasks, sandbox=self.sandbox, max_turns=turns)

    def chat_tokens(self) -> ChatTokens:
        """The collector's conversation format for this run."""
        return setup.chat_tokens(self.config.rollout, self.policy)

    def check_first_prompts(self, candidates: int = 8) -> int:
        """:func:`tracerl.train.setup.check_first_prompts` over the train and held-out tasks."""
        return setup.check_first_prompts(self.config.rollout, self.policy,
                                         [*self.train_tasks, *self.heldout_tasks], candidates)

    # -- warm start ---------------------------------------------------------------------------

    def warm_start(self) -> None:
        """Supervised fine-tuning on the demonstrations; saves the result to ``sft/``."""
        sft = self.config.sft
        sequences, redraw = self.demos.sequences()
        names = random.Random(f"{self.config.seed}:fresh-names")
        kinds = Counter(d.kind for d in self.demos.demonstrations())
        result = supervised_finetune(
            self.actor.policy, sequences, steps=sft.steps, batch_size=sft.batch_size, lr=sft.lr,
            seed=self.config.seed, pad_id=int(self.tokenizer.pad_token_id),
            max_seconds=sft.max_seconds, observation_weight=sft.observation_weight,
            length_window=sft.length_window,
            redraw=None if redraw is None else (lambda i, rng: redraw(i, rng, names)))
        directory = self.save_policy(self.run_dir / "sft")
        record = {"steps": result.steps, "seconds": result.seconds,
                  "final_loss": result.final_loss, "demonstrations": dict(kinds),
                  "losses": list(result.losses)}
        (directory / "sft.json").write_text(json.dumps(record), encoding="utf-8")
        (directory / "DONE").write_text("", encoding="utf-8")
        self.metrics.write(0, {"sft": {k: v for k, v in record.items() if k != "losses"}},
                           kind="sft")
        self.log(f"SFT: {result.steps} steps in {result.seconds:.0f}s, loss {result.final_loss:.3f}")

    # -- collect ------------------------------------------------------------------------------

    def collector(self, tasks: Sequence[Task], *, temperature: float, seed: int,
                  store: TraceStore | None, policy: Any = None) -> Collector:
        """A collector over ``tasks`` with this run's budgets (``rollout.settings``'s
        ``collector_config``, as every evaluation builds it), sampling from ``policy`` (default:
        the local one)."""
        config = collector_config(self.config.rollout, seed=seed, temperature=temperature)
        sampler: Any = policy or self.policy  # HFPolicy, OpenAIPolicy: SamplingPolicies
        return Collector(sampler, self.make_env_factory(tasks), store, config)

    @contextlib.contextmanager
    def collecting_threads(self) -> Iterator[None]:
        """torch's intra-op threads set to ``rollout.threads`` for the block (then restored)."""
        wanted = self.config.rollout.threads
        if wanted is None:
            yield
            return
        previous = torch.get_num_threads()
        torch.set_num_threads(wanted)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    def choose_tasks(self, step: int, count: int, exclude: set[str]) -> list[Task]:
        """Tasks of one step (:func:`tracerl.train.groups.choose_tasks`)."""
        return groups.choose_tasks(self.train_tasks, step, count, exclude,
                                   seed=self.config.seed, dynamic=self.config.dynamic,
                                   group_size=self.config.rollout.group_size,
                                   task_success=self.state.task_success)

    def collect(self, step: int, policy: Any = None
                ) -> tuple[list[Attempt], list[Attempt], dict[str, Any]]:
        """The step's groups (:func:`tracerl.train.collection.collect_step`), sampled with
        ``policy`` (default: ``rollout.engine``'s)."""
        return collection.collect_step(self, step, policy)

    # -- verify -------------------------------------------------------------------------------

    def verify(self, attempts: list[Attempt], collected: Sequence[Attempt] = ()
               ) -> tuple[PackedBatch | None, dict[str, Any]]:
        """Outcomes, audit flags, process rewards and treatments → the packed batch.

        The sandboxed verifier itself ran during collection (at submit, or on the files a
        truncated attempt left), overlapping with generation; this phase reads its verdicts,
        counts audit flags (a flagged attempt's reward is already 0), adds process rewards if
        configured, and applies each ending's treatment while packing. The batch is None when
        dynamic sampling kept no group (all were uniform and no refill found a mixed one).
        """
        if self.config.rollout.process_reward:
            attempts = [self._with_process_rewards(a) for a in attempts]
        batch = pack(attempts, has_critic=self.actor.has_critic,
                     pad_token_id=int(self.tokenizer.pad_token_id)) if attempts else None
        # Outcomes, endings and costs are those of every attempt collected this step, also the
        # ones in uniform groups that dynamic sampling kept out of the batch: they were
        # generated, and leaving them out would overstate the policy's variety and understate
        # what the step cost.
        packed = attempts
        attempts = list(collected or attempts)
        flagged = sum(1 for a in attempts if a.audit is not None and a.audit.flagged)
        rewards = [a.reward for a in attempts if a.reward is not None]
        successes = [float(succeeded(a)) for a in attempts]
        endings = Counter(a.end_reason.value for a in attempts)
        per = lambda values: sum(values) / max(1, len(values))  # noqa: E731
        metrics: dict[str, Any] = {
            "reward": {"mean": per(rewards)},
            "success": {"mean": per(successes)},
            "endings": dict(endings),
            # trained_on: the attempts in the batch (excluded endings and dropped groups left
            # out), the number the step's log line prints; kept: before treatments.
            "attempts": {"collected": len(attempts), "kept": len(packed),
                         "trained_on": batch.report.attempts if batch else 0,
                         "in_batch": batch.report.attempts if batch else 0,
                         "excluded": sum(batch.report.excluded.values()) if batch else 0,
                         "dropped_groups": len(batch.report.dropped_groups) if batch else 0,
                         "audit_flagged": flagged},
            "horizon": {
                "tokens": per([a.costs.generated_tokens for a in attempts]),
                "tool_calls": per([a.costs.tool_calls for a in attempts]),
                "turns": per([a.costs.turns for a in attempts]),
                "fragments": per([len(a.fragments) for a in attempts])},
            "costs": {"generated_tokens": sum(a.costs.generated_tokens for a in attempts),
                      "tool_seconds": sum(a.costs.tool_seconds for a in attempts)},
        }
        outcomes = [(a.group_id, float(a.reward)) for a in attempts if a.reward is not None
                    and a.end_reason.value not in ("tool_error", "cancelled")]
        if outcomes:
            index = {g: i for i, g in enumerate(dict.fromkeys(g for g, _ in outcomes))}
            outcome = group_outcome_metrics(
                torch.tensor([r for _, r in outcomes], dtype=torch.float64),
                torch.tensor([index[g] for g, _ in outcomes]))
            total = max(1.0, outcome["groups/count"])
            metrics["groups"] = {"count": outcome["groups/count"],
                                 "uniform_rate": outcome["groups/uniform_fraction"],
                                 "all_zero_rate": outcome["groups/uniform_zero"] / total,
                                 "all_one_rate": outcome["groups/uniform_one"] / total}
        self.last_attempts = attempts
        return batch, metrics

    def _with_process_rewards(self, attempt: Attempt) -> Attempt:
        """Each turn that ran the visible tests gets ``coef * [the tests passed]``, read from
        the observation that came back. Off by default: it rewards what the visible tests
        measure, which the hidden tests may not (a possible source of bias)."""
        coef = self.config.rollout.process_reward_coef
        fragments = []
        for fragment in attempt.fragments:
            turns = list(fragment.turns)
            for i, turn in enumerate(turns):
                action = [s for s in turn.segments if s.role is Role.ACTION]
                if not action:
                    continue
                text = self.policy.decode(action[-1].token_ids.tolist())
                call = parse_tool_call(text).call
                if call is None or call.name != "run_tests":
                    continue
                if i + 1 < len(turns):
                    following = turns[i + 1].segments[0].token_ids
                else:
                    following = fragment.continuation_ids
                passed = self.policy.decode(following.tolist()).lstrip().startswith("PASS")
                turns[i] = Turn(turn.segments, coef * float(passed))
            fragments.append(dataclasses.replace(fragment, turns=tuple(turns)))
        return dataclasses.replace(attempt, fragments=tuple(fragments))

    # -- advantages -----------------------------------------------------------------------------

    def advantages(self, batch: PackedBatch) -> tuple[RowBatch, dict[str, Any]]:
        """Freeze the old policy (and values, reference) once, bootstrap, estimate advantages."""
        update = self.config.update
        rows = RowBatch(batch.input_ids, batch.attention_mask, batch.action_mask,
                        torch.zeros(batch.action_mask.shape), batch.behavior_logprobs,
                        batch.task_index)
        rows = freeze_old(self.actor, rows, update.micro_batch_rows, self._reference())
        assert rows.old_logprobs is not None
        metrics: dict[str, Any] = {}
        mask = batch.action_mask
        if bool(mask.any()):
            metrics["mismatch"] = _strip(mismatch_metrics(
                rows.old_logprobs, batch.behavior_logprobs, mask,
                cap=update.tis_cap or 2.0), "mismatch/")
        token_rewards = batch.token_rewards.clone()
        if update.kl_coef > 0 and update.kl_in == "reward" and rows.ref_logprobs is not None:
            penalty, _ = kl_reward_penalty(rows.old_logprobs, rows.ref_logprobs, mask,
                                           update.kl_coef, update.kl_estimator)
            token_rewards = token_rewards - penalty
        bootstrap = None
        if self.actor.has_critic:
            bootstrap = torch.zeros(len(batch.layouts))
            need = torch.nonzero(batch.needs_bootstrap).flatten()
            for start in range(0, len(need), update.micro_batch_rows):
                index = need[start:start + update.micro_batch_rows]
                bootstrap[index] = self.actor.state_values(batch.continuation_ids[index],
                                                           batch.continuation_mask[index])
            metrics["critic"] = reports.critic_report(batch, rows.old_values, token_rewards,
                                                      self.config.algorithm.gamma)
        result = compute_advantages(
            AdvantageInputs(batch, token_rewards, rows.old_values, bootstrap),
            self.config.algorithm)
        metrics["advantage"] = _strip(
            {k: v for k, v in result.metrics.items() if k.startswith("advantage/")}, "advantage/")
        metrics["algorithm"] = {k.replace("/", "_"): v for k, v in result.metrics.items()
                                if not k.startswith("advantage/")}
        metrics["segmentation"] = reports.segmentation_report(batch, update.loss_mode,
                                                      update.loss_constant)
        rows = dataclasses.replace(rows, advantages=result.advantages, returns=result.returns)
        return rows, metrics

    def _reference(self) -> ActorCritic | None:
        """The KL anchor: the policy as RL started (after the warm start), frozen."""
        if self.config.update.kl_coef <= 0:
            return None
        if self.reference is None:  # with LoRA: the policy with its adapter disabled
            model = setup.reference_policy(self.actor.policy, self.run_dir)
            self.reference = ActorCritic(model, dataclasses.replace(self.config.critic,
                                                                    kind="none"),
                                         self.config.rollout.temperature).to(self.device)
        return self.reference

    # -- update ---------------------------------------------------------------------------------

    def update(self, rows: RowBatch, attempt_index: torch.Tensor) -> dict[str, Any]:
        """Epochs of minibatch PPO on the frozen rows (``attempt_index``: the attempt of each
        row); bumps the policy version. With several ranks each computes its share of rows."""
        started = time.perf_counter()
        metrics = ppo_update(self.actor, self.optimizer, rows, attempt_index,
                             self.config.update, self.config.critic, self.generator,
                             rank=self.rank, world_size=self.world_size,
                             demonstrations=self.demonstration_batch,
                             observation_weight=self.config.sft.observation_weight)
        self.state.policy_version += 1
        self.policy.policy_version = self.state.policy_version
        grouped: dict[str, dict[str, float]] = defaultdict(dict)
        for name, value in metrics.items():
            section, _, key = name.partition("/")
            grouped[section][key or "value"] = value
        grouped["time"]["train_seconds"] = time.perf_counter() - started
        grouped["tokens"]["action"] = float(rows.action_mask.sum())
        grouped["tokens"]["total"] = float(rows.attention_mask.sum())
        return dict(grouped)

    def demonstration_batch(self, optimizer_step: int) -> DemonstrationBatch:
        """The demonstrations ``update.sft_coef`` mixes into optimizer step ``optimizer_step``
        (:meth:`DemonstrationSet.batch`: the same on a resumed run)."""
        return self.demos.batch(optimizer_step)

    def finish_step(self, metrics: dict[str, Any], step_seconds: float) -> None:
        """Update task-success estimates, log the step, checkpoint."""
        self.state.task_success = groups.task_success_estimates(
            self.state.task_success, self.last_attempts, prior=self.config.dynamic.success_prior,
            ema=self.config.dynamic.success_ema)
        metrics["per_solved"] = reports.add_totals(self.state.totals, metrics, self.last_attempts,
                                                   self.state.elapsed_seconds + step_seconds)
        metrics.setdefault("time", {})["step_seconds"] = step_seconds
        metrics["policy_version"] = self.state.policy_version
        self.state.elapsed_seconds += step_seconds
        self.steps_here += 1
        self.step_seconds += step_seconds
        self.recent_turns = float(metrics["horizon"]["turns"])
        self.metrics.write(self.state.step, metrics)
        self.last_metrics = metrics
        self.log(f"step {self.state.step}: reward {metrics['reward']['mean']:.3f}, "
                 f"{metrics['attempts']['trained_on']} attempts trained on, "
                 f"turns {metrics['horizon']['turns']:.1f}, {step_seconds:.0f}s "
                 f"(collect {self.timings['collect']:.0f}s, update "
                 f"{self.timings['update']:.0f}s so far)")
        if self.ema is not None:
            self.ema.update(self.actor.policy)
        self.state.step += 1
        last = self.state.step >= self.config.steps or not self.tokens_left_for_step()
        if last or self.state.step % self.config.checkpoint_every == 0:
            with self.phase("checkpoint"):
                self.save()

    def save(self) -> Path:
        """Checkpoint the run as it is now."""
        extra = {"optimizer": self.optimizer.state_dict(),
                 "critic": self.actor.critic_state() if self.actor.has_critic else None,
                 "generator": self.generator.get_state(),
                 "ema": None if self.ema is None else self.ema.weights}
        path = ckpt.save_checkpoint(self.run_dir, self.state, self.actor.policy, self.tokenizer,
                                    extra, files={CONVERSATION_FILE: self._conversation(),
                                                  ROLLOUT_FILE: rollout_json(self.config.rollout)})
        ckpt.prune_checkpoints(self.run_dir, self.config.keep_checkpoints)
        return path

    def _conversation(self) -> str:
        rollout = self.config.rollout
        return conversation_json(tool_schemas_in_prompt=rollout.show_tool_schemas,
                                 system_prompt=rollout.system_prompt,
                                 constrain_edits=rollout.constrain_edits,
                                 constrain_calls=rollout.constrain_calls)

    def final_checkpoint(self) -> Path:
        """The checkpoint of the last completed step, written now if it is not there yet."""
        latest = ckpt.latest_checkpoint(self.run_dir)
        if latest is None or not latest.name.endswith(f"{self.state.step:06d}"):
            latest = self.save()
        return latest

    def save_policy(self, directory: Path) -> Path:
        """The policy's current weights and tokenizer as a loadable directory (no trainer
        state: not a checkpoint to resume from)."""
        policy: Any = self.actor.policy  # a transformers model
        policy.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        rollout = self.config.rollout
        write_conversation(directory, tool_schemas_in_prompt=rollout.show_tool_schemas,
                           system_prompt=rollout.system_prompt,
                           constrain_edits=rollout.constrain_edits,
                           constrain_calls=rollout.constrain_calls)
        write_rollout(directory, rollout)
        return directory

    # -- the weight average (update.ema_decay) -------------------------------------------------

    def start_weight_average(self) -> None:
        """Start the average at the weights RL starts from, unless a checkpoint brought one."""
        decay = self.config.update.ema_decay
        if decay is None or self.ema is not None:
            return
        if self.state.step:
            self.log(f"update.ema_decay: checkpoint step {self.state.step} has no weight "
                     "average (the run was started without one); it starts here")
        self.ema = WeightAverage.start(self.actor.policy, decay)

    def time_left_for_step(self) -> bool:
        """Whether another step and the final evaluation fit in ``max_seconds``."""
        budget = self.config.max_seconds
        if budget is None:
            return True
        used = time.perf_counter() - self.started
        per_step = self.step_seconds / self.steps_here if self.steps_here else 0.0
        # The final evaluation has the first one's budget and tasks, but a trained policy often
        # uses more of it (more turns, test runs): allow half as much again, times the growth
        # of the attempts (the latest step's turns against the first evaluation's). With 12
        # turns the demo's attempts grew from 3.9 to 6-7 turns and the final evaluation took
        # 2.6 times the first; the fixed 1.5 ran the demo 33 s past its budget.
        growth = 1.0
        if self.before_turns > 0 and self.recent_turns > 0:
            growth = max(growth, self.recent_turns / self.before_turns)
        final_eval = 1.5 * growth * self.timings.get("evaluate_before", 0.0)
        return used + per_step + final_eval < budget

    def tokens_left_for_step(self) -> bool:
        """Whether another step brings the generated tokens nearer to ``max_generated_tokens``
        than stopping now: steps are whole, so the run ends at the boundary nearest to the
        budget (judged by the mean tokens per step so far, which are in the resumable state)."""
        budget = self.config.max_generated_tokens
        if budget is None:
            return True
        generated = self.state.totals.get("generated_tokens", 0.0)
        per_step = generated / self.state.step if self.state.step else 0.0
        return generated + per_step / 2 < budget

    # -- evaluate -------------------------------------------------------------------------------

    def evaluate(self, label: str, policy: str = "last checkpoint",
                 steps: int | None = None) -> dict[str, Any]:
        """Held-out success of the policy as it is now (:func:`tracerl.train.heldout.evaluate`)."""
        return heldout.evaluate(self, label, policy, steps)

    def close(self) -> None:
        """Seal the trace store and close the metrics files (rank 0 holds them)."""
        if self.lead:
            self.store.close()
            self.metrics.close()


def _strip(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {k.removeprefix(prefix): v for k, v in metrics.items() if math.isfinite(v)}
