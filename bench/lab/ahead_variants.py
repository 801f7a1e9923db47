"""Drafting-ahead variants one after the other on ONE loaded pair: `localspec bench`'s own measurement
(`localspec.sessions.bench.run_bench`: warm-up, plain and speculative runs interleaved, the greedy check) once per
variant, each report written as `localspec bench --json` writes it. One process per pair instead of one per cell
and variant: on the H200 loading the 19.8 GB card target costs ~20 s, as much as a short bench itself
(bench/lab/draft_ahead.sh).

    python bench/lab/ahead_variants.py --target T.gguf --draft D.gguf --temps "0 0.7" --out-prefix RES/n0.013 \\
        [--variants "on fit fit+adaptive"] [--max-tokens 256] [--repeat 3] [--warmup 3]

Variants: on (drafting ahead, whole rounds: `draft_ahead_length = "full"`), off (rounds one after the other),
fit (`draft_ahead_length = "fit"`), adaptive (whole rounds with `adaptive = true`), fit+adaptive; per temperature, all
variants one after the other. Writes
OUT_PREFIX-tTEMP-VARIANT.json (TEMP as given); one that exists is skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import llama_cpp  # noqa: F401, I001  -- before numpy (docs/gpu.md)

from localspec.config import load_preset
from localspec.fsutil import atomic_write
from localspec.sessions.bench import BenchReport, run_bench
from localspec.sessions.session import ModelFiles, open_session

VARIANTS = {  # name -> (drafts ahead, preset overrides)
    "on": (True, {"draft_ahead_length": "full"}),  # whole bets (the default until the fourth H200 run: now "fit")
    "off": (False, {}),
    "fit": (True, {"draft_ahead_length": "fit"}),
    "adaptive": (True, {"draft_ahead_length": "full", "adaptive": True}),
    "fit+adaptive": (True, {"draft_ahead_length": "fit", "adaptive": True}),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--temps", required=True, help='temperatures, e.g. "0 0.7"')
    parser.add_argument("--out-prefix", required=True)
    parser.add_argument("--variants", default="on fit fit+adaptive")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--n-draft", type=int, default=6)
    args = parser.parse_args()
    names = args.variants.split()
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    preset = load_preset("default").with_overrides(
        prefer="bench", seed=42, n_draft=args.n_draft, n_ctx=4096, draft_ahead="on", max_tokens=args.max_tokens,
        repeat=args.repeat, warmup=args.warmup)
    files = ModelFiles(target=args.target, draft=args.draft, name=args.draft.stem)
    failed = False
    with open_session(files, preset) as session:
        for temp, name in ((t, n) for t in args.temps.split() for n in names):
            out = Path(f"{args.out_prefix}-t{temp}-{name}.json")
            if out.exists() and out.stat().st_size:
                continue
            ahead, overrides = VARIANTS[name]
            session.engine.draft_ahead = ahead
            report = None
            for event in run_bench(session, preset.with_overrides(temperature=float(temp), **overrides), raw=True):
                if isinstance(event, BenchReport):
                    report = event
            assert report is not None
            atomic_write(out, json.dumps(report.as_json(), indent=2) + "\n", what="bench report")
            spec = report.speculative
            print(f"{out.name}: plain {report.plain.median_tps:.1f} tok/s, speculative {spec.median_tps:.1f} "
                  f"(acceptance {spec.acceptance_rate:.1%}), greedy check "
                  f"{'passed' if report.greedy_check.passed else 'FAILED'}", flush=True)
            failed = failed or not report.greedy_check.passed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
