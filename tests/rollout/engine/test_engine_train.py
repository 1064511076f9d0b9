"""RL steps with ``rollout.engine: vllm`` against a real vLLM server: every action token
carries the version the server was verified to serve; a skipped sync stops the run; a server
killed mid-collection ends the attempts it cut short as infrastructure failures, stores each
attempt once and says what happened; Ctrl-C leaves no server behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from tracerl.envs.tasks import Task
from tracerl.models.tiny import save_tiny
from tracerl.rollout.vllm import EngineUnavailable, SyncMismatch, VllmConfig, VllmServer
from tracerl.rollout.vllm.engine import save_for_engine
from tracerl.trace import EndReason, Role, read_attempts
from tracerl.train.config import load_config
from tracerl.train.trainer import Trainer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent / "train"))
from engine_models import SHAPE, tiny_model  # noqa: E402
from tiny_runs import OneCallEnv, OneCallTrainer  # noqa: E402

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs' starting policy (``model.path``)."""
    model, tokenizer = tiny_model()
    return save_tiny(model, tokenizer, tmp_path_factory.mktemp("policy") / "policy")


def recipe(root: Path, policy: Path, **vllm: Any) -> Path:
    data = {
        "seed": 1, "steps": 2, "threads": 1, "tensorboard": False, "progress": False,
        "model": {"path": str(policy), "max_positions": SHAPE.max_positions},
        "tasks": {"train_count": 4, "heldout_count": 2},
        "rollout": {"engine": "vllm", "tasks_per_step": 2, "group_size": 2, "max_turns": 1,
                    "max_turn_tokens": 8, "concurrency": 4, "env_workers": 1,
                    "show_tool_schemas": False},
        # An entropy bonus moves the weights every step even when all rewards are 0.
        "update": {"entropy_coef": 0.05, "lr": 0.01, "micro_batch_rows": 4},
        "eval": {"samples_per_task": 1, "greedy": False},
        "vllm": vllm, "run_dir": str(root / "run"),
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def action_versions(run: Path) -> dict[str, set[int | None]]:
    """The policy versions on the action tokens of each stored attempt."""
    return {a.attempt_id: {s.policy_version for f in a.fragments for t in f.turns
                           for s in t.segments if s.role is Role.ACTION}
            for a in read_attempts(run / "traces")}


def test_rl_steps_sample_from_the_verified_version_and_leave_no_server(
        policy_dir: Path, tmp_path: Path) -> None:
    trainer = OneCallTrainer(load_config(recipe(tmp_path, policy_dir)))
    trainer.run()
    run = tmp_path / "run"
    versions = action_versions(run)
    assert versions
    for attempt_id, found in versions.items():
        step = int(attempt_id[1:6])  # "s00001r0:..." is step 1's
        assert found <= {step}, (attempt_id, found)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line.get("kind") == "train"]
    assert [s["engine"]["verified_version"] for s in steps] == [0.0, 1.0]
    for line in steps:
        assert line["engine"]["probe_max_abs_diff"] <= 1e-4
        # Engine and trainer agree on the sampled tokens: float32 on both sides.
        assert line["mismatch"]["max_abs_log_ratio"] < 1e-3
        assert line["mismatch"]["kl_behavior_old"] < 1e-6
    assert (run / "engine" / "server.log").is_file()
    server = trainer.engine.vllm.server if trainer.engine.vllm else None
    assert server is not None and server.process is not None
    assert server.returncode() is not None
    assert live_members(server.process.pid) == []  # nothing of its process group runs


@pytest.fixture(scope="module")
def shared_server(policy_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[VllmServer]:
    """A server the runs below reach at ``vllm.url`` (started on the runs' first policy)."""
    from tracerl.models.tiny import load_tiny

    model, tokenizer = load_tiny(policy_dir)
    base = tmp_path_factory.mktemp("served") / "base"
    save_for_engine(model, base)
    tokenizer.save_pretrained(base)
    with VllmServer(VllmConfig(), base, base.parent / "server.log") as server:
        yield server


class SkippingTrainer(OneCallTrainer):
    """A trainer whose engine believes every update reached the server without syncing it:
    the bug that lets rollouts keep coming from the initial policy."""

    def update(self, rows: Any, attempt_index: Any) -> dict[str, Any]:
        metrics = super().update(rows, attempt_index)
        if self.engine.vllm is not None:
            self.engine.vllm.verified_version = self.state.policy_version
        return metrics


def test_a_skipped_sync_stops_the_run(policy_dir: Path, shared_server: VllmServer,
                                      tmp_path: Path) -> None:
    trainer = SkippingTrainer(load_config(recipe(tmp_path, policy_dir,
                                                 url=shared_server.base_url)))
    with pytest.raises(SyncMismatch, match=r"holds policy version 1, but the server's probe"):
        trainer.run()
    versions = action_versions(tmp_path / "run")
    assert versions and all(found <= {0} for found in versions.values())


class KillingEnv(OneCallEnv):
    """Once ``armed`` (the training collection, not the local evaluation before it), the
    first action kills the server; every attempt goes on to a next turn, which the dead
    server cannot sample."""

    server: VllmServer | None = None
    armed = False

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not KillingEnv.armed:
            return super().step(action)
        server = KillingEnv.server
        if server is not None and server.process is not None and server.alive():
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(30)
        return "OK", 0.0, False, False, {"task_id": self.task_id, "turn": 1, "tool": None,
                                         "tool_seconds": 0.0, "tool_error": False}


class KillingTrainer(Trainer):
    def make_env_factory(self, tasks: Sequence[Task]) -> Callable[[], OneCallEnv]:
        return KillingEnv

    def collect(self, step: int) -> Any:
        KillingEnv.armed = True
        return super().collect(step)


def test_server_killed_mid_collection(policy_dir: Path, shared_server: VllmServer,
                                      tmp_path: Path) -> None:
    KillingEnv.server = shared_server
    config = load_config(recipe(tmp_path, policy_dir, url=shared_server.base_url,
                                request_seconds=30.0),
                         ["rollout.tasks_per_step=4", "rollout.concurrency=8",
                          "rollout.max_turns=2"])
    trainer = KillingTrainer(config)
    with pytest.raises(EngineUnavailable, match=r"(?s)step 0: the vLLM server at .* does not "
                                                r"answer.*ended tool_error"):
        trainer.run()
    attempts = read_attempts(tmp_path / "run" / "traces")
    ids = [a.attempt_id for a in attempts]
    assert len(ids) == len(set(ids)) == 8  # each attempt recorded, once
    failed = [a for a in attempts if a.end_reason is EndReason.TOOL_ERROR]
    assert failed, "the attempts' second turns found the server dead"
    for attempt in failed:
        assert attempt.metadata["failed"] == "sampler" and attempt.reward is None
        assert "EndpointUnreachable" in attempt.metadata["error"]
    finished = [a for a in attempts if a.end_reason is not EndReason.TOOL_ERROR]
    assert all(a.reward is not None for a in finished)


CTRL_C = """
import signal, sys, time
from pathlib import Path
from tracerl.rollout.vllm import VllmConfig, VllmServer
# A terminal's Ctrl-C, even where this test's runner was started with SIGINT ignored (a shell's
# background job), which a child process would otherwise inherit.
signal.signal(signal.SIGINT, signal.default_int_handler)
server = VllmServer(VllmConfig(), Path(sys.argv[1]), Path(sys.argv[2]))
try:
    server.start()
    time.sleep(600)
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_trainer_leaves_no_server(shared_server: VllmServer, tmp_path: Path,
                                              signal_number: int) -> None:
    log = tmp_path / "server.log"
    child = subprocess.Popen([sys.executable, "-c", CTRL_C, str(shared_server.model_dir),
                              str(log)])
    # Interrupt while the server is starting: its process group exists, nothing answers yet.
    deadline = time.monotonic() + 120
    while "api_server" not in (log.read_text() if log.is_file() else ""):
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.5)
    time.sleep(5)
    group = _server_group(child.pid)
    child.send_signal(signal_number)
    # Ctrl-C: KeyboardInterrupt, the script exits 130; SIGTERM: the server manager's handler
    # stops the server and exits as the signal would (128 + 15).
    expected = 130 if signal_number == signal.SIGINT else 128 + signal_number
    # stop() is bounded (20 s of SIGTERM grace, then SIGKILL); the margin is for a busy machine.
    assert child.wait(180) == expected
    assert live_members(group) == []


def _server_group(parent: int) -> int:
    """The process group of ``parent``'s child (the server leads a group of its own)."""
    found = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True)
    children = found.stdout.split()
    assert children, "the server process was not started"
    return os.getpgid(int(children[0]))


def live_members(group: int, wait_seconds: float = 15.0) -> list[str]:
    """The processes of process group ``group`` that still run (zombies waiting for init to
    reap them do not), after waiting up to ``wait_seconds`` for them to go."""
    deadline = time.monotonic() + wait_seconds
    while True:
        listing = subprocess.run(["ps", "-eo", "pid=,pgid=,stat=,args="], capture_output=True,
                                 text=True, check=True).stdout
        live = [line.strip() for line in listing.splitlines()
                if len(line.split()) >= 3 and line.split()[1] == str(group)
                and not line.split()[2].startswith("Z")]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.5)
