"""``tracerl eval`` of a multi-agent run: joint success of the run's saved policies.

A joint run (a ``tracerl train`` run with a ``multiagent`` section) writes ``config.yaml`` and
one ``policy/NAME`` per policy. :func:`evaluate_joint_run` loads them into the run's own
set-up (its environment, agents and conversation format) and runs the evaluation its summary
ran (``JointTrainer.evaluate``): ``samples`` sampled joint attempts per held-out task, with a
95% bootstrap interval that resamples whole tasks, and one greedy joint attempt per task. With
the run's seed and ``eval.samples_per_task`` it reproduces the summary's numbers after RL.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tracerl.rollout import HFPolicy
from tracerl.rollout.collect.joint import JointAttempt
from tracerl.trace import TraceStore
from tracerl.train.config import load_config
from tracerl.train.joint import JointTrainer, joint_metrics


def joint_run_dir(path: str | Path) -> Path | None:
    """The joint run that ``path`` names (the run directory, or its ``policy`` directory),
    or None when ``path`` is not a joint run's; ValueError for one agent's policy inside a
    joint run (which cannot be evaluated without the others)."""
    directory = Path(path)
    for run_dir in (directory, directory.parent):
        if _is_joint(run_dir) and (run_dir == directory or directory.name == "policy"):
            return run_dir
    if directory.parent.name == "policy" and _is_joint(directory.parent.parent):
        raise ValueError(f"--policy {str(directory)!r}: is one policy of the joint run "
                         f"{str(directory.parent.parent)!r}; give the run directory (its "
                         "agents are evaluated together)")
    return None


def _is_joint(run_dir: Path) -> bool:
    config = run_dir / "config.yaml"
    if not config.is_file():
        return False
    import yaml

    try:
        data = yaml.safe_load(config.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return False
    multi = data.get("multiagent") if isinstance(data, dict) else None
    return isinstance(multi, dict) and multi.get("env", "none") != "none"


def load_joint_run(run_dir: str | Path, overrides: Mapping[str, Any] | None = None
                   ) -> JointTrainer:
    """The run's set-up with its saved policies: ``JointTrainer`` on the run's
    ``config.yaml`` (``overrides``: dotted keys on top), each policy replaced by
    ``policy/NAME`` (weights and tokenizer), stamped with the run's last policy version."""
    import json

    from tracerl.models.tiny import load_tiny

    directory = Path(run_dir)
    pairs = [f"run_dir={directory}", *(f"{k}={v}" for k, v in (overrides or {}).items())]
    trainer = JointTrainer(load_config(directory / "config.yaml", pairs))
    summary_path = directory / "summary.json"
    version = 0
    if summary_path.is_file():
        version = int(json.loads(summary_path.read_text(encoding="utf-8")).get("steps", 0))
    for name, policy in trainer.policies.items():
        saved = directory / "policy" / name
        if not (saved / "config.json").is_file():
            raise ValueError(f"--policy {str(directory)!r}: holds no policy/{name} (a joint "
                             "run writes one per policy when it ends)")
        model, tokenizer = load_tiny(saved)
        policy.sampler = HFPolicy(model, tokenizer, max_batch_size=256)
        policy.sampler.policy_version = version
    return trainer


def evaluate_joint_run(run_dir: str | Path, *, samples: int, temperature: float | None = None,
                       seed: int | None = None, max_turns: int | None = None,
                       max_turn_tokens: int | None = None, tasks_file: str | None = None,
                       store_dir: str | None = None) -> dict[str, Any]:
    """Joint success of the run's saved policies on its held-out tasks (for the coding pair,
    or the tasks of ``tasks_file``): ``samples`` joint attempts per task at ``temperature``
    (default the run's), seeded by ``seed`` (default the run's), with the run's turn and
    token limits unless given; the sampled joint attempts are kept in ``store_dir``."""
    if samples < 1:
        raise ValueError(f"--samples: must be >= 1, got {samples}")
    overrides: dict[str, Any] = {}
    if max_turns is not None:
        if max_turns < 1:
            raise ValueError(f"--max-turns: must be >= 1, got {max_turns}")
        overrides["multiagent.max_turns"] = max_turns
    if max_turn_tokens is not None:
        if max_turn_tokens < 1:
            raise ValueError(f"--max-turn-tokens: must be >= 1, got {max_turn_tokens}")
        overrides["rollout.max_turn_tokens"] = max_turn_tokens
    if temperature is not None and temperature < 0:
        raise ValueError(f"--temperature: must be >= 0, got {temperature}")
    trainer = load_joint_run(run_dir, overrides)
    config = trainer.config
    task_ids = _task_file(trainer, tasks_file) if tasks_file is not None else None
    sampled: list[JointAttempt] = []
    result = trainer.evaluate(samples=samples, temperature=temperature, seed=seed,
                              task_ids=task_ids, keep=sampled)
    tasks = list(trainer.heldout_ids if task_ids is None else task_ids)
    per_task = result.pop("per_task")
    step = joint_metrics(sampled)
    result.update({
        "run_dir": str(run_dir), "multiagent": {"env": config.multiagent.env,
                                                "weights": config.multiagent.weights,
                                                "critic": config.multiagent.critic},
        "policies": {name: {"agents": list(p.agents), "version": p.sampler.policy_version}
                     for name, p in trainer.policies.items()},
        "tasks": len(tasks), "attempts": len(sampled),
        "per_task": {t: {"attempts": len(s), "successes": sum(s)}
                     for t, s in zip(tasks, per_task, strict=True)},
        "by_ending": step["endings"], "actions": step["actions"],
        "generated_tokens": {agent: float(sum(j.attempts[agent].costs.generated_tokens
                                              for j in sampled)) for agent in trainer.agents},
        "settings": {"samples": samples,
                     "temperature": config.rollout.temperature if temperature is None
                     else temperature,
                     "seed": config.seed if seed is None else seed,
                     "max_turns": config.multiagent.max_turns,
                     "max_turn_tokens": config.rollout.max_turn_tokens},
        "tasks_file": tasks_file,
    })
    if store_dir is not None:
        store = TraceStore(store_dir)
        try:
            store.append_many([a for j in sampled for a in j.attempts.values()])
        finally:
            store.close()
    return result


def _task_file(trainer: JointTrainer, path: str) -> list[str]:
    """Point the coding pair's environment at the tasks of ``path``; their ids."""
    if trainer.config.multiagent.env != "coding_pair":
        raise ValueError(f"--tasks: the {trainer.config.multiagent.env} game's rounds come "
                         "from the run's config; leave --tasks out")
    from tracerl.envs import Sandbox
    from tracerl.envs.pair import CodingPairEnv
    from tracerl.envs.tasks import load_tasks

    if not Path(path).is_file():
        raise ValueError(f"--tasks {path!r}: no such file")
    tasks = load_tasks(path)
    if not tasks:
        raise ValueError(f"--tasks {path!r}: holds no task")
    sandbox, turns = Sandbox(), trainer.config.multiagent.max_turns
    trainer.make_env = lambda: CodingPairEnv(tasks, sandbox=sandbox, max_turns=turns)
    return [t.id for t in tasks]


def format_joint_result(result: Mapping[str, Any]) -> str:
    """The terminal's lines for a joint evaluation."""
    low, high = result["ci95"]
    settings = result["settings"]
    lines = [
        f"joint run {result['run_dir']} ({result['multiagent']['env']}, "
        f"{result['multiagent']['weights']} weights, critic {result['multiagent']['critic']})",
        f"  joint success {result['success']:.3f}  95% CI [{low:.3f}, {high:.3f}]  "
        f"({result['attempts']} joint attempts, {result['tasks']} tasks, "
        f"temperature {settings['temperature']:g}, seed {settings['seed']})",
        f"  greedy joint success {result['greedy']:.3f}",
        "  endings: " + ", ".join(f"{k} {int(v)}" for k, v in sorted(result["by_ending"].items())),
    ]
    for agent, tokens in result["generated_tokens"].items():
        lines.append(f"  {agent}: {result['actions'].get(agent, 0.0):.2f} actions per joint "
                     f"attempt, {int(tokens)} generated tokens")
    return "\n".join(lines)
