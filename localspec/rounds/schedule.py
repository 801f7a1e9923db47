"""Round scheduling: how a planned round's streams go through the target and their drafters.

The loop (`engine.Engine`) owns a round's steps; a `Schedule` plans the round (`plan`: each stream's draft length,
the one place k is decided) and runs its steps over the streams (`run`), through the small protocol the loop
offers (`Loop`: draft, verify, rewind). Whatever the schedule, each stream's numbers are what they would be alone:
only speed differs.

- Shared batch (the default): every drafter drafts for its streams together, one target decode verifies all;
  `LoadPolicy` shortens the drafts at batch sizes where that measures faster.
- Draft-ahead: a stream alone in its round lets its drafter work beside the verify (`Drafter.draft_ahead`: the draft
  model's, drafters/model.py; when it runs: placement.draft_ahead).
- Turns: when the target's slots take turns (its multi-sequence batches are not exact:
  `LlamaModel.batches_sequences`), the round verifies one stream at a time and drafts the other streams'
  proposals beside those verifies (`_take_turns`): only the first stream drafts on the path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from localspec.drafters.base import NO_PROPOSAL, Proposal
from localspec.rounds.policies import LoadPolicy
from localspec.rounds.scores import ScoringModel
from localspec.rounds.stream import Stream, Verdict


@dataclass(frozen=True, slots=True)
class Plan:
    """One stream's draft length this round, and the width its verify batch is padded to (0: as wide as the drafts
    are; on a GPU the stream's policy may still verify narrow after a run of empty drafts: `verify_width`)."""

    k_round: int  # what the draft-length policy chose
    k: int  # ... within max_tokens, the context and the load policy's share
    width: int


@dataclass(frozen=True, slots=True)
class Scheduled:
    """What a schedule made of a round: per stream its proposal and verdict (in the order of the streams), the
    round's verify seconds, its drafting on the path where every stream counts one shared figure (None: each
    drafter's own), and per stream drafted beside an earlier verify, the wait for it (`Outcome.beside_s`)."""

    proposals: list[Proposal]
    verdicts: list[Verdict]
    verify_s: float
    draft_s: float | None = None
    beside_s: dict[int, float] = field(default_factory=dict)


class Loop(Protocol):
    """What a schedule asks of the loop (`engine.Engine`): the steps of a round over some of its streams."""

    target: ScoringModel
    n_ctx: int  # each slot's context
    constant_width: bool  # verify batches padded to one width (CUDA graphs)
    draft_ahead: bool  # the drafters' models may work beside the target (a device of their own)

    def _draft(self, live: Sequence[Stream], plans: Sequence[Plan]) -> list[Proposal]:
        """Each stream's proposal (every drafter drafts for its streams together)."""
        ...

    def _verify(self, live: Sequence[Stream], plans: Sequence[Plan], proposals: Sequence[Proposal],
                beside: contextlib.AbstractContextManager[None] | None = None,
                draft_ahead: bool = False) -> tuple[list[Verdict], float, float | None]:
        """One target decode of the streams' proposals, with `beside` running meanwhile: the verdicts, the decode's
        seconds and the wait for the work beside it (None: none ran)."""
        ...

    def _rewind(self, s: Stream, proposal: Proposal, verdict: Verdict) -> None:
        """Commit a stream's verdict (its drafter's models are idle again after it)."""
        ...



class Schedule:
    """Runs a planned round over its streams: shared batch, draft-ahead or turns (the module's docstring)."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        # With several streams sharing a verify, the share of k per batch size (down to k = 0, plain batched
        # decoding) where that measures faster.
        self.load = LoadPolicy()
        # Where slots take turns, the other streams' drafting beside the verifies (`_take_turns`): started when used.
        self.beside: ThreadPoolExecutor | None = None

    def plan(self, live: Sequence[Stream]) -> tuple[list[Plan], float]:
        """Each stream's draft length this round: the one place k is decided (the draft-length policy, then what
        max_tokens, the context and the load policy's share allow). Returns the plans and the share."""
        plans = []
        for s in live:
            k_round = s.chooser.next() if s.use_draft else 0
            room = self.loop.n_ctx - len(s.slot.tokens)  # cells left past the cached prefix (cur's included)
            width = min(k_round, room) + 1 if self.loop.constant_width else 0  # 0: as wide as the drafts are
            plans.append(Plan(k_round, self.length(s, k_round), width))
        # Slots that take turns verify one stream a decode, so a stream's round costs what it costs alone: its own
        # draft-length policy decides, and the load policy's shorter shares (for a shared verify growing
        # compute-bound) would only cost their probing rounds.
        # A stream that must draft every round (`[draft] stand_aside` off: --always-draft) keeps its length.
        cut = [s.drafting.stand_aside for s in live]
        share = (self.load.share(len(live)) if any(p.k for p, c in zip(plans, cut, strict=True) if c)
                 and self.loop.target.batches_sequences else 1.0)
        if share < 1.0:
            plans = [Plan(p.k_round, k := round(p.k * share), k + 1 if self.loop.constant_width else 0) if c else p
                     for p, c in zip(plans, cut, strict=True)]
        return plans, share

    def _room(self, s: Stream) -> int:
        """How many drafts the context leaves room for this round: a round emits its drafts and one token more, and
        prompt + reply stay within n_ctx (with context shift the next round shifts there: `Engine._begin`)."""
        return self.loop.n_ctx - len(s.slot.tokens) - 1

    def length(self, s: Stream, k_round: int, past: int = 0) -> int:
        """The longest draft max_tokens and the context leave room for, `past` tokens past the committed ones."""
        return min(k_round, s.max_tokens - s.stats.tokens - past - 1, self._room(s) - past)

    def run(self, live: Sequence[Stream], plans: Sequence[Plan]) -> Scheduled:
        """The round's draft, verify and rewind of every stream in `live`, as this round's schedule runs them."""
        if self._drafts_beside_turns(live):
            return self._take_turns(live, plans)
        loop = self.loop
        proposals = loop._draft(live, plans)
        beside, drafts_ahead = self._draft_ahead_beside(live, plans, proposals)
        verdicts, verify_s, _ = loop._verify(live, plans, proposals, beside, drafts_ahead)
        for s, proposal, verdict in zip(live, proposals, verdicts, strict=True):
            loop._rewind(s, proposal, verdict)
        return Scheduled(proposals, verdicts, verify_s)  # (a drafter's streams share one drafting: each says)

    def close(self) -> None:
        if self.beside is not None:
            self.beside.shutdown(wait=True)
            self.beside = None

    def _drafts_beside_turns(self, live: Sequence[Stream]) -> bool:
        """Whether this round takes turns with the other streams' drafting beside the verifies (`_take_turns`): the
        target's slots take turns, the draft model may work beside it (as for draft-ahead), and no stream's drafter
        reads the target's rows (an MTP head follows its own stream's verify)."""
        return (self.loop.draft_ahead and len(live) > 1 and not self.loop.target.batches_sequences
                and not any(s.drafter is not None and s.drafter.reads_target for s in live))

    def _take_turns(self, live: Sequence[Stream], plans: Sequence[Plan]) -> Scheduled:
        """The round when the target's slots take turns: one verify per stream, and while one runs, the streams
        verified next are drafted in a worker thread (llama.cpp releases the GIL inside a decode; each proposal is
        drafted from its own stream's committed tokens, as it would be on the path). So only the first stream
        drafts on the round's path, and the loop waits for the others' proposals only where drafting outlasts a
        verify. Where the drafters' models share batches between sequences, all the other streams are drafted
        together beside the first verify (each draft step then serves them all: one stream's step would cost the
        same, `ubatch.covering_calls`); where they take turns too, one stream beside each verify. A stream is
        rewound once its verify is read and the drafting beside it ended: its drafter's models are then idle.
        Every stream's stats count the round's drafting on the path and its verify seconds, as for a shared round."""
        loop = self.loop
        if self.beside is None:
            self.beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localspec-draft-beside")
        rest = range(1, len(live))
        together = all(m.batches_sequences for s in live if s.drafter is not None for m in s.drafter.models)
        groups = [[0], *([list(rest)] if together else [[i] for i in rest])]
        proposals = [NO_PROPOSAL] * len(live)
        proposals[0] = loop._draft(live[:1], plans[:1])[0]
        first = live[0].drafter
        draft_s, verify_s = first.spent(live[0].req).seconds if first is not None else 0.0, 0.0
        beside_s: dict[int, float] = {}
        verdicts: list[Verdict] = []
        for g, group in enumerate(groups):
            # The next group is drafted beside this group's first verify.
            following = [j for j in groups[g + 1] if live[j].drafter is not None] if g + 1 < len(groups) else []
            job = (self.beside.submit(loop._draft, [live[j] for j in following], [plans[j] for j in following])
                   if following else None)
            for n, i in enumerate(group):
                beside = _finished(job) if n == 0 else None
                (verdict,), spent, wait = loop._verify([live[i]], [plans[i]], [proposals[i]], beside)
                verify_s += spent
                loop._rewind(live[i], proposals[i], verdict)
                verdicts.append(verdict)
                if beside is not None and job is not None:
                    draft_s += wait or 0.0
                    for j, drafted in zip(following, job.result(), strict=True):
                        # Drafted off the path: its steps are no measure of a step there (the cost model learns
                        # from the first stream's); the wait for them is their drafting on the path.
                        proposals[j], beside_s[j] = drafted, wait or 0.0
        return Scheduled(proposals, verdicts, verify_s, draft_s, beside_s)

    def _draft_ahead_beside(self, live: Sequence[Stream], plans: Sequence[Plan], proposals: Sequence[Proposal]
                            ) -> tuple[contextlib.AbstractContextManager[None] | None, bool]:
        """A stream alone in its round lets its drafter draft ahead beside the verify (not a constrained one: a draft
        made beside the verify would need the grammar after it). Returns the work beside the verify (or None)
        and whether it is a draft-ahead."""
        if not (self.loop.draft_ahead and len(live) == 1 and live[0].drafter is not None
                and live[0].grammar is None):
            return None, False
        s, proposal = live[0], proposals[0]
        # If every draft is accepted, the next round has this many more tokens behind it.
        k_next = self.length(s, plans[0].k_round, past=len(proposal.tokens) + 1)
        return s.drafter.draft_ahead(s.req, proposal, k_next), True  # type: ignore[union-attr]


@contextlib.contextmanager
def _finished(job: Future[list[Proposal]] | None) -> Iterator[None]:
    """The block, then the wait for `job` to end (its result or error is the caller's to read): whatever happens
    in the block, the job's models are idle after it."""
    try:
        yield
    finally:
        if job is not None:
            concurrent.futures.wait([job])
