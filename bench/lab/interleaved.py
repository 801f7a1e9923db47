"""Plain decoding, the preset's default and fixed draft lengths on one grid class, many interleaved runs: per mode
the median tok/s, drafts a round and the share kept, written as JSON.

A grid cell (`bench/grid.py`) runs each mode 3-15 times; on the 2-core machine one 32-token run's rate moves by
+-15% from run to run, so a cell's ratio moves by several percent between runs of the same code. This takes one
cell's modes many more times, in turn (the order reversed every other repetition), for a ratio that holds still.
`--seeds fixed` samples every run of a mode with the preset's one seed (what `localspec bench` did before it took a
seed a repetition): at T > 0 that times one sampled text per mode, the comparison it shows.

    python bench/lab/interleaved.py --class code-edit --max-tokens 400 --runs 7 --drafter lookup --fixed 4,6 \\
        --out bench/results/DAY-cpu-interleaved/lookup-code-edit-400.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for grid's classes

import grid  # noqa: E402

from localspec.config import load_preset  # noqa: E402
from localspec.fsutil import atomic_write  # noqa: E402
from localspec.rounds.events import DoneEvent  # noqa: E402
from localspec.sessions.bench import BenchPrompt, tokenize_prompts  # noqa: E402
from localspec.sessions.session import open_session, resolve_files  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--class", dest="name", choices=sorted(grid.CLASSES), required=True)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=30, help="repetitions of every mode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--drafter", default="lookup")
    parser.add_argument("--fixed", default="", help="fixed draft lengths beside plain and the default, e.g. 4,6")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seeds", choices=("repetition", "fixed"), default="repetition",
                        help="repetition: seed + i in repetition i, every mode alike (the bench's); fixed: one seed")
    parser.add_argument("--pair", default="demo")
    parser.add_argument("--target", type=Path, help="a target GGUF in place of the pair's (then --draft too)")
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    preset = load_preset("default").with_overrides(drafter=args.drafter, threads=args.threads,
                                                   temperature=args.temperature)
    modes = {"plain": dataclasses.replace(preset.draft, n_draft=0), "default": preset.draft}
    for k in (int(k) for k in args.fixed.split(",") if k):
        modes[f"k={k}"] = dataclasses.replace(preset.draft, n_draft=k, stand_aside=False)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
    with open_session(resolve_files(args.pair, args.target, args.draft), preset, longest_draft=max(
            d.n_draft for d in modes.values())) as session:
        (_, prompt), = tokenize_prompts(session, [BenchPrompt(args.name, grid.CLASSES[args.name])], raw=True)
        for drafting in modes.values():  # warm-up: each mode once, 32 tokens
            for _ in session.engine.generate(prompt, preset.sampling, drafting, 32, owner="warm-up"):
                pass
        for i in range(args.runs):
            sampling = preset.sampling.repetition(i) if args.seeds == "repetition" else preset.sampling
            order = list(modes.items()) if i % 2 == 0 else list(reversed(modes.items()))
            for name, drafting in order:
                for event in session.engine.generate(prompt, sampling, drafting, args.max_tokens,
                                                     owner=f"run {i} {name}"):
                    if isinstance(event, DoneEvent):
                        s = event.stats
                        runs[name].append({"seed": sampling.seed, "tokens": s.tokens, "decode_s": s.decode_s,
                                           "tok_s": s.tokens / s.decode_s if s.decode_s else 0.0,
                                           "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted})
    def median_rate(rows: list[dict[str, float]]) -> float:
        """Over the runs that decoded a token (as the bench's ModeSummary: an empty run has no rate)."""
        return statistics.median([r["tok_s"] for r in rows if r["tokens"] > 0] or [0.0])

    plain = median_rate(runs["plain"])
    summary = {}
    for name, rows in runs.items():
        median = median_rate(rows)
        drafted, accepted, rounds = (sum(r[key] for r in rows) for key in ("drafted", "accepted", "rounds"))
        summary[name] = {"median_tok_s": median, "over_plain": median / plain if plain else None,
                         "empty_runs": sum(r["tokens"] == 0 for r in rows),
                         "drafted_a_round": drafted / rounds if rounds else 0.0,
                         "kept": accepted / drafted if drafted else None}
        print(f"{args.drafter} {args.name} {args.max_tokens} T={args.temperature} seeds={args.seeds} {name}: "
              f"{median:.2f} tok/s ({summary[name]['over_plain']:.3f}x plain), "
              f"{summary[name]['drafted_a_round']:.2f} drafted a round, kept {summary[name]['kept'] or 0:.2f}")
    report = {"written_by": "bench/lab/interleaved.py", "argv": sys.argv[1:] if argv is None else argv,
              "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(report, indent=1) + "\n", what="interleaved report")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
