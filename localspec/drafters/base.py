"""The drafter seam: what the loop asks of whoever proposes draft tokens, and what it gets back.

A round is draft → verify → rewind → accept (after `start`, which begins a generation's prompt). The loop owns the
target, the verify and the acceptance; a drafter owns everything about proposing: its models, their KV cells, its
random stream, any work it overlaps with the verify. Values cross the seam, not shared mutable state: the loop hands
a drafter `(DraftRequest, k)` jobs and gets `Proposal`s back (tokens and the distribution q each was drawn from),
then tells it how many were accepted (`rewind`) and hands it the round's `Outcome` (what the verify cost) in
`accept`, where its rules learn. `DrafterBase` holds what every drafter shares: the stream's draft-length policy per
sequence, what its drafting spent, and the optional parts of the seam as no-ops (the target-rows hook, draft-ahead,
models' cells).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from localspec.config import Drafting, Sampling
from localspec.llama.grammar import Grammar
from localspec.rounds.constraints import masked_scores
from localspec.rounds.events import GenerationStats
from localspec.rounds.policies import DraftCost, DraftLength, Observation, Pricing
from localspec.rounds.prompt_cache import SeqFile, SeqState, picture_boundary
from localspec.rounds.prompt_cache import shared_prefix as shared_prefix
from localspec.rounds.sampling import Candidates, distributions, greedy_tokens, penalized
from localspec.rounds.scores import DeviceDist, Scores, ScoringModel

PromptWork = tuple[ScoringModel, list[int], list[int]]  # (model, the tokens its cells hold, tokens still to decode)


@dataclass(frozen=True, slots=True)
class Proposal:
    """A drafter's answer for one request: up to k tokens, each with the distribution it was drawn from."""

    tokens: list[int]
    # Per token, q (one row) at T > 0; None at temperature 0. A deterministic drafter gives a point mass
    # (`sampling.point_mass`): rejection sampling then accepts with p(x) and resamples from p, exact either way.
    q: list[Candidates] | None = None
    # Where they came from: how many of the tokens (the first ones) came from the lead source, at no draft step
    # (prompt lookup's); the rest are stepped, one draft decode each (a draft model's). The cost model counts each
    # source's acceptance.
    lead: int = 0


NO_PROPOSAL = Proposal([])


@dataclass(frozen=True, slots=True)
class Spent:
    """What drafting one proposal spent, in the drafter's own bookkeeping (`DrafterBase.spend`) until its verdict."""

    seconds: float = 0.0  # drafting time on the round's critical path (draft-ahead made beside the verify: 0)
    # Of `seconds`, the first draft step: it also reads what the drafter had not seen (tokens committed while it sat
    # out, lookup's drafts) and may capture a CUDA graph, so it is no measure of a step (`DraftCost`).
    first_s: float = 0.0
    # The least of its later steps (None: fewer than two). On CUDA the two calls after a width change (the first
    # step's catch-up) run the graph uncaptured, so an average step overstates a steady one.
    least_s: float | None = None
    # How many of the tokens (the first ones) were drafted beside the last verify (a draft-ahead that held)
    drafted_ahead: int = 0


NOTHING_SPENT = Spent()


@dataclass(frozen=True, slots=True)
class Outcome:
    """The loop's verdict on one proposal, handed to its drafter (`accept`): how many of its tokens were accepted
    and what the round cost."""

    accepted: int
    width: int  # the verify batch's width
    verify_s: float  # the verify decode's seconds
    wait_s: float | None = None  # the wait after the verify for the drafter's work beside it (None: none ran)
    # Drafted beside an earlier verify (slots taking turns): the loop waited this long for it, which stands for its
    # drafting on the path (its steps are no measure of a step there). None: drafted on the path.
    beside_s: float | None = None


def observe_round(length: DraftLength | None, proposal: Proposal, outcome: Outcome,
                  spent: Spent = NOTHING_SPENT) -> Observation:
    """The round as the cost model takes it (`DraftLength.observe`): the proposal, its verdict and what drafting
    it spent."""
    seconds, ahead = spent.seconds, spent.drafted_ahead
    if outcome.beside_s is not None:
        seconds, ahead = outcome.beside_s, len(proposal.tokens) - proposal.lead
    round_ = Observation(len(proposal.tokens), outcome.accepted, seconds, outcome.verify_s, outcome.width,
                         proposal.lead, spent.first_s, ahead, outcome.wait_s, spent.least_s)
    if length is not None:
        length.observe(round_)
    return round_


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
    # Whose request it is: a drafter that keeps text across requests (suffix lookup) drafts one owner's requests
    # only from that owner's text. A server answers one API key, so every request to it has one owner ("").
    owner: str = ""


class Drafter(Protocol):
    """Whoever proposes draft tokens. Implementations live one per file in `localspec/drafters/`, each a
    `DrafterBase` (the registry finds them there); the loop never knows which one runs."""

    models: tuple[ScoringModel, ...]  # the models it decodes with: slots and context are sized by them too
    # Whether it drafts from the target's hidden states (an MTP head, EAGLE-3): the loop has the target return them
    # for its streams (`LlamaModel.want_hidden`) and hands it every row the target decodes for them (`target_rows`).
    # (With pictures in a prompt it gets a zero row at each of a picture's positions, whose token ids are negative
    # placeholders: a drafter that feeds tokens to a model of its own reads the filler token there.)
    reads_target: bool

    def pricing(self, cost: DraftCost, drafting: Drafting) -> Pricing | None:
        """A stream with these settings starts (or goes on) with the measured facts `cost`: attach this drafter's
        cost rules to them (`CostRule.of`, kept with them) and return the prices `adaptive` chooses k by, or None
        (k stays the preset's; the drafter may still propose fewer by its own rules)."""
        ...

    def start(self, req: DraftRequest, prompt: list[int], length: DraftLength | None) -> list[PromptWork]:
        """A generation starts in `req.seq` with `prompt` and the draft-length policy `length` (whose cost model
        holds this drafter's rules for the stream): `begin` it (`DrafterBase.start`)."""
        ...

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        """A generation starts in `req.seq` with `prompt`: forget the last one's state there and return the
        prompt tokens its models still need (the loop decodes them beside the target's, in the same rounds, and
        says so with `set_cells`; the tokens its cells hold in each work item are a copy)."""
        ...

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]]) -> list[Proposal]:
        """Up to k tokens for each request (k may be 0), continuing its committed tokens: one proposal per job
        (and what drafting it spent in its own bookkeeping: `DrafterBase.spend`)."""
        ...

    def draft_ahead(self, req: DraftRequest, proposal: Proposal, k_next: int) -> AbstractContextManager[None]:
        """Work to do while the target verifies `proposal` (the block is the verify). The loop asks only for a
        request alone in its round, and only when the drafter's models have a device of their own (draft-ahead:
        assume the verdict and draft the next `k_next` tokens, or with `draft_ahead_length = "fit"` what fits beside
        the verify: it stops when the block ends)."""
        ...

    def rewind(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        """`accepted` of the proposal's tokens were kept and `req.tokens` now holds the round's committed tokens: rewind
        whatever state went past them (and learn what only the drafter saw: whether its draft-ahead held). A generation
        that ends inside the round (a stop after one of its tokens) cuts `req.tokens` back to there and calls it again
        with no proposal and 0: a round that drafted nothing, whose only news is the shorter tokens."""
        ...

    def accept(self, req: DraftRequest, proposal: Proposal, outcome: Outcome) -> None:
        """The verdict of the round once it is over (`DrafterBase.accept`): the stream's draft-length policy and
        cost model (and through them the drafter's rules) take the round with what drafting it spent."""
        ...

    def target_limit(self, req: DraftRequest, prompt: list[int]) -> int | None:
        """A generation starts with `prompt`: how many of the target's cached cells it can follow (a reader of the
        target's rows needs its hidden state after each token from where its own cells end; the loop decodes the
        rest again). None: any."""
        ...

    def target_kept(self, req: DraftRequest, kept: int) -> None:
        """The target's cells now hold the prompt's first `kept` tokens."""
        ...

    def target_rows(self, req: DraftRequest, start: int, hidden: np.ndarray) -> None:
        """The target decoded positions start.. of the sequence (`req.tokens`, plus a verify's drafts, which the
        next `accept` settles) with these hidden states, one row per token (only where `reads_target`)."""
        ...

    def cells(self, seq: int) -> list[tuple[ScoringModel, list[int]]]:
        """Per model of its own (none that another drafter in the registry owns), the tokens its cells hold for
        `seq`: a copy. The loop that restores or erases the slot's cells (the prompt cache, slot files) says what
        they hold after with `set_cells`."""
        ...

    def set_cells(self, seq: int, model: ScoringModel, tokens: Sequence[int]) -> None:
        """`model`'s cells of `seq` now hold `tokens` (the loop restored, cut or erased them)."""
        ...

    def save_seq(self, seq: int, tokens: Sequence[int]) -> SeqState | None:
        """What a slot's state (the prompt cache) keeps of this drafter for `seq` beyond its models' cells (an MTP
        head's cells and the target rows it holds), taken beside the models' cells when the slot holds `tokens`
        (committed; the target's cells hold all but the newest); None: nothing."""
        ...

    def load_seq(self, seq: int, state: SeqState | None) -> bool:
        """`seq` now holds a restored slot state (the models' cells are in): take this drafter's part of it, a
        `save_seq` of the same drafter, or None (the state has none: forget what `seq` held, so nothing that
        belonged to other cells stays). False when llama.cpp refuses it: the sequence is then empty."""
        ...

    # The kind of slot-file part this drafter reads back (`SeqFile.kind`; None: its states are never written).
    seq_kind: str | None

    def seq_from_file(self, part: SeqFile, tokens: Sequence[int]) -> SeqState:
        """A slot file's part of this drafter (`seq_kind`) for a state holding `tokens`, checked against this
        drafter and the tokens before any cell changes: ValueError saying what does not fit."""
        ...

    def reset(self) -> None:
        """Forget every sequence's state (the models' KV cells included)."""
        ...

    def close(self) -> None:
        """Stop any worker; the drafter is not used again."""
        ...


class DrafterBase:
    """What every drafter shares: per sequence, the stream's draft-length policy (`start`: its cost rules are
    reached through it, `rule`) and what the last proposal's drafting spent (`spend`, taken by `accept`); and the
    seam's optional parts as no-ops: the target-rows hook (`reads_target` False), draft-ahead (`draft_ahead`), models'
    cells (none), `reset`, `close`. A drafter overrides what it needs."""

    models: tuple[ScoringModel, ...] = ()
    reads_target = False

    def __init__(self) -> None:
        self._lengths: dict[int, DraftLength | None] = {}
        self._spent: dict[int, Spent] = {}

    # -- the seam's fixed parts ---------------------------------------------------------------------------------

    def start(self, req: DraftRequest, prompt: list[int], length: DraftLength | None) -> list[PromptWork]:
        self._lengths[req.seq] = length
        self._spent.pop(req.seq, None)
        return self.begin(req, prompt)

    def accept(self, req: DraftRequest, proposal: Proposal, outcome: Outcome) -> None:
        observe_round(self.length(req), proposal, outcome, self._spent.pop(req.seq, NOTHING_SPENT))

    def length(self, req: DraftRequest) -> DraftLength | None:
        """The stream's draft-length policy (None: none was given, so no cost rule decides)."""
        return self._lengths.get(req.seq)

    def stand_aside(self, req: DraftRequest, k: int, rule: type, lag: int = 1) -> int:
        """The round's length with `[draft] stand_aside` (where `adaptive` does not choose k): k, or none while its
        cost `rule` (a `model.ModelCost` kind: the draft model's, the MTP head's, a block drafter's) prices a round
        of k below plain decoding (`ModelCost.stand_aside`, which probes now and then); `lag`: committed tokens
        its models lack. A round drafting nothing is counted in the request's `stats.stood_aside`."""
        length = self.length(req)
        if k <= 0 or not req.drafting.stand_aside or req.drafting.adaptive or length is None:
            return k
        n = length.rule(rule).stand_aside(k, length, lag)
        req.stats.stood_aside += n == 0
        return n

    def spend(self, req: DraftRequest, spent: Spent) -> None:
        """What drafting the request's proposal of this round spent (`accept` hands it to the cost model)."""
        self._spent[req.seq] = spent

    def spent(self, req: DraftRequest) -> Spent:
        """What drafting the request's proposal of this round spent, so far (the round's drafting on the path, a
        drafter that drafts with another's proposals: the chain)."""
        return self._spent.get(req.seq, NOTHING_SPENT)

    # -- defaults ---------------------------------------------------------------------------------------------

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        return []

    def rewind(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        pass

    def draft_ahead(self, req: DraftRequest, proposal: Proposal, k_next: int) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def target_limit(self, req: DraftRequest, prompt: list[int]) -> int | None:
        return None

    def target_kept(self, req: DraftRequest, kept: int) -> None:
        pass

    def target_rows(self, req: DraftRequest, start: int, hidden: np.ndarray) -> None:
        pass

    def cells(self, seq: int) -> list[tuple[ScoringModel, list[int]]]:
        return []

    def set_cells(self, seq: int, model: ScoringModel, tokens: Sequence[int]) -> None:
        raise ValueError(f"this drafter holds no cells of {model!r}")

    def save_seq(self, seq: int, tokens: Sequence[int]) -> SeqState | None:
        return None

    def load_seq(self, seq: int, state: SeqState | None) -> bool:
        return True

    seq_kind: str | None = None

    def seq_from_file(self, part: SeqFile, tokens: Sequence[int]) -> SeqState:
        raise ValueError(f"this drafter keeps no {part.kind} state")

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def prompt_work(model: ScoringModel, kv: list[int], body: list[int], seq: int,
                limit: int | None = None) -> PromptWork:
    """Cut a sequence's cells back to the longest prefix of `body` they hold (at most `limit`), or as far as the
    model can rewind towards it (a recurrent state: a checkpoint, or nothing); what is left to decode."""
    keep = shared_prefix(kv, body)
    if limit is not None:
        keep = picture_boundary(body, min(keep, limit))
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


def row_draft(req: DraftRequest, logits: np.ndarray | Scores, drafted: list[int], q: list[Candidates] | None,
              rng: np.random.Generator, is_eog: Callable[[int], bool]) -> tuple[int | None, bool]:
    """A draft token from one row of a drafter's own scores (an MTP head's step: full logits or the device's
    candidates; a block drafter's position: its logits, (n_vocab,)) after
    `drafted` tokens this round, and whether the drafter is sure enough of it to draft on (p_min): the argmax at T = 0,
    else a draw from the row's distribution under the request's sampling (appended to `q`); the grammar's allowed
    tokens only (advanced by the token); None where the grammar leaves too little to propose."""
    sampling, p_min = req.sampling, req.drafting.p_min
    history = req.tokens + drafted if sampling.penalized else req.tokens
    row = logits if isinstance(logits, Scores) else Scores(logits[None, :])
    if req.grammar is not None:  # propose only what the grammar allows after the drafts so far
        masked = masked_scores(penalized(row, history, sampling), 0, req.grammar, sampling)
        if masked is None:
            return None, False
        row, history = masked, []
    if sampling.greedy:
        token = int(greedy_tokens(row, history, sampling)[0])
        confident = p_min == 0.0 or row.top_prob(0) >= p_min
    else:
        dist = distributions(row, history, sampling)
        token = dist.sample(0, rng)
        assert q is not None
        q.append(dist)
        confident = p_min == 0.0 or dist.top_prob(0) >= p_min
    if req.grammar is not None and not is_eog(token):
        req.grammar.accept(token)
    return token, confident
