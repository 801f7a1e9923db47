"""The sampling pipeline and the rejection-sampling step, on synthetic distributions (no model needed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from localspec.config import load_preset
from localspec.sampling import (
    Candidates,
    accept_or_resample,
    apply_penalties,
    candidates,
    residual_distribution,
)
from tests.helpers_stats import chi_square

BASE = load_preset("default").sampling


def cfg(**kw):
    return dataclasses.replace(BASE, **kw)


def reference(logits: np.ndarray, c) -> dict[int, float]:
    """The pipeline written the slow, obvious way: full sort, one row."""
    order = np.argsort(-logits, kind="stable")
    if 0 < c.top_k < logits.size:
        order = order[: c.top_k]
    vals = logits[order].astype(np.float64)
    base = np.exp(vals - vals[0])
    base /= base.sum()
    keep = []
    mass = 0.0
    for i, pr in enumerate(base):
        if c.top_p < 1.0 and mass >= c.top_p and i > 0:
            break
        if c.min_p > 0 and pr < c.min_p * base[0] and i > 0:
            continue
        keep.append(i)
        mass += pr
    scaled = np.exp((vals[keep] - vals[0]) / c.temperature)
    scaled /= scaled.sum()
    return {int(order[i]): float(p) for i, p in zip(keep, scaled, strict=True)}


def as_dict(c: Candidates, row: int) -> dict[int, float]:
    return {int(i): float(p) for i, p in zip(c.ids[row], c.probs[row], strict=True) if p > 0}


@pytest.mark.parametrize("settings", [
    dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=0.5, top_k=0, top_p=0.5, min_p=0.0),
    dict(temperature=0.9, top_k=50, top_p=1.0, min_p=0.1),
])
def test_pipeline_matches_reference(settings):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(4, 500)).astype(np.float32)
    c = cfg(**settings)
    got = candidates(logits, c)
    for row in range(4):
        want = reference(logits[row], c)
        have = as_dict(got, row)
        assert have.keys() == want.keys()
        for token, prob in want.items():
            assert have[token] == pytest.approx(prob, rel=1e-9, abs=1e-12)
        assert got.probs[row].sum() == pytest.approx(1.0)


def test_repeat_penalty_follows_llama_cpp_and_copies():
    logits = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    out = apply_penalties(logits, [0, 1, 1, 3], cfg(repeat_penalty=2.0, repeat_last_n=3))
    # window = [1, 1, 3]: token 1 (negative) is multiplied once, token 3 (positive) divided; token 0 is out.
    assert out.tolist() == [2.0, -4.0, 1.0, 0.25]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # the llama.cpp buffer is never written
    assert apply_penalties(logits, [0], cfg(repeat_penalty=1.0)) is logits


def dist(pairs: dict[int, float]) -> Candidates:
    ids = np.array(list(pairs), dtype=np.int64)
    probs = np.array(list(pairs.values()), dtype=np.float64)
    return Candidates(ids=ids[None, :], probs=(probs / probs.sum())[None, :])


CASES = [
    ({0: 0.5, 1: 0.3, 2: 0.2}, {0: 0.2, 1: 0.3, 2: 0.5}),
    ({0: 0.9, 1: 0.1}, {1: 0.6, 3: 0.4}),  # different supports
    ({5: 1.0}, {5: 0.5, 6: 0.5}),
    ({0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25}, {0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25}),
]


@pytest.mark.parametrize(("p_pairs", "q_pairs"), CASES)
def test_rejection_step_preserves_target_exactly(p_pairs, q_pairs):
    """P(emit x) = q(x)·min(1, p(x)/q(x)) + P(reject)·residual(x) must equal p(x) for every x."""
    p, q = dist(p_pairs), dist(q_pairs)
    support, residual = residual_distribution(p.ids[0], p.probs[0], q.ids[0], q.probs[0])
    res = dict(zip(support.tolist(), residual.tolist(), strict=True))
    accept = {x: q.prob_of(0, x) * min(1.0, p.prob_of(0, x) / q.prob_of(0, x)) for x in q_pairs}
    reject = 1.0 - sum(accept.values())
    for x in set(p_pairs) | set(q_pairs):
        emitted = accept.get(x, 0.0) + reject * res.get(x, 0.0)
        assert emitted == pytest.approx(p.prob_of(0, x), abs=1e-12)


@pytest.mark.parametrize(("p_pairs", "q_pairs"), CASES[:2])
def test_rejection_step_statistically(p_pairs, q_pairs):
    """Draw x ~ q, run the real accept/resample step, and compare the emitted histogram with p."""
    p, q = dist(p_pairs), dist(q_pairs)
    rng = np.random.default_rng(1234)
    n = 40_000
    counts: dict[int, int] = {}
    for _ in range(n):
        x = q.sample(0, rng)
        _, out = accept_or_resample(x, p, 0, q, rng)
        counts[out] = counts.get(out, 0) + 1
    assert chi_square(counts, p_pairs) < 16.3  # chi-square, <= 3 degrees of freedom, p = 0.001


def test_identical_distributions_always_accept():
    p = dist({0: 0.4, 1: 0.6})
    rng = np.random.default_rng(0)
    assert all(accept_or_resample(q_tok, p, 0, p, rng)[0] for q_tok in [0, 1] * 200)


def test_frequency_and_presence_penalties_follow_llama_cpp():
    logits = np.array([2.0, -2.0, 1.0, 0.5, 3.0], dtype=np.float32)
    c = cfg(repeat_penalty=2.0, repeat_last_n=4, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [4, 0, 1, 1, 3], c)
    # window = [0, 1, 1, 3]: repeat penalty first, then count × 0.5 + 0.25 subtracted; token 4 is out of it.
    assert out.tolist() == pytest.approx([2.0 / 2 - 0.75, -2.0 * 2 - 1.25, 1.0, 0.5 / 2 - 0.75, 3.0])
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5, 3.0]
    # negative penalties (OpenAI allows -2..2) favour repeats; no window means no penalty
    assert apply_penalties(logits, [2], cfg(presence_penalty=-1.0))[2] == pytest.approx(2.0)
    assert apply_penalties(logits, [2], cfg(presence_penalty=1.0, repeat_last_n=0)) is logits


def test_penalties_reach_both_distributions_through_the_engine_pipeline():
    """p and q go through the same function: a penalised token loses mass in both."""
    from localspec.sampling import distributions
    from localspec.scores import Scores

    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1, size=(2, 50)).astype(np.float32)
    logits[:, 7] = 5.0  # the favourite everywhere
    plain = cfg(temperature=1.0, top_k=0, top_p=1.0)
    penalised = cfg(temperature=1.0, top_k=0, top_p=1.0, frequency_penalty=2.0, presence_penalty=2.0)
    for rows in (logits[:1], logits):  # one draft row (q) and a verify batch (p)
        before = distributions(Scores(rows), [3, 7, 7], plain)
        after = distributions(Scores(rows), [3, 7, 7], penalised)
        for r in range(len(rows)):
            assert after.prob_of(r, 7) < before.prob_of(r, 7) / 10
