"""Prompt lookup: draft what followed the latest earlier occurrence of the context's last n tokens.

No model and next to no time: the context (prompt + output) is searched for the longest n-gram, between
`lookup_min` and `lookup_max` tokens, that ends the context and occurred before; its continuation is the draft.
Replies that repeat their prompt (code edits, summaries quoting a document, reformatted JSON) draft long runs that
the target accepts. The proposal is a function of the context alone, so q is a point mass on each token and
rejection sampling stays exact at T > 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from localspec.drafters.base import Drafter, DraftRequest, PromptWork, Proposal
from localspec.llama_ctx import Grammar
from localspec.sampling import point_mass
from localspec.scores import ScoringModel


def continuation(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """k tokens that followed the longest n-gram (n_min <= n <= n_max) ending `tokens` that occurred earlier in
    it, the latest occurrence on a tie; [] when none does. Vectorised over the candidate positions."""
    if k <= 0 or len(tokens) <= n_min:
        return []
    context = np.asarray(tokens, dtype=np.int64)
    end = len(context) - 1
    ends = np.flatnonzero(context[:end] == context[end])  # earlier positions holding the last token
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, n_max):
        alive &= ends >= back
        if back > end or not alive.any():
            break
        alive[alive] = context[ends[alive] - back] == context[end - back]
        length += alive
    if ends.size == 0 or length.max() < n_min:
        return []
    best = int(ends[np.flatnonzero(length == length.max())[-1]])
    # A match `period` tokens back says the text repeats with that period: a continuation that would run past the
    # end goes on repeating it (a run of one token drafts k of it, not one).
    period = end - best
    return context[best + 1 + np.arange(k) % period].tolist()


def _allowed_prefix(tokens: list[int], grammar: Grammar) -> list[int]:
    """The tokens up to the first one the grammar refuses (or through an end-of-generation token), advancing the
    grammar copy by each one kept (a chained draft model continues from there)."""
    kept: list[int] = []
    for token in tokens:
        if not grammar.legal(np.array([token]))[0]:
            break
        kept.append(token)
        if grammar.model.is_eog(token):
            break  # nothing after the end is ever emitted
        grammar.accept(token)
    return kept


class LookupDrafter:
    models: tuple[ScoringModel, ...] = ()

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        return []

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]]) -> list[Proposal]:
        return [self.propose(req, k) for req, k in jobs]

    def propose(self, req: DraftRequest, k: int) -> Proposal:
        drafting = req.drafting
        tokens = continuation(req.tokens, drafting.lookup_min, drafting.lookup_max, k)
        if req.length is not None:  # as many as pay (`DraftLength.lookup_length`)
            tokens = tokens[: req.length.lookup_length(len(tokens), k)]
        if req.grammar is not None:
            tokens = _allowed_prefix(tokens, req.grammar)
        return Proposal(tokens, None if req.sampling.greedy else [point_mass(t) for t in tokens],
                        looked_up=len(tokens))

    def overlap(self, req: DraftRequest, proposal: Proposal, k_next: int) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def accept(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        pass  # nothing to rewind: the context is the loop's

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter:
    return LookupDrafter()
