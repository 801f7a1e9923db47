"""The draft model: a second, smaller GGUF of the same tokenizer drafts token by token, with draft-ahead.

Each draft step is one batched draft decode across the requests still drafting. Greedy drafts take the draft's
argmax; at T > 0 it samples from its own pipeline q (the same `Sampling` as the target's p) with a random stream of
its own. An unsure draft (top probability below p_min) stops the request's drafting for the round.

Draft-ahead (a draft on a device of its own, or both models on GPUs: `placement.draft_ahead`): while the target
verifies a round, a worker thread drafts the next one, assuming that every draft is accepted and that the target's
own next token is the draft's argmax there. The draft-ahead is kept only when it held (both came true) and the next
round asks for the same length; otherwise it is thrown away and the round drafts as usual. The draft samples from a
random stream of its own that a thrown draft-ahead rewinds, so the output is the sequential loop's, token for token
(given that the draft scores a token alone as it scores it in a batch, which localspec's losslessness already rests on).

With `draft_ahead_length = "fit"` the draft-ahead makes only as many tokens as the cost model says fit beside the verify
(`ModelCost.draft_ahead_length`), and stops after the decode in flight when the verify ends: the loop need not wait for
drafts it could make faster alone. A draft-ahead that held with fewer than k drafts goes on where it stopped, on the
path (the same random stream, the same tokens the sequential loop would draft), for as many more as the cost model says
pay (`ModelCost.continuation`); what is verified is still a proposal with its q, so exactness is unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from localspec.config import Drafting
from localspec.drafters.base import (
    NO_PROPOSAL,
    Drafter,
    DrafterBase,
    DraftRequest,
    PromptWork,
    Proposal,
    Spent,
    device_mode,
    prompt_work,
)
from localspec.llama.layer_features import BLOCK_DRAFTER_ARCHS, EAGLE3_ARCH
from localspec.rounds.constraints import masked_scores
from localspec.rounds.policies import CostRule, DraftCost, DraftLength, Observation
from localspec.rounds.sampling import Candidates, distributions, greedy_tokens, penalized
from localspec.rounds.scores import ScoringModel

LLAMA_SERVER_TYPE = "draft-simple"  # its `speculative.type` (llama-server's name)


@dataclass(frozen=True, slots=True)
class _DraftedAhead:
    """The next round's drafts, made while this round's verify ran, and what keeping or throwing them needs."""

    guess: int  # the target's next token, as the draft guessed it (its argmax after the last draft)
    k: int  # the draft length they were made for
    drafts: list[int]
    q: list[Candidates] | None
    rng_state: dict  # the draft's random stream before them: a thrown draft-ahead gives its draws back
    seconds: float  # spent in the draft's decodes, beside the verify
    decodes: int  # ... in this many decodes (the guess's and the drafts')
    complete: bool  # its drafting ended on its own (k drafts, an unsure one, ...), not cut short to fit the verify


class DraftAhead(NamedTuple):
    """A draft-ahead that held, as another drafter weighing it sees it (`ModelDrafter.drafted_ahead`)."""

    k: int  # the draft length it was made for: a round must ask for exactly this many to use it
    ready: int  # drafts it holds (made beside the last verify: no draft steps on the path)
    room: int  # how many more it may draft on the path (`_go_on`; 0 when its drafting ended on its own)


@dataclass(eq=False)
class _Job:
    """One request's drafting within a call: what it continues and what it has drafted so far."""

    req: DraftRequest
    k: int
    sequence: list[int]
    tokens: list[int] = field(default_factory=list)
    q: list[Candidates] | None = None
    seconds: float = 0.0
    first_s: float = 0.0  # the first step's share of `seconds`
    least_s: float | None = None  # the least of the later steps (`Spent.least_s`)
    decodes: int = 0
    limit: int | None = None  # draft at most this many (a draft-ahead fitted to the verify), else k
    cut: bool = False  # stopped by `limit` or the verify's end with more to draft


class ModelDrafter(DrafterBase):
    def __init__(self, draft: ScoringModel, target_vocab: int) -> None:
        super().__init__()
        self.model = draft
        self.models = (draft,)
        self._target_vocab = target_vocab
        self._unknown = draft.unknown_token
        self._kv: dict[int, list[int]] = {}  # per sequence: the tokens the draft's cells hold (a prefix of it)
        self._rng: dict[int, np.random.Generator] = {}  # per sequence: the draft's random stream
        self._kept: dict[int, _DraftedAhead] = {}  # per sequence: a draft-ahead that held
        self._pending: dict[int, Future[_DraftedAhead | None]] = {}  # per sequence: the draft-ahead beside the verify
        self._worker: ThreadPoolExecutor | None = None  # started when first used

    # -- the seam ---------------------------------------------------------------------------------------------

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        self._wait()
        seq = req.seq
        # A grammar masks full rows, or the device's top candidates (`[load] constrained_rows = "device"`).
        self.model.use_device_sampler(device_mode(
            self.model, req.sampling, p_min=req.drafting.p_min,
            grammar_rows=req.grammar_rows if req.grammar is not None else None), seq)
        self._rng[seq] = np.random.default_rng([req.sampling.seed, 1])
        self._kept.pop(seq, None)
        model, kv, todo = prompt_work(self.model, self._kv.setdefault(seq, []), prompt[:-1], seq)
        return [(model, list(kv), todo)]  # (a copy: what the loop decodes comes back through `set_cells`)

    def start_behind(self, req: DraftRequest, prompt: list[int], length: DraftLength | None) -> None:
        """Start a generation reading none of the prompt: the draft's cells are cut back to what they share with it
        (`prompt_work` trims them and the bookkeeping in place), and its rest is left unread, so the model is `lag`
        tokens behind until a round catches it up (`probe`: only where that is affordable)."""
        self.start(req, prompt, length)  # (the prompt work it returns is not decoded)

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]],
              after: Sequence[list[int]] | None = None) -> list[Proposal]:
        """Up to k tokens per job; with `after`, continuing those tokens (another drafter's) past the committed
        ones. A request alone here uses its draft-ahead when it held and k is what it was
        drafted for."""
        out: list[Proposal] = [NO_PROPOSAL] * len(jobs)
        todo: list[tuple[int, _Job]] = []
        for i, (req, k) in enumerate(jobs):
            self.spend(req, Spent())
            kept = self._kept.pop(req.seq, None)
            if kept is not None and len(jobs) == 1 and kept.k == k and not (after and after[i]):
                req.stats.ahead_kept += 1
                out[i] = self._go_on(req, kept)
                continue
            if kept is not None:
                self._throw(req, kept)
            if after is None:  # (the chain decides its model's share itself)
                k = self.stand_aside(req, k, ModelCost, self.lag(req))
            if k > 0:
                todo.append((i, _Job(req, k, req.tokens + after[i] if after else req.tokens)))
        self._draft([job for _, job in todo])
        for i, job in todo:
            out[i] = Proposal(job.tokens, job.q)
            self.spend(job.req, Spent(job.seconds, job.first_s, job.least_s))
        return out

    @contextlib.contextmanager
    def draft_ahead(self, req: DraftRequest, proposal: Proposal, k_next: int) -> Iterator[None]:
        """Draft ahead in the worker thread for as long as the block (the verify) runs. llama.cpp releases the GIL
        inside each decode, so the two models compute at once. Whatever happens in the block, the draft model is
        idle again when it ends. With `draft_ahead_length = "fit"` it drafts what the cost model says fits and stops
        after the decode in flight when the block ends."""
        if not (proposal.tokens and k_next > 0):
            yield
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localspec-draft-ahead")
        verified = threading.Event() if req.drafting.draft_ahead_length == "fit" else None
        job = self._pending[req.seq] = self._worker.submit(self._draft_ahead_job, req, list(proposal.tokens), k_next,
                                                           verified)
        try:
            yield
        finally:
            if verified is not None:
                verified.set()
            with contextlib.suppress(Exception):  # its own error, if any, is raised by accept
                job.result()

    def rewind(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        """Keep the draft-ahead if it held (else give its random draws back); drop the draft's cells past the
        committed tokens but the newest (which the next draft feeds), unless a draft-ahead that held owns them."""
        seq = req.seq
        job = self._pending.pop(seq, None)
        ahead = job.result() if job is not None else None
        if ahead is not None:
            req.stats.ahead_made += 1
            req.stats.ahead_s += ahead.seconds
            could_keep = accepted == len(proposal.tokens)
            keep = could_keep and req.tokens[-1] == ahead.guess
            length = self.length(req)
            if length is not None:
                length.rule(ModelCost).observe_draft_ahead(ahead.seconds, ahead.decodes, could_keep, keep)
            if keep:
                self._kept[seq] = ahead
                return
            self._rng[seq].bit_generator.state = ahead.rng_state  # its cells go with the rejected ones, below
        self._cut(seq, len(req.tokens) - 1)

    def drafted_ahead(self, req: DraftRequest) -> DraftAhead | None:
        """The draft-ahead kept for this request (it held), None when there is none: a round that
        asks for exactly its k tokens, after no other drafter's, uses it."""
        kept = self._kept.get(req.seq)
        if kept is None:
            return None
        return DraftAhead(kept.k, len(kept.drafts), 0 if kept.complete else kept.k - len(kept.drafts))

    def lag(self, req: DraftRequest) -> int:
        """How many committed tokens the draft's cells lack (1 when current: cur is fed by the next draft)."""
        return len(req.tokens) - len(self._kv.get(req.seq, ()))

    def pricing(self, cost: DraftCost, drafting: Drafting) -> ModelCost:
        """The model's cost rule on this stream's facts: it prices the loop's adaptive k."""
        rule = ModelCost.of(cost)
        rule.draft_ahead_fit = drafting.draft_ahead_length == "fit"
        return rule

    def cells(self, seq: int) -> list[tuple[ScoringModel, list[int]]]:
        return [(self.model, list(self._kv.get(seq, ())))]

    def set_cells(self, seq: int, model: ScoringModel, tokens: Sequence[int]) -> None:
        if model is not self.model:
            super().set_cells(seq, model, tokens)
        self._kv[seq] = list(tokens)

    def reset(self) -> None:
        self._wait()
        self.model.clear()
        self._kv.clear()
        self._kept.clear()

    def close(self) -> None:
        self._wait()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    # -- inside -----------------------------------------------------------------------------------------------

    def _go_on(self, req: DraftRequest, kept: _DraftedAhead) -> Proposal:
        """The round a draft-ahead that held drafted: as it is, or (cut short to fit the verify) with as many more
        drafts as pay, drafted now where the draft-ahead stopped."""
        more = 0
        if not kept.complete:
            ready, length = len(kept.drafts), self.length(req)
            more = (length.rule(ModelCost).continuation(ready, kept.k, length.padded)
                    if length is not None else kept.k - ready)
        if more <= 0:
            self.spend(req, Spent(0.0, drafted_ahead=len(kept.drafts)))
            return Proposal(kept.drafts, kept.q)
        job = _Job(req, more, req.tokens + kept.drafts)
        self._draft([job])
        q = None if job.q is None else [*(kept.q or []), *job.q]
        self.spend(req, Spent(job.seconds, job.first_s, job.least_s, drafted_ahead=len(kept.drafts)))
        return Proposal(kept.drafts + job.tokens, q)

    def _draft(self, jobs: list[_Job], until: threading.Event | None = None, checkpoint: bool = True) -> None:
        """Draft each job's tokens: one batched draft decode per step across the jobs still drafting (with `until`,
        no step starts after it is set). A recurrent draft model is checkpointed after the first step (the
        committed tokens: every later rewind goes back at least that far, and its one-token steps cannot be rolled
        back otherwise); a draft-ahead is not (`checkpoint`: its cells may be thrown away whole)."""
        draft = self.model
        todo = []
        for job in jobs:
            kv = self._kv[job.req.seq]
            feed = job.sequence[len(kv) :]  # cur, plus the last draft token after an all-accept round
            if max(feed) >= draft.n_vocab:
                # A target-only padding id (vocabularies may differ by up to 128 trailing ids): the draft sees its
                # unknown token there instead. That can only cost acceptance, never correctness.
                feed = [t if t < draft.n_vocab else self._unknown for t in feed]
            job.q = None if job.req.sampling.greedy else []
            todo.append((job, feed))
        step = 0
        while todo:
            if until is not None and until.is_set():
                for job, _ in todo:
                    job.cut = True
                break
            t = time.perf_counter()
            scores = draft.decode_many([(job.req.seq, feed, len(self._kv[job.req.seq]), False)
                                        for job, feed in todo])
            if step == 0 and checkpoint and draft.rewind_depth is not None:
                for job, _ in todo:
                    draft.checkpoint(job.req.seq)
            spent = time.perf_counter() - t
            going = []
            for (job, feed), row in zip(todo, scores, strict=True):
                assert row is not None
                job.seconds += spent
                job.decodes += 1
                if step == 0:
                    job.first_s = spent
                elif job.least_s is None or spent < job.least_s:
                    job.least_s = spent
                self._kv[job.req.seq].extend(feed)
                sampling, p_min = job.req.sampling, job.req.drafting.p_min
                # Only a penalty reads the history (copying a long one every draft step costs).
                history = job.sequence + job.tokens if sampling.penalized else job.sequence
                grammar = job.req.grammar
                if grammar is not None:  # propose only what the grammar allows after the drafts so far
                    masked = masked_scores(penalized(row, history, sampling), 0, grammar, sampling)
                    if masked is None:
                        # The device's candidates hold too few legal tokens: propose no further (a shorter
                        # proposal costs nothing in exactness; the target's row is read in full if need be).
                        continue
                    row, history = masked, []  # (its penalties are in the masked row)
                if sampling.greedy:
                    token = int(greedy_tokens(row, history, sampling)[0])
                    confident = p_min == 0.0 or row.top_prob(0) >= p_min
                else:
                    dist = distributions(row, history, sampling)
                    token = dist.sample(0, self._rng[job.req.seq])
                    assert job.q is not None
                    job.q.append(dist)
                    confident = p_min == 0.0 or dist.top_prob(0) >= p_min
                if token >= self._target_vocab:
                    continue  # a draft-only padding id: the target cannot score it
                job.tokens.append(token)
                if grammar is not None and not self.model.is_eog(token):
                    grammar.accept(token)
                # An unsure draft is usually wrong: verify what we have instead of drafting on.
                if step < job.k - 1 and confident:
                    if job.limit is not None and step >= job.limit - 1:
                        job.cut = True
                    else:
                        going.append((job, [token]))
            todo = going
            step += 1

    def _draft_ahead_job(self, req: DraftRequest, drafts: list[int], k: int,
                         verified: threading.Event | None) -> _DraftedAhead | None:
        """Assume every draft is accepted: guess the target's next token (the draft's argmax: no random draw, so
        the draws that follow are the next round's own), then draft the next round behind it: its k tokens, or
        with `verified` (fitted draft-aheads) as many as the cost model says fit, none started after it is set."""
        seq, kv = req.seq, self._kv[req.seq]
        state = self._rng[seq].bit_generator.state
        t = time.perf_counter()
        sequence = req.tokens + drafts
        feed = sequence[len(kv) :]  # the last draft, which the draft has not seen yet
        if not feed:  # drafting stopped at a draft-only id, after feeding every draft: nothing to guess from
            return None
        scores = self.model.decode(feed, len(kv), seq=seq)
        assert scores is not None
        kv.extend(feed)
        guess = int(scores.argmax()[0])
        if guess >= self._target_vocab:
            return None
        # Asked here, beside the verify, rather than on the loop's path before it: the same answer, as nothing
        # tells the cost model anything until the loop has waited for this thread.
        length = self.length(req)
        limit = length.rule(ModelCost).draft_ahead_length(k) if verified is not None and length is not None else k
        job = _Job(req, k, [*sequence, guess], limit=limit)
        if limit > 0:
            self._draft([job], verified, checkpoint=False)
        else:
            job.cut, job.q = True, None if req.sampling.greedy else []
        return _DraftedAhead(guess, k, job.tokens, job.q, state, time.perf_counter() - t, 1 + job.decodes, not job.cut)

    def _throw(self, req: DraftRequest, kept: _DraftedAhead) -> None:
        """Undo a kept drafted-ahead round that this round cannot use (it asks for another length, or other
        requests joined): its draws go back, its cells from cur on leave the draft's cache (the next draft feeds
        cur)."""
        self._rng[req.seq].bit_generator.state = kept.rng_state
        self._cut(req.seq, len(req.tokens) - 1)

    def _cut(self, seq: int, keep: int) -> None:
        """Rewind the draft's cells to `keep` (a recurrent draft may keep fewer: the next draft decodes the rest
        again, as its first step's catch-up)."""
        kv = self._kv.get(seq)
        if kv is not None and len(kv) > keep:
            del kv[keep:]  # bookkeeping first: if a truncate is interrupted, the next begin cuts to what it claims
            del kv[self.model.truncate(keep, seq):]

    def _wait(self) -> None:
        """The draft model is ours again: a draft-ahead interrupted mid-verify (Ctrl-C) may still be running."""
        for job in self._pending.values():
            with contextlib.suppress(BaseException):
                job.result()
        self._pending.clear()


class ModelCost(CostRule):
    """The draft model's prices: each of its tokens costs a draft step (the shared `DraftCost.step_s`) and is right
    at the model's measured rate (source "model"); drafting ahead hides steps behind the verify; a model judged a
    loss is probed now and then. The loop's adaptive k is chosen by these prices (`Pricing`), and the chain's model
    share after lookup's tokens (`chain.ChainCost`). A drafter that drafts token by token at a step's cost (a
    target's own multi-token-prediction head) may subclass it with a `SOURCE` of its own.

    Draft-ahead's model (`seconds`): a draft-ahead holds when every draft was accepted (S(k)) and the draft's argmax
    guess of the target's own token came true (`guess_rate`, measured over the draft-aheads that could: their round
    accepted every draft); a decode beside the verify costs `draft_ahead_step_s` (contended); the draft-ahead thread
    ends `draft_ahead_lag_s` later than its decodes alone would beside a verify that starts with it (thread start,
    the GIL: a few ms on a GPU, docs/lab/2026-12-01-drafters.md), so the loop waits max(0, lag + decodes x step -
    verify). Until a draft-ahead is measured, the share of model tokens drafted ahead discounts the steps on average.

    The probe schedule: while the model is judged a loss it is not run, so every `interval` such rounds one round
    drafts PROBE tokens with it (`probe`; DraftCost's schedule: PROBE_FIRST doubling to PROBE_MAX; reset when it pays
    again). A model that would lose even if every token were accepted (`could_pay`) goes to PROBE_MAX at once and is
    probed only in sync: no acceptance a probe measures could turn it on, only a change of its costs. When the model
    has sat out many rounds, a probe's first step must first read every token since, which on a CPU can cost far
    more than the probe itself: a due probe goes ahead out of sync only while catching up is affordable
    (`_catch_up_affordable`: unmeasured, the first such probe measures `DraftCost.catch_up_cost`; on a GPU it reads
    hundreds of tokens in a few ms), else it waits for a round where the model's cells are current (a generation's
    first round). A probe that waited several intervals before its first catch-up would leave the chain at lookup's
    pace with a model worth more (docs/lab/2026-12-01-drafters.md has the run that showed it).
    """

    SOURCE = "model"
    PRIOR = 0.7  # a position's acceptance before anything is measured there
    PROBE = 2  # tokens of a cheap probe
    CATCH_UP_SHARE = 0.05  # a probe out of sync may cost this share of the rounds it waited in catching up
    WAITED = 1e-4  # a wait shorter than this (s) is the draft-ahead thread's bookkeeping, not a wait for its decodes

    def __init__(self, cost: DraftCost) -> None:
        super().__init__(cost)
        self.source = self.SOURCE
        cost.add_source(self.SOURCE, self.PRIOR)
        # The share of model tokens drafted ahead (beside the last verify: no draft steps on the critical path);
        # a round's draft steps cost that much less on average, which long drafts earn most. (Until draft-ahead's model
        # has measured one: then it replaces this average.)
        self.drafted_ahead_share = 0.0
        self.guesses, self.guesses_right = 0.0, 0.0
        self.draft_ahead_step_s: float | None = None
        self.draft_ahead_lag_s: float | None = None
        self._draft_ahead_s: float | None = None  # the last draft-ahead's seconds (`observe_draft_ahead`), for the lag
        self._draft_ahead_steps: deque[float] = deque(maxlen=cost.STEPS)  # recent draft-aheads' seconds a decode
        self.draft_aheads = 0  # draft-aheads told (`observe_draft_ahead`): the first is cold and measures nothing
        self._draft_ahead_round: int | None = None  # the round the ahead figures were last measured in
        self._draft_ahead_stale = False  # this round's draft-ahead comes after a pause: its figures replace the old
        self.draft_ahead_fit = False  # the stream drafts ahead only what fits beside the verify (`best_draft_ahead`)
        self.idle = 0  # rounds the model sat out since it last drafted (judged a loss)
        self.model_on = True  # the model alone was last judged to pay (`ChainCost.extension`'s hysteresis)
        self.interval = cost.PROBE_FIRST

    def observed(self, round_: Observation) -> None:
        from_model = round_.drafted - round_.lead
        if from_model > 0:
            share = round_.drafted_ahead / from_model
            self.drafted_ahead_share = (1 - self.cost.EMA) * self.drafted_ahead_share + self.cost.EMA * share
        wait_s, verify_s = round_.wait_s, round_.verify_s
        if wait_s is not None and self._draft_ahead_s is not None:
            # Waited: the ahead thread ended `wait_s` after the verify, so it lagged wait + verify - its decodes.
            # Not waited: it ended before the verify did, which bounds the lag from above (a bound from one noisy
            # round moves the figure a step towards it, as a measurement does).
            ema = self.cost.EMA
            lag = max(0.0, (wait_s if wait_s > self.WAITED else 0.0) + verify_s - self._draft_ahead_s)
            old = None if self._draft_ahead_stale else self.draft_ahead_lag_s
            self._draft_ahead_round = self.cost.rounds
            if wait_s > self.WAITED:
                self.draft_ahead_lag_s = lag if old is None else (1 - ema) * old + ema * lag
            elif old is not None:
                self.draft_ahead_lag_s = (1 - ema) * old + ema * min(old, lag)
            elif self.draft_ahead_lag_s is not None:  # stale: the bound replaces a larger old figure
                self.draft_ahead_lag_s = min(self.draft_ahead_lag_s, lag)
        self._draft_ahead_s = None

    def observe_draft_ahead(self, seconds: float, decodes: int, could_keep: bool, kept: bool) -> None:
        """The draft-ahead beside this round's verify: `decodes` draft decodes in `seconds`; whether it could
        hold (the round accepted every draft) and whether it did (the guess was the target's token too).
        Told before the round's `observe`."""
        self.cost.changed()
        self.draft_aheads += 1
        # The stream's first draft-ahead is cold (the worker thread starts; on CUDA its first decodes may
        # capture a graph): its seconds are no step and no lag. Taken whole, one slow first draft-ahead made the model a
        # loss "even if every draft were accepted" and locked it out of the chain for good (docs/performance.md).
        cold = self.draft_aheads == 1
        # After a pause (the model sat out) the figures are old: the next measurement replaces them, as a step
        # after a pause does, rather than moving them 20% (a wrong figure kept the model out for many probes).
        last = self._draft_ahead_round
        self._draft_ahead_stale = last is None or self.cost.rounds - last > self.cost.DECAY
        self._draft_ahead_s = None if cold else seconds
        if decodes and not cold:
            # The least of the recent draft-aheads' figures (two at least), as the step is: one slow one (a call that
            # captured a graph, a busy moment) is no step, and taken whole it ruled the model out until a probe.
            if self._draft_ahead_stale:
                self._draft_ahead_steps.clear()
            self._draft_ahead_steps.append(seconds / decodes)
            self.draft_ahead_step_s = min(self._draft_ahead_steps) if len(self._draft_ahead_steps) > 1 else None
        if could_keep:
            self.guesses += 1.0
            self.guesses_right += kept
            if self.guesses >= 2 * self.cost.DECAY:  # the guess rate drifts with the text too
                self.guesses, self.guesses_right = self.guesses / 2, self.guesses_right / 2

    @property
    def guess_rate(self) -> float:
        """P(draft-ahead's guess of the target's own token is right | every draft was accepted)."""
        return (self.guesses_right + self.cost.PRIOR_WEIGHT * self.PRIOR) / (self.guesses + self.cost.PRIOR_WEIGHT)

    def draft_ahead_wait(self, decodes: np.ndarray | int, verify_s: np.ndarray | float) -> np.ndarray:
        """Expected seconds the loop waits after a verify of `verify_s` for a draft-ahead of `decodes` decodes
        (0 before the thread's lag was measured), elementwise: `_draft_ahead_wait`'s arithmetic on arrays (the
        vectorised questions ask it for a whole table at once)."""
        step, lag = self.draft_ahead_step_s or 0.0, self.draft_ahead_lag_s or 0.0
        return np.maximum(0.0, lag + np.asarray(decodes) * step - np.asarray(verify_s))

    def _draft_ahead_wait(self, decodes: int, verify_s: float) -> float:
        step, lag = self.draft_ahead_step_s or 0.0, self.draft_ahead_lag_s or 0.0
        return max(0.0, lag + decodes * step - verify_s)

    # The two questions below are asked every round with draft-ahead fitted to the verify, so they run on Python
    # floats (the same operations in the same order as the arrays they replaced: the same choices, bit for bit;
    # tests/test_ahead_cost.py checks them against the numpy formulas): numpy's per-call overhead on arrays this
    # small cost a measurable share of a round on a CPU (docs/lab/2026-12-01-host-share.md).

    def best_draft_ahead(self, k: int, verify_s: float | None = None) -> int:
        """How many of the next round's k drafts to make beside a verify (`draft_ahead_length = "fit"`): the j in
        0..k that minimises the wait for them plus the steps left to the round when the draft-ahead holds,
        wait(1 + j) + P(kept) x (k - j) x step (the longer on a tie); k until the costs are measured."""
        if k <= 0 or self.draft_ahead_step_s is None or self.draft_ahead_lag_s is None or self.cost.step_s is None:
            return k
        if verify_s is None:
            verify_s = self.cost.verify_cost(k + 1)
        kept, step = self.cost.tables().survival[self.SOURCE][k] * self.guess_rate, self.cost.step_s
        best, choice = float("inf"), k
        for j in range(k, -1, -1):  # (the longer on a tie)
            cost = self._draft_ahead_wait(1 + j, verify_s) + kept * (k - j) * step
            if cost < best:
                best, choice = cost, j
        return choice

    def best_continuation(self, ready: int, room: int, width: int = 0) -> int:
        """A draft-ahead that held has `ready` drafts of a round of ready + room: how many more to draft now, on the
        path (0..room), for the fastest round: E(ready + n) / (verify + n steps); all of them until a step is
        measured."""
        if room <= 0:
            return 0
        if self.cost.step_s is None or not self.cost.verify_s:
            return room
        return self._kept_round(ready, room, width)[0]

    def held_draft_ahead_speed(self, ready: int, room: int, width: int = 0) -> float | None:
        """Expected tokens per second of the round a draft-ahead that held drafted: its `ready` drafts (made beside the
        last verify: no draft steps on the path) and the best continuation of up to `room` more; None until a verify
        (and, with room, a step) was measured. The chain weighs it against lookup's round
        (`chain.ChainCost.prefer_draft_ahead`)."""
        if not self.cost.verify_s or (room > 0 and self.cost.step_s is None):
            return None
        return self._kept_round(ready, max(room, 0), width)[1]

    def _kept_round(self, ready: int, room: int, width: int) -> tuple[int, float]:
        """(n, speed): the n in 0..room more drafts that make a held draft-ahead's round fastest, E(ready + n) / (verify
        + n steps), the shorter on a tie; and that speed."""
        expected, step = self.cost.tables().cumulative[self.SOURCE], self.cost.step_s or 0.0
        best, choice = -float("inf"), 0
        for n in range(room + 1):  # (the shorter on a tie)
            speed = expected[ready + n] / (self.cost.verify_cost(max(width, ready + n + 1)) + n * step)
            if speed > best:
                best, choice = speed, n
        return choice, best

    def speeds(self, lead: int, room: int, width: int = 0) -> np.ndarray | None:
        """Expected tokens per second of a round of `lead` lead tokens (prompt lookup's) then n = 0..room model
        tokens, verified at `width` tokens (0: as wide as the drafts); None until the costs it needs were
        measured."""
        if not self.cost.verify_s or (room and self.cost.step_s is None):
            return None
        return self.cost.speeds(np.array([lead]), room, width, self)[0, : room + 1]

    def seconds(self, lead: np.ndarray, n: np.ndarray, verify: np.ndarray, perfect: bool) -> np.ndarray:
        """What n model tokens after `lead` lead tokens add to a round verified in `verify` seconds (`Stepped`):
        their steps (`perfect`: on the path; before any draft-ahead is measured, less the share drafted ahead),
        else draft-ahead's model's terms."""
        if perfect:
            return n * (self.cost.step_s or 0.0)
        if self.draft_ahead_step_s is None:  # no draft-ahead measured: its share of the steps, on average
            return n * (self.cost.step_s or 0.0) * (1 - self.drafted_ahead_share)
        return self._draft_ahead_terms(lead, n, verify)

    def _draft_ahead_terms(self, lead: np.ndarray, n: np.ndarray, verify: np.ndarray) -> np.ndarray:
        """Seconds a round of `n` model tokens adds to its verify when the model drafts ahead: the draft-ahead made
        beside the last verify is kept with P = S(n) x guess rate (only where nothing was looked up: the model alone
        drafts ahead), so its round drafts n - j tokens on the path (j: those the draft-ahead made; `draft_ahead_fit`
        fits j to the verify, else j = n) and n when it is thrown; plus the wait after the verify for the next
        draft-ahead's 1 + j decodes. n = 0 is a plain step: nothing beside it."""
        step = self.cost.step_s or 0.0
        kept = np.where(lead == 0, self.cost.tables().arrays()[0][self.SOURCE][n] * self.guess_rate, 0.0)
        n, verify = np.broadcast_arrays(n, verify)
        ahead = n.copy()
        if self.draft_ahead_fit:
            for (row, col), m in np.ndenumerate(n):
                ahead[row, col] = self.best_draft_ahead(int(m), float(verify[row, col]))
        wait = np.where(n > 0, self.draft_ahead_wait(1 + ahead, verify), 0.0)
        return step * (n - kept * ahead) + wait

    def speed(self, lead: int, n: int, width: int = 0) -> float | None:
        """`speeds` at one n."""
        speeds = self.speeds(lead, n, width)
        return None if speeds is None else float(speeds[n])

    def best_extension(self, lead: int, room: int, width: int = 0) -> int | None:
        """How many model tokens (0..room) after `lead` lead tokens make the fastest round (the shorter on a tie);
        None until the model's step and a verify were measured."""
        speeds = self.speeds(lead, room, width)
        return None if speeds is None else int(np.argmax(speeds))

    def could_pay(self, lead: int, room: int, width: int = 0) -> bool:
        """Whether some of the draft model's tokens after `lead` lead tokens would make a faster round than
        none if every one of them were accepted, at the measured step and verify costs (True until measured).
        Drafted on the path, without draft-ahead's terms: those are measured only while the model drafts, so a
        wrong figure there must not judge it hopeless (never probed out of sync, never re-measured)."""
        if not self.cost.verify_s or self.cost.step_s is None or room <= 0:
            return True
        speeds = self.cost.speeds(np.array([lead]), room, width, self, perfect=True)[0, : room + 1]
        return bool(speeds[1:].max() > speeds[0])

    def probe(self, room: int, lag: int = 1, in_sync_only: bool = False) -> int:
        """The model is judged a loss this round: 0 tokens, or PROBE when a probe is due (see the class). `lag`:
        the committed tokens the model's cells lack (1 when in sync: the next draft feeds cur), which a probe out of
        sync reads first (never, with `in_sync_only`)."""
        self.idle += 1
        if self.idle < self.interval:
            return 0
        if lag > 1:
            # Unmeasured, the first catch-up goes (it measures the price); then only while it stays affordable.
            if in_sync_only or not self._catch_up_affordable(lag):
                return 0
            self.cost.probe_lag = lag
        self.idle = 0
        self.interval = min(2 * self.interval, self.cost.PROBE_MAX)
        return min(room, self.PROBE)

    def _catch_up_affordable(self, lag: int) -> bool:
        """Whether reading `lag` tokens first (`catch_up_cost`) costs at most CATCH_UP_SHARE of the rounds the probe
        waited (each at least a one-token verify). On a CPU the draft model reads a token in a sizeable share of a
        target step and a round commits several, so catching up on many rounds costs several rounds' time
        (docs/lab/2026-12-01-drafters.md); on a GPU it reads hundreds of tokens in a few ms and probes go on."""
        cost = self.cost.catch_up_cost(lag)
        if cost is None or not self.cost.verify_s:
            return True  # (unmeasured: the first such probe measures it)
        return cost <= self.CATCH_UP_SHARE * self.idle * self.cost.tables().verify[1]

    def pays(self) -> None:
        """The model pays again: probing starts over from PROBE_FIRST when it next does not."""
        self.idle, self.interval, self.model_on = 0, self.cost.PROBE_FIRST, True

    # -- standing aside (`[draft] stand_aside`): k or nothing ---------------------------------------------------

    def stand_aside(self, k: int, policy: DraftLength, lag: int = 1) -> int:
        """How many of the round's k drafts to make with `stand_aside`: all k while a round of k is priced at least
        as fast as a plain step, none while it is priced slower (probed now and then: `probe`), so drafting never
        runs at a loss for long and, where it pays, drafts the preset's length (a length chosen by price instead,
        `adaptive`, can lose to the fixed one where the prices are a little off: docs/performance.md). The verdict
        and its reason are on `DraftCost.aside`.

        Steps: until a draft step and a verify are measured, draft k (on a CPU: PROBE tokens, as cheap a measure as
        a probe); on a CPU, one plain round next when a one-token verify was never measured (the plain price is a
        measurement, not the prior slope's guess; a plain round costs nothing over plain decoding); a round of k that
        would lose even if every draft were kept (`could_pay`: a draft step about a one-token verify, as on a CPU)
        stands aside at once and is probed at the longest interval, in sync only (`DraftCost.hopeless`: whole
        generations then decode plainly, `Stream`); otherwise the expected prices decide after WARMUP steady steps,
        with hysteresis: drafting that paid stops when a round of k is priced below a plain step, and comes back
        when priced MIN_GAIN above it."""
        if k <= 0:
            return k
        cost = self.cost
        width = k + 1 if policy.padded else 0
        speeds = self.speeds(0, k, width)
        if speeds is None:
            # Measured by drafting: on a CPU as cheaply as a probe (a loss there costs the whole length's steps);
            # on a GPU the length it verifies at (a padded verify costs its width either way).
            return k if policy.padded else min(k, self.PROBE)
        if cost.plain_unpriced(policy.padded):
            return 0  # one plain round prices plain decoding (a CPU: no width to keep warm)
        hopeless = not self.could_pay(0, k, width)
        if cost.step_rounds < policy.WARMUP and not hopeless:
            return k
        plain, drafting = float(speeds[0]), float(speeds[k])
        pays = not hopeless and drafting >= (plain if self.model_on else policy.MIN_GAIN * plain)
        if pays:
            self.pays()
            cost.aside, cost.hopeless = None, False
            return k
        self.model_on = False
        if k >= policy.k or cost.aside is None:  # (a round cut short by the reply's end keeps the full round's words)
            cost.aside = self._aside_reason(k, width, hopeless, drafting / plain if plain > 0 else 0.0)
            cost.hopeless = hopeless
        if hopeless:
            self.interval = cost.PROBE_MAX  # no acceptance a probe measures could turn it on; only a change of costs
        probe = self.probe(k, lag, in_sync_only=hopeless)
        return k if probe and not hopeless else probe

    def _aside_reason(self, k: int, width: int, hopeless: bool, ratio: float) -> str:
        """Why drafting stands aside, in one line, from the measured prices."""
        cost = self.cost
        step = (cost.step_s or 0.0) / cost.verify_cost(1)
        if hopeless:
            drafts = f"{k} drafts" if k > 1 else "a draft"
            return (f"a draft step costs {step:.2f} of a one-token verify, so {drafts} would lose even if every one "
                    f"were kept")
        kept = float(cost.tables().cumulative[self.SOURCE][k]) - 1.0
        return (f"at {kept:.1f} of {k} drafts kept a round (a draft step {step:.2f} of a one-token verify), drafting "
                f"would run {ratio:.2f}x plain decoding")

    # -- the loop's questions: its adaptive k (`Pricing`), a held draft-ahead's round, its length ------------------

    def best_length(self, room: int) -> int | None:
        return self.best_extension(0, room)

    def length_speed(self, n: int) -> float | None:
        return self.speed(0, n)

    def continuation(self, ready: int, k: int, padded: bool) -> int:
        """A draft-ahead that held has `ready` of the round's k drafts: how many more the round drafts on the path."""
        return self.best_continuation(ready, k - ready, k + 1 if padded else 0)

    def draft_ahead_length(self, k: int) -> int:
        """How many of the next round's k drafts to make beside this verify: all of them, or with `draft_ahead_length =
        "fit"` what the cost model says fits (`best_draft_ahead`; the drafter also stops when the verify ends)."""
        return self.best_draft_ahead(k) if self.draft_ahead_fit else k


def unavailable(target: ScoringModel, draft: ScoringModel | None) -> str | None:
    """Why these models have no model drafter (one clause), None when they have one."""
    if draft is None:
        return "no draft model is loaded"
    if getattr(draft, "arch", None) in BLOCK_DRAFTER_ARCHS:
        # (its context reads the target's features, not tokens alone: stepping it token by token drafts nonsense)
        return f"{draft.path.name} is a block drafter (general.architecture dflash): --drafter dflash or dspark"  # type: ignore[attr-defined]
    if getattr(draft, "arch", None) == EAGLE3_ARCH:
        return f"{draft.path.name} is an EAGLE-3 drafter (general.architecture eagle3): --drafter eagle3"  # type: ignore[attr-defined]
    return None


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter | None:
    """The registry's factory: there is a model drafter only with a draft model that steps token by token."""
    return None if draft is None or unavailable(target, draft) else ModelDrafter(draft, target.n_vocab)
