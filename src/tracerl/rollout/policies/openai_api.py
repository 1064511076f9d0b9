"""A policy whose tokens come from an external OpenAI-compatible server (vLLM, SGLang, tracerl).

``OpenAIPolicy.generate`` has the signature of ``HFPolicy.generate``: prompts go out as token
ids and completions come back as token ids with per-token logprobs, so nothing is re-tokenized
between the server's sampler and the trace. It uses the legacy ``/v1/completions`` endpoint,
which (unlike chat) accepts a prompt of token ids, and asks for

- ``logprobs=0`` (the sampled token's logprob, no alternatives), and
- ``return_tokens_as_token_ids=true`` (vLLM's option; tokens come back as ``"token_id:<id>"``),
  or, with ``token_ids="field"``, ``return_token_ids=true`` (newer vLLM: a ``token_ids`` list
  per choice).

Behavior logprobs are only the sampling distribution's if the server reports them so: start
vLLM with ``--logprobs-mode processed_logprobs`` (its default reports the raw model
distribution, before temperature/top-k/top-p). ``tracerl serve`` always reports processed
logprobs. At temperature 0 the policy records 0 (the point mass greedy decoding draws from)
whatever the server reports: vLLM reports the log-softmax there. See ``docs/serving.md``.

Failures are clear errors, never hangs: ``EndpointUnreachable`` (nothing listens, DNS),
``EndpointTimeout`` (no answer within ``timeout`` seconds), ``EndpointResponseError`` (an error
status, or a response without logprobs or token ids).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from tracerl.rollout.policies.sampling import Completion, SamplingParams

TokenIdsMode = Literal["tokens", "field"]
"""How the server returns sampled token ids: ``"tokens"`` = vLLM's
``return_tokens_as_token_ids`` (``"token_id:<id>"`` strings in ``logprobs.tokens``); ``"field"``
= ``return_token_ids`` (a ``token_ids`` list on each choice)."""


class EndpointError(RuntimeError):
    """The server could not give a usable completion."""


class EndpointUnreachable(EndpointError, ConnectionError):
    """Nothing answered at the base URL (refused, reset, unknown host)."""


class EndpointTimeout(EndpointError, TimeoutError):
    """The server did not answer within the timeout."""


class EndpointResponseError(EndpointError, ValueError):
    """The server answered with an error status or without logprobs / token ids."""


@dataclass(frozen=True)
class OpenAIPolicyConfig:
    """Where the server is and how to talk to it."""

    base_url: str
    """Base URL including ``/v1``, e.g. ``http://gpu-host:8000/v1``."""
    model: str
    """Model name the server serves (``GET /v1/models`` lists it)."""
    api_key: str = "EMPTY"
    """Bearer token; vLLM ignores it unless started with ``--api-key``."""
    timeout: float = 120.0
    """Seconds to wait for one completion before ``EndpointTimeout``."""
    max_retries: int = 0
    """Retries of a failed request by the ``openai`` client (0: fail at once, the caller decides)."""
    concurrency: int = 16
    """Prompts of one ``generate`` call in flight at once (one request each)."""
    token_ids: TokenIdsMode = "tokens"
    """How sampled token ids come back (see ``TokenIdsMode``)."""
    engine: str = "vllm"
    """Engine name stamped on the samples (``vllm``, ``sglang``, ``tracerl``)."""
    context_length: int | None = None
    """The served model's context (``--max-model-len``), for the collector's budget; None:
    unknown, the server refuses prompts that do not fit."""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if not self.model:
            raise ValueError("model must be a non-empty model name")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1 or None, got {self.context_length}")
        if self.token_ids not in ("tokens", "field"):
            raise ValueError(f"token_ids must be 'tokens' or 'field', got {self.token_ids!r}")


def _get(obj: Any, name: str) -> Any:
    """Field of a response object or dict; extra fields of pydantic models live in model_extra."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None) or {}
        value = extra.get(name)
    return value


def parse_token_id(token: str) -> int:
    """The id in a ``"token_id:<id>"`` token string (EndpointResponseError otherwise)."""
    prefix, _, number = token.partition(":")
    if prefix != "token_id" or not number.lstrip("-").isdigit():
        raise EndpointResponseError(
            f"token {token!r} is not 'token_id:<id>'; the server ignored "
            "return_tokens_as_token_ids (use token_ids='field' for servers with return_token_ids)"
        )
    return int(number)


class OpenAIPolicy:
    """Sampling through an OpenAI-compatible ``/v1/completions`` endpoint, token ids in and out.

    ``tokenizer`` (optional, the served model's) gives ``chat_prompt`` and ``decode`` so that a
    collector can build token prompts locally; the server sees token ids only.
    """

    def __init__(self, config: OpenAIPolicyConfig, *, tokenizer: Any = None,
                 policy_version: int = 0) -> None:
        try:
            import openai
        except ImportError as error:  # the openai extra
            raise ImportError("OpenAIPolicy needs the openai package: pip install "
                              "'tracerl[openai]'") from error
        self.config = config
        self.tokenizer = tokenizer
        self.engine: str = config.engine
        """Engine name stamped on the segments this policy produces."""
        self.policy_version: int = policy_version
        """Version of the served weights; whoever syncs weights to the server bumps it."""
        self.context_length: int | None = config.context_length
        """Longest prompt + completion the server accepts, when known."""
        self._openai = openai
        self._client = openai.OpenAI(base_url=config.base_url, api_key=config.api_key,
                                     timeout=config.timeout, max_retries=config.max_retries)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` under the local tokenizer's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat_prompt needs a tokenizer with a chat template (tokenizer=...)")
        ids = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False)
        return [int(i) for i in ids]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (local tokenizer), without special tokens."""
        if self.tokenizer is None:
            raise ValueError("decode needs a tokenizer (tokenizer=...)")
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 row_seeds: Sequence[int] | None = None) -> list[Completion]:
        """One completion per prompt (token ids), in order; one request per prompt.

        Each request carries its own seed: ``row_seeds[i]`` when given (the collector's
        per-attempt seeds), else ``params.seed + i`` when ``params.seed`` is set, so a prompt's
        sample does not depend on which other prompts share the call.
        """
        if isinstance(prompts, (str, bytes)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        checked = []
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, (str, bytes)) or not prompt:
                raise ValueError(f"prompt {index} must be a non-empty list of token ids")
            checked.append([int(t) for t in prompt])
        seeds: list[int | None]
        if row_seeds is not None:
            if len(row_seeds) != len(checked):
                raise ValueError(f"row_seeds has {len(row_seeds)} seeds for {len(checked)} prompts")
            seeds = [int(s) for s in row_seeds]
        else:
            seeds = [None if params.seed is None else params.seed + i
                     for i in range(len(checked))]
        workers = min(self.config.concurrency, len(checked))
        if workers == 1:
            return [self._one(checked[0], params, seeds[0])]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda a: self._one(a[0], params, a[1]), zip(checked, seeds, strict=True)))

    def _request(self, prompt: list[int], params: SamplingParams, seed: int | None) -> Any:
        extra: dict[str, Any] = {"top_k": params.top_k if params.top_k else -1}
        if self.config.token_ids == "tokens":
            extra["return_tokens_as_token_ids"] = True
        else:
            extra["return_token_ids"] = True
        if params.stop_token_ids is not None:
            extra["stop_token_ids"] = list(params.stop_token_ids)
            # vLLM also stops at EOS unless told otherwise; an explicit list is the whole list.
            extra["ignore_eos"] = True
        openai = self._openai
        try:
            return self._client.completions.create(
                model=self.config.model, prompt=prompt, max_tokens=params.max_new_tokens,
                temperature=params.temperature, top_p=params.top_p, logprobs=0, n=1,
                seed=seed, stop=list(params.stop_strings) or None, extra_body=extra,
            )
        except openai.APITimeoutError as error:
            raise EndpointTimeout(
                f"{self.config.base_url} did not answer within {self.config.timeout:g} s "
                f"(model {self.config.model!r}); raise timeout= or check the server's load"
            ) from error
        except openai.APIConnectionError as error:
            raise EndpointUnreachable(
                f"cannot reach {self.config.base_url}: {error.__cause__ or error}; is the "
                "server running (see docs/serving.md for the vLLM command)?"
            ) from error
        except openai.APIStatusError as error:
            raise EndpointResponseError(
                f"{self.config.base_url} answered {error.status_code}: {error.message}"
            ) from error

    def _one(self, prompt: list[int], params: SamplingParams, seed: int | None) -> Completion:
        response = self._request(prompt, params, seed)
        choices = _get(response, "choices") or []
        if len(choices) != 1:
            raise EndpointResponseError(f"expected 1 choice, the server returned {len(choices)}")
        choice = choices[0]
        logprobs = _get(choice, "logprobs")
        token_logprobs = None if logprobs is None else _get(logprobs, "token_logprobs")
        if token_logprobs is None:
            raise EndpointResponseError(
                f"the response from {self.config.base_url} has no logprobs; the server must "
                "support logprobs on /v1/completions (behavior logprobs cannot be recovered "
                "afterwards)"
            )
        if self.config.token_ids == "tokens":
            token_ids = [parse_token_id(str(t)) for t in (_get(logprobs, "tokens") or [])]
        else:
            raw = _get(choice, "token_ids")
            if raw is None:
                raise EndpointResponseError("the response has no token_ids; the server ignored "
                                            "return_token_ids (try token_ids='tokens')")
            token_ids = [int(t) for t in raw]
        if len(token_ids) != len(token_logprobs):
            raise EndpointResponseError(
                f"{len(token_ids)} token ids but {len(token_logprobs)} logprobs in the response")
        values = []
        for position, value in enumerate(token_logprobs):
            if value is None or not math.isfinite(value) or value > 0.0:
                raise EndpointResponseError(f"logprob {value!r} at position {position} is not a "
                                            "log-probability (a finite number <= 0)")
            values.append(float(value))
        if params.greedy:
            # Greedy decoding draws from a point mass on the arg-max: its behavior logprob is 0,
            # as HFPolicy records it. vLLM reports the model's log-softmax at temperature 0
            # instead (the token's probability before the arg-max was taken), which is not the
            # probability the token was sampled with.
            values = [0.0] * len(values)
        finish = _get(choice, "finish_reason")
        if finish not in ("stop", "length"):
            raise EndpointResponseError(f"finish_reason {finish!r}: the server did not complete "
                                        "the request")
        stop_reason = _get(choice, "stop_reason")
        text = _get(choice, "text") or ""
        return Completion(
            token_ids=tuple(token_ids), logprobs=tuple(values), finish_reason=finish,
            text=self.decode(token_ids) if self.tokenizer is not None else str(text),
            stop_reason=stop_reason if isinstance(stop_reason, (int, str)) else None,
            policy_version=self.policy_version,
        )
