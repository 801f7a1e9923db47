"""The draft model: a second, smaller GGUF of the same tokenizer drafts token by token, with draft-ahead.

Each draft step is one batched draft decode across the requests still drafting. Greedy drafts take the draft's
argmax; at T > 0 it samples from its own pipeline q (the same `Sampling` as the target's p) with a random stream of
its own. An unsure draft (top probability below p_min) stops the request's drafting for the round.

Draft-ahead (a draft on a device of its own, or both models on GPUs: `placement.draft_ahead`): while the target
verifies a round, a worker thread drafts the next one, betting that every draft is accepted and that the target's
own next token is the draft's argmax there. The bet is kept only when it came true and the next round asks for the
same length; otherwise it is thrown away and the round drafts as usual. The draft samples from a random stream of
its own that a thrown bet rewinds, so the output is the sequential loop's, token for token (given that the draft
scores a token alone as it scores it in a batch, which localspec's losslessness already rests on).

With `ahead_length = "fit"` the bet drafts only as many tokens as the cost model says fit beside the verify
(`DraftLength.ahead_length`), and stops after the decode in flight when the verify ends: the loop need not wait for
drafts it could make faster alone. A kept bet that holds fewer than k drafts goes on where it stopped, on the path
(the same random stream, the same tokens the sequential loop would draft), for as many more as the cost model says
pay (`DraftLength.continuation`); what is verified is still a proposal with its q, so exactness is unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from localspec.constraints import masked_scores
from localspec.drafters.base import NO_PROPOSAL, Drafter, DraftRequest, PromptWork, Proposal, device_mode, prompt_work
from localspec.sampling import Candidates, distributions, greedy_tokens, penalized
from localspec.scores import ScoringModel


@dataclass(frozen=True, slots=True)
class _Ahead:
    """The next round's drafts, made while this round's verify ran, and what keeping or throwing them needs."""

    guess: int  # the target's next token, as the draft bet it (its argmax after the last draft)
    k: int  # the draft length they were made for
    drafts: list[int]
    q: list[Candidates] | None
    rng_state: dict  # the draft's random stream before them: a thrown bet gives its draws back
    seconds: float  # spent in the draft's decodes, beside the verify
    decodes: int  # ... in this many decodes (the guess's and the drafts')
    complete: bool  # its drafting ended on its own (k drafts, an unsure one, ...), not cut short to fit the verify


class Bet(NamedTuple):
    """A kept drafted-ahead round, as another drafter weighing it sees it (`ModelDrafter.bet`)."""

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
    least_s: float | None = None  # the least of the later steps (`Proposal.least_s`)
    decodes: int = 0
    limit: int | None = None  # draft at most this many (a bet fitted to the verify), else k
    cut: bool = False  # stopped by `limit` or the verify's end with more to draft


class ModelDrafter:
    def __init__(self, draft: ScoringModel, target_vocab: int) -> None:
        self.model = draft
        self.models = (draft,)
        self._target_vocab = target_vocab
        self._unknown = draft.unknown_token
        self._kv: dict[int, list[int]] = {}  # per sequence: the tokens the draft's cells hold (a prefix of it)
        self._rng: dict[int, np.random.Generator] = {}  # per sequence: the draft's random stream
        self._kept: dict[int, _Ahead] = {}  # per sequence: a drafted-ahead round whose bet came true
        self._pending: dict[int, Future[_Ahead | None]] = {}  # per sequence: the draft-ahead beside the verify
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
        return [prompt_work(self.model, self._kv.setdefault(seq, []), prompt[:-1], seq)]

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]],
              after: Sequence[list[int]] | None = None) -> list[Proposal]:
        """Up to k tokens per job; with `after`, continuing those tokens (another drafter's) past the committed
        ones. A request alone here uses its drafted-ahead round when the bet came true and k is what it was
        drafted for."""
        out: list[Proposal] = [NO_PROPOSAL] * len(jobs)
        todo: list[tuple[int, _Job]] = []
        for i, (req, k) in enumerate(jobs):
            kept = self._kept.pop(req.seq, None)
            if kept is not None and len(jobs) == 1 and kept.k == k and not (after and after[i]):
                req.stats.ahead_kept += 1
                out[i] = self._go_on(req, kept)
                continue
            if kept is not None:
                self._throw(req, kept)
            if k > 0:
                todo.append((i, _Job(req, k, req.tokens + after[i] if after else req.tokens)))
        self._draft([job for _, job in todo])
        for i, job in todo:
            out[i] = Proposal(job.tokens, job.q, job.seconds, first_s=job.first_s, least_s=job.least_s)
        return out

    @contextlib.contextmanager
    def overlap(self, req: DraftRequest, proposal: Proposal, k_next: int) -> Iterator[None]:
        """Draft ahead in the worker thread for as long as the block (the verify) runs. llama.cpp releases the GIL
        inside each decode, so the two models compute at once. Whatever happens in the block, the draft model is
        idle again when it ends. With `ahead_length = "fit"` it drafts what the cost model says fits and stops
        after the decode in flight when the block ends."""
        if not (proposal.tokens and k_next > 0):
            yield
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localspec-draft-ahead")
        verified = threading.Event() if req.drafting.ahead_length == "fit" else None
        job = self._pending[req.seq] = self._worker.submit(self._draft_ahead, req, list(proposal.tokens), k_next,
                                                           verified)
        try:
            yield
        finally:
            if verified is not None:
                verified.set()
            with contextlib.suppress(Exception):  # its own error, if any, is raised by accept
                job.result()

    def accept(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        """Keep the drafted-ahead round if its bet came true (else give its random draws back); drop the draft's
        cells past the committed tokens but the newest (which the next draft feeds), unless a kept bet holds them."""
        seq = req.seq
        job = self._pending.pop(seq, None)
        ahead = job.result() if job is not None else None
        if ahead is not None:
            req.stats.ahead_made += 1
            req.stats.ahead_s += ahead.seconds
            could_keep = accepted == len(proposal.tokens)
            keep = could_keep and req.tokens[-1] == ahead.guess
            if req.length is not None:
                req.length.observe_ahead(ahead.seconds, ahead.decodes, could_keep, keep)
            if keep:
                self._kept[seq] = ahead
                return
            self._rng[seq].bit_generator.state = ahead.rng_state  # its cells go with the rejected ones, below
        self._cut(seq, len(req.tokens) - 1)

    def bet(self, req: DraftRequest) -> Bet | None:
        """The drafted-ahead round kept for this request (its bet came true), None when there is none: a round that
        asks for exactly its k tokens, after no other drafter's, uses it."""
        kept = self._kept.get(req.seq)
        if kept is None:
            return None
        return Bet(kept.k, len(kept.drafts), 0 if kept.complete else kept.k - len(kept.drafts))

    def lag(self, req: DraftRequest) -> int:
        """How many committed tokens the draft's cells lack (1 when current: cur is fed by the next draft)."""
        return len(req.tokens) - len(self._kv.get(req.seq, ()))

    def cells(self, seq: int) -> list[tuple[ScoringModel, list[int]]]:
        return [(self.model, self._kv.setdefault(seq, []))]

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

    def _go_on(self, req: DraftRequest, kept: _Ahead) -> Proposal:
        """The round a kept bet drafted: as it is, or (cut short to fit the verify) with as many more drafts as
        pay, drafted now where the bet stopped."""
        more = 0
        if not kept.complete:
            ready = len(kept.drafts)
            more = req.length.continuation(ready, kept.k) if req.length is not None else kept.k - ready
        if more <= 0:
            return Proposal(kept.drafts, kept.q, 0.0, ahead=len(kept.drafts))
        job = _Job(req, more, req.tokens + kept.drafts)
        self._draft([job])
        q = None if job.q is None else [*(kept.q or []), *job.q]
        return Proposal(kept.drafts + job.tokens, q, job.seconds, first_s=job.first_s, least_s=job.least_s,
                        ahead=len(kept.drafts))

    def _draft(self, jobs: list[_Job], until: threading.Event | None = None, checkpoint: bool = True) -> None:
        """Draft each job's tokens: one batched draft decode per step across the jobs still drafting (with `until`,
        no step starts after it is set). A recurrent draft model is checkpointed after the first step (the
        committed tokens: every later rewind goes back at least that far, and its one-token steps cannot be rolled
        back otherwise); a bet drafted ahead is not (`checkpoint`: its cells may be thrown away whole)."""
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

    def _draft_ahead(self, req: DraftRequest, drafts: list[int], k: int,
                     verified: threading.Event | None) -> _Ahead | None:
        """Assume every draft is accepted: guess the target's next token (the draft's argmax: no random draw, so
        the draws that follow are the next round's own), then draft the next round behind it: its k tokens, or
        with `verified` (fitted bets) as many as the cost model says fit, none started after it is set."""
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
        limit = req.length.ahead_length(k) if verified is not None and req.length is not None else k
        job = _Job(req, k, [*sequence, guess], limit=limit)
        if limit > 0:
            self._draft([job], verified, checkpoint=False)
        else:
            job.cut, job.q = True, None if req.sampling.greedy else []
        return _Ahead(guess, k, job.tokens, job.q, state, time.perf_counter() - t, 1 + job.decodes, not job.cut)

    def _throw(self, req: DraftRequest, kept: _Ahead) -> None:
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


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter | None:
    """The registry's factory: there is a model drafter only with a draft model."""
    return None if draft is None else ModelDrafter(draft, target.n_vocab)
