"""What the agent did, turn by turn: edits that applied, and what followed a failing test run.

Success says whether an attempt solved its task; it does not say whether the policy tests its
edits, reads a FAIL and tries again, or submits a version it knows fails. Those are the
multi-turn skills demonstrations of one edit do not teach, and the ones RL is expected to
add. ``behaviour`` reads them from the recorded actions and observations:

- ``edits``: ``replace`` calls, and the share that applied (``OK``) rather than erring
  (``old`` not found, line out of range, refused by the syntax guard, a change of nothing...).
- ``malformed``: actions with no valid tool call (bad JSON, unknown tool, bad arguments).
- ``after_fail``: the next action after each ``run_tests`` that answered ``FAIL``, counted by
  tool (``undo``, ``restart``, ``replace``, ``submit``, ``run_tests``, ``view_file``, ...;
  ``malformed``; ``none`` when the attempt ran out of turns there), with shares.
  ``after_fail.retry`` is the share that tried again (``undo``, ``restart`` or ``replace``).
- ``after_edit``: the next action after each ``replace`` that applied: ``run_tests`` (checks
  its edit) or ``submit`` (submits it untested), ...

Reading the texts needs the policy's tokenizer (``decode``); the parse is the environment's own
(``parse_tool_call``), so a call counts as the environment counted it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from tracerl.envs.tools import parse_tool_call
from tracerl.trace.schema import Attempt, Role


class Decoder(Protocol):
    """Anything that turns token ids back into text (``HFPolicy``, a tokenizer wrapper)."""

    def decode(self, token_ids: Sequence[int]) -> str: ...


def _steps(decoder: Decoder, attempt: Attempt) -> list[tuple[str, str | None]]:
    """(tool name or ``malformed``, the observation that came back or None) per action."""
    steps: list[tuple[str, str | None]] = []
    for fragment in attempt.fragments:
        pending: str | None = None
        for turn in fragment.turns:
            for segment in turn.segments:
                if segment.role not in (Role.ACTION, Role.OBSERVATION):
                    continue  # the task statement, a summary of compacted turns
                text = decoder.decode(segment.token_ids.tolist())
                if segment.role is Role.ACTION:
                    if pending is not None:
                        steps.append((pending, None))
                    call = parse_tool_call(text).call
                    pending = "malformed" if call is None else call.name
                elif pending is not None:
                    steps.append((pending, text.lstrip()))
                    pending = None
        if pending is not None:  # the observation after the last action, if it was recorded
            tail = decoder.decode(fragment.continuation_ids.tolist()).lstrip()
            steps.append((pending, tail or None))
    return steps


def _shares(counts: Counter[str]) -> dict[str, Any]:
    total = sum(counts.values())
    return {"count": total,
            "next": {k: v / total for k, v in counts.most_common()} if total else {}}


def behaviour(decoder: Decoder, attempts: Sequence[Attempt]) -> dict[str, Any]:
    """Edit, test and recovery statistics of ``attempts`` (see the module docstring)."""
    actions = malformed = edits = applied = 0
    after_fail: Counter[str] = Counter()
    after_edit: Counter[str] = Counter()
    for attempt in attempts:
        steps = _steps(decoder, attempt)
        for i, (tool, observation) in enumerate(steps):
            actions += 1
            malformed += tool == "malformed"
            following = steps[i + 1][0] if i + 1 < len(steps) else "none"
            if tool == "replace" and observation is not None:
                edits += 1
                if observation.startswith("OK"):
                    applied += 1
                    after_edit[following] += 1
            elif tool == "run_tests" and observation is not None and observation.startswith(
                    "FAIL"):
                after_fail[following] += 1
    fail = _shares(after_fail)
    retried = after_fail["undo"] + after_fail["restart"] + after_fail["replace"]
    fail["retry"] = retried / fail["count"] if fail["count"] else None
    return {"actions": actions, "malformed": malformed / actions if actions else None,
            "edits": edits, "edits_applied": applied / edits if edits else None,
            "after_fail": fail, "after_edit": _shares(after_edit)}
