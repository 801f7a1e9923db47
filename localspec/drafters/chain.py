"""Chained drafting: prompt lookup first; then the draft model, where lookup finds nothing or to extend a match
shorter than k, by as many tokens as the stream's cost model says pay (`policies.DraftLength.extension`): up to
k - m where a draft step is cheap against a verify (a GPU), none where it costs about a target step (the 2-core
CPU demo pair; there a round with no match is a plain step). Per round and per request, so a reply drafts by lookup
while it quotes and by the model between, and chaining never does worse than the better of its parts by much more
than the model's two-round warm-up (once per slot) and the occasional probe of a model it has turned off. Lookup's
length is chosen on the same measured verify costs as lookup alone's (`policies.DraftLength.lookup_length`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from localspec.drafters.base import Drafter, DraftRequest, PromptWork, Proposal
from localspec.drafters.lookup import LookupDrafter
from localspec.drafters.model import ModelDrafter
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
        rest = self.model.draft([(req, self._extension(req, k, len(p.tokens)))
                                 for (req, k), p in zip(jobs, found, strict=True)], after=[p.tokens for p in found])
        return [Proposal(a.tokens + b.tokens, None if a.q is None else a.q + (b.q or []), a.seconds + b.seconds,
                         looked_up=len(a.tokens), first_s=b.first_s) for a, b in zip(found, rest, strict=True)]

    def _extension(self, req: DraftRequest, k: int, looked_up: int) -> int:
        if req.length is None:  # no policy to ask: all of the rest
            return k - looked_up
        return req.length.extension(looked_up, k, lag=self.model.lag(req))

    def overlap(self, req: DraftRequest, proposal: Proposal, k_next: int) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()  # draft-ahead bets on the model's own drafts: not here

    def accept(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        self.model.accept(req, proposal, accepted)

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
