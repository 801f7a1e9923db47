"""The chained drafter's cost figures on a real pair, generation by generation: what decides whether the chain
drafts with the model (issue #19: on the H200 it sat at lookup's pace while the model drafter made 1.94x).

The bench's sequence (`localspec bench`: warm-up runs of WARMUP_TOKENS alternating plain and speculative, then
the timed runs, one engine) at T = 0 through the chat template; after each speculative generation one line: its
speed-up over the plain run just before it, rounds / drafted / bets made and kept, and the slot's `DraftCost`
(the model's step, the draft-ahead's contended step and lag, the draft-aheads told, whether the model could pay if
every draft were accepted, the probe interval, what catching up on 64 tokens is priced at). On the H200, beside
the bench rows of docs/performance.md:

    python bench/chain_state.py --target T --draft D --prompts lookup --max-tokens 256
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import llama_cpp  # noqa: F401, I001  -- before numpy: on the H200 the CUDA build segfaults otherwise (docs/gpu.md)

from localspec.config import load_preset
from localspec.drafters.model import ModelCost
from localspec.rounds.events import collect
from localspec.sessions import bench
from localspec.sessions.session import ModelFiles, open_session


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="target GGUF")
    ap.add_argument("--draft", required=True, help="draft GGUF")
    ap.add_argument("--drafter", default="chain")
    ap.add_argument("--prompts", default="lookup", help="a shipped prompt set: " + ", ".join(bench.PROMPT_SETS))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args(argv)

    preset = load_preset("greedy").with_overrides(n_ctx=args.ctx)
    drafting = dataclasses.replace(preset.draft, n_draft=6, drafter=args.drafter)
    plain = dataclasses.replace(drafting, n_draft=0)
    with open_session(ModelFiles(target=Path(args.target), draft=Path(args.draft), name="chain-state"), preset) as s:
        prompts = bench.tokenize_prompts(s, bench.shipped_prompts(args.prompts))
        runs = [(f"warm-up {i}", prompts[i % len(prompts)], bench.WARMUP_TOKENS) for i in range(4)]
        runs += [(f"run {r}", p, args.max_tokens) for r in range(args.repeat) for p in prompts]
        for label, (name, prompt), max_tokens in runs:
            base = collect(s.engine.generate(prompt, preset.sampling, plain, max_tokens)).done.stats
            st = collect(s.engine.generate(prompt, preset.sampling, drafting, max_tokens)).done.stats
            cost = next(c.cost for c in s.engine.slots[0].policies.values() if c.cost.k_max == 6)
            model = ModelCost.of(cost)
            ms = {f: None if getattr(o, f) is None else round(1000 * getattr(o, f), 2)
                  for o, f in ((cost, "step_s"), (model, "draft_ahead_step_s"), (model, "draft_ahead_lag_s"))}
            verify = sorted((w, round(1000 * v, 2)) for w, v in cost.verify_s.items())
            catch_up = cost.catch_up_cost(64)
            print(f"{label} {name}: {st.decode_tps / base.decode_tps:.2f}x rounds {st.rounds} drafted {st.drafted}"
                  f" accepted {st.accepted} bets {st.ahead_made}/{st.ahead_kept} | step {ms['step_s']} ms,"
                  f" ahead step {ms['draft_ahead_step_s']} ms, lag {ms['draft_ahead_lag_s']} ms,"
                  f" aheads {model.draft_aheads},"
                  f" model rounds {cost.step_rounds}, on {model.model_on}, could pay (padded)"
                  f" {model.could_pay(0, 6, 7)}, interval {model.interval}, verify ms {verify}, catch-up of 64"
                  f" {None if catch_up is None else round(1000 * catch_up, 2)} ms",
                  flush=True)


if __name__ == "__main__":
    main()
