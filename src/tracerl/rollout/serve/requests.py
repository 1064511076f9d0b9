"""What an OpenAI-style request to ``tracerl serve`` asks for, checked: its sampling
parameters and ``n``, and its integer fields. A bad field is a :class:`RequestError`, which
the server answers with 400 and an OpenAI-style error body naming the field.
"""

from __future__ import annotations

from typing import Any

from tracerl.rollout.policies.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20
"""Most alternatives per position, as in the OpenAI API."""


class RequestError(ValueError):
    """A bad request: answered 400 with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def int_field(body: dict[str, Any], name: str, default: int | None, low: int) -> int | None:
    """``body[name]``, an integer >= ``low`` (``default`` when absent or null)."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise RequestError(f"{name} must be an integer >= {low}, got {value!r}", name)
    return value


def sampling_from_request(
    body: dict[str, Any], *, default_max_tokens: int, stop_token_ids: tuple[int, ...] | None
) -> tuple[SamplingParams, int]:
    """SamplingParams and ``n`` from an OpenAI request body (RequestError on bad fields)."""
    stop = body.get("stop")
    if stop is None:
        stop_strings: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stop_strings = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop_strings = tuple(stop)
    else:
        raise RequestError("stop must be a string or a list of strings", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    if body.get("ignore_eos"):
        stop_token_ids = ()
    extra_stop_ids = body.get("stop_token_ids")
    if extra_stop_ids is not None:
        if not isinstance(extra_stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in extra_stop_ids
        ):
            raise RequestError("stop_token_ids must be a list of token ids", "stop_token_ids")
        stop_token_ids = tuple(stop_token_ids or ()) + tuple(extra_stop_ids)
    try:
        params = SamplingParams(
            temperature=float(body.get("temperature", 1.0) if body.get("temperature") is not None
                              else 1.0),
            top_p=float(body.get("top_p", 1.0) if body.get("top_p") is not None else 1.0),
            top_k=max(0, int(body.get("top_k") or 0)),
            max_new_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            stop_strings=tuple(s for s in stop_strings if s),
            seed=body.get("seed"),
        )
    except (ValueError, TypeError) as error:
        raise RequestError(str(error)) from error
    n = int_field(body, "n", 1, 1)
    assert n is not None
    return params, n
