"""The speculative loop. It yields events and never prints; it does not know who drafts.

One generation: `_prefill` the prompt into its slot's KV cells (the target's, and any the drafter's models hold,
reusing whatever prefix they already hold), then rounds of `_plan` (the draft length k: the one place it is
decided), `_draft` (the request's drafter proposes up to k tokens with their distributions q: `drafters/`),
`_verify` (one batched target decode with scores at every drafted position), `_accept` (greedy match or rejection
sampling, a `Verdict`) and `_rewind` (commit the round's tokens and tell the drafter the verdict, which rewinds its
own state); once the round's events are taken, `_settle` drops the target's cells of rejected tokens, and where the
generation ended inside the round (end of generation, max_tokens, a stop string, a cancel) the round's tokens after
that one too, from every model, so that a slot ends holding what plain decoding's would. k = 0 is plain decoding
through the same code, so baselines are apples to apples. On a GPU the verify batch keeps one width (short drafts
padded) so llama.cpp's CUDA graphs stay captured — but for runs of rounds with nothing drafted, verified narrow
when padding them measures dearer than the width changes (`DraftLength.verify_width`) — and plain decoding at T > 0
draws its tokens on the device (docs/gpu.md).

Slots: the models may hold several sequences (`LlamaModel(n_seq=N)`, one KV region each). `start` opens a
`Stream` in a slot; `step(streams)` runs one round for all of them at once (each drafter drafts for its streams
together, one target decode verifies all), and each stream's `events()` yields what its round emitted. Every stream
keeps its own settings, random streams and stats, and a slot's numbers do not depend on what the others hold (on
the CPU, bit for bit: tests/test_slots.py), so a request's output is what it would be alone. `generate` is the
one-stream case of the same code. The server starts streams with `prefill_in_rounds`: their prompts go in one batch
per round, beside the others' rounds. With several streams sharing a verify, `LoadPolicy` shortens the drafts (down
to k = 0, plain batched decoding) at batch sizes where that measures faster.

A stream alone in its round lets its drafter work beside the verify (`Drafter.overlap`: the draft model's
draft-ahead, drafters/model.py; when it runs: placement.draft_ahead). When the target's slots take turns (its
multi-sequence batches are not exact: `LlamaModel.batches_sequences`), the round verifies one stream at a time and
drafts the other streams' proposals beside those verifies (`_take_turns`): only the first stream drafts on the path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from localspec import context_shift, drafters
from localspec.config import ContextSettings, Drafting, Sampling
from localspec.constraints import accept_constrained
from localspec.drafters.base import (
    NO_PROPOSAL,
    Drafter,
    PromptWork,
    Proposal,
    ReadsTarget,
    device_mode,
    prompt_work,
)
from localspec.drafters.base import shared_prefix as shared_prefix
from localspec.errors import ContextFullError, DecodeError, RollbackError, UsageError
from localspec.events import STOP_CONTEXT_FULL as STOP_CONTEXT_FULL
from localspec.events import STOP_EOG as STOP_EOG
from localspec.events import STOP_MAX_TOKENS as STOP_MAX_TOKENS
from localspec.events import STOP_REQUESTED as STOP_REQUESTED
from localspec.events import DoneEvent as DoneEvent
from localspec.events import Event as Event
from localspec.events import Generation as Generation
from localspec.events import GenerationStats as GenerationStats
from localspec.events import TokenEvent as TokenEvent
from localspec.events import collect as collect
from localspec.llama.grammar import Grammar
from localspec.policies import DraftLength, LoadPolicy, kept_length
from localspec.prompt_cache import PromptCache, SlotState
from localspec.sampling import accept_rows, penalized, token_logprobs
from localspec.scores import Scores, ScoringModel
from localspec.slot_cells import SlotCells
from localspec.stream import Slot, Verdict
from localspec.stream import Stream as Stream

# (The events' names are re-exported above: callers have imported them from here since the first release.)


@dataclass(frozen=True, slots=True)
class _Plan:
    """One stream's draft length this round, and the width its verify batch is padded to (0: as wide as the drafts
    are; on a GPU the stream's policy may still verify narrow after a run of empty drafts: `verify_width`)."""

    k_round: int  # what the draft-length policy chose
    k: int  # ... within max_tokens, the context and the load policy's share
    width: int


class Engine:
    """Speculative decoding over a target `LlamaModel` and the drafters its optional draft model allows (same
    tokenizer), for as many concurrent generations as the models have sequences (slots)."""

    def __init__(self, target: ScoringModel, draft: ScoringModel | None, *, constant_width: bool | None = None,
                 draft_ahead: bool = False, constrained_rows: str = "full",
                 prompt_cache: PromptCache | None = None) -> None:
        self.target = target
        # Slots' states kept in host RAM: a slot given to another prompt is saved there first, and a prompt that
        # an entry serves better than its slot is restored from there (`SlotCells.from_cache`).
        self.prompt_cache = prompt_cache if prompt_cache is not None and prompt_cache.limit > 0 else None
        self.draft = draft
        # Keep the verify width constant within a generation, padding a short draft (an early stop below p_min,
        # the last round before max_tokens): on CUDA a width change re-captures graphs, which costs more than the
        # padded positions (docs/gpu.md). On a CPU the padded positions are pure extra work, so only on a GPU.
        self.constant_width = target.on_gpu if constant_width is None else constant_width
        # A stream alone in its round lets its drafter work beside the verify (the draft model: draft-ahead).
        self.draft_ahead = draft_ahead and draft is not None
        # Where slots take turns, the other streams' drafting beside the verifies (`_take_turns`): started when used.
        self._beside: ThreadPoolExecutor | None = None
        self.closed = False  # `close` was called: the models may be freed
        # How a grammar's rows are read (`[load] constrained_rows`): "full" logits, or "device" top candidates with
        # a row decoded again in full where they hold too few legal tokens (slower on a GPU: docs/performance.md).
        # A recurrent target cannot go back into a verify to read a row again: full rows there.
        self.constrained_rows = constrained_rows if target.rewind_depth is None else "full"
        # Plain decoding at T > 0 may draw its tokens on the device (one slot only, `start`): llama.cpp's random
        # stream, not the host's, so a seed's text depends on the slot count. The server turns it off, so that a
        # seed gives the same text whatever --parallel is.
        self.draw_on_device = True
        self.drafters = drafters.build(target, draft)
        # Every model once (the chain drafts with the model drafter's draft model).
        self.models = list({id(m): m for m in (target, *(m for d in self._distinct_drafters() for m in d.models))}
                           .values())
        self.slots = [Slot(seq) for seq in range(min(m.n_seq for m in self.models))]
        self.cells = SlotCells(target, self._distinct_drafters(), self.slots)  # every model's cells of a slot
        self.load = LoadPolicy()
        self._starts = 0
        # A token's text and whether it ends a generation are the vocabulary's: one llama.cpp call per token id,
        # not per emitted token (~5 us each, on every round's path).
        self.token_piece: Callable[[int], bytes] = functools.cache(target.piece)
        self.token_is_eog: Callable[[int], bool] = functools.cache(target.is_eog)

    # -- public ---------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every slot's KV cells (the next prompts are processed in full)."""
        for drafter in self._distinct_drafters():
            drafter.reset()
        self.target.clear()
        self.cells.floors.clear()
        for slot in self.slots:
            slot.tokens, slot.target_kv, slot.busy, slot.stale_cells = [], [], False, False

    def close(self) -> None:
        # A generation's events not yet taken to their end are settled when their iterator is closed, which the
        # garbage collector may do after the models were freed (a Ctrl-C between two tokens): nothing is left to
        # rewind then, and a rewind would read freed memory (`_settle`).
        self.closed = True
        if self._beside is not None:
            self._beside.shutdown(wait=True)
            self._beside = None
        for drafter in self._distinct_drafters():
            drafter.close()

    def check_drafter(self, drafting: Drafting) -> None:
        """A drafter these models cannot run is a UsageError naming the ones they can (from the registry), never
        plain decoding in its place."""
        if drafting.n_draft > 0 and drafting.drafter not in self.drafters:
            why = drafters.unavailable(drafting.drafter, self.target, self.draft)
            why = f" ({why})" if why else ""
            raise UsageError(f"drafter {drafting.drafter!r} cannot run with these models{why}; they can run: "
                             f"{', '.join(self.drafters) or 'none'} (or draft length 0: plain decoding)")

    def _distinct_drafters(self) -> list[Drafter]:
        return list({id(d): d for d in self.drafters.values()}.values())

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        """The tokens in slot 0's target KV cells, position by position (chat reports how much it could reuse)."""
        return tuple(self.slots[0].target_kv)

    @property
    def n_ctx(self) -> int:
        """Each slot's context."""
        return min(m.n_ctx for m in self.models)

    @property
    def batches_slots(self) -> bool:
        """Whether a round's slots share each decode (else llama.cpp's multi-sequence batches are not exact for
        this model and they take turns inside the round: `LlamaModel.batches_sequences`)."""
        return all(m.batches_sequences for m in self.models)

    # A cached prefix at least this long decides the slot; a shorter one only breaks ties. Every decode of a round
    # spans the sequence ids from the lowest busy slot to the highest and pads the free ones in between
    # (llama.ubatch.covering_calls): a gap costs a draft step's and a verify's width of tokens every round, more
    # over a reply than re-reading a short prefix once.
    LONG_PREFIX = 256

    def free_slot(self, prompt: Sequence[int], exclude: Collection[int] = ()) -> int | None:
        """The free slot for `prompt`: the one whose cells share a long prefix with it (a returning conversation
        goes back to its cache), else the one that keeps the busy slots' ids closest together, then the longest
        shared prefix, then the least recently used; None when every slot is busy (or in `exclude`: promised to
        another job)."""
        free = [s for s in self.slots if not s.busy and s.seq not in exclude]
        if not free:
            return None
        busy = [s.seq for s in self.slots if s.busy or s.seq in exclude]  # the promised ones are about to be

        def key(s: Slot) -> tuple[int, int, int, int]:
            reuse = shared_prefix(s.target_kv, prompt)
            span = max(busy + [s.seq]) - min(busy + [s.seq])
            return (reuse if reuse >= self.LONG_PREFIX else 0, -span, reuse, -s.used)

        return max(free, key=key).seq

    def generate(self, prompt: Sequence[int], sampling: Sampling, drafting: Drafting, max_tokens: int,
                 should_stop: Callable[[], bool] | None = None, *, trace: bool = False, slot: int = 0,
                 grammar: Grammar | None = None, constrain_draft: bool = True,
                 logprobs: int | None = None, context: ContextSettings | None = None) -> Iterator[Event]:
        """Yield a TokenEvent per emitted token, then one DoneEvent with the stats and why it stopped: the one-slot
        case of `start` + `step` + `events`.

        `should_stop` is asked before each round and after each token the caller has consumed; True ends the
        generation there with STOP_REQUESTED and full stats (closing the iterator stops it too, without stats).
        Either way the slot keeps the tokens up to that one and no further (as plain decoding would): a round's
        tokens after it leave the slot's list and every model's cells (`_settle`).
        `trace` (temperature 0 only): each TokenEvent also carries its target row's argmax and top-2 margin, for
        the bench's greedy check; the device then returns candidates rather than only the argmax.
        """
        stream = self.start(prompt, sampling, drafting, max_tokens, should_stop, trace=trace, slot=slot,
                            grammar=grammar, constrain_draft=constrain_draft, logprobs=logprobs, context=context)
        try:
            while True:
                self.step([stream])
                yield from stream.events()
                if stream.finished:
                    return
        finally:
            stream.slot.busy = False

    def start(self, prompt: Sequence[int], sampling: Sampling, drafting: Drafting, max_tokens: int,
              should_stop: Callable[[], bool] | None = None, *, trace: bool = False, slot: int = 0,
              prefill_in_rounds: bool = False, grammar: Grammar | None = None, constrain_draft: bool = True,
              logprobs: int | None = None, context: ContextSettings | None = None) -> Stream:
        """Begin a generation in `slot`: set its samplers, bring its cells to the prompt (reusing the prefix they
        hold) and return its Stream, ready for `step`. With `prefill_in_rounds` the prompt is decoded one batch
        per model per round instead (`step` does it), so the streams already running keep going meanwhile; the
        batches are the ones a whole prefill makes, so the numbers are the same.

        `grammar` (the stream owns it from here: closed when it ends) holds the output to a constraint; `logprobs`
        asks for each token's logprob and that many alternatives: it needs the full logits of its rows, so the
        target's device sampler is off for that stream. A grammar masks full rows, the target's and the drafter's
        models' alike (they see `req.grammar`); with `constrained_rows = "device"` the models keep their top
        candidates on the device (greedy, top-k) and the target reads a row in full only where they hold too few
        legal tokens.

        `context` with `context_shift` on: a generation that fills the context drops tokens after the first n_keep
        and goes on (`_shift`); off or None, it stops there."""
        if not prompt:
            raise UsageError("the prompt must hold at least one token (a BOS token will do)")
        if len(prompt) > self.n_ctx:
            raise ContextFullError(f"the prompt has {len(prompt)} tokens; the context holds {self.n_ctx}")
        self.check_drafter(drafting)
        depth = self.target.rewind_depth
        if depth is not None and drafting.n_draft > depth:
            raise RollbackError(
                f"draft length {drafting.n_draft}: this model's recurrent state rolls back at most {depth} tokens "
                f"(loaded for that draft length); ask for n_draft <= {depth}, or load it with a longer one")
        if context is not None and context.context_shift:
            self.check_context_shift()
        chosen = self.slots[slot]
        stream = Stream(self, chosen, sampling, drafting, max_tokens, should_stop, trace, grammar, constrain_draft,
                        logprobs, context)
        seq = chosen.seq
        self.target.want_hidden(seq, isinstance(stream.drafter, ReadsTarget))
        # Plain decoding at T > 0 draws on the device only with one slot: several slots' chains must not keep
        # intermediate results (llama.ubatch.covering_calls), so there the host draws from the device's top k.
        plain = not stream.use_draft and self.target.n_seq == 1 and self.draw_on_device
        # Logprobs read every row whole; a grammar masks full rows or the device's top candidates
        # (`constrained_rows`, `constraints.accept_constrained`).
        self.target.use_device_sampler(None if logprobs is not None else device_mode(
            self.target, sampling, p_min=0.0, plain=plain, trace=stream.trace,
            grammar_rows=self.constrained_rows if grammar is not None else None), seq)
        self.target.restart_device_sampler(seq)
        # With several slots, a model this stream does not decode keeps no chain for it (its drafter's models set
        # their own in `begin`).
        drafting_models = {id(m) for m in stream.drafter.models} if stream.drafter is not None else set()
        for model in self.models[1:]:
            if model.n_seq > 1 and id(model) not in drafting_models:
                model.use_device_sampler(None, seq)
        stream.stats.prompt_tokens = len(prompt)
        if self.prompt_cache is not None:
            self.cells.from_cache(self.prompt_cache, chosen, prompt)
        stream.prefill = self._prefill(stream, list(prompt))
        if not prefill_in_rounds:
            self._prefill_some(stream, whole=True)
        self._starts += 1
        chosen.used, chosen.busy = self._starts, True
        stream.t_start = time.perf_counter()
        return stream

    # -- a slot's cells as a state (`slot_cells`): slot files, the prompt cache; context shift's check ----------

    def snapshot(self, slot: int) -> SlotState:
        return self.cells.snapshot(slot)

    def restore(self, slot: int, state: SlotState) -> bool:
        return self.cells.restore(slot, state)

    def erase(self, slot: int) -> int:
        return self.cells.erase(slot)

    def state_models(self) -> list[ScoringModel]:
        return self.cells.models()

    def check_context_shift(self) -> None:
        self.cells.check_context_shift()

    def step(self, streams: Sequence[Stream]) -> None:
        """One round for every stream that goes on: plan, draft (each drafter for its streams together), verify
        (one target decode for all), accept per stream, rewind. Each stream's `events()` then yields its tokens."""
        t0 = time.perf_counter()
        for slot in self.slots if len(self.slots) > 1 else ():  # a free slot's chains would run in every decode
            if not slot.busy:  # (llama.ubatch.covering_calls)
                for model in self.models:
                    model.use_device_sampler(None, slot.seq)
        live = [s for s in streams if self._begin(s)]
        if not live:
            return
        plans, share = self._plan(live)
        self._settle_grammars(live)
        if self._drafts_beside_turns(live):
            proposals, verdicts, draft_s, verify_s = self._take_turns(live, plans)
        else:
            proposals = self._draft(live, plans)
            draft_s = None  # (each stream's proposal says; a drafter's streams share one drafting)
            beside, ahead = self._ahead(live, plans, proposals)
            verdicts, verify_s, _ = self._verify(live, plans, proposals, beside, ahead)
            for s, proposal, verdict in zip(live, proposals, verdicts, strict=True):
                self._rewind(s, proposal, verdict)
        for s, proposal, verdict in zip(live, proposals, verdicts, strict=True):
            s.chooser.observe(len(proposal.tokens), verdict.accepted, proposal.seconds, verify_s, verdict.width,
                              proposal.lead, proposal.first_s, proposal.ahead, verdict.ahead_wait_s,
                              proposal.least_s)
            s.stats.count_round(len(proposal.tokens), verdict.accepted,
                                proposal.seconds if draft_s is None else draft_s, verify_s)
        # A round where nobody would draft tells the load policy nothing; one its share cut to k = 0 is its plain
        # epoch and counts.
        if share < 1.0 or any(p.k for p in plans):
            self.load.observe(len(live), share, sum(len(v.emitted) for v in verdicts), time.perf_counter() - t0)

    def _draft_length(self, drafting: Drafting, sampling: Sampling, slot: Slot,
                      drafter: Drafter | None) -> DraftLength:
        """The generation's draft-length policy, its cost model kept in the slot (`policies.kept_length`), with the
        drafter's cost rules attached."""
        return kept_length(slot.policies, drafting, sampling.greedy, self.constant_width,
                           lambda cost: drafter.pricing(cost, drafting) if drafter is not None else None)

    # -- the loop's steps -----------------------------------------------------------------------------------

    def _prefill(self, s: Stream, prompt: list[int]) -> list[PromptWork]:
        """Cut the slot's cells (the target's, and the drafter's models') back to the longest prefix of
        prompt[:-1] they hold; returns, per model, (model, its cells' tokens, the tokens still to decode)."""
        slot = s.slot
        reader = s.drafter if isinstance(s.drafter, ReadsTarget) else None
        limit = reader.target_limit(s.req, prompt) if reader is not None else None
        self.cells.start_afresh_below_floor(slot.seq, prompt[:-1], limit)
        work = [prompt_work(self.target, slot.target_kv, prompt[:-1], slot.seq, limit)]
        slot.stale_cells = False  # (prompt_work truncated the target's cells to its bookkeeping)
        s.stats.prompt_tokens_processed = len(work[0][2])
        slot.tokens[:] = prompt  # (in place: the stream's DraftRequest reads the same list)
        if reader is not None:
            reader.target_kept(s.req, len(slot.target_kv))
        if s.drafter is not None:
            work += s.drafter.begin(s.req, prompt)
        return [w for w in work if w[2]]

    def _prefill_some(self, s: Stream, whole: bool = False) -> bool:
        """Decode the stream's prompt into every model: all of it, or one batch of each; True when it is in."""
        t0 = time.perf_counter()
        self._decode_work(s, whole)
        now = time.perf_counter()
        s.stats.prefill_s += now - t0
        s.t_start = now
        return not s.prefill

    def _decode_work(self, s: Stream, whole: bool) -> None:
        """Decode the stream's pending prompt work into every model: all of it, or one batch of each."""
        for model, kv, todo in s.prefill:
            take = todo if whole else todo[: model.n_batch]
            scores = model.decode(take, len(kv), seq=s.slot.seq)
            if model is self.target and isinstance(s.drafter, ReadsTarget):
                assert scores is not None and scores.hidden is not None
                s.drafter.target_rows(s.req, len(kv), scores.hidden)
            kv.extend(take)
            del todo[: len(take)]
            if model is self.target and not todo:
                # A recurrent state is rewound to here for the next prompt that shares this one (a chat's next
                # turn); it cannot be rolled back that far otherwise.
                model.checkpoint(s.slot.seq)
        s.prefill = [t for t in s.prefill if t[2]]

    def _shift(self, s: Stream) -> None:
        """Context shift (context_shift.py): keep the first n_keep tokens, drop the next n_discard, and decode the
        rest again at their new positions in every model, as a fresh context holding the shifted tokens would."""
        assert s.shift is not None
        tokens = s.slot.tokens
        shift = context_shift.plan(len(tokens) - 1, self.n_ctx, s.stats.prompt_tokens, s.shift.n_keep,
                                   s.shift.n_discard, self.target.add_bos)
        processed = s.stats.prompt_tokens_processed
        s.prefill = self._prefill(s, context_shift.shifted(tokens, shift))
        s.stats.prompt_tokens_processed = processed
        s.stats.context_shifts += 1
        s.stats.shift_tokens += sum(len(todo) for model, _, todo in s.prefill if model is self.target)
        self._decode_work(s, whole=True)

    def _begin(self, s: Stream) -> bool:
        """Whether the stream goes on this round (else it finishes here)."""
        if s.finished:
            return False
        assert not s.verdict.emitted, "events() of the last round were not taken"
        if s.stats.tokens >= s.max_tokens:
            s._finish(STOP_MAX_TOKENS, f"reached max_tokens ({s.max_tokens})")
            return False
        if s._stop_requested():
            s._finish(STOP_REQUESTED, "stopped by the caller")
            return False
        if s.prefill and not self._prefill_some(s):
            return False  # more of its prompt next round; the round that decodes the last batch is its first
        if s.shift is not None and len(s.slot.tokens) >= self.n_ctx:
            # Every round ends at most at n_ctx tokens (`_room`), so plain and speculative decoding shift at the
            # same token and keep the same ones.
            self._shift(s)
        if len(s.slot.tokens) >= self.n_ctx:  # prompt + reply never exceed the context (one more would)
            s._finish(STOP_CONTEXT_FULL, f"context full ({self.n_ctx} tokens): start a new conversation")
            return False
        return True

    def _plan(self, live: Sequence[Stream]) -> tuple[list[_Plan], float]:
        """Each stream's draft length this round: the one place k is decided (the draft-length policy, then what
        max_tokens, the context and the load policy's share allow). Returns the plans and the share."""
        plans = []
        for s in live:
            k_round = s.chooser.next() if s.use_draft else 0
            room = self.n_ctx - len(s.slot.tokens)  # cells left past the cached prefix (cur's included)
            width = min(k_round, room) + 1 if self.constant_width else 0  # 0: as wide as the drafts are
            plans.append(_Plan(k_round, self._length(s, k_round), width))
        # Slots that take turns verify one stream a decode, so a stream's round costs what it costs alone: its own
        # draft-length policy decides, and the load policy's shorter shares (for a shared verify growing
        # compute-bound) would only cost their probing rounds.
        share = self.load.share(len(live)) if any(p.k for p in plans) and self.target.batches_sequences else 1.0
        if share < 1.0:
            plans = [_Plan(p.k_round, k := round(p.k * share), k + 1 if self.constant_width else 0) for p in plans]
        return plans, share

    def _room(self, s: Stream) -> int:
        """How many drafts the context leaves room for this round: a round emits its drafts and one token more, and
        prompt + reply stay within n_ctx (with context shift the next round shifts there: `_begin`)."""
        return self.n_ctx - len(s.slot.tokens) - 1

    def _length(self, s: Stream, k_round: int, ahead: int = 0) -> int:
        """The longest draft max_tokens and the context leave room for, `ahead` tokens past the committed ones."""
        return min(k_round, s.max_tokens - s.stats.tokens - ahead - 1, self._room(s) - ahead)

    @staticmethod
    def _settle_grammars(live: Sequence[Stream]) -> None:
        """Give each constrained stream's drafter its copy of the grammar state after the committed tokens."""
        for s in live:
            if s.req.grammar is not None:
                s.req.grammar.close()
                assert s.grammar is not None
                s.req.grammar = s.grammar.clone()

    def _draft(self, live: Sequence[Stream], plans: Sequence[_Plan]) -> list[Proposal]:
        """Each stream's proposal: every drafter drafts for its streams together (k = 0 included: a drafter may
        have state to settle)."""
        proposals = [NO_PROPOSAL] * len(live)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(live):
            if s.drafter is not None:
                groups.setdefault(id(s.drafter), []).append(i)
        for members in groups.values():
            drafter = live[members[0]].drafter
            assert drafter is not None
            for i, proposal in zip(members, drafter.draft([(live[i].req, plans[i].k) for i in members]),
                                   strict=True):
                proposals[i] = proposal
        return proposals

    def _drafts_beside_turns(self, live: Sequence[Stream]) -> bool:
        """Whether this round takes turns with the other streams' drafting beside the verifies (`_take_turns`): the
        target's slots take turns, the draft model may work beside it (as for draft-ahead), and no stream's drafter
        reads the target's rows (an MTP head follows its own stream's verify)."""
        return (self.draft_ahead and len(live) > 1 and not self.target.batches_sequences
                and not any(isinstance(s.drafter, ReadsTarget) for s in live))

    def _take_turns(self, live: Sequence[Stream],
                    plans: Sequence[_Plan]) -> tuple[list[Proposal], list[Verdict], float, float]:
        """The round when the target's slots take turns: one verify per stream, and while one runs, the streams
        verified next are drafted in a worker thread (llama.cpp releases the GIL inside a decode; each proposal is
        drafted from its own stream's committed tokens, as it would be on the path). So only the first stream
        drafts on the round's path, and the loop waits for the others' proposals only where drafting outlasts a
        verify. Where the drafters' models share batches between sequences, all the other streams are drafted
        together beside the first verify (each draft step then serves them all: one stream's step would cost the
        same, `ubatch.covering_calls`); where they take turns too, one stream beside each verify. A stream is
        rewound once its verify is read and the drafting beside it ended: its drafter's models are then idle.
        Returns the proposals, the verdicts, and the round's drafting on the path and verify seconds (what every
        stream's stats count, as for a shared round)."""
        if self._beside is None:
            self._beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localspec-draft-beside")
        rest = range(1, len(live))
        together = all(m.batches_sequences for s in live if s.drafter is not None for m in s.drafter.models)
        groups = [[0], *([list(rest)] if together else [[i] for i in rest])]
        proposals = [NO_PROPOSAL] * len(live)
        proposals[0] = self._draft(live[:1], plans[:1])[0]
        draft_s, verify_s = proposals[0].seconds, 0.0
        verdicts: list[Verdict] = []
        for g, group in enumerate(groups):
            # The next group is drafted beside this group's first verify.
            following = [j for j in groups[g + 1] if live[j].drafter is not None] if g + 1 < len(groups) else []
            job = (self._beside.submit(self._draft, [live[j] for j in following], [plans[j] for j in following])
                   if following else None)
            for n, i in enumerate(group):
                beside = _finished(job) if n == 0 else None
                (verdict,), spent, wait = self._verify([live[i]], [plans[i]], [proposals[i]], beside)
                verify_s += spent
                self._rewind(live[i], proposals[i], verdict)
                verdicts.append(verdict)
                if beside is not None and job is not None:
                    draft_s += wait or 0.0
                    for j, drafted in zip(following, job.result(), strict=True):
                        # Drafted off the path: its steps are no measure of a step there (the cost model learns
                        # from the first stream's); the wait for them is their drafting on the path.
                        proposals[j] = dataclasses.replace(drafted, seconds=wait or 0.0,
                                                           ahead=len(drafted.tokens) - drafted.lead)
        return proposals, verdicts, draft_s, verify_s

    def _ahead(self, live: Sequence[Stream], plans: Sequence[_Plan],
               proposals: Sequence[Proposal]) -> tuple[contextlib.AbstractContextManager[None] | None, bool]:
        """A stream alone in its round lets its drafter draft ahead beside the verify (not a constrained one: a bet
        drafted beside the verify would need the grammar after it). Returns the work beside the verify (or None)
        and whether it is a draft-ahead."""
        if not (self.draft_ahead and len(live) == 1 and live[0].drafter is not None and live[0].grammar is None):
            return None, False
        s, proposal = live[0], proposals[0]
        # If every draft is accepted, the next round has this many more tokens behind it.
        k_next = self._length(s, plans[0].k_round, ahead=len(proposal.tokens) + 1)
        return s.drafter.overlap(s.req, proposal, k_next), True  # type: ignore[union-attr]

    def _verify(self, live: Sequence[Stream], plans: Sequence[_Plan], proposals: Sequence[Proposal],
                beside: contextlib.AbstractContextManager[None] | None = None,
                ahead: bool = False) -> tuple[list[Verdict], float, float | None]:
        """One target decode of every stream's [cur] + drafts (each padded to its width), then acceptance per
        stream. `beside`: work that runs while the decode does (`ahead`: the lone stream's draft-ahead, whose wait
        its stats count). Returns the verdicts, the decode's seconds, and how long the loop then waited for the
        work beside it (None: none ran)."""
        items, widths = [], []
        for s, plan, proposal in zip(live, plans, proposals, strict=True):
            # Padded to the plan's width, or narrow after a run of empty drafts: the stream's policy decides.
            width = s.chooser.verify_width(plan.width, len(proposal.tokens)) if plan.width else len(proposal.tokens) + 1
            batch = [s.slot.tokens[-1], *proposal.tokens]
            # Padding only keeps the batch shape: its positions come after every real one (causal attention),
            # their rows are never read, and _settle drops their KV cells with the rejected drafts'.
            batch += [batch[-1]] * (width - len(batch))
            items.append((s.slot.seq, batch, len(s.slot.target_kv), True))
            widths.append(width)
        with beside if beside is not None else contextlib.nullcontext():
            t = time.perf_counter()
            scores = self.target.decode_many(items)
            spent = time.perf_counter() - t
            t = time.perf_counter()
        wait: float | None = None
        if beside is not None:  # the block's exit waited for the work beside the verify to finish
            wait = time.perf_counter() - t
        if ahead:
            assert wait is not None
            live[0].stats.ahead_wait_s += wait
        if any(s.grammar is not None and r is not None and not r.full for s, r in zip(live, scores, strict=True)):
            # A constrained row may be decoded again (`accept_constrained`) into the buffer full rows still view.
            scores = [r.with_logits(r.logits.copy()) if r is not None and r.full and r.logits is not None
                      and r.logits.base is not None else r for r in scores]
        verdicts = []
        for s, (_, batch, _, _), rows, proposal, width in zip(live, items, scores, proposals, widths, strict=True):
            assert rows is not None
            if isinstance(s.drafter, ReadsTarget):
                assert rows.hidden is not None
                s.drafter.target_rows(s.req, len(s.slot.target_kv), rows.hidden)
            s.slot.target_kv.extend(batch)
            rows = rows.head(len(proposal.tokens) + 1)
            if s.grammar is None:
                verdict = self._accept(s, proposal, rows, width)
            else:
                t_accept, start, seq = time.perf_counter(), len(s.slot.target_kv) - len(batch), s.slot.seq
                history = s.slot.tokens + proposal.tokens if s.sampling.penalized else s.slot.tokens
                emitted, accepted, s.grammar, redecoded, chosen = accept_constrained(
                    s.grammar, proposal.tokens, proposal.q, rows, history, s.sampling, s.rng, self.token_is_eog,
                    lambda i, batch=batch, start=start, seq=seq: self.target.full_row(batch[i], start + i, seq),
                    s.logprobs)
                # (A row decoded again ends the round with its token, which may be an accepted draft: then every
                # emitted token is one.)
                verdict = Verdict(emitted, accepted, [], width, chosen)
                if redecoded:  # a row decoded again is verify time (masking rows aside)
                    s.stats.full_rows += redecoded
                    spent += time.perf_counter() - t_accept
            if ahead:
                verdict = dataclasses.replace(verdict, ahead_wait_s=wait)
            verdicts.append(verdict)
        return verdicts, spent, wait

    @staticmethod
    def _accept(s: Stream, proposal: Proposal, scores: Scores, width: int) -> Verdict:
        """gpt-fast's accept/reject over one stream's verify rows (`sampling.accept_rows`)."""
        history = s.slot.tokens + proposal.tokens if s.sampling.penalized else s.slot.tokens  # (a penalty reads it)
        verdict = Verdict(*accept_rows(proposal.tokens, proposal.q, scores, history, s.sampling, s.rng, s.trace), width)
        if s.logprobs is None:
            return verdict
        # Each token's row as its choice saw it: after the penalties (row i follows the drafts before it).
        assert scores.logits is not None and scores.full  # logprobs turn the device sampler off (start)
        seen = penalized(scores, history, s.sampling).logits
        assert seen is not None
        return dataclasses.replace(verdict, logprobs=[token_logprobs(seen[i], t, s.logprobs)
                                                      for i, t in enumerate(verdict.emitted)])

    def _rewind(self, s: Stream, proposal: Proposal, verdict: Verdict) -> None:
        """Commit the round's tokens, say which of the target's cells stay (its rejected ones go in `_settle`, once
        the round's events are taken), and hand the verdict to the drafter (which rewinds its own models' cells)."""
        slot = s.slot
        # The target's cells keep the committed tokens but the newest (cur, which opens the next verify): the
        # emitted tokens but the last were each decoded in the verify at its position.
        keep = len(slot.tokens) + len(verdict.emitted) - 1
        if len(slot.target_kv) > keep:
            del slot.target_kv[keep:]  # bookkeeping first: if a truncate is interrupted, _prefill cuts to it
            slot.stale_cells = True
        slot.tokens.extend(verdict.emitted)
        s.verdict = verdict
        if s.drafter is not None:
            s.drafter.accept(s.req, proposal, verdict.accepted)

    def _settle(self, s: Stream, unused: int) -> None:
        """The round's events were taken (`Stream.events`): the generation used all of its tokens but the last
        `unused` (it ended inside the round). Those leave the slot's tokens, the target's cells and the drafter's
        state, so that the slot holds what plain decoding's would (a stop string, a cancel, an end-of-generation
        token among accepted drafts); then the target's cells past its bookkeeping go, in one rewind of the verify
        (a recurrent state can roll back once a decode, within it: `start` keeps k within its depth)."""
        if self.closed:
            return
        slot = s.slot
        if unused:
            del slot.tokens[len(slot.tokens) - unused :]
            if len(slot.target_kv) >= len(slot.tokens):
                del slot.target_kv[len(slot.tokens) - 1 :]
                slot.stale_cells = True
            if s.drafter is not None:  # a round with nothing drafted over the shorter tokens: its state goes too
                s.drafter.accept(s.req, NO_PROPOSAL, 0)
        if slot.stale_cells:
            keep = len(slot.target_kv)
            if self.target.truncate(keep, slot.seq) != keep:
                raise DecodeError(f"the target could not roll back to position {keep} after a verify")
            slot.stale_cells = False


@contextlib.contextmanager
def _finished(job: Future[list[Proposal]] | None) -> Iterator[None]:
    """The block, then the wait for `job` to end (its result or error is the caller's to read): whatever happens
    in the block, the job's models are idle after it."""
    try:
        yield
    finally:
        if job is not None:
            concurrent.futures.wait([job])
