"""The speculative loop. It yields events and never prints; it does not know who drafts.

One generation: prefill the prompt into its slot's KV cells (the target's, and any the drafter's models hold,
reusing whatever prefix they already hold: `SlotCells.prefill`), then rounds of a plan (the draft length k:
`Schedule.plan`), `_draft` (the request's drafter proposes up to k tokens with their distributions q: `drafters/`),
`_verify` (one batched target decode with scores at every drafted position; each stream's greedy match or
rejection sampling over its rows, a `Verdict`: `Stream.judge`) and `_rewind` (commit the round's tokens; the
drafter rewinds its own state), then each drafter's `accept` takes the round's verdict and costs. Once the round's
events are taken, `_settle` drops the target's cells of rejected tokens, and where the generation ended inside the
round (end of generation, max_tokens, a stop string, a cancel) the round's tokens after that one too, from every
model, so that a slot ends holding what plain decoding's would. k = 0 is plain decoding through the same code, so
baselines are apples to apples. On a GPU the verify batch keeps one width (short drafts padded) so llama.cpp's
CUDA graphs stay captured — but for runs of rounds with nothing drafted, verified narrow when padding them
measures dearer than the width changes (`DraftLength.verify_width`) — and plain decoding at T > 0 draws its tokens
on the device (docs/gpu.md).

Slots: the models may hold several sequences (`LlamaModel(n_seq=N)`, one KV region each). `start` opens a
`Stream` in a slot; `step(streams)` runs one round for all of them at once (each drafter drafts for its streams
together, one target decode verifies all), and each stream's `events()` yields what its round emitted. Every stream
keeps its own settings, random streams and stats, and a slot's numbers do not depend on what the others hold (on
the CPU, bit for bit: tests/test_slots.py), so a request's output is what it would be alone. `generate` is the
one-stream case of the same code. The server starts streams with `prefill_in_rounds`: their prompts go in one batch
per round, beside the others' rounds. How a round's steps run over its streams (a shared batch, draft-ahead beside
the verify, slots taking turns) is `schedule.Schedule`'s, through the steps the engine offers (`schedule.Loop`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Iterator, Sequence

from localspec import drafters
from localspec.config import ContextSettings, Drafting, Sampling
from localspec.drafters.base import (
    NO_PROPOSAL,
    Drafter,
    Outcome,
    Proposal,
    device_mode,
    observe_round,
)
from localspec.drafters.base import shared_prefix as shared_prefix
from localspec.errors import ContextFullError, DecodeError, RollbackError, UsageError
from localspec.llama.grammar import Grammar
from localspec.rounds.constraints import accept_constrained
from localspec.rounds.events import STOP_CONTEXT_FULL, STOP_MAX_TOKENS, STOP_REQUESTED, Event
from localspec.rounds.policies import DraftLength, LoadPolicy, kept_length
from localspec.rounds.prompt_cache import PromptCache, SeqFile, SlotState
from localspec.rounds.schedule import Plan, Schedule
from localspec.rounds.scores import ScoringModel
from localspec.rounds.slot_cells import SlotCells
from localspec.rounds.stream import Slot, Verdict
from localspec.rounds.stream import Stream as Stream


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
        self.schedule = Schedule(self)  # how a round's steps run over its streams
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
        self.schedule.close()
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

    @property
    def load(self) -> LoadPolicy:
        return self.schedule.load  # (the share of k per batch size, for streams sharing a verify)

    @property
    def _beside(self) -> concurrent.futures.ThreadPoolExecutor | None:
        return self.schedule.beside  # (the worker that drafts beside the verifies where slots take turns)

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

    def free_slot(self, prompt: Sequence[int], exclude: Collection[int] = ()) -> int | None:
        return self.cells.free_slot(prompt, exclude)  # (`SlotCells.free_slot`)

    def generate(self, prompt: Sequence[int], sampling: Sampling, drafting: Drafting, max_tokens: int,
                 should_stop: Callable[[], bool] | None = None, *, trace: bool = False, slot: int = 0,
                 grammar: Grammar | None = None, constrain_draft: bool = True,
                 logprobs: int | None = None, context: ContextSettings | None = None,
                 owner: str = "") -> Iterator[Event]:
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
                            grammar=grammar, constrain_draft=constrain_draft, logprobs=logprobs, context=context,
                            owner=owner)
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
              logprobs: int | None = None, context: ContextSettings | None = None, owner: str = "") -> Stream:
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
        and goes on (`SlotCells.shift`); off or None, it stops there.

        `owner`: whose request it is (`DraftRequest.owner`): a drafter that keeps text across requests (suffix
        lookup) drafts it from that owner's past requests only."""
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
                        logprobs, context, owner)
        seq = chosen.seq
        self.target.want_hidden(seq, stream.drafter is not None and stream.drafter.reads_target)
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
        stream.prefill = self.cells.prefill(stream, list(prompt))
        if not prefill_in_rounds:
            self._prefill_some(stream, whole=True)
        self._starts += 1
        chosen.used, chosen.busy = self._starts, True
        stream.t_start = time.perf_counter()
        return stream

    # -- a slot's cells as a state (`slot_cells`): slot files, the prompt cache; context shift's check ----------

    def snapshot(self, slot: int) -> SlotState:
        return self.cells.snapshot(slot)

    def restore(self, slot: int, state: SlotState, parts: Sequence[SeqFile] | None = None) -> bool:  # (parts: a file's)
        return self.cells.restore(slot, state if parts is None else self.cells.with_parts(state, parts))

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
        plans, share = self.schedule.plan(live)
        for s in live:
            s.hand_grammar()
        done = self.schedule.run(live, plans)
        verify_s, draft_s, verdicts = done.verify_s, done.draft_s, done.verdicts
        for i, (s, proposal, verdict) in enumerate(zip(live, done.proposals, verdicts, strict=True)):
            outcome = Outcome(verdict.accepted, verdict.width, verify_s, verdict.draft_ahead_wait_s,
                              done.beside_s.get(i))
            # Its drafting on the path (the drafter's own figure, unless the round counts one for every stream).
            on_path = draft_s if draft_s is not None else s.drafter.spent(s.req).seconds if s.drafter else 0.0
            if s.drafter is None:
                observe_round(s.chooser, proposal, outcome)
            else:
                s.drafter.accept(s.req, proposal, outcome)
            s.stats.count_round(len(proposal.tokens), verdict.accepted, on_path, verify_s)
        # A round where nobody would draft tells the load policy nothing; one its share cut to k = 0 is its plain
        # epoch and counts. Nor does one where no stream may be cut (all must draft every round: --always-draft).
        if any(s.drafting.stand_aside for s in live) and (share < 1.0 or any(p.k for p in plans)):
            self.load.observe(len(live), share, sum(len(v.emitted) for v in verdicts), time.perf_counter() - t0)

    def _draft_length(self, drafting: Drafting, sampling: Sampling, slot: Slot,
                      drafter: Drafter | None) -> DraftLength:
        """The generation's draft-length policy and cost model, kept in the slot (`policies.kept_length`)."""
        return kept_length(slot.policies, drafting, sampling.greedy, self.constant_width,
                           lambda cost: drafter.pricing(cost, drafting) if drafter is not None else None,
                           (other.policies for other in self.slots if other is not slot))

    # -- the loop's steps -----------------------------------------------------------------------------------

    def _prefill_some(self, s: Stream, whole: bool = False) -> bool:
        """Decode the stream's prompt into every model: all of it, or one batch of each; True when it is in."""
        t0 = time.perf_counter()
        self.cells.decode(s, whole)
        now = time.perf_counter()
        s.stats.prefill_s += now - t0
        s.t_start = now
        return not s.prefill

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
            # Every round ends at most at n_ctx tokens (`Schedule.length`), so plain and speculative decoding shift
            # at the same token and keep the same ones.
            self.cells.shift(s, self.n_ctx)
        if len(s.slot.tokens) >= self.n_ctx:  # prompt + reply never exceed the context (one more would)
            s._finish(STOP_CONTEXT_FULL, f"context full ({self.n_ctx} tokens): start a new conversation")
            return False
        return True

    def _draft(self, live: Sequence[Stream], plans: Sequence[Plan]) -> list[Proposal]:
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

    def _verify(self, live: Sequence[Stream], plans: Sequence[Plan], proposals: Sequence[Proposal],
                beside: contextlib.AbstractContextManager[None] | None = None,
                draft_ahead: bool = False) -> tuple[list[Verdict], float, float | None]:
        """One target decode of every stream's [cur] + drafts (each padded to its width), then acceptance per
        stream. `beside`: work that runs while the decode does (`draft_ahead`: the lone stream's draft-ahead, whose wait
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
        if draft_ahead:
            assert wait is not None
            live[0].stats.ahead_wait_s += wait
        if any(s.grammar is not None and r is not None and not r.full for s, r in zip(live, scores, strict=True)):
            # A constrained row may be decoded again (`accept_constrained`) into the buffer full rows still view.
            scores = [r.with_logits(r.logits.copy()) if r is not None and r.full and r.logits is not None
                      and r.logits.base is not None else r for r in scores]
        verdicts = []
        for s, (_, batch, _, _), rows, proposal, width in zip(live, items, scores, proposals, widths, strict=True):
            assert rows is not None
            if s.drafter is not None and s.drafter.reads_target:
                assert rows.hidden is not None
                s.drafter.target_rows(s.req, len(s.slot.target_kv), rows.hidden)
            s.slot.target_kv.extend(batch)
            rows = rows.head(len(proposal.tokens) + 1)
            if s.grammar is None:
                verdict = s.judge(proposal, rows, width)
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
            if draft_ahead:
                verdict = dataclasses.replace(verdict, draft_ahead_wait_s=wait)
            verdicts.append(verdict)
        return verdicts, spent, wait

    def _rewind(self, s: Stream, proposal: Proposal, verdict: Verdict) -> None:
        """Commit the round's tokens, say which of the target's cells stay (its rejected ones go in `_settle`, once
        the round's events are taken), and hand the verdict to the drafter (which rewinds its own models' cells)."""
        slot = s.slot
        # The target's cells keep the committed tokens but the newest (cur, which opens the next verify): the
        # emitted tokens but the last were each decoded in the verify at its position.
        keep = len(slot.tokens) + len(verdict.emitted) - 1
        if len(slot.target_kv) > keep:
            del slot.target_kv[keep:]  # bookkeeping first: if a truncate is interrupted, the next prefill cuts to it
            slot.stale_cells = True
        slot.tokens.extend(verdict.emitted)
        s.verdict = verdict
        if s.drafter is not None:
            s.drafter.rewind(s.req, proposal, verdict.accepted)

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
                s.drafter.rewind(s.req, NO_PROPOSAL, 0)
        if slot.stale_cells:
            keep = len(slot.target_kv)
            if self.target.truncate(keep, slot.seq) != keep:
                raise DecodeError(f"the target could not roll back to position {keep} after a verify")
            slot.stale_cells = False

