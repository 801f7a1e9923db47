"""Chained drafting: prompt lookup first; then the draft model, where lookup finds nothing or to extend a match
shorter than k, by as many tokens as the stream's cost model says pay (`policies.DraftLength.extension`): up to
k - m where a draft step is cheap against a verify (a GPU), none where it costs about a target step (the 2-core
CPU demo pair; there a round with no match is a plain step). Per round and per request, so a reply drafts by lookup
while it quotes and by the model between, and chaining never does worse than the better of its parts by much more
than the model's two-round warm-up (once per slot) and the occasional probe of a model it has turned off. Lookup's
length is chosen on the same measured verify costs as lookup alone's (`policies.DraftLength.lookup_length`). A
round of the model's tokens alone drafts ahead beside its verify as the model drafter does (`overlap`); where that
bet came true and lookup matches too, the round is the bet's unless lookup's is expected to pay more
(`DraftLength.prefer_bet`: the bet costs no draft steps on the path)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from localspec.drafters.base import Drafter, DraftRequest, PromptWork, Proposal
from localspec.drafters.lookup import LookupDrafter
from localspec.drafters.model import Bet, ModelDrafter
from localspec.scores import ScoringModel


class ChainDrafter:
    def __init__(self, lookup: LookupDrafter, model: ModelDrafter) -> None:
        self.lookup, self.model = lookup, model
        self.models = model.models

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        return self.lookup.begin(req, prompt) + self.model.begin(req, prompt)

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]]) -> list[Proposal]:
        found = self.lookup.draft(jobs)
        # The model continues each lookup draft (from the committed tokens where lookup found nothing).
        lengths = []
        for i, ((req, k), p) in enumerate(zip(jobs, found, strict=True)):
            # A bet drafted beside the last verify (`overlap`) that came true holds the model's round, drafted
            # already; a round that uses it asks for its length (another length, or lookup's tokens first, throw
            # it, its draws given back).
            bet = self.model.bet(req) if len(jobs) == 1 else None
            if bet is not None and bet.k > k:
                bet = None
            if bet is not None and p.tokens and self._prefer_bet(req, k, len(p.tokens), bet):
                found[i] = Proposal([], None if p.q is None else [])  # (lookup's point masses: no draws to give back)
                lengths.append(bet.k)
                continue
            n = self._extension(req, k, len(p.tokens))
            # Where lookup found nothing and the model drafts, the bet's length (another would throw it).
            lengths.append(bet.k if bet is not None and not p.tokens and n else n)
        rest = self.model.draft([(req, n) for (req, _), n in zip(jobs, lengths, strict=True)],
                                after=[p.tokens for p in found])
        return [Proposal(a.tokens + b.tokens, None if a.q is None else a.q + (b.q or []), a.seconds + b.seconds,
                         looked_up=len(a.tokens), first_s=b.first_s, least_s=b.least_s, ahead=b.ahead)
                for a, b in zip(found, rest, strict=True)]

    @staticmethod
    def _prefer_bet(req: DraftRequest, k: int, looked_up: int, bet: Bet) -> bool:
        """Lookup matched while a bet is held: the bet's round unless lookup's (with the model's extension on the
        path) is expected to pay more. On the H200's shipped prompts lookup's short matches are rarely right, and
        taking them threw the bet, and the next round's too (nothing is drafted ahead after lookup's tokens)."""
        return req.length is not None and req.length.prefer_bet(looked_up, k, bet.ready, bet.room)

    def _extension(self, req: DraftRequest, k: int, looked_up: int) -> int:
        if req.length is None:  # no policy to ask: all of the rest
            return k - looked_up
        return req.length.extension(looked_up, k, lag=self.model.lag(req))

    def overlap(self, req: DraftRequest, proposal: Proposal,
                k_next: int) -> contextlib.AbstractContextManager[None]:
        """A round of the model's drafts alone lets it draft the next round beside the verify, as the model
        drafter does (on the H200 that hides ~6-8 ms of a round's draft steps). The bet is used only if the next
        round is the model's alone again with the same length (`draft`: where lookup matches, the bet's round unless
        lookup's pays more); else it is thrown, its draws given back.
        A round with lookup's tokens drafts nothing ahead: the bet's guess would follow tokens the model did not
        draft, and the next round's lookup decides first."""
        if proposal.looked_up or not proposal.tokens:
            return contextlib.nullcontext()
        return self.model.overlap(req, proposal, k_next)

    def accept(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        self.model.accept(req, proposal, accepted)

    def cells(self, seq: int) -> list[tuple[ScoringModel, list[int]]]:
        return []  # its parts are the registry's too, and answer there

    def reset(self) -> None:
        pass  # its parts are the registry's too, and reset there

    def close(self) -> None:
        pass  # likewise


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter:
    """Without a draft model the chain is lookup alone."""
    lookup, model = built["lookup"], built.get("model")
    if model is None:
        return lookup
    assert isinstance(lookup, LookupDrafter) and isinstance(model, ModelDrafter)
    return ChainDrafter(lookup, model)
