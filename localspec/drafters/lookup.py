"""Prompt lookup: draft what followed the latest earlier occurrence of the context's last n tokens.

No model and next to no time: the context (prompt + output) is searched for the longest n-gram, between
`lookup_min` and `lookup_max` tokens, that ends the context and occurred before; its continuation is the draft.
Replies that repeat their prompt (code edits, summaries quoting a document, reformatted JSON) draft long runs that
the target accepts. The proposal is a function of the context alone, so q is a point mass on each token and
rejection sampling stays exact at T > 0.

The search is an index per request (`NgramIndex`), extended by the tokens committed since the last round, so a
round's host work does not grow with the context (a rescan of the whole context every round grew with it, to more
than a small draft model's whole GPU step at a few thousand tokens: docs/lab/2026-12-01-drafters.md); while lookup's
cost rule (`LookupCost`) says its tokens are a loss, a round does no search at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from localspec.config import Drafting
from localspec.drafters.base import Drafter, DrafterBase, DraftRequest, PromptWork, Proposal
from localspec.llama.grammar import Grammar
from localspec.llama.vision import text_prefix
from localspec.rounds.policies import CostRule, DraftCost, DraftLength, Observation, Stepped
from localspec.rounds.sampling import point_mass
from localspec.rounds.scores import ScoringModel

LLAMA_SERVER_TYPE = "ngram-simple"  # its `speculative.type` (llama-server's name)


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


class LookupDrafter(DrafterBase):
    def __init__(self) -> None:
        super().__init__()
        # Per sequence: the request its index belongs to, and the index (a new request starts it afresh).
        self._indexes: dict[int, tuple[DraftRequest, NgramIndex]] = {}

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        self._indexes.pop(req.seq, None)
        return []

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]]) -> list[Proposal]:
        return [self.propose(req, k) for req, k in jobs]

    def propose(self, req: DraftRequest, k: int, extension: type[CostRule] | None = None) -> Proposal:
        """Up to k tokens for the request, as many as pay (`LookupCost.length`; with `extension`, the `Stepped` rule
        of the drafter that drafts after them, whose best share is priced in)."""
        length = self.length(req)
        rule = length.rule(LookupCost) if length is not None else None
        if k <= 0 or (rule is not None and not rule.wanted()):
            # Backed off: no search (the index catches up when lookup is wanted again).
            return Proposal([], None if req.sampling.greedy else [])
        return priced_proposal(req, self._index(req).continuation(req.tokens, k), k, length, rule, extension)

    def pricing(self, cost: DraftCost, drafting: Drafting) -> None:
        """Lookup's cost rule on this stream's facts; k stays fixed (its tokens cost no draft steps)."""
        LookupCost.of(cost)

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

    def reset(self) -> None:
        self._indexes.clear()

    def close(self) -> None:
        self._indexes.clear()


class LookupCost(CostRule):
    """Prompt lookup's prices: its tokens cost no draft step, only the verify's width, and are right at lookup's own
    measured rate (source "lookup", the lead of a round: a chained model drafts after them). How many of a match to
    propose (`length`): all where they are right most of the time, none where they only widen the verify (SmolLM2
    on the shipped prompts: 20% right, 0.74x plain when it proposed them all), then probed on DraftCost's doubling
    schedule (a probe proposes one token where widths cost their own: `probe_length`); backed off, lookup does not
    even search (`wanted`). Its first matches are proposed whole (measured before judged); then, where the verify
    is not padded, every width a lookup round could choose is measured once before the costs decide (`unmeasured`),
    and a match cut short proposes a longer length every EPOCH such rounds in a row, the one whose width was
    measured longest ago (`stalest`), so a width measured once in a slow moment is measured again."""

    SOURCE = "lookup"
    PRIOR = 0.9  # lookup's tokens are right far more often than a draft model's

    def __init__(self, cost: DraftCost) -> None:
        super().__init__(cost)
        cost.add_source(self.SOURCE, self.PRIOR, lead=True, own_epochs=True)
        self._judge_afresh()

    def _judge_afresh(self) -> None:
        """The judgement of lookup's tokens as before anything was measured (a new rule, a new request)."""
        self.idle, self.interval = 0, self.cost.PROBE_FIRST  # the probe schedule of tokens judged a loss
        self.off = False  # lookup's tokens were last judged a loss: it does not search (`wanted`)
        self.short = 0  # rounds in a row that proposed only some of lookup's match (`length`)
        self.measuring = False  # this round's length measures an unmeasured verify width

    def observed(self, round_: Observation) -> None:
        self.measuring = False

    def begin_generation(self) -> None:
        """A new request: its acceptance (whether this reply copies its text) starts from the prior, and its
        judgement with it (not backed off, the probe interval back at PROBE_FIRST, its first matches proposed whole
        to measure it), as in a new slot's cost model; the verify prices stay (`DraftCost.begin_generation`).
        Suffix lookup (`SuffixCost`) likewise: its index spans requests, but whether this request's text follows it
        is this request's."""
        self.cost.restart_source(self.SOURCE)
        self._judge_afresh()

    def best(self, found: int, k: int, width: int = 0, extension: Stepped | None = None) -> int | None:
        """How many of prompt lookup's `found` tokens to propose (the longer on a tie: they cost no draft steps):
        the j in 0..found whose round is fastest — with the `extension`'s best share after them (a chained draft
        model's) once its step is measured. None until a verify was measured."""
        cost = self.cost
        if not cost.verify_s:
            return None
        with_model = extension is not None and cost.step_s is not None
        speeds = cost.speeds(np.arange(found + 1), k if with_model else 0, width, extension if with_model else None)
        if with_model:  # j lookup tokens leave room for k - j of the model's
            speeds = np.where(np.add.outer(np.arange(found + 1), np.arange(k + 1)) <= k, speeds, -np.inf)
        best, choice = -1.0, 0
        for j, fastest in enumerate(speeds.max(axis=1).tolist()):
            if fastest >= best * (1 - 1e-9):
                best, choice = fastest, j
        return choice

    def unmeasured(self, best: int, found: int) -> int | None:
        """A lookup length in 1..found whose verify width (length + 1) was never measured, the nearest `best` (the
        shorter on a tie); None when each was. A verify's cost need not grow smoothly with its width (on a CPU one
        width can cost far more than the next narrower one: docs/lab/2026-12-01-drafters.md), which the line through
        the tried widths cannot know, and the chain would propose a length whose width is slow a token. So each
        width a lookup round can choose is measured once before the costs decide: at most k - 1 rounds a
        cost model, each still emitting its accepted tokens."""
        untried = [j for j in range(1, found + 1) if j + 1 not in self.cost.verify_s]
        return min(untried, key=lambda j: (abs(j - best), j)) if untried else None

    def stalest(self, best: int, found: int) -> int:
        """Of the lookup lengths best + 1..found, the one whose verify width was measured longest ago (the longer
        on a tie): what a match cut short proposes now and then to measure a wider width again."""
        return min(range(best + 1, found + 1), key=lambda j: (self.cost.verified.get(j + 1, -1), -j))

    def probe(self) -> bool:
        """Lookup's tokens are judged a loss this round: whether to propose them anyway (a probe: every `interval`
        such rounds, doubling while they stay a loss)."""
        self.idle += 1
        if self.idle >= self.interval:
            self.idle = 0
            self.interval = min(2 * self.interval, self.cost.PROBE_MAX)
            return True
        return False

    def length(self, found: int, k: int, policy: DraftLength, extension: Stepped | None = None) -> int:
        """How many of the `found` tokens prompt lookup matched to propose in a round of at most k of the stream's
        `policy`: by cost (with `extension`, the chained draft model may draft in their place); 0 where its
        measured acceptance makes them a loss at the measured verify costs, but all of them in a probe now and
        then."""
        if found == 0:
            return 0
        padded = policy.padded
        best = self.best(found, k, k + 1 if padded else 0, extension)
        if best is None or self.cost.seen[self.SOURCE] < DraftLength.WARMUP:
            # Measure first: judged on its prior acceptance alone, a slow first verify of the draft model's
            # warm-up could back lookup off for a probe interval on text it copies (the CPU chain: 13 rounds).
            return found
        if best:
            self.idle, self.interval, self.off = 0, self.cost.PROBE_FIRST, False
            # Where the width is the drafts' own (no padding), an unmeasured one is tried once first: the chain's
            # model then adds nothing this round (`ChainCost.extension`), so the verify measures that width.
            untried = None if padded else self.unmeasured(best, found)
            if untried is not None:
                self.measuring = True
                return untried
            if best < found:
                # Cut short by the verify's cost at the longer widths: measured once, maybe in a slow moment, a
                # width not verified again is never measured again, and one slow figure would hold lookup short of
                # matches that are nearly always right (docs/lab/2026-12-01-drafters.md). Every EPOCH such rounds
                # in a row, a longer length, the one whose
                # width was measured longest ago (padded, where every width costs the same: all of them).
                self.short += 1
                if self.short >= DraftLength.EPOCH:
                    self.short = 0
                    best = found if padded else self.stalest(best, found)
                    self.measuring = not padded
            else:
                self.short = 0
            return best
        # A loss at the full length is one at any (`best` takes the best j <= found, and a match is k long):
        # backed off until a probe or a new judgement. A shorter round's (k cut by max_tokens) says less.
        self.off = self.off or k >= policy.k_max
        return self.probe_length(found, padded) if self.probe() else 0

    @staticmethod
    def probe_length(found: int, padded: bool) -> int:
        """How many of a match a probe proposes: its first token where the verify's width is the drafts' own (a CPU),
        all of it where the verify is padded anyway. A probe asks whether lookup's first token has become right (it
        was judged a loss because that one was wrong): one token answers that at a two-token verify, and a match
        that is right again is then proposed at the length its costs pay. Proposing all of it (7 tokens wide) cost
        5.5 one-token verifies on the CPU demo pair, wrong on Q&A: one probe a 32-token reply, about 14% of it."""
        return found if padded else min(found, 1)

    def wanted(self) -> bool:
        """Whether prompt lookup should search this round. Not while its tokens are judged a loss (`length` cut a
        match to nothing): each such round counts towards its probe as a cut match does. But it searches when a
        probe is due (the next match probes), right after one and every EPOCH rounds, for `length` to
        judge again (by the probe's verdict; the verify costs may have moved)."""
        if not self.off or self.idle + 1 >= self.interval:
            return True
        judge = self.idle % DraftLength.EPOCH == 0
        self.idle += 1
        return judge


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter:
    return LookupDrafter()


def priced_proposal(req: DraftRequest, tokens: list[int], k: int, length: DraftLength | None,
                    rule: LookupCost | None, extension: type[CostRule] | None = None) -> Proposal:
    """A lead drafter's found continuation as its proposal (prompt lookup's, suffix lookup's): cut to as many as pay
    by its `rule` on the stream's `length` policy (with `extension`, the `Stepped` rule of a drafter that drafts
    after them, whose best share is priced in), then to what the grammar allows; point masses at T > 0."""
    tokens = text_prefix(tokens)  # (a context holding a picture: its placeholder ids are no tokens to draft)
    if rule is not None:
        assert length is not None
        after = length.rule(extension) if extension is not None else None
        tokens = tokens[: rule.length(len(tokens), k, length, after)]
    if req.grammar is not None:
        tokens = _allowed_prefix(tokens, req.grammar)
    return Proposal(tokens, None if req.sampling.greedy else [point_mass(t) for t in tokens], lead=len(tokens))
