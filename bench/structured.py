"""Constrained decoding and logprobs: what they cost, and what masking the draft buys (issue #20).

    python bench/structured.py mask [--vocab GGUF] [--rows N]
    python bench/structured.py speed [--pair demo-chat | --target GGUF --draft GGUF] [--runs N] [--max-tokens N]
                                     [--threads N] [--rows full|device|both] [--json OUT]

`mask`: llama.cpp's grammar sampler (`llama_ctx.Grammar`) on a tiny model written with the vocabulary of --vocab
(default: llama.cpp's ggml-vocab-qwen2.gguf, 151,936 tokens, from the pinned llama-cpp-python sdist) — the time to
mask a whole row, and to mask the way the engine does (`constraints.masked_row`: the row's best tokens first) for
greedy (1 legal token needed) and top_k = 40, on rows of random logits, at a JSON-schema grammar's first positions.

`speed`: one pair, greedy, a JSON-schema chat request; each mode `--runs` times interleaved in one session, median
tok/s and the acceptance: unconstrained, constrained on the target only (drafts unmasked), constrained on draft and
target, plain constrained decoding (k = 0) — the constrained modes under each row mode of `--rows` (`[load]
constrained_rows`: "full" logits, the default, or "device" top-k candidates with a row decoded again in full where
they hold too few legal tokens: "rows again"), so target-only and draft + target compare under the same rows —
and logprobs on vs off (unconstrained). Prints one table (and --json).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from localspec.llama_ctx import LlamaModel  # noqa: E402,I001  -- llama.cpp before numpy (docs/architecture.md)
import numpy as np  # noqa: E402

from localspec.chat import ChatTemplate, encode_chat  # noqa: E402
from localspec.config import load_preset  # noqa: E402
from localspec.constraints import Constraint, masked_row  # noqa: E402
from localspec.engine import collect  # noqa: E402
from localspec.session import Session, open_session, resolve_files  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PROMPTS = ["Describe a fictional person as JSON: name, age, city and up to three hobbies.",
           "Invent a character for a novel and give their details as JSON.",
           "Return a JSON record for a made-up customer."]


# Where the rest of bench finds llama.cpp's vocabulary file: bench/gpu/make_archive.sh takes it from the pinned
# llama-cpp-python sdist into the carry.
CARRIED_VOCAB = ROOT / "bench" / "gpu" / "carry" / "ggml-vocab-qwen2.gguf"
VOCAB_IN_SDIST = Path("vendor/llama.cpp/models/ggml-vocab-qwen2.gguf")


def default_vocab() -> Path:
    """llama.cpp's Qwen2 vocabulary: beside the llama_cpp package when it is a source tree (an editable install of
    the sdist), else the GPU carry's copy; never a path of one machine."""
    spec = importlib.util.find_spec("llama_cpp")
    candidates = [CARRIED_VOCAB]
    if spec and spec.origin:
        candidates.insert(0, Path(spec.origin).parent.parent / VOCAB_IN_SDIST)
    for path in candidates:
        if path.is_file():
            return path
    raise SystemExit(f"no ggml-vocab-qwen2.gguf found: pass --vocab FILE (the llama-cpp-python sdist's "
                     f"{VOCAB_IN_SDIST}), or run `bash bench/gpu/make_archive.sh`, which copies it from the pinned "
                     f"sdist to {CARRIED_VOCAB.relative_to(ROOT)}")


def mask(args: argparse.Namespace) -> dict:
    from synthetic import TINY, write_pair

    vocab = args.vocab or default_vocab()
    folder = Path(tempfile.mkdtemp(prefix="localspec-mask-"))
    write_pair(folder / "t.gguf", folder / "d.gguf", TINY, vocab_source=vocab)
    with LlamaModel(folder / "t.gguf", n_ctx=64, n_threads=1) as model:
        grammar = Constraint.json_schema(SCHEMA, "bench").grammar(model)
        ids = np.arange(model.n_vocab)
        states, g = [], grammar
        for piece in ('{"', 'name', '":', ' "'):  # a few positions into the object: keys, then a string value
            states.append(g)
            g = g.clone()
            for t in model.tokenize(piece, add_special=False):
                g.accept(t)
        rng = np.random.default_rng(0)
        rows = [rng.normal(size=model.n_vocab).astype(np.float32) * 3 for _ in range(args.rows)]
        legal = [s.legal(ids) for s in states]
        # A model that follows the format ranks the legal tokens first: the same rows with them lifted by 12.
        following = [[np.where(mask, r + 12, r) for r in rows] for mask in legal]
        out: dict = {"vocab": str(vocab), "n_vocab": model.n_vocab, "rows": args.rows * len(states),
                     "load": os.getloadavg()[0]}
        for label, fn, lifted in (("full row", lambda r, s: s.legal(ids), False),
                                  ("greedy, random rows", lambda r, s: masked_row(r, s, 1), False),
                                  ("top_k 40, random rows", lambda r, s: masked_row(r, s, 40), False),
                                  ("greedy, rows following the format", lambda r, s: masked_row(r, s, 1), True),
                                  ("top_k 40, rows following the format", lambda r, s: masked_row(r, s, 40), True)):
            t0 = time.perf_counter()
            for i, s in enumerate(states):
                for r in following[i] if lifted else rows:
                    fn(r, s)
            out[label] = (time.perf_counter() - t0) / (len(rows) * len(states)) * 1000
        out["legal tokens per position"] = [int(mask.sum()) for mask in legal]
    for key, value in out.items():
        print(f"{key:>36}: {value:.3f} ms" if isinstance(value, float) and key != "load" else f"{key:>36}: {value}")
    return out


def speed(args: argparse.Namespace) -> dict:
    preset = load_preset("greedy").with_overrides(threads=args.threads, n_ctx=1024)
    files = resolve_files(None if args.target else args.pair, args.target, args.draft)
    constraint = Constraint.json_schema(SCHEMA, "bench")
    # name -> (draft length, constrained, draft masked, logprobs, constrained rows: `[load] constrained_rows`)
    modes: dict[str, tuple] = {"unconstrained": (args.k, False, False, None, None)}
    for rows in ("full", "device") if args.rows == "both" else (args.rows,):
        modes |= {f"constrained, target only, {rows} rows": (args.k, True, False, None, rows),
                  f"constrained, draft + target, {rows} rows": (args.k, True, True, None, rows),
                  f"constrained, plain (k=0), {rows} rows": (0, True, True, None, rows)}
    modes |= {"unconstrained + logprobs": (args.k, False, False, 5, None),
              "unconstrained, plain (k=0)": (0, False, False, None, None),
              "plain + logprobs (k=0)": (0, False, False, 5, None)}
    results: dict[str, list] = {name: [] for name in modes}
    with open_session(files, preset) as s:
        _speed_runs(args, s, constraint, modes, results)
    table = {}
    for name, stats in results.items():
        tokens = sum(st.tokens for st in stats)
        table[name] = {"tok_s_median": statistics.median(st.decode_tps for st in stats),
                       "tok_s_total": tokens / sum(st.decode_s for st in stats),
                       "acceptance": sum(st.accepted for st in stats) / max(1, sum(st.drafted for st in stats)),
                       "tokens": tokens, "rows_decoded_again": sum(st.full_rows for st in stats)}
    print(f"pair {files.name}, greedy, k = {args.k}, {args.runs} runs x {len(PROMPTS)} prompts, "
          f"threads {args.threads}, load {os.getloadavg()[0]:.2f}")
    print(f"{'mode':<44} {'tok/s (total)':>14} {'acceptance':>11} {'tokens':>7} {'rows again':>10}")
    for name, row in table.items():
        print(f"{name:<44} {row['tok_s_total']:>14.1f} {row['acceptance']:>11.1%} {row['tokens']:>7} "
              f"{row['rows_decoded_again']:>10}")
    return {"pair": files.name, "target": str(files.target), "draft": str(files.draft), "k": args.k,
            "runs": args.runs, "threads": args.threads,
            "loadavg": os.getloadavg(), "table": table}


def _speed_runs(args: argparse.Namespace, s: Session, constraint: Constraint, modes: dict[str, tuple],
                results: dict[str, list]) -> None:
    preset = s.preset
    template = ChatTemplate.for_model(s.target)
    prompts = [encode_chat(s.target, template.render([{"role": "user", "content": p}])) for p in PROMPTS]
    for _ in range(args.runs):
        for name, (k, constrained, on_draft, logprobs, rows) in modes.items():
            # The row mode is the engine's `[load] constrained_rows`, set here per mode so every mode shares one
            # session and interleaves (unconstrained modes ignore it).
            s.engine.constrained_rows = rows or preset.load.constrained_rows
            for prompt in prompts:
                grammar = constraint.grammar(s.target) if constrained else None
                s.engine.reset()  # every run processes its prompt in full: no cross-mode cache effects
                drafting = dataclasses.replace(preset.draft, n_draft=k, p_min=0.0, adaptive=False)
                gen = collect(s.engine.generate(prompt, preset.sampling, drafting, args.max_tokens, grammar=grammar,
                                                constrain_draft=on_draft, logprobs=logprobs))
                results[name].append(gen.stats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mask")
    m.add_argument("--vocab", type=Path)
    m.add_argument("--rows", type=int, default=20)
    sp = sub.add_parser("speed")
    sp.add_argument("--pair", default="demo-chat")
    sp.add_argument("--target", type=Path)
    sp.add_argument("--draft", type=Path)
    sp.add_argument("--runs", type=int, default=3)
    sp.add_argument("--k", type=int, default=6)
    sp.add_argument("--max-tokens", type=int, default=96)
    sp.add_argument("--threads", type=int, default=1)
    sp.add_argument("--rows", choices=("full", "device", "both"), default="both",
                    help="the constrained modes' rows ([load] constrained_rows); both: each mode under each")
    for q in (m, sp):
        q.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    out = mask(args) if args.command == "mask" else speed(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
