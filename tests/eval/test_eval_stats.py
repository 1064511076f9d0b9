from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tracerl.eval.stats import bootstrap_ci, paired_bootstrap_ci, pass_at_k, pass_at_k_table


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n attempts (c correct) containing a correct one."""
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_enumeration(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_large_n_is_finite_and_matches_comb() -> None:
    n, c, k = 200, 7, 50
    expected = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12)


def test_pass_at_1_is_the_success_rate_and_table_averages_tasks() -> None:
    table = pass_at_k_table({"a": (4, 1), "b": (4, 4), "c": (4, 0)}, 4)
    assert list(table) == ["1", "2", "3", "4"]
    assert table["1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert table["4"] == pytest.approx((1 + 1 + 0) / 3)


@pytest.mark.parametrize("bad", [dict(n=3, c=4, k=1), dict(n=3, c=1, k=0), dict(n=3, c=1, k=4),
                                 dict(n=-1, c=0, k=1)])
def test_pass_at_k_refuses_bad_counts(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        pass_at_k(**bad)


def test_pass_at_k_table_refuses_tasks_with_fewer_attempts_than_k() -> None:
    with pytest.raises(ValueError, match="'b'"):
        pass_at_k_table({"a": (4, 1), "b": (2, 1)}, 4)


def test_bootstrap_is_deterministic_under_a_seed() -> None:
    rng = np.random.default_rng(1)
    per_task = [list(rng.integers(0, 2, size=8).astype(float)) for _ in range(30)]
    assert bootstrap_ci(per_task, seed=3) == bootstrap_ci(per_task, seed=3)
    assert bootstrap_ci(per_task, seed=3) != bootstrap_ci(per_task, seed=4)


def test_bootstrap_over_tasks_is_wide_for_correlated_samples() -> None:
    # 40 tasks x 8 samples, perfectly correlated within a task: half the tasks always pass.
    # The information is 40 task outcomes, not 320 independent attempts.
    tasks, samples = 40, 8
    per_task = [[1.0] * samples if t % 2 == 0 else [0.0] * samples for t in range(tasks)]
    low, high = bootstrap_ci(per_task, seed=0, resamples=4000)
    assert low < 0.5 < high
    by_tasks = 2 * 1.96 * math.sqrt(0.25 / tasks)  # normal width with 40 independent units
    assert (high - low) == pytest.approx(by_tasks, rel=0.15)
    # Treating each attempt as its own "task" (the naive interval) is far too narrow.
    naive_low, naive_high = bootstrap_ci([[v] for s in per_task for v in s], seed=0,
                                         resamples=4000)
    assert (high - low) > 2.4 * (naive_high - naive_low)


def test_bootstrap_of_identical_tasks_has_no_width_and_unequal_sizes_weight_attempts() -> None:
    assert bootstrap_ci([[1.0, 0.0]] * 10, seed=0) == (0.5, 0.5)
    low, high = bootstrap_ci([[1.0], [0.0, 0.0, 0.0]], seed=0, resamples=500)
    assert 0.0 <= low <= 0.25 <= high <= 1.0


def test_bootstrap_refuses_empty_input() -> None:
    with pytest.raises(ValueError, match="per_task"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="at least one attempt"):
        bootstrap_ci([[1.0], []])


def test_paired_gain_interval_is_narrower_than_the_unpaired_one() -> None:
    # 40 tasks: half easy (both policies solve 7-8 of 8), half hard (0-1 of 8); the second
    # policy solves one more sample of every task. Task difficulty dominates each policy's own
    # interval, but it cancels in the gain when both sides use the same resampled tasks.
    before = [[1.0] * 7 + [0.0] if t % 2 == 0 else [0.0] * 8 for t in range(40)]
    after = [[1.0] * 8 if t % 2 == 0 else [1.0] + [0.0] * 7 for t in range(40)]
    low, high = paired_bootstrap_ci(before, after, seed=0, resamples=4000)
    assert low == pytest.approx(0.125) and high == pytest.approx(0.125)  # every task gained 1/8
    b_low, b_high = bootstrap_ci(before, seed=0, resamples=4000)
    a_low, a_high = bootstrap_ci(after, seed=1, resamples=4000)
    assert a_low < b_high  # the separate intervals overlap: on their own they cannot tell
    assert a_high - a_low > 0.2 and b_high - b_low > 0.2


def test_paired_gain_against_one_greedy_attempt_per_task() -> None:
    # Greedy before (one attempt per task) against eight samples after: counts may differ.
    rng = np.random.default_rng(0)
    greedy = [[float(rng.integers(0, 2))] for _ in range(30)]
    sampled = [list(rng.integers(0, 2, size=8).astype(float)) for _ in range(30)]
    gain = np.mean([v for s in sampled for v in s]) - np.mean([s[0] for s in greedy])
    low, high = paired_bootstrap_ci(greedy, sampled, seed=2)
    assert low < gain < high
    assert paired_bootstrap_ci(greedy, sampled, seed=2) == (low, high)


def test_paired_gain_refuses_unpaired_or_empty_tasks() -> None:
    with pytest.raises(ValueError, match="paired by task"):
        paired_bootstrap_ci([[1.0]], [[1.0], [0.0]])
    with pytest.raises(ValueError, match="before: no tasks"):
        paired_bootstrap_ci([], [])
    with pytest.raises(ValueError, match="after: every task"):
        paired_bootstrap_ci([[1.0]], [[]])


def test_gain_ci_pairs_the_per_task_counts_of_two_summaries() -> None:
    from tracerl.eval.summary import gain_ci

    def result(counts: dict[str, tuple[int, int]]) -> dict[str, object]:
        return {"per_task": {t: {"family": "f", "attempts": n, "successes": k}
                             for t, (n, k) in counts.items()}}

    greedy = result({"a": (1, 1), "b": (1, 0), "c": (1, 0), "d": (1, 1)})
    sampled = result({"d": (8, 8), "c": (8, 4), "b": (8, 2), "a": (8, 6)})  # order differs
    expected = paired_bootstrap_ci([[1.0], [0.0], [0.0], [1.0]],
                                   [[1.0] * 6 + [0.0] * 2, [1.0] * 2 + [0.0] * 6,
                                    [1.0] * 4 + [0.0] * 4, [1.0] * 8], seed=3, resamples=500)
    assert gain_ci(greedy, sampled, seed=3, resamples=500) == list(expected)
    with pytest.raises(ValueError, match="after: its tasks differ"):
        gain_ci(greedy, result({"a": (8, 1)}))
