"""`tracerl serve` driven by the official `openai` client: logprobs, tool calls, recorded traces."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from tracerl.models.tiny import (  # noqa: E402
    TinyModelConfig,
    build_tiny_model,
    render_tool_call,
    train_tokenizer,
)
from tracerl.rollout import HFPolicy, SamplingParams, sequence_logprobs  # noqa: E402
from tracerl.rollout.serve.recorder import SessionRecorder, parse_hermes_tool_calls  # noqa: E402
from tracerl.rollout.serve.server import TracingServer, create_app  # noqa: E402
from tracerl.testing.serving import free_port  # noqa: E402
from tracerl.trace import EndReason, Role, TraceStore, read_attempts  # noqa: E402

TOOL_CALL = render_tool_call("run_tests", {"path": "tests"})
TOOLS = [{"type": "function", "function": {
    "name": "run_tests", "description": "Run the tests.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
USER = [{"role": "user", "content": "Fix the bug"}]


def fit_tool_caller() -> HFPolicy:
    """A tiny model trained for a moment to answer USER (with TOOLS) with TOOL_CALL, greedily."""
    tokenizer = train_tokenizer(["Fix the bug in add.", TOOL_CALL, "All tests pass."] * 10,
                                vocab_size=300)
    model = build_tiny_model(tokenizer, TinyModelConfig(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=256))
    policy = HFPolicy(model, tokenizer)
    prompt = policy.chat_prompt(USER, tools=TOOLS)
    target = [*tokenizer.encode(TOOL_CALL, add_special_tokens=False), tokenizer.eos_token_id]
    inputs, labels = torch.tensor([prompt + target]), torch.tensor(target)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    threads = torch.get_num_threads()
    # Tiny matrices: one thread avoids oversubscribing the shared cores (10-50x faster here).
    torch.set_num_threads(1)
    try:
        _fit(model, optimizer, inputs, labels, len(prompt))
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return policy


def _fit(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
         labels: torch.Tensor, n_prompt: int) -> None:
    for _ in range(400):
        logits = model(input_ids=inputs).logits[0, n_prompt - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.005:
            break


class RunningServer:
    """uvicorn serving a TracingServer on 127.0.0.1 in a background thread."""

    def __init__(self, server: TracingServer) -> None:
        self.port = free_port()
        self.uvicorn = uvicorn.Server(uvicorn.Config(
            create_app(server), host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def policy() -> HFPolicy:
    return fit_tool_caller()


@pytest.fixture(scope="module")
def served(policy: HFPolicy, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[RunningServer, TraceStore, Path]]:
    directory = tmp_path_factory.mktemp("serve-store")
    store = TraceStore(directory, fsync=False)
    running = RunningServer(TracingServer(policy, SessionRecorder(store), model_name="tiny",
                                          seed=0))
    yield running, store, directory
    running.stop()
    store.close()


@pytest.fixture()
def client(served: tuple[RunningServer, TraceStore, Path]) -> Any:
    return openai.OpenAI(base_url=served[0].base_url, api_key="unused", max_retries=0,
                         timeout=60)


def token_ids(logprobs_content: Any) -> list[int]:
    return [int(entry.token.split(":", 1)[1]) for entry in logprobs_content]


def test_models_lists_the_served_model(client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_logprobs_are_behavior_logprobs_with_top_alternatives(
    client: Any, policy: HFPolicy
) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], temperature=0.8,
        max_tokens=12, logprobs=True, top_logprobs=5, seed=3,
        extra_body={"top_k": 5, "return_tokens_as_token_ids": True},
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    assert response.usage.completion_tokens == len(content) > 0
    sampled = token_ids(content)
    # Each sampled token is among the 5 alternatives (top_k=5 is the whole support), with the
    # same logprob, and the alternatives' probabilities sum to 1 (renormalised support).
    for entry, token in zip(content, sampled, strict=True):
        alternatives = {int(a.token.split(":")[1]): a.logprob for a in entry.top_logprobs}
        assert alternatives[token] == pytest.approx(entry.logprob, abs=1e-5)
        assert sum(np.exp(list(alternatives.values()))) == pytest.approx(1.0, abs=1e-4)
    # Recomputed from one forward pass under the same processing: the behavior logprobs.
    prompt = policy.chat_prompt([{"role": "user", "content": "hello"}])
    ids = torch.tensor([prompt + sampled])
    with torch.no_grad():
        recomputed = sequence_logprobs(policy.model, ids, params=SamplingParams(
            temperature=0.8, top_k=5))[0, len(prompt):]
    np.testing.assert_allclose(recomputed.numpy(), [e.logprob for e in content], atol=1e-5)


def test_tool_call_round_trip_is_recorded_token_for_token(
    client: Any, served: tuple[RunningServer, TraceStore, Path], policy: HFPolicy
) -> None:
    session = {"X-Tracerl-Session": "agent-1"}
    first = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=40, logprobs=True,
        extra_headers=session, extra_body={"return_tokens_as_token_ids": True},
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    (call,) = message.tool_calls
    assert call.function.name == "run_tests"
    assert json.loads(call.function.arguments) == {"path": "tests"}

    # The agent answers the call as it would with any OpenAI server.
    history = [*USER, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "All tests pass."}]
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, temperature=0.7, max_tokens=6, seed=1,
        logprobs=True, extra_headers=session, extra_body={"return_tokens_as_token_ids": True},
    )
    assert client.get("/sessions/agent-1", cast_to=object)["turns"] == 2
    finished = client.post("/sessions/agent-1/finish", cast_to=object,
                           body={"end_reason": "terminated", "reward": 1.0, "task_id": "t1"})
    assert finished == {"attempt_id": "agent-1", "end_reason": "terminated", "fragments": 1,
                        "turns": 2, "generated_tokens": len(first.choices[0].logprobs.content)
                        + len(second.choices[0].logprobs.content)}

    (attempt,) = [a for a in read_attempts(served[2]) if a.attempt_id == "agent-1"]
    assert attempt.reward == 1.0 and attempt.end_reason is EndReason.TERMINATED
    (fragment,) = attempt.fragments
    (prompt, action_1), (observation, action_2) = (t.segments for t in fragment.turns)
    assert prompt.role is Role.PROMPT and observation.role is Role.OBSERVATION
    assert prompt.token_ids.tolist() == policy.chat_prompt(USER, tools=TOOLS)
    # Action tokens and logprobs are exactly what the server sampled and reported.
    for action, response in ((action_1, first), (action_2, second)):
        content = response.choices[0].logprobs.content
        assert action.role is Role.ACTION and action.engine == "hf"
        assert action.token_ids.tolist() == token_ids(content)
        np.testing.assert_array_equal(action.logprobs,
                                      np.float32([e.logprob for e in content]))
    assert action_1.sampling is not None and action_1.sampling.temperature == 0
    assert action_2.sampling is not None and action_2.sampling.temperature == 0.7
    # The tool result came back through the chat template: it is observation, not action.
    assert policy.tokenizer.decode(observation.token_ids.tolist()) == (
        "<|tool|>All tests pass.<|end|><|assistant|>")


def test_rewritten_history_starts_a_new_fragment(
    client: Any, served: tuple[RunningServer, TraceStore, Path]
) -> None:
    session = {"X-Tracerl-Session": "agent-2"}
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=4,
                                   extra_headers=session)
    # The agent compacts its own history: the new prompt no longer extends the old context.
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Summary: tried A. Fix the bug"}],
        max_tokens=4, extra_headers=session)
    client.post("/sessions/agent-2/finish", cast_to=object, body={"end_reason": "timeout"})
    (attempt,) = [a for a in read_attempts(served[2]) if a.attempt_id == "agent-2"]
    assert [f.end for f in attempt.fragments] == [EndReason.CONTINUED, EndReason.TIMEOUT]
    assert attempt.fragments[1].turns[0].segments[0].role is Role.PROMPT


def test_request_without_session_is_its_own_attempt(
    client: Any, served: tuple[RunningServer, TraceStore, Path]
) -> None:
    response = client.chat.completions.create(model="tiny", messages=USER, max_tokens=3,
                                              temperature=1.0, n=2)
    assert len(response.choices) == 2
    ids = {f"{response.id}-0", f"{response.id}-1"}
    attempts = [a for a in read_attempts(served[2]) if a.attempt_id in ids]
    assert len(attempts) == 2
    assert {a.group_id for a in attempts} == {response.id}
    assert all(a.end_reason is EndReason.TRUNCATED_TOKENS for a in attempts)  # max_tokens=3


def test_bad_requests_are_clear_400s(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="more than the model's context"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Fix the bug " * 300}])
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="tiny", messages=USER, top_p=0)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.chat.completions.create(model="tiny", messages=USER, n=2, user="agent-3")
    with pytest.raises(openai.NotFoundError, match="no open session"):
        client.post("/sessions/nobody/finish", cast_to=object, body={})


def test_open_sessions_are_written_cancelled_at_shutdown(
    policy: HFPolicy, tmp_path: Path
) -> None:
    with TraceStore(tmp_path, fsync=False) as store:
        running = RunningServer(TracingServer(policy, SessionRecorder(store), model_name="tiny"))
        try:
            client = openai.OpenAI(base_url=running.base_url, api_key="x", max_retries=0)
            client.chat.completions.create(model="tiny", messages=USER, max_tokens=3,
                                           user="left-open")
        finally:
            running.stop()
    (attempt,) = read_attempts(tmp_path)
    assert attempt.attempt_id == "left-open"
    assert attempt.end_reason is EndReason.CANCELLED


def test_hermes_parsing_keeps_unparseable_calls_as_content() -> None:
    content, calls = parse_hermes_tool_calls('I will run it.<tool_call>{"name": "x", '
                                             '"arguments": {"a": 1}}</tool_call>')
    assert content == "I will run it."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("x", {"a": 1})]
    broken = '<tool_call>{"name": "x", "arguments": </tool_call>'
    assert parse_hermes_tool_calls(broken) == (broken, [])


@pytest.mark.slow
def test_cli_serves_and_writes_open_sessions_on_sigint(tmp_path: Path) -> None:
    from tracerl.models.tiny import save_tiny
    from tracerl.testing.serving import serve_subprocess

    tokenizer = train_tokenizer(["Fix the bug.", "hello"] * 10, vocab_size=300)
    model = build_tiny_model(tokenizer, TinyModelConfig(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=128))
    save_tiny(model, tokenizer, tmp_path / "model")
    with serve_subprocess(tmp_path / "model", tmp_path / "store") as served:
        assert [m.id for m in served.client.models.list().data] == ["model"]
        served.client.chat.completions.create(model="model", messages=USER, max_tokens=3,
                                              user="still-open")
    assert served.returncode == 0, served.output
    (attempt,) = read_attempts(tmp_path / "store")
    assert (attempt.attempt_id, attempt.end_reason) == ("still-open", EndReason.CANCELLED)


def test_sampled_tokens_stand_for_an_assistant_message_that_renders_differently(
    policy: HFPolicy
) -> None:
    from tracerl.rollout.serve.recorder import Sample, normalize_message
    from tracerl.trace import SamplingParams as TraceSampling

    tokenizer = policy.tokenizer
    recorder = SessionRecorder(None)

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return str(tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    messages = [normalize_message(m) for m in USER]
    prompt, prompt_text = recorder.chat_prompt("s", messages, render, encode)
    # The model wrote compact JSON; the template renders the returned call with spaces.
    sampled = [*encode('<tool_call>{"name":"run_tests","arguments":{}}</tool_call>'),
               tokenizer.eos_token_id]
    returned = normalize_message({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}]})
    recorder.record("s", prompt, Sample(sampled, [-0.5] * len(sampled), "stop", 0,
                                        TraceSampling(temperature=1.0), "hf"),
                    prompt_text=prompt_text, sampled_text=tokenizer.decode(sampled),
                    messages=[*messages, returned])
    follow_up = [*messages, returned, normalize_message(
        {"role": "tool", "tool_call_id": "c1", "content": "ok"})]
    assert not render(follow_up, True).startswith(prompt_text + tokenizer.decode(sampled))
    next_prompt, _ = recorder.chat_prompt("s", follow_up, render, encode)
    context = prompt + sampled
    assert next_prompt[: len(context)] == context  # the sampled tokens, not a re-rendering
    assert tokenizer.decode(next_prompt[len(context):]) == "<|tool|>ok<|end|><|assistant|>"


def test_concurrent_sessions_keep_separate_traces(
    client: Any, served: tuple[RunningServer, TraceStore, Path], policy: HFPolicy
) -> None:
    def agent(name: str) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {name}"}]
        for _ in range(2):
            reply = client.chat.completions.create(model="tiny", messages=messages,
                                                   max_tokens=4, user=name)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "go on"}]
        client.post(f"/sessions/{name}/finish", cast_to=object, body={"reward": 0.0})

    names = [f"concurrent-{i}" for i in range(4)]
    threads = [threading.Thread(target=agent, args=(n,)) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    attempts = {a.attempt_id: a for a in read_attempts(served[2]) if a.attempt_id in names}
    assert sorted(attempts) == names
    for name, attempt in attempts.items():
        # Two turns each, and every prompt is this session's own conversation. (A turn whose
        # sampled text held a special token the agent's copy drops would start a second
        # fragment: the context changed. Untrained samples may do that, so it is allowed.)
        assert sum(len(f.turns) for f in attempt.fragments) == 2
        for fragment in attempt.fragments:
            first = fragment.turns[0].segments[0]
            assert first.role is Role.PROMPT
            assert f"task {name}" in policy.tokenizer.decode(first.token_ids.tolist())


def test_a_tracerl_policy_is_served_as_its_run_decoded_it(
        policy: HFPolicy, tmp_path: Path) -> None:
    from tracerl.rollout.settings import RolloutConfig

    # What a run saved beside the policy: greedy, 48 tokens a turn, the tools in the prompt,
    # and an edit rule that needs the environment's open file.
    rollout = RolloutConfig(temperature=0.0, max_turn_tokens=48, constrain_edits=True)
    store = TraceStore(tmp_path / "store", fsync=False)
    running = RunningServer(TracingServer(policy, SessionRecorder(store), model_name="tiny",
                                          rollout=rollout))
    try:
        client = openai.OpenAI(base_url=running.base_url, api_key="unused", max_retries=0,
                               timeout=60)
        # The request names no temperature and no token limit: the run's are used.
        answer = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                                extra_headers={"X-Tracerl-Session": "run"})
        assert answer.choices[0].finish_reason == "tool_calls"
        client.post("/sessions/run/finish", cast_to=object, body={"reward": 0.0})
    finally:
        running.stop()
        store.close()
    (attempt,) = read_attempts(tmp_path / "store")
    assert attempt.costs.tool_calls == 1 and attempt.costs.turns == 1
    action = attempt.fragments[0].turns[0].segments[1]
    assert action.sampling is not None
    assert (action.sampling.temperature, action.sampling.max_new_tokens) == (0.0, 48)
    assert attempt.metadata["decoding_rules_not_applied"] == ["constrain_edits"]


def test_the_run_s_tool_call_grammar_decodes_served_chat_completions(policy: HFPolicy) -> None:
    from tracerl.envs.tools import TOOL_NAMES
    from tracerl.rollout.serve.server import chat_completion
    from tracerl.rollout.settings import RolloutConfig

    server = TracingServer(policy, SessionRecorder(None), model_name="tiny",
                           rollout=RolloutConfig(constrain_calls=True, max_turn_tokens=64,
                                                 show_tool_schemas=False,
                                                 system_prompt="Use the tools."))

    answer = chat_completion(server, {"messages": USER, "tools": TOOLS, "seed": 3}, None)
    (attempt,) = server.recorder.finished
    prompt, action = attempt.fragments[0].turns[0].segments
    assert action.sampling is not None and action.sampling.constraint == "tool_call"
    # Rendered as the run rendered it: its system prompt, no tool schemas.
    text = policy.tokenizer.decode(prompt.token_ids.tolist())
    assert "Use the tools." in text and "run_tests" not in text
    # The grammar keeps the action one well-formed call, which the answer returns as one.
    (call,) = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] in TOOL_NAMES and attempt.costs.tool_calls == 1
