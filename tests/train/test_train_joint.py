"""Training several agents: each policy learns from its own agents' action tokens only, the
centralized critic reads the joint context while the actors do not, and the game is learned."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tracerl.cli import main as run
from tracerl.envs.multi import MultiStep
from tracerl.envs.referential import LISTENER, SPEAKER, ReferentialGame
from tracerl.eval.compare import compare_runs, format_table
from tracerl.rollout.collect.joint import JointAttempt
from tracerl.trace import Role, pack, read_attempts
from tracerl.train import joint as joint_module
from tracerl.train.config import TrainConfig, config_from_dict, load_config
from tracerl.train.joint import JointTrainer
from tracerl.train.joint_critic import joint_sequence
from tracerl.train.joint_eval import load_joint_run

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _config(tmp_path: Path, **multi: Any) -> TrainConfig:
    return config_from_dict({
        "run_dir": str(tmp_path / "run"), "seed": 0, "steps": 1, "threads": 2,
        "model": {"vocab_size": 300, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
                  "intermediate_size": 32, "max_positions": 128},
        "rollout": {"tasks_per_step": 4, "group_size": 4, "max_turn_tokens": 4},
        "update": {"lr": 1e-2},
        "eval": {"samples_per_task": 2},
        "multiagent": {"env": "referential", "items": "red blue", "symbols": "ka ki",
                       "heldout_fraction": 0.0, **multi},
    })


def _own_tokens(joint: JointAttempt, agent: str) -> list[int]:
    return [int(t) for turn in joint.attempts[agent].fragments[0].turns
            for s in turn.segments for t in s.token_ids]


def test_an_agents_update_never_includes_another_agents_tokens(tmp_path: Path) -> None:
    first = JointTrainer(_config(tmp_path))
    joints = first.collect(0)
    attempts = first.policy_attempts(joints, SPEAKER)
    assert {a.metadata["agent"] for a in attempts} == {SPEAKER}
    batch = pack(attempts, has_critic=False, pad_token_id=first.pad_id)
    own_actions = sum(len(s.token_ids) for a in attempts for turn in a.fragments[0].turns
                      for s in turn.segments if s.role is Role.ACTION)
    assert int(batch.action_mask.sum()) == own_actions

    def altered(joint: JointAttempt) -> JointAttempt:
        """The listener's record with other actions, logprobs and reward."""
        listener = joint.attempts[LISTENER]
        turns = []
        for turn in listener.fragments[0].turns:
            segments = tuple(dataclasses.replace(s, token_ids=s.token_ids[::-1].copy(),
                                                 logprobs=s.logprobs * 0 - 0.5)
                             if s.role is Role.ACTION else s for s in turn.segments)
            turns.append(dataclasses.replace(turn, segments=segments))
        fragment = dataclasses.replace(listener.fragments[0], turns=tuple(turns))
        listener = dataclasses.replace(listener, fragments=(fragment,),
                                       reward=1.0 - (listener.reward or 0.0))
        return dataclasses.replace(joint, attempts={**joint.attempts, LISTENER: listener})

    def speaker_after(trainer: JointTrainer, joints: list[JointAttempt]) -> dict[str, Any]:
        policy = trainer.policies[SPEAKER]
        trainer.update_policy(policy, trainer.policy_attempts(joints, SPEAKER), None)
        return {k: v.clone() for k, v in policy.actor.policy.state_dict().items()}

    second = JointTrainer(_config(tmp_path))
    changed = [altered(j) for j in joints]
    before = {k: v.clone() for k, v in first.policies[SPEAKER].actor.policy.state_dict().items()}
    a, b = speaker_after(first, joints), speaker_after(second, changed)
    assert all(torch.equal(a[k], b[k]) for k in a)  # B's tokens and reward: no effect on A
    assert any(not torch.equal(a[k], before[k]) for k in a)  # and the update did something


def test_a_step_with_nothing_to_learn_from_leaves_the_weights_alone(tmp_path: Path) -> None:
    """Every group uniform (each joint attempt at a round scored alike): no update, as in the
    single-agent trainer. An optimizer step on zero gradients would still move the weights by
    Adam's momentum from the steps before, with no advantage to pull them back."""
    trainer = JointTrainer(_config(tmp_path))
    trainer.train_step(trainer.collect(0))  # momentum from a step with something to learn
    policy = trainer.policies[SPEAKER]
    attempts = [dataclasses.replace(a, reward=1.0)
                for a in trainer.policy_attempts(trainer.collect(1), SPEAKER)]
    before = {k: v.clone() for k, v in policy.actor.policy.state_dict().items()}
    result = trainer.update_policy(policy, attempts, None)
    assert result["update"] == {"skipped": 1.0} and result["shift"] == {SPEAKER: 0.0}
    after = policy.actor.policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_centralized_critic_reads_the_joint_context_and_the_actors_do_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = JointTrainer(_config(tmp_path, critic="centralized"))
    actor_inputs: list[torch.Tensor] = []
    real_update = joint_module.ppo_update

    def spy(model: Any, optimizer: Any, rows: Any, *args: Any, **kwargs: Any) -> Any:
        actor_inputs.append(rows.input_ids[rows.attention_mask.bool()])
        return real_update(model, optimizer, rows, *args, **kwargs)

    monkeypatch.setattr(joint_module, "ppo_update", spy)
    joints = trainer.collect(0)
    record = trainer.train_step(joints)
    assert trainer.critic is not None and "value_loss" in record["critic"]
    for joint, seen in zip(joints, trainer.critic.inputs, strict=True):
        expected = joint_sequence(joint).token_ids
        assert seen.tolist() == list(expected)
        speaker, listener = _own_tokens(joint, SPEAKER), _own_tokens(joint, LISTENER)
        assert seen.tolist() == speaker + listener  # the speaker acts first: its turn, then the
        # listener's: the critic holds both contexts
    speaker_rows, listener_rows = actor_inputs  # separate weights: one update per agent
    assert speaker_rows.tolist() == [t for j in joints for t in _own_tokens(j, SPEAKER)]
    assert listener_rows.tolist() == [t for j in joints for t in _own_tokens(j, LISTENER)]


def test_a_shared_policy_learns_from_every_agents_tokens_in_separate_groups(
        tmp_path: Path) -> None:
    trainer = JointTrainer(_config(tmp_path, weights="shared"))
    assert set(trainer.policies) == {"shared"}
    joints = trainer.collect(0)
    attempts = trainer.policy_attempts(joints, "shared")
    groups = {a.group_id for a in attempts}
    assert all(g.endswith((f"/{SPEAKER}", f"/{LISTENER}")) for g in groups)
    record = trainer.train_step(joints)
    assert set(record["nonstationarity"]["policy_shift"]) == {SPEAKER, LISTENER}


def test_the_referential_recipe_runs_through_tracerl_train(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "referential.yaml")
    assert config.multiagent.env == "referential"
    overrides = [f"run_dir={tmp_path / 'run'}", "steps=1", "eval.samples_per_task=1",
                 "rollout.tasks_per_step=2", "rollout.group_size=2"]
    assert run(["train", str(CONFIGS / "referential.yaml"), *overrides]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["generated_tokens"] > 0
    metrics = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert set(metrics[0]["nonstationarity"]["others_shift"]) == {SPEAKER, LISTENER}
    assert (tmp_path / "run" / "policy" / SPEAKER / "config.json").is_file()
    (row,), _ = compare_runs([tmp_path / "run"])
    assert (row.estimator, row.critic) == ("grpo (separate weights)", "none")
    assert row.generated_tokens == summary["generated_tokens"] and row.success is not None
    shifts = metrics[0]["nonstationarity"]["others_shift"]  # one step: its mean over agents
    assert row.others_shift == pytest.approx(sum(shifts.values()) / 2) and row.others_shift > 0
    assert "others' shift/step" in format_table([row])


def test_tracerl_eval_of_a_joint_run_reproduces_its_summary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``tracerl eval --policy RUN`` evaluates the run's saved policies together, as the run's
    own evaluation after RL did: same joint success, interval and greedy success."""
    overrides = [f"run_dir={tmp_path / 'run'}", "steps=2", "eval.samples_per_task=4",
                 "rollout.group_size=4"]
    assert run(["train", str(CONFIGS / "referential.yaml"), *overrides]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    out = tmp_path / "eval.json"
    assert run(["eval", "--policy", str(tmp_path / "run"), "--samples", "4",
                "--store", str(tmp_path / "store"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["success"] == summary["heldout_success_after"]
    assert result["ci95"] == summary["heldout_ci95_after"]
    assert result["greedy"] == summary["heldout_greedy_after"]
    assert result["attempts"] == 4 * result["tasks"] == 8  # the two-item game: two rounds
    assert sum(t["successes"] for t in result["per_task"].values()) == 8 * result["success"]
    assert set(result["generated_tokens"]) == {SPEAKER, LISTENER}
    assert {p["version"] for p in result["policies"].values()} == {2}
    assert "joint success" in capsys.readouterr().out
    records = read_attempts(tmp_path / "store")
    assert len(records) == 16 and {r.metadata["agent"] for r in records} == {SPEAKER, LISTENER}
    assert {s.policy_version for r in records for t in r.fragments[0].turns
            for s in t.segments if s.role is Role.ACTION} == {2}
    # The policies evaluated are the saved ones, not the run's fresh initialisation.
    loaded = load_joint_run(tmp_path / "run")
    fresh = JointTrainer(load_config(tmp_path / "run" / "config.yaml"))
    for name, policy in loaded.policies.items():
        weights = policy.sampler.model.state_dict()
        initial = fresh.policies[name].actor.policy.state_dict()
        assert any(not torch.equal(weights[k], initial[k]) for k in initial)
    # The run's policy directory names the run too; one agent's policy alone does not.
    assert run(["eval", "--policy", str(tmp_path / "run" / "policy"), "--samples", "1"]) == 0
    capsys.readouterr()
    for argv, message in (([str(tmp_path / "run" / "policy" / SPEAKER)], "one policy of"),
                          ([str(tmp_path / "run"), "--top-p", "0.9"], "--top-p: not available"),
                          ([str(tmp_path / "run"), "--tasks", "x.jsonl"], "leave --tasks out")):
        assert run(["eval", "--policy", *argv, "--samples", "1"]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["referential", "coding_pair"])
def test_every_multiagent_recipe_leaves_room_for_a_turn(recipe: str, tmp_path: Path) -> None:
    config = load_config(CONFIGS / f"{recipe}.yaml", [f"run_dir={tmp_path / 'run'}"])
    trainer = JointTrainer(config)
    chat = trainer.collector(1.0).policies
    env = trainer.make_env()
    longest = 0
    for task_id in [*trainer.train_ids, *trainer.heldout_ids][:8]:
        start = env.reset(options={"task_id": task_id})
        for agent, text in start.observations.items():
            tokens = chat[trainer.agent_policy[agent]].chat.first_prompt(text)
            longest = max(longest, len(tokens))
    close = getattr(env, "close", None)
    if close is not None:
        close()
    assert longest > 0
    assert longest + config.rollout.max_turn_tokens <= config.model.max_positions


def test_bad_multiagent_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"algorithm\.estimator: 'gae' is not available"):
        JointTrainer(dataclasses.replace(
            _config(tmp_path), algorithm=dataclasses.replace(
                _config(tmp_path).algorithm, estimator="gae")))
    with pytest.raises(ValueError, match=r"multiagent\.env: got 'chess'"):
        config_from_dict({"multiagent": {"env": "chess"}})
    game = {"env": "referential"}
    for section, message in (({"sft": {"enabled": True}}, r"sft\.enabled: not available"),
                             ({"model": {"lora": {"rank": 4}}},
                              r"model\.lora\.rank: not available"),
                             ({"multiagent": {**game, "candidates": 1}}, "candidates: must be"),
                             ({"multiagent": {**game, "items": "red"}}, "at least two words"),
                             ({"rollout": {"group_size": 1}}, "compare joint attempts")):
        with pytest.raises(ValueError, match=message):
            config_from_dict({"multiagent": game, **section})


class _TellingSpeaker(ReferentialGame):
    """The game with a speaker whose word is fixed by the target (red: ka, blue: ki)."""

    def step(self, agent: str, action: str) -> MultiStep:
        if agent == SPEAKER and self.task is not None:
            action = "ka" if self.task.target == "red" else "ki"
        return super().step(agent, action)


def test_the_listener_learns_a_speakers_protocol_in_a_short_run(tmp_path: Path) -> None:
    """Through the joint trainer, the listener learns which word names which item: success
    rises from chance (0.5); with an update that did nothing it would stay there."""
    config = dataclasses.replace(_config(tmp_path), update=dataclasses.replace(
        _config(tmp_path).update, epochs=4, minibatches=2), rollout=dataclasses.replace(
        _config(tmp_path).rollout, group_size=8))
    trainer = JointTrainer(config)
    tasks = list(trainer.make_env().tasks.values())  # type: ignore[attr-defined]
    trainer.make_env = lambda: _TellingSpeaker(tasks, ("ka", "ki"))
    success = [trainer.train_step(trainer.collect(step))["joint"]["success"]
               for step in range(6)]
    assert success[0] <= 0.65
    assert sum(success[-2:]) / 2 >= 0.8, success


def test_both_agents_learn_the_game_from_scratch_in_a_short_run(tmp_path: Path) -> None:
    """The recipe's speaker and listener, both learning from their random initialisation,
    agree on a protocol: joint success rises from chance (0.5) to at least 0.9 within 40
    steps, and both policies moved; with an update that did nothing it would stay at chance."""
    config = load_config(CONFIGS / "referential.yaml", [f"run_dir={tmp_path / 'run'}"])
    trainer = JointTrainer(config)
    success, moved = [], set()
    for step in range(40):
        record = trainer.train_step(trainer.collect(step))
        success.append(record["joint"]["success"])
        moved |= {a for a, v in record["nonstationarity"]["policy_shift"].items() if v > 0}
    assert sum(success[:2]) / 2 <= 0.7, success
    assert moved == {SPEAKER, LISTENER}
    assert sum(success[-5:]) / 5 >= 0.9, success


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_coding_pair_runs_through_tracerl_train(tmp_path: Path) -> None:
    overrides = [f"run_dir={tmp_path / 'pair'}", "steps=1", "tasks.train_count=2",
                 "tasks.heldout_count=1", "rollout.tasks_per_step=2", "rollout.group_size=2",
                 "eval.samples_per_task=1", "multiagent.max_turns=4",
                 "rollout.max_turn_tokens=8", "model.hidden_size=16", "model.num_layers=1",
                 "model.intermediate_size=32"]
    assert run(["train", str(CONFIGS / "coding_pair.yaml"), *overrides]) == 0
    summary = json.loads((tmp_path / "pair" / "summary.json").read_text())
    assert summary["joint_attempts"] == 4 and summary["multiagent"]["env"] == "coding_pair"
    metrics = json.loads((tmp_path / "pair" / "metrics.jsonl").read_text().splitlines()[0])
    assert sum(metrics["joint"]["endings"].values()) == 4
    assert set(metrics["joint"]["actions"]) == {"tester", "fixer"}
    out = tmp_path / "eval.json"  # and through tracerl eval: the run's held-out task, together
    assert run(["eval", "--policy", str(tmp_path / "pair"), "--samples", "2",
                "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["tasks"], result["attempts"]) == (1, 2)
    assert result["multiagent"]["env"] == "coding_pair" and 0.0 <= result["success"] <= 1.0
    assert sum(result["by_ending"].values()) == 2
    tasks = tmp_path / "tasks.jsonl"  # or the pair on the tasks of a task file
    assert run(["tasks", "export", "--split", "heldout", "--count", "1", "--out", str(tasks)]) == 0
    assert run(["eval", "--policy", str(tmp_path / "pair"), "--samples", "1", "--tasks",
                str(tasks), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["tasks"], result["attempts"], result["tasks_file"]) == (1, 1, str(tasks))
