"""From recorded attempts to the numbers of a fixed-budget evaluation.

Success is decided here, once: an attempt succeeded when the verifier ran, its hidden tests
passed, and the audit did not flag it. Anything else, including an attempt that never reached
the verifier (a tool error, a cancellation), is not a success. Means are over every attempt
of the fixed budget; infrastructure failures are also reported apart, so that their effect
on the headline number is visible rather than hidden.

Attempts into which tool faults were injected (``metadata["injected_faults"]``, recorded by
the collector) are counted, with how many of them still succeeded: recovery, measured.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from tracerl.eval.audit import hack_flag, hack_flags, hack_summary
from tracerl.eval.stats import bootstrap_ci, paired_bootstrap_ci, pass_at_k_table
from tracerl.trace.schema import ATTEMPT_ENDINGS, Attempt, EndReason

INFRASTRUCTURE_ENDINGS = frozenset({EndReason.TOOL_ERROR, EndReason.CANCELLED})
"""Endings that are the infrastructure's doing, not the policy's."""

_VISIBLE_KEYS = ("visible_pass", "visible_passed", "visible")
_HIDDEN_KEYS = ("hidden_pass", "hidden_passed", "hidden")


def _detail(attempt: Attempt, keys: Sequence[str]) -> bool | None:
    """A named pass/fail sub-score from the verifier's details or the reward components."""
    sources: list[Mapping[str, float]] = []
    if attempt.verifier is not None:
        sources.append(attempt.verifier.details)
    sources.append(attempt.rewards)
    for source in sources:
        for key in keys:
            if key in source:
                return bool(source[key] >= 1.0)
    return None


def hidden_passed(attempt: Attempt) -> bool:
    """The hidden tests passed (the verifier's verdict); False when no verifier ran."""
    if attempt.verifier is None:
        return False
    named = _detail(attempt, _HIDDEN_KEYS)
    return attempt.verifier.passed if named is None else named and attempt.verifier.passed


def visible_passed(attempt: Attempt) -> bool | None:
    """The visible tests passed on the final files; None when the verifier did not record it."""
    if attempt.verifier is None:
        return None
    return _detail(attempt, _VISIBLE_KEYS)


def succeeded(attempt: Attempt) -> bool:
    """Verified by the hidden tests and not flagged by the audit."""
    return hidden_passed(attempt) and hack_flag(attempt) is None


def summarize(attempts: Sequence[Attempt], families: Mapping[str, str], *, max_k: int,
              seed: int = 0, resamples: int = 2000) -> dict[str, Any]:
    """The evaluation's numbers from its attempts.

    ``families`` maps every evaluated task id to its family; a task with no attempt is an
    error (the budget was not spent as stated), as is an attempt at an unknown task.
    ``max_k`` is the largest k of pass@k (normally the samples per task).
    """
    if not attempts:
        raise ValueError("attempts: nothing to summarize")
    by_task: dict[str, list[Attempt]] = defaultdict(list)
    for attempt in attempts:
        if attempt.task_id not in families:
            raise ValueError(f"attempt {attempt.attempt_id}: unknown task {attempt.task_id!r}")
        by_task[attempt.task_id].append(attempt)
    missing = sorted(set(families) - set(by_task))
    if missing:
        raise ValueError(f"{len(missing)} task(s) have no attempt, e.g. {missing[0]!r}")
    task_ids = sorted(by_task)
    scores = {t: [1.0 if succeeded(a) else 0.0 for a in by_task[t]] for t in task_ids}
    result = _block([scores[t] for t in task_ids], seed=seed, resamples=resamples)
    result["pass_at_k"] = pass_at_k_table(
        {t: (len(scores[t]), int(sum(scores[t]))) for t in task_ids}, max_k)
    family_names = sorted({families[t] for t in task_ids})
    result["by_family"] = {
        name: _block([scores[t] for t in task_ids if families[t] == name], seed=seed,
                     resamples=resamples)
        for name in family_names}
    endings = Counter(a.end_reason.value for a in attempts)
    result["by_ending"] = {r.value: endings.get(r.value, 0) for r in ATTEMPT_ENDINGS}
    result["success_by_ending"] = {
        r.value: sum(succeeded(a) for a in attempts if a.end_reason is r) / endings[r.value]
        for r in ATTEMPT_ENDINGS if endings.get(r.value)}
    clean = [a for a in attempts if a.end_reason not in INFRASTRUCTURE_ENDINGS]
    result["infrastructure_failures"] = len(attempts) - len(clean)
    result["success_excluding_infrastructure"] = (
        sum(map(succeeded, clean)) / len(clean) if clean else None)
    result.update(_independence(attempts))
    result.update(fault_counts(attempts))
    flags = hack_flags(attempts)
    result["hack_flags"] = hack_summary(flags)
    result["hack_flagged_but_hidden_passed"] = sum(
        1 for a in attempts if hack_flag(a) is not None and hidden_passed(a))
    result["generated_tokens"] = sum(a.costs.generated_tokens for a in attempts)
    result["tool_seconds"] = sum(a.costs.tool_seconds for a in attempts)
    result["tool_calls"] = sum(a.costs.tool_calls for a in attempts)
    result["turns"] = sum(a.costs.turns for a in attempts)
    result["attempt_seconds"] = sum(max(a.timings.finished_at - a.timings.started_at, 0.0)
                                    for a in attempts)
    result["per_task"] = {t: {"family": families[t], "attempts": len(scores[t]),
                              "successes": int(sum(scores[t]))} for t in task_ids}
    return result


def injected_faults(attempt: Attempt) -> list[str]:
    """The faults injected into ``attempt``, in order (empty when none)."""
    faults = attempt.metadata.get("injected_faults")
    if isinstance(faults, (list, tuple)):
        return [str(f) for f in faults]
    single = attempt.metadata.get("fault")  # recorded with a tool error by older collectors
    return [str(single)] if single else []


def fault_counts(attempts: Sequence[Attempt]) -> dict[str, Any]:
    """Faulted attempts and their recovery.

    ``faulted_attempts``: attempts with at least one injected fault that did not end by the
    infrastructure (those are in ``infrastructure_failures``); ``recovered_attempts``: the ones
    of them that succeeded; ``recovery_rate``: their share (None without faulted attempts);
    ``injected_faults``: how many faults of each kind were injected, in every attempt.
    """
    kinds: Counter[str] = Counter()
    for attempt in attempts:
        kinds.update(injected_faults(attempt))
    faulted = [a for a in attempts
               if a.end_reason not in INFRASTRUCTURE_ENDINGS and injected_faults(a)]
    recovered = sum(map(succeeded, faulted))
    return {"faulted_attempts": len(faulted), "recovered_attempts": recovered,
            "recovery_rate": recovered / len(faulted) if faulted else None,
            "injected_faults": dict(sorted(kinds.items()))}


def fault_comparison(clean: Mapping[str, Any], faulted: Mapping[str, Any]) -> dict[str, Any]:
    """Two results of :func:`summarize` on the same tasks, one without and one with injected
    faults: success of each with infrastructure endings excluded (and counted apart), and the
    recovery of the faulted attempts."""
    without = clean["success_excluding_infrastructure"]
    with_faults = faulted["success_excluding_infrastructure"]
    return {
        "success_without_faults": without, "success_with_faults": with_faults,
        "success_change": None if without is None or with_faults is None
        else with_faults - without,
        "infrastructure_failures_without_faults": clean["infrastructure_failures"],
        "infrastructure_failures_with_faults": faulted["infrastructure_failures"],
        "faulted_attempts": faulted["faulted_attempts"],
        "recovered_attempts": faulted["recovered_attempts"],
        "recovery_rate": faulted["recovery_rate"],
        "injected_faults": faulted["injected_faults"],
    }


def gain_ci(before: Mapping[str, Any], after: Mapping[str, Any], *, seed: int = 0,
            resamples: int = 2000) -> list[float]:
    """The 95% interval of ``after``'s success minus ``before``'s (two results of
    :func:`summarize` on the same tasks, e.g. one greedy attempt per task against eight
    samples), from a bootstrap over tasks paired between the two (``paired_bootstrap_ci``)."""
    if sorted(before["per_task"]) != sorted(after["per_task"]):
        raise ValueError("after: its tasks differ from before's; a gain is paired by task")

    def scores(result: Mapping[str, Any]) -> list[list[float]]:
        per_task = result["per_task"]
        return [[1.0] * per_task[t]["successes"]
                + [0.0] * (per_task[t]["attempts"] - per_task[t]["successes"])
                for t in sorted(per_task)]

    low, high = paired_bootstrap_ci(scores(before), scores(after), seed=seed,
                                    resamples=resamples)
    return [low, high]


def _block(per_task: list[list[float]], *, seed: int, resamples: int) -> dict[str, Any]:
    attempts = sum(len(s) for s in per_task)
    low, high = bootstrap_ci(per_task, seed=seed, resamples=resamples)
    return {"success": sum(sum(s) for s in per_task) / attempts, "ci95": [low, high],
            "tasks": len(per_task), "attempts": attempts}


def _independence(attempts: Sequence[Attempt]) -> dict[str, Any]:
    """Visible- vs hidden-test success, so that overfitting the visible tests shows."""
    verified = [a for a in attempts if a.verifier is not None]
    visible = [visible_passed(a) for a in verified]
    known = [v for v in visible if v is not None]
    out: dict[str, Any] = {
        "verified_attempts": len(verified),
        "hidden_success": sum(map(hidden_passed, attempts)) / len(attempts),
        "visible_success": (sum(known) / len(attempts)) if len(known) == len(verified) and
        verified else None,
        "visible_not_hidden": sum(1 for a, v in zip(verified, visible, strict=True)
                                  if v and not hidden_passed(a)),
    }
    if verified and len(known) < len(verified):
        out["visible_success_note"] = (
            f"{len(verified) - len(known)} verified attempt(s) did not record the visible tests")
    return out
