from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tracerl.eval.judge import (
    DEFAULT_PROMPT,
    Judge,
    JudgeConfig,
    independence_warning,
    parse_score,
)


class RuleJudge(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint whose 'model' grades by a rule: 1 if the transcript
    submitted, else 0. It records the requests it received."""

    requests: list[dict[str, Any]] = []  # noqa: RUF012

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        RuleJudge.requests.append(body)
        text = body["messages"][-1]["content"]
        answer = "1" if "submit" in text.split("Transcript of the attempt:")[1] else "0.0"
        payload = json.dumps({
            "id": "x", "object": "chat.completion", "created": 0, "model": "rule-judge-1",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": answer}}],
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), RuleJudge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_judge_scores_through_the_openai_client_and_records_model_and_prompt(
        endpoint: str) -> None:
    config = JudgeConfig(base_url=endpoint, model="rule-judge")
    judge = Judge(config)
    good = judge.score("Fix add.", '[AGENT] <tool_call>{"name": "submit"}</tool_call>')
    bad = judge.score("Fix add.", "[AGENT] nothing")
    assert (good.score, bad.score) == (1.0, 0.0)
    assert good.model == "rule-judge-1" and good.prompt_sha256 == config.prompt_sha256
    sent = RuleJudge.requests[-1]
    assert sent["model"] == "rule-judge" and sent["temperature"] == 0.0
    assert sent["messages"][0]["content"].startswith(DEFAULT_PROMPT.split("{")[0])
    recorded = config.to_dict()
    assert recorded["prompt"] == DEFAULT_PROMPT and "api_key" not in json.dumps(recorded)


def test_same_judge_for_training_and_evaluation_is_warned_about() -> None:
    train = JudgeConfig(base_url="http://judge:8000/v1", model="grader")
    assert independence_warning(train, train) is not None
    reworded = JudgeConfig(base_url="http://judge:8000/v1/", model="grader",
                           prompt="Grade {instruction} given {transcript}")
    warning = independence_warning(train.to_dict(), reworded)
    assert warning is not None and "reworded prompt" in warning
    other = JudgeConfig(base_url="http://judge:8000/v1", model="another-grader")
    assert independence_warning(train, other) is None
    assert independence_warning(None, train) is None


@pytest.mark.parametrize(("answer", "score"), [("0.75", 0.75), ("Score: 1", 1.0), (".5\n", 0.5)])
def test_parse_score(answer: str, score: float) -> None:
    assert parse_score(answer) == score


@pytest.mark.parametrize("answer", ["yes", "7", "-0.5"])
def test_parse_score_refuses_answers_that_are_not_scores(answer: str) -> None:
    with pytest.raises(ValueError, match="judge"):
        parse_score(answer)


def test_judge_config_refuses_bad_fields() -> None:
    with pytest.raises(ValueError, match="base_url"):
        JudgeConfig(base_url="judge:8000", model="m")
    with pytest.raises(ValueError, match="transcript"):
        JudgeConfig(base_url="http://j/v1", model="m", prompt="{instruction}")
    with pytest.raises(ValueError, match="unknown keys"):
        JudgeConfig.from_dict({"base_url": "http://j/v1", "model": "m", "temprature": 0})
