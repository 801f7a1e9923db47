"""localspec's side of the GPU comparison: plain, fixed-k speculative, adaptive and a k sweep, on the same
files, prompt and lengths as llama.cpp's tools in run.sh. Prints a table; writes JSON for summarize.py.

    python3 bench/gpu/localspec_bench.py --target T.gguf --draft D.gguf --prompt-file P --n-predict 256 \
        --draft-max 6 --temps 0,0.7 --sweep 2,4,6,8 --json out.json
"""

# llama_cpp before numpy: on the GPU image the other order segfaults when a model loads (shared/GPU.md).
import llama_cpp  # noqa: F401, I001

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a plain checkout, no install needed

from localspec.config import Drafting, load_preset  # noqa: E402
from localspec.engine import DoneEvent, TokenEvent  # noqa: E402
from localspec.session import ModelFiles, open_session  # noqa: E402


def generate(session, prompt, sampling, drafting, n):
    tokens, stats = [], None
    for event in session.engine.generate(prompt, sampling, drafting, n):
        if isinstance(event, TokenEvent):
            tokens.append(event.token)
        elif isinstance(event, DoneEvent):
            stats = event.stats
    return tokens, stats


def measure(session, prompt, sampling, drafting, n, reps):
    runs = []
    for rep in range(reps):
        s = dataclasses.replace(sampling, seed=sampling.seed + rep)
        tokens, st = generate(session, prompt, s, drafting, n)
        runs.append((tokens, st))
    tps = [st.decode_tps for _, st in runs]
    drafted = sum(st.drafted for _, st in runs)
    rounds = sum(st.rounds for _, st in runs)
    decode = sum(st.decode_s for _, st in runs)
    return {
        "tok_s": statistics.median(tps), "tok_s_min": min(tps), "tok_s_max": max(tps),
        "acceptance": sum(st.accepted for _, st in runs) / drafted if drafted else None,
        "mean_accepted": sum(st.accepted for _, st in runs) / rounds if rounds else None,
        "tokens": runs[0][1].tokens,
        "host_frac": sum(st.host_s for _, st in runs) / decode if decode else None,
        "round_ms": 1000 * decode / rounds if rounds else None,
        "draft_ms_per_round": 1000 * sum(st.draft_s for _, st in runs) / rounds if rounds else None,
        "verify_ms_per_round": 1000 * sum(st.verify_s for _, st in runs) / rounds if rounds else None,
        "host_ms_per_round": 1000 * sum(st.host_s for _, st in runs) / rounds if rounds else None,
        "mean_draft_len": drafted / rounds if rounds else 0.0,
        "first_tokens": runs[0][0],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--prompt-file", type=Path, required=True)
    ap.add_argument("--n-predict", type=int, default=256)
    ap.add_argument("--draft-max", type=int, default=6)
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep", default="4,5,7,8")
    ap.add_argument("--adaptive-max", type=int, default=10)
    ap.add_argument("--p-min", type=float, default=0.0)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    preset = load_preset("default").with_overrides(
        n_ctx=args.ctx, n_gpu_layers=-1, draft_n_gpu_layers=-1, seed=args.seed, top_k=40, top_p=0.9, min_p=0.0,
    )
    t = time.perf_counter()
    session = open_session(ModelFiles(args.target, args.draft, "synthetic"), preset)
    print(f"loaded both models in {time.perf_counter() - t:.1f} s", flush=True)
    # As llama.cpp's tools read -f: one trailing newline dropped, special tokens added and parsed.
    prompt = session.target.tokenize(args.prompt_file.read_text().removesuffix("\n"), parse_special=True)
    warm = Drafting(n_draft=args.draft_max, p_min=0.0, adaptive=False)
    for _ in range(2):
        generate(session, prompt, preset.sampling, warm, 32)

    def d(k: int, adaptive: bool = False) -> Drafting:
        return Drafting(k, args.p_min, adaptive)

    modes = [("plain", d(0)), ("spec", d(args.draft_max)), ("spec-adaptive", d(args.adaptive_max, True))]
    modes += [(f"sweep-k{k}", d(k)) for k in map(int, filter(None, args.sweep.split(",")))]
    # A/B: plain and fixed-k with full logits copied to the host (device sampling off).
    modes += [("plain-fulllogits", d(0)), ("spec-fulllogits", d(args.draft_max))]
    device_top_k = {m: m.device_top_k for m in (session.target, session.draft)}
    runs = []
    print(f"{'temp':>5} {'mode':<24} {'tok/s':>7} {'accept':>7} {'mean acc':>8} {'k':>5} {'round ms':>8} "
          f"{'draft':>6} {'verify':>6} {'host':>6} {'host%':>6}", flush=True)
    for temp in map(float, args.temps.split(",")):
        sampling = dataclasses.replace(preset.sampling, temperature=temp)
        plain_tokens = None
        for mode, drafting in modes:
            for model, k in device_top_k.items():
                model.device_top_k = 0 if mode.endswith("fulllogits") else k
            r = measure(session, prompt, sampling, drafting, args.n_predict, args.reps)
            if mode == "plain":
                plain_tokens = r["first_tokens"]
            r.update(mode=mode, temp=temp, draft=drafting.n_draft, adaptive=drafting.adaptive)
            if temp == 0.0 and mode != "plain":
                r["identical_to_plain"] = r["first_tokens"] == plain_tokens
            r.pop("first_tokens")
            runs.append(r)
            acc = f"{r['acceptance']:.1%}" if r["acceptance"] is not None else "—"
            mean = f"{r['mean_accepted']:.2f}" if r["mean_accepted"] is not None else "—"
            same = {True: " ✓", False: " ✗"}.get(r.get("identical_to_plain"), "")
            print(f"{temp:>5} {mode:<24} {r['tok_s']:>7.1f} {acc:>7} {mean:>8} {r['mean_draft_len']:>5.2f} "
                  f"{r['round_ms']:>8.2f} {r['draft_ms_per_round']:>6.2f} {r['verify_ms_per_round']:>6.2f} "
                  f"{r['host_ms_per_round']:>6.2f} {r['host_frac']:>6.1%}{same}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "n_predict": args.n_predict}, indent=2))
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
