"""Many clients at once against one OpenAI-compatible server (issue #14): aggregate and per-request speed.

    python bench/concurrency.py --url http://127.0.0.1:8080/v1 --clients 1,4,8,16 [--json OUT] [--label NAME]

Drives `localspec serve --parallel N` and llama.cpp's `llama-server -np N` the same way: the official `openai`
client, streaming chat completions with `stream_options.include_usage`, only OpenAI fields plus `top_k`/`min_p`
(which both servers read) in the body. For each concurrency level C: one warm-up request (not measured), then C
clients start together, each sending `--requests-per-client` requests one after another (a new one as soon as the
last one's stream ends). Client c takes the prompts round-robin from offset c·(P // C), so the requests in flight
at one time carry different prompts (P = the number of prompts).

Measured per request, on the client's clock (time.perf_counter): send → first chunk with text (TTFT); completion
tokens from the usage chunk (a server that sends none: the number of chunks with text, which undercounts when a
chunk holds several tokens: the output says so); per-request decode tok/s = (tokens − 1) / (last text chunk −
first text chunk). Per level: aggregate tok/s = all completion tokens / (first send → last stream end), median and
min per-request tok/s, median TTFT, errors, and acceptance where the server's `timings` report drafts
(llama-server's and localspec's final chunk both carry `draft_n` / `draft_n_accepted`).

The JSON (--json) holds every request's figures and reply text, the settings, the exact argv, the server's /v1/models
answer and its /health before and after (localspec's says how many slots and whether they share each decode). Exit
status: 0, or 1 when the server cannot be reached or any request failed (the JSON is written either way).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import openai

from localspec.errors import LocalspecError, WriteError
from localspec.fsutil import atomic_write
from localspec.sessions.bench import load_prompts as bench_prompts

# Varied on purpose (explanation, code, lists, arithmetic, prose, translation, dialogue): prompts that draft well
# and prompts that do not, of different lengths, so a level's figures are not one kind of text.
PROMPTS: tuple[str, ...] = (
    "Explain how a refrigerator moves heat from its inside to the room, step by step.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "List ten countries in Europe and their capital cities, one per line.",
    "Tell a short story about a lighthouse keeper who finds a message in a bottle.",
    "What is 17 multiplied by 23? Show the working, then check it a second way.",
    "Translate into French: 'The library opens at nine and closes at six on weekdays.'",
    "Summarise the causes of the French Revolution in five bullet points.",
    "Write a SQL query that finds the three customers with the highest total order value.",
    "Describe the water cycle to a ten-year-old.",
    "Give a recipe for a simple tomato soup, with ingredients and numbered steps.",
    "Compare TCP and UDP: when would you choose each? Answer in a short table.",
    "Write a haiku about autumn rain, then explain its imagery.",
    "A train leaves at 14:05 and arrives at 17:50. How long is the journey? Explain.",
    "Write a polite email asking a landlord to repair a leaking kitchen tap.",
    "Explain what a hash table is and why lookups are fast on average.",
    "Continue the dialogue: 'Are you sure this is the right road?' asked Maria. 'Of course,' said Tom,",
)
WARMUP_PROMPT = "Say hello and name three colours."


class BenchError(Exception):
    """A problem that ends the run with one line on stderr and exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


def _clients(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or any(n < 1 for n in levels):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return levels


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="concurrency.py", description="Concurrent streaming clients against an OpenAI-compatible "
                "server: aggregate and per-request tok/s, TTFT, errors per concurrency level.")
    p.add_argument("--url", default="http://127.0.0.1:8080/v1", help="OpenAI-compatible base URL (ends in /v1)")
    p.add_argument("--model", help="model id to send (default: the first id of GET /v1/models)")
    p.add_argument("--clients", type=_clients, default=[1, 4, 8, 16], help="concurrency levels, e.g. 1,4,8,16")
    p.add_argument("--requests-per-client", type=_at_least(1), default=2, help="requests each client sends in turn")
    p.add_argument("--max-tokens", type=_at_least(1), default=256, help="max_tokens of every request")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, help="top_k (not sent unless given; both servers read it)")
    p.add_argument("--top-p", type=float, help="top_p (not sent unless given)")
    p.add_argument("--min-p", type=float, help="min_p (not sent unless given; both servers read it)")
    p.add_argument("--seed", type=int, default=42, help="seed of every request (-1: not sent, the server draws)")
    p.add_argument("--prompts", type=Path, help="a file with one prompt per line, or JSONL with 'prompt' or "
                   "'messages', as `localspec bench --prompts` reads it (default: 16 built-in prompts)")
    p.add_argument("--warmup", type=_at_least(0), default=1, help="unmeasured requests before each level (default 1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    p.add_argument("--json", type=Path, dest="json_out", help="write the results here")
    p.add_argument("--label", default="", help="what is measured, e.g. 'localspec k=6' (goes into the JSON)")
    p.add_argument("--api-key", default="none", help="API key (Bearer); servers without one ignore it")
    p.add_argument("--image", type=Path, help="a picture (PNG, JPEG) sent before every prompt's text, as an image_url "
                   "part with a data: URI (both servers need the projector: --mmproj)")
    return p


def load_prompts(path: Path | None) -> list[str | list[dict[str, str]]]:
    """--prompts as `localspec bench --prompts` reads it (one home for prompt files): one prompt per line, or JSONL
    with `prompt` (a user message's text; it may hold newlines) or `messages` (a whole conversation)."""
    if path is None:
        return list(PROMPTS)
    try:
        read = bench_prompts(path)
    except LocalspecError as exc:
        raise BenchError(f"--prompts {exc}") from None
    return [p.text if p.text is not None else [dict(m) for m in p.messages or ()] for p in read]


@dataclass
class Request:
    """One measured request; times are seconds from the level's start (perf_counter)."""

    client: int
    index: int  # the client's n-th request
    prompt: int  # index into the prompt list
    sent: float = 0.0
    first_token: float | None = None  # first chunk carrying text
    last_token: float | None = None  # last chunk carrying text
    end: float | None = None  # the stream ended (after the usage chunk)
    tokens: int = 0
    usage_tokens: int | None = None  # from the usage chunk; None = the server sent none
    text_chunks: int = 0
    text: str = ""  # the reply: the same seed's replies at different concurrencies can then be compared
    finish_reason: str | None = None
    timings: dict[str, Any] | None = None  # the server's own `timings`, when it sends them
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def decode_tps(self) -> float | None:
        if self.first_token is None or self.last_token is None or self.tokens < 2:
            return None
        span = self.last_token - self.first_token
        return (self.tokens - 1) / span if span > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ttft_s": self.ttft, "decode_tps": self.decode_tps}


@dataclass
class Level:
    clients: int
    requests: list[Request] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.requests if r.error is None]
        tokens = sum(r.tokens for r in ok)
        tps = [r.decode_tps for r in ok if r.decode_tps is not None]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        # llama-server leaves draft_n out of a request that drafted nothing: count it as 0 once any request has it.
        timings = [r.timings or {} for r in ok]
        have_drafts = any("draft_n" in t for t in timings)
        drafted = [int(t.get("draft_n", 0)) for t in timings]
        accepted = [int(t.get("draft_n_accepted", 0)) for t in timings]
        return {
            "clients": self.clients,
            "requests": len(self.requests),
            "errors": len(self.requests) - len(ok),
            "completion_tokens": tokens,
            "wall_s": self.wall_s,
            "aggregate_tps": round(tokens / self.wall_s, 3) if self.wall_s > 0 else None,
            "per_request_tps_median": round(statistics.median(tps), 3) if tps else None,
            "per_request_tps_min": round(min(tps), 3) if tps else None,
            "per_request_tps_max": round(max(tps), 3) if tps else None,
            "ttft_s_median": round(statistics.median(ttft), 4) if ttft else None,
            "ttft_s_max": round(max(ttft), 4) if ttft else None,
            "tokens_from_usage": sum(r.usage_tokens is not None for r in ok),
            "draft_n": sum(drafted) if have_drafts else None,
            "draft_n_accepted": sum(accepted) if have_drafts else None,
            "acceptance": (round(sum(accepted) / sum(drafted), 4) if have_drafts and sum(drafted) else None),
        }


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, openai.APIStatusError):
        # the server's own message where its error body has one (the client's adds "Error code: N - {body}")
        body = exc.body if isinstance(exc.body, dict) else {}
        text = f"HTTP {exc.status_code}: {body.get('message') or exc.message}"
    elif isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        text = f"{exc.message} ({type(cause).__name__}: {cause})" if cause else exc.message
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def _body(args: argparse.Namespace) -> dict[str, Any]:
    """The fields every request sends besides model/messages/stream: the same for every server."""
    kw: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.top_p is not None:
        kw["top_p"] = args.top_p
    if args.seed is not None and args.seed >= 0:
        kw["seed"] = args.seed
    extra = {k: v for k, v in (("top_k", args.top_k), ("min_p", args.min_p)) if v is not None}
    if extra:
        kw["extra_body"] = extra
    return kw


def with_picture(prompt: str, image_uri: str | None) -> str | list[dict[str, Any]]:
    """A prompt as its user message's content: the text, or the picture (an image_url part) then the text."""
    if image_uri is None:
        return prompt
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_uri}},
                                         {"type": "text", "text": prompt}]}]


def image_uri(path: Path | None) -> str | None:
    """--image as a data: URI (its type from the file's first bytes), or None; a BenchError naming it if unreadable."""
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BenchError(f"--image {path}: {exc.strerror or exc}") from None
    kind = "png" if data.startswith(b"\x89PNG") else "jpeg" if data.startswith(b"\xff\xd8") else None
    if kind is None:
        raise BenchError(f"--image {path}: not a PNG or JPEG file")
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


async def stream_one(client: openai.AsyncOpenAI, model: str, prompt: str | list[dict[str, Any]],
                     body: dict[str, Any], req: Request, t0: float) -> None:
    """Send one streaming chat completion (a user message, or a whole conversation) and fill `req` in; an error is
    recorded, not raised."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    req.sent = time.perf_counter() - t0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, **body)
        async with stream:  # closes the connection also when the stream fails halfway
            await _read(stream, req, t0)
            req.end = time.perf_counter() - t0
        req.tokens = req.usage_tokens if req.usage_tokens is not None else req.text_chunks
    except Exception as exc:  # one failed request must not end the level: it is counted and reported
        req.end = time.perf_counter() - t0
        req.error = _one_line(exc)


async def _read(stream: Any, req: Request, t0: float) -> None:
    async for chunk in stream:
        now = time.perf_counter() - t0
        if chunk.usage is not None and chunk.usage.completion_tokens is not None:
            req.usage_tokens = chunk.usage.completion_tokens
        timings = (chunk.model_extra or {}).get("timings")
        if isinstance(timings, dict):
            req.timings = timings
        for choice in chunk.choices:
            if choice.delta is not None and choice.delta.content:
                req.text_chunks += 1
                req.text += choice.delta.content
                if req.first_token is None:
                    req.first_token = now
                req.last_token = now
            if choice.finish_reason:
                req.finish_reason = choice.finish_reason


async def run_level(client: openai.AsyncOpenAI, model: str, prompts: list[Any], n_clients: int,
                    args: argparse.Namespace) -> Level:
    body = _body(args)
    for _ in range(args.warmup):
        warm = Request(client=-1, index=0, prompt=-1)
        await stream_one(client, model, with_picture(WARMUP_PROMPT, args.image_uri), body, warm, time.perf_counter())
        if warm.error:
            raise BenchError(f"warm-up request failed: {warm.error}")
    level = Level(clients=n_clients)
    stride = max(1, len(prompts) // n_clients)

    async def one_client(c: int) -> None:
        for i in range(args.requests_per_client):
            p = (c * stride + i) % len(prompts)
            req = Request(client=c, index=i, prompt=p)
            level.requests.append(req)
            await stream_one(client, model, with_picture(prompts[p], args.image_uri), body, req, t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client(c) for c in range(n_clients)))
    ends = [r.end for r in level.requests if r.end is not None]
    level.wall_s = max(ends) if ends else time.perf_counter() - t0  # t0 = the first send
    level.requests.sort(key=lambda r: (r.client, r.index))
    return level


async def fetch_models(client: openai.AsyncOpenAI, url: str) -> tuple[Any, list[str]]:
    """The server's GET /models answer as it sent it (recorded in the JSON), and the model ids in it."""
    try:
        raw = await client.models.with_raw_response.list()
        ids = [m.id for m in raw.parse().data]
        answer = json.loads(raw.text)
    except openai.APIConnectionError as exc:
        raise BenchError(f"cannot reach {url}: {_one_line(exc)}") from None
    except openai.APIStatusError as exc:
        raise BenchError(f"{url}/models: {_one_line(exc)}") from None
    except (ValueError, AttributeError, TypeError) as exc:
        raise BenchError(f"{url}/models: not an OpenAI model list ({type(exc).__name__}: {exc})") from None
    return answer, ids


async def served_model(client: openai.AsyncOpenAI, url: str, given: str | None) -> tuple[Any, str]:
    """The server's /models answer and the model id to send: `given`, else the first it lists."""
    models, ids = await fetch_models(client, url)
    if given is None and not ids:
        raise BenchError(f"{url}/models lists no model: pass --model")
    return models, given or ids[0]


def server_health(url: str, api_key: str) -> Any:
    """GET /health beside the API root (llama-server's and localspec's: status, slots, counters), recorded in the
    JSON as the server described itself; None where there is none."""
    root = url.removesuffix("/v1")
    request = urllib.request.Request(f"{root}/health", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def print_table(args: argparse.Namespace, model: str, levels: list[dict[str, Any]], token_note: str | None) -> None:
    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    print(f"\n{args.label or 'server'}: model {model} at {args.url}; {args.requests_per_client} streaming chat "
          f"request(s) per client, max_tokens {args.max_tokens}, temperature {args.temperature}\n"
          "aggregate = all completion tokens / level wall time; per-request = (tokens - 1) / (last - first text "
          "chunk); TTFT = send -> first text chunk")
    head = ("clients", "requests", "errors", "tokens", "wall s", "aggregate tok/s", "per-req median", "per-req min",
            "TTFT median s", "acceptance")
    rows = [(str(s["clients"]), str(s["requests"]), str(s["errors"]), str(s["completion_tokens"]),
             fmt(s["wall_s"], ".2f"), fmt(s["aggregate_tps"], ".1f"), fmt(s["per_request_tps_median"], ".1f"),
             fmt(s["per_request_tps_min"], ".1f"), fmt(s["ttft_s_median"], ".3f"),
             fmt(s["acceptance"], ".1%")) for s in levels]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    for row in (head, *rows):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    if token_note:
        print(token_note)


async def run(args: argparse.Namespace, argv: list[str]) -> int:
    prompts = load_prompts(args.prompts)
    args.image_uri = image_uri(args.image)
    if args.image_uri is not None and not all(isinstance(p, str) for p in prompts):
        raise BenchError(f"--image with --prompts {args.prompts}: a picture goes before one prompt's text, not into "
                         "a conversation ('messages')")
    if args.json_out is not None:  # before the measurement, not after it
        try:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BenchError(f"--json {args.json_out}: {exc.strerror or exc}") from None
    url = args.url.rstrip("/")
    client = openai.AsyncOpenAI(base_url=url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
    try:
        models, model = await served_model(client, url, args.model)
        health_before = await asyncio.to_thread(server_health, url, args.api_key)
        started = datetime.now(UTC).isoformat(timespec="seconds")
        levels: list[Level] = []
        for n in args.clients:
            print(f"level {n}: {n} client(s) x {args.requests_per_client} request(s), max_tokens {args.max_tokens}",
                  file=sys.stderr, flush=True)
            levels.append(await run_level(client, model, prompts, n, args))
        health_after = await asyncio.to_thread(server_health, url, args.api_key)
    finally:
        await client.close()

    summaries = [lv.summary() for lv in levels]
    ok = [r for lv in levels for r in lv.requests if r.error is None]
    no_usage = sum(r.usage_tokens is None for r in ok)
    token_note = None
    if no_usage:
        token_note = (f"note: {no_usage} of {len(ok)} requests had no usage chunk; their tokens are the count of "
                      "chunks with text (an undercount where a chunk holds several tokens)")
    print_table(args, model, summaries, token_note)
    errors = [(lv.clients, r.client, r.error) for lv in levels for r in lv.requests if r.error]
    for clients, c, err in errors[:10]:
        print(f"error at {clients} clients, client {c}: {err}")
    if len(errors) > 10:
        print(f"... and {len(errors) - 10} more errors (see the JSON)")

    if args.json_out is not None:
        record = {
            "label": args.label,
            "argv": argv,
            "client": {"python": sys.version.split()[0], "openai": openai.__version__},
            "started": started,
            "url": url,
            "model": model,
            "models_response": models,
            "health_before": health_before,
            "health_after": health_after,
            "settings": {
                "clients": args.clients, "requests_per_client": args.requests_per_client,
                "max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
                "top_p": args.top_p, "min_p": args.min_p, "seed": args.seed, "warmup": args.warmup,
                "prompts": str(args.prompts) if args.prompts else "built-in", "n_prompts": len(prompts),
                "request_fields": _body(args),
                "image": None if args.image is None else {"file": str(args.image), "bytes": args.image.stat().st_size},
            },
            "token_count": "usage" if not no_usage else f"chunks with text for {no_usage} of {len(ok)} requests",
            "levels": [{**s, "results": [r.to_json() for r in lv.requests]}
                       for s, lv in zip(summaries, levels, strict=True)],
            "prompts": prompts,
        }
        write_json(args.json_out, record)
    return 1 if errors else 0


def write_json(path: Path, record: dict[str, Any]) -> None:
    """The run's record, atomically: a JSON that exists is whole (the GPU harness skips what exists)."""
    try:
        atomic_write(path, json.dumps(record, indent=1, default=str) + "\n", what="--json")
    except WriteError as exc:
        raise BenchError(str(exc)) from None


def guarded(prog: str, body: Callable[[], int]) -> int:
    """A client's exit status: `body`'s, or 1 with one line on stderr for a BenchError, 130 for Ctrl-C."""
    try:
        return body()
    except BenchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    # The JSON records the command line as run; called as a function, this file stands in for the program name.
    full = list(sys.argv) if argv is None else [__file__, *argv]
    args = build_parser().parse_args(full[1:])
    return guarded("concurrency.py", lambda: asyncio.run(run(args, full)))


if __name__ == "__main__":
    sys.exit(main())
