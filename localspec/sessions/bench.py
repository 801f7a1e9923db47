"""`localspec bench` as a library: warm-up, interleaved measured runs, medians, a JSON-ready report.

It yields progress events and returns data; the CLI draws them. A run generates `max_tokens` for every prompt of
the prompt set (the shipped one, or the user's own from `--prompts FILE`); its tok/s is all generated tokens over
all decode time (prompt processing is reported apart). Plain (k = 0) and speculative runs alternate, so drifting
clocks or thermals hit both modes alike.

Bench measures what users run: when the target carries a chat template, each prompt goes through it (as a user
message), because replies to a templated prompt are what chat produces and acceptance differs between the two;
`raw` keeps plain completion.
"""

from __future__ import annotations

import codecs
import dataclasses
import itertools
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Generic, TypeVar

from localspec import __version__, machine
from localspec.config import DRAFTER_TABLE, Drafting, Preset, Sampling
from localspec.errors import UsageError
from localspec.fsutil import read_text
from localspec.rounds.events import STOP_EOG, DoneEvent, GenerationStats, collect
from localspec.sessions.chat import ChatTemplate, encode_chat
from localspec.sessions.session import Session

# Code, prose and Q&A: acceptance differs by kind of text, so the set mixes them.
PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test.\n"),
    ("prose", "Write a short story about a lighthouse keeper who finds a message in a bottle.\n"),
    ("qa", "Question: Why is the sky blue? Explain it simply, step by step.\nAnswer:"),
)
# Where prompt lookup matters: replies that repeat their prompt (`--prompts lookup`).
_FUNCTION = '''def summarize_orders(orders, tax_rate):
    """Total, count and mean of the paid orders, with tax."""
    total = 0.0
    count = 0
    for order in orders:
        if order["status"] != "paid":
            continue
        amount = order["amount"] * (1.0 + tax_rate)
        total += amount
        count += 1
    mean = total / count if count else 0.0
    return {"total": round(total, 2), "count": count, "mean": round(mean, 2)}
'''
_DOCUMENT = (
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. The lanes, which opened in "
    "March, run for two miles from the train station to the river park. Since they opened, the number of people "
    "cycling to work has doubled, according to counts taken by the transport office every Monday morning. Shop "
    "owners on Main Street were worried that fewer parking spaces would mean fewer customers, but sales in the "
    "street rose by four percent over the same months. The council voted to extend the lanes by one mile to the "
    "university next year, at a cost of two hundred thousand dollars, paid from the transport budget."
)
_RECORDS = (
    '[{"id": 1, "name": "Alice", "email": "alice@example.com", "role": "admin", "active": true}, '
    '{"id": 2, "name": "Bob", "email": "bob@example.com", "role": "editor", "active": false}, '
    '{"id": 3, "name": "Carol", "email": "carol@example.com", "role": "viewer", "active": true}]'
)
LOOKUP_PROMPTS: tuple[tuple[str, str], ...] = (
    ("code-edit", "Rename the variable `total` to `paid_total` in this Python function and return the whole "
                  f"function, otherwise unchanged:\n\n```python\n{_FUNCTION}```\n"),
    ("summarise", f"Document:\n{_DOCUMENT}\n\nSummarise the document in three sentences, reusing its own "
                  "words where you can.\n"),
    ("json", f"Reformat this JSON with two-space indentation, one key per line, keys in the same order:\n"
             f"{_RECORDS}\n"),
)
PROMPT_SETS = {"shipped": PROMPTS, "lookup": LOOKUP_PROMPTS}  # `--prompts NAME`
WARMUP_TOKENS = 16
PROGRESS_EVERY_S = 0.5  # how often a run reports its tokens so far: a slow machine must never look hung
SWEEP_NEXT = "`localspec bench --sweep 2,4,6,8`"
GPU_NEXT = "`localspec pull qwen3-32b && localspec bench --pair qwen3-32b`"
# A run's tok/s spread (fastest over slowest) beyond which something else was competing for the cores.
NOISY_SPREAD = 1.5
# The share of rounds stood aside from which the speculative runs decoded as plain decoding does (the judged
# generation in PLAIN_GENERATIONS aside): their difference from plain is then the machine's, not drafting's.
ALL_ASIDE = 0.99
PLAIN, SPEC = "plain", "speculative"
RAW, TEMPLATE = "raw completion", "chat template"
MAX_PROMPTS = 10_000


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of the set: plain text, or a conversation (`messages`) that needs the chat template."""

    name: str
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


def shipped_prompts(name: str = "shipped") -> list[BenchPrompt]:
    return [BenchPrompt(prompt, text=text) for prompt, text in PROMPT_SETS[name]]


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """`--prompts FILE`: one prompt per line, or JSONL with `prompt` (text) or `messages` (a conversation); or a
    shipped set's name (`PROMPT_SETS`: a file of that name is `./NAME`).

    A file is JSONL when its name ends in `.jsonl` or its first non-blank line starts with `{`. Blank lines are
    skipped; an error names the file and the line.
    """
    if isinstance(path, str) and path in PROMPT_SETS:  # (a str: Path("./lookup") would read as "lookup")
        return shipped_prompts(path)
    lines = read_text(Path(path)).splitlines()  # a missing, unreadable, special or non-UTF-8 file: one line
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise UsageError(f"{path}: no prompts (one per line, or JSONL with 'prompt' or 'messages')")
    if len(numbered) > MAX_PROMPTS:
        raise UsageError(f"{path}: {len(numbered)} prompts; at most {MAX_PROMPTS}")
    if Path(path).suffix != ".jsonl" and not numbered[0][1].lstrip().startswith("{"):
        return [BenchPrompt(f"line {i}", text=line) for i, line in numbered]
    return [_jsonl_prompt(path, i, line) for i, line in numbered]


def _jsonl_prompt(path: Path, lineno: int, line: str) -> BenchPrompt:
    where = f"{path}:{lineno}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: invalid JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(item, dict):
        raise UsageError(f"{where}: expected an object with 'prompt' or 'messages'")
    unknown = sorted(set(item) - {"prompt", "messages", "name"})
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]!r} (allowed: prompt, messages, name)")
    if ("prompt" in item) == ("messages" in item):
        raise UsageError(f"{where}: give exactly one of 'prompt' or 'messages'")
    name = item.get("name", f"line {lineno}")
    if not isinstance(name, str):
        raise UsageError(f"{where}: 'name' must be a string")
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"].strip():
            raise UsageError(f"{where}: 'prompt' must be a non-empty string")
        return BenchPrompt(name, text=item["prompt"])
    messages = item["messages"]
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for n, m in enumerate(messages, 1):
        if (not isinstance(m, dict) or set(m) != {"role", "content"} or not isinstance(m["role"], str)
                or not isinstance(m["content"], str)):
            raise UsageError(f"{where}: message {n} must be an object with string 'role' and 'content'")
    return BenchPrompt(name, messages=tuple(messages))


def prompt_mode(session: Session, raw: bool) -> str:
    """Through the chat template when the target carries one (what chat sends), unless `raw`."""
    return RAW if raw or not session.target.metadata("tokenizer.chat_template") else TEMPLATE


def tokenize_prompts(session: Session, prompts: list[BenchPrompt] | None = None,
                     raw: bool = False) -> list[tuple[str, list[int]]]:
    return [(name, tokens) for name, _, tokens in render_prompts(session, prompts, raw)]


def render_prompts(session: Session, prompts: list[BenchPrompt] | None = None,
                   raw: bool = False) -> list[tuple[str, str, list[int]]]:
    """Each prompt's name, the text the target reads (the chat template rendered, or the plain text) and its tokens;
    a prompt that does not fit the context is refused."""
    prompts = shipped_prompts() if prompts is None else prompts
    mode = prompt_mode(session, raw)
    template: ChatTemplate | None = None
    out: list[tuple[str, str, list[int]]] = []
    for p in prompts:
        if p.messages is None and mode == RAW:
            assert p.text is not None
            out.append((p.name, p.text, session.target.tokenize(p.text, add_special=True)))
            continue
        if p.messages is not None and raw:
            raise UsageError(f"prompt {p.name!r} is a conversation (messages): it needs the chat template, "
                                 "so it cannot run with --raw")
        template = template or ChatTemplate.for_model(session.target)
        messages = list(p.messages) if p.messages is not None else [{"role": "user", "content": p.text or ""}]
        text = template.render(messages)
        out.append((p.name, text, encode_chat(session.target, text)))
    too_long = [name for name, _, tokens in out if len(tokens) >= session.engine.n_ctx]
    if too_long:
        raise UsageError(f"prompt {too_long[0]!r} does not fit the context of {session.engine.n_ctx} tokens "
                             "(--ctx raises it)")
    return out


@dataclass
class RunResult:
    """One measured run: the engine's stats summed over the prompt set, and each prompt's tokens."""

    mode: str
    index: int
    stats: GenerationStats
    prefill_tps: float  # median over the prompts that processed any prompt tokens
    outputs: dict[str, list[int]] = field(repr=False)
    aside: str | None = None  # why drafting stood aside at the run's last generation's end (`DoneEvent.aside`)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "index": self.index, "prefill_tps": self.prefill_tps, **self.stats.as_dict(),
                "aside": self.aside}


@dataclass(frozen=True)
class ModeSummary:
    mode: str
    runs: int
    median_tps: float
    min_tps: float
    max_tps: float
    acceptance_rate: float
    mean_accepted: float
    host_fraction: float  # share of decode time spent outside llama_decode
    ahead_hit_rate: float | None = None  # draft-ahead: share of the rounds drafted ahead that were used (None: off)
    # `[draft] stand_aside`: the share of rounds that drafted nothing because drafting was priced below plain
    # decoding, and why (the last run's reason; None: it drafted at the end)
    stood_aside: float = 0.0
    aside: str | None = None
    # Runs that decoded no token (every prompt's reply ended at its first: at T > 0 some seeds draw the end of
    # generation there), which have no decode rate: left out of the median, min and max, and counted here. Counted
    # as 0 tok/s they dragged a mode's median down by whichever seeds drew the end in that mode.
    empty_runs: int = 0
    # Tokens drafted a round, over the rounds that drafted: the length the drafter and its price chose round by
    # round (a lookup match's end, DSpark's confidence head, p_min, the cost rule), at most the draft length
    mean_drafted: float = 0.0

    @classmethod
    def of(cls, mode: str, runs: list[RunResult]) -> ModeSummary:
        timed = [r.stats.decode_tps for r in runs if r.stats.tokens > 0]
        tps = timed or [0.0]
        total = GenerationStats.total(r.stats for r in runs)
        return cls(
            mode=mode, runs=len(runs), median_tps=statistics.median(tps), min_tps=min(tps), max_tps=max(tps),
            empty_runs=len(runs) - len(timed),
            acceptance_rate=total.acceptance_rate, mean_accepted=total.mean_accepted,
            host_fraction=total.host_fraction, ahead_hit_rate=total.ahead_hit_rate if total.ahead_made else None,
            stood_aside=total.stood_aside / total.rounds if total.rounds else 0.0, aside=runs[-1].aside,
            mean_drafted=statistics.mean(drafting) if (drafting := [n for n in total.draft_lengths if n]) else 0.0,
        )

    @property
    def standing_aside(self) -> str | None:
        """One line when drafting stood aside in most rounds (`[draft] stand_aside`), with the measured reason."""
        if self.stood_aside < 0.5:
            return None
        why = f": {self.aside}" if self.aside else ""
        return f"drafting stood aside in {self.stood_aside:.0%} of rounds (plain decoding's steps){why}"


@dataclass(frozen=True)
class Divergence:
    """A speculative token that the target alone, decoding the same prefix one token at a time, did not choose."""

    position: int  # index in the speculative output
    emitted: int | None  # the speculative token there (None: the speculative run ended its generation there)
    single: int  # the single-token row's argmax: what plain decoding of that prefix chooses
    margin: float  # the single-token row's top-1 minus top-2 logit: how close the call was
    runner_up: bool  # the emitted token is that row's second choice (ending there: the second is end-of-generation)

    def near_tie(self, threshold: float) -> bool:
        """Kernel noise can swap a row's top two only where they lie within `threshold` logits."""
        return self.runner_up and self.margin <= threshold


@dataclass(frozen=True)
class PromptCheck:
    """One prompt of the greedy check: speculative against single-token (plain) decoding, both at temperature 0."""

    name: str
    tokens: int  # tokens compared (the shorter output)
    first_divergence: int | None  # index of the first token where the outputs differ; None: identical
    plain_margin: float | None  # plain decoding's top-1 minus top-2 logit at that token: how close the call was
    spec_margin: float | None  # the same, in the verify row that chose the speculative token there
    # Not on the CPU: the speculative output from the first divergence on, decoded again one token at a time by
    # the target alone (`single_token_divergences`): how many positions, and where its argmax was not the token.
    redecoded: int
    divergences: list[Divergence]
    # Plain decoding's output, so other implementations' greedy output can be compared with it (bench/gpu).
    plain_tokens: list[int] = field(repr=False)
    plain_text: str = field(repr=False)
    plain_token_ends: list[int] = field(repr=False)  # character offset in plain_text where each token ends
    plain_margins: list[float] = field(repr=False)


@dataclass(frozen=True)
class GreedyCheck:
    """Greedy fidelity (docs/lossless.md). On a CPU (`exact`) a batch scores each position bit for bit as a single
    token does, so speculative output must be token-identical to plain decoding. On a GPU the logits depend on the
    batch shape (docs/gpu.md), so a speculative token may differ from what plain decoding of the same prefix
    chooses, but only at a near-tie: every emitted token is checked against the target alone decoding its prefix
    one token at a time (up to the first divergence plain decoding is that; after it, the prefix is decoded again),
    and the check fails where the emitted token is not that row's runner-up within `near_tie` logits."""

    exact: bool
    prompts: list[PromptCheck]
    near_tie: float  # logits: the preset's bench.near_tie

    @property
    def diverged(self) -> list[PromptCheck]:
        """The prompts whose speculative output left plain decoding's."""
        return [p for p in self.prompts if p.first_divergence is not None]

    @property
    def broken(self) -> list[tuple[str, Divergence]]:
        """Not on the CPU: the divergences from single-token decoding that are not near-ties (the promise broken)."""
        return [(p.name, d) for p in self.prompts for d in p.divergences if not d.near_tie(self.near_tie)]

    @property
    def passed(self) -> bool:
        return not self.diverged if self.exact else not self.broken

    def describe(self) -> str:
        """One line on the divergence from plain decoding."""
        n = len(self.prompts)
        if not self.diverged:
            return f"token-identical to plain decoding on {n} of {n} prompts"
        firsts = ", ".join(
            f"{p.name!r} at token {p.first_divergence}"
            + (f" (top-2 margin {p.plain_margin:.3f})" if p.plain_margin is not None else "")
            for p in self.diverged)
        return f"diverged from plain decoding on {len(self.diverged)} of {n} prompts: {firsts}"

    def describe_single(self) -> str:
        """Not on the CPU: one line on the check against single-token decoding of each emitted token's prefix."""
        checked = sum(p.tokens for p in self.prompts)
        found = [(p.name, d) for p in self.prompts for d in p.divergences]
        if not found:
            return f"every one of {checked} speculative tokens is the target's single-token argmax"
        broken = self.broken
        where = ", ".join(f"{name!r} at token {d.position} (margin {d.margin:.3f}"
                          + ("" if d.runner_up else f", {_what(d.emitted)} not the runner-up") + ")"
                          for name, d in (broken or found))
        if broken:
            return (f"{len(broken)} of {checked} speculative tokens are not the target's single-token choice nor a "
                    f"near-tie (runner-up within {self.near_tie:g} logits): {where}")
        return (f"{len(found)} of {checked} speculative tokens are the single-token runner-up at a near-tie "
                f"(within {self.near_tie:g} logits): {where}")

    def as_dict(self) -> dict[str, Any]:
        return {"exact": self.exact, "near_tie": self.near_tie, "passed": self.passed,
                # (bench/gpu's scripts read this name: the promise of this backend holds)
                "invariant_holds": self.passed, "diverged": len(self.diverged), "broken": len(self.broken),
                "summary": self.describe() if self.exact else f"{self.describe()}; {self.describe_single()}",
                "prompts": [dataclasses.asdict(p) for p in self.prompts]}


def _what(token: int | None) -> str:
    return "its end of generation" if token is None else f"token {token}"


@dataclass
class BenchReport:
    preset: Preset
    n_draft: int
    max_tokens: int
    plain: ModeSummary
    speculative: ModeSummary
    greedy_check: GreedyCheck
    runs: list[RunResult]
    environment: dict[str, Any]
    prompts: list[str] = field(default_factory=list)
    prompt_mode: str = RAW
    warnings: list[str] = field(default_factory=list)  # what makes these numbers doubtful (contention)

    @property
    def speedup(self) -> float:
        return self.speculative.median_tps / self.plain.median_tps if self.plain.median_tps else 0.0

    @property
    def plain_spread(self) -> tuple[float, float] | None:
        """Plain decoding's slowest and fastest run over its median: this machine's run-to-run noise (None: fewer
        than two timed runs)."""
        plain = self.plain
        if plain.runs - plain.empty_runs < 2 or not plain.median_tps:
            return None
        return plain.min_tps / plain.median_tps, plain.max_tps / plain.median_tps

    @property
    def decoded_as_plain(self) -> bool:
        """Whether the speculative runs decoded as plain decoding does (drafting stood aside in all but the judged
        rounds) and their speed stays within plain decoding's own run-to-run spread: the speedup is then noise.
        A stand-aside outside that spread is not explained away."""
        spread = self.plain_spread
        return (self.speculative.stood_aside >= ALL_ASIDE and spread is not None
                and spread[0] <= self.speedup <= spread[1])

    @property
    def verdict(self) -> str:
        aside = self.speculative.standing_aside
        stood = f"{DRAFTER_TABLE[self.preset.draft.drafter].title} does not pay here, so it stood aside"
        spread = self.plain_spread
        if aside is not None and spread is not None and self.decoded_as_plain:
            return (f"{stood} and decoded as plain decoding does: {self.speedup:.2f}x plain is this machine's "
                    f"run-to-run noise (plain decoding's own runs: {spread[0]:.2f}-{spread[1]:.2f}x their median); "
                    f"{aside}")
        if aside is not None:
            return f"{stood}: {self.speedup:.2f}x plain decoding; {aside}"
        if self.speedup >= 1.0:
            return f"speculative decoding is {self.speedup:.2f}x plain decoding on this pair and machine"
        return (f"speculative decoding is SLOWER than plain decoding on this pair and machine ({self.speedup:.2f}x): "
                "the draft does not save enough target work here")

    @property
    def advice(self) -> list[str]:
        """What the verdict means here and what to run next: one or two lines, then the command."""
        on_cpu = self.greedy_check.exact  # the CPU backend: batch and single-token logits are bitwise equal
        aside = self.speculative.standing_aside is not None  # (then no draft length would pay: no sweep to suggest)
        if self.speedup >= 1.0 and not aside:
            return [f"next: {SWEEP_NEXT} finds the best draft length here; `localspec chat` uses it"]
        if on_cpu:
            return [
                "expected on a CPU: a small target costs about as much per token as its draft, and verifying "
                f"{self.n_draft + 1} tokens in one batch costs several single-token steps, so a model draft "
                "rarely pays here.",
                "on a GPU a 32B int4 target is read once per verify batch, which is where a draft model pays: "
                "on an H100, synthetic models with the recommended pair's shapes and quant types (random weights, "
                "~85% of drafts accepted) decoded 2.2-2.4x plain (docs/performance.md); real models on an "
                "RTX 3090/4090 are not measured yet.",
                f"next: with an NVIDIA GPU, the README's GPU quick start ({GPU_NEXT})" + (
                    "" if aside else f"; on this CPU, {SWEEP_NEXT} tries shorter drafts"),
            ]
        return ["on a GPU this usually means few drafts are accepted (see accept) or a draft too large for its "
                f"target; next: {SWEEP_NEXT}, or a smaller draft of the same family"]

    def as_json(self) -> dict[str, Any]:
        return {
            "localspec_bench": 1,
            "environment": self.environment,
            "preset": self.preset.as_dict(),
            "n_draft": self.n_draft,
            "max_tokens": self.max_tokens,
            "prompts": self.prompts,
            "prompt_mode": self.prompt_mode,
            "plain": dataclasses.asdict(self.plain),
            "speculative": dataclasses.asdict(self.speculative),
            "speedup": self.speedup,
            "plain_spread": self.plain_spread,
            "decoded_as_plain": self.decoded_as_plain,
            "verdict": self.verdict,
            "advice": self.advice,
            "warnings": self.warnings,
            "greedy_check": self.greedy_check.as_dict(),
            "runs": [r.as_dict() for r in self.runs],
        }


@dataclass(frozen=True)
class WarmupStep:
    done: int
    total: int


R = TypeVar("R")


@dataclass(frozen=True)
class RunDone(Generic[R]):
    """A run finished: its result (a `RunResult`, or `versus.LlamaRun` for llama.cpp's runs), and how far along."""

    result: R
    done: int
    total: int


@dataclass(frozen=True)
class CheckStarted:
    prompts: int


@dataclass(frozen=True)
class RunProgress:
    """A measured run under way: tokens so far and their rate (wall time, prompt processing included)."""

    mode: str
    index: int
    tokens: int
    total: int  # at most this many: every prompt's max_tokens
    tok_s: float


BenchEvent = WarmupStep | RunProgress | RunDone[RunResult] | CheckStarted | BenchReport


_GENERATIONS = itertools.count()


def _first_time() -> str:
    """An owner of its own for each of the bench's generations (`DraftRequest.owner`): a drafter that keeps text
    across requests (suffix lookup) drafts a bench prompt from that prompt's own context alone, as a first request
    would be, never from the earlier runs of the same prompt (which would make it look the faster with every run;
    `bench/agent_replay.py` measures drafting from earlier requests)."""
    return f"bench generation {next(_GENERATIONS)}"


def _one_run(session: Session, prompts: list[tuple[str, list[int]]], preset: Preset, mode: str, index: int,
             max_tokens: int) -> Generator[RunProgress, None, RunResult]:
    """One run over the prompt set; yields its progress every PROGRESS_EVERY_S and returns its result. A measured
    run (`index` >= 0, its repetition) samples with that repetition's seed (`Sampling.repetition`), whatever its
    mode; a warm-up (-1) with the preset's."""
    drafting = preset.draft if mode == SPEC else dataclasses.replace(preset.draft, n_draft=0)
    sampling = preset.sampling.repetition(max(index, 0))
    outputs: dict[str, list[int]] = {}
    stats: list[GenerationStats] = []
    aside: str | None = None
    start = last = time.perf_counter()
    total = len(prompts) * max_tokens
    for name, prompt in prompts:
        tokens = outputs[name] = []
        for event in session.engine.generate(prompt, sampling, drafting, max_tokens, owner=_first_time()):
            if isinstance(event, DoneEvent):
                stats.append(event.stats)
                aside = event.aside
                break
            tokens.append(event.token)
            now = time.perf_counter()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                done = sum(len(t) for t in outputs.values())
                yield RunProgress(mode, index, done, total, done / (now - start))
    prefill = [s.prefill_tps for s in stats if s.prompt_tokens_processed]
    return RunResult(mode=mode, index=index, stats=GenerationStats.total(stats),
                     prefill_tps=statistics.median(prefill) if prefill else 0.0, outputs=outputs, aside=aside)


def greedy_check(session: Session, prompts: list[tuple[str, list[int]]], preset: Preset, max_tokens: int, *,
                 exact: bool | None = None) -> GreedyCheck:
    """Plain and speculative decoding at temperature 0 of every prompt, traced (see GreedyCheck). `exact`: whether
    to demand identity with plain decoding (None: on the CPU backend); else each emitted token is checked against
    single-token decoding of its prefix."""
    exact = not session.target.on_gpu if exact is None else exact
    sampling = dataclasses.replace(preset.sampling, temperature=0.0)
    plain_drafting = dataclasses.replace(preset.draft, n_draft=0)
    checks = []
    for name, prompt in prompts:
        plain = collect(session.engine.generate(prompt, sampling, plain_drafting, max_tokens, trace=True,
                                                owner=_first_time()))
        spec = collect(session.engine.generate(prompt, sampling, preset.draft, max_tokens, trace=True,
                                               owner=_first_time()))
        n = min(len(plain.tokens), len(spec.tokens))
        first = next((i for i in range(n) if plain.tokens[i] != spec.tokens[i]), None)
        if first is None and len(plain.tokens) != len(spec.tokens):
            first = n
        ended = spec.done.stop_reason == STOP_EOG
        # Up to its first divergence the speculative output is plain decoding's, which is single-token decoding.
        redo = [] if exact or first is None else list(range(first, len(spec.tokens) + ended))
        text, ends = _text_with_ends(session, plain.tokens)
        checks.append(PromptCheck(
            name=name, tokens=n, first_divergence=first,
            plain_margin=plain.trace[first][1] if first is not None and first < len(plain.trace) else None,
            spec_margin=spec.trace[first][1] if first is not None and first < len(spec.trace) else None,
            redecoded=len(redo),
            divergences=single_token_divergences(session, prompt, spec.tokens, redo, sampling, preset.draft),
            plain_tokens=plain.tokens, plain_text=text, plain_token_ends=ends,
            plain_margins=[margin for _, margin in plain.trace],
        ))
    return GreedyCheck(exact=exact, prompts=checks, near_tie=preset.bench.near_tie)


def single_token_divergences(session: Session, prompt: list[int], emitted: list[int], positions: list[int],
                             sampling: Sampling, drafting: Drafting) -> list[Divergence]:
    """Each of `positions` of a greedy output (`emitted`; position len(emitted): where it ended its generation)
    decoded again by the target alone as plain decoding reads it: the prefix in the cells, its last token decoded
    by itself (each next prefix reuses the cells, so a position costs one single-token decode). Returns where the
    row's argmax is not the emitted token, with the row's top-1 minus top-2 margin and whether the emitted token
    was its runner-up."""
    engine = session.engine
    plain = dataclasses.replace(drafting, n_draft=0)
    found = []
    for i in positions:
        # The row in full (logprobs: its two best, in float64 over the whole row), whatever the device sampler.
        stream = engine.start([*prompt, *emitted[:i]], sampling, plain, 1, logprobs=2)
        try:
            engine.step([stream])
            verdict = stream.verdict
            for _ in stream.events():
                pass
        finally:
            stream.slot.busy = False
        single = verdict.emitted[0]
        _, top = verdict.logprobs[0]
        token = emitted[i] if i < len(emitted) else None
        if not _is(token, single, engine.token_is_eog):
            margin = top[0][1] - top[1][1] if len(top) > 1 else math.inf
            found.append(Divergence(position=i, emitted=token, single=single, margin=margin,
                                    runner_up=len(top) > 1 and _is(token, top[1][0], engine.token_is_eog)))
    return found


def _is(emitted: int | None, token: int, is_eog: Callable[[int], bool]) -> bool:
    """Whether a row's `token` is the emitted one (None: the output ended there, which any end-of-generation
    token does)."""
    return is_eog(token) if emitted is None else token == emitted


def _text_with_ends(session: Session, tokens: list[int]) -> tuple[str, list[int]]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, ends = "", []
    for token in tokens:
        text += decoder.decode(session.target.piece(token))
        ends.append(len(text))
    return text, ends


def run_bench(session: Session, preset: Preset, prompts: list[BenchPrompt] | None = None,
              raw: bool = False) -> Iterator[BenchEvent]:
    """Warm up, then `preset.bench.repeat` plain and speculative runs, interleaved; then the greedy check."""
    if preset.draft.drafter not in session.engine.drafters:
        raise UsageError("bench compares plain with speculative decoding: it needs a draft model "
                         "(or --drafter lookup)")
    settings = preset.bench
    kind = prompt_mode(session, raw)
    prompts = tokenize_prompts(session, prompts, raw)
    load_before = machine.load_average()
    for i in range(settings.warmup):
        mode = SPEC if i % 2 else PLAIN
        name, prompt = prompts[i % len(prompts)]
        yield from _one_run(session, [(name, prompt)], preset, mode, -1, WARMUP_TOKENS)
        yield WarmupStep(i + 1, settings.warmup)

    runs: list[RunResult] = []
    total = 2 * settings.repeat
    for i in range(settings.repeat):
        for mode in (PLAIN, SPEC) if i % 2 == 0 else (SPEC, PLAIN):
            result = yield from _one_run(session, prompts, preset, mode, i, settings.max_tokens)
            runs.append(result)
            yield RunDone(result, len(runs), total)

    plain_runs = [r for r in runs if r.mode == PLAIN]
    spec_runs = [r for r in runs if r.mode == SPEC]
    # Apart from the timed runs, at any temperature: the check's trace asks the device for candidates, not only
    # the argmax, and sampled outputs differ run to run by design.
    warnings = contention(session.target.n_threads, machine.physical_cores(), load_before, machine.load_average(),
                          [r.stats.decode_tps for r in plain_runs])
    yield CheckStarted(len(prompts))
    check = greedy_check(session, prompts, preset, settings.max_tokens)

    yield BenchReport(
        preset=preset, n_draft=preset.draft.n_draft, max_tokens=settings.max_tokens,
        plain=ModeSummary.of(PLAIN, plain_runs), speculative=ModeSummary.of(SPEC, spec_runs),
        greedy_check=check, runs=runs, environment=environment(session),
        prompts=[name for name, _ in prompts], prompt_mode=kind, warnings=warnings,
    )


def contention(threads: int, cores: int, load_before: float | None, load_after: float | None,
               plain_tps: list[float]) -> list[str]:
    """Signs that other programs competed for the cores during the runs, each with what to do about it.

    The load average after the runs counts this process's own threads; what is left over was someone else's.
    Plain decoding does the same work every run, so a wide spread between its runs means the machine was not
    ours alone either.
    """
    warnings = []
    if load_after is not None:
        others = max(0.0, load_after - threads)
        if threads + round(others) > cores:
            rose = f" (from {load_before:.1f})" if load_before is not None and others > load_before + 0.5 else ""
            fewer = max(1, cores - round(others))
            hint = f", or with --threads {fewer}" if fewer < threads else ""
            warnings.append(
                f"the load average was {load_after:.1f}{rose} on {cores} physical cores with {threads} "
                f"thread{'s' * (threads != 1)} of ours: other programs competed for the cores, so these numbers "
                f"are low and noisy; rerun on a quieter machine{hint}")
    if len(plain_tps) >= 2 and min(plain_tps) > 0 and max(plain_tps) / min(plain_tps) > NOISY_SPREAD:
        warnings.append(f"plain decoding ran between {min(plain_tps):.1f} and {max(plain_tps):.1f} tok/s from run to "
                        "run: something else was using the CPU; the medians are less certain than usual")
    return warnings


def environment(session: Session) -> dict[str, Any]:
    """Versions, hardware and model files, for the JSON report (so numbers can be compared honestly)."""
    from localspec.llama.backend import supports_gpu_offload, system_info

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    def model(m: Any) -> dict[str, Any] | None:
        if m is None:
            return None
        return {"path": str(m.path), "bytes": m.path.stat().st_size, "n_vocab": m.n_vocab, "n_ctx": m.n_ctx,
                "n_gpu_layers": m.n_gpu_layers, "kv_type": m.kv_type}

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "localspec": __version__,
        "llama_cpp_python": version("llama-cpp-python"),
        "llama_cpp_system_info": system_info(),
        "gpu_offload": supports_gpu_offload(),
        **gpus(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": machine.cpu_name(),
        "cpu_cores_physical": machine.physical_cores(),
        "cpu_threads": session.target.n_threads,
        "cpu_threads_chosen": threads_line(session),
        "ram_bytes": machine.ram_total(),
        "pair": session.files.name,
        "target": model(session.target),
        "draft": model(session.draft),
        "placement": placement(session),
    }


def gpus() -> dict[str, Any]:
    """The report's `gpus`: each NVIDIA GPU's name, driver and VRAM (NVML), and `gpu_notes`: why none was read."""
    notes: list[str] = []
    found = [{"index": g.index, "name": g.name, "driver": g.driver, "vram_total_bytes": g.total,
              "vram_free_bytes": g.free} for g in machine.nvidia_gpus(notes)]
    return {"gpus": found, "gpu_notes": notes}


def threads_line(session: Session) -> str:
    """How many CPU threads the models use and why: bench's header line and its JSON."""
    if session.threads is not None:
        return f"{session.threads.describe()} (--threads N sets it)"
    return f"{session.target.n_threads} (set by --threads or the preset's load.threads)"


def placement(session: Session) -> dict[str, Any]:
    """Where each model runs and whether the draft drafts ahead: bench's header line and its JSON."""
    plan = session.plan
    return {"target": plan.target.describe() if plan else None,
            "draft": plan.draft.describe() if plan and session.draft else None,
            "drafter": session.preset.draft.drafter,
            "target_devices": [d.name for d in session.target.devices],
            "draft_devices": [d.name for d in session.draft.devices] if session.draft else [],
            "draft_ahead": session.engine.draft_ahead}


# -- draft-length sweep -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepRow:
    n_draft: int  # 0 = plain decoding (the baseline row)
    summary: ModeSummary
    # The preset's own policy at its draft length (standing aside where drafting loses: `[draft] stand_aside`),
    # beside the fixed lengths, which always draft
    default: bool = False


@dataclass
class SweepReport:
    preset: Preset
    rows: list[SweepRow]
    environment: dict[str, Any]

    @property
    def plain_tps(self) -> float:
        return next(r.summary.median_tps for r in self.rows if r.n_draft == 0)

    @property
    def best(self) -> SweepRow:
        """The fastest fixed draft length."""
        return max((r for r in self.rows if r.n_draft > 0 and not r.default), key=lambda r: r.summary.median_tps)

    @property
    def default(self) -> SweepRow | None:
        """The preset's own policy's row (None: the preset always drafts its length, a fixed row already)."""
        return next((r for r in self.rows if r.default), None)

    def as_json(self) -> dict[str, Any]:
        default = self.default
        return {
            "localspec_sweep": 1,
            "environment": self.environment,
            "preset": self.preset.as_dict(),
            "rows": [{"n_draft": r.n_draft, "policy": "default" if r.default else "fixed",
                      **dataclasses.asdict(r.summary),
                      "speedup": r.summary.median_tps / self.plain_tps if self.plain_tps else 0.0}
                     for r in self.rows],
            "best_n_draft": self.best.n_draft,
            "default_over_best_fixed": default.summary.median_tps / self.best.summary.median_tps
            if default is not None and self.best.summary.median_tps else None,
        }


SweepEvent = WarmupStep | RunProgress | RunDone[RunResult] | SweepReport


def run_sweep(session: Session, preset: Preset, lengths: list[int], prompts: list[BenchPrompt] | None = None,
              raw: bool = False) -> Iterator[SweepEvent]:
    """Median tok/s per draft length (plus plain decoding as the baseline), the k values interleaved per repeat."""
    if preset.draft.drafter not in session.engine.drafters:
        raise UsageError("a draft-length sweep needs a draft model (or --drafter lookup)")
    settings = preset.bench
    prompts = tokenize_prompts(session, prompts, raw)
    for i in range(settings.warmup):
        yield from _one_run(session, [prompts[i % len(prompts)]], preset, SPEC if i % 2 else PLAIN, -1,
                            WARMUP_TOKENS)
        yield WarmupStep(i + 1, settings.warmup)
    # Fixed lengths always draft; the preset's own policy (standing aside where drafting loses) is a row of its own,
    # "default", so the sweep shows what it gives up against the best fixed length (-1 below).
    ks = [0, *sorted(set(lengths) - {0})]
    if preset.draft.stand_aside and preset.draft.n_draft > 0:
        ks.append(-1)
    by_k: dict[int, list[RunResult]] = {k: [] for k in ks}
    total = settings.repeat * len(ks)
    done = 0
    for i in range(settings.repeat):
        for k in ks if i % 2 == 0 else reversed(ks):
            drafting = preset.draft if k < 0 else dataclasses.replace(preset.draft, n_draft=k, stand_aside=False)
            tuned = dataclasses.replace(preset, draft=drafting)
            result = yield from _one_run(session, prompts, tuned, SPEC if k else PLAIN, i, settings.max_tokens)
            by_k[k].append(result)
            done += 1
            yield RunDone(result, done, total)
    rows = [SweepRow(preset.draft.n_draft, ModeSummary.of("default", by_k[k]), default=True) if k < 0 else
            SweepRow(k, ModeSummary.of(f"k={k}" if k else PLAIN, by_k[k])) for k in ks]
    yield SweepReport(preset=preset, rows=rows, environment=environment(session))
