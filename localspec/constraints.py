"""Constrained generation as data and as a token mask: what a request asks for (a GBNF grammar, a JSON schema, any
JSON object) and the masked rows the engine samples from.

The constrained distribution is the sampling pipeline run on logits where every token the grammar forbids after
the prefix is -inf (mask first, then top-k → top-p → min-p → temperature; greedy: the best legal token). The engine
masks the draft's rows and the target's verify rows alike, each with the grammar state after its own prefix, so
rejection sampling compares the masked p and q and its output is exactly the constrained target's.

Masking asks llama.cpp's grammar sampler (`llama.grammar.Grammar`) about as few tokens as exactness allows: a row
sampled with top-k needs only its top_k best legal tokens (and greedy its best one), so the mask is asked about the
row's best few dozen tokens first and widens only when too few of them are legal; top_k = 0 needs every token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localspec.config import Sampling
from localspec.errors import GrammarError
from localspec.llama.grammar import Grammar, json_object_gbnf, json_schema_gbnf
from localspec.llama.model import LlamaModel
from localspec.sampling import Candidates, accept_or_resample, distributions, penalized
from localspec.scores import Scores

FIRST_LOOK = 64  # tokens of a row checked first; each miss widens the look eightfold


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


def masked_row(row: np.ndarray, grammar: Grammar, need: int) -> np.ndarray:
    """The row (logits over a vocabulary) with every token the grammar forbids at -inf, exact for a pipeline that
    keeps at most `need` tokens (1 for greedy, top_k; 0 = no top-k: every token is checked).

    Only the row's best tokens are checked until `need` legal ones are found: any legal token outside them ranks
    below all of them, so top-`need` of the masked row is the same. Each widening checks only the tokens it adds.
    Tokens left unchecked are -inf too."""
    vocab = len(row)
    look = min(vocab, max(FIRST_LOOK, 4 * need)) if need else vocab
    checked = np.zeros(vocab, dtype=bool)
    legal_ids: list[np.ndarray] = []
    found = 0
    while True:
        ids = np.arange(vocab) if look >= vocab else np.argpartition(row, vocab - look)[vocab - look :]
        ids = ids[~checked[ids]]
        checked[ids] = True
        keep = ids[grammar.legal(ids)]
        legal_ids.append(keep)
        found += len(keep)
        if look >= vocab or found >= need:
            break
        look = min(vocab, look * 8)
    if found == 0:
        raise GrammarError(f"{grammar.source}: the grammar allows no token here (a grammar that cannot end?)")
    out = np.full(vocab, -np.inf, dtype=np.float32)
    keep = np.concatenate(legal_ids)
    out[keep] = row[keep]
    return out


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
        return Scores(masked_row(scores.logits[row].reshape(-1), grammar, rows_needed(sampling))[None, :])
    need = rows_needed(sampling)
    legal = grammar.legal(scores.ids[row])
    if need == 0 or int(legal.sum()) < need:
        return None
    return Scores(np.where(legal, scores.logits[row], -np.inf)[None, :].astype(np.float32), scores.ids[row][None, :])


def accept_constrained(grammar: Grammar, drafts: list[int], q: list[Candidates] | None, scores: Scores,
                       history: list[int], sampling: Sampling, rng: np.random.Generator,
                       is_eog: Callable[[int], bool], full_row: Callable[[int], np.ndarray],
                       ) -> tuple[list[int], Grammar, int]:
    """Acceptance (greedy match, or accept-or-resample against q) on a verify's masked rows: row i is masked with
    the grammar state after the drafts before it (a copy of `grammar`, advanced by each accepted draft), so p is the
    constrained target's at every position. `history`: what penalties read. Returns the emitted tokens, the copy
    (the state after them: it replaces `grammar`, which the caller closes) and how many rows were decoded again.

    Rows of the device's top candidates (greedy, top-k) are masked as they are where they hold enough legal tokens;
    a row that does not is read in full (`full_row(i)`: its token decoded again, which drops the cells after it),
    so the round ends with that row's token (exact either way: it is the constrained target's choice or draw at
    that position)."""
    scored = penalized(scores, history, sampling)
    state = grammar.clone()
    emitted: list[int] = []
    redecoded = 0
    try:
        for i in range(len(drafts) + 1):
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
            if not is_eog(token):
                state.accept(token)
            if not ok or last:
                break
    except BaseException:
        state.close()
        raise
    grammar.close()
    return emitted, state, redecoded
