"""Training several agents in one task: ``tracerl train`` with a ``multiagent`` section.

Each step collects ``rollout.group_size`` joint attempts at each of ``rollout.tasks_per_step``
tasks (:mod:`tracerl.rollout.collect.joint`), stores every agent's record, and updates each
policy on its own agents' records only:

- ``multiagent.weights: separate``: one policy per agent (independent learners); agent A's
  batch holds only A's attempts, so its loss and gradient hold only A's action tokens (B's
  messages are observations in A's context, never in its action mask);
- ``shared``: one policy for all agents, each agent named in its instruction; the batch holds
  every agent's attempts, each with its own action tokens and its own group;
- advantages: group-relative over the joint attempts at the same task (``algorithm.estimator``
  ``grpo`` or ``rloo``; each agent's group is its attempts in those joint attempts), or with
  ``multiagent.critic: centralized`` the acting agent's reward minus a critic's value of the
  joint context (:mod:`tracerl.train.joint_critic`).

The update itself is the single-agent one (``pack``, ``freeze_old``, ``ppo_update``). Each step
also records the *nonstationarity* each agent faced: how far every policy moved on its own
actions of the step (the mean over its action tokens of the k3 estimate of KL(old || new),
computed from the logprobs before and after the update), and for each agent the sum over the
other agents: how much the rest of its environment changed.

The run directory holds ``config.yaml``, ``metrics.jsonl``, the trace store, ``policy/NAME``
for each policy and ``summary.json`` (joint success before and after on held-out tasks with
95% intervals, as ``tracerl compare`` reads it).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tracerl.envs import Sandbox
from tracerl.envs.multi import MultiAgentEnv
from tracerl.envs.pair import FIXER, POWERS, CodingPairEnv
from tracerl.envs.referential import ReferentialGame, referential_tasks, split_tasks
from tracerl.eval.stats import bootstrap_ci
from tracerl.models.tiny import (
    TinyModelConfig,
    build_tiny_model,
    render_tool_call,
    train_tokenizer,
)
from tracerl.models.words import WORDS
from tracerl.rollout import HFPolicy
from tracerl.rollout.collect.chat_tokens import ChatTokens
from tracerl.rollout.collect.joint import AgentPolicy, JointAttempt, JointCollector, JointConfig
from tracerl.rollout.policies.sampling import SamplingParams
from tracerl.trace import Attempt, TraceStore, pack
from tracerl.train.algorithms import AdvantageInputs, compute_advantages
from tracerl.train.config import CriticConfig, TrainConfig, dump_config
from tracerl.train.joint_config import validate_multiagent
from tracerl.train.joint_critic import (
    CentralizedCritic,
    advantages_on_rows,
    centralized_advantages,
)
from tracerl.train.metrics import MetricsWriter
from tracerl.train.setup import run_tasks
from tracerl.train.update import ActorCritic, RowBatch, freeze_old, make_adamw, ppo_update

SHARED = "shared"
"""The policy's name when every agent shares one."""


@dataclasses.dataclass
class _Policy:
    name: str
    actor: ActorCritic
    sampler: HFPolicy
    optimizer: torch.optim.Optimizer
    agents: tuple[str, ...]


class JointTrainer:
    """One multi-agent run of :class:`TrainConfig` (see the module docstring)."""

    def __init__(self, config: TrainConfig, *, log: Callable[[str], None] | None = None,
                 between_rounds: Callable[[int], None] | None = None) -> None:
        if config.multiagent.env == "none":
            raise ValueError("multiagent.env: 'none' is a single-agent run (use Trainer)")
        validate_multiagent(config)
        self.config = config
        self.log = log or (lambda message: None)
        self.between_rounds = between_rounds
        self.run_dir = Path(config.run_dir)
        self.policy_version = 0
        self.setup()

    # -- set-up -----------------------------------------------------------------------------

    def setup(self) -> None:
        """Tasks, tokenizer, one policy per agent (or one shared), collector, store."""
        config, multi = self.config, self.config.multiagent
        torch.manual_seed(config.seed)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.make_env: Callable[[], MultiAgentEnv]
        self.corpus: list[str]
        self.words: list[str]
        if multi.env == "coding_pair":
            self._pair_tasks()
        else:
            items, symbols = multi.items.split(), multi.symbols.split()
            tasks = referential_tasks(items, multi.candidates)
            train, heldout = split_tasks(tasks, multi.heldout_fraction, config.seed)
            self.train_ids = [t.id for t in train]
            self.heldout_ids = [t.id for t in heldout] or self.train_ids
            self.agents = ReferentialGame.agents
            self.make_env = lambda: ReferentialGame(tasks, symbols)
            self.corpus = [text for t in tasks[:8] for text in
                           ReferentialGame(tasks, symbols).reset(
                               options={"task_id": t.id}).observations.values()]
            self.words = [*items, *symbols, *self.agents, "heard"]
        self.tokenizer = train_tokenizer(self.corpus, vocab_size=config.model.vocab_size,
                                         words=self.words)
        m = config.model
        self.shape = TinyModelConfig(hidden_size=m.hidden_size, num_layers=m.num_layers,
                                     num_heads=m.num_heads, intermediate_size=m.intermediate_size,
                                     max_positions=m.max_positions,
                                     initializer_range=m.initializer_range)
        groups = ({SHARED: self.agents} if multi.weights == "shared"
                  else {agent: (agent,) for agent in self.agents})
        self.policies: dict[str, _Policy] = {}
        for i, (name, agents) in enumerate(groups.items()):
            model = build_tiny_model(self.tokenizer, self.shape, seed=config.seed + i)
            actor = ActorCritic(model, CriticConfig(), config.rollout.temperature)
            optimizer = make_adamw([{"params": actor.policy_parameters(),
                                     "lr": config.update.lr}], config.update.weight_decay)
            sampler = HFPolicy(model, self.tokenizer, max_batch_size=256)
            self.policies[name] = _Policy(name, actor, sampler, optimizer, agents)
        self.agent_policy = {a: p.name for p in self.policies.values() for a in p.agents}
        self.critic: CentralizedCritic | None = None
        if multi.critic == "centralized":
            self.critic = CentralizedCritic(self.tokenizer, self.shape, seed=config.seed + 99)
            self.critic_optimizer = make_adamw([{"params": self.critic.parameters(),
                                                 "lr": multi.critic_lr}], 0.0)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.totals = {"generated_tokens": 0.0, "joint_attempts": 0.0}

    def _pair_tasks(self) -> None:
        """The coding pair on the run's tasks (``tasks.*``, as a single-agent run loads
        them), one sandbox for all joint attempts."""
        train, heldout = run_tasks(self.config)
        sandbox = Sandbox()
        everything = [*train, *heldout]
        turns = self.config.multiagent.max_turns
        self.agents = CodingPairEnv.agents
        self.train_ids, self.heldout_ids = [t.id for t in train], [t.id for t in heldout]
        self.make_env = lambda: CodingPairEnv(everything, sandbox=sandbox, max_turns=turns)
        statements = [CodingPairEnv(everything[:1], sandbox=sandbox).reset().observations]
        self.corpus = [*(text for s in statements for text in s.values()),
                       *(content for t in train for content in t.files.values()),
                       *(render_tool_call(name, {}) for name in sorted(POWERS[FIXER]))]
        self.words = list(WORDS)

    def collector(self, temperature: float) -> JointCollector:
        """A joint collector over this run's policies at ``temperature``."""
        rollout = self.config.rollout
        sampling = SamplingParams(temperature=temperature, max_new_tokens=rollout.max_turn_tokens)
        entries = [AgentPolicy(p.name, p.sampler, ChatTokens(p.sampler, tools=None,
                                                             observation_role="user"))
                   for p in self.policies.values()]
        config = JointConfig(sampling, max_turns=self.config.multiagent.max_turns,
                             name_agent=self.config.multiagent.weights == "shared")
        return JointCollector(entries, self.agent_policy, self.make_env, config)

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Evaluate, train ``steps`` steps (or up to ``max_generated_tokens``), evaluate."""
        started = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.config), encoding="utf-8")
        store = TraceStore(self.run_dir / "traces", fsync=False)
        metrics = MetricsWriter(self.run_dir, tensorboard=False)
        before = self.evaluate()
        self.log(f"before: joint success {before['success']:.3f}")
        steps = 0
        budget = self.config.max_generated_tokens
        try:
            while steps < self.config.steps and (
                    budget is None or self.totals["generated_tokens"] < budget):
                joints = self.collect(steps)
                store.append_many([a for j in joints for a in j.attempts.values()])
                record = self.train_step(joints)
                metrics.write(steps, record)
                self.log(f"step {steps}: joint success {record['joint']['success']:.3f}")
                steps += 1
        finally:
            store.close()
            metrics.close()
        after = self.evaluate()
        self.log(f"after: joint success {after['success']:.3f}")
        for policy in self.policies.values():
            directory = self.run_dir / "policy" / policy.name
            policy.actor.policy.save_pretrained(directory)  # type: ignore[operator]
            self.tokenizer.save_pretrained(directory)
        summary = {
            "multiagent": dataclasses.asdict(self.config.multiagent), "steps": steps,
            "heldout_success_before": before["success"], "heldout_ci95_before": before["ci95"],
            "heldout_success_after": after["success"], "heldout_ci95_after": after["ci95"],
            "heldout_greedy_before": before["greedy"], "heldout_greedy_after": after["greedy"],
            "generated_tokens": self.totals["generated_tokens"],
            "joint_attempts": self.totals["joint_attempts"],
            "wall_seconds": time.perf_counter() - started,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1),
                                                   encoding="utf-8")
        return summary

    def collect(self, step: int) -> list[JointAttempt]:
        """This step's joint attempts: ``group_size`` at each of the step's tasks."""
        rollout = self.config.rollout
        rng = random.Random(f"{self.config.seed}:{step}")
        count = min(rollout.tasks_per_step, len(self.train_ids))
        tasks = rng.sample(self.train_ids, count)
        joints = self.collector(rollout.temperature).collect(
            tasks, rollout.group_size, seed=self.config.seed * 100_003 + step, step=step,
            between_rounds=self.between_rounds)
        self.totals["generated_tokens"] += sum(a.costs.generated_tokens for j in joints
                                               for a in j.attempts.values())
        self.totals["joint_attempts"] += len(joints)
        return joints

    def train_step(self, joints: Sequence[JointAttempt]) -> dict[str, Any]:
        """Update every policy on its own agents' attempts; the step's metrics."""
        per_turn: dict[tuple[str, str, int], float] | None = None
        record: dict[str, Any] = {"joint": joint_metrics(joints)}
        if self.critic is not None:
            per_turn, record["critic"] = centralized_advantages(
                self.critic, self.critic_optimizer, joints, self.pad_id)
        shift: dict[str, float] = {}
        for policy in self.policies.values():
            attempts = self.policy_attempts(joints, policy.name)
            result = self.update_policy(policy, attempts, per_turn)
            record[f"update/{policy.name}"] = result["update"]
            shift.update(result["shift"])
        record["nonstationarity"] = {
            "policy_shift": shift,
            "others_shift": {a: sum(v for b, v in shift.items() if b != a) for a in shift}}
        self.policy_version += 1
        for policy in self.policies.values():
            policy.sampler.policy_version = self.policy_version
        record["policy_version"] = self.policy_version
        record["costs"] = {"generated_tokens": sum(a.costs.generated_tokens for j in joints
                                                   for a in j.attempts.values())}
        return record

    def policy_attempts(self, joints: Sequence[JointAttempt], name: str) -> list[Attempt]:
        """The attempts policy ``name`` learns from: its own agents' records, each agent's
        joint attempts at a task forming that agent's group. An agent that never acted in a
        joint attempt (the others ended it first) made no decision there: its record is kept
        in the store and left out of its group."""
        agents = self.policies[name].agents
        out = []
        for joint in joints:
            for agent in agents:
                attempt = joint.attempts[agent]
                if attempt.costs.turns == 0:
                    continue
                if len(agents) > 1:
                    attempt = dataclasses.replace(attempt, group_id=f"{attempt.group_id}/{agent}")
                out.append(attempt)
        return out

    def update_policy(self, policy: _Policy, attempts: Sequence[Attempt],
                      per_turn: dict[tuple[str, str, int], float] | None) -> dict[str, Any]:
        """One PPO update of ``policy`` on ``attempts``; its metrics and how far it moved on
        each agent's actions."""
        update = self.config.update
        batch = pack(attempts, has_critic=False, pad_token_id=self.pad_id,
                     min_group_size=1 if per_turn is not None else 2)
        if not bool(batch.action_mask.any()):
            return {"update": {"skipped": 1.0}, "shift": {}}
        rows = RowBatch(batch.input_ids, batch.attention_mask, batch.action_mask,
                        torch.zeros(batch.action_mask.shape), batch.behavior_logprobs,
                        batch.task_index)
        rows = freeze_old(policy.actor, rows, update.micro_batch_rows)
        if per_turn is None:
            advantages = compute_advantages(AdvantageInputs(batch, batch.token_rewards),
                                            self.config.algorithm).advantages
        else:
            by_id = {a.attempt_id: a for a in attempts}
            advantages = advantages_on_rows(
                batch, per_turn,
                {i: str(by_id[i].metadata["joint"]["id"]) for i in batch.attempt_ids},
                {i: str(by_id[i].metadata["agent"]) for i in batch.attempt_ids})
        if update.entropy_coef == 0 and not bool((advantages * batch.action_mask).any()):
            # Nothing to learn from (every group uniform), as the single-agent trainer skips
            # it: an optimizer step on zero gradients would still move the weights (Adam's
            # momentum), with no advantage to pull them back.
            return {"update": {"skipped": 1.0}, "shift": {a: 0.0 for a in policy.agents}}
        rows = dataclasses.replace(rows, advantages=advantages)
        metrics = ppo_update(policy.actor, policy.optimizer, rows, batch.attempt_index, update,
                             CriticConfig(), self.generator)
        after = freeze_old(policy.actor, rows, update.micro_batch_rows)
        assert rows.old_logprobs is not None and after.old_logprobs is not None
        # k3 estimate of KL(old || new) on the tokens the old policy sampled: never negative.
        log_ratio = (after.old_logprobs - rows.old_logprobs).clamp(-20.0, 20.0)
        moved = (log_ratio.exp() - 1.0 - log_ratio) * batch.action_mask.float()
        agent_of = {a.attempt_id: str(a.metadata["agent"]) for a in attempts}
        agent_of_row = [agent_of[batch.attempt_ids[int(i)]] for i in batch.attempt_index]
        shift = {}
        for agent in policy.agents:
            mine = torch.tensor([a == agent for a in agent_of_row])
            tokens = batch.action_mask[mine].sum()
            shift[agent] = float(moved[mine].sum() / tokens) if tokens else 0.0
        return {"update": {k.replace("/", "_"): v for k, v in metrics.items()}, "shift": shift}

    # -- evaluation -------------------------------------------------------------------------

    def evaluate(self, *, samples: int | None = None, temperature: float | None = None,
                 seed: int | None = None, task_ids: Sequence[str] | None = None,
                 keep: list[JointAttempt] | None = None) -> dict[str, Any]:
        """Joint success on the held-out tasks (or ``task_ids``): ``samples`` sampled joint
        attempts per task (default ``eval.samples_per_task``, at ``temperature``, default
        ``rollout.temperature``), with a 95% task-level bootstrap interval, and one greedy.
        ``seed`` (default the run's) seeds sampling and the bootstrap; the sampled joint
        attempts are appended to ``keep`` when given."""
        seed = self.config.seed if seed is None else seed
        tasks = list(self.heldout_ids if task_ids is None else task_ids)
        temperature = self.config.rollout.temperature if temperature is None else temperature
        sampled = self._joints(tasks, temperature, samples or self.config.eval.samples_per_task,
                               seed)
        if keep is not None:
            keep.extend(sampled)
        per_task = _by_task(sampled, tasks)
        greedy = _by_task(self._joints(tasks, 0.0, 1, seed), tasks)
        flat = [s for scores in per_task for s in scores]
        return {"success": sum(flat) / len(flat),
                "ci95": list(bootstrap_ci(per_task, seed=seed)),
                "greedy": sum(s for scores in greedy for s in scores) / len(greedy),
                "per_task": per_task}

    def _joints(self, tasks: Sequence[str], temperature: float, samples: int,
                seed: int) -> list[JointAttempt]:
        return self.collector(temperature).collect(tasks, samples, seed=seed + 7, step=-1)


def _by_task(joints: Sequence[JointAttempt], tasks: Sequence[str]) -> list[list[float]]:
    """Each task's joint successes, in ``tasks`` order."""
    by_task: dict[str, list[float]] = {t: [] for t in tasks}
    for joint in joints:
        by_task[joint.task_id].append(joint_success(joint))
    return [by_task[t] for t in tasks]


def joint_success(joint: JointAttempt) -> float:
    """1.0 when every agent's reward is at least 1 (a shared reward of 1: the joint task
    solved), else 0.0; a joint attempt without rewards (a tool error) counts 0."""
    rewards = list(joint.rewards.values())
    return float(all(r is not None and r >= 1.0 for r in rewards))


def joint_metrics(joints: Sequence[JointAttempt]) -> dict[str, Any]:
    """Success, endings and actions per agent of a step's joint attempts."""
    endings: dict[str, float] = {}
    for joint in joints:
        endings[joint.end.value] = endings.get(joint.end.value, 0.0) + 1.0
    agents = list(joints[0].attempts) if joints else []
    return {"success": sum(joint_success(j) for j in joints) / max(len(joints), 1),
            "attempts": float(len(joints)), "endings": endings,
            "actions": {a: sum(j.attempts[a].costs.turns for j in joints) / max(len(joints), 1)
                        for a in agents}}
