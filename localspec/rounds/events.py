"""What the engine yields and counts: token and done events, the stop reasons, `GenerationStats`, `collect`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field


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
    ahead_made: int = 0  # draft-ahead: rounds drafted while the previous round's verify ran, assuming its verdict
    ahead_kept: int = 0  # ... and those that held: rounds whose drafts cost no time on the critical path
    ahead_s: float = 0.0  # draft decodes made ahead, beside a verify (not in draft_s: off the critical path)
    ahead_wait_s: float = 0.0  # after a verify, waiting for the draft-ahead beside it to finish (on the path)
    full_rows: int = 0  # constrained verify rows whose device candidates held too few legal tokens: decoded again
    context_shifts: int = 0  # times the context filled and a block of tokens was dropped (context shift)
    shift_tokens: int = 0  # ... tokens decoded again at their new positions then (in decode_s)
    stood_aside: int = 0  # rounds the drafter drafted nothing because drafting was priced below plain decoding
    draft_lengths: list[int] = field(default_factory=list)

    def count_round(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """One speculative round: `drafted` tokens proposed in `draft_s` (on the path), `accepted` of them, the
        verify's `verify_s`."""
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.draft_lengths.append(drafted)

    def __add__(self, other: GenerationStats) -> GenerationStats:
        return GenerationStats(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                                  for f in dataclasses.fields(self)})

    @classmethod
    def total(cls, many: Iterable[GenerationStats]) -> GenerationStats:
        return sum(many, cls())

    @property
    def host_s(self) -> float:
        """Everything in the rounds that is neither a llama_decode nor the wait for a draft-ahead: sampling,
        acceptance, bookkeeping."""
        return max(0.0, self.decode_s - self.draft_s - self.verify_s - self.ahead_wait_s)

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
                "ahead_wait_s", "ahead_hit_rate", "full_rows", "context_shifts", "shift_tokens", "stood_aside")
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
    # Why drafting stood aside when the generation ended (`[draft] stand_aside`: one line from the measured
    # prices), None while it drafted
    aside: str | None = None


Event = TokenEvent | DoneEvent


def drafting_note(stats: GenerationStats, aside: str | None) -> str:
    """How a generation drafted, in a few words for a status line: its acceptance, that drafting stood aside
    (`[draft] stand_aside`, with the measured reason), or no drafting."""
    if aside is not None and stats.stood_aside:
        return f"drafting stood aside: {aside}"
    return f"acceptance {stats.acceptance_rate:.0%}" if stats.drafted else "no drafting"


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
