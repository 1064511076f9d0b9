"""An optional model-based judge, over any OpenAI-compatible chat endpoint.

Tests are the default verifier. A judge scores what tests cannot (readability, whether the fix
is the intended one), as a training reward or as an evaluation score. Its model, endpoint and
prompt are recorded with every score, and :func:`independence_warning` says so when the same
judge both trained a policy and evaluates it: a policy optimised against a judge learns that
judge's blind spots, so the judge's later approval is no independent validation.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_PROMPT = (
    "You grade an attempt at a coding task. Answer with one number between 0 and 1: the "
    "probability that the attempt solves the task as asked, without editing tests or reading "
    "hidden answers. Answer with the number only.\n\n"
    "Task:\n{instruction}\n\nTranscript of the attempt:\n{transcript}\n"
)
"""The default prompt; ``{instruction}`` and ``{transcript}`` are filled in."""

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)")


@dataclass(frozen=True)
class JudgeConfig:
    """Where the judge runs and what it is asked."""

    base_url: str
    """OpenAI-compatible endpoint, e.g. ``http://localhost:8000/v1``."""
    model: str
    """Model name sent with each request (recorded with every score)."""
    prompt: str = DEFAULT_PROMPT
    """Prompt template with ``{instruction}`` and ``{transcript}`` fields."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key (a placeholder is sent when it is unset)."""
    temperature: float = 0.0
    """Sampling temperature of the judge; 0 makes its scores repeatable where the server is."""
    max_tokens: int = 16
    """Longest answer; the score is the first number in it."""
    timeout_seconds: float = 60.0
    """Per-request timeout."""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {self.base_url!r}")
        if not self.model:
            raise ValueError("model must be a non-empty string")
        for field_name in ("{instruction}", "{transcript}"):
            if field_name not in self.prompt:
                raise ValueError(f"prompt must contain {field_name}")
        if self.max_tokens < 1 or self.timeout_seconds <= 0 or self.temperature < 0:
            raise ValueError("max_tokens must be >= 1, timeout_seconds > 0, temperature >= 0")

    @property
    def prompt_sha256(self) -> str:
        return hashlib.sha256(self.prompt.encode("utf-8")).hexdigest()

    def identity(self) -> dict[str, str]:
        """What makes two judges the same judge: endpoint, model and prompt."""
        return {"base_url": self.base_url.rstrip("/"), "model": self.model,
                "prompt_sha256": self.prompt_sha256}

    def to_dict(self) -> dict[str, Any]:
        """JSON record of the judge (the key itself is never recorded)."""
        return {"base_url": self.base_url, "model": self.model, "prompt": self.prompt,
                "prompt_sha256": self.prompt_sha256, "temperature": self.temperature,
                "max_tokens": self.max_tokens}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JudgeConfig:
        known = {"base_url", "model", "prompt", "api_key_env", "temperature", "max_tokens",
                 "timeout_seconds"}
        unknown = sorted(set(data) - known - {"prompt_sha256"})
        if unknown:
            raise ValueError(f"judge: unknown keys {unknown}; accepted: {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class JudgeScore:
    """One judgement, with what produced it."""

    score: float
    """The judge's number, in [0, 1]."""
    answer: str
    """The judge's raw answer."""
    model: str
    """The model that answered (as the server reported it)."""
    prompt_sha256: str
    """Hash of the prompt template used."""


def parse_score(answer: str) -> float:
    """The first number of ``answer``, which must lie in [0, 1]."""
    match = _NUMBER.search(answer)
    if match is None:
        raise ValueError(f"judge answer holds no number: {answer[:80]!r}")
    value = float(match.group())
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"judge score must be in [0, 1], got {value} from {answer[:80]!r}")
    return value


class Judge:
    """Scores attempts by asking a chat model (``openai`` client; ``pip install tracerl[openai]``)."""

    def __init__(self, config: JudgeConfig) -> None:
        try:
            from openai import OpenAI
        except ImportError as error:  # pragma: no cover - depends on the install
            raise ValueError("the judge needs the openai package: pip install tracerl[openai]"
                             ) from error
        self.config = config
        self._client = OpenAI(base_url=config.base_url,
                              api_key=os.environ.get(config.api_key_env) or "unused",
                              timeout=config.timeout_seconds, max_retries=1)

    def score(self, instruction: str, transcript: str) -> JudgeScore:
        """Ask the judge about one attempt."""
        config = self.config
        content = config.prompt.format(instruction=instruction, transcript=transcript)
        response = self._client.chat.completions.create(
            model=config.model, messages=[{"role": "user", "content": content}],
            temperature=config.temperature, max_tokens=config.max_tokens)
        answer = response.choices[0].message.content or ""
        return JudgeScore(parse_score(answer), answer, response.model or config.model,
                          config.prompt_sha256)


def judge_identity(judge: JudgeConfig | Mapping[str, Any] | None) -> dict[str, str] | None:
    """The identity of a judge given as a config or as its recorded dict."""
    if judge is None:
        return None
    if isinstance(judge, JudgeConfig):
        return judge.identity()
    prompt = judge.get("prompt")
    digest = judge.get("prompt_sha256") or (
        hashlib.sha256(prompt.encode("utf-8")).hexdigest() if isinstance(prompt, str) else "")
    return {"base_url": str(judge.get("base_url", "")).rstrip("/"),
            "model": str(judge.get("model", "")), "prompt_sha256": str(digest)}


def independence_warning(training: JudgeConfig | Mapping[str, Any] | None,
                         evaluation: JudgeConfig | Mapping[str, Any] | None) -> str | None:
    """A warning when the training reward's judge is also the evaluation's, else None.

    The same model behind the same endpoint counts as the same judge even with a reworded
    prompt: rewording does not remove the blind spots the policy was trained into.
    """
    train_id, eval_id = judge_identity(training), judge_identity(evaluation)
    if train_id is None or eval_id is None:
        return None
    if train_id["model"] != eval_id["model"] or train_id["base_url"] != eval_id["base_url"]:
        return None
    same_prompt = train_id["prompt_sha256"] == eval_id["prompt_sha256"]
    return (f"the judge that scores this evaluation ({eval_id['model']} at "
            f"{eval_id['base_url']}{', same prompt' if same_prompt else ', reworded prompt'}) "
            "also produced the training reward: its score is no independent validation; "
            "rely on the hidden tests")
