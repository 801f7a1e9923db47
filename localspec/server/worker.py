"""The one engine thread: a bounded FIFO of jobs feeding the engine's slots, each job streamed back as it is
generated.

Continuous batching: between rounds, waiting jobs take free slots (a returning conversation the slot that holds its
prefix); every round then advances all running jobs at once (`Engine.step`: one draft decode per draft step, one
target decode for every verify), and a job that finishes or is cancelled leaves its slot free for the next round.
With one slot (`--parallel 1`) this is a FIFO that runs one job at a time.

Interface: `submit(job)` queues a Job or raises the 503 `ApiError` that says why not (the queue is full, or the
server is shutting down); the job's `sink` receives `Delta`s and then exactly one `Finished` or `Failed`, called
from the worker thread; `cancel(job)` takes a queued job out or stops a running one at the engine's next check
(between rounds, or after the token being emitted), which keeps the engine's KV bookkeeping consistent;
`shutdown()` cancels everything. A job's output does not depend on the others.

Stop strings are matched here, on the worker thread, so the engine is stopped the moment one completes instead of
whenever the event loop next looks.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from localspec.config import ContextSettings, Drafting, Sampling
from localspec.errors import LocalspecError
from localspec.llama.grammar import Grammar
from localspec.rounds.engine import Engine, Stream
from localspec.rounds.events import STOP_CONTEXT_FULL, STOP_MAX_TOKENS, DoneEvent, GenerationStats, TokenEvent
from localspec.server.errors import ApiError, shutting_down
from localspec.server.stops import StopMatcher
from localspec.server.structured import TokenLogprob

log = logging.getLogger("localspec.server")

FINISH_STOP = "stop"  # end of turn or a stop string (OpenAI's finish_reason)
FINISH_LENGTH = "length"  # max_tokens or a full context
FINISH_CANCELLED = "cancelled"  # the client left or the server is shutting down (never sent to a client)
# Seconds a closing server or an unloading pair waits for the engine thread to end (a cancelled job stops at the
# engine's next check, after the decode under way) before it gives up on freeing the models.
STOP_JOIN_S = 30.0


@dataclass(frozen=True, slots=True)
class Delta:
    text: str  # safe to send: nothing at or past a stop string
    logprobs: tuple[TokenLogprob, ...] = ()  # with logprobs on: the tokens whose text starts in what is sent so far
    timings: dict[str, float | int] | None = None  # the job's so far, when it asked (`timings_per_token`)


@dataclass(frozen=True)
class JobResult:
    """What one job returned. `stats` are the engine's, counted over the tokens whose text reached the client: a
    stop string can end inside an accepted draft run, and the tokens after it are neither returned nor counted."""

    text: str
    finish_reason: str  # FINISH_STOP, FINISH_LENGTH or FINISH_CANCELLED
    stop_string: str | None
    stats: GenerationStats
    engine_tokens: int  # tokens the engine generated (>= stats.tokens: a stop string ends inside a token)
    logprobs: list[TokenLogprob] | None = None  # one per returned token, with logprobs on
    slot: int = -1  # the slot it ran in
    aside: str | None = None  # why drafting stood aside at its end (`DoneEvent.aside`), None: it drafted

    @property
    def prompt_n(self) -> int:
        return prompt_n(self.stats)

    def timings(self) -> dict[str, float | int]:
        return timings(self.stats)


def prompt_n(stats: GenerationStats) -> int:
    """llama.cpp's meaning: prompt tokens evaluated. The engine prefills all but the last prompt token and
    decodes that one in the first verify batch, so even a fully cached prompt costs 1."""
    return stats.prompt_tokens_processed + 1


def timings(s: GenerationStats) -> dict[str, float | int]:
    """llama.cpp server's `timings` (so UIs that read them work), plus localspec's acceptance figures."""
    n = prompt_n(s)
    return {
        "cache_n": s.prompt_tokens - n,
        "prompt_n": n,
        "prompt_ms": round(s.prefill_s * 1000, 3),
        "prompt_per_token_ms": round(s.prefill_s * 1000 / n, 3),
        "prompt_per_second": round(n / s.prefill_s, 3) if s.prefill_s > 0 else 0.0,
        "predicted_n": s.tokens,
        "predicted_ms": round(s.decode_s * 1000, 3),
        # Every predicted token costs decode time here (llama-server's first token comes with the prompt's last
        # batch; here the first verify round makes it), so per token is the whole time over the tokens.
        "predicted_per_token_ms": round(s.decode_s * 1000 / s.tokens, 3) if s.tokens else 0.0,
        "predicted_per_second": round(s.decode_tps, 3),
        "draft_n": s.drafted,
        "draft_n_accepted": s.accepted,
        "acceptance_rate": round(s.acceptance_rate, 4),
        "mean_accepted": round(s.mean_accepted, 4),
        # rounds that drafted nothing because drafting was priced below plain decoding (`[draft] stand_aside`), of
        # the request's `rounds` (verify steps; plain decoding's: one per token)
        "draft_stood_aside": s.stood_aside,
        "rounds": s.rounds,
    }


@dataclass(frozen=True, slots=True)
class Finished:
    result: JobResult


@dataclass(frozen=True, slots=True)
class Failed:
    """A job that ended without a reply: what its client is answered (a 400 where the prompt cannot run, a 503 at
    shutdown, a 500 where generation failed; handling.py adds the 499 of a client that left)."""

    error: ApiError


Item = Delta | Finished | Failed


@dataclass(eq=False)
class Job:
    prompt: list[int]
    sampling: Sampling
    drafting: Drafting
    max_tokens: int
    stops: tuple[str, ...]
    sink: Callable[[Item], None]  # called on the worker thread (or the cancelling thread for a queued job)
    grammar: Grammar | None = None  # the request's constraint (the engine stream owns it once started)
    logprobs: int | None = None  # None: off; N: each token's logprob and N alternatives
    slot: int | None = None  # the slot it must run in (llama-server's `id_slot`); None: the best free one
    timings_per_token: bool = False  # each Delta carries the timings so far
    context: ContextSettings | None = None  # context shift (None: the generation stops at a full context)
    task_id: int = -1  # numbered by `submit` (llama-server's `id_task`)
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class WorkerStats:
    """Counters for the status line and /health (read from other threads; ints are updated atomically)."""

    served: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0  # queue full
    running: int = 0  # jobs in slots now
    busy: bool = False  # any job running
    last: JobResult | None = None
    mean_job_s: float = 0.0  # smoothed wall time of a job, for Retry-After
    totals: GenerationStats = field(default_factory=GenerationStats)  # every served job's, for /metrics
    prompt_n: int = 0  # prompt tokens evaluated, summed as each reply's timings count them (`prompt_n`)
    cache_n: int = 0  # ... and reused from the cache (`cache_n`)
    max_sequence: int = 0  # the longest prompt + reply served (llama-server's n_tokens_max)
    draft_rounds: int = 0  # rounds that verified a draft (llama-server's spec_decode_num_drafts_total)
    busy_slot_decodes: int = 0  # over the target's decodes in rounds: the slots busy in each, summed


@dataclass(frozen=True)
class SlotView:
    """One slot as /slots shows it: the job in it now, else the last one it served."""

    slot: int
    busy: bool
    task_id: int  # -1: it has served nothing yet
    n_tokens: int  # tokens in its context (prompt and reply)
    stats: GenerationStats | None  # the job's so far (running) or in the end (served)
    job: Job | None


class _Running:
    """A job in a slot: its engine stream and what it has sent so far (stop strings are matched here)."""

    def __init__(self, job: Job, slot: int) -> None:
        self.job = job
        self.slot = slot
        self.matcher = StopMatcher(job.stops)
        self.starts: list[int] = []  # each token's offset in the generated text
        self.from_draft: list[bool] = []
        self.released: list[str] = []
        self.released_chars = 0
        self.logprobs: list[TokenLogprob] = []
        self.logprobs_sent = 0
        self.produced = 0
        self.stream: Stream | None = None
        self.t0 = time.perf_counter()

    def should_stop(self) -> bool:
        return self.job.cancelled or self.matcher.matched is not None

    def take(self, event: TokenEvent, piece: Callable[[int], bytes]) -> None:
        self.starts.append(self.produced)
        self.from_draft.append(event.from_draft)
        self.produced += len(event.text)
        if event.logprob is not None:
            self.logprobs.append(_logprob_entry(event, piece))
        safe = self.matcher.feed(event.text)
        if safe:
            self._release(safe)

    def _timings_so_far(self) -> dict[str, float | int] | None:
        if not self.job.timings_per_token or self.stream is None:
            return None
        elapsed = time.perf_counter() - self.stream.t_start
        return timings(dataclasses.replace(self.stream.stats, decode_s=elapsed, draft_lengths=[]))

    def _release(self, text: str, everything: bool = False) -> None:
        """Send text, with the logprobs of the tokens whose text starts in what has been sent (all: at the end)."""
        self.released.append(text)
        self.released_chars += len(text)
        # (starts ascend: bisect counts those before the released end without a pass over the reply each token)
        n = len(self.logprobs) if everything else bisect.bisect_left(self.starts, self.released_chars)
        n = min(n, len(self.logprobs))
        entries, self.logprobs_sent = tuple(self.logprobs[self.logprobs_sent : n]), max(n, self.logprobs_sent)
        _deliver(self.job, Delta(text, entries, self._timings_so_far()))

    def finish(self, done: DoneEvent) -> Finished:
        if self.matcher.matched is None:
            tail = self.matcher.flush()
            if tail or self.logprobs_sent < len(self.logprobs):
                self._release(tail, everything=True)
        result = _result(self.job, "".join(self.released), self.matcher, done, self.starts, self.from_draft,
                         self.slot)
        if self.job.logprobs is not None:
            result = dataclasses.replace(result, logprobs=self.logprobs[: result.stats.tokens])
        return Finished(result)


class Worker:
    def __init__(self, engine: Engine, queue_size: int) -> None:
        self.engine = engine
        self.queue_size = queue_size
        self.slots = len(engine.slots)
        self.stats = WorkerStats()
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._running: list[_Running] = []
        self._task_ids = itertools.count()
        self._last: dict[int, tuple[Job, GenerationStats]] = {}  # each slot's last job, for /slots
        # Work on one slot's cells (save, restore, erase: `in_slot`), run on this thread when that slot is idle.
        self._actions: collections.deque[tuple[int, Callable[[], Any], concurrent.futures.Future]] = \
            collections.deque()
        self._thread = threading.Thread(target=self._run, name="localspec-engine", daemon=True)
        self._decodes_at_start = engine.target.decodes  # (loading may have decoded: not the server's work)

    @property
    def decodes(self) -> int:
        """The target's llama_decode calls since the server started (llama-server's n_decode_total: the draft
        model's are not counted)."""
        return self.engine.target.decodes - self._decodes_at_start

    # -- the interface ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._pending)

    def submit(self, job: Job) -> None:
        self.submit_all([job])

    def submit_all(self, jobs: list[Job]) -> None:
        """Queue all of `jobs` (one request's choices) or none of them."""
        with self._cond:
            if self._closed:
                raise shutting_down()
            # `queue_size` jobs may wait for a slot; those that free slots can take at once are not waiting.
            capacity = self.queue_size + self.slots - len(self._running)
            if len(self._pending) + len(jobs) > capacity:
                self.stats.rejected += 1
                raise ApiError(503, f"the server is busy ({len(self._pending)} requests are already waiting); retry "
                               "later", kind="server_error", code="queue_full",
                               headers={"Retry-After": str(self.retry_after_s())})
            for job in jobs:
                job.task_id = next(self._task_ids)
                self._pending.append(job)
            self._cond.notify()

    def in_slot(self, slot: int, action: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `action` on the engine thread as soon as slot `slot` is idle, before any waiting job can take it
        (llama-server defers a slot action on a busy slot the same way); its result or exception in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise shutting_down()
            self._actions.append((slot, action, future))
            self._cond.notify()
        return future

    def cancel(self, job: Job) -> None:
        """Stop `job`: dropped if still queued (its sink hears nothing more), else stopped at the next check."""
        job._cancelled.set()
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)
                self.stats.cancelled += 1

    def retry_after_s(self) -> int:
        """A guess at when a queue place frees up (a running job ends), for the Retry-After header."""
        return int(min(60, max(1, math.ceil(self.stats.mean_job_s / self.slots))))

    def slot_views(self) -> list[SlotView]:
        """What each slot holds now (read from the event loop: a consistent enough snapshot for monitoring)."""
        with self._cond:
            running = {r.slot: r for r in self._running if r.stream is not None}
            last = dict(self._last)
        views = []
        for slot in self.engine.slots:
            r = running.get(slot.seq)
            job, stats = (r.job, r.stream.stats) if r is not None and r.stream is not None else \
                last.get(slot.seq, (None, None))
            views.append(SlotView(slot=slot.seq, busy=r is not None, task_id=job.task_id if job else -1,
                                  n_tokens=len(slot.tokens), stats=stats, job=job))
        return views

    def shutdown(self, timeout: float | None = None) -> bool:
        """Cancel the running jobs, fail the queued ones, and end the thread (waits up to `timeout`). Whether the
        thread has ended (never started counts as ended)."""
        with self._cond:
            self._closed = True
            pending, self._pending = list(self._pending), collections.deque()
            running = list(self._running)
            actions, self._actions = list(self._actions), collections.deque()
            self._cond.notify_all()
        for _, _, future in actions:
            future.set_exception(shutting_down())
        for r in running:
            r.job._cancelled.set()
        for job in pending:
            job._cancelled.set()
            _deliver(job, Failed(shutting_down()))
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop_then_free(self, free: Callable[[], None], what: str) -> bool:
        """Stop the engine thread (`shutdown`, up to STOP_JOIN_S), then `free` the models it decodes with. A thread
        still running then (a decode that does not return) may be inside llama.cpp: freeing its context under it
        would crash the process, so the models are left (leaked) and one warning says so. Whether they were
        freed."""
        if not self.shutdown(timeout=STOP_JOIN_S):
            log.warning("%s: the engine thread did not end within %g s; its models are left loaded (not freed under "
                        "a running decode)", what, STOP_JOIN_S)
            return False
        free()
        return True

    # -- the thread -------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._running and not self._actions and not self._closed:
                    self._cond.wait()
                if self._closed and not self._running:
                    return
                due = self._due_actions()
            for _, action, future in due:
                self._act(action, future)
            with self._cond:
                joining = self._admit()
            for r in joining:
                self._start(r)
            if self._running:
                self._round()

    def _due_actions(self) -> list[tuple[int, Callable[[], Any], concurrent.futures.Future]]:
        """The slot actions whose slot is idle now, taken from the queue (called holding the lock)."""
        busy = {r.slot for r in self._running}
        due = [a for a in self._actions if a[0] not in busy]
        for a in due:
            self._actions.remove(a)
        return due

    def _act(self, action: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(action())
        except Exception as exc:  # told to the caller (a bad file is a 400 there); the slot itself is consistent
            future.set_exception(exc)

    def _admit(self) -> list[_Running]:
        """Waiting jobs into free slots, in order (called holding the lock). A job pinned to a busy slot waits
        for it while the jobs behind it go ahead."""
        joining: list[_Running] = []
        taken: set[int] = set()
        for job in list(self._pending):
            if len(self._running) >= self.slots:
                break
            if job.cancelled:  # cancelled between the queue and here
                self._pending.remove(job)
                self.stats.cancelled += 1
                continue
            slot = self.engine.free_slot(job.prompt, exclude=taken) if job.slot is None else job.slot
            if slot is None or slot in taken or self.engine.slots[slot].busy:
                continue
            self._pending.remove(job)
            r = _Running(job, slot)
            taken.add(slot)
            self._running.append(r)
            joining.append(r)
        self._count_running()
        return joining

    def _count_running(self) -> None:
        """The stats' view of the running jobs (called holding the lock)."""
        self.stats.running = len(self._running)
        self.stats.busy = bool(self._running)

    def _start(self, r: _Running) -> None:
        """Start a joining job in the slot `_admit` chose for it."""
        job, slot = r.job, r.slot
        try:
            # The prompt goes in one batch a round: the requests already running do not stall behind it.
            r.stream = self.engine.start(job.prompt, job.sampling, job.drafting, job.max_tokens, r.should_stop,
                                         slot=slot, prefill_in_rounds=True, grammar=job.grammar,
                                         logprobs=job.logprobs, context=job.context)
        except LocalspecError as exc:  # e.g. the prompt does not fit the context
            self._end(r, Failed(ApiError(400, str(exc), code="invalid_value")))
        except Exception as exc:
            self._fail_all(exc)

    def _round(self) -> None:
        """One engine round for every running job, then each job's tokens to its client."""
        running = [r for r in self._running if r.stream is not None]
        before = self.engine.target.decodes
        try:
            self.engine.step([r.stream for r in running])
            self.stats.busy_slot_decodes += (self.engine.target.decodes - before) * len(running)
            for r in running:
                for event in r.stream.events():
                    if isinstance(event, TokenEvent):
                        r.take(event, self.engine.target.piece)
                    else:
                        self._end(r, r.finish(event))
        except Exception as exc:
            self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        """A decode that raised may have left KV cells the bookkeeping does not know: every running job fails
        and the engine starts clean."""
        self.engine.reset()
        if os.environ.get("LOCALSPEC_DEBUG", "") not in ("", "0"):
            log.exception("generation failed")
        else:
            log.error("generation failed: %s: %s", type(exc).__name__, exc)
        for r in list(self._running):
            self._end(r, Failed(ApiError(500, f"generation failed: {type(exc).__name__}", kind="server_error",
                                         code="internal_error")))

    def _end(self, r: _Running, final: Finished | Failed) -> None:
        """Counters first, then the final item: a client that has its reply sees them updated."""
        elapsed = time.perf_counter() - r.t0
        self.stats.mean_job_s = elapsed if not self.stats.mean_job_s else 0.8 * self.stats.mean_job_s + 0.2 * elapsed
        if isinstance(final, Failed):
            self.stats.failed += 1
        elif final.result.finish_reason == FINISH_CANCELLED:
            self.stats.cancelled += 1
        else:
            self.stats.served += 1
            self.stats.last = final.result
            # Without the per-round draft lengths: a server's lifetime of rounds would only grow.
            self.stats.totals = self.stats.totals + dataclasses.replace(final.result.stats, draft_lengths=[])
            self.stats.prompt_n += final.result.prompt_n
            self.stats.cache_n += final.result.stats.prompt_tokens - final.result.prompt_n
            self.stats.draft_rounds += sum(1 for n in final.result.stats.draft_lengths if n)
            self.stats.max_sequence = max(self.stats.max_sequence,
                                          final.result.stats.prompt_tokens + final.result.engine_tokens)
        with self._cond:
            self._running.remove(r)
            if r.stream is not None:
                self._last[r.slot] = (r.job, final.result.stats if isinstance(final, Finished) else r.stream.stats)
            self._count_running()
        _deliver(r.job, final)


def _result(job: Job, text: str, matcher: StopMatcher, done: DoneEvent, starts: list[int],
            from_draft: list[bool], slot: int) -> JobResult:
    """Count what reached the client. A token is returned when its text starts before the cut (the stop
    string's start); a round counts when it returned a token, with all it drafted (the work was done)."""
    if matcher.matched is not None:
        returned = sum(1 for s in starts if s < matcher.released)
        finish = FINISH_STOP
    else:
        returned = len(starts)
        if job.cancelled:
            finish = FINISH_CANCELLED
        elif done.stop_reason in (STOP_MAX_TOKENS, STOP_CONTEXT_FULL):
            finish = FINISH_LENGTH
        else:
            finish = FINISH_STOP
    # Each round emits its accepted draft tokens, then one token of the target's own (from_draft False).
    rounds = 1 + sum(1 for f in from_draft[: returned - 1] if not f) if returned else 0
    stats = dataclasses.replace(done.stats, tokens=returned, rounds=rounds,
                                drafted=sum(done.stats.draft_lengths[:rounds]),
                                accepted=sum(from_draft[:returned]),
                                draft_lengths=done.stats.draft_lengths[:rounds])
    return JobResult(text=text, finish_reason=finish, stop_string=matcher.matched, stats=stats,
                     engine_tokens=done.stats.tokens, slot=slot, aside=done.aside)


def _logprob_entry(event: TokenEvent, piece: Callable[[int], bytes]) -> TokenLogprob:
    def text(token: int) -> tuple[str, bytes]:
        raw = piece(token)
        return raw.decode("utf-8", errors="replace"), raw

    assert event.logprob is not None
    top = tuple((*text(t), lp) for t, lp in event.top_logprobs or ())
    return TokenLogprob(*text(event.token), event.logprob, top)


def _deliver(job: Job, item: Item) -> None:
    try:
        job.sink(item)
    except Exception as exc:  # the consumer is gone (event loop closed): nothing to tell
        log.debug("dropped %s for a departed client: %s", type(item).__name__, exc)
