"""Which requantization of SmolLM2-135M-Instruct drafts best for the demo-chat pair: acceptance x speed.

Greedy decoding of five chat prompts (through the model's own template), plain and with each candidate draft,
runs interleaved (the order flips every repeat), medians reported. The result is written next to the choice in
localspec/models/demo.py.

    python bench/lab/demo_draft_quant.py --out /tmp/drafts --types Q4_0,Q5_0,Q8_0,Q2_K --tokens 64 --threads 1 \\
        --repeat 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from localspec.config import load_preset
from localspec.llama.model import LlamaModel
from localspec.models import demo
from localspec.rounds.engine import Engine
from localspec.rounds.events import DoneEvent
from localspec.sessions.chat import ChatTemplate, encode_chat

PROMPTS = ["What is two plus two?", "Write a Python function that reverses a string.",
           "Give me three tips for sleeping better.", "Why is the sky blue?", "Summarise the plot of Cinderella."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the requantized drafts")
    ap.add_argument("--types", default="Q4_0,Q5_0,Q8_0,Q2_K", help="llama.cpp file types to try")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0 = physical cores)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--draft", type=int, default=load_preset().draft.n_draft, help="draft length")
    args = ap.parse_args()

    types = args.types.split(",")
    src = demo.smollm2_source_path()
    preset = load_preset("greedy")
    target = LlamaModel(src, n_ctx=1024, device_top_k=0, n_threads=args.threads)
    template = ChatTemplate.for_model(target)
    prompts = [encode_chat(target, template.render([{"role": "user", "content": p}])) for p in PROMPTS]
    drafts = {t: demo._requantize(src, args.out / f"smollm2-{t}.gguf", t) for t in types}
    models = {t: LlamaModel(p, n_ctx=1024, device_top_k=0, n_threads=args.threads) for t, p in drafts.items()}

    def run(draft: LlamaModel | None) -> tuple[float, float]:
        engine = Engine(target, draft)
        drafting = dataclasses.replace(preset.draft, n_draft=args.draft if draft is not None else 0)
        tokens = drafted = accepted = 0
        seconds = 0.0
        for prompt in prompts:
            engine.reset()
            for event in engine.generate(prompt, preset.sampling, drafting, args.tokens):
                if isinstance(event, DoneEvent):
                    s = event.stats
                    tokens, seconds = tokens + s.tokens, seconds + s.decode_s
                    drafted, accepted = drafted + s.drafted, accepted + s.accepted
        return tokens / seconds, accepted / drafted if drafted else 0.0

    tps: dict[str, list[float]] = {name: [] for name in ["plain", *types]}
    acceptance: dict[str, float] = {}
    for r in range(args.repeat):
        order = ["plain", *types] if r % 2 == 0 else [*reversed(types), "plain"]
        for name in order:
            rate, acceptance[name] = run(None if name == "plain" else models[name])
            tps[name].append(rate)
            print(f"run {r} {name}: {rate:.1f} tok/s, acceptance {acceptance[name]:.0%}", flush=True)
    plain = statistics.median(tps["plain"])
    print(f"plain: {plain:.1f} tok/s {[round(x, 1) for x in tps['plain']]}; target {src.stat().st_size / 1e6:.1f} MB")
    for name in types:
        m = statistics.median(tps[name])
        print(f"{name}: {m:.1f} tok/s ({m / plain:.2f}x plain), acceptance {acceptance[name]:.0%}, "
              f"{drafts[name].stat().st_size / 1e6:.1f} MB {[round(x, 1) for x in tps[name]]}")


if __name__ == "__main__":
    main()
