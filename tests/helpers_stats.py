"""The goodness-of-fit statistic the distribution tests share, and the joint distribution they test against."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence


def chi_square(counts: Mapping[int, int], probs: Mapping[int, float]) -> float:
    """Pearson's chi-square of observed `counts` against the distribution `probs` (normalised here); an outcome
    outside `probs` is an error, not a large statistic."""
    assert set(counts) <= set(probs), f"drawn outside the distribution: {set(counts) - set(probs)}"
    n, total = sum(counts.values()), sum(probs.values())
    return sum((counts.get(x, 0) - n * p / total) ** 2 / (n * p / total) for x, p in probs.items())


def joint_probs(next_probs: Callable[[list[int]], Mapping[int, float]], prompt: Sequence[int],
                n: int) -> dict[tuple[int, ...], float]:
    """The target's own p(t1) p(t2 | t1) ... p(tn | ...) after `prompt`, for every outcome of n tokens
    (`next_probs(context)`: the next token's distribution)."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        joint = {(*seq, t): p * q for seq, p in joint.items()
                 for t, q in next_probs([*prompt, *seq]).items()}
    return joint
