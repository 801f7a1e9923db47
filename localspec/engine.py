"""The speculative loop. It yields events and never prints; it does not know who drafts.

One generation: `_prefill` the prompt into its slot's KV cells (the target's, and any the drafter's models hold,
reusing whatever prefix they already hold), then rounds of `_plan` (the draft length k: the one place it is
decided), `_draft` (the request's drafter proposes up to k tokens with their distributions q: `drafters/`),
`_verify` (one batched target decode with scores at every drafted position), `_accept` (greedy match or rejection
sampling, a `_Verdict`) and `_rewind` (drop the target's KV cells of rejected tokens, commit the round's tokens and
tell the drafter the verdict, which rewinds its own state). k = 0 is plain decoding through the same code, so
baselines are apples to apples. On a GPU the verify batch keeps one width (short drafts padded) so llama.cpp's CUDA
graphs stay captured — but for runs of rounds with nothing drafted, verified narrow when padding them measures dearer
than the width changes (`DraftLength.verify_width`) — and plain decoding at T > 0 draws its tokens on the device
(docs/gpu.md).

Slots: the models may hold several sequences (`LlamaModel(n_seq=N)`, one KV region each). `start` opens a
`Stream` in a slot; `step(streams)` runs one round for all of them at once (each drafter drafts for its streams
together, one target decode verifies all), and each stream's `events()` yields what its round emitted. Every stream
keeps its own settings, random streams and stats, and a slot's numbers do not depend on what the others hold (on
the CPU, bit for bit: tests/test_slots.py), so a request's output is what it would be alone. `generate` is the
one-stream case of the same code. The server starts streams with `prefill_in_rounds`: their prompts go in one batch
per round, beside the others' rounds. With several streams, `LoadPolicy` shortens the drafts (down to k = 0, plain
batched decoding) at batch sizes where that measures faster.

A stream alone in its round lets its drafter work beside the verify (`Drafter.overlap`: the draft model's
draft-ahead, drafters/model.py; when it runs: placement.draft_ahead).
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from localspec import context_shift, drafters
from localspec.config import ContextSettings, Drafting, Sampling
from localspec.constraints import masked_row, masked_scores
from localspec.drafters.base import (
    NO_PROPOSAL,
    Drafter,
    DraftRequest,
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
from localspec.llama_ctx import Grammar
from localspec.policies import DraftCost, DraftLength, LoadPolicy
from localspec.prompt_cache import ModelState, PromptCache, SlotState
from localspec.sampling import accept_drafts, accept_or_resample, distributions, penalized, token_logprobs
from localspec.scores import Scores, ScoringModel

# (The events' names are re-exported above: callers have imported them from here since the first release.)


@dataclass(frozen=True, slots=True)
class _Plan:
    """One stream's draft length this round, and the width its verify batch is padded to (0: as wide as the drafts
    are; on a GPU the stream's policy may still verify narrow after a run of empty drafts: `verify_width`)."""

    k_round: int  # what the draft-length policy chose
    k: int  # ... within max_tokens, the context and the load policy's share
    width: int


@dataclass(frozen=True, slots=True)
class _Verdict:
    """What verification kept of one stream's round."""

    emitted: list[int]  # the accepted drafts, then one token of the target's own
    accepted: int
    rows: list[tuple[int, float]]  # with trace: each emitted token's row (argmax, top-2 margin)
    width: int  # the verify batch's width
    # with logprobs: each emitted token's logprob and the best alternatives (sampling.token_logprobs)
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    ahead_wait_s: float | None = None  # the wait after the verify for the draft-ahead beside it (None: none ran)


_NOTHING = _Verdict([], 0, [], 0)


@dataclass(eq=False)
class _Slot:
    """One sequence of the target (llama.cpp sequence id `seq`) and what its KV cells hold.

    Invariant between rounds: `tokens` is the committed sequence; the target's cells hold all of it but the last
    token (`cur`, which opens the next verify batch). A drafter's models keep their own cells (a prefix of it)."""

    seq: int
    tokens: list[int] = field(default_factory=list)
    target_kv: list[int] = field(default_factory=list)
    # Per drafting settings recently used here: the draft-length policy and its cost model, kept across
    # generations (and across others' between them, as bench's interleaved plain runs)
    policies: dict[tuple, DraftLength] = field(default_factory=dict)
    used: int = 0  # when it last started a generation (the least recently used free slot is reused first)
    busy: bool = False


class Stream:
    """One generation in progress in a slot: its request, drafter, random stream and stats, and the last round's
    verdict.

    Made by `Engine.start`; `Engine.step` runs a round for several streams at once; `events()` then yields that
    round's TokenEvents (asking `should_stop` after each) and, when the generation has ended, its DoneEvent.
    """

    def __init__(self, engine: Engine, slot: _Slot, sampling: Sampling, drafting: Drafting, max_tokens: int,
                 should_stop: Callable[[], bool] | None, trace: bool, grammar: Grammar | None = None,
                 constrain_draft: bool = True, logprobs: int | None = None,
                 context: ContextSettings | None = None) -> None:
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
                                            sampling, slot)
        self.stats = GenerationStats()
        self.req = DraftRequest(slot.seq, slot.tokens, sampling, drafting, self.stats,
                                grammar.clone() if grammar is not None and constrain_draft and self.use_draft else None,
                                engine.constrained_rows, self.chooser)
        self.done: DoneEvent | None = None
        self._done_sent = False
        self.prefill: list[PromptWork] = []  # prompt tokens not yet in the caches
        self.t_start = 0.0
        self.verdict = _NOTHING  # the last round's, until events() takes it
        self._piece = engine.token_piece
        self._is_eog = engine.token_is_eog
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def use_draft(self) -> bool:
        return self.drafter is not None

    @property
    def finished(self) -> bool:
        return self.done is not None

    def _finish(self, stop: str, message: str) -> None:
        self.stats.decode_s = time.perf_counter() - self.t_start
        self.done = DoneEvent(self.stats, stop, message)
        self.slot.busy = False
        for grammar in (self.grammar, self.req.grammar):
            if grammar is not None:
                grammar.close()

    def _stop_requested(self) -> bool:
        return self.should_stop is not None and self.should_stop()

    def events(self) -> Iterator[Event]:
        """The last round's tokens, then the DoneEvent if the generation ended (in the round or here)."""
        verdict, self.verdict = self.verdict, _NOTHING
        stats = self.stats
        for i, token in enumerate(verdict.emitted):
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
        if self.done is not None and not self._done_sent:
            self._done_sent = True
            yield self.done


class Engine:
    """Speculative decoding over a target `LlamaModel` and the drafters its optional draft model allows (same
    tokenizer), for as many concurrent generations as the models have sequences (slots)."""

    def __init__(self, target: ScoringModel, draft: ScoringModel | None, *, constant_width: bool | None = None,
                 draft_ahead: bool = False, constrained_rows: str = "full",
                 prompt_cache: PromptCache | None = None) -> None:
        self.target = target
        # Slots' states kept in host RAM: a slot given to another prompt is saved there first, and a prompt that
        # an entry serves better than its slot is restored from there (`_from_cache`).
        self.prompt_cache = prompt_cache if prompt_cache is not None and prompt_cache.limit > 0 else None
        self.draft = draft
        # Keep the verify width constant within a generation, padding a short draft (an early stop below p_min,
        # the last round before max_tokens): on CUDA a width change re-captures graphs, which costs more than the
        # padded positions (docs/gpu.md). On a CPU the padded positions are pure extra work, so only on a GPU.
        self.constant_width = target.on_gpu if constant_width is None else constant_width
        # A stream alone in its round lets its drafter work beside the verify (the draft model: draft-ahead).
        self.draft_ahead = draft_ahead and draft is not None
        # How a grammar's rows are read (`[load] constrained_rows`): "full" logits, or "device" top candidates with
        # a row decoded again in full where they hold too few legal tokens (slower on a GPU: docs/performance.md).
        # A recurrent target cannot go back into a verify to read a row again: full rows there.
        self.constrained_rows = constrained_rows if target.rewind_depth is None else "full"
        # Plain decoding at T > 0 may draw its tokens on the device (one slot only, `start`): llama.cpp's random
        # stream, not the host's, so a seed's text depends on the slot count. The server turns it off, so that a
        # seed gives the same text whatever --parallel is.
        self.draw_on_device = True
        self.drafters = drafters.build(target, draft)
        self.models = [target, *(m for d in self._distinct_drafters() for m in d.models)]
        self.slots = [_Slot(seq) for seq in range(min(m.n_seq for m in self.models))]
        # Per (model, sequence) whose cells were restored from a state: the shortest length they may be cut back to
        # (`prompt_cache.ModelState.floor`); a prompt that shares less starts that model's cells afresh.
        self._floors: dict[tuple[int, int], int] = {}
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
        self._floors.clear()
        for slot in self.slots:
            slot.tokens, slot.target_kv, slot.busy = [], [], False

    def close(self) -> None:
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
    # (llama_ctx._covering_calls): a gap costs a draft step's and a verify's width of tokens every round, more
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

        def key(s: _Slot) -> tuple[int, int, int, int]:
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
        A round's later tokens stay committed in the caches either way, so the next prompt reuses them.
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
        # intermediate results (llama_ctx._covering_calls), so there the host draws from the device's top k.
        plain = not stream.use_draft and self.target.n_seq == 1 and self.draw_on_device
        # Logprobs read every row whole; a grammar masks full rows or the device's top candidates
        # (`constrained_rows`, `_accept_constrained`).
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
            self._from_cache(chosen, prompt)
        stream.prefill = self._prefill(stream, list(prompt))
        if not prefill_in_rounds:
            self._prefill_some(stream, whole=True)
        self._starts += 1
        chosen.used, chosen.busy = self._starts, True
        stream.t_start = time.perf_counter()
        return stream

    def check_context_shift(self) -> None:
        """Context shift drops tokens from the middle of a sequence: a recurrent state cannot (UsageError)."""
        for i, model in enumerate(self._state_models()):
            if model.recurrent:
                raise UsageError(f"context shift: the {'target' if i == 0 else 'draft'} has a recurrent state, which "
                                 "cannot drop tokens from its middle (turn context_shift off)")

    # -- a slot's cells as a state: the prompt cache, slot files ---------------------------------------------

    def snapshot(self, slot: int) -> SlotState:
        """Slot `slot`'s cells in every model, each rolled back to a prefix of its committed tokens (a draft's
        cells may hold drafted tokens past them), as llama.cpp serialises them. The slot must be idle."""
        s = self.slots[slot]
        assert not s.busy, "snapshot of a busy slot"
        models = []
        for model, kv in self._cells(slot):
            keep = shared_prefix(kv, s.tokens)
            if len(kv) > keep:
                del kv[keep:]  # bookkeeping first, as everywhere
                del kv[model.truncate(keep, slot):]  # (a recurrent state may keep less: a checkpoint, or nothing)
            models.append(ModelState(len(kv), model.save_state(slot), model.restore_floor(len(kv))))
        held = max(m.n_tokens for m in models)
        return SlotState(tuple(s.tokens[:held]), tuple(models))

    def restore(self, slot: int, state: SlotState) -> bool:
        """Put `state` (one ModelState per model of `state_models`, in its order) into idle slot `slot`; its earlier
        cells go. False when llama.cpp refuses a model's state: the slot is then empty."""
        s = self.slots[slot]
        assert not s.busy, "restore into a busy slot"
        cells = self._cells(slot)
        assert len(cells) == len(state.models), "one state per model"
        for (model, kv), saved in zip(cells, state.models, strict=True):
            kv.clear()
            self._floors.pop((id(model), slot), None)
            if saved.n_tokens == 0:
                model.clear(slot)
                continue
            if not model.load_state(saved.data, slot):
                self.erase(slot)
                return False
            kv.extend(state.tokens[: saved.n_tokens])
            if saved.floor:
                self._floors[(id(model), slot)] = saved.floor
        s.tokens[:] = state.tokens
        return True

    def erase(self, slot: int) -> int:
        """Empty slot `slot`'s cells in every model; returns how many tokens the target's held."""
        s = self.slots[slot]
        assert not s.busy, "erase of a busy slot"
        held = len(s.target_kv)
        for model, kv in self._cells(slot):
            kv.clear()
            model.clear(slot)
            self._floors.pop((id(model), slot), None)
        s.tokens.clear()
        return held

    def state_models(self) -> list[ScoringModel]:
        """The models whose cells a slot's state holds, in `SlotState.models`' order: the target first."""
        return self._state_models()

    def _state_models(self) -> list[ScoringModel]:
        return [model for model, _ in self._cells(0)]

    def _cells(self, slot: int) -> list[tuple[ScoringModel, list[int]]]:
        """Every model's cells of a slot with their bookkeeping: the target's, then each drafter's own models'."""
        cells = [(self.target, self.slots[slot].target_kv)]
        for drafter in self._distinct_drafters():
            for model, kv in drafter.cells(slot):
                if all(model is not m for m, _ in cells):
                    cells.append((model, kv))
        return cells

    def _reuse(self, slot: int, model: ScoringModel, kv: list[int], body: Sequence[int]) -> int:
        """How much of `body` a model's cells of the slot can keep: the shared prefix, or nothing where that is
        shorter than a restored state may be cut back to."""
        n = shared_prefix(kv, body)
        return n if n >= self._floors.get((id(model), slot), 0) else 0

    def _from_cache(self, slot: _Slot, prompt: Sequence[int]) -> None:
        """llama-server's prompt cache: when the slot would keep less than half of what its cells hold (it is
        given to another prompt), its state goes to the cache first; then an entry that serves more of the
        prompt than the slot does is restored into it."""
        cache = self.prompt_cache
        assert cache is not None
        body = prompt[:-1]
        kept = self._reuse(slot.seq, self.target, slot.target_kv, body)
        if slot.target_kv and 2 * kept >= len(slot.target_kv):
            return  # the conversation it holds goes on
        if slot.target_kv:
            cache.put(self.snapshot(slot.seq))
        found = cache.best(body, better_than=kept)
        if found is not None:
            self.restore(slot.seq, found[0])

    def step(self, streams: Sequence[Stream]) -> None:
        """One round for every stream that goes on: plan, draft (each drafter for its streams together), verify
        (one target decode for all), accept per stream, rewind. Each stream's `events()` then yields its tokens."""
        t0 = time.perf_counter()
        for slot in self.slots if len(self.slots) > 1 else ():  # a free slot's chains would run in every decode
            if not slot.busy:  # (llama_ctx._covering_calls)
                for model in self.models:
                    model.use_device_sampler(None, slot.seq)
        live = [s for s in streams if self._begin(s)]
        if not live:
            return
        plans, share = self._plan(live)
        proposals = self._draft(live, plans)
        verdicts, verify_s = self._verify(live, plans, proposals)
        for s, proposal, verdict in zip(live, proposals, verdicts, strict=True):
            self._rewind(s, proposal, verdict)
            s.chooser.observe(len(proposal.tokens), verdict.accepted, proposal.seconds, verify_s, verdict.width,
                              proposal.looked_up, proposal.first_s, proposal.ahead, verdict.ahead_wait_s,
                              proposal.least_s)
            stats = s.stats
            stats.draft_s += proposal.seconds
            stats.verify_s += verify_s
            stats.rounds += 1
            stats.drafted += len(proposal.tokens)
            stats.accepted += verdict.accepted
            stats.draft_lengths.append(len(proposal.tokens))
        # A round where nobody would draft tells the load policy nothing; one its share cut to k = 0 is its plain
        # epoch and counts.
        if share < 1.0 or any(p.k for p in plans):
            self.load.observe(len(live), share, sum(len(v.emitted) for v in verdicts), time.perf_counter() - t0)

    KEPT_POLICIES = 8  # per slot: one per drafting settings recently used there

    def _draft_length(self, drafting: Drafting, sampling: Sampling, slot: _Slot) -> DraftLength:
        """A fixed length's chooser is fresh each generation. An adaptive one is kept across the slot's generations
        with the same drafting, and so is the cost model of every chooser: what it measured (costs, acceptance)
        stays valid for the next prompt, and probing again every generation would cost rounds."""
        key = (drafting, sampling.greedy)
        kept = slot.policies.pop(key, None) or DraftLength(
            drafting, DraftCost(drafting.n_draft, graphs=self.constant_width), self.constant_width)
        slot.policies[key] = kept  # the most recent last
        while len(slot.policies) > self.KEPT_POLICIES:
            del slot.policies[next(iter(slot.policies))]
        return kept if drafting.adaptive else DraftLength(drafting, kept.cost, self.constant_width)

    # -- the loop's steps -----------------------------------------------------------------------------------

    def _prefill(self, s: Stream, prompt: list[int]) -> list[PromptWork]:
        """Cut the slot's cells (the target's, and the drafter's models') back to the longest prefix of
        prompt[:-1] they hold; returns, per model, (model, its cells' tokens, the tokens still to decode)."""
        slot = s.slot
        for model, kv in self._cells(slot.seq):  # restored cells shorter than their floor start afresh
            if (id(model), slot.seq) in self._floors and not self._reuse(slot.seq, model, kv, prompt[:-1]):
                del self._floors[(id(model), slot.seq)]
                kv.clear()
                model.clear(slot.seq)
        reader = s.drafter if isinstance(s.drafter, ReadsTarget) else None
        limit = reader.target_limit(s.req, prompt) if reader is not None else None
        if limit is not None and self._floors.get((id(self.target), slot.seq), 0) > limit:
            # Its reader needs rows from below the floor of a restored state: the target starts afresh.
            del self._floors[(id(self.target), slot.seq)]
            slot.target_kv.clear()
            self.target.clear(slot.seq)
        work = [prompt_work(self.target, slot.target_kv, prompt[:-1], slot.seq, limit)]
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
        share = self.load.share(len(live)) if any(p.k for p in plans) else 1.0
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

    def _draft(self, live: Sequence[Stream], plans: Sequence[_Plan]) -> list[Proposal]:
        """Each stream's proposal: every drafter drafts for its streams together (k = 0 included: a drafter may
        have state to settle)."""
        proposals = [NO_PROPOSAL] * len(live)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(live):
            if s.drafter is not None:
                groups.setdefault(id(s.drafter), []).append(i)
        for s in live:
            if s.req.grammar is not None:  # the drafter's copy: the state after the committed tokens
                s.req.grammar.close()
                assert s.grammar is not None
                s.req.grammar = s.grammar.clone()
        for members in groups.values():
            drafter = live[members[0]].drafter
            assert drafter is not None
            for i, proposal in zip(members, drafter.draft([(live[i].req, plans[i].k) for i in members]),
                                   strict=True):
                proposals[i] = proposal
        return proposals

    def _verify(self, live: Sequence[Stream], plans: Sequence[_Plan],
                proposals: Sequence[Proposal]) -> tuple[list[_Verdict], float]:
        """One target decode of every stream's [cur] + drafts (each padded to its width), then acceptance per
        stream. A stream alone in its round lets its drafter work beside the decode. Returns the verdicts and the
        decode's seconds."""
        items, widths = [], []
        for s, plan, proposal in zip(live, plans, proposals, strict=True):
            # Padded to the plan's width, or narrow after a run of empty drafts: the stream's policy decides.
            width = s.chooser.verify_width(plan.width, len(proposal.tokens)) if plan.width else len(proposal.tokens) + 1
            batch = [s.slot.tokens[-1], *proposal.tokens]
            # Padding only keeps the batch shape: its positions come after every real one (causal attention),
            # their rows are never read, and _rewind drops their KV cells with the rejected drafts'.
            batch += [batch[-1]] * (width - len(batch))
            items.append((s.slot.seq, batch, len(s.slot.target_kv), True))
            widths.append(width)
        beside: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        overlapping = False
        # (Not for a constrained stream: a bet drafted beside the verify would need the grammar after it.)
        if self.draft_ahead and len(live) == 1 and live[0].drafter is not None and live[0].grammar is None:
            s, proposal = live[0], proposals[0]
            # If every draft is accepted, the next round has this many more tokens behind it.
            k_next = self._length(s, plans[0].k_round, ahead=len(proposal.tokens) + 1)
            beside = s.drafter.overlap(s.req, proposal, k_next)  # type: ignore[union-attr]
            overlapping = True
        with beside:
            t = time.perf_counter()
            scores = self.target.decode_many(items)
            spent = time.perf_counter() - t
            t = time.perf_counter()
        wait: float | None = None
        if overlapping:  # the block's exit waited for the draft-ahead beside the verify to finish
            wait = time.perf_counter() - t
            live[0].stats.ahead_wait_s += wait
        if any(s.grammar is not None and r is not None and not r.full for s, r in zip(live, scores, strict=True)):
            # A constrained row may be decoded again (`_accept_constrained`) into the buffer full rows still view.
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
                t_accept, redecoded = time.perf_counter(), s.stats.full_rows
                verdict = self._accept_constrained(s, proposal, rows, width, batch, len(s.slot.target_kv) - len(batch))
                if s.stats.full_rows > redecoded:  # a row decoded again is verify time (masking rows aside)
                    spent += time.perf_counter() - t_accept
            if s.logprobs is not None and s.grammar is None:  # (a constrained stream's: _accept_constrained)
                assert rows.logits is not None and rows.full  # logprobs turn the device sampler off (start)
                # Each token's row as its choice saw it: after the penalties (row i follows the drafts before it).
                history = s.slot.tokens + proposal.tokens if s.sampling.penalized else s.slot.tokens
                seen = penalized(rows, history, s.sampling).logits
                assert seen is not None
                verdict = dataclasses.replace(verdict, logprobs=[token_logprobs(seen[i], t, s.logprobs)
                                                                 for i, t in enumerate(verdict.emitted)])
            if wait is not None:
                verdict = dataclasses.replace(verdict, ahead_wait_s=wait)
            verdicts.append(verdict)
        return verdicts, spent

    @staticmethod
    def _accept(s: Stream, proposal: Proposal, scores: Scores, width: int) -> _Verdict:
        """gpt-fast's accept/reject over one stream's verify rows."""
        drafts, sampling = proposal.tokens, s.sampling
        history = s.slot.tokens + drafts if sampling.penalized else s.slot.tokens  # (only a penalty reads it)
        if scores.drawn is not None:  # plain decoding at T > 0: the device drew the token
            return _Verdict([int(scores.drawn[0])], 0, [], width)
        if sampling.greedy:
            scored = penalized(scores, history, sampling)
            rows = scored.argmax_and_margin() if s.trace else []  # read from the rows, apart from the choice
            choice = scored.argmax()
            n = 0
            while n < len(drafts) and drafts[n] == choice[n]:
                n += 1
            return _Verdict([*drafts[:n], int(choice[n])], n, rows, width)
        assert proposal.q is not None or not drafts, "a drafter sampling at T > 0 must say what it drew from"
        n, out = accept_drafts(drafts, distributions(scores, history, sampling), proposal.q or [], s.rng)
        return _Verdict([*drafts[:n], out], n, [], width)

    def _accept_constrained(self, s: Stream, proposal: Proposal, scores: Scores, width: int, batch: list[int],
                            start: int) -> _Verdict:
        """`_accept` on masked rows: row i is masked with the grammar state after the drafts before it (a copy of
        the real state, advanced by each accepted draft), so p is the constrained target's at every position. The
        copy then replaces the real state.

        Rows of the device's top candidates (greedy, top-k) are masked as they are where they hold enough legal
        tokens; a row that does not is read in full by decoding its token (`batch[i]` at `start + i`) again, which
        drops the cells after it, so the round ends with that row's token (exact either way: it is the
        constrained target's choice or draw at that position)."""
        assert s.grammar is not None
        drafts, sampling = proposal.tokens, s.sampling
        history = s.slot.tokens + drafts if sampling.penalized else s.slot.tokens
        scored = penalized(scores, history, sampling)
        state = s.grammar.clone()
        emitted: list[int] = []
        logprob_rows: list[np.ndarray] = []
        # Logprobs read every token the grammar allows (masked_scores checks only what the choice needs): a pipeline
        # without top-k, top-p or min-p needs them all.
        every = dataclasses.replace(sampling, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
        try:
            for i in range(len(drafts) + 1):
                if s.logprobs is not None:
                    assert scored.logits is not None  # full rows: logprobs turn the device sampler off (start)
                    logprob_rows.append(masked_row(scored.logits[i], state, every))
                row = masked_scores(scored, i, state, sampling)
                last = row is None
                if row is None:  # (no penalty here: a penalised stream has full rows)
                    full = Scores(self.target.full_row(batch[i], start + i, s.slot.seq)[None, :])
                    row = masked_scores(full, 0, state, sampling)
                    assert row is not None
                    s.stats.full_rows += 1
                if sampling.greedy:
                    token = int(row.argmax()[0])
                    ok = i < len(drafts) and drafts[i] == token
                elif i < len(drafts):
                    assert proposal.q is not None, "a drafter sampling at T > 0 must say what it drew from"
                    ok, token = accept_or_resample(drafts[i], distributions(row, [], sampling), 0, proposal.q[i],
                                                   s.rng)
                else:
                    ok, token = False, distributions(row, [], sampling).sample(0, s.rng)
                emitted.append(token)
                if not self.token_is_eog(token):
                    state.accept(token)
                if not ok or last:
                    break
        except BaseException:
            state.close()
            raise
        s.grammar.close()
        s.grammar = state
        n_top = s.logprobs
        chosen = [] if n_top is None else [token_logprobs(row, token, n_top)
                                           for row, token in zip(logprob_rows, emitted, strict=True)]
        return _Verdict(emitted, len(emitted) - 1, [], width, chosen)

    def _rewind(self, s: Stream, proposal: Proposal, verdict: _Verdict) -> None:
        """Drop the target's KV cells of rejected tokens, commit the round's tokens, and hand the verdict to the
        drafter (which rewinds its own models' cells)."""
        slot = s.slot
        keep = len(slot.tokens) + verdict.accepted  # committed tokens (cur included) + accepted drafts
        # Bookkeeping first: if a truncate is interrupted, the next _prefill truncates to what the lists claim.
        if len(slot.target_kv) > keep:
            del slot.target_kv[keep:]
            if self.target.truncate(keep, slot.seq) != keep:  # (`start` keeps k within the target's rewind depth)
                raise DecodeError(f"the target could not roll back to position {keep} after a verify")
        slot.tokens.extend(verdict.emitted)
        s.verdict = verdict
        if s.drafter is not None:
            s.drafter.accept(s.req, proposal, verdict.accepted)
