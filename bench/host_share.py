"""Host milliseconds per speculative round (the round's time outside llama_decode), and where they go.

    python bench/host_share.py --target T.gguf [--draft D.gguf] [--drafter model|lookup|chain]
        [--temperature 0.7] [--k 6] [--rounds 300] [--prompt-tokens 24] [--threads 1] [--profile 25] [--json OUT]

Runs one stream through `Engine.step` for `--rounds` rounds (after a few warm-up rounds) and reports the stats'
split (`GenerationStats`: draft_s, verify_s, host_s = the rest), per round. With a tiny pair the decodes are short,
so the host side shows; its Python and numpy costs are the ones a GPU round pays beside its kernels. The device
candidates are what a GPU run gets (`device_top_k`, top-64 per row), where this llama.cpp build can run them.
`--profile N` then runs the same rounds again under cProfile and prints the N costliest functions by own time
(llama_decode included, so the host functions can be read against it). `--drafter lookup` needs no draft model
(prompt lookup's host work per round: `--prompt-tokens` sets the context it searches); `--k 0` is plain decoding.
The prompt is random token ids, or (`--prompts shipped|lookup --max-tokens 128`) bench's prompt set through the
chat template, one generation after another.
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
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp  # noqa: F401, I001  -- before numpy (docs/gpu.md)
import numpy as np

from localspec.bench import shipped_prompts, tokenize_prompts
from localspec.config import Drafting, Sampling, load_preset
from localspec.engine import Engine
from localspec.events import GenerationStats
from localspec.fsutil import atomic_write
from localspec.scores import ScoringModel
from localspec.session import ModelFiles, open_session


class _DecodeClock:
    """This thread's CPU seconds inside the models' decodes (the same boundary as draft_s and verify_s): the host
    side's CPU time is the round's minus these. CPU time, unlike wall time, does not count the moments a busy box
    gives the CPU to someone else."""

    def __init__(self, models: list[ScoringModel]) -> None:
        self.inside = 0.0
        for model in {id(m): m for m in models}.values():  # (a drafter's model may be listed twice)
            model.decode_many = self._timed(model.decode_many)  # type: ignore[method-assign]

    def _timed(self, decode: Callable) -> Callable:
        def timed(*args, **kwargs):
            t = time.thread_time()
            try:
                return decode(*args, **kwargs)
            finally:
                self.inside += time.thread_time() - t
        return timed


def _rounds(engine: Engine, clock: _DecodeClock, args: argparse.Namespace, sampling: Sampling, drafting: Drafting,
            host_ms: list[float], host_cpu_ms: list[float], prompts: list[list[int]]) -> GenerationStats:
    """`--rounds` rounds after the warm-up, the prompts' generations one after another (each at most
    `--max-tokens`); each round's host milliseconds (wall, and this thread's CPU) go to the lists."""
    engine.reset()
    total = GenerationStats()
    rounds, wall_s = 0, 0.0
    for prompt in prompts:
        stream = engine.start(prompt, sampling, drafting, args.max_tokens)
        stats = stream.stats
        before = dataclasses.replace(stats, draft_lengths=[])
        while not stream.finished and rounds < args.warmup + args.rounds:
            if rounds == args.warmup:  # the warm-up's rounds leave the totals
                before = dataclasses.replace(stats, draft_lengths=[])
            wall, cpu = time.perf_counter(), time.thread_time()
            inside_wall, inside_cpu = stats.draft_s + stats.verify_s, clock.inside
            engine.step([stream])
            list(stream.events())
            rounds += 1
            if rounds > args.warmup:
                wall_s += time.perf_counter() - wall  # (rounds only: a prompt's prefill is no round)
                host_ms.append(1e3 * (time.perf_counter() - wall - (stats.draft_s + stats.verify_s - inside_wall)))
                host_cpu_ms.append(1e3 * (time.thread_time() - cpu - (clock.inside - inside_cpu)))
        if rounds > args.warmup:
            total += GenerationStats(tokens=stats.tokens - before.tokens, rounds=stats.rounds - before.rounds,
                                     drafted=stats.drafted - before.drafted,
                                     accepted=stats.accepted - before.accepted, draft_s=stats.draft_s - before.draft_s,
                                     verify_s=stats.verify_s - before.verify_s)
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
    p.add_argument("--profile", type=int, default=0, metavar="N", help="then cProfile the rounds: N functions")
    p.add_argument("--sort", default="tottime", help="--profile: pstats sort key (tottime, cumulative)")
    p.add_argument("--json", type=Path, dest="json_out")
    args = p.parse_args(argv)
    preset = load_preset("default").with_overrides(temperature=args.temperature, n_draft=args.k,
                                                   threads=args.threads, n_ctx=args.ctx)
    if args.draft is None and args.drafter != "lookup":
        p.error(f"--drafter {args.drafter} needs --draft")
    drafting = dataclasses.replace(preset.draft, n_draft=args.k, p_min=0.0, adaptive=False, drafter=args.drafter)
    files = ModelFiles(target=args.target, draft=args.draft, name="host_share")
    with open_session(files, preset, parallel=1) as session:
        engine: Engine = session.engine
        clock = _DecodeClock(engine.models)
        host_ms: list[float] = []
        host_cpu_ms: list[float] = []
        prompts = _prompts(session, args)
        stats = _rounds(engine, clock, args, preset.sampling, drafting, host_ms, host_cpu_ms, prompts)
        n = stats.rounds
        result = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "device_top_k": session.target.device_top_k, "rounds": n,
                  "round_ms": 1e3 * stats.decode_s / n, "draft_ms": 1e3 * stats.draft_s / n,
                  "verify_ms": 1e3 * stats.verify_s / n, "host_ms": 1e3 * stats.host_s / n,
                  # robust to a busy box: a round the scheduler stalled counts once, not by its length
                  "host_ms_median": statistics.median(host_ms),
                  "host_cpu_ms": statistics.mean(host_cpu_ms), "host_cpu_ms_median": statistics.median(host_cpu_ms),
                  "host_fraction": stats.host_fraction, "tokens_per_round": stats.tokens / n,
                  "acceptance": stats.acceptance_rate}
        print(json.dumps(result, indent=1))
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            _rounds(engine, clock, args, preset.sampling, drafting, [], [], prompts)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(args.profile)
            print(text.getvalue())
    if args.json_out:
        atomic_write(args.json_out, json.dumps(result, indent=1) + "\n", what="--json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
