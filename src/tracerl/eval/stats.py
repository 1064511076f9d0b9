"""Statistics of a fixed-budget evaluation: unbiased pass@k and a bootstrap over tasks.

The samples of one task are correlated (an easy task is solved by most of its samples, a hard
one by none), so an interval that resamples attempts as if they were independent is too
narrow. :func:`bootstrap_ci` resamples whole tasks, each with all its attempts;
:func:`paired_bootstrap_ci` does the same for the gain of one policy over another on the same
tasks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n``
    attempts, ``c`` of them correct, is correct: ``1 - C(n-c, k) / C(n, k)``.

    This is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models
    Trained on Code", eq. 1); ``1 - (1 - c/n)**k`` is biased when n is small. Computed as a
    product so large n does not overflow.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if c > n:
        raise ValueError(f"c ({c}) must not exceed n ({n})")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_table(counts: Mapping[str, tuple[int, int]], max_k: int) -> dict[str, float]:
    """Mean over tasks of :func:`pass_at_k` for k = 1..``max_k``, keyed ``"1"`` … ``"K"``.

    ``counts`` maps task id to (attempts n, successes c). Every task needs n >= max_k, so each
    k is averaged over the same tasks.
    """
    if not counts:
        raise ValueError("counts: no tasks")
    if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
        raise ValueError(f"max_k must be a positive integer, got {max_k!r}")
    short = sorted(task for task, (n, _) in counts.items() if n < max_k)
    if short:
        raise ValueError(f"max_k={max_k} needs that many attempts per task; "
                         f"{len(short)} task(s) have fewer, e.g. {short[0]!r}")
    return {str(k): float(np.mean([pass_at_k(n, c, k) for n, c in counts.values()]))
            for k in range(1, max_k + 1)}


def bootstrap_ci(per_task: Sequence[Sequence[float]], *, level: float = 0.95,
                 resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over all attempts, resampling whole tasks.

    ``per_task[i]`` holds the scores of task i's attempts. Each resample draws as many tasks
    as there are, with replacement, and takes the mean over every attempt of the drawn tasks
    (the same statistic as the point estimate). Deterministic under ``seed``.
    """
    _check_resampling(level, resamples)
    sums, sizes = _sums_and_sizes(per_task, "per_task")
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(per_task), size=(resamples, len(per_task)))  # (R, tasks)
    means = sums[draws].sum(axis=1) / sizes[draws].sum(axis=1)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


def paired_bootstrap_ci(before: Sequence[Sequence[float]], after: Sequence[Sequence[float]], *,
                        level: float = 0.95, resamples: int = 2000, seed: int = 0
                        ) -> tuple[float, float]:
    """Percentile bootstrap interval of a gain, ``mean(after) - mean(before)``, on the same tasks.

    ``before[i]`` and ``after[i]`` hold task i's scores under the two policies (the counts may
    differ: eight samples after, one greedy attempt before). Each resample draws tasks with
    replacement and uses the same draw for both means, so a task that is easy for both
    policies moves both and the gain's interval is only as wide as the policies disagree:
    narrower than the two separate intervals suggest, and the right one for "did training
    help on these tasks". Deterministic under ``seed``.
    """
    if len(before) != len(after):
        raise ValueError(f"after: {len(after)} tasks, but before has {len(before)}; the gain "
                         "is paired by task")
    _check_resampling(level, resamples)
    sums_b, sizes_b = _sums_and_sizes(before, "before")
    sums_a, sizes_a = _sums_and_sizes(after, "after")
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(before), size=(resamples, len(before)))  # (R, tasks)
    gains = (sums_a[draws].sum(axis=1) / sizes_a[draws].sum(axis=1)
             - sums_b[draws].sum(axis=1) / sizes_b[draws].sum(axis=1))
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(gains, [alpha, 1.0 - alpha])
    return float(low), float(high)


def _check_resampling(level: float, resamples: int) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be a positive integer, got {resamples!r}")


def _sums_and_sizes(per_task: Sequence[Sequence[float]], name: str
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Each task's score sum and attempt count, checked."""
    if not per_task:
        raise ValueError(f"{name}: no tasks")
    sums = np.array([float(np.sum(scores)) for scores in per_task], dtype=np.float64)
    sizes = np.array([len(scores) for scores in per_task], dtype=np.float64)
    if np.any(sizes == 0):
        raise ValueError(f"{name}: every task needs at least one attempt")
    if not np.all(np.isfinite(sums)):
        raise ValueError(f"{name}: scores must be finite")
    return sums, sizes
