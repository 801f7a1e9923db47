"""One generation in a slot, as the loop drives it: its settings, drafter, random stream, stats and draft-length
policy, how its verify rows are judged (`Stream.judge`), the last round's verdict, and the events it yields
(`Stream.events`). `Slot` is a sequence of the models and what its cells hold. The loop that runs streams is
`engine.Engine`.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from localspec.config import ContextSettings, Drafting, Sampling
from localspec.drafters.base import Drafter, DraftRequest, PromptWork, Proposal
from localspec.llama.grammar import Grammar
from localspec.rounds.events import (
    STOP_EOG,
    STOP_MAX_TOKENS,
    STOP_REQUESTED,
    DoneEvent,
    Event,
    GenerationStats,
    TokenEvent,
)
from localspec.rounds.policies import DraftLength
from localspec.rounds.sampling import accept_rows, penalized, token_logprobs
from localspec.rounds.scores import Scores


class Host(Protocol):
    """What a stream asks of the engine that starts it (`engine.Engine`)."""

    drafters: dict[str, Drafter]
    constrained_rows: str
    token_piece: Callable[[int], bytes]
    token_is_eog: Callable[[int], bool]

    def _draft_length(self, drafting: Drafting, sampling: Sampling, slot: Slot,
                      drafter: Drafter | None) -> DraftLength: ...

    def _settle(self, stream: Stream, unused: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Verdict:
    """What verification kept of one stream's round."""

    emitted: list[int]  # the accepted drafts, then one token of the target's own
    accepted: int
    rows: list[tuple[int, float]]  # with trace: each emitted token's row (argmax, top-2 margin)
    width: int  # the verify batch's width
    # with logprobs: each emitted token's logprob and the best alternatives (sampling.token_logprobs)
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    draft_ahead_wait_s: float | None = None  # the wait after the verify for the draft-ahead beside it (None: none ran)


NO_VERDICT = Verdict([], 0, [], 0)


@dataclass(eq=False)
class Slot:
    """One sequence of the target (llama.cpp sequence id `seq`) and what its KV cells hold.

    Invariant between rounds: `tokens` is the committed sequence; the target's cells hold all of it but the last
    token (`cur`, which opens the next verify batch). A drafter's models keep their own cells (a prefix of it).
    Within a round, from its verify until its events are taken, `target_kv` already says what the target keeps while
    its cells may still hold the verify's rejected positions (`stale_cells`): `Engine._settle` drops them once the
    generation's consumer has said where it ends, in one rewind (a recurrent state rolls back only once a decode)."""

    seq: int
    tokens: list[int] = field(default_factory=list)
    target_kv: list[int] = field(default_factory=list)
    # Per drafting settings recently used here: the draft-length policy and its cost model, kept across
    # generations (and across others' between them, as bench's interleaved plain runs)
    policies: dict[tuple, DraftLength] = field(default_factory=dict)
    used: int = 0  # when it last started a generation (the least recently used free slot is reused first)
    busy: bool = False
    stale_cells: bool = False  # the target's cells hold positions past `target_kv` (until `Engine._settle`)


class Stream:
    """One generation in progress in a slot: its request, drafter, random stream and stats, and the last round's
    verdict.

    Made by `Engine.start`; `Engine.step` runs a round for several streams at once; `events()` then yields that
    round's TokenEvents (asking `should_stop` after each) and, when the generation has ended, its DoneEvent.
    """

    def __init__(self, engine: Host, slot: Slot, sampling: Sampling, drafting: Drafting, max_tokens: int,
                 should_stop: Callable[[], bool] | None, trace: bool, grammar: Grammar | None = None,
                 constrain_draft: bool = True, logprobs: int | None = None,
                 context: ContextSettings | None = None, owner: str = "") -> None:
        self.slot = slot
        # With context shift on: what a full context keeps (n_keep, n_discard); None: the generation stops there.
        self.shift = context if context is not None and context.context_shift else None
        # The grammar's state after the committed tokens (advanced only by emitted ones); each round the drafter
        # gets a copy in its request. constrain_draft=False masks the verify rows only (to measure the difference).
        self.grammar = grammar
        self.constrain_draft = constrain_draft
        self.logprobs = logprobs  # None: off; N: each emitted token's logprob and the N best alternatives
        self.sampling = sampling
        self.drafting = drafting
        self.max_tokens = max_tokens
        self.should_stop = should_stop
        # (Engine.start has checked that these models can run it.)
        self.drafter: Drafter | None = engine.drafters[drafting.drafter] if drafting.n_draft > 0 else None
        self.trace = trace and sampling.greedy
        self.rng = np.random.default_rng(sampling.seed)  # acceptance and the target's own tokens
        self.chooser = engine._draft_length(drafting if self.use_draft else dataclasses.replace(drafting, n_draft=0),
                                            sampling, slot, self.drafter)
        # Standing aside where drafting would lose at any acceptance (`DraftCost.hopeless`, the drafter's rule says):
        # the whole generation decodes plainly, its tokens drawn as plain decoding's are (on the device, no per-round
        # host sampling: ~3% of a CPU round), all but every PLAIN_GENERATIONS-th, whose rounds the rule judges again.
        self.aside: str | None = None
        cost = self.chooser.cost
        if self.drafter is not None and cost.hopeless and drafting.stand_aside and not drafting.adaptive:
            cost.plain_generations += 1
            if cost.plain_generations % cost.PLAIN_GENERATIONS:
                self.aside, self.drafter = cost.aside, None
        self.stats = GenerationStats()
        self.req = DraftRequest(slot.seq, slot.tokens, sampling, drafting, self.stats,
                                grammar.clone() if grammar is not None and constrain_draft and self.use_draft else None,
                                engine.constrained_rows, owner=owner)
        self.done: DoneEvent | None = None
        self._done_sent = False
        self.prefill: list[PromptWork] = []  # prompt tokens not yet in the caches
        self.t_start = 0.0
        self.verdict = NO_VERDICT  # the last round's, until events() takes it
        self._piece = engine.token_piece
        self._is_eog = engine.token_is_eog
        self._settle = engine._settle
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def use_draft(self) -> bool:
        return self.drafter is not None

    @property
    def finished(self) -> bool:
        return self.done is not None

    def judge(self, proposal: Proposal, scores: Scores, width: int) -> Verdict:
        """gpt-fast's accept/reject over the stream's verify rows of `proposal` (`sampling.accept_rows`), with each
        emitted token's logprobs where asked."""
        history = self.slot.tokens + proposal.tokens if self.sampling.penalized else self.slot.tokens  # (penalties)
        verdict = Verdict(*accept_rows(proposal.tokens, proposal.q, scores, history, self.sampling, self.rng,
                                       self.trace), width)
        if self.logprobs is None:
            return verdict
        # Each token's row as its choice saw it: after the penalties (row i follows the drafts before it).
        assert scores.logits is not None and scores.full  # logprobs turn the device sampler off (`Engine.start`)
        seen = penalized(scores, history, self.sampling).logits
        assert seen is not None
        return dataclasses.replace(verdict, logprobs=[token_logprobs(seen[i], t, self.logprobs)
                                                      for i, t in enumerate(verdict.emitted)])

    def hand_grammar(self) -> None:
        """Give the drafter its copy of the grammar state after the committed tokens (a constrained stream)."""
        if self.req.grammar is not None:
            self.req.grammar.close()
            assert self.grammar is not None
            self.req.grammar = self.grammar.clone()

    def _finish(self, stop: str, message: str) -> None:
        self.stats.decode_s = time.perf_counter() - self.t_start
        if self.aside is not None:  # (a generation decoded plainly: every round stood aside)
            self.stats.stood_aside = self.stats.rounds
        aside = self.aside if self.aside is not None else self.chooser.aside if self.use_draft else None
        self.done = DoneEvent(self.stats, stop, message, aside)
        self.slot.busy = False
        for grammar in (self.grammar, self.req.grammar):
            if grammar is not None:
                grammar.close()

    def _stop_requested(self) -> bool:
        return self.should_stop is not None and self.should_stop()

    def events(self) -> Iterator[Event]:
        """The last round's tokens, then the DoneEvent if the generation ended (in the round or here).

        A generation that ends inside the round (an end-of-generation token, max_tokens, the caller's stop after a
        token: a stop string, a cancel; or the consumer closing this iterator) keeps only the tokens up to there:
        the slot's tokens and every model's cells end where plain decoding's would (`Engine._settle`)."""
        verdict, self.verdict = self.verdict, NO_VERDICT
        stats = self.stats
        used = 0  # the round's tokens the generation took (an end-of-generation token included, as plain decoding)
        try:
            for i, token in enumerate(verdict.emitted):
                used = i + 1
                if self._is_eog(token):
                    self._finish(STOP_EOG, "end of generation")
                    break
                stats.tokens += 1
                row_argmax, margin = verdict.rows[i] if verdict.rows else (None, None)
                logprob, top = verdict.logprobs[i] if verdict.logprobs else (None, None)
                yield TokenEvent(token, self._decoder.decode(self._piece(token)), i < verdict.accepted, row_argmax,
                                 margin, logprob, top)
                if stats.tokens >= self.max_tokens:
                    self._finish(STOP_MAX_TOKENS, f"reached max_tokens ({self.max_tokens})")
                    break
                if self._stop_requested():
                    # Inside a round: a stop string may end in an accepted draft run; stop before the next token.
                    self._finish(STOP_REQUESTED, "stopped by the caller")
                    break
        finally:
            self._settle(self, len(verdict.emitted) - used)
        if self.done is not None and not self._done_sent:
            self._done_sent = True
            yield self.done
