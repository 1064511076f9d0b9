"""``tracerl serve``: a policy behind an OpenAI-compatible HTTP API that records what it samples.

Endpoints (FastAPI; the ``serve`` extra):

- ``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template (tools
  included); ``logprobs`` / ``top_logprobs`` in the standard ``choices[].logprobs.content``
  shape; Hermes ``<tool_call>{...}</tool_call>`` text parsed into ``message.tool_calls``, and
  ``tool`` messages rendered back through the template on the next request.
- ``POST /v1/completions``: a prompt as text or as token ids (as vLLM accepts), with
  ``logprobs`` and the vLLM options ``return_tokens_as_token_ids`` (tokens written
  ``"token_id:<id>"``) and ``return_token_ids`` (``token_ids`` / ``prompt_token_ids`` fields),
  so ``OpenAIPolicy`` works against this server exactly as against vLLM.
- ``GET /v1/models``; ``GET /v1/sessions/{key}``; ``POST /v1/sessions/{key}/finish``.

Every reported logprob is the behavior logprob: the log-probability under the distribution the
token was actually drawn from (temperature, top-k, top-p applied and renormalised), which is
what vLLM reports with ``--logprobs-mode processed_logprobs``. ``top_logprobs`` are recomputed
by one extra forward pass under the same processing; tokens outside the sampling support
(probability 0) are not listed.

A policy saved by a tracerl run is served as its run decoded it (its ``RolloutConfig``,
``rollout.settings.read_rollout``): a request that names no temperature, ``top_p``, ``top_k``
or token limit gets the run's (``max_turn_tokens`` per request); the run's system prompt
opens a conversation that has none; the tools' schemas are left out of the prompt when the
run left them out; and with ``constrain_calls`` every chat completion is decoded under the
tool-call grammar. The edit rule (``constrain_edits``) reads the environment's open file,
which a server does not see: it is not applied, and each attempt's metadata
says so (``decoding_rules_not_applied``).

Sessions: a request carrying the ``X-Tracerl-Session`` header (or, failing that, the ``user``
field) belongs to that session; its turns accumulate (see ``serve.recorder``) until
``POST /v1/sessions/{key}/finish`` writes the attempt with its ending and reward, or the server
stops and writes it as ``cancelled``. A request without a session is a one-turn attempt of its
own, written at once (``terminated``, or ``truncated_tokens`` when it hit its token limit).
"""

from __future__ import annotations

import asyncio
import inspect
import random
import threading
import time
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

from tracerl.rollout.policies.sampling import SamplingParams
from tracerl.rollout.serve.recorder import (
    Sample,
    SessionRecorder,
    normalize_message,
    parse_hermes_tool_calls,
)
from tracerl.rollout.serve.requests import (
    MAX_TOP_LOGPROBS,
    RequestError,
    int_field,
    sampling_from_request,
)
from tracerl.rollout.settings import RolloutConfig
from tracerl.trace.schema import EndReason
from tracerl.trace.schema import SamplingParams as TraceSamplingParams

SESSION_HEADER = "x-tracerl-session"
"""Request header naming the session a request belongs to (takes precedence over ``user``)."""
class ServedPolicy(Protocol):
    """What the server needs of a policy (``HFPolicy`` provides it)."""

    tokenizer: Any
    policy_version: int
    engine: str

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Any]:
        """One completion per prompt (``token_ids``, ``logprobs``, ``finish_reason``, ``text``)."""
        ...


class TracingServer:
    """The state behind the HTTP app: policy, recorder, a generation lock and request seeds.

    One generation runs at a time: the policy's model is not thread-safe, and the sampler
    already batches the ``n`` choices of a request.
    """

    def __init__(
        self,
        policy: ServedPolicy,
        recorder: SessionRecorder,
        *,
        model_name: str = "tracerl",
        default_max_tokens: int | None = None,
        seed: int | None = None,
        rollout: RolloutConfig | None = None,
    ) -> None:
        if default_max_tokens is None:
            default_max_tokens = rollout.max_turn_tokens if rollout is not None else 256
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
        self.policy = policy
        self.recorder = recorder
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.rollout = rollout
        """How the policy's run decoded (None: not a tracerl policy; requests decide)."""
        self.not_applied: tuple[str, ...] = tuple(
            name for name in ("constrain_edits",)
            if rollout is not None and getattr(rollout, name))
        """The run's decoding rules a server cannot apply (they read the environment's files)."""
        self._grammar: Any = None
        self._lock = threading.Lock()
        # Requests without a seed get one from this stream, so a seeded server is reproducible.
        self._seeds = random.Random(seed)
        self._row_seeds = "row_seeds" in inspect.signature(policy.generate).parameters
        self.created = int(time.time())

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    def request_defaults(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with the run's temperature, ``top_p`` and ``top_k`` where it names none."""
        if self.rollout is None:
            return body
        filled = dict(body)
        for key in ("temperature", "top_p", "top_k"):
            if filled.get(key) is None:
                filled[key] = getattr(self.rollout, key)
        return filled

    def conversation(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Messages and tools as the run rendered them: its system prompt first when the
        messages have none, and no tool schemas in the prompt when it showed none."""
        if self.rollout is None:
            return messages, tools
        if self.rollout.system_prompt and (not messages or messages[0].get("role") != "system"):
            messages = [{"role": "system", "content": self.rollout.system_prompt}, *messages]
        return messages, tools if self.rollout.show_tool_schemas else None

    def decoding_rule(self) -> Any:
        """The run's tool-call grammar (``constrain_calls``) for a chat completion, or None."""
        if self.rollout is None or not self.rollout.constrain_calls:
            return None
        if self._grammar is None:
            from tracerl.envs.tools import ARGUMENT_ALTERNATIVES, TOOL_SCHEMAS
            from tracerl.rollout.decoding.grammar import ToolCallGrammar, tool_specs

            model = getattr(self.policy, "model", None)
            if model is None:
                raise ValueError("constrain_calls: the served policy has no model to constrain")
            width = int(model.get_output_embeddings().weight.shape[0])
            end_ids = tuple(getattr(self.policy, "eos_ids", ()))
            self._grammar = ToolCallGrammar(tool_specs(TOOL_SCHEMAS, ARGUMENT_ALTERNATIVES),
                                            self.tokenizer, width, end_ids)
        return self._grammar.rule()

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("the served tokenizer has no chat template; use /v1/completions "
                               "with a text or token-id prompt")
        try:
            return str(self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                tokenize=False,
            ))
        except Exception as error:  # the template's own raise_exception, bad roles, ...
            raise RequestError(f"messages: the chat template refused them: {error}",
                               "messages") from error

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def completion_text(self, token_ids: Sequence[int]) -> str:
        """Text of sampled tokens without the tokenizer's special tokens.

        Decoded with ``skip_special_tokens=False`` after dropping the ids the tokenizer lists
        as special, so markers such as ``<tool_call>`` survive even when the tokenizer flags
        them special internally (the parser needs them).
        """
        special = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
        kept = [int(t) for t in token_ids if int(t) not in special]
        return str(self.tokenizer.decode(kept, skip_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def generate(self, prompts: list[list[int]], params: SamplingParams, rule: Any = None
                 ) -> tuple[list[Any], float]:
        """Sample one completion per prompt (each under ``rule``, a decoding rule, when one is
        given); returns (completions, wall seconds)."""
        with self._lock:
            if params.seed is None:
                params = _with_seed(params, self._seeds.randrange(2**62))
            start = time.perf_counter()
            extra: dict[str, Any] = {}
            if rule is not None:
                extra["constraints"] = [rule] * len(prompts)
            try:
                if self._row_seeds and len(prompts) > 1:
                    # Choice i of a seeded request is the same whatever n is.
                    seeds = [int(params.seed or 0) + i for i in range(len(prompts))]
                    completions = self.policy.generate(prompts, params, row_seeds=seeds,  # type: ignore[call-arg]
                                                       **extra)
                else:
                    completions = self.policy.generate(prompts, params, **extra)
            except ValueError as error:  # prompt too long, bad token ids: the client's input
                raise RequestError(str(error), "messages") from error
            return completions, time.perf_counter() - start

    def top_logprobs(self, prompt: list[int], completion: Any, params: SamplingParams,
                     k: int) -> list[list[tuple[int, float]]]:
        """Top-``k`` (token, logprob) per generated position, under the sampling processing."""
        import torch

        from tracerl.rollout.policies.sampling import processed_logprobs

        model = getattr(self.policy, "model", None)
        if model is None:
            raise RequestError("top_logprobs needs a local model; this policy has none",
                               "top_logprobs")
        tokens = list(completion.token_ids)
        if not tokens or k == 0:
            return [[] for _ in tokens]
        with self._lock, torch.inference_mode():
            was_training = model.training
            model.eval()
            try:
                ids = torch.tensor([prompt + tokens[:-1]], dtype=torch.long)
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 :]  # (T, V)
            finally:
                model.train(was_training)
            logprobs = processed_logprobs(logits, temperature=params.temperature,
                                          top_k=params.top_k, top_p=params.top_p)
            values, indices = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        return [
            [(int(i), float(v)) for v, i in zip(row_v.tolist(), row_i.tolist(), strict=True)
             if v != float("-inf")]
            for row_v, row_i in zip(values, indices, strict=True)
        ]


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def _trace_sampling(params: SamplingParams, constraint: str | None = None
                    ) -> TraceSamplingParams:
    return TraceSamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None,
        max_new_tokens=params.max_new_tokens, seed=params.seed, constraint=constraint,
    )


def _sample(server: TracingServer, completion: Any, params: SamplingParams,
            seconds: float, rule: Any = None, tool_calls: int = 0) -> Sample:
    return Sample(
        token_ids=tuple(completion.token_ids), logprobs=tuple(completion.logprobs),
        finish_reason=completion.finish_reason,
        policy_version=int(getattr(completion, "policy_version", server.policy.policy_version)),
        sampling=_trace_sampling(params, None if rule is None else str(rule.name)),
        engine=server.policy.engine, seconds=seconds, tool_calls=tool_calls,
    )


def _cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """OpenAI servers leave the stop string (and what follows) out of the returned text."""
    cut = min((text.find(s) for s in stop_strings if s in text), default=-1)
    return text if cut < 0 else text[:cut]


def _token_entry(server: TracingServer, token_id: int, logprob: float, as_ids: bool
                 ) -> dict[str, Any]:
    text = f"token_id:{token_id}" if as_ids else server.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _record_single(server: TracingServer, request_id: str, index: int, prompt: list[int],
                   sample: Sample, prompt_text: str = "") -> None:
    """A request without a session is a one-turn attempt of its own, written now."""
    key = f"{request_id}-{index}"
    server.recorder.record(key, prompt, sample, model=server.model_name)
    end = EndReason.TRUNCATED_TOKENS if sample.finish_reason == "length" else EndReason.TERMINATED
    server.recorder.finish(key, end=end, group_id=request_id, metadata=_served_metadata(server))


def _served_metadata(server: TracingServer) -> dict[str, Any] | None:
    """What an attempt's metadata says about the decoding rules the server left out."""
    return {"decoding_rules_not_applied": list(server.not_applied)} if server.not_applied else None


def chat_completion(server: TracingServer, body: dict[str, Any], session: str | None
                    ) -> dict[str, Any]:
    """Answer one ``/v1/chat/completions`` request (blocking; run it in a worker thread)."""
    if body.get("stream"):
        raise RequestError("stream=true is not supported; tracerl answers whole responses",
                           "stream")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RequestError("messages must be a non-empty list", "messages")
    try:
        messages = [normalize_message(m) for m in raw_messages]
    except ValueError as error:
        raise RequestError(str(error), "messages") from error
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools")
    messages, tools = server.conversation(messages, tools)
    params, n = sampling_from_request(server.request_defaults(body),
                                      default_max_tokens=server.default_max_tokens,
                                      stop_token_ids=None)
    if session is not None and n != 1:
        raise RequestError("a recorded session samples one choice per request (n=1); "
                           "branches belong to separate sessions", "n")
    want_logprobs = bool(body.get("logprobs"))
    top_k = int_field(body, "top_logprobs", 0, 0) or 0
    if top_k > MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs must be <= {MAX_TOP_LOGPROBS}", "top_logprobs")
    if top_k and not want_logprobs:
        raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    as_ids = bool(body.get("return_tokens_as_token_ids"))

    def render(msgs: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return server.render(msgs, tools, add_generation_prompt)

    prompt, prompt_text = server.recorder.chat_prompt(session, messages, render, server.encode)
    rule = server.decoding_rule()
    completions, seconds = server.generate([prompt] * n, params, rule)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = []
    for index, completion in enumerate(completions):
        text = _cut_at_stop(server.completion_text(completion.token_ids), params.stop_strings)
        content, calls = parse_hermes_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        finish = "tool_calls" if calls else completion.finish_reason
        choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish,
                                  "logprobs": None}
        if want_logprobs:
            tops = server.top_logprobs(prompt, completion, params, top_k) if top_k else None
            content_lp = []
            for position, (token_id, logprob) in enumerate(
                zip(completion.token_ids, completion.logprobs, strict=True)
            ):
                entry = _token_entry(server, int(token_id), float(logprob), as_ids)
                entry["top_logprobs"] = [
                    _token_entry(server, t, v, as_ids) for t, v in (tops[position] if tops else [])
                ]
                content_lp.append(entry)
            choice["logprobs"] = {"content": content_lp, "refusal": None}
        if body.get("return_token_ids"):
            choice["token_ids"] = list(completion.token_ids)
        choices.append(choice)
        sample = _sample(server, completion, params, seconds, rule, len(calls))
        if session is None:
            _record_single(server, request_id, index, prompt, sample)
        else:
            sampled_text = server.tokenizer.decode(list(completion.token_ids),
                                                   skip_special_tokens=False)
            server.recorder.record(
                session, prompt, sample, model=server.model_name, prompt_text=prompt_text,
                sampled_text=str(sampled_text), messages=[*messages, normalize_message(message)],
            )
    generated = sum(len(c.token_ids) for c in completions)
    response: dict[str, Any] = {
        "id": request_id, "object": "chat.completion", "created": int(time.time()),
        "model": server.model_name, "choices": choices,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": generated,
                  "total_tokens": len(prompt) + generated},
    }
    if body.get("return_token_ids"):
        response["prompt_token_ids"] = prompt
    return response


def _completion_prompts(server: TracingServer, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [server.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt:
        out = []
        for item in prompt:
            out.extend(_completion_prompts(server, item))
        return out
    raise RequestError("prompt must be text, token ids, or a non-empty list of either", "prompt")


def text_completion(server: TracingServer, body: dict[str, Any], session: str | None
                    ) -> dict[str, Any]:
    """Answer one ``/v1/completions`` request (blocking; run it in a worker thread)."""
    if body.get("stream"):
        raise RequestError("stream=true is not supported", "stream")
    if body.get("echo"):
        raise RequestError("echo=true is not supported", "echo")
    prompts = _completion_prompts(server, body.get("prompt"))
    params, n = sampling_from_request(server.request_defaults(body),
                                      default_max_tokens=server.default_max_tokens,
                                      stop_token_ids=None)
    if session is not None and n * len(prompts) != 1:
        raise RequestError("a recorded session samples one completion per request", "n")
    n_logprobs = int_field(body, "logprobs", None, 0)
    if n_logprobs is not None and n_logprobs > MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs must be <= {MAX_TOP_LOGPROBS}", "logprobs")
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    rows = [p for p in prompts for _ in range(n)]
    completions, seconds = server.generate(rows, params)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    choices = []
    for index, (prompt, completion) in enumerate(zip(rows, completions, strict=True)):
        text = _cut_at_stop(server.completion_text(completion.token_ids), params.stop_strings)
        choice: dict[str, Any] = {
            "index": index, "text": text, "finish_reason": completion.finish_reason,
            "stop_reason": getattr(completion, "stop_reason", None), "logprobs": None,
        }
        if n_logprobs is not None:
            tops = (server.top_logprobs(prompt, completion, params, n_logprobs)
                    if n_logprobs else None)
            tokens = [_token_entry(server, int(t), 0.0, as_ids)["token"]
                      for t in completion.token_ids]
            offsets, position = [], 0
            for token in tokens:
                offsets.append(position)
                position += len(token)
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": [float(x) for x in completion.logprobs],
                "top_logprobs": (
                    [{_token_entry(server, t, 0.0, as_ids)["token"]: v for t, v in row}
                     for row in tops] if tops is not None else None
                ),
                "text_offset": offsets,
            }
        if body.get("return_token_ids"):
            choice["token_ids"] = list(completion.token_ids)
            choice["prompt_token_ids"] = prompt
        choices.append(choice)
        sample = _sample(server, completion, params, seconds,
                         tool_calls=len(parse_hermes_tool_calls(text)[1]))
        if session is None:
            _record_single(server, request_id, index, prompt, sample)
        else:
            server.recorder.record(session, prompt, sample, model=server.model_name)
    generated = sum(len(c.token_ids) for c in completions)
    n_prompt = sum(len(p) for p in rows)
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()),
        "model": server.model_name, "choices": choices,
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": generated,
                  "total_tokens": n_prompt + generated},
    }


def create_app(server: TracingServer) -> Any:
    """The FastAPI app serving ``server``; open sessions are written ``cancelled`` at shutdown."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        yield
        server.recorder.finish_all(EndReason.CANCELLED, metadata=_served_metadata(server))

    app = FastAPI(title="tracerl", lifespan=lifespan)

    def error(status: int, message: str, param: str | None = None,
              kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(status_code=status, content={
            "error": {"message": message, "type": kind, "param": param, "code": None}})

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestError("the request body is not valid JSON") from exc
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    def session_of(request: Request, body: dict[str, Any]) -> str | None:
        key = request.headers.get(SESSION_HEADER) or body.get("user")
        if key is not None and (not isinstance(key, str) or not key.strip()):
            raise RequestError("the session key (header or user) must be a non-empty string",
                               "user")
        return key

    async def answer(request: Request, handler: Any) -> JSONResponse:
        try:
            body = await body_of(request)
            session = session_of(request, body)
            result = await asyncio.to_thread(handler, server, body, session)
        except RequestError as exc:
            return error(400, str(exc), exc.param)
        return JSONResponse(result)

    # Plain Starlette routes: the handlers read the body themselves (OpenAI-style 400s rather
    # than FastAPI's 422s), and nothing depends on resolving postponed annotations.
    async def chat(request: Request) -> JSONResponse:
        return await answer(request, chat_completion)

    async def completions(request: Request) -> JSONResponse:
        return await answer(request, text_completion)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created,
            "owned_by": "tracerl", "policy_version": server.policy.policy_version}]})

    async def session_info(request: Request) -> JSONResponse:
        try:
            return JSONResponse(server.recorder.session_summary(request.path_params["key"]))
        except ValueError as exc:
            return error(404, str(exc), "session", "not_found_error")

    async def finish(request: Request) -> JSONResponse:
        key = request.path_params["key"]
        try:
            body = await body_of(request) if await request.body() else {}
            reward = body.get("reward")
            if reward is not None and not isinstance(reward, (int, float)):
                raise RequestError("reward must be a number", "reward")
            metadata = body.get("metadata")
            if metadata is not None and not isinstance(metadata, dict):
                raise RequestError("metadata must be a JSON object", "metadata")
            attempt = await asyncio.to_thread(
                server.recorder.finish, key, end=body.get("end_reason", "terminated"),
                reward=None if reward is None else float(reward), task_id=body.get("task_id"),
                group_id=body.get("group_id"),
                metadata={**(_served_metadata(server) or {}), **(metadata or {})},
            )
        except ValueError as exc:
            status = 404 if "no open session" in str(exc) else 400
            return error(status, str(exc), "session")
        return JSONResponse({
            "attempt_id": attempt.attempt_id, "end_reason": attempt.end_reason.value,
            "fragments": len(attempt.fragments),
            "turns": sum(len(f.turns) for f in attempt.fragments),
            "generated_tokens": attempt.costs.generated_tokens})

    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/v1/sessions/{key:path}/finish", finish, methods=["POST"])
    app.add_route("/v1/sessions/{key:path}", session_info, methods=["GET"])
    return app


def run_server(server: TracingServer, *, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "warning") -> None:
    """Serve until interrupted (uvicorn); open sessions are written ``cancelled`` on the way out."""
    import uvicorn

    uvicorn.run(create_app(server), host=host, port=port, log_level=log_level)
