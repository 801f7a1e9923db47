"""Host milliseconds per speculative round (the round's time outside llama_decode), and where they go.

    python bench/host_share.py --target T.gguf --draft D.gguf [--temperature 0.7] [--k 6] [--rounds 300]
        [--threads 1] [--profile 25] [--json OUT]

Runs one stream through `Engine.step` for `--rounds` rounds (after a few warm-up rounds) and reports the stats'
split (`GenerationStats`: draft_s, verify_s, host_s = the rest), per round. With a tiny pair the decodes are short,
so the host side shows; its Python and numpy costs are the ones a GPU round pays beside its kernels. The device
candidates are what a GPU run gets (`device_top_k`, top-64 per row), where this llama.cpp build can run them.
`--profile N` then runs the same rounds again under cProfile and prints the N costliest functions by own time
(llama_decode included, so the host functions can be read against it).
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
            host_ms: list[float], host_cpu_ms: list[float]) -> GenerationStats:
    """`--rounds` rounds of one stream after the warm-up; each round's host milliseconds (wall, and this thread's
    CPU) go to the lists."""
    prompt = np.random.default_rng(3).integers(100, 4000, size=24).tolist()
    engine.reset()
    stream = engine.start(prompt, sampling, drafting, 10**6)
    for _ in range(args.warmup):
        engine.step([stream])
        list(stream.events())
    before = dataclasses.replace(stream.stats, draft_lengths=[])
    stats = stream.stats
    t = time.perf_counter()
    for _ in range(args.rounds):
        wall, cpu = time.perf_counter(), time.thread_time()
        inside_wall, inside_cpu = stats.draft_s + stats.verify_s, clock.inside
        engine.step([stream])
        list(stream.events())
        host_ms.append(1e3 * (time.perf_counter() - wall - (stats.draft_s + stats.verify_s - inside_wall)))
        host_cpu_ms.append(1e3 * (time.thread_time() - cpu - (clock.inside - inside_cpu)))
    return GenerationStats(tokens=stats.tokens - before.tokens, rounds=stats.rounds - before.rounds,
                           drafted=stats.drafted - before.drafted, accepted=stats.accepted - before.accepted,
                           draft_s=stats.draft_s - before.draft_s, verify_s=stats.verify_s - before.verify_s,
                           decode_s=time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="host_share.py", description=__doc__.splitlines()[0])
    for name in ("--target", "--draft"):
        p.add_argument(name, type=Path, required=True)
    for name, default in (("--temperature", 0.7), ("--k", 6), ("--rounds", 300), ("--warmup", 10),
                          ("--threads", 1), ("--ctx", 2048)):
        p.add_argument(name, type=type(default), default=default)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="then cProfile the rounds: N functions")
    p.add_argument("--sort", default="tottime", help="--profile: pstats sort key (tottime, cumulative)")
    p.add_argument("--json", type=Path, dest="json_out")
    args = p.parse_args(argv)
    preset = load_preset("default").with_overrides(temperature=args.temperature, n_draft=args.k,
                                                   threads=args.threads, n_ctx=args.ctx)
    drafting = dataclasses.replace(preset.draft, n_draft=args.k, p_min=0.0, adaptive=False)
    files = ModelFiles(target=args.target, draft=args.draft, name="host_share")
    with open_session(files, preset, parallel=1) as session:
        engine: Engine = session.engine
        clock = _DecodeClock(engine.models)
        host_ms: list[float] = []
        host_cpu_ms: list[float] = []
        stats = _rounds(engine, clock, args, preset.sampling, drafting, host_ms, host_cpu_ms)
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
            _rounds(engine, clock, args, preset.sampling, drafting, [], [])
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(args.profile)
            print(text.getvalue())
    if args.json_out:
        atomic_write(args.json_out, json.dumps(result, indent=1) + "\n", what="--json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
