"""The sampling pipeline and the rejection-sampling step, on synthetic distributions (no model needed)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from localspec.config import load_preset
from localspec.rounds import sampling
from localspec.rounds.sampling import (
    Candidates,
    accept_drafts,
    accept_or_resample,
    apply_penalties,
    candidates,
    candidates_from_top_k,
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


SETTINGS = [
    dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=0.5, top_k=0, top_p=0.5, min_p=0.0),
    dict(temperature=0.9, top_k=50, top_p=1.0, min_p=0.1),
    dict(temperature=0.6, top_k=30, top_p=0.8, min_p=0.05),
]


@pytest.mark.parametrize("narrow", [True, False], ids=["python-rows", "numpy-rows"])
@pytest.mark.parametrize("settings", SETTINGS)
def test_pipeline_matches_reference(settings, narrow, monkeypatch):
    """Both homes of the row math (Python floats for rows of device candidates, numpy for vocabulary-wide rows)
    against the slow, obvious reference."""
    monkeypatch.setattr(sampling, "NARROW", 10_000 if narrow else 0)
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(4, 500)).astype(np.float32)
    c = cfg(**settings)
    got = candidates(logits, c)
    assert_matches_reference(got, logits, c)
    for row in range(4):
        assert got.probs[row].sum() == pytest.approx(1.0)


def hostile_rows(vocab: int) -> np.ndarray:
    """Rows that mislead a threshold read off a sample: flat, a plateau of ties across the k-th place, a few
    peaks over a flat floor, a row masked to fewer tokens than k (-inf), and a plain one."""
    rng = np.random.default_rng(4)
    flat = np.zeros(vocab)
    plateau = rng.normal(0, 1, vocab)
    plateau[rng.choice(vocab, 100, replace=False)] = 9.0  # 100 equal best tokens: top_k 40 keeps the earliest
    peaks = np.full(vocab, -2.0)
    peaks[[3, vocab // 2, vocab - 1]] = [5.0, 4.0, 6.0]
    masked = np.full(vocab, -np.inf)
    masked[rng.choice(vocab, 12, replace=False)] = rng.normal(0, 2, 12)
    return np.stack([flat, plateau, peaks, masked, rng.normal(0, 3, vocab)]).astype(np.float32)


@pytest.mark.parametrize("vocab", [600, 20_000])
@pytest.mark.parametrize("settings", [SETTINGS[0], SETTINGS[4], dict(temperature=1.0, top_k=40, top_p=1.0,
                                                                     min_p=0.0)])
def test_host_top_k_keeps_the_earliest_of_ties_on_hostile_rows(settings, vocab):
    """The host's top-k (a threshold from a strided sample, an argpartition where the sample misjudges the row)
    keeps what a full stable sort keeps, ties included, on rows built to mislead the sample."""
    logits = hostile_rows(vocab)
    c = cfg(**settings)
    got = candidates(logits, c)
    for row in range(len(logits)):
        want = {token: p for token, p in reference(logits[row], c).items() if p > 0}  # (-inf: probability 0)
        have = as_dict(got, row)
        assert have.keys() == want.keys(), row
        assert all(have[token] == pytest.approx(p, rel=1e-9, abs=1e-12) for token, p in want.items())


def assert_matches_reference(got: Candidates, logits: np.ndarray, c) -> None:
    for row in range(len(logits)):
        want = reference(logits[row], c)
        have = as_dict(got, row)
        assert have.keys() == want.keys()
        for token, prob in want.items():
            assert have[token] == pytest.approx(prob, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("settings", SETTINGS)
def test_device_candidates_match_the_reference_on_full_rows(settings):
    """The device's top 64 of each row, in the device's (unsorted) order, give the full row's pipeline whenever
    top_k fits in them."""
    c = cfg(**settings)
    if not 0 < c.top_k <= 64:
        pytest.skip("full rows only: the device candidates serve top_k <= 64")
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, size=(7, 500)).astype(np.float32)
    top = np.argsort(-logits, axis=1)[:, :64]
    shuffled = rng.permuted(top, axis=1)  # the device promises the top 64, not their order
    got = candidates_from_top_k(shuffled.astype(np.int32), np.take_along_axis(logits, shuffled, axis=1), c)
    assert_matches_reference(got, logits, c)


def row_at_a_time(ids: list[int], vals: list[float], top_k: int, c) -> tuple[list[int], list[float]]:
    """The Python row pipeline as it was before the sort moved into numpy (a key sort per row, a mass loop): the
    same floats in the same order, so a seed keeps drawing the same tokens."""
    order = sorted(range(len(vals)), key=vals.__getitem__, reverse=True)
    if 0 < top_k < len(order):
        del order[top_k:]
    ids, vals = [ids[i] for i in order], [vals[i] for i in order]
    top, n = vals[0], len(vals)
    if c.top_p < 1.0 or c.min_p > 0.0:
        base = [math.exp(v - top) for v in vals]
        limit = c.top_p * sum(base) if c.top_p < 1.0 else math.inf
        mass, n = 1.0, 1
        while n < len(base) and mass < limit and base[n] >= c.min_p:
            mass += base[n]
            n += 1
    weights = [math.exp((v - top) / c.temperature) for v in vals[:n]]
    total = sum(weights)
    return ids[:n], [w / total for w in weights]


@pytest.mark.parametrize("settings", [*SETTINGS, dict(temperature=1e-9, top_k=40, top_p=0.95, min_p=0.02)])
def test_device_rows_are_the_row_at_a_time_pipeline_bit_for_bit(settings):
    """Rows with ties (rounded logits, +0.0 beside -0.0) in the device's unsorted order: the same ids, order and
    probabilities to the last bit as the row-at-a-time pipeline."""
    c = cfg(**settings)
    rng = np.random.default_rng(2)
    for trial in range(60):
        logits = rng.normal(0, (0.5, 3.0, 10.0)[trial % 3], size=(7, 64)).astype(np.float32)
        if trial % 2:
            logits = np.round(logits)
            logits[:, :4], logits[:, 4:8] = 0.0, -0.0
        ids = rng.integers(0, 150_000, size=(7, 64)).astype(np.int32)
        got = candidates_from_top_k(ids, logits, c)
        for row in range(7):
            want = row_at_a_time(ids[row].tolist(), logits[row].tolist(), c.top_k, c)
            assert (got.row(row).ids, got.row(row).probs) == want, (trial, row)


def reference_verify(drafts, p_rows, q_rows, rng):
    """Rejection sampling over a verify the textbook way, row by row on dense dictionaries: (accepted, the
    distribution the emitted token is drawn from). Consumes the uniforms the rule needs, the draw's included."""
    for i, x in enumerate(drafts):
        p_x, q_x = p_rows[i].get(x, 0.0), q_rows[i].get(x, 0.0)
        if q_x > 0.0 and rng.random() * q_x < p_x:
            continue
        support = set(p_rows[i]) | set(q_rows[i])
        residual = {t: max(0.0, p_rows[i].get(t, 0.0) - q_rows[i].get(t, 0.0)) for t in support}
        total = sum(residual.values())
        rng.random()
        return i, {t: r / total for t, r in residual.items() if r > 0.0}
    rng.random()
    return len(drafts), p_rows[len(drafts)]


def test_accept_drafts_matches_the_row_by_row_reference():
    """accept_drafts (lazy rows, residuals over p's support) against the textbook rule on random verifies: the
    same accept/reject decisions from the same uniforms, the same residual, and the same random stream after."""
    c = cfg(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0)
    outcomes = set()
    for trial in range(300):
        rng = np.random.default_rng(trial)
        k = int(rng.integers(1, 8))
        target = rng.normal(0, 2, size=(k + 1, 64)).astype(np.float32)
        draft = (target[:k] + rng.normal(0, 1.5, size=(k, 64))).astype(np.float32)
        ids = np.stack([rng.permutation(1000)[:64] for _ in range(k + 1)]).astype(np.int32)
        p = candidates_from_top_k(ids, target, c)
        q = [candidates_from_top_k(ids[i : i + 1], draft[i : i + 1], c) for i in range(k)]
        drafts = [q[i].sample(0, rng) for i in range(k)]
        p_rows = [as_dict(p, r) for r in range(k + 1)]
        q_rows = [as_dict(q[i], 0) for i in range(k)]
        seed = int(rng.integers(1 << 30))
        mine, theirs = np.random.default_rng(seed), np.random.default_rng(seed)
        # (fresh Candidates: the reference's dictionaries above computed every row already)
        p = candidates_from_top_k(ids, target, c)
        n, token = accept_drafts(drafts, p, q, mine)
        n_ref, emitted_from = reference_verify(drafts, p_rows, q_rows, theirs)
        assert n == n_ref
        assert mine.bit_generator.state == theirs.bit_generator.state
        assert emitted_from.get(token, 0.0) > 0.0
        if n < k:
            support, residual = residual_distribution(p.row(n), q[n].row(0))
            got = {t: r for t, r in zip(support, residual, strict=True) if r > 0.0}
            assert got.keys() == emitted_from.keys()
            for t, prob in emitted_from.items():
                assert got[t] == pytest.approx(prob, rel=1e-9, abs=1e-12)
            assert all(p._rows[r] is None for r in range(n + 1, k + 1))  # rows after the rejection: never made
        outcomes.add(n == k)
    assert outcomes == {True, False}  # both full accepts and rejections happened


def test_repeat_penalty_follows_llama_cpp_and_copies():
    logits = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    out = apply_penalties(logits, [0, 1, 1, 3], cfg(repeat_penalty=2.0, repeat_last_n=3))
    # window = [1, 1, 3]: token 1 (negative) is multiplied once, token 3 (positive) divided; token 0 is out.
    assert out.tolist() == [2.0, -4.0, 1.0, 0.25]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # the llama.cpp buffer is never written
    assert apply_penalties(logits, [0], cfg(repeat_penalty=1.0)) is logits


def dist(pairs: dict[int, float]) -> Candidates:
    return Candidates.of([list(pairs)], [list(pairs.values())])


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
    support, residual = residual_distribution(p.row(0), q.row(0))
    res = dict(zip(support, residual, strict=True))
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
    from localspec.rounds.sampling import distributions
    from localspec.rounds.scores import Scores

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
