"""Synthetic attempts with the shape of real agent traces, for tests, benchmarks and demos.

They follow every invariant of the schema (roles, logprob counts, fragment chains), with
token ids and logprobs drawn at random; nothing here imitates a model's behaviour.
"""

from __future__ import annotations

import numpy as np

from tracerl.trace.schema import (
    Attempt,
    Costs,
    EndReason,
    Fragment,
    Role,
    SamplingParams,
    Segment,
    Timings,
    Turn,
    VerifierResult,
)


def synthetic_attempt(
    rng: np.random.Generator,
    attempt_id: str,
    *,
    task_id: str = "task-0",
    group_id: str = "group-0",
    total_tokens: int = 2000,
    turns: int = 10,
    fragments: int = 1,
    end: EndReason = EndReason.TERMINATED,
    reward: float | None = 1.0,
    vocab_size: int = 150_000,
    policy_version: int = 0,
) -> Attempt:
    """An attempt of about ``total_tokens`` tokens: a prompt, then turns of action + observation.

    With ``fragments > 1`` the turns are split across fragments joined by compaction (each
    later fragment starts with a summary).
    """
    if total_tokens < 2 * turns + 1 or turns < fragments or fragments < 1:
        raise ValueError("synthetic_attempt: need total_tokens > 2 * turns >= 2 * fragments")
    prompt_len = max(1, total_tokens // 8)
    per_turn = (total_tokens - prompt_len) // turns
    action_len = max(1, per_turn // 2)
    observation_len = max(1, per_turn - action_len)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=4096)

    def ids(n: int) -> np.ndarray:
        return rng.integers(0, vocab_size, size=n, dtype=np.int32)

    def action(n: int) -> Segment:
        logprobs = (-rng.exponential(1.0, size=n)).astype(np.float32)
        return Segment(Role.ACTION, ids(n), logprobs, sampling, policy_version, "synthetic")

    split = np.array_split(np.arange(turns), fragments)
    chain: list[Fragment] = []
    for f, turn_numbers in enumerate(split):
        body: list[Turn] = []
        for k, _ in enumerate(turn_numbers):
            segments: list[Segment] = []
            if k == 0:
                head = Role.PROMPT if f == 0 else Role.SUMMARY
                segments.append(Segment(head, ids(prompt_len if f == 0 else observation_len)))
            segments.append(action(action_len))
            segments.append(Segment(Role.OBSERVATION, ids(observation_len)))
            body.append(Turn(tuple(segments)))
        last = f == fragments - 1
        chain.append(Fragment(f, tuple(body), end if last else EndReason.CONTINUED))
    return Attempt(
        attempt_id=attempt_id,
        task_id=task_id,
        group_id=group_id,
        fragments=tuple(chain),
        reward=reward,
        rewards={} if reward is None else {"hidden_pass": reward},
        verifier=None if reward is None else VerifierResult(reward > 0, reward),
        timings=Timings(started_at=0.0, finished_at=1.0, generation_seconds=0.5),
        costs=Costs(generated_tokens=action_len * turns, tool_seconds=0.25 * turns,
                    tool_calls=turns, turns=turns),
        metadata={"source": "synthetic"},
    )
