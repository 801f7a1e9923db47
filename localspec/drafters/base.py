"""The drafter seam: what the loop asks of whoever proposes draft tokens, and what it gets back.

A round is begin → draft → verify → accept → rewind. The loop owns the target, the verify and the acceptance; a
drafter owns everything about proposing: its models, their KV cells, its random stream, any work it overlaps with
the verify. Values cross the seam, not shared mutable state: the loop hands a drafter `(DraftRequest, k)` jobs and
gets `Proposal`s back (tokens and the distribution q each was drawn from), then tells it how many were accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from localspec.config import Drafting, Sampling
from localspec.events import GenerationStats
from localspec.llama.grammar import Grammar
from localspec.policies import DraftCost, DraftLength, Pricing
from localspec.prompt_cache import shared_prefix as shared_prefix
from localspec.sampling import Candidates
from localspec.scores import DeviceDist, ScoringModel

PromptWork = tuple[ScoringModel, list[int], list[int]]  # (model, the tokens its cells hold, tokens still to decode)


@dataclass(frozen=True, slots=True)
class Proposal:
    """A drafter's answer for one request: up to k tokens, each with the distribution it was drawn from."""

    tokens: list[int]
    # Per token, q (one row) at T > 0; None at temperature 0. A deterministic drafter gives a point mass
    # (`sampling.point_mass`): rejection sampling then accepts with p(x) and resamples from p, exact either way.
    q: list[Candidates] | None = None
    seconds: float = 0.0  # drafting time on the round's critical path (draft-ahead made beside the verify: 0)
    # How many of the tokens (the first ones) came from the lead source, at no draft step (prompt lookup's); the
    # rest are stepped, one draft decode each (a draft model's). The cost model counts each source's acceptance.
    lead: int = 0
    # Of `seconds`, the first draft step: it also reads what the drafter had not seen (tokens committed while it sat
    # out, lookup's drafts) and may capture a CUDA graph, so it is no measure of a step (`DraftCost`).
    first_s: float = 0.0
    # The least of its later steps (None: fewer than two). On CUDA the two calls after a width change (the first
    # step's catch-up) run the graph uncaptured: a probe's average step was 2.6-2.8 ms where a steady one is 1.35.
    least_s: float | None = None
    ahead: int = 0  # how many of the tokens (the first ones) were drafted beside the last verify (a kept bet)


NO_PROPOSAL = Proposal([])


@dataclass(eq=False)
class DraftRequest:
    """What a drafter knows of one generation: its sequence (slot), settings, committed tokens and stats."""

    seq: int
    tokens: list[int]  # the committed sequence, prompt + output (the loop's list: drafters read it, never write)
    sampling: Sampling
    drafting: Drafting
    stats: GenerationStats  # drafters add what only they know (draft-ahead's counts)
    # A constrained request's grammar state after the committed tokens, a copy the loop makes each round: a
    # drafter proposes only what it allows and advances it by each token it proposes (end-of-generation aside).
    # None: unconstrained, or the draft is not masked.
    grammar: Grammar | None = None
    # How its models read rows under that grammar (`device_mode`'s grammar_rows): "full" or "device" candidates.
    grammar_rows: str = "full"
    # The stream's draft-length policy and cost model: a drafter asks its own cost rule through it
    # (`length.rule(ItsCost)`), which keeps what it measured for the stream.
    length: DraftLength | None = None


@runtime_checkable
class ReadsTarget(Protocol):
    """A drafter that drafts from the target's own hidden states (an MTP head): the loop has the target return
    them (`LlamaModel.want_hidden`) for its streams and hands it every row the target decodes for them."""

    def target_limit(self, req: DraftRequest, prompt: list[int]) -> int:
        """A generation starts with `prompt`: how many of the target's cached cells it can follow (it needs the
        target's hidden state after each token from where its own cells end); the loop decodes the rest again."""
        ...

    def target_kept(self, req: DraftRequest, kept: int) -> None:
        """The target's cells now hold the prompt's first `kept` tokens."""
        ...

    def target_rows(self, req: DraftRequest, start: int, hidden: np.ndarray) -> None:
        """The target decoded positions start.. of the sequence (`req.tokens`, plus a verify's drafts, which the
        next `accept` settles) with these hidden states, one row per token."""
        ...


class Drafter(Protocol):
    """Whoever proposes draft tokens. Implementations live one per file in `localspec/drafters/` (the registry
    finds them there); the loop never knows which one runs."""

    models: tuple[ScoringModel, ...]  # the models it decodes with: slots and context are sized by them too

    def pricing(self, cost: DraftCost, drafting: Drafting) -> Pricing | None:
        """A stream with these settings starts (or goes on) with the measured facts `cost`: attach this drafter's
        cost rules to them (`CostRule.of`, kept with them) and return the prices `adaptive` chooses k by, or None
        (k stays the preset's; the drafter may still propose fewer by its own rules)."""
        ...

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        """A generation starts in `req.seq` with `prompt`: forget the last one's state there and return the
        prompt tokens its models still need (the loop decodes them beside the target's, in the same rounds)."""
        ...

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]]) -> list[Proposal]:
        """Up to k tokens for each request (k may be 0), continuing its committed tokens: one proposal per job."""
        ...

    def overlap(self, req: DraftRequest, proposal: Proposal, k_next: int) -> AbstractContextManager[None]:
        """Work to do while the target verifies `proposal` (the block is the verify). The loop asks only for a
        request alone in its round, and only when the drafter's models have a device of their own (draft-ahead:
        bet on the verdict and draft the next `k_next` tokens, or with `ahead_length = "fit"` what fits beside the
        verify: it stops when the block ends)."""
        ...

    def accept(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        """The verdict: `accepted` of the proposal's tokens were kept and `req.tokens` now holds the round's
        committed tokens. Learn from it and rewind whatever state went past them. A generation that ends inside the
        round (a stop after one of its tokens) cuts `req.tokens` back to there and calls it again with no proposal
        and 0: a round that drafted nothing, whose only news is the shorter tokens."""
        ...

    def cells(self, seq: int) -> list[tuple[ScoringModel, list[int]]]:
        """Per model of its own (none that another drafter in the registry owns), the tokens its cells hold for
        `seq`: the live bookkeeping list, which the loop rewrites in place when it restores or erases the slot's
        cells (the prompt cache, slot files)."""
        ...

    def reset(self) -> None:
        """Forget every sequence's state (the models' KV cells included)."""
        ...

    def close(self) -> None:
        """Stop any worker; the drafter is not used again."""
        ...


def prompt_work(model: ScoringModel, kv: list[int], body: list[int], seq: int,
                limit: int | None = None) -> PromptWork:
    """Cut a sequence's cells back to the longest prefix of `body` they hold (at most `limit`), or as far as the
    model can rewind towards it (a recurrent state: a checkpoint, or nothing); what is left to decode."""
    keep = shared_prefix(kv, body)
    if limit is not None:
        keep = min(keep, limit)
    # Truncate even when the bookkeeping says nothing is extra: a decode interrupted by an exception may have left
    # cells the bookkeeping never recorded. Bookkeeping first: an interrupted truncate leaves it claiming less.
    del kv[keep:]
    del kv[model.truncate(keep, seq):]
    return model, kv, body[len(kv):]


def device_mode(model: ScoringModel, sampling: Sampling, p_min: float, *, plain: bool = False,
                trace: bool = False, grammar_rows: str | None = None) -> str | DeviceDist | None:
    """What the device should compute per row. A penalty needs the penalised tokens' logits wherever they rank:
    full rows. Greedy needs only the argmax (unless p_min or a trace needs the candidates' logits); plain decoding
    at T > 0 draws its token on the device (the whole pipeline, nothing copied back); a top-k pipeline needs the
    top candidates (rejection sampling compares p and q), and top_k = 0 needs every logit: full rows.

    A grammar (`grammar_rows`, the preset's `[load] constrained_rows`) needs logits to mask, never the device's own
    choice: "full" rows (the default: faster on a GPU, docs/performance.md), or "device": greedy and top-k get the
    top candidates (a row whose candidates hold too few legal tokens is decoded again in full: engine.py)."""
    if sampling.penalized or grammar_rows == "full":
        return None
    constrained = grammar_rows is not None
    if sampling.greedy:
        return "top_k" if p_min > 0.0 or trace or constrained else "greedy"
    if constrained:
        return "top_k" if 0 < sampling.top_k <= model.device_top_k else None
    if plain:
        return DeviceDist(sampling.top_k, sampling.top_p, sampling.min_p, sampling.temperature, sampling.seed)
    if 0 < sampling.top_k <= model.device_top_k:
        return "top_k"
    return None
