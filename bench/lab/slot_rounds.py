"""Rounds per second and llama.cpp ubatches per round with N busy slots (issue #18), through the engine.

    python bench/lab/slot_rounds.py --target T.gguf [--draft D.gguf] [--drafter model|mtp|lookup|...] [--slots 16]
        [--rounds 40] [--order scrambled] [--temperature 0.7] [--k 6] [--share 1.0] [--threads 1] [--count-ubatches]
        [--timeline] [--draft-ahead auto|on|off] [--device-top-k N] [--share-batches probe|on|off] [--stand-aside]
        [--json OUT]

Starts one request per slot (different prompts, seeds), the slots taken in `--order` (`scrambled`: a fixed
permutation, as a server's slots are after requests come and go; `ascending`: 0, 1, 2, ...), and the streams
listed in that order, then times `--rounds` engine rounds (`Engine.step` over all of them, the load policy held at
full drafts, so every round drafts k and verifies k + 1; `--share F` holds it at F of k instead: `--share 0` is a
speculative server's rounds where the load policy cut every draft, against `--k 0`, a plain server's). With
`--count-ubatches` it runs the same rounds again with llama.cpp's batch debugging on (`LLAMA_BATCH_DEBUG=1`, read
when a context is made) and counts the ubatches llama.cpp made per round from its own log ("added ubatch"), target
and draft apart: the ground truth for any version of localspec, which is how the figures before and after the fix
of issue #18 were taken. That pass is not timed (the debug log costs time).

With `--timeline` every llama.cpp decode of the timed rounds is logged (model, thread, start, end): per round, the
target's decodes and their mean length, the draft's on the loop's thread and beside it (a worker thread), an MTP
head's (`head_s`), and the rest of the round (host work, waits). `--draft-ahead` and `--device-top-k` set the
`[load]` keys of those names. `--share-batches on|off` overrides the target's load probe
(`LlamaModel.batches_sequences`: whether its slots share a verify or take turns), to price what the probe's
verdict costs; the probe's figures are reported either way.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import llama_cpp  # noqa: I001  -- before numpy (docs/gpu.md)
import numpy as np

from localspec.config import load_preset
from localspec.fsutil import atomic_write
from localspec.rounds.engine import Engine
from localspec.rounds.policies import LoadPolicy as _LoadPolicy
from localspec.sessions.session import ModelFiles, open_session

_counts = {"ubatches": 0}


def _count(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if b"added ubatch" in text:
        _counts["ubatches"] += 1


_COUNTING = llama_cpp.llama_log_callback(_count)  # kept alive: llama.cpp holds the pointer


def _log_decodes(model, name: str, log: list[tuple[str, bool, float, float, int]],  # type: ignore[no-untyped-def]
                 method: str = "_decode") -> None:
    """Log each llama.cpp decode of `model` (name, on the loop's thread, start, end, tokens): its `method`, whose
    first argument is the token count or the entries (an MTP head's `_decode_chunk`)."""
    decode = getattr(model, method)
    main = threading.main_thread()

    def timed(n, *rest):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = decode(n, *rest)
        log.append((name, threading.current_thread() is main, t0, time.perf_counter(), n if isinstance(n, int)
                    else len(n)))
        return out

    setattr(model, method, timed)


def _timeline(log: list[tuple[str, bool, float, float, int]], bounds: list[tuple[float, float]]) -> dict:
    """Per round (its start and end): seconds in the target's decodes, the draft's on the loop's thread and beside
    it, and the rest; the target's decodes by token count."""
    rows = []
    for t0, t1 in bounds:
        inside = [e for e in log if t0 <= e[2] < t1]
        target = [e[3] - e[2] for e in inside if e[0] == "target"]
        draft_main = sum(e[3] - e[2] for e in inside if e[0] == "draft" and e[1])
        draft_beside = sum(e[3] - e[2] for e in inside if e[0] == "draft" and not e[1])
        head = sum(e[3] - e[2] for e in inside if e[0] == "head")
        rows.append({"round_s": t1 - t0, "target_s": sum(target), "target_decodes": len(target),
                     "draft_main_s": draft_main, "draft_beside_s": draft_beside, "head_s": head,
                     "rest_s": t1 - t0 - sum(target) - draft_main - head})
    by_width: dict[int, list[float]] = {}
    for name, _, t0, t1, n in log:
        if name == "target":
            by_width.setdefault(n, []).append(t1 - t0)
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]} if rows else {}
    return {"median_per_round": med,
            "target_decode_ms_by_tokens": {n: round(1000 * statistics.median(v), 2)
                                           for n, v in sorted(by_width.items())},
            "target_decodes_by_tokens": {n: len(v) for n, v in sorted(by_width.items())}}


def measure(args: argparse.Namespace, count: bool) -> dict:
    if count:
        os.environ["LLAMA_BATCH_DEBUG"] = "1"
    preset = load_preset("default").with_overrides(
        temperature=args.temperature, n_draft=args.k, threads=args.threads, n_ctx=args.ctx,
        draft_ahead=args.draft_ahead, device_top_k=args.device_top_k, drafter=args.drafter)
    files = ModelFiles(target=args.target, draft=args.draft, name="slot_rounds")
    _LoadPolicy.SHARES = (args.share,)  # every round drafts that share of its length: the same rounds throughout
    with open_session(files, preset, parallel=args.slots) as session:
        if count:
            llama_cpp.llama_log_set(_COUNTING, ctypes.c_void_p(0))
        engine: Engine = session.engine
        probe = {name: {"shared": m.batches_sequences, "error": m.sequence_batch_error, "width_noise": m.width_noise}
                 for name, m in (("target", session.target), ("draft", session.draft)) if m is not None}
        if args.share_batches != "probe":  # before any stream starts: its device sampler follows the verdict
            session.target.batches_sequences = args.share_batches == "on"
        log: list[tuple[str, bool, float, float, int]] = []
        bounds: list[tuple[float, float]] = []
        if args.timeline and not count:
            _log_decodes(session.target, "target", log)
            if session.draft is not None:
                _log_decodes(session.draft, "draft", log)
            for drafter in engine.drafters.values():  # an MTP head's decodes (its context is made on first use)
                if hasattr(drafter, "head"):
                    _log_decodes(drafter.head, "head", log, "_decode_chunk")
        slots = list(range(args.slots))
        if args.order == "scrambled":
            slots = np.random.default_rng(7).permutation(args.slots).tolist()
        rng = np.random.default_rng(3)
        streams = []
        for i, slot in enumerate(slots):
            prompt = rng.integers(100, min(session.target.n_vocab, 40_000), size=12 + i).tolist()
            sampling = dataclasses.replace(preset.sampling, seed=100 + i)
            drafting = dataclasses.replace(preset.draft, n_draft=args.k, p_min=0.0, adaptive=False)
            if args.share == 1.0 and not args.stand_aside:  # (a drafter's own stand-aside would cut the share)
                drafting = dataclasses.replace(drafting, stand_aside=False)
            streams.append(engine.start(prompt, sampling, drafting, 10**6, slot=slot))
        for _ in range(args.warmup):
            engine.step(streams)
            for s in streams:
                list(s.events())
        per_round, seconds, with_events = [], [], []
        before_tokens = sum(s.stats.tokens for s in streams)
        for _ in range(args.rounds):
            before = _counts["ubatches"]
            t = time.perf_counter()
            engine.step(streams)
            seconds.append(time.perf_counter() - t)
            bounds.append((t, t + seconds[-1]))
            for s in streams:
                list(s.events())
            with_events.append(time.perf_counter() - t)  # (a server pays the events too: its rounds are these)
            per_round.append(_counts["ubatches"] - before)
        tokens = sum(s.stats.tokens for s in streams)
        tokens_timed = tokens - before_tokens
        return {"rounds": args.rounds, "round_s_median": statistics.median(seconds),
                "round_with_events_s_median": statistics.median(with_events),
                "tokens_per_s_with_events": tokens_timed / sum(with_events),
                "stand_aside": args.stand_aside or args.share != 1.0,
                "rounds_per_s": args.rounds / sum(seconds), "tokens": tokens,
                "ubatches_per_round": statistics.mean(per_round) if count else None,
                "acceptance": sum(s.stats.accepted for s in streams) / max(1, sum(s.stats.drafted for s in streams)),
                "tokens_per_s": tokens_timed / sum(seconds), "draft_ahead": engine.draft_ahead,
                "slots_batched": engine.batches_slots, "probe": probe, "target_replans": session.target.replans,
                "target_device_samplers": [str(session.target.device_sampler(s.slot.seq)) for s in streams[:4]],
                "timeline": _timeline(log, bounds) if log else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slot_rounds.py", description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, help="the draft model (none: a drafter without one, --drafter)")
    p.add_argument("--drafter", default=None, help="the preset's drafter (default: its own, the draft model)")
    p.add_argument("--share", type=float, default=1.0,
                   help="the share of k the load policy is held at (0: every draft cut, the stand-aside rounds)")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--order", choices=("scrambled", "ascending"), default="scrambled")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ctx", type=int, default=1024, help="context per slot")
    p.add_argument("--count-ubatches", action="store_true", help="also count llama.cpp's ubatches per round")
    p.add_argument("--timeline", action="store_true", help="log every decode of the timed rounds (see above)")
    p.add_argument("--draft-ahead", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--device-top-k", type=int, default=64)
    p.add_argument("--share-batches", choices=("probe", "on", "off"), default="probe")
    p.add_argument("--stand-aside", action="store_true",
                   help="keep each stream's stand-aside on at --share 1 (as a server runs; its pricing is timed, and "
                        "it may cut drafts)")
    p.add_argument("--json", type=Path, dest="json_out")
    args = p.parse_args(argv)
    result = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "timed": measure(args, count=False)}
    if args.count_ubatches:
        result["counted"] = measure(args, count=True)
    print(json.dumps(result, indent=1))
    if args.json_out:
        atomic_write(args.json_out, json.dumps(result, indent=1) + "\n", what="--json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
