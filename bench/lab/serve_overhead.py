"""What `localspec serve` costs over `localspec generate`, and what prefix reuse buys a chat, on one machine.

    python bench/lab/serve_overhead.py [--repeat 5] [--max-tokens 128] [--pair demo] [-- extra serve/generate options]

Starts `localspec serve` on a free loopback port, then alternates, `--repeat` times each:
  - `localspec generate PROMPT --temp 0 --json` (its own prefill + decode seconds, from its stats), and
  - the same prompt through the server with the `openai` client, non-streaming (wall time seen by the client) and
    streaming (first token to last token, seen by the client),
and reports median tok/s of each and the server's overhead. Then it times the first token of a chat's turn 1
(a long system prompt, nothing cached) and turn 2 (the whole conversation resent) through the server.
Greedy decoding, so every run generates the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai

PROMPT = "The three primary colours are"
CLI = [sys.executable, "-c", "from localspec.cli.app import main; main()"]
SYSTEM = ("You are a patient tutor for a student learning about colour. Explain ideas step by step, use short "
          "sentences, give one example for each idea, and never use jargon without explaining it first. ") * 6


def start_server(extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "COLUMNS": "200"}
    with log.open("w") as out:
        proc = subprocess.Popen([*CLI, "serve", "--port", "0", *extra], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    deadline = time.monotonic() + 600
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited: {log.read_text()}")
        found = re.search(r"http://127\.0\.0\.1:\d+/v1", log.read_text())
        if found:
            url = found.group(0)
            if httpx.get(url.removesuffix("/v1") + "/health", timeout=10).status_code == 200:
                return proc, url
        time.sleep(0.3)
    raise SystemExit("serve did not become ready")


def generate_seconds(extra: list[str], n: int) -> tuple[float, int]:
    out = subprocess.run([*CLI, "generate", PROMPT, "--temp", "0", "--max-tokens", str(n), "--json", *extra],
                         capture_output=True, text=True, timeout=1800, check=True).stdout
    data = json.loads(out)
    return data["stats"]["prefill_s"] + data["stats"]["decode_s"], data["tokens"]


def server_whole(client: openai.OpenAI, n: int) -> tuple[float, int, float, float]:
    """Client wall seconds, tokens, the engine's own tok/s, and the engine's seconds for that same request."""
    t0 = time.perf_counter()
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=n, temperature=0)
    wall = time.perf_counter() - t0
    t = r.model_extra["timings"]
    return wall, r.usage.completion_tokens, t["predicted_per_second"], (t["prompt_ms"] + t["predicted_ms"]) / 1000


def server_stream(client: openai.OpenAI, n: int) -> float:
    """Tokens after the first per second between the first and the last content chunk."""
    stamps = []
    for chunk in client.completions.create(model="any", prompt=PROMPT, max_tokens=n, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return (tokens - 1) / (stamps[-1] - stamps[0])


def first_token_s(client: openai.OpenAI, messages: list[dict]) -> tuple[float, str, int, int]:
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    for chunk in client.chat.completions.create(model="any", messages=messages, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            prompt_n = chunk.model_extra["timings"]["prompt_n"]
        if chunk.usage:
            usage = chunk.usage
    return first - t0, "".join(text), prompt_n, usage.prompt_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("extra", nargs="*", help="options for both serve and generate (after --)")
    args = ap.parse_args()
    log = Path(f"/tmp/serve_overhead_{os.getpid()}.log")
    proc, url = start_server(args.extra, log)
    client = openai.OpenAI(base_url=url, api_key=os.environ.get("LOCALSPEC_API_KEY", "none"), max_retries=0,
                           timeout=3600)
    try:
        server_whole(client, 8)  # warm-up
        generate_seconds(args.extra, 8)
        gen, whole, inner, stream, around = [], [], [], [], []
        for i in range(args.repeat):
            s, n = generate_seconds(args.extra, args.max_tokens)
            gen.append(n / s)
            s, n, engine_tps, engine_s = server_whole(client, args.max_tokens)
            whole.append(n / s)
            inner.append(engine_tps)
            around.append(s / engine_s - 1)  # HTTP, JSON, queue hand-off, tokenizing: the same request
            stream.append(server_stream(client, args.max_tokens))
            print(f"run {i + 1}: generate {gen[-1]:.2f} tok/s · server JSON {whole[-1]:.2f} · server stream "
                  f"{stream[-1]:.2f} · server engine-only {inner[-1]:.2f}", flush=True)
        g, w, st = statistics.median(gen), statistics.median(whole), statistics.median(stream)
        print(f"median tok/s over {args.repeat} interleaved runs of {args.max_tokens} tokens: generate {g:.2f}, "
              f"server non-streaming {w:.2f} ({(g / w - 1) * 100:+.1f}% time), server streaming {st:.2f} "
              f"({(g / st - 1) * 100:+.1f}% time), server engine-only {statistics.median(inner):.2f}")
        print(f"around the engine, same request (client wall / engine prefill+decode - 1): median "
              f"{statistics.median(around) * 100:+.2f}%, max {max(around) * 100:+.2f}%")

        t1s, t2s = [], []
        for _ in range(args.repeat):
            tag = uuid.uuid4().hex[:8]  # a system prompt nothing has cached
            turn1 = [{"role": "system", "content": f"[{tag}] {SYSTEM}"},
                     {"role": "user", "content": "Why do red and blue make purple?"}]
            t1, reply, n1, p1 = first_token_s(client, turn1)
            turn2 = [*turn1, {"role": "assistant", "content": reply},
                     {"role": "user", "content": "And red and yellow?"}]
            t2, _, n2, p2 = first_token_s(client, turn2)
            t1s.append(t1)
            t2s.append(t2)
            print(f"chat: turn 1 first token {t1 * 1000:.0f} ms (prompt_n {n1} of {p1}) · turn 2 "
                  f"{t2 * 1000:.0f} ms (prompt_n {n2} of {p2})", flush=True)
        print(f"median time to first token: turn 1 {statistics.median(t1s) * 1000:.0f} ms, turn 2 "
              f"{statistics.median(t2s) * 1000:.0f} ms")
    finally:
        proc.send_signal(signal.SIGINT)
        print(f"serve exited with {proc.wait(timeout=120)}")


if __name__ == "__main__":
    main()
