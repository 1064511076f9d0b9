"""How often a group of attempts carries any within-group reward signal.

Assumption (the specification's): attempts at one task succeed independently with probability
``p`` and are scored 1 or 0. A group of G attempts has reward variation only if it contains
both a success and a failure: ``P_mix = 1 - p**G - (1 - p)**G``.
"""

from __future__ import annotations

__all__ = ["min_group_size_for_mixed", "mixed_group_probability"]


def _check_probability(success_probability: float) -> float:
    if isinstance(success_probability, bool) or not isinstance(success_probability, (int, float)):
        raise ValueError("success_probability must be a number in [0, 1]")
    if not 0 <= success_probability <= 1:
        raise ValueError("success_probability must be in [0, 1]")
    return float(success_probability)


def mixed_group_probability(success_probability: float, group_size: int) -> float:
    """Probability that a group of ``group_size`` attempts has both a success and a failure."""
    p = _check_probability(success_probability)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError("group_size must be a positive integer")
    return 1 - p**group_size - (1 - p) ** group_size


def min_group_size_for_mixed(
    success_probability: float, wanted_fraction: float, max_group_size: int = 10**9
) -> int:
    """Smallest G with ``mixed_group_probability(p, G) >= wanted_fraction``.

    ``P_mix`` grows with G toward 1 for 0 < p < 1, so a doubling search then bisection finds
    it. Raises ValueError when no G up to ``max_group_size`` reaches the fraction (always so
    for p = 0 or p = 1, where every group is uniform).
    """
    p = _check_probability(success_probability)
    if isinstance(wanted_fraction, bool) or not isinstance(wanted_fraction, (int, float)):
        raise ValueError("wanted_fraction must be a number in [0, 1)")
    if not 0 <= wanted_fraction < 1:
        raise ValueError("wanted_fraction must be in [0, 1)")

    def reaches(size: int) -> bool:
        return mixed_group_probability(p, size) >= wanted_fraction

    if reaches(1):
        return 1
    if p in (0.0, 1.0) or not reaches(max_group_size):
        raise ValueError(
            f"no group size up to {max_group_size} gives {wanted_fraction:.1%} mixed groups "
            f"at success_probability={p}"
        )
    low, high = 1, 2
    while not reaches(high):
        low, high = high, min(2 * high, max_group_size)
    while high - low > 1:
        middle = (low + high) // 2
        if reaches(middle):
            high = middle
        else:
            low = middle
    return high
