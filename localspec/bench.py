"""`localspec bench` as a library: warm-up, interleaved measured runs, medians, a JSON-ready report.

It yields progress events and returns data; the CLI draws them. A run generates `max_tokens` for every prompt of
the shipped prompt set; its tok/s is all generated tokens over all decode time (prompt processing is reported
apart). Plain (k = 0) and speculative runs alternate, so drifting clocks or thermals hit both modes alike.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from localspec import __version__
from localspec.config import Drafting, Preset
from localspec.engine import DoneEvent, GenerationStats, TokenEvent
from localspec.errors import UsageError
from localspec.session import Session

# Code, prose and Q&A: acceptance differs by kind of text, so the set mixes them.
PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test.\n"),
    ("prose", "Write a short story about a lighthouse keeper who finds a message in a bottle.\n"),
    ("qa", "Question: Why is the sky blue? Explain it simply, step by step.\nAnswer:"),
)
WARMUP_TOKENS = 16
PLAIN, SPEC = "plain", "speculative"


@dataclass
class RunResult:
    mode: str
    index: int
    tokens: int
    decode_s: float
    drafted: int
    accepted: int
    rounds: int
    draft_s: float
    verify_s: float
    host_s: float
    prefill_tps: float
    outputs: dict[str, list[int]] = field(repr=False)

    @property
    def decode_tps(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0


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

    @classmethod
    def of(cls, mode: str, runs: list[RunResult]) -> ModeSummary:
        tps = [r.decode_tps for r in runs]
        drafted = sum(r.drafted for r in runs)
        rounds = sum(r.rounds for r in runs)
        decode = sum(r.decode_s for r in runs)
        return cls(
            mode=mode, runs=len(runs), median_tps=statistics.median(tps), min_tps=min(tps), max_tps=max(tps),
            acceptance_rate=sum(r.accepted for r in runs) / drafted if drafted else 0.0,
            mean_accepted=sum(r.accepted for r in runs) / rounds if rounds else 0.0,
            host_fraction=sum(r.host_s for r in runs) / decode if decode else 0.0,
        )


@dataclass(frozen=True)
class GreedyCheck:
    identical: bool
    first_mismatch: str | None  # "prompt 'code', token 17: plain 1234 vs speculative 99"


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

    @property
    def speedup(self) -> float:
        return self.speculative.median_tps / self.plain.median_tps if self.plain.median_tps else 0.0

    @property
    def verdict(self) -> str:
        if self.speedup >= 1.0:
            return f"speculative decoding is {self.speedup:.2f}x plain decoding on this pair and machine"
        return (f"speculative decoding is SLOWER than plain decoding on this pair and machine ({self.speedup:.2f}x): "
                "the draft does not save enough target work here")

    def as_json(self) -> dict[str, Any]:
        def run_dict(r: RunResult) -> dict[str, Any]:
            d = {k: v for k, v in dataclasses.asdict(r).items() if k != "outputs"}
            d.update(decode_tps=r.decode_tps, acceptance_rate=r.acceptance_rate, mean_accepted=r.mean_accepted)
            return d

        return {
            "localspec_bench": 1,
            "environment": self.environment,
            "preset": self.preset.as_dict(),
            "n_draft": self.n_draft,
            "max_tokens": self.max_tokens,
            "prompts": [name for name, _ in PROMPTS],
            "plain": dataclasses.asdict(self.plain),
            "speculative": dataclasses.asdict(self.speculative),
            "speedup": self.speedup,
            "verdict": self.verdict,
            "greedy_check": dataclasses.asdict(self.greedy_check),
            "runs": [run_dict(r) for r in self.runs],
        }


@dataclass(frozen=True)
class WarmupStep:
    done: int
    total: int


@dataclass(frozen=True)
class RunDone:
    result: RunResult
    done: int
    total: int


@dataclass(frozen=True)
class CheckStarted:
    prompts: int


BenchEvent = WarmupStep | RunDone | CheckStarted | BenchReport


def _generate(session: Session, prompt: list[int], preset: Preset, drafting: Drafting,
              max_tokens: int) -> tuple[list[int], GenerationStats]:
    tokens: list[int] = []
    stats = GenerationStats()
    for event in session.engine.generate(prompt, preset.sampling, drafting, max_tokens):
        if isinstance(event, TokenEvent):
            tokens.append(event.token)
        elif isinstance(event, DoneEvent):
            stats = event.stats
    return tokens, stats


def _one_run(session: Session, prompts: list[tuple[str, list[int]]], preset: Preset, mode: str, index: int,
             max_tokens: int) -> RunResult:
    drafting = preset.draft if mode == SPEC else dataclasses.replace(preset.draft, n_draft=0)
    totals = GenerationStats()
    outputs: dict[str, list[int]] = {}
    prefill_tps = []
    for name, prompt in prompts:
        out, s = _generate(session, prompt, preset, drafting, max_tokens)
        outputs[name] = out
        for key in ("tokens", "drafted", "accepted", "rounds", "draft_s", "verify_s", "decode_s"):
            setattr(totals, key, getattr(totals, key) + getattr(s, key))
        if s.prompt_tokens_processed:
            prefill_tps.append(s.prefill_tps)
    return RunResult(
        mode=mode, index=index, tokens=totals.tokens, decode_s=totals.decode_s, drafted=totals.drafted,
        accepted=totals.accepted, rounds=totals.rounds, draft_s=totals.draft_s, verify_s=totals.verify_s,
        host_s=totals.host_s, prefill_tps=statistics.median(prefill_tps) if prefill_tps else 0.0, outputs=outputs,
    )


def _compare(plain: dict[str, list[int]], spec: dict[str, list[int]]) -> GreedyCheck:
    for name, a in plain.items():
        b = spec[name]
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return GreedyCheck(False, f"prompt {name!r}, token {i}: plain {x} vs speculative {y}")
        if len(a) != len(b):
            return GreedyCheck(False, f"prompt {name!r}: plain made {len(a)} tokens, speculative {len(b)}")
    return GreedyCheck(True, None)


def tokenize_prompts(session: Session) -> list[tuple[str, list[int]]]:
    return [(name, session.target.tokenize(text, add_special=True)) for name, text in PROMPTS]


def run_bench(session: Session, preset: Preset) -> Iterator[BenchEvent]:
    """Warm up, then `preset.bench.repeat` plain and speculative runs, interleaved; then the greedy check."""
    if session.draft is None:
        raise UsageError("bench compares plain with speculative decoding: it needs a draft model")
    settings = preset.bench
    prompts = tokenize_prompts(session)
    for i in range(settings.warmup):
        mode = SPEC if i % 2 else PLAIN
        name, prompt = prompts[i % len(prompts)]
        _one_run(session, [(name, prompt)], preset, mode, -1, WARMUP_TOKENS)
        yield WarmupStep(i + 1, settings.warmup)

    runs: list[RunResult] = []
    total = 2 * settings.repeat
    for i in range(settings.repeat):
        for mode in (PLAIN, SPEC) if i % 2 == 0 else (SPEC, PLAIN):
            result = _one_run(session, prompts, preset, mode, i, settings.max_tokens)
            runs.append(result)
            yield RunDone(result, len(runs), total)

    plain_runs = [r for r in runs if r.mode == PLAIN]
    spec_runs = [r for r in runs if r.mode == SPEC]
    if preset.sampling.greedy:
        check = _compare(plain_runs[0].outputs, spec_runs[0].outputs)
    else:
        # Sampled outputs differ run to run by design; losslessness is checked at temperature 0.
        yield CheckStarted(len(prompts))
        greedy = dataclasses.replace(preset, sampling=dataclasses.replace(preset.sampling, temperature=0.0))
        plain = _one_run(session, prompts, greedy, PLAIN, 0, settings.max_tokens)
        spec = _one_run(session, prompts, greedy, SPEC, 0, settings.max_tokens)
        check = _compare(plain.outputs, spec.outputs)

    yield BenchReport(
        preset=preset, n_draft=preset.draft.n_draft, max_tokens=settings.max_tokens,
        plain=ModeSummary.of(PLAIN, plain_runs), speculative=ModeSummary.of(SPEC, spec_runs),
        greedy_check=check, runs=runs, environment=environment(session),
    )


def environment(session: Session) -> dict[str, Any]:
    """Versions, hardware and model files, for the JSON report (so numbers can be compared honestly)."""
    import llama_cpp
    import psutil

    from localspec.llama_ctx import supports_gpu_offload

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
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "gpu_offload": supports_gpu_offload(),
        "gpus": gpu_names(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "cpu_threads": session.target.n_threads,
        "ram_bytes": psutil.virtual_memory().total,
        "pair": session.files.name,
        "target": model(session.target),
        "draft": model(session.draft),
    }


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one (platform.processor() is empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """NVIDIA GPUs seen through NVML; empty without a driver (the normal case on CPU machines)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else name)
        return names
    finally:
        pynvml.nvmlShutdown()


# -- draft-length sweep -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepRow:
    n_draft: int  # 0 = plain decoding (the baseline row)
    summary: ModeSummary


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
        return max((r for r in self.rows if r.n_draft > 0), key=lambda r: r.summary.median_tps)

    def as_json(self) -> dict[str, Any]:
        return {
            "localspec_sweep": 1,
            "environment": self.environment,
            "preset": self.preset.as_dict(),
            "rows": [{"n_draft": r.n_draft, **dataclasses.asdict(r.summary),
                      "speedup": r.summary.median_tps / self.plain_tps if self.plain_tps else 0.0}
                     for r in self.rows],
            "best_n_draft": self.best.n_draft,
        }


SweepEvent = WarmupStep | RunDone | SweepReport


def run_sweep(session: Session, preset: Preset, lengths: list[int]) -> Iterator[SweepEvent]:
    """Median tok/s per draft length (plus plain decoding as the baseline), the k values interleaved per repeat."""
    if session.draft is None:
        raise UsageError("a draft-length sweep needs a draft model")
    settings = preset.bench
    prompts = tokenize_prompts(session)
    for i in range(settings.warmup):
        _one_run(session, [prompts[i % len(prompts)]], preset, SPEC if i % 2 else PLAIN, -1, WARMUP_TOKENS)
        yield WarmupStep(i + 1, settings.warmup)
    ks = [0, *sorted(set(lengths) - {0})]
    by_k: dict[int, list[RunResult]] = {k: [] for k in ks}
    total = settings.repeat * len(ks)
    done = 0
    for i in range(settings.repeat):
        for k in ks if i % 2 == 0 else reversed(ks):
            tuned = dataclasses.replace(preset, draft=dataclasses.replace(preset.draft, n_draft=k))
            result = _one_run(session, prompts, tuned, SPEC if k else PLAIN, i, settings.max_tokens)
            by_k[k].append(result)
            done += 1
            yield RunDone(result, done, total)
    rows = [SweepRow(k, ModeSummary.of(f"k={k}" if k else PLAIN, by_k[k])) for k in ks]
    yield SweepReport(preset=preset, rows=rows, environment=environment(session))
