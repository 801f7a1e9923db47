"""The speculative loop. It yields events and never prints.

One generation: `_prefill` the prompt into its slot's KV cells in both models (reusing whatever prefix they already
hold), then rounds of `_draft` (up to k tokens, one draft decode each), `_verify` (one batched target decode with
logits at every drafted position), `_accept` (greedy match or rejection sampling), and `_rewind` (the one place KV
cells of rejected tokens are removed from both caches). k = 0 is plain decoding through the same code, so
baselines are apples to apples. On a GPU the verify batch keeps one width per generation (short drafts padded) so
llama.cpp's CUDA graphs stay captured, and plain decoding at T > 0 draws its tokens on the device (docs/gpu.md).

Slots: the models may hold several sequences (`LlamaModel(n_seq=N)`, one KV region each). `start` opens a
`Stream` in a slot; `step(streams)` runs one round for all of them at once (each draft step one draft decode
across the streams, one target decode verifying all), and each stream's `events()` yields what its round emitted.
Every stream keeps its own settings, random streams and stats, and a slot's numbers do not depend on what the
others hold (on the CPU, bit for bit: tests/test_slots.py), so a request's output is what it would be alone.
`generate` is the one-stream case of the same code. The server starts streams with `prefill_in_rounds`: their
prompts go in one batch per round, beside the others' rounds. With several streams, `_LoadPolicy` shortens the drafts
(down to k = 0, plain batched decoding) at batch sizes where that measures faster.

Draft-ahead (`Engine(draft_ahead=True)`, for a draft on a device of its own): while the target verifies a round,
a worker thread drafts the next one, betting that every draft is accepted and that the target's own next token
is the draft's argmax there. The bet is kept only when it came true and the next round asks for the same length;
otherwise it is thrown away and the round drafts as usual (as it does when other streams share the round). The
draft samples from a random stream of its own that a thrown bet rewinds, so the output is the sequential loop's,
token for token (given that the draft scores a token alone as it scores it in a batch, which localspec's
losslessness already rests on).
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from localspec.config import Drafting, Sampling
from localspec.constraints import masked_row
from localspec.errors import ContextFullError, UsageError
from localspec.llama_ctx import DeviceDist, Grammar, LlamaModel, Sampled, TopK
from localspec.sampling import (
    Candidates,
    accept_or_resample,
    apply_penalties,
    candidates,
    candidates_from_top_k,
    token_logprobs,
)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token: int
    text: str  # the UTF-8 text this token completes (may be "" mid-character)
    from_draft: bool  # True when the token is an accepted draft token
    # With generate(trace=True) at temperature 0: the argmax of the target row this token was chosen from (read
    # from the row itself, apart from the acceptance logic) and that row's top-1 minus top-2 logit.
    row_argmax: int | None = None
    margin: float | None = None
    # With start(logprobs=N): the token's log-probability under the target's full distribution at temperature 1,
    # and the N most likely tokens with theirs (OpenAI's logprobs; sampling.token_logprobs).
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass
class GenerationStats:
    """The one home of a generation's numbers; every report (bench, chat, generate, the server) reads these.

    Counts and seconds add up (`+`, `total`), so totals over prompts, runs or chat turns are built the same way and
    the rates below are always derived from summed counts, never averaged.
    """

    prompt_tokens: int = 0
    prompt_tokens_processed: int = 0  # the part of the prompt not already in the KV caches
    prefill_s: float = 0.0
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0  # inside llama_decode of the draft (including logits sync)
    verify_s: float = 0.0  # inside llama_decode of the target
    decode_s: float = 0.0  # wall time of all rounds
    ahead_made: int = 0  # draft-ahead: rounds drafted while the previous round's verify ran, betting on it
    ahead_kept: int = 0  # ... and the bets that came true: rounds whose drafts cost no time on the critical path
    ahead_s: float = 0.0  # draft decodes made ahead, beside a verify (not in draft_s: off the critical path)
    draft_lengths: list[int] = field(default_factory=list)

    def __add__(self, other: GenerationStats) -> GenerationStats:
        return GenerationStats(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                                  for f in dataclasses.fields(self)})

    @classmethod
    def total(cls, many: Iterable[GenerationStats]) -> GenerationStats:
        return sum(many, cls())

    @property
    def host_s(self) -> float:
        """Everything in the rounds that is not a llama_decode: sampling, acceptance, bookkeeping."""
        return max(0.0, self.decode_s - self.draft_s - self.verify_s)

    @property
    def host_fraction(self) -> float:
        return self.host_s / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def ahead_hit_rate(self) -> float:
        """Draft-ahead: the share of rounds drafted beside a verify that the next round used."""
        return self.ahead_kept / self.ahead_made if self.ahead_made else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per round (each round also emits one token of the target's own)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens_processed / self.prefill_s if self.prefill_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """Counts, seconds and the derived rates (draft_lengths left out: a list per round)."""
        keys = ("prompt_tokens", "prompt_tokens_processed", "prefill_s", "tokens", "rounds", "drafted",
                "accepted", "draft_s", "verify_s", "decode_s", "host_s", "host_fraction", "acceptance_rate",
                "mean_accepted", "decode_tps", "prefill_tps", "ahead_made", "ahead_kept", "ahead_s",
                "ahead_hit_rate")
        return {k: getattr(self, k) for k in keys}


STOP_EOG = "eog"
STOP_MAX_TOKENS = "max_tokens"
STOP_CONTEXT_FULL = "context_full"
STOP_REQUESTED = "requested"  # the caller's should_stop said so (a stop string matched, a client left)


@dataclass(frozen=True, slots=True)
class DoneEvent:
    stats: GenerationStats
    stop_reason: str  # STOP_EOG, STOP_MAX_TOKENS, STOP_CONTEXT_FULL or STOP_REQUESTED
    message: str


Event = TokenEvent | DoneEvent


@dataclass(frozen=True, slots=True)
class Generation:
    """A whole generation, collected: what a caller that does not stream needs."""

    tokens: list[int]
    from_draft: int  # how many of `tokens` were accepted draft tokens
    done: DoneEvent
    trace: list[tuple[int, float]]  # generate(trace=True): each token's (row argmax, top-2 margin); else empty

    @property
    def stats(self) -> GenerationStats:
        return self.done.stats


def collect(events: Iterable[Event]) -> Generation:
    """Drain an engine stream into its tokens and its final DoneEvent."""
    tokens: list[int] = []
    trace: list[tuple[int, float]] = []
    from_draft = 0
    for event in events:
        if isinstance(event, DoneEvent):
            return Generation(tokens, from_draft, event, trace)
        tokens.append(event.token)
        from_draft += event.from_draft
        if event.row_argmax is not None and event.margin is not None:
            trace.append((event.row_argmax, event.margin))
    raise RuntimeError("the engine stream ended without a DoneEvent")  # an engine bug, not a user error


class _DraftLength:
    """Chooses k for the next round: fixed, or adaptive among a few lengths that it changes rarely.

    On CUDA every change of the verify width costs: llama.cpp rebuilds its compute graph and the CUDA graph runs
    uncaptured for two calls, then is captured again (docs/gpu.md: widths 7,7,5,5 cost 23.0 ms a call against
    19.0 for 7 and 15.7 for 5). So adaptive drafting holds k for EPOCH rounds and considers only a short LADDER
    of lengths (a third, two thirds and all of the preset's k). At an epoch's end it moves to the length that
    maximises expected tokens per second, E[tokens | k] / cost(k), and only if that beats the current length
    by MIN_GAIN. Acceptance is bursty, so E[tokens | k] = 1 + sum_{i<=k} S(i) uses the measured survival
    S(i) = P(positions 1..i all accepted) from each position's conditional acceptance; a position never
    verified borrows the deepest measured rate. cost(k) = k draft steps + a verify of k + 1 tokens, both timed
    online (the verify cost of an untried width from a line through the tried ones). The first two epochs probe
    the longest and the middle length, since a line needs two widths.
    """

    EPOCH = 16
    MIN_GAIN = 1.05

    def __init__(self, cfg: Drafting) -> None:
        self.k_max = cfg.n_draft
        self.ladder = sorted({max(1, round(self.k_max * f)) for f in (1 / 3, 2 / 3, 1.0)})
        self.adaptive = cfg.adaptive and len(self.ladder) > 1
        self.k = self.k_max
        self.rounds = 0
        self.tried = np.zeros(self.k_max + 1)  # index i: rounds that verified position i
        self.ok = np.zeros(self.k_max + 1)
        self.draft_step_s = 0.0
        self.verify_s: dict[int, float] = {}

    def next(self) -> int:
        if self.adaptive and self.rounds and self.rounds % self.EPOCH == 0:
            self.k = self._choose()
        return self.k

    def _choose(self) -> int:
        if len(self.verify_s) < 2:
            return self.ladder[len(self.ladder) // 2] if self.k == self.k_max else self.k_max
        rate = 0.8  # prior for a position never verified
        survival, expected = 1.0, [1.0]
        for i in range(1, self.k_max + 1):
            if self.tried[i] >= 1.0:
                rate = (self.ok[i] + 1.0) / (self.tried[i] + 2.0)
            survival *= rate
            expected.append(expected[-1] + survival)
        speed = {k: expected[k] / (k * self.draft_step_s + self._verify_cost(k + 1)) for k in self.ladder}
        best = max(speed, key=speed.__getitem__)
        return best if speed[best] > self.MIN_GAIN * speed.get(self.k, 0.0) else self.k

    def _verify_cost(self, width: int) -> float:
        if width in self.verify_s:
            return self.verify_s[width]
        widths = np.array(sorted(self.verify_s))
        times = np.array([self.verify_s[w] for w in widths])
        slope, intercept = np.polyfit(widths, times, 1)
        return float(max(intercept + slope * width, times.min()))

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float, width: int) -> None:
        self.rounds += 1
        if not self.adaptive:
            return
        if self.rounds % self.EPOCH == 0:  # older epochs count less: acceptance drifts with the text
            self.tried *= 0.5
            self.ok *= 0.5
        verified = min(accepted + 1, drafted)  # positions 1..accepted passed; the next one (if drafted) failed
        self.tried[1 : verified + 1] += 1.0
        self.ok[1 : accepted + 1] += 1.0
        ema = 0.2
        if drafted:
            step = draft_s / drafted
            self.draft_step_s = step if self.draft_step_s == 0.0 else (1 - ema) * self.draft_step_s + ema * step
        old = self.verify_s.get(width)
        self.verify_s[width] = verify_s if old is None else (1 - ema) * old + ema * verify_s


@dataclass(frozen=True, slots=True)
class _Ahead:
    """The next round's drafts, made while this round's verify ran, and what keeping or throwing them needs."""

    guess: int  # the target's next token, as the draft bet it (its argmax after the last draft)
    k: int  # the draft length they were made for
    drafts: list[int]
    q: list[Candidates] | None
    rng_state: dict  # the draft's random stream before them: a thrown bet gives its draws back
    seconds: float  # spent in the draft's decodes, beside the verify


class _LoadPolicy:
    """How much of its draft length each stream drafts at the current batch size (several slots in one round).

    With many slots the target's verify grows towards compute-bound and draft tokens cost nearly what they save.
    So per batch size this measures the aggregate tokens per second of whole rounds at each share of the streams'
    own draft lengths in SHARES (all of it, none: plain batched decoding, half), an epoch each, then uses the
    fastest and re-measures the others in turn every REPROBE-th epoch (acceptance drifts with the text). One slot
    alone always drafts all of it: the single-request loop (and `localspec bench`'s modes) stays what it was, and
    a seed reproduces its output.
    """

    EPOCH = 8
    REPROBE = 8
    SHARES = (1.0, 0.0, 0.5)

    def __init__(self) -> None:
        self.rounds: dict[int, int] = {}
        self.rate: dict[tuple[int, float], float] = {}  # (batch size, share) -> smoothed tokens per second

    def share(self, n: int) -> float:
        """The share of each stream's draft length to draft this round, with n streams in it."""
        if n < 2:
            return 1.0
        epoch = self.rounds.get(n, 0) // self.EPOCH
        if epoch < len(self.SHARES):
            return self.SHARES[epoch]
        best = max(self.SHARES, key=lambda f: self.rate.get((n, f), 0.0))
        if epoch % self.REPROBE:
            return best
        others = [f for f in self.SHARES if f != best]
        return others[(epoch // self.REPROBE) % len(others)]

    def observe(self, n: int, share: float, tokens: int, seconds: float) -> None:
        if n < 2 or seconds <= 0.0:
            return
        self.rounds[n] = self.rounds.get(n, 0) + 1
        rate, key = tokens / seconds, (n, share)
        old = self.rate.get(key)
        self.rate[key] = rate if old is None else 0.8 * old + 0.2 * rate

    def summary(self) -> dict[int, dict[str, float]]:
        """Per batch size seen: the measured tok/s at each share of the draft length ("k×1", "k×0.5", "k×0": plain),
        for the server's /health."""
        return {n: {f"k×{f:g}": round(r, 1) for (m, f), r in sorted(self.rate.items()) if m == n}
                for n in sorted(self.rounds)}


@dataclass(eq=False)
class _Slot:
    """One sequence of both contexts (llama.cpp sequence id `seq`) and what its KV cells hold.

    Invariant between rounds: `tokens` is the committed sequence; the target's cells hold all of it but the last
    token (`cur`, which opens the next verify batch); the draft's cells hold a prefix of it."""

    seq: int
    tokens: list[int] = field(default_factory=list)
    target_kv: list[int] = field(default_factory=list)
    draft_kv: list[int] = field(default_factory=list)
    chooser: tuple[tuple, _DraftLength] | None = None  # adaptive drafting's, kept across generations
    used: int = 0  # when it last started a generation (the least recently used free slot is reused first)
    busy: bool = False


class Stream:
    """One generation in progress in a slot: its request, random streams and stats, and the last round's tokens.

    Made by `Engine.start`; `Engine.step` runs a round for several streams at once; `events()` then yields that
    round's TokenEvents (asking `should_stop` after each) and, when the generation has ended, its DoneEvent.
    """

    def __init__(self, engine: Engine, slot: _Slot, sampling: Sampling, drafting: Drafting, max_tokens: int,
                 should_stop: Callable[[], bool] | None, trace: bool, grammar: Grammar | None = None,
                 constrain_draft: bool = True, logprobs: int | None = None) -> None:
        self.slot = slot
        # The grammar's state after the committed tokens (advanced only by emitted ones), and during drafting the
        # state after the drafts so far (a clone). constrain_draft=False masks the verify rows only (to measure).
        self.grammar = grammar
        self.constrain_draft = constrain_draft
        self.draft_grammar: Grammar | None = None
        self.logprobs = logprobs  # None: off; N: the emitted token's logprob and the N best alternatives
        self.token_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = []
        self.sampling = sampling
        self.drafting = drafting
        self.max_tokens = max_tokens
        self.should_stop = should_stop
        self.use_draft = engine.draft is not None and drafting.n_draft > 0
        self.trace = trace and sampling.greedy
        self.rng = np.random.default_rng(sampling.seed)  # acceptance and the target's own tokens
        self.draft_rng = np.random.default_rng([sampling.seed, 1])  # the draft's: a stream draft-ahead can rewind
        self.chooser = engine._draft_length(drafting if self.use_draft else dataclasses.replace(drafting, n_draft=0),
                                            sampling, slot)
        self.stats = GenerationStats()
        self.ahead: _Ahead | None = None  # drafted beside the last verify, betting on its outcome
        self.done: DoneEvent | None = None
        self._done_sent = False
        self.prefill: list[tuple[LlamaModel, list[int], list[int]]] = []  # prompt tokens not yet in the caches
        self.t_start = 0.0
        # The round in flight: its draft length, drafts, the draft's distributions, and what verification kept.
        self.k_round = self.k = 0
        self.drafts: list[int] = []
        self.q: list[Candidates] | None = None
        self.draft_s = 0.0
        self.emitted: list[int] = []
        self.n_accepted = 0
        self.rows: list[tuple[int, float]] = []
        self.width = 0  # the verify batch's width: 1 + drafts, or constant within the generation on a GPU
        self._piece = engine.target.piece
        self._is_eog = engine.target.is_eog
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def finished(self) -> bool:
        return self.done is not None

    def _finish(self, stop: str, message: str) -> None:
        self.stats.decode_s = time.perf_counter() - self.t_start
        self.done = DoneEvent(self.stats, stop, message)
        self.slot.busy = False
        if self.grammar is not None:
            self.grammar.close()

    def _stop_requested(self) -> bool:
        return self.should_stop is not None and self.should_stop()

    def events(self) -> Iterator[Event]:
        """The last round's tokens, then the DoneEvent if the generation ended (in the round or here)."""
        emitted, self.emitted = self.emitted, []
        stats = self.stats
        for i, token in enumerate(emitted):
            if self._is_eog(token):
                self._finish(STOP_EOG, "end of generation")
                break
            stats.tokens += 1
            row_argmax, margin = self.rows[i] if self.rows else (None, None)
            logprob, top = self.token_logprobs[i] if self.token_logprobs else (None, None)
            yield TokenEvent(token, self._decoder.decode(self._piece(token)), i < self.n_accepted, row_argmax, margin,
                             logprob, top)
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
    """Speculative decoding over a target and an optional draft `LlamaModel` (same tokenizer), for as many
    concurrent generations as the models have sequences (slots)."""

    def __init__(self, target: LlamaModel, draft: LlamaModel | None, *, constant_width: bool | None = None,
                 draft_ahead: bool = False) -> None:
        self.target = target
        self.draft = draft
        # Keep the verify width constant within a generation, padding a short draft (an early stop below p_min,
        # the last round before max_tokens): on CUDA a width change re-captures graphs, which costs more than the
        # padded positions (docs/gpu.md). On a CPU the padded positions are pure extra work, so only on a GPU.
        self.constant_width = target.on_gpu if constant_width is None else constant_width
        self.draft_ahead = draft_ahead and draft is not None
        self._worker: ThreadPoolExecutor | None = None  # drafts ahead beside the verify (started when first used)
        self._job: Future[_Ahead | None] | None = None  # the last draft-ahead handed to the worker
        n_slots = target.n_seq if draft is None else min(target.n_seq, draft.n_seq)
        self.slots = [_Slot(seq) for seq in range(n_slots)]
        self.load = _LoadPolicy()
        self._starts = 0
        self._draft_unknown = 0 if draft is None else draft.unknown_token

    # -- public ---------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every slot's KV cells (the next prompts are processed in full)."""
        self._wait_for_worker()
        self.target.clear()
        if self.draft is not None:
            self.draft.clear()
        for slot in self.slots:
            slot.tokens, slot.target_kv, slot.draft_kv, slot.busy = [], [], [], False

    def _wait_for_worker(self) -> None:
        """The draft model is ours again: a draft-ahead interrupted mid-verify (Ctrl-C) may still be running."""
        if self._job is not None:
            with contextlib.suppress(BaseException):
                self._job.result()
            self._job = None

    def close(self) -> None:
        self._wait_for_worker()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        """The tokens in slot 0's target KV cells, position by position (chat reports how much it could reuse)."""
        return tuple(self.slots[0].target_kv)

    @property
    def n_ctx(self) -> int:
        """Each slot's context."""
        return min(self.target.n_ctx, self.draft.n_ctx) if self.draft is not None else self.target.n_ctx

    @property
    def batches_slots(self) -> bool:
        """Whether a round's slots share each decode (else llama.cpp's multi-sequence batches are not exact for
        this model and they take turns inside the round: `LlamaModel.batches_sequences`)."""
        return all(m.batches_sequences for m in (self.target, self.draft) if m is not None)

    def free_slot(self, prompt: Sequence[int]) -> int | None:
        """The free slot for `prompt`: the one whose cells share the longest prefix with it (a returning
        conversation goes back to its cache), else the least recently used; None when every slot is busy."""
        free = [s for s in self.slots if not s.busy]
        if not free:
            return None
        return max(free, key=lambda s: (shared_prefix(s.target_kv, prompt), -s.used)).seq

    def generate(self, prompt: Sequence[int], sampling: Sampling, drafting: Drafting, max_tokens: int,
                 should_stop: Callable[[], bool] | None = None, *, trace: bool = False, slot: int = 0,
                 grammar: Grammar | None = None, constrain_draft: bool = True,
                 logprobs: int | None = None) -> Iterator[Event]:
        """Yield a TokenEvent per emitted token, then one DoneEvent with the stats and why it stopped: the one-slot
        case of `start` + `step` + `events`.

        `should_stop` is asked before each round and after each token the caller has consumed; True ends the
        generation there with STOP_REQUESTED and full stats (closing the iterator stops it too, without stats).
        A round's later tokens stay committed in the caches either way, so the next prompt reuses them.
        `trace` (temperature 0 only): each TokenEvent also carries its target row's argmax and top-2 margin, for
        the bench's greedy check; the device then returns candidates rather than only the argmax.
        """
        stream = self.start(prompt, sampling, drafting, max_tokens, should_stop, trace=trace, slot=slot,
                            grammar=grammar, constrain_draft=constrain_draft, logprobs=logprobs)
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
              logprobs: int | None = None) -> Stream:
        """Begin a generation in `slot`: set its samplers, bring its cells to the prompt (reusing the prefix they
        hold) and return its Stream, ready for `step`. With `prefill_in_rounds` the prompt is decoded one batch
        per model per round instead (`step` does it), so the streams already running keep going meanwhile; the
        batches are the ones a whole prefill makes, so the numbers are the same.

        `grammar` (the stream owns it from here: closed when it ends) holds the output to a constraint; `logprobs`
        asks for each token's logprob and that many alternatives. Both need the full logits of their rows, so
        that stream's device sampler is off (the draft's too for a grammar)."""
        if not prompt:
            raise UsageError("the prompt must hold at least one token (a BOS token will do)")
        self._wait_for_worker()
        chosen = self.slots[slot]
        stream = Stream(self, chosen, sampling, drafting, max_tokens, should_stop, trace, grammar, constrain_draft,
                        logprobs)
        seq = chosen.seq
        full_rows = grammar is not None or logprobs is not None
        self.target.use_device_sampler(None if full_rows else _device_mode(
            self.target, sampling, p_min=0.0, plain=not stream.use_draft, trace=stream.trace), seq)
        self.target.restart_device_sampler(seq)
        if self.draft is not None:
            self.draft.use_device_sampler(None if grammar is not None and constrain_draft else _device_mode(
                self.draft, sampling, p_min=drafting.p_min), seq)
        stream.stats.prompt_tokens = len(prompt)
        stream.prefill = self._prefill(chosen, list(prompt), stream.use_draft, stream.stats)
        if not prefill_in_rounds:
            self._prefill_some(stream, whole=True)
        self._starts += 1
        chosen.used, chosen.busy = self._starts, True
        stream.t_start = time.perf_counter()
        return stream

    def step(self, streams: Sequence[Stream]) -> None:
        """One round for every stream that goes on: draft (one draft decode per step across them), verify (one
        target decode for all), accept per stream, rewind. Each stream's `events()` then yields its tokens."""
        t0 = time.perf_counter()
        live = [s for s in streams if self._begin(s)]
        if not live:
            return
        drafting = any(s.k for s in live)  # (a round where nobody drafts tells the load policy nothing)
        share = self.load.share(len(live)) if drafting else 1.0
        solo = live[0] if len(live) == 1 else None
        to_draft = []
        for s in live:
            if share < 1.0:
                s.k = round(s.k * share)
                s.width = s.k + 1 if self.constant_width else 0
            if s.ahead is not None and s is solo and s.ahead.k == s.k:  # the bet made beside the last verify
                s.drafts, s.q, s.draft_s = s.ahead.drafts, s.ahead.q, 0.0
                s.stats.ahead_kept += 1
            else:
                self._throw_ahead(s)
                s.drafts, s.q, s.draft_s = [], None, 0.0
                if s.k > 0:
                    to_draft.append((s, s.k, None))
            s.ahead = None
        self._draft(to_draft)
        if solo is not None:
            s = solo
            # If every draft is accepted, the next round has this many more tokens behind it.
            k_next = min(s.k_round, s.max_tokens - s.stats.tokens - len(s.drafts) - 2,
                         self.n_ctx - len(s.slot.tokens) - len(s.drafts) - 1)
            with self._drafting_ahead(s, k_next) as job:
                verify_s = self._verify(live)
            s.ahead = self._settle_ahead(s, job, s.n_accepted == len(s.drafts))
        else:
            verify_s = self._verify(live)
        for s in live:
            self._rewind(s, keep_draft=s.ahead is not None)
            s.chooser.observe(len(s.drafts), s.n_accepted, s.draft_s, verify_s, s.width)
            stats = s.stats
            stats.draft_s += s.draft_s
            stats.verify_s += verify_s
            stats.rounds += 1
            stats.drafted += len(s.drafts)
            stats.accepted += s.n_accepted
            stats.draft_lengths.append(len(s.drafts))
        if drafting:
            self.load.observe(len(live), share, sum(len(s.emitted) for s in live), time.perf_counter() - t0)

    def _draft_length(self, drafting: Drafting, sampling: Sampling, slot: _Slot) -> _DraftLength:
        """A fixed length's chooser is fresh each generation. An adaptive one is kept across the slot's generations
        with the same drafting: what it measured (costs, acceptance) stays valid for the next prompt, and probing
        again every generation would cost rounds."""
        if not drafting.adaptive:
            return _DraftLength(drafting)
        key = (drafting, sampling.greedy)
        if slot.chooser is None or slot.chooser[0] != key:
            slot.chooser = (key, _DraftLength(drafting))
        return slot.chooser[1]

    # -- the loop's steps -----------------------------------------------------------------------------------

    def _prefill(self, slot: _Slot, prompt: list[int], use_draft: bool,
                 stats: GenerationStats) -> list[tuple[LlamaModel, list[int], list[int]]]:
        """Cut the slot's cells in both models back to the longest prefix of prompt[:-1] they hold; returns, per
        model, (model, its cells' tokens, the tokens still to decode) for `_prefill_some`."""
        if len(prompt) > self.n_ctx:
            raise ContextFullError(f"the prompt has {len(prompt)} tokens; the context holds {self.n_ctx}")
        body = prompt[:-1]
        models = [(self.target, slot.target_kv)]
        if use_draft:
            models.append((self.draft, slot.draft_kv))
        todo = []
        for model, kv in models:
            keep = shared_prefix(kv, body)
            # Truncate even when the bookkeeping says nothing is extra: a decode interrupted by an exception may
            # have left cells the bookkeeping never recorded.
            del kv[keep:]
            model.truncate(keep, slot.seq)
            todo.append((model, kv, body[keep:]))
        stats.prompt_tokens_processed = len(todo[0][2])
        slot.tokens = list(prompt)
        return [t for t in todo if t[2]]

    def _prefill_some(self, s: Stream, whole: bool = False) -> bool:
        """Decode the stream's prompt into both models: all of it, or one batch of each; True when it is in."""
        t0 = time.perf_counter()
        for model, kv, todo in s.prefill:
            take = todo if whole else todo[: model.n_batch]
            model.decode(take, len(kv), seq=s.slot.seq)
            kv.extend(take)
            del todo[: len(take)]
        s.prefill = [t for t in s.prefill if t[2]]
        now = time.perf_counter()
        s.stats.prefill_s += now - t0
        s.t_start = now
        return not s.prefill

    def _begin(self, s: Stream) -> bool:
        """Whether the stream goes on this round (else it finishes here), and its draft length."""
        if s.finished:
            return False
        assert not s.emitted, "events() of the last round were not taken"
        if s.stats.tokens >= s.max_tokens:
            s._finish(STOP_MAX_TOKENS, f"reached max_tokens ({s.max_tokens})")
            return False
        if s._stop_requested():
            s._finish(STOP_REQUESTED, "stopped by the caller")
            return False
        if s.prefill and not self._prefill_some(s):
            return False  # more of its prompt next round; the round that decodes the last batch is its first
        room = self.n_ctx - len(s.slot.tokens)  # verify needs cur + k cells after the cached prefix
        if room < 0:
            s._finish(STOP_CONTEXT_FULL, f"context full ({self.n_ctx} tokens): start a new conversation")
            return False
        s.k_round = s.chooser.next() if s.use_draft else 0
        s.k = min(s.k_round, s.max_tokens - s.stats.tokens - 1, room)
        s.width = min(s.k_round, room) + 1 if self.constant_width else 0  # 0: as wide as the drafts are
        return True

    def _draft(self, jobs: Sequence[tuple[Stream, int, list[int] | None]]) -> None:
        """Up to k draft tokens for each (stream, k, sequence) — continuing `sequence`, by default the committed
        tokens — one batched draft decode per step across the streams still drafting. Sets each stream's
        drafts, the draft's distributions when sampling, and the seconds it waited for draft decodes."""
        if not jobs:
            return
        draft = self.draft
        assert draft is not None
        todo = []
        for s, k, sequence in jobs:
            sequence = s.slot.tokens if sequence is None else sequence
            feed = sequence[len(s.slot.draft_kv) :]  # cur, plus the last draft token after an all-accept round
            if max(feed) >= draft.n_vocab:
                # A target-only padding id (vocabularies may differ by up to 128 trailing ids): the draft sees its
                # unknown token there instead. That can only cost acceptance, never correctness.
                feed = [t if t < draft.n_vocab else self._draft_unknown for t in feed]
            s.drafts, s.q, s.draft_s = [], (None if s.sampling.greedy else []), 0.0
            if s.grammar is not None and s.constrain_draft:
                s.draft_grammar = s.grammar.clone()
            todo.append((s, k, sequence, feed))
        step = 0
        while todo:
            t = time.perf_counter()
            scores = draft.decode_many([(s.slot.seq, feed, len(s.slot.draft_kv), False) for s, _, _, feed in todo])
            spent = time.perf_counter() - t
            going = []
            for (s, k, sequence, feed), row in zip(todo, scores, strict=True):
                s.draft_s += spent
                s.slot.draft_kv.extend(feed)
                sampling, p_min = s.sampling, s.drafting.p_min
                # Only a penalty reads the history (copying a long one every draft step costs).
                history = sequence + s.drafts if sampling.penalized else sequence
                if s.draft_grammar is not None:  # the draft proposes only what the grammar allows after the drafts
                    row = _masked(_penalized(row, history, sampling), s.draft_grammar, sampling)
                    history = []  # (its penalties are in the masked row)
                if sampling.greedy:
                    token = int(_argmax(_penalized(row, history, sampling))[0])
                    confident = p_min == 0.0 or _top_softmax(row) >= p_min
                else:
                    dist = _distributions(row, history, sampling)
                    token = dist.sample(0, s.draft_rng)
                    s.q.append(dist)
                    confident = p_min == 0.0 or dist.top_prob(0) >= p_min
                if token >= self.target.n_vocab:
                    continue  # a draft-only padding id: the target cannot score it
                s.drafts.append(token)
                if s.draft_grammar is not None and not self.target.is_eog(token):
                    s.draft_grammar.accept(token)
                # An unsure draft is usually wrong: verify what we have instead of drafting on.
                if step < k - 1 and confident:
                    going.append((s, k, sequence, [token]))
            todo = going
            step += 1

    def _verify(self, streams: Sequence[Stream]) -> float:
        """One target decode of every stream's [cur] + drafts (each padded to its width), then acceptance per
        stream: greedy match or rejection sampling, with the stream's own settings and random stream. Sets each
        stream's tokens to emit, accepted count and (with trace) each real row's (argmax, top-2 margin); returns
        the decode's seconds."""
        items = []
        for s in streams:
            s.width = max(s.width, len(s.drafts) + 1)
            batch = [s.slot.tokens[-1], *s.drafts]
            # Padding only keeps the batch shape: its positions come after every real one (causal attention),
            # their rows are never read, and _rewind drops their KV cells with the rejected drafts'.
            batch += [batch[-1]] * (s.width - len(batch))
            items.append((s.slot.seq, batch, len(s.slot.target_kv), True))
        t = time.perf_counter()
        scores = self.target.decode_many(items)
        spent = time.perf_counter() - t
        for s, (_, batch, _, _), rows in zip(streams, items, scores, strict=True):
            s.slot.target_kv.extend(batch)
            rows = _first_rows(rows, len(s.drafts) + 1)
            if s.grammar is None:
                s.emitted, s.n_accepted, s.rows = self._accept(s, rows)
            else:
                s.emitted, s.n_accepted, s.rows = self._accept_constrained(s, rows)
            if s.logprobs is not None:
                assert isinstance(rows, np.ndarray)  # logprobs turn the device sampler off (start)
                s.token_logprobs = [token_logprobs(rows[i], t, s.logprobs) for i, t in enumerate(s.emitted)]
        return spent

    @staticmethod
    def _accept(s: Stream, scores: np.ndarray | TopK | Sampled) -> tuple[list[int], int, list[tuple[int, float]]]:
        """gpt-fast's accept/reject over one stream's verify rows: (tokens to emit, accepted drafts, trace rows)."""
        drafts, sampling = s.drafts, s.sampling
        history = s.slot.tokens + drafts if sampling.penalized else s.slot.tokens  # (only a penalty reads it)
        if isinstance(scores, Sampled):  # plain decoding at T > 0: the device drew the token
            return [int(scores.tokens[0])], 0, []
        if sampling.greedy:
            scored = _penalized(scores, history, sampling)
            rows = _row_argmax_and_margin(scored) if s.trace else []  # read from the rows, apart from the choice
            choice = _argmax(scored)
            n = 0
            while n < len(drafts) and drafts[n] == choice[n]:
                n += 1
            return [*drafts[:n], int(choice[n])], n, rows
        p = _distributions(scores, history, sampling)
        for i, token in enumerate(drafts):
            ok, out = accept_or_resample(token, p, i, s.q[i], s.rng)
            if not ok:
                return [*drafts[:i], out], i, []
        return [*drafts, p.sample(len(drafts), s.rng)], len(drafts), []

    def _accept_constrained(self, s: Stream, scores: np.ndarray | TopK | Sampled,
                            ) -> tuple[list[int], int, list[tuple[int, float]]]:
        """`_accept` on masked rows: row i is masked with the grammar state after the drafts before it (a clone
        of the real state, advanced by each accepted draft), so p is the constrained target's at every position.
        The real state then advances by the emitted tokens. Full rows only (start turns the device sampler off)."""
        assert isinstance(scores, np.ndarray) and s.grammar is not None
        drafts, sampling = s.drafts, s.sampling
        history = s.slot.tokens + drafts if sampling.penalized else s.slot.tokens
        scored = _penalized(scores, history, sampling)
        state = s.grammar.clone()
        emitted: list[int] = []
        for i in range(len(drafts) + 1):
            row = _masked(scored[i], state, sampling)
            if sampling.greedy:
                token = int(np.argmax(row[0]))
                ok = i < len(drafts) and drafts[i] == token
            elif i < len(drafts):
                ok, token = accept_or_resample(drafts[i], candidates(row, sampling), 0, s.q[i], s.rng)
            else:
                ok, token = False, candidates(row, sampling).sample(0, s.rng)
            emitted.append(token)
            if not self.target.is_eog(token):
                state.accept(token)
            if not ok:
                break
        s.grammar.close()
        s.grammar = state
        s.draft_grammar = None
        return emitted, len(emitted) - 1, []

    # -- draft-ahead: the next round's drafts while this round verifies (one stream) -------------------------

    @contextlib.contextmanager
    def _drafting_ahead(self, s: Stream, k: int) -> Iterator[Future[_Ahead | None] | None]:
        """Run `_draft_ahead` in the worker thread for as long as the block (the verify) runs. llama.cpp releases
        the GIL inside each decode, so the two models compute at once. Whatever happens in the block, the draft
        model is idle again when it ends."""
        if not (self.draft_ahead and s.drafts and k > 0 and s.grammar is None):
            yield None
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localspec-draft-ahead")
        job = self._job = self._worker.submit(self._draft_ahead, s, list(s.drafts), k)
        try:
            yield job
        finally:
            with contextlib.suppress(Exception):  # its own error, if any, is raised by _settle_ahead
                job.result()

    def _draft_ahead(self, s: Stream, drafts: list[int], k: int) -> _Ahead | None:
        """Assume every draft is accepted: guess the target's next token (the draft's argmax: no random draw, so
        the draws that follow are the next round's own), then draft the next round behind it. Works on a shadow
        Stream, so the round being verified keeps its drafts."""
        draft = self.draft
        assert draft is not None
        slot = s.slot
        state = s.draft_rng.bit_generator.state
        t = time.perf_counter()
        sequence = slot.tokens + drafts
        feed = sequence[len(slot.draft_kv) :]  # the last draft, which the draft has not seen yet
        if not feed:  # drafting stopped at a draft-only id, after feeding every draft: nothing to guess from
            return None
        scores = draft.decode(feed, len(slot.draft_kv), seq=slot.seq)
        slot.draft_kv.extend(feed)
        guess = int(_argmax(scores)[0])
        if guess >= self.target.n_vocab:
            return None
        shadow = _Shadow(s)
        self._draft([(shadow, k, [*sequence, guess])])  # type: ignore[list-item]
        return _Ahead(guess, k, shadow.drafts, shadow.q, state, time.perf_counter() - t)

    def _settle_ahead(self, s: Stream, job: Future[_Ahead | None] | None, all_accepted: bool) -> _Ahead | None:
        """Keep the drafted-ahead round if its bet came true; otherwise give its random draws back."""
        if job is None:
            return None
        ahead = job.result()
        if ahead is None:
            return None
        s.stats.ahead_made += 1
        s.stats.ahead_s += ahead.seconds
        if all_accepted and s.emitted[-1] == ahead.guess:
            return ahead
        s.draft_rng.bit_generator.state = ahead.rng_state  # its KV cells go with the round's rejected ones (_rewind)
        return None

    def _throw_ahead(self, s: Stream) -> None:
        """Undo a kept drafted-ahead round that the next round cannot use (it asks for another length, or other
        streams joined): its draws go back to the stream, its KV cells from cur on leave the draft's cache (the
        next draft feeds cur)."""
        ahead, slot = s.ahead, s.slot
        if ahead is None:
            return
        s.draft_rng.bit_generator.state = ahead.rng_state
        keep = min(len(slot.draft_kv), len(slot.tokens) - 1)
        if len(slot.draft_kv) > keep:
            del slot.draft_kv[keep:]
            self.draft.truncate(keep, slot.seq)

    def _rewind(self, s: Stream, keep_draft: bool = False) -> None:
        """Drop the KV cells of rejected tokens from both caches and commit the round's tokens. With `keep_draft`
        the draft's cache keeps the next round's drafts (a kept draft-ahead)."""
        slot = s.slot
        keep = len(slot.tokens) + s.n_accepted  # committed tokens (cur included) + accepted drafts
        # Bookkeeping first: if a truncate is interrupted, the next _prefill truncates to what the lists claim.
        if len(slot.target_kv) > keep:
            del slot.target_kv[keep:]
            self.target.truncate(keep, slot.seq)
        if len(slot.draft_kv) > keep and not keep_draft:
            del slot.draft_kv[keep:]
            self.draft.truncate(keep, slot.seq)
        slot.tokens.extend(s.emitted)


class _Shadow:
    """What `_draft` reads and writes of a Stream, for drafting ahead without touching the round in flight: the
    slot and the draft's random stream are the stream's own; the drafts and distributions are the shadow's."""

    def __init__(self, s: Stream) -> None:
        self.slot, self.sampling, self.drafting, self.draft_rng = s.slot, s.sampling, s.drafting, s.draft_rng
        self.drafts: list[int] = []
        self.q: list[Candidates] | None = None
        self.draft_s = 0.0
        self.grammar: Grammar | None = None  # draft-ahead is off for constrained streams
        self.draft_grammar: Grammar | None = None


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share (what a KV cache holding `a` can keep of `b`)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _device_mode(model: LlamaModel, sampling: Sampling, p_min: float, *, plain: bool = False,
                 trace: bool = False) -> str | DeviceDist | None:
    """What the device should compute per row. A penalty needs the penalised tokens' logits wherever they rank:
    full rows. Greedy needs only the argmax (unless p_min or a trace needs the candidates' logits); plain decoding
    at T > 0 draws its token on the device (the whole pipeline, nothing copied back); a top-k pipeline needs the
    top candidates (rejection sampling compares p and q), and top_k = 0 needs every logit: full rows."""
    if sampling.penalized:
        return None
    if sampling.greedy:
        return "top_k" if p_min > 0.0 or trace else "greedy"
    if plain:
        return DeviceDist(sampling.top_k, sampling.top_p, sampling.min_p, sampling.temperature, sampling.seed)
    if 0 < sampling.top_k <= model.device_top_k:
        return "top_k"
    return None


def _first_rows(scores: np.ndarray | TopK | Sampled | None, n: int) -> np.ndarray | TopK | Sampled:
    """The rows of the real tokens of a (possibly padded) verify batch."""
    assert scores is not None
    if isinstance(scores, TopK):
        return TopK(scores.ids[:n], scores.logits[:n])
    if isinstance(scores, Sampled):
        return Sampled(scores.tokens[:n])
    return scores[:n]


def _row_argmax_and_margin(scores: np.ndarray | TopK | Sampled) -> list[tuple[int, float]]:
    """Each row's argmax and its lead over the runner-up, in logits (from the device's candidates or full rows)."""
    assert not isinstance(scores, Sampled)
    logits = scores.logits if isinstance(scores, TopK) else scores
    ids = scores.ids if isinstance(scores, TopK) else None
    out = []
    for r in range(len(logits)):
        row = logits[r]
        if len(row) < 2:  # a single candidate: nothing to compare with
            out.append((int(ids[r, 0]) if ids is not None else 0, float("inf")))
            continue
        top2 = np.argpartition(row, len(row) - 2)[-2:]
        best, second = (top2[1], top2[0]) if row[top2[1]] >= row[top2[0]] else (top2[0], top2[1])
        # np.argmax breaks ties toward the lower index, as the acceptance does; argpartition does not.
        best = int(np.argmax(row)) if row[best] == row[second] else int(best)
        token = int(ids[r, best]) if ids is not None else best
        out.append((token, float(row[best] - row[second])))
    return out


def _argmax(scores: np.ndarray | TopK) -> np.ndarray:
    """The greedy token of every row, from full logits or from the device's top-k candidates."""
    return scores.argmax() if isinstance(scores, TopK) else np.argmax(scores, axis=1)


def _penalized(scores: np.ndarray | TopK, history: list[int], sampling: Sampling) -> np.ndarray | TopK:
    """Every row with the penalties applied; row i sees the history plus the rows before it. Penalties get full
    rows (see _device_mode), so TopK passes through unchanged."""
    if isinstance(scores, TopK) or not sampling.penalized:
        return scores
    base = len(history) - len(scores) + 1  # row i follows history[:base + i]
    return np.stack([apply_penalties(row, history[: base + i], sampling) for i, row in enumerate(scores)])


def _masked(row: np.ndarray, grammar: Grammar, sampling: Sampling) -> np.ndarray:
    """One full row (penalties applied) with what the grammar forbids at -inf, as a (1, vocab) row; checked as far
    as the pipeline needs: greedy keeps one token, top-k top_k of them, top_k = 0 every one."""
    need = 1 if sampling.greedy else (sampling.top_k if sampling.top_k > 0 else 0)
    return masked_row(row.reshape(-1), grammar, need)[None, :]


def _distributions(scores: np.ndarray | TopK, history: list[int], sampling: Sampling) -> Candidates:
    """The sampling pipeline for every row."""
    if isinstance(scores, TopK):  # only chosen when no penalty applies (see _device_mode)
        return candidates_from_top_k(scores.ids, scores.logits, sampling)
    return candidates(_penalized(scores, history, sampling), sampling)


def _top_softmax(scores: np.ndarray | TopK) -> float:
    """The draft's top probability at temperature 1, for the p_min early stop of greedy drafts. With device
    top-k it is taken over the candidates only (an overestimate, fine for a stopping heuristic)."""
    row = scores.logits[0] if isinstance(scores, TopK) else scores[0]
    return 1.0 / float(np.exp(row - row.max(), dtype=np.float64).sum())
