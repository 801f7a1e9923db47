"""Host milliseconds per speculative round (the round's time outside llama_decode), and where they go.

    python bench/host_share.py --target T.gguf [--draft D.gguf] [--drafter model|lookup|chain]
        [--temperature 0.7] [--k 6] [--rounds 300] [--prompt-tokens 24] [--threads 1] [--profile 25] [--json OUT]
        [--draft-ahead on|off] [--draft-ahead-length full|fit]

Runs one stream through `Engine.step` for `--rounds` rounds (after a few warm-up rounds) and reports the stats'
split (`GenerationStats`: draft_s, verify_s, host_s = the rest), per round. With a tiny pair the decodes are short,
so the host side shows; its Python and numpy costs are the ones a GPU round pays beside its kernels. The device
candidates are what a GPU run gets (`device_top_k`, top-64 per row), where this llama.cpp build can run them.
`--profile N` then runs the same rounds again under cProfile and prints the N costliest functions by own time
(llama_decode included, so the host functions can be read against it). `--drafter lookup` needs no draft model
(prompt lookup's host work per round: `--prompt-tokens` sets the context it searches); `--k 0` is plain decoding.
The prompt is random token ids, or (`--prompts shipped|lookup --max-tokens 128`) bench's prompt set through the
chat template, one generation after another.

`--draft-ahead on` drafts ahead beside each verify and `--draft-ahead-length full|fit` sets how far (both overlay the
preset, as bench's options do; on a CPU the two threads then compete for its cores). Host time is then also
outside the wait for the draft-ahead thread (`ahead_wait_ms`). The CPU figures are the loop's thread's:
`host_cpu_split_ms` splits them by the round's phases (plan; draft: the drafter's call on the path, a kept bet's
continuation included; verify: the batch, the draft-ahead's start, the acceptance; rewind: the rest, the
drafter's verdict and the cost model's observation); `cost_model_cpu_ms` is the part of it in the draft-length
policy (its questions and observations, every phase), and `ahead_cpu_ms` the draft-ahead thread's CPU time a round
(its decodes included).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp  # noqa: F401, I001  -- before numpy (docs/gpu.md)
import numpy as np

from localspec.config import Drafting, Sampling, load_preset
from localspec.drafters.model import ModelCost, ModelDrafter
from localspec.fsutil import atomic_write
from localspec.rounds.engine import Engine
from localspec.rounds.events import GenerationStats
from localspec.rounds.policies import DraftLength
from localspec.sessions.bench import shipped_prompts, tokenize_prompts
from localspec.sessions.session import ModelFiles, open_session


class _DecodeClock:
    """This thread's CPU seconds inside the models' decodes (the same boundary as draft_s and verify_s): the host
    side's CPU time is the round's minus these. CPU time, unlike wall time, does not count the moments a busy box
    gives the CPU to someone else, nor the loop's waits (for the draft-ahead thread, for the GIL).

    `seconds`: "inside", the loop thread's decodes only; with draft-ahead, "ahead" is the draft-ahead thread's CPU
    time (decodes included); per phase of the round (`PHASES`), the loop thread's CPU time outside the decodes; and
    "cost_model" its CPU time in the draft-length policy's questions and observations (all phases)."""

    PHASES = ("_plan", "_draft", "_verify")  # (the rest of a round: the rewind, the verdict, the observations)
    COST_MODEL = ((DraftLength, "next"), (DraftLength, "verify_width"), (ModelCost, "draft_ahead_length"),
                  (ModelCost, "continuation"), (DraftLength, "observe"), (ModelCost, "observe_draft_ahead"))

    def __init__(self, engine: Engine) -> None:
        self.seconds = dict.fromkeys(("inside", "ahead", "cost_model", *self.PHASES), 0.0)
        self._loop = threading.get_ident()
        for model in {id(m): m for m in engine.models}.values():  # (a drafter's model may be listed twice)
            model.decode_many = self._timed(model.decode_many, "inside")  # type: ignore[method-assign]
        for drafter in {id(d): d for d in engine.drafters.values() if isinstance(d, ModelDrafter)}.values():
            drafter._draft_ahead_job = self._timed(drafter._draft_ahead_job, "ahead",  # type: ignore[method-assign]
                                               loop_only=False)
        for name in self.PHASES:  # (planning is the schedule's, drafting and verifying the engine's)
            owner, attr = (engine.schedule, "plan") if name == "_plan" else (engine, name)
            setattr(owner, attr, self._timed(getattr(owner, attr), name, outside_decodes=True))
        for cls, name in self.COST_MODEL:  # (the class's: a stream's policy is made when it starts)
            setattr(cls, name, self._timed(getattr(cls, name), "cost_model"))

    @property
    def inside(self) -> float:
        return self.seconds["inside"]

    def _timed(self, method: Callable, key: str, loop_only: bool = True, outside_decodes: bool = False) -> Callable:
        """`method`, its CPU seconds added to `seconds[key]` (the loop thread's only, unless not `loop_only`;
        less the decodes inside it with `outside_decodes`)."""
        def timed(*args, **kwargs):
            if loop_only and threading.get_ident() != self._loop:
                return method(*args, **kwargs)
            t, inside = time.thread_time(), self.inside
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[key] += time.thread_time() - t - (self.inside - inside if outside_decodes else 0.0)
        return timed


@dataclasses.dataclass
class _PerRound:
    """Each measured round's host milliseconds: wall (outside the decodes and the draft-ahead wait) and this
    thread's CPU time, its split by phase, the wait, and the draft-ahead thread's CPU time."""

    host_ms: list[float] = dataclasses.field(default_factory=list)
    host_cpu_ms: list[float] = dataclasses.field(default_factory=list)
    split_ms: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    wait_ms: list[float] = dataclasses.field(default_factory=list)
    cost_model_ms: list[float] = dataclasses.field(default_factory=list)
    ahead_cpu_ms: list[float] = dataclasses.field(default_factory=list)


def _rounds(engine: Engine, clock: _DecodeClock, args: argparse.Namespace, sampling: Sampling, drafting: Drafting,
            per: _PerRound, prompts: list[list[int]]) -> GenerationStats:
    """`--rounds` rounds after the warm-up, the prompts' generations one after another (each at most
    `--max-tokens`); each round's figures go to `per`."""
    engine.reset()
    total = GenerationStats()
    rounds, wall_s = 0, 0.0
    counted = ("draft_s", "verify_s", "ahead_wait_s")  # the wall time that is not host time
    for prompt in prompts:
        stream = engine.start(prompt, sampling, drafting, args.max_tokens)
        stats = stream.stats
        before = dataclasses.replace(stats, draft_lengths=[])
        while not stream.finished and rounds < args.warmup + args.rounds:
            if rounds == args.warmup:  # the warm-up's rounds leave the totals
                before = dataclasses.replace(stats, draft_lengths=[])
            wall, cpu = time.perf_counter(), time.thread_time()
            not_host, seconds = sum(getattr(stats, f) for f in counted), dict(clock.seconds)
            waited = stats.ahead_wait_s
            engine.step([stream])
            list(stream.events())
            rounds += 1
            if rounds > args.warmup:
                wall_s += time.perf_counter() - wall  # (rounds only: a prompt's prefill is no round)
                spent = {key: 1e3 * (clock.seconds[key] - seconds[key]) for key in seconds}
                host_cpu = 1e3 * (time.thread_time() - cpu) - spent["inside"]
                per.host_ms.append(1e3 * (time.perf_counter() - wall
                                          - (sum(getattr(stats, f) for f in counted) - not_host)))
                per.host_cpu_ms.append(host_cpu)
                split = {name.lstrip("_"): spent[name] for name in clock.PHASES}
                split["rewind"] = host_cpu - sum(split.values())
                for name, ms in split.items():
                    per.split_ms.setdefault(name, []).append(ms)
                per.wait_ms.append(1e3 * (stats.ahead_wait_s - waited))
                per.cost_model_ms.append(spent["cost_model"])
                per.ahead_cpu_ms.append(spent["ahead"])
        if rounds > args.warmup:
            total += GenerationStats(**{f: getattr(stats, f) - getattr(before, f) for f in (
                "tokens", "rounds", "drafted", "accepted", "draft_s", "verify_s", "ahead_made", "ahead_kept",
                "ahead_s", "ahead_wait_s")})
    return dataclasses.replace(total, decode_s=wall_s)


def _prompts(session, args: argparse.Namespace) -> list[list[int]]:
    """Random token ids (`--prompt-tokens` of them), or a shipped bench set through the chat template."""
    if args.prompts == "random":
        return [np.random.default_rng(3).integers(100, 4000, size=args.prompt_tokens).tolist()]
    return [tokens for _, tokens in tokenize_prompts(session, shipped_prompts(args.prompts))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="host_share.py", description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, help="the draft model (--drafter model or chain)")
    p.add_argument("--drafter", choices=("model", "lookup", "chain"), default="model")
    for name, default in (("--temperature", 0.7), ("--k", 6), ("--rounds", 300), ("--warmup", 10),
                          ("--threads", 1), ("--ctx", 2048), ("--prompt-tokens", 24)):
        p.add_argument(name, type=type(default), default=default)
    p.add_argument("--prompts", choices=("random", "shipped", "lookup"), default="random",
                   help="random ids (one generation of --rounds), or a bench set: its prompts one after another")
    p.add_argument("--max-tokens", type=int, default=10**6, help="per prompt (with a bench set: 128 is bench's)")
    p.add_argument("--draft-ahead", choices=("auto", "on", "off"), help="draft ahead beside the verify (preset's)")
    p.add_argument("--draft-ahead-length", choices=("full", "fit"), help="how far it drafts ahead (preset's)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="then cProfile the rounds: N functions")
    p.add_argument("--sort", default="tottime", help="--profile: pstats sort key (tottime, cumulative)")
    p.add_argument("--json", type=Path, dest="json_out")
    args = p.parse_args(argv)
    preset = load_preset("default").with_overrides(temperature=args.temperature, n_draft=args.k,
                                                   threads=args.threads, n_ctx=args.ctx, draft_ahead=args.draft_ahead,
                                                   draft_ahead_length=args.draft_ahead_length)
    if args.draft is None and args.drafter != "lookup":
        p.error(f"--drafter {args.drafter} needs --draft")
    # (a fixed length: what drafting costs is the question, so it never stands aside)
    drafting = dataclasses.replace(preset.draft, n_draft=args.k, p_min=0.0, adaptive=False, drafter=args.drafter,
                                   stand_aside=False)
    files = ModelFiles(target=args.target, draft=args.draft, name="host_share")
    with open_session(files, preset, parallel=1) as session:
        engine: Engine = session.engine
        clock = _DecodeClock(engine)
        per = _PerRound()
        prompts = _prompts(session, args)
        stats = _rounds(engine, clock, args, preset.sampling, drafting, per, prompts)
        n = stats.rounds
        result = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "device_top_k": session.target.device_top_k, "draft_ahead": engine.draft_ahead,
                  "draft_ahead_length": drafting.draft_ahead_length, "rounds": n,
                  "round_ms": 1e3 * stats.decode_s / n, "draft_ms": 1e3 * stats.draft_s / n,
                  "verify_ms": 1e3 * stats.verify_s / n, "host_ms": 1e3 * stats.host_s / n,
                  "ahead_wait_ms": 1e3 * stats.ahead_wait_s / n,
                  # robust to a busy box: a round the scheduler stalled counts once, not by its length
                  "host_ms_median": statistics.median(per.host_ms),
                  "host_cpu_ms": statistics.mean(per.host_cpu_ms),
                  "host_cpu_ms_median": statistics.median(per.host_cpu_ms),
                  "host_cpu_split_ms": {name: statistics.mean(ms) for name, ms in per.split_ms.items()},
                  "host_cpu_split_ms_median": {name: statistics.median(ms) for name, ms in per.split_ms.items()},
                  "cost_model_cpu_ms": statistics.mean(per.cost_model_ms),
                  "ahead_cpu_ms": statistics.mean(per.ahead_cpu_ms),
                  "ahead_made": stats.ahead_made, "ahead_kept": stats.ahead_kept,
                  "host_fraction": stats.host_fraction, "tokens_per_round": stats.tokens / n,
                  "acceptance": stats.acceptance_rate}
        print(json.dumps(result, indent=1))
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            _rounds(engine, clock, args, preset.sampling, drafting, _PerRound(), prompts)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(args.profile)
            print(text.getvalue())
    if args.json_out:
        atomic_write(args.json_out, json.dumps(result, indent=1) + "\n", what="--json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
