"""One sampling pipeline for target (p) and draft (q), and the lossless acceptance rules.

Pipeline (llama.cpp's order): penalties (repeat, frequency, presence) → top-k → top-p → min-p → temperature. It
takes a matrix of logit rows (one per verified position; the device's top candidates of each, or every logit with
a host top-k by `argpartition`) and computes a row's pipeline when the row is first read: a verify's rows after
the first rejection never are.

Why Python lists on the rows: at T > 0 a speculative round runs the pipeline once per draft step (one row of ~40
candidates) and once per verify, and on such rows numpy costs per call, not per element. The row math in plain
Python floats (math.exp, accumulate, bisect) is cheaper than the same math in numpy calls, even for a verify's
rows at once (docs/lab/2026-12-01-host-share.md has the figures). The sort is the exception: one stable numpy
argsort for all rows beats a key sort per row and gives the same order. Rows wider than `NARROW` (top_k = 0: the
whole vocabulary) stay in numpy.

Acceptance (Leviathan et al. / Chen et al.): accept draft token x with probability min(1, p(x)/q(x)); on rejection
sample from normalize(max(0, p − q)). The emitted token is then distributed exactly as p. At temperature 0 the rule
degenerates to "accept while the draft equals the target's argmax".
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from localspec.config import Sampling
from localspec.rounds.scores import Scores

WIDEN = 8  # `best_ids` keeps its sample's answer while it holds at most this many times the ids asked for
SAMPLE_STRIDE = 16  # `best_ids` reads every 16th logit of a row to place its threshold
NARROW = 1024  # rows at most this wide after top-k get the pipeline's math in Python, wider ones in numpy


@dataclass(frozen=True, slots=True)
class Row:
    """One position's distribution: the surviving token ids, best first, their probabilities and running sums."""

    ids: list[int]
    probs: list[float]  # sums to 1
    cdf: list[float]  # running sums of probs: a draw is one bisect

    def prob_of(self, token: int) -> float:
        try:
            return self.probs[self.ids.index(token)]
        except ValueError:
            return 0.0

    def sample(self, rng: np.random.Generator) -> int:
        return _draw(self.ids, self.cdf, rng)


class Candidates:
    """Sparse distributions, one `Row` per position. A pipeline's rows are computed when first read."""

    __slots__ = ("_rows", "_make")

    def __init__(self, rows: list[Row | None], make: Callable[[int], Row] | None = None) -> None:
        self._rows = rows
        self._make = make

    @classmethod
    def of(cls, ids: Sequence[Sequence[int]], probs: Sequence[Sequence[float]]) -> Candidates:
        """Explicit distributions (a point mass, tests): per row, ids and probabilities (normalised here)."""
        rows: list[Row | None] = []
        for row_ids, row_probs in zip(ids, probs, strict=True):
            pairs = sorted(zip(list(row_probs), list(row_ids), strict=True), key=lambda pair: -pair[0])
            total = math.fsum(p for p, _ in pairs)
            ps = [float(p) / total for p, _ in pairs]
            rows.append(Row([int(t) for _, t in pairs], ps, list(accumulate(ps))))
        return cls(rows)

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, r: int) -> Row:
        row = self._rows[r]
        if row is None:
            assert self._make is not None
            row = self._rows[r] = self._make(r)
        return row

    def prob_of(self, row: int, token: int) -> float:
        return self.row(row).prob_of(token)

    def sample(self, row: int, rng: np.random.Generator) -> int:
        return self.row(row).sample(rng)

    def top_prob(self, row: int) -> float:
        return self.row(row).probs[0]

    @property
    def ids(self) -> np.ndarray:
        """(rows, m) int64: each row's ids best first, padded with -1 (for references and tests)."""
        return self._padded("ids", -1, np.int64)

    @property
    def probs(self) -> np.ndarray:
        """(rows, m) float64, padded with zeros."""
        return self._padded("probs", 0.0, np.float64)

    def _padded(self, field: str, fill: float, dtype: type) -> np.ndarray:
        rows = [getattr(self.row(r), field) for r in range(len(self))]
        out = np.full((len(rows), max(map(len, rows))), fill, dtype=dtype)
        for r, values in enumerate(rows):
            out[r, : len(values)] = values
        return out


def point_mass(token: int) -> Candidates:
    """The proposal distribution of a deterministic drafter (lookup): all of q on `token`. Rejection sampling
    against it accepts with probability p(token) and otherwise draws from p without `token`: exactly p."""
    return Candidates([Row([token], [1.0], [1.0])])


def _draw(ids: Sequence[int], cdf: Sequence[float], rng: np.random.Generator) -> int:
    """A draw from running sums `cdf` (normalised or not) with one uniform."""
    return ids[min(bisect.bisect_right(cdf, rng.random() * cdf[-1]), len(ids) - 1)]


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
    """Turn (rows, vocab) logits into the pipeline's distributions.

    Penalties must already be applied (it depends on each row's own history). A row's top k are found among
    `best_ids` (a comparison over the row instead of an argpartition of it, the costly part of a verify's host
    work on a large vocabulary: docs/lab/2026-12-04-h200-fourth-window.md) in column order, so a tie goes to the
    earlier column, at the k-th place too.
    """
    rows, vocab = logits.shape
    k = cfg.top_k if 0 < cfg.top_k < vocab else vocab
    if k < vocab:
        idx = np.empty((rows, k), dtype=np.intp)
        for r, row in enumerate(logits):
            ids = best_ids(row, k)
            floor = np.partition(row[ids], len(ids) - k)[len(ids) - k]  # the row's k-th best logit
            # Every id at or above it, in column order: a comparison's hits hold them all; argpartition's k ids
            # (best_ids' fallback) may leave out ties at the floor.
            ids = np.flatnonzero(row >= floor) if len(ids) == k else ids[row[ids] >= floor]
            if len(ids) > k:  # ties at the floor: the earlier columns
                ids = ids[np.sort(np.argsort(-row[ids], kind="stable")[:k])]
            idx[r] = ids
        vals = np.take_along_axis(logits, idx, axis=1)
    else:
        idx = np.broadcast_to(np.arange(vocab), (rows, vocab))
        vals = logits
    return _after_top_k(idx, vals, cfg)


def best_ids(row: np.ndarray, look: int) -> np.ndarray:
    """At least `look` ids of a row's best logits, every other token's logit below all of theirs (not in order).
    Those above a threshold read off a strided sample of the row, somewhat more than `look`: a comparison over
    the row, cheaper than an argpartition of a large vocabulary (every constrained row pays one); the argpartition
    where the sample misjudges the row (ties, a row flat but for a few)."""
    vocab = len(row)
    sample = row[::SAMPLE_STRIDE]
    want = look // SAMPLE_STRIDE + look // 64 + 8  # about 2x look ids at 160, 1.3x at 1280: rarely fewer than look
    if want < len(sample):
        threshold = np.partition(sample, len(sample) - want)[len(sample) - want]
        ids = np.flatnonzero(row >= threshold)
        if look <= len(ids) <= WIDEN * look:
            return ids
    return np.argpartition(row, vocab - look)[vocab - look :]


def candidates_from_top_k(ids: np.ndarray, logits: np.ndarray, cfg: Sampling) -> Candidates:
    """The same pipeline when the device already selected each row's top candidates (k_device >= cfg.top_k)."""
    return _after_top_k(ids, logits, cfg, cfg.top_k)


def _after_top_k(idx: np.ndarray, vals: np.ndarray, cfg: Sampling, top_k: int = 0) -> Candidates:
    """Each row's candidates sorted best first (ties: the earlier column first), the first `top_k` kept (0: all),
    then top-p, min-p and temperature. The sort is one numpy call for all rows; rows of up to `NARROW` candidates
    then leave numpy (two `tolist`) and get the rest in Python when first read, wider rows stay in numpy."""
    order = np.argsort(-vals, axis=1, kind="stable")
    if 0 < top_k < order.shape[1]:
        order = order[:, :top_k]
    rows = np.arange(len(order))[:, None]
    ids, vals = idx[rows, order], vals[rows, order]
    if vals.shape[1] > NARROW:
        return Candidates(_wide_rows(ids, vals, cfg))
    row_ids, row_vals = ids.tolist(), vals.tolist()
    return Candidates([None] * len(row_ids), lambda r: _row(row_ids[r], row_vals[r], cfg))


def _row(ids: list[int], vals: list[float], cfg: Sampling) -> Row:
    """One sorted row's pipeline in Python floats (float64, like numpy's path): top-p, min-p, temperature."""
    top = vals[0]
    n = len(vals)
    if cfg.top_p < 1.0 or cfg.min_p > 0.0:
        # llama.cpp applies top-p and min-p before temperature, on the softmax at temperature 1. Unnormalised
        # here: the best candidate's weight is exp(0) = 1, so min-p compares with min_p itself.
        base = [math.exp(v - top) for v in vals]
        if cfg.top_p < 1.0:  # the smallest prefix whose mass reaches top_p, at least one
            n = min(bisect.bisect_left(list(accumulate(base)), cfg.top_p * sum(base)) + 1, n)
        if cfg.min_p > 0.0:  # ... and no candidate below min_p after the first
            n = next((i for i in range(1, n) if base[i] < cfg.min_p), n)
    # A temperature near 0 sends every logit but the top one to -inf (Python floats do not raise), i.e. p = 0.
    weights = [math.exp((v - top) / cfg.temperature) for v in vals[:n]]
    total = sum(weights)
    probs = [w / total for w in weights]
    return Row(ids[:n], probs, list(accumulate(probs)))


def _wide_rows(ids: np.ndarray, vals: np.ndarray, cfg: Sampling) -> list[Row]:
    """`_row`'s math in numpy, for rows too wide for Python loops (top_k = 0: the whole vocabulary)."""
    shifted = vals.astype(np.float64) - vals[:, :1]
    survivors = np.full(len(ids), ids.shape[1])
    if cfg.top_p < 1.0 or cfg.min_p > 0.0:
        base = np.exp(shifted)
        keep = np.ones(base.shape, dtype=bool)
        if cfg.top_p < 1.0:
            keep &= np.cumsum(base, axis=1) - base < cfg.top_p * base.sum(axis=1, keepdims=True)
        if cfg.min_p > 0.0:
            keep &= base >= cfg.min_p
        keep[:, 0] = True
        survivors = keep.sum(axis=1)  # a prefix of each sorted row
    out = []
    for r, n in enumerate(survivors.tolist()):
        with np.errstate(over="ignore"):  # a temperature near 0: every logit but the top one to -inf, i.e. p = 0
            weights = np.exp(shifted[r, :n] / cfg.temperature)
        probs = weights / weights.sum()
        out.append(Row(ids[r, :n].tolist(), probs.tolist(), np.cumsum(probs).tolist()))
    return out


def residual_distribution(p: Row, q: Row) -> tuple[list[int], list[float]]:
    """normalize(max(0, p − q)) as (ids, probs) over p's support (it is zero wherever p is), in token id order:
    the order draws from it have always used, so a seed still gives the same text."""
    q_at = dict(zip(q.ids, q.probs, strict=True))
    residual = [d if (d := p_x - q_at.get(t, 0.0)) > 0.0 else 0.0 for t, p_x in zip(p.ids, p.probs, strict=True)]
    total = sum(residual)
    if total <= 0.0:  # p == q up to rounding: a rejection was (numerically) impossible
        residual, total = p.probs, 1.0
    ids, probs = zip(*sorted(zip(p.ids, residual, strict=True)), strict=True)
    return list(ids), [r / total for r in probs]


def _accepts(p_x: float, q_x: float, rng: np.random.Generator) -> bool:
    """Accept a draft x ~ q with probability min(1, p(x)/q(x)): one uniform (none when q(x) = 0)."""
    return q_x > 0.0 and rng.random() * q_x < p_x


def _resample(p: Row, q: Row, rng: np.random.Generator) -> int:
    ids, probs = residual_distribution(p, q)
    return _draw(ids, list(accumulate(probs)), rng)


def accept_or_resample(token: int, p: Candidates, row: int, q: Candidates,
                       rng: np.random.Generator) -> tuple[bool, int]:
    """One step of speculative rejection sampling: draft `token` was drawn from q (one row) and p's row `row`
    is the target's distribution at the same position. Returns (accepted, token to emit)."""
    if _accepts(p.prob_of(row, token), q.prob_of(0, token), rng):
        return True, token
    return False, _resample(p.row(row), q.row(0), rng)


def accept_drafts(drafts: Sequence[int], p: Candidates, q: Sequence[Candidates],
                  rng: np.random.Generator) -> tuple[int, int]:
    """A whole verify's rejection sampling: p's row i is the target's distribution at draft i's position (one row
    more than drafts), q[i] the distribution draft i was drawn from. Returns (drafts accepted, the token to emit
    after them: a draw from the first rejected row's residual, or from p's last row when all pass).

    `accept_or_resample` row by row (the same uniforms in the same order); p's rows after the first rejection are
    never computed."""
    for i, token in enumerate(drafts):
        ok, out = accept_or_resample(token, p, i, q[i], rng)
        if not ok:
            return i, out
    return len(drafts), p.sample(len(drafts), rng)


def accept_rows(drafts: list[int], q: Sequence[Candidates] | None, scores: Scores, history: list[int], cfg: Sampling,
                rng: np.random.Generator, trace: bool = False) -> tuple[list[int], int, list[tuple[int, float]]]:
    """A verify's acceptance over its rows (one more than drafts; penalties by `history` applied here): the token
    the device drew (plain decoding at T > 0), the greedy match (the drafts up to the first that is not its row's
    argmax, then that argmax; `trace`: each row's argmax and top-2 margin, read apart from the choice), or rejection
    sampling against each draft's q (`accept_drafts`). Returns (the emitted tokens, drafts accepted, the traced
    rows)."""
    if scores.drawn is not None:  # plain decoding at T > 0: the device drew the token
        return [int(scores.drawn[0])], 0, []
    if cfg.greedy:
        scored = penalized(scores, history, cfg)
        rows = scored.argmax_and_margin() if trace else []
        choice = scored.argmax()
        n = 0
        while n < len(drafts) and drafts[n] == choice[n]:
            n += 1
        return [*drafts[:n], int(choice[n])], n, rows
    assert q is not None or not drafts, "a drafter sampling at T > 0 must say what it drew from"
    n, out = accept_drafts(drafts, distributions(scores, history, cfg), q or [], rng)
    return [*drafts[:n], out], n, []


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
    """OpenAI's logprobs of one emitted token: its log-probability under the row's distribution at temperature 1,
    and the `n_top` most likely tokens with theirs, best first (ties: the lower id, as the greedy choice breaks
    them). The engine passes the row the token was chosen from: the target's logits after the penalties and a
    grammar's mask (-inf: probability 0), before top-k, top-p, min-p and temperature, so a greedy token is always
    the first of its alternatives. Computed in float64 over every logit of the row."""
    logits = row.astype(np.float64)
    top = float(logits.max())
    log_z = top + float(np.log(np.exp(logits - top).sum()))
    best: tuple[tuple[int, float], ...] = ()
    if n_top:
        floor = logits[np.argpartition(logits, len(logits) - n_top)[len(logits) - n_top :]].min()
        idx = np.flatnonzero((logits >= floor) & np.isfinite(logits))  # every tie at the floor, none masked out
        idx = idx[np.lexsort((idx, -logits[idx]))][:n_top]  # best first; ties by lower id
        best = tuple((int(i), float(logits[i] - log_z)) for i in idx)
    return float(logits[token] - log_z), best
