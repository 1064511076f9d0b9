"""Asynchronous training (``asynchronous.max_staleness``): k = 0 is the synchronous run bit for
bit; with k >= 1 the worker never runs more than k versions ahead, stale groups are dropped
whole (or kept and counted), per-token versions follow the weights when they change
mid-attempt, and a killed run resumes without losing or doubling a step."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tracerl.models.tiny import TinyModelConfig, build_tiny_model, train_tokenizer
from tracerl.rollout.collect.collector import Collector, CollectorConfig
from tracerl.rollout.policies.sampling import SamplingParams
from tracerl.trace import Attempt, Role, read_attempts
from tracerl.trace.synthetic import synthetic_attempt
from tracerl.train import asynchronous
from tracerl.train.asynchronous import AsyncLoop, StampedSampler, WorkerWeights
from tracerl.train.config import config_from_dict, load_config
from tracerl.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_runs import TINY_RUN, tiny_recipe

ASYNC_UPDATE = {**TINY_RUN["update"], "tis_cap": 2.0}
"""The tiny run's update with the importance weight decoupled PPO needs."""


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> Iterator[None]:
    yield


def _train_records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def _weights(run_dir: Path, checkpoint: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / checkpoint)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "message"), [
    ({"asynchronous": {"max_staleness": -1}}, "asynchronous.max_staleness: must be an integer"),
    ({"asynchronous": {"max_staleness": 1.5}}, "asynchronous.max_staleness: got 1.5"),
    ({"asynchronous": {"max_staleness": True}}, "asynchronous.max_staleness: got True"),
    ({"asynchronous": {"max_staleness": 1}}, "update.tis_cap: not available"),
    ({"asynchronous": {"max_staleness": 1, "weight_sync": "sometimes"}},
     "asynchronous.weight_sync: got 'sometimes'"),
    ({"asynchronous": {"max_staleness": 1, "stale": "keep"}}, "asynchronous.stale: got 'keep'"),
    ({"asynchronous": {"max_staleness": 2}, "update": {"tis_cap": 2.0, "loss_level": "sequence"}},
     "update.loss_level: not available with asynchronous.max_staleness 2"),
    ({"asynchronous": {"max_staleness": 1}, "update": {"tis_cap": 2.0},
      "rollout": {"threads": 1}}, "rollout.threads: not available"),
    ({"asynchronous": {"max_staleness": 1}, "update": {"tis_cap": 2.0},
      "multiagent": {"env": "referential"}}, "multiagent.env: not available"),
    ({"update": {"tis_mode": "clip"}}, "update.tis_mode: got 'clip'"),
])
def test_bad_asynchronous_settings_are_refused_naming_the_key(changes: dict[str, Any],
                                                                message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        config_from_dict(changes)


def test_torchrun_ranks_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE: not available"):
        config_from_dict({"asynchronous": {"max_staleness": 1}, "update": {"tis_cap": 2.0}})
    config_from_dict({"asynchronous": {"max_staleness": 0}})  # synchronous: ranks as before


# -- groups under staleness ------------------------------------------------------------------


def _attempt(group: str, index: int, *versions: int) -> Attempt:
    """A synthetic attempt whose action segments carry ``versions``, one per turn."""
    base = synthetic_attempt(np.random.default_rng(index), f"{group}:{index}", group_id=group,
                             total_tokens=60, turns=len(versions))
    fragments = []
    for fragment in base.fragments:
        turns = []
        for turn, version in zip(fragment.turns, versions, strict=True):
            segments = tuple(
                s if s.role is not Role.ACTION else
                type(s)(s.role, s.token_ids, s.logprobs, s.sampling, version, s.engine)
                for s in turn.segments)
            turns.append(type(turn)(segments))
        fragments.append(type(fragment)(fragment.index, tuple(turns), fragment.end))
    return type(base)(base.attempt_id, base.task_id, group, tuple(fragments), base.reward)


def test_a_group_with_one_attempt_older_than_k_is_dropped_whole() -> None:
    """Staleness is per attempt: the learner's version minus the oldest version among its
    action tokens. A group is trained or dropped whole, so a GRPO baseline never comes from
    part of a group."""
    fresh = [_attempt("g1", 0, 4, 5), _attempt("g1", 1, 5, 5)]
    mixed = [_attempt("g2", 2, 5, 5), _attempt("g2", 3, 3, 5)]  # its first turn: 3 behind
    assert asynchronous.staleness(mixed[1], 6) == 3
    assert asynchronous.action_versions(mixed[1]) == [3, 5]
    kept, stale = asynchronous.stale_groups([*fresh, *mixed], learner_version=6,
                                            max_staleness=2)
    assert [a.attempt_id for a in kept] == ["g1:0", "g1:1"]
    assert [a.attempt_id for a in stale] == ["g2:2", "g2:3"]
    kept, stale = asynchronous.stale_groups([*fresh, *mixed], learner_version=6,
                                            max_staleness=3)
    assert len(kept) == 4 and not stale


# -- whole runs ------------------------------------------------------------------------------


def test_max_staleness_zero_is_the_synchronous_run_bit_for_bit(tmp_path: Path) -> None:
    """k = 0 runs the synchronous loop itself: same weights, same metrics, under a seed."""
    one = {"rollout": {"concurrency": 1}}  # the sampler's batches (and rounding) fixed
    runs = {}
    for name, extra in (("sync", {}), ("k0", {"asynchronous": {"max_staleness": 0}})):
        (tmp_path / name).mkdir()
        Trainer(load_config(tiny_recipe(tmp_path / name, **one, **extra))).run()
        runs[name] = tmp_path / name / "run"
    assert torch.equal(_weights(runs["sync"], "step-000002"), _weights(runs["k0"], "step-000002"))
    strip = lambda r: {k: v for k, v in r.items() if k not in ("time", "per_solved")}  # noqa: E731
    sync, k0 = _train_records(runs["sync"]), _train_records(runs["k0"])
    assert [strip(r) for r in sync] == [strip(r) for r in k0]
    assert all("async" not in r for r in k0)


def test_an_async_run_trains_on_attempts_at_most_k_versions_old(tmp_path: Path) -> None:
    """k = 1: the worker collects step s + 1 while the learner trains on step s, from the
    weights before that update; every trained attempt's staleness is at most 1, and the
    versions stamped on its tokens are the ones the learner published."""
    def slow_learner(phase: str, trainer: Trainer) -> None:
        if phase == "collect":  # the worker starts the next step before this update
            loop: AsyncLoop = trainer.async_loop  # type: ignore[attr-defined]
            deadline = time.monotonic() + 120
            while (loop.collecting <= trainer.state.step < trainer.config.steps - 1
                   and time.monotonic() < deadline):
                time.sleep(0.01)

    recipe = tiny_recipe(tmp_path, steps=3, update=ASYNC_UPDATE,
                         asynchronous={"max_staleness": 1})
    Trainer(load_config(recipe), hooks=[slow_learner]).run()
    run_dir = tmp_path / "run"
    records = _train_records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    stored = read_attempts(run_dir / "traces")
    for record in records:
        section = record["async"]
        assert section["max_staleness"] == 1
        assert section["learner_version"] == record["policy_version"] - 1
        ages = {int(age) for age in section["staleness_versions"]}
        assert ages <= {0, 1}
        assert sum(section["staleness_versions"].values()) == record["attempts"]["trained_on"]
        assert section["dropped_attempts"] == 0
        assert 0.0 <= section["overlap"] <= 1.0
        step = [a for a in stored if a.group_id.startswith(f"s{record['step']:05d}r")]
        versions = {v for a in step for v in asynchronous.action_versions(a)}
        assert versions and max(versions) <= section["learner_version"]
        assert min(versions) >= section["learner_version"] - 1
    # Step 1 was sampled while step 0's update ran: one version behind at its update.
    assert records[1]["async"]["staleness_versions"] == {"1": 4}


@pytest.mark.parametrize("stale", ["drop", "capped"])
def test_attempts_older_than_k_are_never_trained_on(tmp_path: Path, stale: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With the worker's wait taken away, it collects steps 1-3 from the first weights while
    the learner is still on step 0; at their updates steps 2 and 3 are 2 versions old (k = 1):
    dropped whole and counted (``drop``: no update, the version stays), or trained and
    counted (``capped``)."""
    monkeypatch.setattr(AsyncLoop, "may_collect", lambda self, step: True)

    def wait_for_worker(phase: str, trainer: Trainer) -> None:
        if phase == "collect" and trainer.state.step == 0:
            loop: AsyncLoop = trainer.async_loop  # type: ignore[attr-defined]
            deadline = time.monotonic() + 120
            while not {1, 2, 3} <= set(loop.ready) and time.monotonic() < deadline:
                time.sleep(0.05)

    recipe = tiny_recipe(tmp_path, steps=4, update=ASYNC_UPDATE,
                         asynchronous={"max_staleness": 1, "stale": stale})
    Trainer(load_config(recipe), hooks=[wait_for_worker]).run()
    records = _train_records(tmp_path / "run")
    assert [r["async"]["learner_version"] for r in records] == (
        [0, 1, 2, 2] if stale == "drop" else [0, 1, 2, 3])
    for record in records[:2]:
        assert record["async"]["dropped_attempts"] == record["async"]["kept_stale_attempts"] == 0
    for record in records[2:]:
        section = record["async"]
        if stale == "drop":
            assert section["dropped_attempts"] == 4 and section["dropped_groups"] == 2
            assert record["attempts"]["trained_on"] == 0
            assert record["update"] == {"skipped": True}
            assert section["staleness_versions"] == {}
        else:
            assert section["kept_stale_attempts"] == 4 and section["dropped_attempts"] == 0
            assert record["attempts"]["trained_on"] == 4
            assert section["staleness_versions"] == {str(section["learner_version"]): 4}
        assert record["attempts"]["collected"] == 4  # their outcomes and costs still count


KILLED_RUN = """
import os, sys, time
from tracerl.train.config import load_config
from tracerl.train.trainer import Trainer

def die(phase, trainer):
    # At step 1's update the worker has collected step 2 (k = 1): kill -9 then.
    if phase == "advantages" and trainer.state.step == 1:
        loop = trainer.async_loop
        deadline = time.monotonic() + 120
        while 2 not in loop.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(9)

Trainer(load_config(sys.argv[1]), hooks=[die]).run()
"""


def test_a_killed_async_run_resumes_without_losing_or_doubling(tmp_path: Path) -> None:
    """Killed during step 1's update with step 2 already collected: the restart resumes from
    step 1's checkpoint, reuses the stored groups of steps 1 and 2 rather than sampling them
    again, trains each step once, and the store holds each attempt once."""
    recipe = tiny_recipe(tmp_path, steps=3, update=ASYNC_UPDATE,
                         asynchronous={"max_staleness": 1})
    died = subprocess.run([sys.executable, "-c", KILLED_RUN, str(recipe)], capture_output=True,
                          text=True, timeout=600)
    assert died.returncode == 9, died.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert (run_dir / "checkpoints" / "step-000001").is_dir()
    assert not (run_dir / "checkpoints" / "step-000002").exists()
    before = {a.attempt_id for a in read_attempts(run_dir / "traces")}
    assert any(i.startswith("s00002r0:") for i in before)  # step 2, collected ahead

    Trainer(load_config(recipe)).run()
    records = _train_records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]  # none repeated, none lost
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    assert [r["dynamic"]["reused_groups"] for r in records[1:]] == [2, 2]
    stored = read_attempts(run_dir / "traces")
    ids = [a.attempt_id for a in stored]
    assert len(ids) == len(set(ids))
    assert set(ids) == before  # nothing sampled again: every group was complete
    for record in records:
        assert max(int(age) for age in record["async"]["staleness_versions"]) <= 1


# -- weights that change during an attempt ------------------------------------------------


class TurnsEnv:
    """Three turns per attempt; after each of an attempt's first two turns ``between`` runs
    (the test publishes new weights there)."""

    def __init__(self, between: Any) -> None:
        self.between = between
        self.turn = 0

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.turn = 0
        return "Say anything, three times.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        if self.turn < 3:
            self.between(self.turn)
            return "Again.", 0.0, False, False, {}
        return "Done.", 0.0, True, False, {}


@pytest.mark.parametrize("mid_attempt", [True, False])
def test_every_action_token_carries_the_version_that_sampled_it(mid_attempt: bool) -> None:
    """New weights published between an attempt's turns: with ``mid_attempt`` its next turn is
    sampled by them and stamped with their version (the recorded logprobs are those weights'
    own); with ``between_attempts`` the whole attempt stays on the version it started with."""
    tokenizer = train_tokenizer(["Say anything, three times. Again. Done."] * 4, vocab_size=300)
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2,
                                                        intermediate_size=32), seed=0)
    weights = WorkerWeights(model, tokenizer, 0, max_batch_size=1)
    states = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    lock = threading.Lock()

    def publish(turn: int) -> None:
        with lock, torch.no_grad():
            for parameter in model.parameters():  # visibly other weights
                parameter.add_(torch.randn_like(parameter) * 0.5)
            states[turn] = {k: v.clone() for k, v in model.state_dict().items()}
            weights.publish(turn, model)

    sampler = StampedSampler(weights, mid_attempt=mid_attempt)
    collector = Collector(sampler, lambda: TurnsEnv(publish), None, CollectorConfig(
        sampling=SamplingParams(temperature=1.0, max_new_tokens=5), max_turns=3,
        max_concurrent=1, env_workers=1, handle_signals=False, tools=()))
    (attempt,) = collector.collect(["t"], 1).attempts
    expected = [0, 1, 2] if mid_attempt else [0, 0, 0]
    assert asynchronous.action_versions(attempt) == expected
    assert attempt.metadata.get("policy_versions") == ([0, 1, 2] if mid_attempt else None)
    # Each action's logprobs are those of the weights its version names.
    context: list[int] = []
    checker = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=16, num_layers=1,
                                                          num_heads=2, intermediate_size=32))
    for turn in attempt.fragments[0].turns:
        for segment in turn.segments:
            ids = segment.token_ids.tolist()
            if segment.role is Role.ACTION and ids:
                assert segment.policy_version is not None and segment.logprobs is not None
                checker.load_state_dict(states[segment.policy_version])
                with torch.no_grad():
                    logits = checker(torch.tensor([context + ids])).logits[0].double()
                at = torch.log_softmax(logits, -1)[len(context) - 1:-1]
                own = at.gather(1, torch.tensor(ids)[:, None]).squeeze(1)
                assert torch.allclose(own, torch.tensor(segment.logprobs).double(), atol=1e-4)
            context += ids


def test_an_async_lora_run_trains_the_adapter_and_stamps_versions(tmp_path: Path) -> None:
    """k = 1 with ``model.lora``: the worker's copy samples with the published adapter, only
    the adapter moves, and every trained attempt is at most one version old."""
    lora = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}
    recipe = tiny_recipe(tmp_path, steps=3, update=ASYNC_UPDATE,
                         model={**TINY_RUN["model"], "lora": lora},
                         asynchronous={"max_staleness": 1})
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def watch(phase: str, trainer: Trainer) -> None:
        if phase == "collect" and "before" not in seen:
            seen["before"] = {n: p.detach().clone()
                              for n, p in trainer.actor.policy.named_parameters()}

    trainer = Trainer(load_config(recipe), hooks=[watch])
    trainer.run()
    before, after = seen["before"], dict(trainer.actor.policy.named_parameters())
    trainer.close()
    adapter = {n for n in before if "lora_" in n}
    assert adapter
    assert all(torch.equal(before[n], after[n]) for n in before if n not in adapter)
    assert any(not torch.equal(before[n], after[n]) for n in adapter)
    run_dir = tmp_path / "run"
    records = _train_records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    stored = read_attempts(run_dir / "traces")
    for record in records:
        section = record["async"]
        assert {int(age) for age in section["staleness_versions"]} <= {0, 1}
        versions = {v for a in stored if a.group_id.startswith(f"s{record['step']:05d}r")
                    for v in asynchronous.action_versions(a)}
        assert versions and max(versions) <= section["learner_version"]
    # Step 0 was sampled by the weights its update started from, adapter and all: the
    # behavior logprobs are the trainer's.
    assert records[0]["mismatch"]["mean_abs_log_ratio"] < 1e-5
    assert (run_dir / "checkpoints" / "step-000003" / "adapter_model.safetensors").exists()
