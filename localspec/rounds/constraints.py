"""Constrained generation as data and as a token mask: what a request asks for (a GBNF grammar, a JSON schema, any
JSON object) and the masked rows the engine samples from.

The constrained distribution is the sampling pipeline run on logits where every token the grammar forbids after
the prefix is -inf (mask first, then top-k → top-p → min-p → temperature; greedy: the best legal token). The engine
masks the draft's rows and the target's verify rows alike, each with the grammar state after its own prefix, so
rejection sampling compares the masked p and q and its output is exactly the constrained target's.

Masking asks llama.cpp's grammar sampler (`llama.grammar.Grammar`) about as few tokens as exactness allows: a row
sampled with top-k needs only its top_k best legal tokens (and greedy its best one), so the mask is asked about the
row's best few dozen tokens first and widens only when too few of them are legal; top_k = 0 needs every token.
Fewer legal tokens than top_k among those checked is enough too when top-p or min-p would cut the row before any
token left unchecked, whatever those are (`settled`): at a JSON key or a comma a grammar allows a handful of tokens
in 152k, and a full check of such a row asks about every token (docs/performance.md has what it costs). Where the
row's best tokens do not do (a literal such as `<tool_call>` or a tool's name, none of whose few legal tokens the
model ranks high), the whole vocabulary is checked through its prefix forest (`Grammar.legal_everywhere`): a few
thousand tokens asked, not 152k.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localspec.config import Sampling
from localspec.errors import GrammarError
from localspec.llama.grammar import Grammar, json_object_gbnf, json_schema_gbnf
from localspec.llama.model import LlamaModel
from localspec.rounds.sampling import (
    NARROW,
    WIDEN,
    Candidates,
    accept_or_resample,
    best_ids,
    distributions,
    penalized,
    token_logprobs,
)
from localspec.rounds.scores import Scores

FIRST_LOOK = 64  # tokens of a row checked first (at least 4 x top_k); a miss widens the look eightfold, then to all
NARROW_TOP_K = NARROW  # `settled` mirrors the pipeline's Python rows (top-k up to this wide)


@dataclass(frozen=True)
class Constraint:
    """A grammar to hold generation to: GBNF text, where it came from (for error messages), and for a lazy one
    the marker from which it applies (tool calls: free text until `<tool_call>`)."""

    gbnf: str
    source: str
    trigger: str | None = None

    def grammar(self, model: LlamaModel) -> Grammar:
        """A fresh grammar state over the model's vocabulary (the target's: the draft shares its tokenizer)."""
        return Grammar(model, self.gbnf, self.source, trigger=self.trigger)

    @classmethod
    def json_object(cls, source: str) -> Constraint:
        return cls(json_object_gbnf(), source)

    @classmethod
    def json_schema(cls, schema: object, source: str) -> Constraint:
        if not isinstance(schema, dict):
            raise GrammarError(f"{source}: a JSON schema must be a JSON object")
        return cls(json_schema_gbnf(schema, source), source)

    @classmethod
    def from_files(cls, json_schema: Path | None, grammar: Path | None) -> Constraint | None:
        """`generate --json-schema FILE` / `--grammar FILE` (at most one)."""
        if json_schema is not None and grammar is not None:
            raise GrammarError("--json-schema and --grammar: give one of them")
        path = json_schema or grammar
        if path is None:
            return None
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise GrammarError(f"{path}: cannot read it: {exc}") from None
        if grammar is not None:
            return cls(text, str(path))
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise GrammarError(f"{path}: not JSON: {exc}") from None
        return cls.json_schema(schema, str(path))


def masked_row(row: np.ndarray, grammar: Grammar, sampling: Sampling) -> np.ndarray:
    """The row (logits over a vocabulary) with every token the grammar forbids at -inf (see `kept_ids`)."""
    out = np.full(len(row), -np.inf, dtype=np.float32)
    keep = kept_ids(row, grammar, sampling)
    out[keep] = row[keep]
    return out


def kept_ids(row: np.ndarray, grammar: Grammar, sampling: Sampling) -> np.ndarray:
    """The legal token ids of a row (logits over a vocabulary) that `sampling`'s pipeline needs, in id order: with
    every other token at -inf the row samples exactly as the fully masked row (`rows_needed`: 1 for greedy, top_k;
    0 = no top-k: every token is checked).

    Only the row's best tokens are checked (then eight times as many, then all) until `need` legal ones are
    found, or until those found settle the top-p/min-p cut (`settled`): any legal token outside them ranks below
    all of them, so the pipeline keeps the same tokens with the same probabilities. Each widening checks only the
    tokens it adds; the last one asks the grammar about the whole vocabulary (`Grammar.legal_everywhere`: a
    literal's few legal tokens cost a few thousand checks, not one per token)."""
    need = rows_needed(sampling)
    vocab = len(row)
    look = first = min(vocab, max(FIRST_LOOK, 4 * need)) if need else vocab
    checked = np.zeros(vocab, dtype=bool)
    legal_ids: list[np.ndarray] = []
    found = 0
    while look < vocab:
        ids = best_ids(row, look)
        fresh = ids[~checked[ids]]
        checked[fresh] = True
        keep = fresh[grammar.legal(fresh)]
        legal_ids.append(keep)
        found += len(keep)
        if found >= need:
            break
        if found and settled(np.concatenate(legal_ids), row, float(row[ids].min()), vocab - len(ids), sampling):
            break
        # One wider look, then the whole row: a row whose legal tokens are not in its best thousand is rarely
        # settled later (a literal: a handful of legal tokens anywhere in the row).
        look = min(vocab, look * WIDEN) if look == first else vocab
    else:
        legal_ids = [np.flatnonzero(grammar.legal_everywhere())]
        found = len(legal_ids[0])
    if found == 0:
        raise GrammarError(f"{grammar.source}: the grammar allows no token here (a grammar that cannot end?)")
    return np.sort(np.concatenate(legal_ids))


def settled(legal: np.ndarray, row: np.ndarray, bound: float, unchecked: int, sampling: Sampling) -> bool:
    """Whether the pipeline's rows are the same whatever the `unchecked` tokens are: `legal` (fewer than top_k ids
    of `row`) are the legal ones among those checked, every unchecked token's logit is at most `bound`.

    The pipeline (sampling._row) sorts the top-k legal tokens, cuts the smallest prefix whose mass at temperature 1
    reaches top_p, then the first below min_p of the best, and renormalises what is left. Unchecked legal tokens
    (at most top_k - len(legal) of them, each of weight at most exp(bound - best)) sort after every checked one and
    only add to the sum top-p compares with; the cut moves only one way as that sum grows, so when it falls at the
    same checked token with none of them and with all of them at that weight (the same sums, in the same order, as
    the pipeline computes them), and that token is above `bound`, the kept tokens and their probabilities are
    those of the fully checked row."""
    k = sampling.top_k
    if sampling.greedy or not 0 < k <= NARROW_TOP_K or (sampling.top_p >= 1.0 and sampling.min_p <= 0.0):
        return False
    vals = sorted(row[legal].astype(np.float64).tolist(), reverse=True)
    top = vals[0]
    base = [math.exp(v - top) for v in vals]
    known = len(base)
    unknown_weight = math.exp(bound - top)
    cut_min_p = known if sampling.min_p > 0.0 and unknown_weight < sampling.min_p else math.inf
    if sampling.min_p > 0.0:
        cut_min_p = next((i for i in range(1, known) if base[i] < sampling.min_p), cut_min_p)

    def cut(total: float) -> float:
        if sampling.top_p >= 1.0:
            return cut_min_p
        running, i = 0.0, 0
        while i < known:
            running += base[i]
            if running >= sampling.top_p * total:  # bisect_left(accumulate(base), top_p * total) == i
                return min(i + 1, cut_min_p)
            i += 1
        return cut_min_p  # top-p's cut falls among the unchecked: only min-p can settle it

    least = sum(base)
    most = least
    for _ in range(min(k - known, unchecked)):
        most += unknown_weight
    n = cut(least)
    return n == cut(most) and n <= known and vals[int(n) - 1] > bound


def rows_needed(sampling: Sampling) -> int:
    """How many legal tokens a masked row must rank exactly for this pipeline: greedy one, top-k top_k, top_k = 0
    every one (0)."""
    return 1 if sampling.greedy else (sampling.top_k if sampling.top_k > 0 else 0)


def masked_scores(scores: Scores, row: int, grammar: Grammar, sampling: Sampling) -> Scores | None:
    """One row of `scores` (penalties already applied) with what the grammar forbids at -inf, as a one-row
    Scores the sampling pipeline reads like any other (the draft's rows and the target's verify rows alike).

    A row of the device's top candidates is exact when they hold the pipeline's `rows_needed` legal tokens: any
    legal token outside them ranks below all of them. None when they do not: that row needs its full logits."""
    assert scores.logits is not None and scores.drawn is None, "a constrained row needs logits, not a drawn token"
    if scores.ids is None:
        # Only the kept tokens, as candidates: the pipeline then sorts a few dozen, not a vocabulary of -inf (whose
        # argpartition was a large share of a JSON reply's host time: docs/lab/2026-12-04-cpu-constrained-sampling.md).
        logits = scores.logits[row].reshape(-1)
        keep = kept_ids(logits, grammar, sampling)
        return Scores(logits[keep][None, :].astype(np.float32), keep[None, :])
    need = rows_needed(sampling)
    ids, logits = scores.ids[row], scores.logits[row]
    legal = grammar.legal(ids)
    found = int(legal.sum())
    # The device's candidates are a row's best; every other token's logit is at most their least.
    if need == 0 or found == 0 or (found < need and not settled(
            np.flatnonzero(legal), logits, float(logits.min()), grammar.n_vocab - len(ids), sampling)):
        return None
    return Scores(np.where(legal, logits, -np.inf)[None, :].astype(np.float32), ids[None, :])


def accept_constrained(grammar: Grammar, drafts: list[int], q: list[Candidates] | None, scores: Scores,
                       history: list[int], sampling: Sampling, rng: np.random.Generator,
                       is_eog: Callable[[int], bool], full_row: Callable[[int], np.ndarray],
                       logprobs: int | None = None,
                       ) -> tuple[list[int], int, Grammar, int, list[tuple[float, tuple[tuple[int, float], ...]]]]:
    """Acceptance (greedy match, or accept-or-resample against q) on a verify's masked rows: row i is masked with
    the grammar state after the drafts before it (a copy of `grammar`, advanced by each accepted draft), so p is the
    constrained target's at every position. `history`: what penalties read. Returns the emitted tokens, how many of
    them are accepted drafts (all of them where a row decoded again ended the round on an accepted draft), the copy
    (the state after them: it replaces `grammar`, which the caller closes), how many rows were decoded again and,
    with `logprobs` (N), each emitted token's logprob and its N best legal alternatives on its masked row.

    Rows of the device's top candidates (greedy, top-k) are masked as they are where they hold enough legal tokens;
    a row that does not is read in full (`full_row(i)`: its token decoded again, which drops the cells after it),
    so the round ends with that row's token (exact either way: it is the constrained target's choice or draw at
    that position)."""
    scored = penalized(scores, history, sampling)
    state = grammar.clone()
    emitted: list[int] = []
    accepted = 0
    redecoded = 0
    logprob_rows: list[np.ndarray] = []
    # Logprobs read every token the grammar allows (masked_scores checks only what the choice needs): a pipeline
    # without top-k, top-p or min-p needs them all.
    every = dataclasses.replace(sampling, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    try:
        for i in range(len(drafts) + 1):
            if logprobs is not None:
                assert scored.logits is not None  # full rows: logprobs turn the device sampler off (Engine.start)
                logprob_rows.append(masked_row(scored.logits[i], state, every))
            row = masked_scores(scored, i, state, sampling)
            last = row is None
            if row is None:  # (no penalty here: a penalised stream has full rows)
                row = masked_scores(Scores(full_row(i)[None, :]), 0, state, sampling)
                assert row is not None
                redecoded += 1
            if sampling.greedy:
                token = int(row.argmax()[0])
                ok = i < len(drafts) and drafts[i] == token
            elif i < len(drafts):
                assert q is not None, "a drafter sampling at T > 0 must say what it drew from"
                ok, token = accept_or_resample(drafts[i], distributions(row, [], sampling), 0, q[i], rng)
            else:
                ok, token = False, distributions(row, [], sampling).sample(0, rng)
            emitted.append(token)
            accepted += int(ok)
            if not is_eog(token):
                state.accept(token)
            if not ok or last:
                break
    except BaseException:
        state.close()
        raise
    grammar.close()
    chosen = [] if logprobs is None else [token_logprobs(row, token, logprobs)
                                          for row, token in zip(logprob_rows, emitted, strict=True)]
    return emitted, accepted, state, redecoded, chosen
