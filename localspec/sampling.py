"""One sampling pipeline for target (p) and draft (q), and the lossless acceptance rules.

Pipeline (llama.cpp's order): penalties (repeat, frequency, presence) → top-k → top-p → min-p → temperature. It
works on a matrix of logit rows at once (one per verified position) and keeps only the candidates that survive, so
host work per round is one `argpartition` over the vocabulary per row (none when the device chose each row's top
candidates) plus small (rows × k) arithmetic. On rows of 64 candidates numpy's cost is per call, not per element:
the pipeline and the acceptance are written in as few numpy calls as the math allows, batched over rows (this is
the host side of a speculative round at T > 0: docs/performance.md, "T > 0 host share").

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

    def probs_of(self, tokens: Sequence[int]) -> list[float]:
        """Row i's probability of tokens[i], for the first len(tokens) rows, in one pass (ids are unique per row,
        so each row has at most one hit)."""
        n = len(tokens)
        hits = self.ids[:n] == np.asarray(tokens, dtype=np.int64)[:, None]
        return np.einsum("ij,ij->i", self.probs[:n], hits).tolist()

    def sample(self, row: int, rng: np.random.Generator) -> int:
        return _draw(self.ids[row], self.probs[row], rng)

    def top_prob(self, row: int) -> float:
        return float(self.probs[row].max())


def point_mass(token: int) -> Candidates:
    """The proposal distribution of a deterministic drafter (lookup): all of q on `token`. Rejection sampling
    against it accepts with probability p(token) and otherwise draws from p without `token`: exactly p."""
    return Candidates(ids=np.array([[token]], dtype=np.int64), probs=np.ones((1, 1)))


def _draw(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.add.accumulate(probs)
    i = int(cdf.searchsorted(rng.random() * cdf[-1], side="right"))
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
    return _after_top_k(ids, logits, cfg, cfg.top_k)


def _after_top_k(idx: np.ndarray, vals: np.ndarray, cfg: Sampling, top_k: int = 0) -> Candidates:
    """Sort each row's candidates best first (ties: the earlier column first), keep the first `top_k` (0: all),
    then top-p, min-p and temperature on (rows, k) arrays."""
    order = np.argsort(-vals, axis=1, kind="stable")
    if 0 < top_k < order.shape[1]:
        order = order[:, :top_k]
    rows = np.arange(len(order))[:, None]
    ids = idx[rows, order].astype(np.int64)
    vals = vals[rows, order].astype(np.float64)
    shifted = vals - vals[:, :1]  # <= 0: the best candidate at 0

    width = shifted.shape[1]
    survivors = None  # per row, how many candidates top-p and min-p keep (a prefix: the rows are sorted)
    # (np.add.reduce / accumulate: the ufuncs themselves, without the Python wrappers of sum and cumsum.)
    if cfg.top_p < 1.0 or cfg.min_p > 0.0:
        # llama.cpp applies top-p and min-p before temperature, on the softmax at temperature 1.
        base = np.exp(shifted)
        base /= np.add.reduce(base, axis=1, keepdims=True)
        keep = None
        if cfg.top_p < 1.0:
            # the mass strictly before each candidate: keeps the smallest prefix reaching top_p, at least one
            keep = np.add.accumulate(base, axis=1) - base < cfg.top_p
        if cfg.min_p > 0.0:
            above = base >= cfg.min_p * base[:, :1]
            keep = above if keep is None else keep & above
        assert keep is not None
        keep[:, 0] = True
        survivors = np.add.reduce(keep, axis=1)
        width = int(survivors.max())

    if cfg.temperature >= 1e-200:
        scaled = shifted[:, :width] / cfg.temperature
    else:  # (|logit differences| stay below float32's 7e38, so only such a temperature can overflow the division)
        with np.errstate(over="ignore"):  # a temperature near 0: every logit but the top one to -inf, i.e. p = 0
            scaled = shifted[:, :width] / cfg.temperature
    probs = np.exp(scaled, out=scaled)
    if survivors is not None and len(survivors) > 1:  # (one row keeps exactly `width`)
        probs[np.arange(width) >= survivors[:, None]] = 0.0
    probs /= np.add.reduce(probs, axis=1, keepdims=True)
    return Candidates(ids=ids[:, :width].copy() if width < ids.shape[1] else ids, probs=probs)


def residual_distribution(p_ids: np.ndarray, p_probs: np.ndarray, q_ids: np.ndarray,
                          q_probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """normalize(max(0, p − q)) as (ids, probs), over p's support: it is zero wherever p is."""
    q_at_p = np.dot(p_ids[:, None] == q_ids, q_probs)  # (ids are unique: at most one hit per p id)
    residual = np.maximum(p_probs - q_at_p, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p == q up to rounding: a rejection was (numerically) impossible
        return p_ids, p_probs
    return p_ids, residual / total


def _accepts(p_x: float, q_x: float, rng: np.random.Generator) -> bool:
    """Accept a draft x ~ q with probability min(1, p(x)/q(x)): one uniform (none when q(x) = 0)."""
    return q_x > 0.0 and rng.random() * q_x < p_x


def _resample(p: Candidates, row: int, q: Candidates, rng: np.random.Generator) -> int:
    return _draw(*residual_distribution(p.ids[row], p.probs[row], q.ids[0], q.probs[0]), rng)


def accept_or_resample(token: int, p: Candidates, row: int, q: Candidates,
                       rng: np.random.Generator) -> tuple[bool, int]:
    """One step of speculative rejection sampling: draft `token` was drawn from q (one row) and p's row `row`
    is the target's distribution at the same position. Returns (accepted, token to emit)."""
    if _accepts(p.prob_of(row, token), q.prob_of(0, token), rng):
        return True, token
    return False, _resample(p, row, q, rng)


def accept_drafts(drafts: Sequence[int], p: Candidates, q: Sequence[Candidates],
                  rng: np.random.Generator) -> tuple[int, int]:
    """A whole verify's rejection sampling: p's row i is the target's distribution at draft i's position (one row
    more than drafts), q[i] the distribution draft i was drawn from. Returns (drafts accepted, the token to emit
    after them: a draw from the first rejected row's residual, or from p's last row when all pass).

    The same uniforms in the same order as `accept_or_resample` row by row, with every row's p(x) read in one
    numpy pass and nothing computed for the rows after the first rejection."""
    p_x = p.probs_of(drafts)
    for i, token in enumerate(drafts):
        if not _accepts(p_x[i], q[i].prob_of(0, token), rng):
            return i, _resample(p, i, q[i], rng)
    return len(drafts), p.sample(len(drafts), rng)


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
