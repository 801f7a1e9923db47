"""Chained drafting: prompt lookup first; then the draft model, where lookup finds nothing or to extend a match
shorter than k, by as many tokens as the round's prices say pay (`ChainCost.extension`): up to k - m where a draft
step is cheap against a verify (a GPU), none where it costs about a target step (a small pair on a CPU; there a
round with no match is a plain step). Per round and per request, so a reply drafts by lookup while it quotes and by
the model between. Lookup's length is chosen on the same measured verify costs as lookup alone's, with the model's
best share after it priced in (`lookup.LookupCost.length`). A round of the model's tokens alone drafts ahead beside
its verify as the model drafter does (`draft_ahead`); where that draft-ahead held and lookup matches too, the round
is the draft-ahead's unless lookup's is expected to pay more (`ChainCost.prefer_draft_ahead`: the draft-ahead costs no
draft steps on the path). The lead may be suffix lookup instead (`[draft] chain_lead = "suffix"`: the deepest match
in the context and in past requests, `drafters/suffix.py`), priced by the same rule over its own acceptance.

It makes no promise to keep up with the better of its parts: it tracks the draft model's pace where lookup rarely
matches and lookup's where drafting costs about a verify, but a reply that quotes little of its prompt can hold it near
lookup's pace while the model alone would do better (docs/performance.md, "Drafters: the draft model, prompt lookup,
both chained", has the figures): on a GPU the draft model is the safe choice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from localspec.config import Drafting
from localspec.drafters.base import Drafter, DrafterBase, DraftRequest, PromptWork, Proposal, Spent
from localspec.drafters.lookup import LookupCost, LookupDrafter
from localspec.drafters.model import DraftAhead, ModelCost, ModelDrafter
from localspec.drafters.model import unavailable as model_unavailable
from localspec.drafters.suffix import SuffixCost, SuffixDrafter
from localspec.rounds.policies import CostRule, DraftCost, DraftLength
from localspec.rounds.scores import ScoringModel

NEEDS = ("lookup", "model", "suffix")  # built after its parts (the registry's order)
LLAMA_SERVER_TYPE = "ngram-simple,draft-simple"  # its `speculative.type` (llama-server's --spec-type list)


class ChainCost(CostRule):
    """The chain's prices over its parts' rules (lookup's tokens lead the round, the model's follow): how many of
    the model's tokens follow lookup's (`extension`), and a held draft-ahead weighed against lookup's match
    (`prefer_draft_ahead`)."""

    def __init__(self, cost: DraftCost) -> None:
        super().__init__(cost)
        # The lead's rule: prompt lookup's, or suffix lookup's where the stream's lead is suffix lookup (`[draft]
        # chain_lead`: its pricing attached it first, as the stream's lead source).
        lead = SuffixCost if cost.lead_source == SuffixCost.SOURCE else LookupCost
        self.lookup, self.model = lead.of(cost), ModelCost.of(cost)

    def extension(self, looked_up: int, k: int, policy: DraftLength, lag: int = 1) -> int:
        """How many draft-model tokens should follow `looked_up` lookup tokens in a round of at most k drafts of
        the stream's `policy`, by the round's price: 0 where the model is a net loss (then probed now and then;
        where lookup found nothing and the model alone was paying, it stays on until it is a loss by MIN_GAIN: its
        acceptance is an estimate from a few dozen rounds, and a streak of rejections must not switch it off).
        `lag`: how many committed tokens the draft model's cells lack (1: in sync, a probe costs no catching up;
        more: a probe out of sync waits while catching up would cost too much)."""
        cost, model = self.cost, self.model
        room = k - looked_up
        if room <= 0 or self.lookup.measuring:
            return 0
        if cost.model_hopeless and cost.step_rounds == cost.model_hopeless_steps >= policy.WARMUP:
            # Judged a loss even if every token were kept, on the draft step measured then, and no step measured
            # since: the verdict stands, nothing to price (this round's host work is on the path). A verify that has
            # since run slower (other slots decoding beside it, a longer context) moves one side of the price alone
            # and must not turn the model on: only a probe (in sync, at the longest interval) measures a step beside
            # today's verify. Served to 4 clients on a CPU, a new slot's second verify, slowed by the others', priced
            # the model as paying: it drafted after catching up on its whole prompt (~0.2 s a slot).
            return self._sit_out(room, looked_up, lag, hopeless=True)
        width = k + 1 if policy.padded else 0
        speeds = model.speeds(looked_up, room, width)
        if speeds is None:
            return min(room, model.PROBE)  # measure first, as cheaply as a probe
        if not looked_up and cost.plain_unpriced(policy.padded):
            # One plain round before the model drafts again (as the model drafter's rule does): judged against the
            # prior slope's guess of a one-token verify, the model looked paying on a CPU, and a 32-token reply spent
            # its first rounds drafting 6 with it.
            return 0
        n = int(np.argmax(speeds))
        # Judged where the model's tokens pay most (no lookup tokens before them: all of k, the narrowest verify);
        # asked only where the answer matters (a round's host work is on the path).
        hopeless = (not n or cost.step_rounds < policy.WARMUP) and not model.could_pay(0, k, width)
        if cost.step_rounds < policy.WARMUP:
            return min(room, model.PROBE) if hopeless else room
        if hopeless:
            cost.model_hopeless_steps = cost.step_rounds
        cost.model_hopeless = hopeless
        if not n and not looked_up and not hopeless and model.model_on:
            # The model alone was paying: it stays on until it is a loss by MIN_GAIN. Its acceptance is measured
            # over a few dozen rounds, and a streak of early rejections would otherwise switch off a paying model
            # until the next probe (docs/lab/2026-12-01-drafters.md has the replay that showed it).
            best = 1 + int(np.argmax(speeds[1:]))
            n = best if policy.MIN_GAIN * speeds[best] >= speeds[0] else 0
        if n:
            model.pays()
            return n
        return self._sit_out(room, looked_up, lag, hopeless)

    def _sit_out(self, room: int, looked_up: int, lag: int, hopeless: bool) -> int:
        """A round the model is judged a loss in: none of its tokens, or a probe's when one is due."""
        model = self.model
        if not looked_up:
            model.model_on = False
        if hopeless:
            # A loss even if every token were accepted (a draft step about a one-token verify, as on a CPU): no
            # acceptance a probe could measure turns it on, only a change of costs, so it is probed at the longest
            # interval, and only where the model's cells are current (catching up would be pure loss).
            model.interval = self.cost.PROBE_MAX
        probe = model.probe(room, lag, in_sync_only=hopeless)
        # A probe of a model that could pay drafts all the room: two tokens measure two positions, and the deeper
        # ones, borrowing the last measured rate, would be judged on one rejection.
        return room if probe and not hopeless else probe

    def prefer_draft_ahead(self, looked_up: int, k: int, ready: int, room: int, policy: DraftLength) -> bool:
        """The chain holds a draft-ahead that held (`ready` drafts made beside the last verify, `room` more it may
        draft on the path) and lookup found `looked_up` tokens in a round of at most k: whether the draft-ahead's
        round is expected to be at least as fast (tokens per second) as lookup's tokens with the model's best
        extension on the path. The draft-ahead unless lookup is expected to pay more (it cost no draft steps;
        unmeasured: the draft-ahead)."""
        width = k + 1 if policy.padded else 0
        held = self.model.held_draft_ahead_speed(ready, room, width)
        lookup = self.model.speeds(looked_up, k - looked_up, width)
        return held is None or lookup is None or float(lookup.max()) <= held


class ChainDrafter(DrafterBase):
    def __init__(self, lookup: LookupDrafter, model: ModelDrafter, suffix: SuffixDrafter | None = None) -> None:
        super().__init__()
        self.lookup, self.model, self.suffix = lookup, model, suffix
        self.models = model.models

    def lead(self, drafting: Drafting) -> LookupDrafter | SuffixDrafter:
        """Whose tokens come first (`[draft] chain_lead`): prompt lookup's or suffix lookup's."""
        return self.suffix if drafting.chain_lead == "suffix" and self.suffix is not None else self.lookup

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        length = self.length(req)  # (its parts reach their rules through the same policy)
        lead = self.lead(req.drafting).start(req, prompt, length)
        cost = length.cost if length is not None else None
        if cost is not None and cost.model_hopeless:
            # A draft model that would lose at any acceptance drafts only in sync, so reading the prompt into it
            # buys nothing but the generation's first-round probe: read it every PLAIN_GENERATIONS-th generation
            # (whose first rounds probe, the interval permitting), else leave the draft behind (its cells cut to
            # what they share with the prompt; nothing decoded). On a small pair on a CPU the draft reads a prompt
            # about as slowly as the target: the time to first token doubled.
            cost.model_generations += 1
            if cost.model_generations % cost.PLAIN_GENERATIONS:
                self.model.start_behind(req, prompt, length)
                return lead
        return lead + self.model.start(req, prompt, length)

    def pricing(self, cost: DraftCost, drafting: Drafting) -> None:
        """Its parts' rules on this stream's facts; k stays fixed (each round's shares are decided by cost)."""
        self.lead(drafting).pricing(cost, drafting)
        self.model.pricing(cost, drafting)
        ChainCost.of(cost)

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]]) -> list[Proposal]:
        # Lookup's length with the model's best share after it priced in.
        found = [self.lead(req.drafting).propose(req, k, ModelCost) for req, k in jobs]
        # The model continues each lookup draft (from the committed tokens where lookup found nothing).
        lengths = []
        for i, ((req, k), p) in enumerate(zip(jobs, found, strict=True)):
            # A draft-ahead made beside the last verify (`draft_ahead`) that held is the model's round, drafted
            # already; a round that uses it asks for its length (another length, or lookup's tokens first, throw
            # it, its draws given back).
            held = self.model.drafted_ahead(req) if len(jobs) == 1 else None
            if held is not None and held.k > k:
                held = None
            if held is not None and p.tokens and self._prefer_draft_ahead(req, k, len(p.tokens), held):
                found[i] = Proposal([], None if p.q is None else [])  # (lookup's point masses: no draws to give back)
                lengths.append(held.k)
                continue
            n = self._extension(req, k, len(p.tokens))
            # Where lookup found nothing and the model drafts, the draft-ahead's length (another would throw it).
            lengths.append(held.k if held is not None and not p.tokens and n else n)
        rest = self.model.draft([(req, n) for (req, _), n in zip(jobs, lengths, strict=True)],
                                after=[p.tokens for p in found])
        out = []
        for (req, _), a, b in zip(jobs, found, rest, strict=True):
            spent = self.model.spent(req)  # (lookup's tokens cost no draft step)
            self.spend(req, Spent(spent.seconds, spent.first_s, spent.least_s, spent.drafted_ahead))
            out.append(Proposal(a.tokens + b.tokens, None if a.q is None else a.q + (b.q or []), lead=len(a.tokens)))
        return out

    def _prefer_draft_ahead(self, req: DraftRequest, k: int, looked_up: int, held: DraftAhead) -> bool:
        """Lookup matched while a draft-ahead is held: the draft-ahead's round unless lookup's (with the model's
        extension on the path) is expected to pay more. Where lookup's short matches are rarely right, taking them
        would throw the draft-ahead, and the next round's too (nothing is drafted ahead after lookup's tokens)."""
        length = self.length(req)
        return length is not None and length.rule(ChainCost).prefer_draft_ahead(looked_up, k, held.ready, held.room,
                                                                                length)

    def _extension(self, req: DraftRequest, k: int, looked_up: int) -> int:
        length = self.length(req)
        if length is None:  # no policy to ask: all of the rest
            return k - looked_up
        return length.rule(ChainCost).extension(looked_up, k, length, lag=self.model.lag(req))

    def draft_ahead(self, req: DraftRequest, proposal: Proposal,
                    k_next: int) -> contextlib.AbstractContextManager[None]:
        """A round of the model's drafts alone lets it draft the next round beside the verify, as the model
        drafter does (it hides that round's draft steps: docs/lab/2026-12-01-drafters.md). The draft-ahead is used
        only if the next round is the model's alone again with the same length (`draft`: where lookup matches, the
        draft-ahead's round unless lookup's pays more); else it is thrown, its draws given back.
        A round with lookup's tokens drafts nothing ahead: its guess would follow tokens the model did not draft,
        and the next round's lookup decides first."""
        if proposal.lead or not proposal.tokens:
            return contextlib.nullcontext()
        return self.model.draft_ahead(req, proposal, k_next)

    def rewind(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        self.lead(req.drafting).rewind(req, proposal, accepted)
        self.model.rewind(req, proposal, accepted)

    # (Its parts are the registry's too: their cells, `reset` and `close` answer there.)


def unavailable(target: ScoringModel, draft: ScoringModel | None) -> str | None:
    """Why these models have no chain (one clause), None when they have one: the draft model's reason."""
    return model_unavailable(target, draft)


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter:
    """Without a draft model the chain is lookup alone."""
    lookup, model, suffix = built["lookup"], built.get("model"), built.get("suffix")
    if model is None:
        return lookup
    assert isinstance(lookup, LookupDrafter) and isinstance(model, ModelDrafter)
    return ChainDrafter(lookup, model, suffix if isinstance(suffix, SuffixDrafter) else None)
