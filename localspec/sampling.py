"""One sampling pipeline for target (p) and draft (q), and the lossless acceptance rules.

Pipeline (llama.cpp's order): penalties (repeat, frequency, presence) → top-k → top-p → min-p → temperature. It
works on a matrix of logit rows at once (one per verified position) and keeps only the candidates that survive, so
host work per round is one `argpartition` over the vocabulary per row plus small (rows × k) arithmetic.

Acceptance (Leviathan et al. / Chen et al.): accept draft token x with probability min(1, p(x)/q(x)); on rejection
sample from normalize(max(0, p − q)). The emitted token is then distributed exactly as p. At temperature 0 the rule
degenerates to "accept while the draft equals the target's argmax".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from localspec.config import Sampling
from localspec.scores import Scores


@dataclass(frozen=True, slots=True)
class Candidates:
    """Sparse distributions, one row per position: token ids and their probabilities (zeros are pruned)."""

    ids: np.ndarray  # (rows, m) int64
    probs: np.ndarray  # (rows, m) float64, each row sums to 1

    def prob_of(self, row: int, token: int) -> float:
        hit = np.flatnonzero(self.ids[row] == token)
        return float(self.probs[row, hit[0]]) if hit.size else 0.0

    def sample(self, row: int, rng: np.random.Generator) -> int:
        return _draw(self.ids[row], self.probs[row], rng)

    def top_prob(self, row: int) -> float:
        return float(self.probs[row].max())


def point_mass(token: int) -> Candidates:
    """The proposal distribution of a deterministic drafter (lookup): all of q on `token`. Rejection sampling
    against it accepts with probability p(token) and otherwise draws from p without `token`: exactly p."""
    return Candidates(ids=np.array([[token]], dtype=np.int64), probs=np.ones((1, 1)))


def _draw(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])


def apply_penalties(logits: np.ndarray, history: Sequence[int], cfg: Sampling) -> np.ndarray:
    """llama.cpp's penalties over the last `repeat_last_n` tokens: for each distinct token there, divide a
    positive logit (multiply a negative one) by the repeat penalty, then subtract count × frequency penalty and
    the presence penalty once (OpenAI's meaning).

    Returns a copy when it changes anything: `logits` may be a view into llama.cpp's buffer.
    """
    if not cfg.penalized or not history:
        return logits
    recent, counts = np.unique(np.asarray(history[-cfg.repeat_last_n :], dtype=np.int64), return_counts=True)
    inside = recent < logits.shape[-1]
    recent, counts = recent[inside], counts[inside]
    out = np.array(logits, dtype=np.float32, copy=True)
    vals = out[recent]
    if cfg.repeat_penalty != 1.0:
        vals = np.where(vals > 0, vals / cfg.repeat_penalty, vals * cfg.repeat_penalty)
    out[recent] = vals - (counts * cfg.frequency_penalty + cfg.presence_penalty)
    return out


def candidates(logits: np.ndarray, cfg: Sampling) -> Candidates:
    """Turn (rows, vocab) logits into the pipeline's distributions, vectorised over rows.

    Penalties must already be applied (it depends on each row's own history).
    """
    rows, vocab = logits.shape
    k = cfg.top_k if 0 < cfg.top_k < vocab else vocab
    if k < vocab:
        idx = np.argpartition(logits, vocab - k, axis=1)[:, vocab - k :]
        vals = np.take_along_axis(logits, idx, axis=1)
    else:
        idx = np.broadcast_to(np.arange(vocab), (rows, vocab))
        vals = logits
    return _after_top_k(idx, vals, cfg)


def candidates_from_top_k(ids: np.ndarray, logits: np.ndarray, cfg: Sampling) -> Candidates:
    """The same pipeline when the device already selected each row's top candidates (k_device >= cfg.top_k)."""
    if 0 < cfg.top_k < ids.shape[1]:
        keep = np.argpartition(logits, ids.shape[1] - cfg.top_k, axis=1)[:, ids.shape[1] - cfg.top_k :]
        ids = np.take_along_axis(ids, keep, axis=1)
        logits = np.take_along_axis(logits, keep, axis=1)
    return _after_top_k(ids, logits, cfg)


def _after_top_k(idx: np.ndarray, vals: np.ndarray, cfg: Sampling) -> Candidates:
    """Sort the top-k survivors, then top-p, min-p and temperature on (rows, k) arrays."""
    order = np.argsort(-vals, axis=1, kind="stable")
    ids = np.take_along_axis(idx, order, axis=1).astype(np.int64)
    vals = np.take_along_axis(vals, order, axis=1).astype(np.float64)

    keep = np.ones(vals.shape, dtype=bool)
    if cfg.top_p < 1.0 or cfg.min_p > 0.0:
        # llama.cpp applies top-p and min-p before temperature, on the softmax at temperature 1.
        base = np.exp(vals - vals[:, :1])
        base /= base.sum(axis=1, keepdims=True)
        if cfg.top_p < 1.0:
            before = np.cumsum(base, axis=1) - base  # mass strictly before each candidate
            keep &= before < cfg.top_p  # keeps the smallest prefix reaching top_p, at least one
        if cfg.min_p > 0.0:
            keep &= base >= cfg.min_p * base[:, :1]
        keep[:, 0] = True

    # A temperature near 0 sends every logit but the top one to -inf, i.e. probability 0, as intended.
    with np.errstate(over="ignore"):
        scaled = (vals - vals[:, :1]) / cfg.temperature
    probs = np.where(keep, np.exp(scaled), 0.0)
    probs /= probs.sum(axis=1, keepdims=True)
    width = int(keep.sum(axis=1).max())  # sorted descending, so survivors sit at the front
    return Candidates(ids=ids[:, :width].copy(), probs=probs[:, :width].copy())


def residual_distribution(p_ids: np.ndarray, p_probs: np.ndarray, q_ids: np.ndarray,
                          q_probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """normalize(max(0, p − q)) over the union of both supports, as (ids, probs)."""
    support = np.union1d(p_ids, q_ids)
    p = np.zeros(support.size)
    q = np.zeros(support.size)
    p[np.searchsorted(support, p_ids)] = p_probs
    q[np.searchsorted(support, q_ids)] = q_probs
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p == q up to rounding: a rejection was (numerically) impossible
        return support, p
    return support, residual / total


def accept_or_resample(token: int, p: Candidates, row: int, q: Candidates,
                       rng: np.random.Generator) -> tuple[bool, int]:
    """One step of speculative rejection sampling: draft `token` was drawn from q (one row) and p's row `row`
    is the target's distribution at the same position. Returns (accepted, token to emit)."""
    p_x = p.prob_of(row, token)
    q_x = q.prob_of(0, token)
    if q_x > 0.0 and rng.random() * q_x < p_x:
        return True, token
    return False, _draw(*residual_distribution(p.ids[row], p.probs[row], q.ids[0], q.probs[0]), rng)


def penalized(scores: Scores, history: list[int], cfg: Sampling) -> Scores:
    """Every row with the penalties applied; row i sees the history plus the rows before it. Penalties are asked
    for full rows (the loop's device modes), so device candidates pass through unchanged."""
    if not scores.full or not cfg.penalized:
        return scores
    base = len(history) - len(scores) + 1  # row i follows history[:base + i]
    assert scores.logits is not None
    return scores.with_logits(np.stack([apply_penalties(row, history[: base + i], cfg)
                                        for i, row in enumerate(scores.logits)]))


def greedy_tokens(scores: Scores, history: list[int], cfg: Sampling) -> np.ndarray:
    """Each row's token at temperature 0 (after the penalties)."""
    return penalized(scores, history, cfg).argmax()


def distributions(scores: Scores, history: list[int], cfg: Sampling) -> Candidates:
    """The sampling pipeline for every row, from full logits or the device's candidates."""
    if scores.ids is not None:  # only chosen when no penalty applies
        assert scores.logits is not None
        return candidates_from_top_k(scores.ids, scores.logits, cfg)
    return candidates(penalized(scores, history, cfg).logits, cfg)  # type: ignore[arg-type]


def token_logprobs(row: np.ndarray, token: int, n_top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """OpenAI's logprobs of one emitted token: its log-probability under the model's full distribution at
    temperature 1 (the raw logits: before penalties, the sampling pipeline or a grammar), and the `n_top` most
    likely tokens with theirs, best first. Computed in float64 over every logit of the row."""
    logits = row.astype(np.float64)
    top = float(logits.max())
    log_z = top + float(np.log(np.exp(logits - top).sum()))
    best: tuple[tuple[int, float], ...] = ()
    if n_top:
        idx = np.argpartition(logits, len(logits) - n_top)[len(logits) - n_top :]
        idx = idx[np.lexsort((idx, -logits[idx]))]  # best first; ties by lower id
        best = tuple((int(i), float(logits[i] - log_z)) for i in idx)
    return float(logits[token] - log_z), best
