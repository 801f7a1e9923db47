"""The goodness-of-fit statistic the distribution tests share."""

from __future__ import annotations

from collections.abc import Mapping


def chi_square(counts: Mapping[int, int], probs: Mapping[int, float]) -> float:
    """Pearson's chi-square of observed `counts` against the distribution `probs` (normalised here); an outcome
    outside `probs` is an error, not a large statistic."""
    assert set(counts) <= set(probs), f"drawn outside the distribution: {set(counts) - set(probs)}"
    n, total = sum(counts.values()), sum(probs.values())
    return sum((counts.get(x, 0) - n * p / total) ** 2 / (n * p / total) for x, p in probs.items())
