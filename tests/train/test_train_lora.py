"""LoRA on the local engine (``model.lora.rank > 0``): the update trains the adapter only,
the KL reference is the policy with its adapter off, sampled logprobs are the trainer's,
checkpoints hold the adapter (PEFT layout) and the run's base, ``tracerl eval`` / ``serve`` /
``train-eval`` load them, and a killed run resumes bit for bit.

Two short runs of the same recipe: one through ``tracerl train`` with ``model.lora.rank=8``
as an override, uninterrupted; one in process, stopped after step 1's collection and resumed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tracerl.cli import main
from tracerl.envs.suite import generate_split
from tracerl.envs.tasks import dump_tasks
from tracerl.models.lora import AdapterOff, is_lora
from tracerl.models.tiny import load_tiny
from tracerl.rollout.policies.hf import HFPolicy
from tracerl.train.config import config_from_dict, describe_config, dump_config, load_config
from tracerl.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_runs import TINY_RUN, OneCallTrainer, tiny_recipe

LORA = {"rank": 8, "target_modules": ["q_proj", "v_proj"]}
CHANGES: dict[str, Any] = {
    # One attempt at a time: the sampler's batches (and float rounding) match across runs.
    "rollout": {"concurrency": 1},
    # A KL term (its reference: the adapter off) and a weight average (of the adapter).
    "update": {"kl_coef": 0.05, "ema_decay": 0.5},
    "eval": {"samples_per_task": 1, "greedy": False},
}


class Stop(Exception):
    """Raised by a hook to stop a run after a phase."""


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, through the command line; returns its run directory."""
    root = tmp_path_factory.mktemp("straight")
    recipe = tiny_recipe(root, **CHANGES)
    assert main(["train", str(recipe), "model.lora.rank=8",
                 "model.lora.target_modules=q_proj,v_proj"]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same recipe in process: weights observed around step 0's update, the run stopped
    after step 1's collection, then resumed to the end."""
    root = tmp_path_factory.mktemp("killed")
    recipe = tiny_recipe(root, **{**CHANGES, "model": {**TINY_RUN["model"], "lora": LORA}})
    seen: dict[str, Any] = {}

    def watch(phase: str, trainer: Trainer) -> None:
        policy = trainer.actor.policy
        if phase == "collect" and trainer.state.step == 0:
            seen["before"] = {n: p.detach().clone() for n, p in policy.named_parameters()}
        elif phase == "update" and trainer.state.step == 0:
            seen["after"] = {n: p.detach().clone() for n, p in policy.named_parameters()}
            seen["optimized"] = [p for group in trainer.optimizer.param_groups
                                 for p in group["params"]]
            seen["trainable"] = [p for p in policy.parameters() if p.requires_grad]
            seen["reference"] = trainer.reference
            assert trainer.ema is not None
            seen["ema"] = set(trainer.ema.weights)
            seen["decode"] = trainer.policy.decode_path()
        elif phase == "collect" and trainer.state.step == 1:
            raise Stop

    trainer = Trainer(load_config(recipe), hooks=[watch])
    with pytest.raises(Stop):
        trainer.run()
    trainer.close()
    said: list[str] = []
    resumed = Trainer(load_config(recipe), log=said.append)
    resumed.run()
    resumed.close()
    seen["said"] = said
    seen["run_dir"] = root / "run"
    return seen


def _adapter(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "adapter_model.safetensors"))


def test_the_update_moves_the_adapter_and_never_the_base(killed: dict[str, Any]) -> None:
    before, after = killed["before"], killed["after"]
    adapter = {n for n in before if "lora_" in n}
    assert adapter and set(before) == set(after)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in adapter)
    assert any(not torch.equal(before[n], after[n]) for n in adapter)
    # The optimizer holds the adapter only, the weight average too.
    assert [id(p) for p in killed["optimized"]] == [id(p) for p in killed["trainable"]]
    assert killed["ema"] == adapter
    # The KL reference is the policy itself with its adapter off, not a second copy.
    assert isinstance(killed["reference"].policy, AdapterOff)
    # The sampler's fast path reads raw Llama weights: a LoRA policy is sampled by its own
    # forward instead (the logprobs below are then the trainer's).
    assert killed["decode"] == "hf"


def test_the_base_is_the_one_the_run_started_from(killed: dict[str, Any]) -> None:
    run_dir = killed["run_dir"]
    base = load_file(str(run_dir / "base" / "model.safetensors"))
    after = killed["after"]
    for name, tensor in base.items():  # the warm start trained the adapter, not these
        if "q_proj" in name or "v_proj" in name:  # an adapted layer keeps its base beside
            name = name.replace(".weight", ".base_layer.weight")
        assert torch.equal(after[f"base_model.model.{name}"], tensor), name


def test_sampled_logprobs_are_the_trainers_with_the_adapter_on(straight: Path) -> None:
    steps = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert len(steps) == 2
    for step in steps:  # behavior (sampler) vs old (the trainer's forward) on action tokens
        assert step["mismatch"]["mean_abs_log_ratio"] < 1e-5, step["mismatch"]
        assert abs(step["mismatch"]["max_log_ratio"]) < 1e-4, step["mismatch"]


def test_checkpoints_hold_the_adapter_and_the_run_its_base(straight: Path) -> None:
    for directory in (straight / "checkpoints" / "step-000002", straight / "policy",
                      straight / "sft"):
        names = {p.name for p in directory.iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= names, directory
        assert "model.safetensors" not in names and "config.json" not in names
        config = json.loads((directory / "adapter_config.json").read_text())
        assert (config["r"], sorted(config["target_modules"])) == (8, ["q_proj", "v_proj"])
        assert Path(config["base_model_name_or_path"]) == (straight / "base").resolve()
    assert (straight / "base" / "model.safetensors").is_file()
    assert "trainer.pt" in {p.name for p in (straight / "checkpoints" / "step-000002").iterdir()}


def test_a_resumed_run_ends_as_the_uninterrupted_one(straight: Path,
                                                     killed: dict[str, Any]) -> None:
    run_dir = killed["run_dir"]
    assert any("resuming from" in line and "step-000001" in line for line in killed["said"])
    for policy in ("checkpoints/step-000002", "policy"):
        mine, theirs = _adapter(run_dir / policy), _adapter(straight / policy)
        assert set(mine) == set(theirs)
        assert all(torch.equal(mine[n], theirs[n]) for n in mine), policy
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [0, 1]


def test_eval_and_serve_load_the_base_with_the_adapter(straight: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(generate_split("heldout", seed=0, count=1), tasks)
    for policy in (straight / "policy", straight / "checkpoints" / "step-000001"):
        assert main(["eval", "--policy", str(policy), "--tasks", str(tasks), "--samples", "1",
                     "--json", str(tmp_path / f"{policy.name}.json")]) == 0
        assert json.loads((tmp_path / f"{policy.name}.json").read_text())
    # What `tracerl serve` loads: the base with the adapter merged, a plain model.
    served = HFPolicy.from_pretrained(str(straight / "policy"))
    assert not is_lora(served.model) and served.decode_path() == "fused"
    model, _ = load_tiny(straight / "policy")
    config = load_config(straight / "config.yaml", [f"run_dir={tmp_path / 'again'}",
                                                    f"model.path={straight / 'policy'}"])
    trainer = Trainer(config)
    trainer.setup()  # model.path names the adapter: the base with it on, trainable
    assert is_lora(trainer.actor.policy)
    ids = torch.tensor([[1, 5, 9, 30, 2, 7]])
    with torch.no_grad():
        merged = model(input_ids=ids).logits
        adapted = trainer.actor.policy(input_ids=ids).logits
    trainer.close()
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)


def test_checkpoints_of_a_lora_run_are_evaluated_and_averaged(straight: Path,
                                                              tmp_path: Path) -> None:
    from tracerl.train.run_eval import average_spec, evaluate_run, step_spec

    records = evaluate_run(straight, [step_spec(2), average_spec("1-2")], tmp_path / "out",
                           log=lambda _: None)
    assert [r["label"] for r in records] == ["step00002", "avg00001-00002"]
    assert all(0.0 <= r["sampled"]["success"] <= 1.0 for r in records)


def test_lora_settings_in_the_config(tmp_path: Path) -> None:
    config = config_from_dict({"model": {"lora": {"rank": 4, "target_modules": "q_proj, o_proj",
                                                  "alpha": 8}}})
    assert config.model.lora.target_modules == ("q_proj", "o_proj")
    assert config.model.lora.alpha == 8.0
    again = tmp_path / "config.yaml"
    again.write_text(dump_config(config))
    assert load_config(again) == config
    rows = {name: doc for name, _, doc in describe_config()}
    for key in ("rank", "alpha", "target_modules", "dropout"):
        assert rows[f"model.lora.{key}"], key
    # Off (rank 0) with the other keys set is fine.
    off = config_from_dict({"model": {"lora": {"rank": 0, "alpha": 64.0,
                                               "target_modules": ["gate_proj"]}}})
    assert off.model.lora.rank == 0


@pytest.mark.parametrize(("lora", "message"), [
    ({"rank": -1}, r"model.lora.rank: must be >= 0 \(0: off\), got -1"),
    ({"rank": 4, "alpha": 0}, "model.lora.alpha: must be > 0, got 0.0"),
    ({"rank": 4, "target_modules": []}, "model.lora.target_modules: must name at least one"),
    ({"rank": 4, "dropout": 1.0}, r"model.lora.dropout: must be in \[0, 1\)"),
    ({"rank": 4, "target_modules": [3]}, r"model.lora.target_modules\[0\]: got 3"),
    ({"ranks": 4}, "model.lora.ranks: unknown key"),
])
def test_bad_lora_settings_are_refused_naming_the_key(lora: dict[str, Any],
                                                      message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_dict({"model": {"lora": lora}})


def test_without_peft_the_config_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'tracerl\[lora\]'"):
        config_from_dict({"model": {"lora": {"rank": 4}}})
    config_from_dict({"model": {"lora": {"rank": 0}}})  # off: peft is not needed


def test_a_target_the_model_lacks_is_named(tmp_path: Path) -> None:
    config = load_config(tiny_recipe(tmp_path, sft={"enabled": False}, model={
        **TINY_RUN["model"], "lora": {"rank": 4, "target_modules": ["q_proj", "c_attn"]}}))
    with pytest.raises(ValueError, match=r"model.lora.target_modules: c_attn matches no module "
                       r"of LlamaForCausalLM; its linear layers are named down_proj, "
                       r"gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        Trainer(config).setup()


def test_resuming_across_a_lora_switch_is_refused(straight: Path, tmp_path: Path) -> None:
    shutil.copytree(straight / "checkpoints", tmp_path / "run" / "checkpoints")
    with pytest.raises(ValueError, match="holds a LoRA adapter, so the run it resumes needs "
                       r"model.lora.rank > 0"):
        Trainer(load_config(straight / "config.yaml", [
            "model.lora.rank=0", f"run_dir={tmp_path / 'run'}"])).setup()


@pytest.mark.parametrize("kind", ["value_head", "separate"])
def test_a_critic_beside_a_lora_policy_trains_its_own_weights_only(tmp_path: Path,
                                                                   kind: str) -> None:
    """``value_head``: a head on the adapted trunk; ``separate``: a copy of the base with its
    own adapter and head. Neither moves a base weight."""
    config = load_config(tiny_recipe(
        tmp_path, steps=2 if kind == "separate" else 1, sft={"enabled": False},
        model={**TINY_RUN["model"], "lora": LORA}),
        ["algorithm.estimator=gae", f"critic.kind={kind}", "rollout.max_turns=1",
         "rollout.max_turn_tokens=40", "rollout.constrain_calls=true",
         "rollout.group_size=4"])
    seen: dict[str, Any] = {}

    def watch(phase: str, trainer: Trainer) -> None:
        if phase == "collect" and trainer.state.step == 0:
            seen["before"] = {n: p.detach().clone() for n, p in trainer.actor.named_parameters()}
        elif phase == "update":
            seen["after"] = {n: p.detach().clone() for n, p in trainer.actor.named_parameters()}
            seen["trainable"] = {n for n, p in trainer.actor.named_parameters() if p.requires_grad}
            seen["optimized"] = {id(p) for group in trainer.optimizer.param_groups
                                 for p in group["params"]}
            seen["ids"] = {n: id(p) for n, p in trainer.actor.named_parameters()}

    trainer = OneCallTrainer(config, hooks=[watch])  # rewards of 0 and 1: values to learn
    trainer.run()
    trainer.close()
    before, after, trainable = seen["before"], seen["after"], seen["trainable"]
    assert {seen["ids"][n] for n in trainable} == seen["optimized"]
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    moved = {n for n in trainable if not torch.equal(before[n], after[n])}
    assert any(n.startswith("value_head.") for n in moved), moved
    # The head starts at zero, so the separate critic's trunk moves from the second step on:
    # its own adapter, not the policy's, on its own copy of the base.
    if kind == "separate":
        assert any(n.startswith("critic_backbone.") and "lora_" in n for n in moved), moved
    assert all("lora_" in n or n.startswith("value_head.") for n in trainable), trainable
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "critic" in record


def test_the_base_is_model_path_when_given_and_a_full_checkpoint_is_not_resumed(
        tmp_path: Path) -> None:
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model, save_tiny, train_tokenizer
    from tracerl.train import setup

    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n"] * 5, vocab_size=300)
    shape = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    saved = save_tiny(build_tiny_model(tokenizer, shape), tokenizer, tmp_path / "given")
    config = config_from_dict({"run_dir": str(tmp_path / "run"), "model": {
        "path": str(saved), "lora": {"rank": 2, "alpha": 4, "target_modules": ["o_proj"]}}})
    assert setup.lora_settings(config) is not None
    model = setup.lora_policy(config, load_tiny(saved)[0], tokenizer, None)
    assert model.peft_config["default"].base_model_name_or_path == str(saved.resolve())
    assert not (tmp_path / "run" / "base").exists()  # the base is the given directory
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000003"
    with pytest.raises(ValueError, match="was trained without LoRA; a LoRA run cannot resume"):
        setup.lora_policy(config, load_tiny(saved)[0], tokenizer, checkpoint)
    off = config_from_dict({"model": {"lora": {"rank": 0}}})
    assert setup.lora_settings(off) is None
    plain = load_tiny(saved)[0]
    assert setup.lora_policy(off, plain, tokenizer, None) is plain
