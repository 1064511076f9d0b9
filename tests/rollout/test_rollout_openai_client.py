"""OpenAIPolicy against a real OpenAI-compatible server (tracerl serve), and its failure modes."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from tracerl.models.tiny import TinyModelConfig, build_tiny_model, train_tokenizer  # noqa: E402
from tracerl.rollout import HFPolicy, SamplingParams  # noqa: E402
from tracerl.rollout.policies.openai_api import (  # noqa: E402
    EndpointResponseError,
    EndpointTimeout,
    EndpointUnreachable,
    OpenAIPolicy,
    OpenAIPolicyConfig,
)
from tracerl.rollout.serve.recorder import SessionRecorder  # noqa: E402
from tracerl.rollout.serve.server import TracingServer, create_app  # noqa: E402
from tracerl.testing.serving import free_port  # noqa: E402


@pytest.fixture(scope="module")
def local() -> HFPolicy:
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n", "Fix the bug."] * 10,
                                vocab_size=300)
    model = build_tiny_model(tokenizer, TinyModelConfig(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=128))
    return HFPolicy(model, tokenizer)


@pytest.fixture(scope="module")
def base_url(local: HFPolicy) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        create_app(TracingServer(local, SessionRecorder(None), model_name="tiny")),
        host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=30)


def client_policy(base_url: str, local: HFPolicy | None = None, **config: Any) -> OpenAIPolicy:
    return OpenAIPolicy(OpenAIPolicyConfig(base_url=base_url, model="tiny", engine="tracerl",
                                           **config),
                        tokenizer=None if local is None else local.tokenizer, policy_version=7)


@pytest.mark.parametrize("token_ids", ["tokens", "field"])
def test_token_ids_and_logprobs_equal_the_servers_sampler(
    base_url: str, local: HFPolicy, token_ids: str
) -> None:
    remote = client_policy(base_url, local, token_ids=token_ids)
    prompts = [local.chat_prompt([{"role": "user", "content": "Fix the bug."}]),
               local.tokenizer.encode("def add(a, b):", add_special_tokens=False)]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, max_new_tokens=8, seed=11)
    got = remote.generate(prompts, params)
    # Prompt i is sampled with seed + i; the same model sampling locally gives the same tokens
    # and the same behavior logprobs (the server is this very sampler behind HTTP).
    for i, (prompt, completion) in enumerate(zip(prompts, got, strict=True)):
        (expected,) = local.generate([prompt], SamplingParams(
            temperature=0.9, top_p=0.95, top_k=40, max_new_tokens=8, seed=11 + i))
        assert completion.token_ids == expected.token_ids
        assert completion.logprobs == pytest.approx(expected.logprobs, abs=1e-6)
        assert completion.finish_reason == expected.finish_reason
        assert completion.text == expected.text
        assert completion.policy_version == 7


def test_explicit_stop_token_ids_replace_eos(base_url: str, local: HFPolicy) -> None:
    remote = client_policy(base_url)
    prompt = local.tokenizer.encode("Fix the bug.", add_special_tokens=False)
    (completion,) = remote.generate([prompt], SamplingParams(max_new_tokens=5, seed=0,
                                                             stop_token_ids=()))
    assert len(completion.token_ids) == 5 and completion.finish_reason == "length"


def test_unreachable_endpoint_is_a_clear_error() -> None:
    remote = client_policy(f"http://127.0.0.1:{free_port()}/v1", timeout=5)
    with pytest.raises(EndpointUnreachable, match="cannot reach"):
        remote.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))


def test_slow_endpoint_times_out() -> None:
    # A server that accepts connections and never answers.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        remote = client_policy(f"http://127.0.0.1:{listener.getsockname()[1]}/v1", timeout=0.5)
        with pytest.raises(EndpointTimeout, match=r"did not answer within 0\.5 s"):
            remote.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    finally:
        listener.close()


class _NoLogprobs(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that answers completions without logprobs."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "tiny",
                           "choices": [{"index": 0, "text": "hi", "finish_reason": "stop",
                                        "logprobs": None}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_response_without_logprobs_is_refused() -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _NoLogprobs)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        remote = client_policy(f"http://127.0.0.1:{httpd.server_address[1]}/v1", timeout=10)
        with pytest.raises(EndpointResponseError, match="no logprobs"):
            remote.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_server_rejection_is_reported(base_url: str) -> None:
    remote = client_policy(base_url)
    with pytest.raises(EndpointResponseError, match=r"answered 400.*context"):
        remote.generate([[5] * 500], SamplingParams(max_new_tokens=2))


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="base_url"):
        OpenAIPolicyConfig(base_url="localhost:8000", model="m")
    with pytest.raises(ValueError, match="timeout"):
        OpenAIPolicyConfig(base_url="http://h/v1", model="m", timeout=0)


def test_row_seeds_are_sent_per_prompt(base_url: str, local: HFPolicy) -> None:
    remote = client_policy(base_url, local, context_length=128)
    assert remote.context_length == 128
    prompt = local.tokenizer.encode("Fix the bug.", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=6)
    got = remote.generate([prompt, prompt], params, row_seeds=[3, 9])
    for seed, completion in zip([3, 9], got, strict=True):
        (expected,) = local.generate([prompt], SamplingParams(max_new_tokens=6, seed=seed))
        assert completion.token_ids == expected.token_ids
    with pytest.raises(ValueError, match="row_seeds"):
        remote.generate([prompt], params, row_seeds=[1, 2])
