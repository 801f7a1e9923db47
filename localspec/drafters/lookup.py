"""Prompt lookup: draft what followed the latest earlier occurrence of the context's last n tokens.

No model and next to no time: the context (prompt + output) is searched for the longest n-gram, between
`lookup_min` and `lookup_max` tokens, that ends the context and occurred before; its continuation is the draft.
Replies that repeat their prompt (code edits, summaries quoting a document, reformatted JSON) draft long runs that
the target accepts. The proposal is a function of the context alone, so q is a point mass on each token and
rejection sampling stays exact at T > 0.

The search is an index per request (`NgramIndex`), extended by the tokens committed since the last round, so a
round's host work does not grow with the context (a numpy rescan a round, with the cost model's questions, took 2-2.5
ms a round on the 2-core CPU at 1,000-3,000 tokens, twice SmolLM2's whole H200 step); while the stream's cost model
says lookup's tokens are a loss, a round does no search at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from localspec.drafters.base import Drafter, DraftRequest, PromptWork, Proposal
from localspec.llama_ctx import Grammar
from localspec.sampling import point_mass
from localspec.scores import ScoringModel


class NgramIndex:
    """Every n-gram (n_min <= n <= n_max tokens) of a growing sequence → where its latest occurrence ends.

    `extend` indexes the tokens appended since the last call (n_max - n_min + 1 entries a token); `continuation`
    then answers with at most that many dict lookups, whatever the sequence's length. Keys are the n-grams'
    hashes (a third of a tuple's memory; about 0.4 KB a context token with the default 3..8), each hit checked
    against the tokens themselves: a hash collision only loses that match. (Hand-written: a dict is the index
    llama.cpp's n-gram cache uses too, and no kept library indexes a growing token list.)"""

    __slots__ = ("n_min", "n_max", "_ends", "_indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._ends: dict[int, int] = {}
        self._indexed = 0  # n-grams ending before this position are in

    @property
    def indexed(self) -> int:
        return self._indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the n-grams that end before the last token (the last one's own n-grams are the query: a match
        must have occurred before it). `tokens` must extend what was indexed before."""
        last = len(tokens) - 1  # n-grams ending at positions indexed .. last - 1
        if last <= self._indexed:
            return
        for n in range(self.n_min, self.n_max + 1):
            first = max(self._indexed, n - 1)  # the first end position with n tokens before it
            if first >= last:
                break
            # The n-grams ending at first .. last - 1, built by zipping n shifted slices (in C, not a Python loop);
            # a later occurrence overwrites an earlier one.
            grams = zip(*(tokens[first - n + 1 + i : last - n + 1 + i] for i in range(n)), strict=True)
            self._ends.update(zip(map(hash, grams), range(first, last), strict=True))
        self._indexed = last

    def continuation(self, tokens: Sequence[int], k: int) -> list[int]:
        """k tokens that followed the longest n-gram ending `tokens` that occurred earlier in it, the latest
        occurrence on a tie; [] when none does. `tokens` is the sequence indexed (`extend` first)."""
        size = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            suffix = tuple(tokens[size - n :])
            end = self._ends.get(hash(suffix))
            if end is not None and tuple(tokens[end - n + 1 : end + 1]) == suffix:
                # A match `period` tokens back says the text repeats with that period: a continuation that would
                # run past the end goes on repeating it (a run of one token drafts k of it, not one).
                period = size - 1 - end
                return [tokens[end + 1 + i % period] for i in range(k)]
        return []


def continuation(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """`NgramIndex.continuation` of `tokens` indexed from scratch (a one-off query)."""
    index = NgramIndex(n_min, n_max)
    index.extend(tokens)
    return index.continuation(tokens, k)


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

    def __init__(self) -> None:
        # Per sequence: the request its index belongs to, and the index (a new request starts it afresh).
        self._indexes: dict[int, tuple[DraftRequest, NgramIndex]] = {}

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        self._indexes.pop(req.seq, None)
        return []

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]]) -> list[Proposal]:
        return [self.propose(req, k) for req, k in jobs]

    def propose(self, req: DraftRequest, k: int) -> Proposal:
        if k <= 0 or (req.length is not None and not req.length.lookup_wanted()):
            # Backed off: no search (the index catches up when lookup is wanted again).
            return Proposal([], None if req.sampling.greedy else [])
        tokens = self._index(req).continuation(req.tokens, k)
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

    def _index(self, req: DraftRequest) -> NgramIndex:
        """The request's index, extended by its tokens committed since the last search."""
        held = self._indexes.get(req.seq)
        # The committed tokens only grow within a request; a new request in the slot, new settings or fewer
        # tokens than indexed (nothing the loop does) start afresh.
        if (held is None or held[0] is not req or held[1].indexed >= len(req.tokens)
                or (held[1].n_min, held[1].n_max) != (req.drafting.lookup_min, req.drafting.lookup_max)):
            held = self._indexes[req.seq] = (req, NgramIndex(req.drafting.lookup_min, req.drafting.lookup_max))
        held[1].extend(req.tokens)
        return held[1]

    def cells(self, seq: int) -> list[tuple[ScoringModel, list[int]]]:
        return []  # no model

    def reset(self) -> None:
        self._indexes.clear()

    def close(self) -> None:
        self._indexes.clear()


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter:
    return LookupDrafter()
