"""What a verify batch costs by width, what changing the width costs (CUDA graph warmth), and how far a batch's
logits are from single-token decoding's. Measured through localspec's own LlamaModel, as the engine decodes.

    python3 bench/gpu/verify_widths.py --model TARGET.gguf --json out.json            # timings
    python3 bench/gpu/verify_widths.py --model SMALL.gguf --json out.json --logits    # + logits, GPU and CPU
    GGML_CUDA_GRAPH_OPT=1 python3 bench/gpu/verify_widths.py --model T.gguf --json k.json --widths 1-8 \
        --flash-attn off --no-patterns --label graph-opt                                # one kernel configuration

Timings: the target decodes a batch of w tokens after a 200-token context (device greedy sampler, as the engine's
greedy verify), the KV cells are dropped again, and the next call follows; the median of `--calls` calls per
pattern after warm-up calls. Patterns: each constant width; widths alternating as a varying draft length makes
them (7,7,5,5 and 7,5); widths drawn at random from 3..7 (drafts stopped early below p_min) against the same
rounds padded to 7; and one change every 16 calls (adaptive drafting's epochs).

The verify kernel experiment (bench/gpu/kernels.sh) runs it once per configuration, in a process of its own: the
ggml-cuda settings are environment variables read once per process (recorded in the JSON with `--label`), flash
attention is `--flash-attn`; `--no-patterns` keeps only the constant widths.
"""

# llama_cpp before numpy: on the GPU image the other order segfaults when a model loads (docs/gpu.md).
import llama_cpp  # noqa: F401, I001

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a plain checkout, no install needed

from localspec.llama.model import LlamaModel  # noqa: E402

CONTEXT = 200
TEXT = ("Speculative decoding lets a small draft model propose several tokens that a large target model then "
        "checks in one batched forward pass. When the draft agrees with the target, many tokens are emitted for "
        "the cost of one target step; when it disagrees, the target's own choice is kept and the rest is thrown "
        "away. The speed-up therefore depends on how often the two models agree and on how much a batch costs.")


def context_tokens(model: LlamaModel) -> list[int]:
    tokens = model.tokenize(TEXT)
    while len(tokens) < CONTEXT:
        tokens += tokens
    return tokens[:CONTEXT]


def time_pattern(model: LlamaModel, ctx: list[int], widths: list[int], warmup: int) -> list[float]:
    """Seconds per call (the sampled tokens' read waits for the device), warm-up calls dropped."""
    base = len(ctx)
    follow = ctx[:32]
    out = []
    for w in widths:
        t = time.perf_counter()
        model.decode(follow[:w], base, all_logits=True)
        out.append(time.perf_counter() - t)
        model.truncate(base)
    return out[warmup:]


def timings(model: LlamaModel, calls: int, widths: list[int], patterns_too: bool = True) -> dict:
    ctx = context_tokens(model)
    model.use_device_sampler("greedy")
    model.clear()
    model.decode(ctx, 0)
    warm = 6
    res: dict = {"constant": {}, "patterns": {}}
    for w in widths:
        res["constant"][w] = 1000 * statistics.median(time_pattern(model, ctx, [w] * (calls + warm), warm))
    if not patterns_too:
        return res
    rng = np.random.default_rng(0)
    random_w = rng.integers(3, 8, size=calls + warm).tolist()
    patterns = {
        "7,7,5,5": [7, 7, 5, 5] * ((calls + warm) // 4 + 1),
        "7,5": [7, 5] * ((calls + warm) // 2 + 1),
        "random 3..7": random_w,
        "random 3..7 padded to 7": [7] * len(random_w),
        "change every 16 (7, 4)": ([7] * 16 + [4] * 16) * ((calls + warm) // 32 + 2),
    }
    for name, ws in patterns.items():
        times = time_pattern(model, ctx, ws, warm)
        res["patterns"][name] = {"mean_ms": 1000 * statistics.fmean(times),
                                 "median_ms": 1000 * statistics.median(times),
                                 "mean_width": statistics.fmean(ws[warm:])}
    # What the widths would cost with a warm graph each: the constant-width medians, weighted as the pattern is.
    for name, ws in patterns.items():
        warm_ms = [res["constant"].get(w) for w in ws[warm:]]
        if None not in warm_ms:
            res["patterns"][name]["warm_ms"] = statistics.fmean(warm_ms)
    return res


def logits_vs_single(model: LlamaModel, cpu: LlamaModel | None, max_width: int) -> dict:
    """Full logits of a batch of w tokens vs w single-token decodes (and vs the CPU's), w = 2..max_width."""
    ctx = context_tokens(model)
    model.use_device_sampler(None)
    rows: dict = {}
    for w in range(2, max_width + 1):
        model.clear()
        model.decode(ctx[:-1], 0)
        cur, single = ctx[-1], []
        seq = [cur]
        for i in range(w):
            row = model.decode([seq[-1]], len(ctx) - 1 + i, all_logits=True).logits[0].copy()
            single.append(row)
            seq.append(int(np.argmax(row)))
        feed = seq[:w]  # what a verify batch holds when the draft agrees: cur + the target's own greedy tokens
        model.truncate(len(ctx) - 1)
        batch = model.decode(feed, len(ctx) - 1, all_logits=True).logits.copy()
        single_a = np.stack(single)
        top2 = np.sort(single_a, axis=1)[:, -2:]
        entry = {
            "max_abs_diff": float(np.abs(batch - single_a).max()),
            "argmax_flips": int((batch.argmax(axis=1) != single_a.argmax(axis=1)).sum()),
            "min_top2_margin_single": float((top2[:, 1] - top2[:, 0]).min()),
        }
        if cpu is not None:
            # In chunks of 16: llama.cpp hands batches of 32+ tokens to the GPU even for CPU-resident weights.
            cpu.clear()
            for start in range(0, len(ctx) - 1, 16):
                cpu.decode(ctx[start : min(start + 16, len(ctx) - 1)], start)
            ref = cpu.decode(feed, len(ctx) - 1, all_logits=True).logits.copy()
            entry["max_abs_diff_single_vs_cpu"] = float(np.abs(single_a - ref).max())
            entry["max_abs_diff_batch_vs_cpu"] = float(np.abs(batch - ref).max())
        rows[w] = entry
    # Repeated single-token decodes of the same position: bitwise equal?
    model.clear()
    model.decode(ctx[:-1], 0)
    a = model.decode([ctx[-1]], len(ctx) - 1, all_logits=True).logits[0].copy()
    model.truncate(len(ctx) - 1)
    b = model.decode([ctx[-1]], len(ctx) - 1, all_logits=True).logits[0].copy()
    return {"by_width": rows, "repeat_single_bitwise_equal": bool(np.array_equal(a, b))}


def width_range(text: str) -> list[int]:
    """"1-8" or "1,2,4,7": widths of at least 1."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            widths = list(range(lo, hi + 1))
        else:
            widths = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: widths are like 1-8 or 1,2,4") from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: widths are at least 1")
    return widths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--logits", action="store_true", help="also compare batch and single-token logits (and CPU)")
    ap.add_argument("--max-width", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: physical cores; 1 on a busy CPU)")
    ap.add_argument("--widths", type=width_range, default=list(range(1, 10)), help="constant widths, e.g. 1-8")
    ap.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--no-patterns", action="store_true", help="constant widths only (the kernel experiment)")
    ap.add_argument("--label", default="default", help="the configuration's name, kept in the JSON")
    a = ap.parse_args()
    result: dict = {"model": str(a.model), "label": a.label, "flash_attn": a.flash_attn,
                    "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("GGML_")}}
    with LlamaModel(a.model, n_ctx=1024, n_gpu_layers=-1, device_top_k=64, n_threads=a.threads,
                    flash_attn=a.flash_attn) as model:
        result["on_gpu"] = model.on_gpu
        result["timings_ms"] = timings(model, a.calls, a.widths, not a.no_patterns)
        if a.logits:
            cpu = LlamaModel(a.model, n_ctx=1024, device_top_k=0, n_gpu_layers=0,
                             n_threads=a.threads) if model.on_gpu else None
            try:
                result["logits"] = logits_vs_single(model, cpu, a.max_width)
            finally:
                if cpu is not None:
                    cpu.close()
    a.json.write_text(json.dumps(result, indent=2))
    t = result["timings_ms"]
    print("verify ms by width:", "  ".join(f"w{w} {ms:.2f}" for w, ms in t["constant"].items()))
    for name, p in t["patterns"].items():
        warm = f"; warm graphs would give {p['warm_ms']:.2f}" if "warm_ms" in p else ""
        print(f"{name:>26}: {p['mean_ms']:.2f} ms a call (mean width {p['mean_width']:.2f}{warm})")
    if "logits" in result:
        for w, e in result["logits"]["by_width"].items():
            print(f"w{w}: max |batch - single| {e['max_abs_diff']:.4f}, argmax flips {e['argmax_flips']}, "
                  + (f"|single - cpu| {e['max_abs_diff_single_vs_cpu']:.3f}, "
                     f"|batch - cpu| {e['max_abs_diff_batch_vs_cpu']:.3f}" if "max_abs_diff_batch_vs_cpu" in e else ""))
        print("repeated single decodes bitwise equal:", result["logits"]["repeat_single_bitwise_equal"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
