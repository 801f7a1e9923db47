"""Constrained decoding and logprobs: what they cost, and what masking the draft buys (issue #20).

    python bench/structured.py mask [--vocab GGUF] [--rows N]
    python bench/structured.py speed [--pair demo-chat | --target GGUF --draft GGUF] [--runs N] [--max-tokens N]
                                     [--threads N] [--rows full|device|both] [--temp T] [--constraint schema|tools|both]
                                     [--compare-early-stop] [--no-logprobs] [--json OUT]

`mask`: llama.cpp's grammar sampler (`llama.grammar.Grammar`) on a tiny model written with the vocabulary of --vocab
(default: llama.cpp's ggml-vocab-qwen2.gguf, 151,936 tokens, from the pinned llama-cpp-python sdist) — the time to
mask a whole row, and to mask the way the engine does (`constraints.masked_row`: the row's best tokens first) for
greedy (1 legal token needed), top_k = 40 alone and the default sampling (top_k 40, top_p 0.9: `settled` may stop
early), on rows of random logits and on rows that follow the format, at a JSON-schema grammar's first positions.

`speed`: one pair, a JSON-schema chat request (`--constraint tools`: tool calls with tool_choice "required", the
server's `<tool_call>` grammar; `both`), greedy (`--temp 0`) or the default preset's sampling at `--temp` (top_k 40,
top_p 0.9); each mode `--runs` times interleaved in one session, total tok/s and the acceptance: unconstrained,
constrained on the target only (drafts unmasked), constrained on draft and target, plain constrained decoding
(k = 0) — the constrained modes under each row mode of `--rows` (`[load] constrained_rows`: "full" logits, the
default, or "device" top-k candidates with a row decoded again in full where they cannot serve it: "rows again"),
so target-only and draft + target compare under the same rows — and logprobs on vs off (unconstrained;
`--no-logprobs` leaves them out). `--compare-early-stop` adds the constrained modes with rows checked until top_k
legal tokens are found, as before `constraints.settled`, interleaved with the rest. Prints one table (and --json).
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

from localspec.llama.model import LlamaModel  # noqa: E402,I001  -- llama.cpp before numpy (docs/architecture.md)
import numpy as np  # noqa: E402

from localspec.sessions.chat import ChatTemplate, encode_chat  # noqa: E402
from localspec.config import load_preset  # noqa: E402
from localspec.rounds import constraints  # noqa: E402
from localspec.sessions import versus  # noqa: E402
from localspec.rounds.constraints import Constraint, masked_row  # noqa: E402
from localspec.server.tools import messages_for_template, parse_tools  # noqa: E402
from localspec.rounds.events import collect  # noqa: E402
from localspec.errors import LocalspecError  # noqa: E402
from localspec.sessions.session import Session, open_session, resolve_files  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PROMPTS = ["Describe a fictional person as JSON: name, age, city and up to three hobbies.",
           "Invent a character for a novel and give their details as JSON.",
           "Return a JSON record for a made-up customer."]
TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The current weather in a city.",
             "parameters": {"type": "object", "properties": {
                 "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                 "required": ["city", "unit"]}}},
         {"type": "function", "function": {
             "name": "search_flights", "description": "Flights between two cities on a date.",
             "parameters": {"type": "object", "properties": {
                 "origin": {"type": "string"}, "destination": {"type": "string"},
                 "date": {"type": "string", "description": "YYYY-MM-DD"}},
                 "required": ["origin", "destination", "date"]}}}]
TOOL_PROMPTS = ["What is the weather in Lisbon right now, in celsius?",
                "Find me a flight from Oslo to Rome on 2026-03-14.",
                "Is it colder in Helsinki or in Tallinn today? Use fahrenheit."]


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
    with LlamaModel(folder / "t.gguf", n_ctx=64, device_top_k=0, n_threads=1) as model:
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
        greedy = load_preset("greedy").sampling
        default = load_preset("default").sampling  # T 0.7, top_k 40, top_p 0.9
        top_k_only = dataclasses.replace(default, top_p=1.0, min_p=0.0)
        for label, fn, lifted in (("full row", lambda r, s: s.legal(ids), False),
                                  ("greedy, random rows", lambda r, s: masked_row(r, s, greedy), False),
                                  ("top_k 40 alone, random rows", lambda r, s: masked_row(r, s, top_k_only), False),
                                  ("default sampling, random rows", lambda r, s: masked_row(r, s, default), False),
                                  ("greedy, rows following the format", lambda r, s: masked_row(r, s, greedy), True),
                                  ("top_k 40 alone, rows following the format",
                                   lambda r, s: masked_row(r, s, top_k_only), True),
                                  ("default sampling, rows following the format",
                                   lambda r, s: masked_row(r, s, default), True)):
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
    # Greedy (--temp 0, the preset `greedy`), or the shipped default sampling at --temp (top_k 40, top_p 0.9).
    preset = (load_preset("greedy") if args.temp == 0 else load_preset("default").with_overrides(
        temperature=args.temp)).with_overrides(threads=args.threads, n_ctx=1024)
    files = resolve_files(None if args.target else args.pair, args.target, args.draft)
    kinds = ("schema", "tools") if args.constraint == "both" else (args.constraint,)
    # name -> (constraint kind, draft length, constrained, draft masked, logprobs, rows, early stop)
    modes: dict[str, tuple] = {"unconstrained": (kinds[0], args.k, False, False, None, None, True),
                               "unconstrained, plain (k=0)": (kinds[0], 0, False, False, None, None, True)}
    for kind in kinds:
        label = "constrained" if kind == "schema" else "tool call"
        for rows in ("full", "device") if args.rows == "both" else (args.rows,):
            modes |= {f"{label}, target only, {rows} rows": (kind, args.k, True, False, None, rows, True),
                      f"{label}, draft + target, {rows} rows": (kind, args.k, True, True, None, rows, True),
                      f"{label}, plain (k=0), {rows} rows": (kind, 0, True, True, None, rows, True)}
            if args.compare_early_stop:  # the same two modes checking rows as before the early stop
                modes |= {f"{label}, draft + target, {rows} rows, no early stop":
                          (kind, args.k, True, True, None, rows, False),
                          f"{label}, plain (k=0), {rows} rows, no early stop": (kind, 0, True, True, None, rows, False)}
    if args.logprobs:
        modes |= {"unconstrained + logprobs": (kinds[0], args.k, False, False, 5, None, True),
                  "plain + logprobs (k=0)": (kinds[0], 0, False, False, 5, None, True)}
    results: dict[str, list] = {name: [] for name in modes}
    plans: dict[str, versus.Plan] = {}
    with tempfile.TemporaryDirectory(prefix="localspec-structured-") as folder:
        with open_session(files, preset) as s:
            _speed_runs(args, s, modes, results)
            if args.against_llama is not None:
                plans = _llama_plans(args, s, kinds, Path(folder))
        table = _llama_table(args, plans)  # after the session: llama.cpp loads the pair itself, one copy fits
    table |= _table(results)
    print(f"pair {files.name}, temperature {args.temp:g}, k = {args.k}, {args.runs} runs x {len(PROMPTS)} prompts, "
          f"threads {args.threads}, load {os.getloadavg()[0]:.2f}")
    print(f"{'mode':<52} {'tok/s (total)':>14} {'acceptance':>11} {'tokens':>7} {'rows again':>10}")
    for name, row in table.items():
        if "error" in row:
            print(f"{name:<52} {row['error']}")
            continue
        print(f"{name:<52} {row['tok_s_total']:>14.1f} {row['acceptance']:>11.1%} {row['tokens']:>7} "
              f"{row['rows_decoded_again']:>10}")
    return {"pair": files.name, "target": str(files.target), "draft": str(files.draft), "k": args.k,
            "temperature": args.temp, "sampling": dataclasses.asdict(preset.sampling), "runs": args.runs,
            "threads": args.threads, "loadavg": os.getloadavg(), "table": table,
            "llama_cpp": {label: plan.command(Path("PROMPT.txt"), plan.modes[0]) for label, plan in plans.items()}}


def _table(results: dict[str, list]) -> dict[str, dict]:
    table = {}
    for name, stats in results.items():
        tokens = sum(st.tokens for st in stats)
        table[name] = {"tok_s_median": statistics.median(st.decode_tps for st in stats),
                       "tok_s_total": tokens / sum(st.decode_s for st in stats),
                       "acceptance": sum(st.accepted for st in stats) / max(1, sum(st.drafted for st in stats)),
                       "tokens": tokens, "rows_decoded_again": sum(st.full_rows for st in stats)}
    return table


def _llama_plans(args: argparse.Namespace, s: Session, kinds: tuple[str, ...], folder: Path) -> dict[str, versus.Plan]:
    """llama.cpp's own grammar path on the same prompt tokens (`--against-llama`): llama-speculative-simple with
    each kind's GBNF (the very text localspec's grammar parses) as --grammar-file, and without one."""
    tool = versus.probe_tool(versus.find_tool(str(args.against_llama)))
    preset = s.preset.with_overrides(prefer="bench", max_tokens=args.max_tokens, n_draft=args.k, p_min=0.0)
    plans = {}
    for kind in kinds:
        constraint, prompts = _prompts(s, kind)
        texts = [versus.llama_prompt(s, f"{kind}-{i}", text, tokens) for i, (text, tokens) in enumerate(prompts)]
        if kind == kinds[0]:
            plans["unconstrained"] = versus.plan_for(s, preset, tool, texts)
        grammar = folder / f"{kind}.gbnf"
        grammar.write_text(constraint.gbnf, encoding="utf-8")
        plans["constrained" if kind == "schema" else "tool call"] = versus.plan_for(
            s, preset, tool, texts, extra=("--grammar-file", str(grammar)))
    return plans


def _llama_table(args: argparse.Namespace, plans: dict[str, versus.Plan]) -> dict[str, dict]:
    """Per plan and sampling mode: llama.cpp's tokens over its decode seconds, all runs (a run that fails is the
    row's error, not the end of the measurement)."""
    table: dict[str, dict] = {}
    for label, plan in plans.items():
        try:
            runs = [done.run for done in versus.run_prompts(plan, args.llama_runs or args.runs, timeout_s=600.0)]
        except LocalspecError as exc:
            table[f"llama.cpp, {label}"] = {"error": str(exc)}
            continue
        for mode in plan.modes:
            mine = [r.timings for r in runs if r.mode == mode]
            drafted = sum(t.drafted for t in mine)
            table[f"llama.cpp, {label}, {mode} sampling"] = {
                "tok_s_median": None, "tok_s_total": sum(t.tokens for t in mine) / sum(t.seconds for t in mine),
                "acceptance": sum(t.accepted for t in mine) / drafted if drafted else 0.0,
                "tokens": sum(t.tokens for t in mine), "rows_decoded_again": 0}
    return table


def _prompts(s: Session, kind: str) -> tuple[Constraint, list[tuple[str, list[int]]]]:
    """A kind's constraint and its prompts through the chat template (text and tokens): a JSON schema
    (response_format), or tool calls with tool_choice "required" (the server's `<tool_call>` grammar, the tools
    described as the server does)."""
    template = ChatTemplate.for_model(s.target)
    if kind == "schema":
        texts = [template.render([{"role": "user", "content": p}]) for p in PROMPTS]
        return Constraint.json_schema(SCHEMA, "bench"), [(t, encode_chat(s.target, t)) for t in texts]
    request = parse_tools(TOOLS, "required", False)
    assert request is not None
    texts = []
    for p in TOOL_PROMPTS:
        messages, variables = messages_for_template([{"role": "user", "content": p}], request, template.reads_tools)
        texts.append(template.render(messages, **variables))
    return request.constraint(), [(t, encode_chat(s.target, t)) for t in texts]


def _speed_runs(args: argparse.Namespace, s: Session, modes: dict[str, tuple], results: dict[str, list]) -> None:
    preset = s.preset
    prompts = {kind: _prompts(s, kind) for kind in {m[0] for m in modes.values()}}
    # (Only `--compare-early-stop` touches `constraints.settled`: without it this runs against an older
    # localspec/rounds/constraints.py too, for a before/after of the whole masking path.)
    early_stop = constraints.settled if not all(m[6] for m in modes.values()) else None
    try:
        for _ in range(args.runs):
            for name, (kind, k, constrained, on_draft, logprobs, rows, stop) in modes.items():
                # The row mode is the engine's `[load] constrained_rows`, set here per mode so every mode shares
                # one session and interleaves (unconstrained modes ignore it).
                s.engine.constrained_rows = rows or preset.load.constrained_rows
                if early_stop is not None:
                    constraints.settled = early_stop if stop else _never_settled
                constraint, texts = prompts[kind]
                for _, prompt in texts:
                    grammar = constraint.grammar(s.target) if constrained else None
                    s.engine.reset()  # every run processes its prompt in full: no cross-mode cache effects
                    drafting = dataclasses.replace(preset.draft, n_draft=k, p_min=0.0, adaptive=False)
                    gen = collect(s.engine.generate(prompt, preset.sampling, drafting, args.max_tokens,
                                                    grammar=grammar, constrain_draft=on_draft, logprobs=logprobs))
                    results[name].append(gen.stats)
    finally:
        if early_stop is not None:
            constraints.settled = early_stop


def _never_settled(*_: object) -> bool:
    """`--compare-early-stop`: rows checked until top_k legal tokens are found, as before the early stop."""
    return False


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
    sp.add_argument("--temp", type=float, default=0.0,
                    help="0: greedy; otherwise the default preset's sampling (top_k 40, top_p 0.9) at this temperature")
    sp.add_argument("--constraint", choices=("schema", "tools", "both"), default="schema",
                    help="a JSON schema (response_format), tool calls (tool_choice required), or both")
    sp.add_argument("--logprobs", action=argparse.BooleanOptionalAction, default=True,
                    help="also the unconstrained modes with logprobs on")
    sp.add_argument("--against-llama", type=Path, metavar="BIN",
                    help="also llama.cpp's llama-speculative-simple (or its folder) on the same prompts, with the "
                         "same GBNF as --grammar-file and without one")
    sp.add_argument("--llama-runs", type=int, help="llama.cpp's repetitions (default: --runs; each loads the pair)")
    sp.add_argument("--compare-early-stop", action="store_true",
                    help="also the constrained spec and plain modes checking rows without the early stop")
    for q in (m, sp):
        q.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    out = mask(args) if args.command == "mask" else speed(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
