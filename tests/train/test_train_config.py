"""The config tree: strict loading, overrides, validation before compute, help text."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracerl.train.config import (
    TrainConfig,
    config_changes,
    config_from_dict,
    describe_config,
    dump_config,
    load_config,
    parse_override,
)

RECIPES = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads(path: Path) -> None:
    assert isinstance(load_config(path), TrainConfig)


def test_the_three_recipes_exist() -> None:
    assert {"demo.yaml", "grpo.yaml", "ppo_critic.yaml"} <= {p.name for p in RECIPES}
    ppo = load_config(RECIPES[[p.name for p in RECIPES].index("ppo_critic.yaml")])
    assert ppo.algorithm.estimator == "gae" and ppo.critic.kind != "none"
    assert ppo.rollout.compact_at_tokens is not None and ppo.update.loss_level == "token"


def test_overrides_are_typed() -> None:
    config = load_config(None, ["update.lr=3e-4", "rollout.group_size=4",
                                "algorithm.scale=none", "update.clip_high=null"])
    assert config.update.lr == 3e-4 and config.rollout.group_size == 4
    assert config.algorithm.scale == "none" and config.update.clip_high is None
    assert parse_override("max_seconds=10") == ("max_seconds", 10)


@pytest.mark.parametrize(("override", "message"), [
    ("update.lrr=1", "update.lrr: unknown key; UpdateConfig accepts"),
    ("nope=1", "nope: unknown key"),
    ("update.lr=fast", "update.lr: got 'fast' (str), accepts float"),
    ("steps=1.5", "steps: got 1.5 (float), accepts int"),
    ("tensorboard=1", "tensorboard: got 1 (int), accepts bool"),
    ("algorithm.estimator=ppo", "algorithm.estimator: got 'ppo', accepts one of 'grpo'"),
    ("update=3", "update: got 3, accepts a mapping"),
    ("update.sft_coef=-0.5", "update.sft_coef: must be >= 0"),
    ("update.ema_decay=1.0", "update.ema_decay: must be in .0, 1) or null, got 1.0"),
    ("rollout.threads=0", "rollout.threads: must be >= 1 or null, got 0"),
    ("threads=0", "threads: must be >= 1 or null, got 0"),
])
def test_bad_keys_and_types_are_refused_by_name(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_mixing_demonstrations_into_rl_needs_a_warm_start() -> None:
    with pytest.raises(ValueError, match=r"update.sft_coef: .* needs sft.enabled: true"):
        config_from_dict({"sft": {"enabled": False}, "update": {"sft_coef": 0.5}})
    config_from_dict({"sft": {"enabled": True}, "update": {"sft_coef": 0.5}})


def test_critic_estimator_without_critic_is_refused() -> None:
    with pytest.raises(ValueError, match=r"algorithm.estimator: 'gae' needs a critic"):
        config_from_dict({"algorithm": {"estimator": "gae"}})


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "gigpo"])
def test_groups_of_one_are_refused_for_group_methods(estimator: str) -> None:
    with pytest.raises(ValueError, match=r"rollout.group_size: .* at least 2, got 1"):
        config_from_dict({"algorithm": {"estimator": estimator}, "rollout": {"group_size": 1}})
    # A critic method may use single attempts.
    config_from_dict({"algorithm": {"estimator": "gae"}, "critic": {"kind": "value_head"},
                      "rollout": {"group_size": 1}})


def test_other_cross_field_rules() -> None:
    with pytest.raises(ValueError, match=r"update\.kl_in"):
        config_from_dict({"update": {"kl_coef": 0.1, "kl_in": "reward"}})
    with pytest.raises(ValueError, match=r"critic\.kind"):
        config_from_dict({"critic": {"kind": "value_head"}})
    with pytest.raises(ValueError, match=r"rollout\.temperature"):
        config_from_dict({"rollout": {"temperature": 0.0}})
    with pytest.raises(ValueError, match=r"update\.kl_coef: must be >= 0, got -0\.1"):
        config_from_dict({"update": {"kl_coef": -0.1}})
    with pytest.raises(ValueError, match=r"update\.kl_clamp"):
        config_from_dict({"update": {"kl_clamp": 0.0}})
    with pytest.raises(ValueError, match=r"update\.warmup_steps"):
        config_from_dict({"update": {"warmup_steps": -1}})
    # A negative entropy weight is entropy minimisation, not an error.
    assert config_from_dict({"update": {"entropy_coef": -0.1}}).update.entropy_coef == -0.1


def test_dump_round_trips(tmp_path: Path) -> None:
    config = load_config(None, ["update.lr=0.01", "rollout.system_prompt=hello"])
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_a_reused_run_dir_says_what_changed(tmp_path: Path) -> None:
    from tracerl.train.setup import check_config_file

    run = tmp_path / "run"
    run.mkdir()
    old = load_config(None, [f"run_dir={run}", "rollout.max_turns=8"])
    (run / "config.yaml").write_text(dump_config(old))
    new = load_config(None, [f"run_dir={run}", "rollout.max_turns=12", "sft.undo=true"])
    messages: list[str] = []
    check_config_file(new, messages.append)
    (message,) = messages
    assert "already holds a run" in message
    assert "rollout.max_turns: 8 -> 12" in message and "sft.undo: False -> True" in message
    assert load_config(run / "config.yaml") == new
    (kept,) = run.glob("config.*.yaml")
    assert load_config(kept) == old and kept.name in message
    # The same config again: nothing to say, nothing renamed.
    check_config_file(new, messages.append)
    assert len(messages) == 1 and len(list(run.glob("config.*.yaml"))) == 1
    assert config_changes({"a": {"b": 1}}, {"a": {"b": 2}, "c": 3}) == [
        "a.b: 1 -> 2", "c: '(none)' -> 3"]


def test_every_field_has_help() -> None:
    rows = describe_config()
    assert len(rows) > 60
    assert all(doc for _, _, doc in rows), [name for name, _, doc in rows if not doc]


def test_demo_summary_prints_behaviour_and_the_verdict() -> None:
    from tracerl.train.demo import format_summary, verdict

    def acts(retry: float, submitted: float) -> dict[str, object]:
        return {"actions": 100, "malformed": 0.1, "edits": 40, "edits_applied": 0.2,
                "after_fail": {"count": 10, "retry": retry, "next": {"submit": submitted}},
                "after_edit": {"count": 8, "next": {"run_tests": 1.0}}}

    summary: dict[str, object] = {
        "temperature": 1.0, "samples_per_task": 8, "heldout_tasks": 32,
        "heldout_success_before": 0.164, "heldout_ci95_before": [0.094, 0.25],
        "heldout_greedy_before": 0.281, "heldout_pass_at_k_before": {"8": 0.531},
        "heldout_success_after": 0.234, "heldout_ci95_after": [0.141, 0.344],
        "heldout_greedy_after": 0.438, "heldout_pass_at_k_after": {"8": 0.531},
        "heldout_behaviour_before": acts(0.22, 0.41), "heldout_behaviour_after": acts(0.36, 0.26),
        "rl_steps": 28, "wall_seconds": 824.0, "generated_tokens": 601474, "tool_seconds": 138.0,
        "heldout_gain_ci95": [-0.016, 0.156], "heldout_gain_over_greedy_ci95": [-0.2, 0.1],
        "policy": "weight average, update.ema_decay 0.92", "policy_dir": "runs/demo/policy"}
    summary["demo_targets"] = verdict(summary)
    text = format_summary(summary)
    assert "RL policy: weight average, update.ema_decay 0.92 (runs/demo/policy)" in text
    assert "gain over SFT sampled 7.0% [-1.6%, 15.6%] (target 15.0%)" in text
    assert "over SFT greedy -4.7% [-20.0%, 10.0%] (target 10.0%)" in text
    assert "28 RL steps, 824s wall (target 900s)" in text
    assert "demo targets: NOT met (sampled gain, greedy gain)" in text
    assert "after a FAIL: tried again 22.0% of 10, submitted 41.0%" in text
    assert "after a FAIL: tried again 36.0% of 10, submitted 26.0%" in text
    # Runs recorded before behaviour statistics existed print without those lines.
    del summary["heldout_behaviour_before"]
    assert "tried again" not in format_summary(summary)
    # ... and without the gains' paired intervals.
    del summary["heldout_gain_ci95"], summary["heldout_gain_over_greedy_ci95"]
    summary["demo_targets"] = verdict(summary)
    assert "gain over SFT sampled 7.0% (target 15.0%)" in format_summary(summary)
    # The time is a target too: every margin met but the run too long is not met.
    summary.update(heldout_success_after=0.6, wall_seconds=901.0)
    summary["demo_targets"] = verdict(summary)
    assert summary["demo_targets"]["missed"] == ["time"]
    assert "demo targets: NOT met (time)" in format_summary(summary)
    summary["wall_seconds"] = 900.0
    assert verdict(summary)["met"]
