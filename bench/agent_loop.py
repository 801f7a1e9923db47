"""An agent loop against an OpenAI-compatible server: every turn resends the whole conversation so far (a system
prompt, each tool result and each reply) plus one new tool result, as coding agents do. With --agents N, N such
conversations take turns, one request at a time (agent 0's turn 1, agent 1's turn 1, agent 0's turn 2, ...), as
several agents or sub-agents sharing fewer slots do: a server whose slot was given to another conversation either
reads the returning one's whole history again or restores it (localspec's `--cache-ram`, llama-server's too).

    python bench/agent_loop.py --url http://127.0.0.1:8080/v1 --turns 20 --agents 2 --json ON.json --label "cache"
    python bench/agent_loop.py --compare OFF.json ON.json

Measured per request with concurrency.py's client (`stream_one`: the official `openai` client, streaming, on the
client's clock): time to first token (send → first chunk with text), decode tok/s ((tokens − 1) / (last − first
text chunk)), and the server's own `timings` where it sends them (localspec and llama-server do): `prompt_n` (prompt
tokens it evaluated) and `cache_n` (those it reused). Tool results are deterministic text (code listings, about
`--turn-chars` characters each: ~320 tokens on a Qwen or Llama tokenizer), so two runs send the same first
turn; with temperature 0 (the default) both replies, and so every later turn, are the same too — `--compare` says
whether they were, beside each turn's time to first token on both runs and the totals.

The JSON (--json, written atomically) holds every request's figures and reply, the settings and the argv. Exit
status: 0, or 1 when the server cannot be reached or a request failed (the JSON is written either way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
from concurrency import (
    BenchError,
    Request,
    _at_least,
    _Parser,
    guarded,
    served_model,
    server_health,
    stream_one,
    write_json,
)

SYSTEM = ("You are a coding agent. Each user message is the output of a tool you ran; answer with the next step "
          "in one or two sentences.")


def tool_result(agent: int, turn: int, chars: int) -> str:
    """A deterministic tool output of about `chars` characters: a source file as `cat` prints it."""
    lines = [f"$ cat src/agent{agent}/module_{turn}.py"]
    i = 0
    while sum(len(line) + 1 for line in lines) < chars:
        lines += [f"def handler_{agent}_{turn}_{i}(request):",
                  f"    value = request.get(\"field_{i}\", {(i * 7 + turn) % 13})",
                  f"    return {{\"status\": \"ok\", \"value\": value * {i + agent}}}", ""]
        i += 1
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="agent_loop.py", description="An agent loop (each turn resends the whole conversation) against "
                "an OpenAI-compatible server: time to first token per turn, tok/s; --compare two runs.")
    p.add_argument("--url", default="http://127.0.0.1:8080/v1", help="OpenAI-compatible base URL (ends in /v1)")
    p.add_argument("--model", help="model id to send (default: the first id of GET /v1/models)")
    p.add_argument("--turns", type=_at_least(1), default=20, help="turns per conversation")
    p.add_argument("--agents", type=_at_least(1), default=2, help="conversations taking turns")
    p.add_argument("--turn-chars", type=_at_least(1), default=1100, help="characters of each tool result")
    p.add_argument("--max-tokens", type=_at_least(1), default=64, help="max_tokens of every reply")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--seed", type=int, default=42, help="seed of every request")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    p.add_argument("--json", type=Path, dest="json_out", help="write the results here")
    p.add_argument("--label", default="", help="what is measured, e.g. 'localspec --cache-ram 0' (into the JSON)")
    p.add_argument("--api-key", default="none", help="API key (Bearer); servers without one ignore it")
    p.add_argument("--compare", type=Path, nargs=2, metavar=("A.json", "B.json"),
                   help="print two runs' per-turn time to first token side by side (no server needed)")
    return p


def _figures(req: Request) -> dict[str, Any]:
    timings = req.timings or {}
    return {**req.to_json(), "agent": req.client, "turn": req.index + 1,
            "prompt_n": timings.get("prompt_n"), "cache_n": timings.get("cache_n")}


async def run(args: argparse.Namespace, argv: list[str]) -> int:
    url = args.url.rstrip("/")
    client = openai.AsyncOpenAI(base_url=url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
    body: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    conversations = [[{"role": "system", "content": SYSTEM}] for _ in range(args.agents)]
    requests: list[Request] = []
    try:
        _, model = await served_model(client, url, args.model)
        health_before = await asyncio.to_thread(server_health, url, args.api_key)
        warm = Request(client=-1, index=0, prompt=-1)  # graphs, caches and clocks: not measured
        await stream_one(client, model, "Say hello.", body, warm, time.perf_counter())
        if warm.error:
            raise BenchError(f"warm-up request failed: {warm.error}")
        started = datetime.now(UTC).isoformat(timespec="seconds")
        t0 = time.perf_counter()
        for turn in range(args.turns):
            for agent in range(args.agents):
                history = conversations[agent]
                history.append({"role": "user", "content": tool_result(agent, turn, args.turn_chars)})
                req = Request(client=agent, index=turn, prompt=turn)
                await stream_one(client, model, list(history), body, req, t0)
                requests.append(req)
                print(f"agent {agent} turn {turn + 1}: " + (f"error {req.error}" if req.error else
                      f"TTFT {req.ttft:.3f} s, {req.tokens} tokens, cache_n {(req.timings or {}).get('cache_n')}"),
                      file=sys.stderr, flush=True)
                if req.error:
                    break
                history.append({"role": "assistant", "content": req.text})
            if any(r.error for r in requests):
                break
        wall = time.perf_counter() - t0
        health_after = await asyncio.to_thread(server_health, url, args.api_key)
    finally:
        await client.close()
    figures = [_figures(r) for r in requests]
    summary = summarize(figures, wall)
    print_run(args.label or url, summary, figures)
    if args.json_out is not None:
        record = {"label": args.label, "argv": argv, "client": {"python": sys.version.split()[0],
                  "openai": openai.__version__}, "started": started, "url": url, "model": model,
                  "settings": {k: getattr(args, k) for k in ("turns", "agents", "turn_chars", "max_tokens",
                                                              "temperature", "seed")},
                  "health_before": health_before, "health_after": health_after, "summary": summary,
                  "requests": figures}
        write_json(args.json_out, record)
    return 1 if any(r.error for r in requests) else 0


def summarize(figures: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ok = [f for f in figures if f["error"] is None]
    ttft = [f["ttft_s"] for f in ok if f["ttft_s"] is not None]
    tps = [f["decode_tps"] for f in ok if f["decode_tps"] is not None]
    last = max((f["turn"] for f in ok), default=0)
    return {
        "requests": len(figures), "errors": len(figures) - len(ok), "wall_s": round(wall, 3),
        "ttft_s_total": round(sum(ttft), 4), "ttft_s_median": round(statistics.median(ttft), 4) if ttft else None,
        "ttft_s_last_turn": round(statistics.mean([f["ttft_s"] for f in ok if f["turn"] == last]), 4) if ok else None,
        "decode_tps_median": round(statistics.median(tps), 3) if tps else None,
        "completion_tokens": sum(f["tokens"] for f in ok),
        "prompt_tokens_last_turn": max(((f["prompt_n"] or 0) + (f["cache_n"] or 0) for f in ok), default=None),
        "prompt_n_total": sum(f["prompt_n"] or 0 for f in ok), "cache_n_total": sum(f["cache_n"] or 0 for f in ok),
    }


def print_run(label: str, summary: dict[str, Any], figures: list[dict[str, Any]]) -> None:
    print(f"\n{label}: {summary['requests']} requests, {summary['errors']} errors, wall {summary['wall_s']:.1f} s")
    print("turn agent  prompt tokens  evaluated  reused  TTFT s  decode tok/s")
    for f in figures:
        total = (f["prompt_n"] or 0) + (f["cache_n"] or 0)
        tps = "-" if f["decode_tps"] is None else f"{f['decode_tps']:.1f}"
        ttft = "-" if f["ttft_s"] is None else f"{f['ttft_s']:.3f}"
        print(f"{f['turn']:>4} {f['agent']:>5} {total:>14} {f['prompt_n'] or 0:>10} {f['cache_n'] or 0:>7} "
              f"{ttft:>7} {tps:>13}")
    print(f"TTFT total {summary['ttft_s_total']:.2f} s (median {summary['ttft_s_median']}, last turn "
          f"{summary['ttft_s_last_turn']}); decode median {summary['decode_tps_median']} tok/s; prompt tokens "
          f"evaluated {summary['prompt_n_total']}, reused {summary['cache_n_total']}")


def compare(a_path: Path, b_path: Path) -> int:
    runs = []
    for path in (a_path, b_path):
        try:
            runs.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            raise BenchError(f"{path}: cannot read a run: {exc}") from None
    a, b = runs
    by_key = [{(f["agent"], f["turn"]): f for f in run["requests"]} for run in runs]
    names = [run["label"] or str(path) for run, path in zip(runs, (a_path, b_path), strict=True)]
    print(f"A = {names[0]}\nB = {names[1]}")
    print("turn agent  prompt tokens  TTFT A s  TTFT B s  A/B   decode A  decode B  same reply")
    same = 0
    keys = sorted(set(by_key[0]) & set(by_key[1]), key=lambda k: (k[1], k[0]))
    for key in keys:
        fa, fb = by_key[0][key], by_key[1][key]
        total = (fb["prompt_n"] or 0) + (fb["cache_n"] or 0)
        ratio = fa["ttft_s"] / fb["ttft_s"] if fa["ttft_s"] and fb["ttft_s"] else None
        equal = fa["text"] == fb["text"]
        same += equal

        def num(x: float | None, spec: str) -> str:
            return "-" if x is None else format(x, spec)

        print(f"{key[1]:>4} {key[0]:>5} {total:>14} {num(fa['ttft_s'], '.3f'):>9} {num(fb['ttft_s'], '.3f'):>9} "
              f"{num(ratio, '.2f'):>5} {num(fa['decode_tps'], '.1f'):>9} {num(fb['decode_tps'], '.1f'):>9}  "
              f"{'yes' if equal else 'NO'}")
    sa, sb = a["summary"], b["summary"]
    print(f"TTFT total A {sa['ttft_s_total']:.2f} s, B {sb['ttft_s_total']:.2f} s "
          f"({sa['ttft_s_total'] / sb['ttft_s_total']:.2f}x); decode median A {sa['decode_tps_median']}, "
          f"B {sb['decode_tps_median']} tok/s; wall A {sa['wall_s']:.1f} s, B {sb['wall_s']:.1f} s; "
          f"prompt tokens evaluated A {sa['prompt_n_total']}, B {sb['prompt_n_total']}; "
          f"same replies {same}/{len(keys)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    full = list(sys.argv) if argv is None else [__file__, *argv]
    args = build_parser().parse_args(full[1:])
    if args.compare:
        return guarded("agent_loop.py", lambda: compare(*args.compare))
    return guarded("agent_loop.py", lambda: asyncio.run(run(args, full)))


if __name__ == "__main__":
    sys.exit(main())

