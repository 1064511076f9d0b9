"""The Ray backend: same attempts as the local collector, and a killed actor is a tool_error."""

from __future__ import annotations

import functools
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from tracerl.envs import TOOL_SCHEMAS, CodingEnv, Sandbox  # noqa: E402
from tracerl.envs.suite import generate_split  # noqa: E402
from tracerl.rollout.collect.collector import Collector, CollectorConfig  # noqa: E402
from tracerl.rollout.collect.ray_backend import RayEnvPool, init_ray  # noqa: E402
from tracerl.rollout.policies.hf import HFPolicy  # noqa: E402
from tracerl.rollout.policies.sampling import SamplingParams  # noqa: E402
from tracerl.testing.toy_agent import toy_tool_policy  # noqa: E402
from tracerl.trace import EndReason, TraceStore, read_attempts  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
TOOLS = tuple(s for s in TOOL_SCHEMAS if s["function"]["name"] in ("run_tests", "submit"))
SAMPLING = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=30)


class SlowTaskEnv:
    """A coding env whose steps on one task take long (a slow test run), announced in a file."""

    def __init__(self, tasks: list[Any], slow_task: str, marker: str) -> None:
        self.env = CodingEnv(tasks, sandbox=Sandbox())
        self.slow_task, self.marker = slow_task, marker
        self.task: str | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        self.task = (options or {}).get("task_id")
        return self.env.reset(seed=seed, options=options)

    def step(self, action: str) -> Any:
        if self.task == self.slow_task:
            try:  # only the first step on the slow task, of all attempts, is slow
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return self.env.step(action)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            time.sleep(60)
        return self.env.step(action)

    def verify(self) -> Any:
        return self.env.verify()

    def audit(self) -> Any:
        return self.env.audit()

    def close(self) -> None:
        self.env.close()


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    # The test module is not importable in Ray's workers: ship SlowTaskEnv by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tasks() -> list[Any]:
    return generate_split("train", seed=0, count=2)


@pytest.fixture(scope="module")
def policy(tasks: list[Any]) -> HFPolicy:
    env = CodingEnv(tasks, sandbox=Sandbox())
    first = [env.reset(options={"task_id": t.id})[0] for t in tasks]
    env.close()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices on shared cores
    try:
        return toy_tool_policy(first, tools=TOOLS, steps=60)
    finally:
        torch.set_num_threads(threads)


def config(**changes: Any) -> CollectorConfig:
    settings: dict[str, Any] = dict(sampling=SAMPLING, tools=TOOLS, max_turns=2,
                                    max_concurrent=4, env_workers=4, seed=5,
                                    handle_signals=False, verify_truncated=False)
    return CollectorConfig(**{**settings, **changes})


def test_ray_envs_give_the_local_backends_attempts(
    ray_session: None, tasks: list[Any], policy: HFPolicy
) -> None:
    make_env = functools.partial(CodingEnv, tasks, sandbox=Sandbox())
    local = Collector(policy, make_env, None, config()).collect(tasks, 2, run_id="eq")
    with RayEnvPool(make_env, num_hosts=2, env_concurrency=2) as pool:
        remote = Collector(policy, pool.make_env, None, config()).collect(tasks, 2, run_id="eq")
        assert pool.replaced == 0
    assert [a.attempt_id for a in remote.attempts] == [a.attempt_id for a in local.attempts]
    assert len(local.attempts) == 4
    for mine, theirs in zip(remote.attempts, local.attempts, strict=True):
        assert mine.end_reason is theirs.end_reason
        assert mine.reward == theirs.reward
        assert mine.costs.turns == theirs.costs.turns
        segments = [s for f in mine.fragments for t in f.turns for s in t.segments]
        expected = [s for f in theirs.fragments for t in f.turns for s in t.segments]
        assert [s.role for s in segments] == [s.role for s in expected]
        for got, want in zip(segments, expected, strict=True):
            assert got.token_ids.tolist() == want.token_ids.tolist()
            if want.logprobs is not None:
                # Same seeds per row; batch neighbours may differ, which moves float rounding.
                np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_killed_actor_ends_its_attempts_as_tool_error_and_the_run_goes_on(
    ray_session: None, tasks: list[Any], policy: HFPolicy, tmp_path: Path
) -> None:
    marker = tmp_path / "slow-step-pid"
    make_env = functools.partial(SlowTaskEnv, tasks, tasks[0].id, str(marker))
    with RayEnvPool(make_env, num_hosts=2, env_concurrency=2) as pool, \
            TraceStore(tmp_path / "store", fsync=False) as store:
        collector = Collector(policy, pool.make_env, store,
                              config(max_concurrent=1, env_workers=1))
        killed: list[int] = []

        def kill_the_slow_host() -> None:
            deadline = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not marker.exists():
                return
            pid = int(marker.read_text())
            for host in list(pool.hosts):
                if ray.get(host.pid.remote()) == pid:
                    ray.kill(host)
                    killed.append(pid)
                    return

        killer = threading.Thread(target=kill_the_slow_host, daemon=True)
        killer.start()
        # One attempt at a time: the slow task's comes first and is killed; the next starts
        # after the kill, on the replacement host.
        result = collector.collect(tasks, 1, run_id="kill")
        killer.join(timeout=5)
    assert killed, "the slow step never started"
    assert pool.replaced >= 1
    # Every attempt is recorded: the slow task's on the killed actor as a tool error ...
    attempts = {a.attempt_id: a for a in read_attempts(tmp_path / "store")}
    assert len(attempts) == len(result.attempts) == 2
    (slow,) = [a for a in attempts.values() if a.task_id == tasks[0].id]
    assert slow.end_reason is EndReason.TOOL_ERROR and "died" in slow.metadata["error"]
    assert slow.reward is None  # never scored as the policy's failure
    # ... and the run went on: the next attempt ran on the replacement host.
    (other,) = [a for a in attempts.values() if a.task_id != tasks[0].id]
    assert other.end_reason is not EndReason.TOOL_ERROR
    assert other.costs.turns >= 1


def test_pool_refuses_bad_sizes(ray_session: None, tasks: list[Any]) -> None:
    with pytest.raises(ValueError, match="num_hosts"):
        RayEnvPool(functools.partial(CodingEnv, tasks), num_hosts=0)
    with pytest.raises(ValueError, match="env_concurrency"):
        RayEnvPool(functools.partial(CodingEnv, tasks), env_concurrency=0)


@pytest.mark.slow
def test_policy_in_an_actor_samples_as_locally(
    ray_session: None, policy: HFPolicy, tmp_path: Path
) -> None:
    from tracerl.models.tiny import load_tiny, save_tiny
    from tracerl.rollout.collect.ray_backend import RayPolicy

    save_tiny(policy.model, policy.tokenizer, tmp_path / "model")

    def make_policy(path: str) -> HFPolicy:
        model, tokenizer = load_tiny(path)
        return HFPolicy(model, tokenizer)

    remote = RayPolicy(functools.partial(make_policy, str(tmp_path / "model")), num_cpus=0)
    prompt = policy.chat_prompt([{"role": "user", "content": "Fix the bug."}])
    assert remote.chat_prompt([{"role": "user", "content": "Fix the bug."}]) == prompt
    assert remote.engine == "hf" and remote.context_length == policy.context_length
    got = remote.generate([prompt, prompt], SAMPLING, row_seeds=[1, 2])
    want = policy.generate([prompt, prompt], SAMPLING, row_seeds=[1, 2])
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    ray.kill(remote.actor)
    from tracerl.rollout.collect.ray_backend import PolicyActorDied

    with pytest.raises(PolicyActorDied):
        remote.generate([prompt], SAMPLING)
