"""Suffix lookup: draft the most frequent continuation of the deepest earlier occurrence of the context's end, in
the context itself and in past requests' prompts and replies of the same caller (SuffixDecoding, arXiv 2411.04975).

Coding agents resend long, repeated prompts: tool outputs pasted back, files rewritten with small edits, the same
JSON shapes again and again. Prompt lookup (`lookup`) matches the current context only, one n-gram length at a
time, and proposes the latest occurrence's continuation. This drafter keeps an index (`_suffix_index`) over the
current context and over recent requests' text (a budget of tokens per served pair, in host RAM, the oldest
request out first), finds the deepest match of the context's end (up to `suffix_depth` tokens), and proposes the
continuation most of those occurrences agree on, for at most `suffix_factor` x the match's depth tokens and while
the share that agrees along the path stays at or above `suffix_min_prob`: long where the match is deep and the
text repeats, short or nothing where it is shallow or the occurrences disagree. How many of those tokens a round
proposes is then priced as prompt lookup's are (`SuffixCost`: its own measured acceptance per position at the
verify's measured cost by width, none where they are a loss, probed now and then).

The proposal is a function of the text alone, so q is a point mass on each token (`sampling.point_mass`):
rejection sampling accepts a token with the target's probability and resamples from the rest, exact at every
temperature, as with prompt lookup.

Whose text a request may draft from: its own context and the past documents of its owner (`owner_of`), never
another's. The drafter is per engine, so per served pair: another pair's text is never in its index. The index is
host memory only: a restart starts empty (`reset` empties it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localspec.config import Drafting
from localspec.drafters._suffix_index import ContextStream, SuffixStore, best_continuation
from localspec.drafters.base import Drafter, DrafterBase, DraftRequest, PromptWork, Proposal
from localspec.drafters.lookup import LookupCost, priced_proposal
from localspec.rounds.policies import CostRule, DraftCost
from localspec.rounds.scores import ScoringModel

CONTEXT_WINDOW = 1 << 18  # a request's latest tokens its own context is searched over (a context is n_ctx at most)


def owner_of(req: DraftRequest) -> str:
    """Whose text the request may draft from: its `owner` (`DraftRequest.owner`; "" for every request to a server,
    which answers one API key)."""
    return req.owner


class SuffixCost(LookupCost):
    """Suffix lookup's prices: prompt lookup's rule (its tokens cost no draft step, only the verify's width; how
    many pay at the measured acceptance per position and verify costs; backed off and probed where they are a
    loss) over a source of its own, so its acceptance is measured apart from lookup's, and from its prior again each
    request (`LookupCost.begin_generation`): its index spans requests, but whether this one's text follows it is this
    request's."""

    SOURCE = "suffix"
    PRIOR = 0.8  # its path is cut where the occurrences disagree: right most of the time, less sure than lookup's


@dataclass(eq=False, slots=True)
class _Context:
    """A sequence's generation: its request, owner and context stream."""

    req: DraftRequest
    owner: str
    stream: ContextStream


class SuffixDrafter(DrafterBase):
    def __init__(self, window: int = CONTEXT_WINDOW) -> None:
        super().__init__()
        self.window = window
        self.store = SuffixStore(0)  # past requests' text per owner (its budget: the latest request's setting)
        self._contexts: dict[int, _Context] = {}

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        self._retire(req.seq)
        self._contexts[req.seq] = _Context(req, owner_of(req), ContextStream(prompt, self.window))
        return []

    def _retire(self, seq: int) -> None:
        """The sequence's last generation is over (a new one begins there): its text becomes a past document of its
        owner."""
        held = self._contexts.pop(seq, None)
        if held is None:
            return
        self.store.budget = held.req.drafting.suffix_budget
        self.store.add(held.owner, held.stream.tokens)
        self.store.evict()  # (a budget lowered since)

    def _context(self, req: DraftRequest) -> _Context:
        """The request's context, following its committed tokens (a request the drafter did not `begin`, or a new
        one in the sequence, starts one)."""
        held = self._contexts.get(req.seq)
        if held is None or held.req is not req:
            self.begin(req, req.tokens)
            held = self._contexts[req.seq]
        return held

    def rewind(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        # The committed tokens, copied every round (a new request in the slot replaces the loop's list in place
        # before `begin`, where this one's text is kept).
        self._context(req).stream.sync(req.tokens, index=False)

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]]) -> list[Proposal]:
        return [self.propose(req, k) for req, k in jobs]

    def propose(self, req: DraftRequest, k: int, extension: type[CostRule] | None = None) -> Proposal:
        """Up to k tokens for the request, as many as pay (`SuffixCost.length`; with `extension`, the `Stepped` rule
        of a drafter that drafts after them, whose best share is priced in)."""
        length = self.length(req)
        rule = length.rule(SuffixCost) if length is not None else None
        held = self._context(req)
        if k <= 0 or (rule is not None and not rule.wanted()):
            return Proposal([], None if req.sampling.greedy else [])
        held.stream.sync(req.tokens, index=True)
        corpus = self.store.corpus(held.owner)
        streams = [corpus.stream, held.stream] if corpus is not None else [held.stream]
        drafting = req.drafting
        tokens = best_continuation(streams, req.tokens, k, depth=drafting.suffix_depth,
                                   factor=drafting.suffix_factor, min_prob=drafting.suffix_min_prob,
                                   follows_query=held.stream).tokens
        return priced_proposal(req, tokens, k, length, rule, extension)

    def pricing(self, cost: DraftCost, drafting: Drafting) -> None:
        """Its cost rule on this stream's facts; k stays fixed (its tokens cost no draft steps)."""
        SuffixCost.of(cost)

    def reset(self) -> None:
        self._contexts.clear()
        self.store.clear()

    def close(self) -> None:
        self.reset()


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter:
    return SuffixDrafter()
