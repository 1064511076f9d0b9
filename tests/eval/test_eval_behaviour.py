"""Behaviour statistics read from recorded attempts: edits that applied, and what followed
a failing test run or an applied edit."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tracerl.eval.behaviour import behaviour
from tracerl.models.tiny import render_tool_call
from tracerl.trace import Attempt, EndReason, Fragment, Role, SamplingParams, Segment, Turn


class OneTokenPerText:
    """A decoder whose every token id stands for one whole text."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def id_of(self, text: str) -> int:
        self.texts.append(text)
        return len(self.texts) - 1

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self.texts[i] for i in token_ids)


def build(decoder: OneTokenPerText, name: str,
          steps: list[tuple[str, str | None]]) -> Attempt:
    """An attempt of ``(action text, observation or None)`` steps, recorded as the collector
    records them: each turn is the context it saw, then its action."""
    turns, context = [], Segment(Role.PROMPT, [decoder.id_of("Fix f.\nFiles:\nf.py")])
    last: list[int] = []  # what followed the last action (a truncated attempt's last answer)
    for action, observation in steps:
        sampled = Segment(Role.ACTION, [decoder.id_of(action)], logprobs=[-0.1],
                          sampling=SamplingParams(temperature=1.0), policy_version=0,
                          engine="test")
        turns.append(Turn((context, sampled)))
        if observation is not None:
            context = Segment(Role.OBSERVATION, [decoder.id_of(observation)])
            last = [context.token_ids[0]]
        else:
            last = []
    ending = EndReason.TERMINATED if '"submit"' in steps[-1][0] else EndReason.TRUNCATED_TURNS
    return Attempt(name, "t", "g", (Fragment(0, tuple(turns), ending, last),), reward=0.0)


def call(name: str, **arguments: object) -> str:
    return render_tool_call(name, dict(arguments))


def test_behaviour_counts_edits_and_what_follows_fail_and_ok() -> None:
    decoder = OneTokenPerText()
    view = (call("view_file"), "1: def f(n):\n2:     return n + 1")
    ok = (call("replace", line=2, old="+", new="-"), "OK")
    miss = (call("replace", line=2, old="*", new="-"),
            "error: replace: old text not found in line 2 of f.py:\n2:     return n + 1")
    fail = (call("run_tests"), "FAIL\nf(1) got 2 want 0")
    attempts = [
        # Tests its edit, sees FAIL, undoes, misses once, edits again, passes, submits.
        build(decoder, "a", [view, ok, fail, (call("undo"), "OK\n2:     return n + 1"), miss,
                             ok, (call("run_tests"), "PASS"), (call("submit"), None)]),
        build(decoder, "b", [view, ok, (call("submit"), None)]),            # submits untested
        build(decoder, "c", [view, ok, fail, (call("submit"), None)]),      # submits a FAIL
        # A malformed call, then a FAIL with no turn left to act on it.
        build(decoder, "d", [view, ('<tool_call>{"name": "replace", "arg', "error: tool call "
                                    "is not valid JSON"), fail]),
    ]
    result = behaviour(decoder, attempts)
    assert result["actions"] == 8 + 3 + 4 + 3
    assert result["malformed"] == pytest.approx(1 / 18)
    assert result["edits"] == 5 and result["edits_applied"] == pytest.approx(4 / 5)
    assert result["after_edit"] == {"count": 4, "next": {"run_tests": 0.75, "submit": 0.25}}
    after_fail = result["after_fail"]
    assert after_fail["count"] == 3 and after_fail["retry"] == pytest.approx(1 / 3)
    assert after_fail["next"] == pytest.approx({"undo": 1 / 3, "submit": 1 / 3, "none": 1 / 3})


def test_behaviour_of_no_attempts_has_no_rates() -> None:
    result = behaviour(OneTokenPerText(), [])
    assert result["actions"] == 0 and result["malformed"] is None
    assert result["edits_applied"] is None and result["after_fail"]["retry"] is None


def test_restart_counts_as_trying_again_across_contexts() -> None:
    decoder = OneTokenPerText()
    view = (call("view_file"), "1: def f(n):\n2:     return n + 1")
    ok = (call("replace", line=2, old="+", new="-"), "OK")
    given_up = build(decoder, "a", [view, ok, (call("run_tests"), "FAIL\nf(1) got 0 want 2"),
                                    (call("restart"), None)]).fragments[0]
    fresh = build(decoder, "a", [view, ok, (call("run_tests"), "PASS"),
                                 (call("submit"), None)]).fragments[0]
    attempt = Attempt("a", "t", "g", (
        Fragment(0, given_up.turns, EndReason.CONTINUED),
        Fragment(1, fresh.turns, EndReason.TERMINATED)), reward=1.0)
    result = behaviour(decoder, [attempt])
    assert result["actions"] == 8 and result["edits"] == 2
    assert result["after_fail"] == {"count": 1, "next": {"restart": 1.0}, "retry": 1.0}
    assert result["after_edit"] == {"count": 2, "next": {"run_tests": 1.0}}
