"""Lookup or the MTP head, each round: the lead's match where it pays more, else the target's own MTP head.

Agent traffic repeats itself (files read back, tool output pasted in, the same JSON shapes): there a lookup drafter
(prompt lookup, or suffix lookup over past requests with `[draft] chain_lead = "suffix"`) proposes long runs at no
draft step; between such runs the MTP head drafts. Unlike the draft model's chain (`chain`), the head cannot continue
after the lead's tokens within a round: it drafts from the target's hidden state after the last committed token, and
the lead's tokens have none until they are verified. So a round is one or the other: the lead's match (cut by the
lead's own prices, `LookupCost.length`), kept where its expected tokens per second at the measured verify cost are at
least the head's best round's (`MtpCost.speeds`, the head's measured steps and per-position acceptance); the head's
draft otherwise, and while the head is unmeasured the lead's match is taken (it costs no draft step). The lead may
propose the round's whole length (`n_draft`), the head at most `mtp_n_draft` of it: a chained head's acceptance falls
with depth faster than a match's.

The head follows the target whoever drafted: every verify's hidden rows reach it (`target_rows`) and it decodes the
committed ones lazily before its next draft, as after a round it sat out. Exact at every temperature: the lead's
tokens are point masses, the head's drafts carry its q; the loop's rejection sampling takes either.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from localspec.config import Drafting
from localspec.drafters.base import (
    NO_PROPOSAL,
    NOTHING_SPENT,
    Drafter,
    DrafterBase,
    DraftRequest,
    PromptWork,
    Proposal,
)
from localspec.drafters.lookup import LookupDrafter
from localspec.drafters.mtp import MtpCost, MtpDrafter
from localspec.drafters.mtp import unavailable as mtp_unavailable
from localspec.drafters.suffix import SuffixDrafter
from localspec.rounds.policies import DraftCost, DraftLength
from localspec.rounds.scores import ScoringModel

NEEDS = ("lookup", "mtp", "suffix")  # built after its parts (the registry's order)
LLAMA_SERVER_TYPE = "ngram-simple,draft-mtp"  # its `speculative.type` (llama-server's --spec-type list)


def lead_pays(length: DraftLength, found: int, k: int) -> bool:
    """Whether a round of the lead's `found` tokens is expected to be at least as fast (tokens per second) as the
    head's best round of up to k drafts, by the stream's measured costs (`length.cost`); True while the head's steps
    or the verify are unmeasured (the lead's tokens cost no draft step: measured first)."""
    head = length.rule(MtpCost)
    width = k + 1 if length.padded else 0
    lead = head.speeds(found, 0, width)
    drafted = head.speeds(0, k, width)
    if lead is None or drafted is None:
        return True
    return float(lead[0]) >= float(np.max(drafted))


class ChainMtpDrafter(DrafterBase):
    reads_target = True  # the head reads the target's hidden state after each token, whoever drafted it

    def __init__(self, lookup: LookupDrafter, mtp: MtpDrafter, suffix: SuffixDrafter | None = None) -> None:
        super().__init__()
        self.lookup, self.mtp, self.suffix = lookup, mtp, suffix
        self.models = mtp.models

    def lead(self, drafting: Drafting) -> LookupDrafter | SuffixDrafter:
        """Whose match leads (`[draft] chain_lead`): prompt lookup's or suffix lookup's."""
        return self.suffix if drafting.chain_lead == "suffix" and self.suffix is not None else self.lookup

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        length = self.length(req)
        return self.lead(req.drafting).start(req, prompt, length) + self.mtp.start(req, prompt, length)

    def pricing(self, cost: DraftCost, drafting: Drafting) -> None:
        """Both parts' rules on this stream's facts (the lead's source and the head's); k stays fixed."""
        self.lead(drafting).pricing(cost, drafting)
        self.mtp.pricing(cost, drafting)

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]]) -> list[Proposal]:
        out: list[Proposal] = [NO_PROPOSAL] * len(jobs)
        heads: list[tuple[int, DraftRequest, int]] = []
        for i, (req, k) in enumerate(jobs):
            found = self.lead(req.drafting).propose(req, k)
            length = self.length(req)
            # The head drafts at most `mtp_n_draft` (its acceptance falls faster with depth than a lookup match's).
            head_k = min(k, req.drafting.mtp_n_draft)
            if found.tokens and (length is None or lead_pays(length, len(found.tokens), head_k)):
                self.spend(req, NOTHING_SPENT)  # (the lead's tokens cost no draft step)
                out[i] = found
            else:
                heads.append((i, req, head_k))
        if heads:
            drafted = self.mtp.draft([(req, k) for _, req, k in heads])
            for (i, req, _), proposal in zip(heads, drafted, strict=True):
                self.spend(req, self.mtp.spent(req))
                out[i] = Proposal(proposal.tokens, proposal.q)
        return out

    def rewind(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        self.lead(req.drafting).rewind(req, proposal, accepted)
        self.mtp.rewind(req, proposal, accepted)

    # The target-rows hook is the head's: it follows the target through every round.

    def target_limit(self, req: DraftRequest, prompt: list[int]) -> int:
        return self.mtp.target_limit(req, prompt)

    def target_kept(self, req: DraftRequest, kept: int) -> None:
        self.mtp.target_kept(req, kept)

    def target_rows(self, req: DraftRequest, start: int, hidden: np.ndarray) -> None:
        self.mtp.target_rows(req, start, hidden)

    # (Its parts are the registry's too: `reset` and `close` answer there.)


def unavailable(target: ScoringModel, draft: ScoringModel | None) -> str | None:
    """Why these models have no lookup-or-MTP chain (one clause), None when they have one: the head's reason."""
    return mtp_unavailable(target, draft)


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter | None:
    """Where the target carries MTP layers (the head's drafter was built)."""
    lookup, mtp, suffix = built["lookup"], built.get("mtp"), built.get("suffix")
    if not isinstance(mtp, MtpDrafter):
        return None
    assert isinstance(lookup, LookupDrafter)
    return ChainMtpDrafter(lookup, mtp, suffix if isinstance(suffix, SuffixDrafter) else None)
