"""A coding agent's sessions replayed against an OpenAI-compatible server: the traffic suffix lookup is for.

Each session is what an agent (Cline, Aider, Continue, OpenHands) sends a local server: a system prompt, then turn by
turn a tool's output pasted back — a file read, a test run's failure quoting it, a diff, a request to rewrite the file
with the edit applied (the reply copies most of the file), the file read again, a search's JSON in the same shape
each time — and every turn resends the whole conversation so far, the model's replies included. The sessions are
generated from `--seed` (no downloads): the same seed sends the same first turn, and at temperature 0 the same
conversation throughout.

    python bench/agent_replay.py --url http://127.0.0.1:8080/v1 --sessions 2 --turns 8 --drafter suffix --json S.json
    python bench/agent_replay.py --url http://127.0.0.1:8080/v1 --drafter lookup --json L.json

Per turn, with concurrency.py's client (the official `openai` client, streaming, on the client's clock): time to first
token, decode tok/s, and from the server's `timings` (localspec sends them) the prompt tokens evaluated and reused
(`prompt_n`, `cache_n`: serve with the prompt cache on, `--cache-ram`, as agents' long prompts want) and the drafts
proposed and accepted (`draft_n`, `draft_n_accepted`). `--drafter NAME` asks the server for that drafter in every
request (`speculative.type`); without it, the server's own. Exit status: 0, or 1 when the server cannot be reached or
a request failed (the JSON, `--json`, is written either way).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
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

SYSTEM = ("You are a coding agent working in a Python repository. Each user message is the output of a tool you ran. "
          "Answer with the next step; when asked for a file, reply with the whole file and nothing else.")

NOUNS = ("user", "order", "invoice", "session", "token", "record", "account", "payment", "report", "item")
VERBS = ("load", "save", "parse", "check", "render", "update", "build", "fetch", "merge", "clean")


@dataclass
class SourceFile:
    """A generated module: its path and lines (what the session reads, tests, diffs and rewrites)."""

    path: str
    lines: list[str]

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def source_file(rng: random.Random, session: int, functions: int) -> SourceFile:
    """A module of `functions` small functions with the same shapes (what agents read again and again)."""
    noun = rng.choice(NOUNS)
    lines = [f'"""Helpers for {noun}s."""', "", "from __future__ import annotations", "", "import json", ""]
    for i in range(functions):
        verb, field = rng.choice(VERBS), rng.choice(NOUNS)
        lines += ["", f"def {verb}_{field}_{i}(data: dict) -> dict:",
                  f'    """{verb.capitalize()} the {field} of a {noun}."""',
                  f'    value = data.get("{field}_{i}", {rng.randint(0, 99)})',
                  "    if value is None:",
                  f'        raise ValueError("missing {field}_{i}")',
                  f'    return {{"status": "ok", "{field}": value, "count": {rng.randint(1, 9)}}}']
    return SourceFile(f"src/app{session}/{noun}_helpers.py", lines)


def edited(rng: random.Random, file: SourceFile) -> tuple[SourceFile, str]:
    """The file with one return line changed, and the unified diff that says so (git's shape)."""
    returns = [i for i, line in enumerate(file.lines) if line.startswith("    return {")]
    at = rng.choice(returns)
    old, new = file.lines[at], file.lines[at].replace('"status": "ok"', '"status": "done"')
    lines = [*file.lines[:at], new, *file.lines[at + 1 :]]
    start = max(0, at - 3)
    context = file.lines[start:at]
    after = file.lines[at + 1 : at + 4]
    diff = [f"diff --git a/{file.path} b/{file.path}", f"--- a/{file.path}", f"+++ b/{file.path}",
            f"@@ -{start + 1},{len(context) + 1 + len(after)} +{start + 1},{len(context) + 1 + len(after)} @@",
            *(" " + line for line in context), "-" + old, "+" + new, *(" " + line for line in after)]
    return SourceFile(file.path, lines), "\n".join(diff)


def pytest_report(rng: random.Random, file: SourceFile) -> str:
    """pytest's failure report quoting the file (the shape every run repeats)."""
    names = [line[4:].split("(")[0] for line in file.lines if line.startswith("def ")]
    failing = rng.sample(names, k=min(2, len(names)))
    out = ["$ python -m pytest -q", f"{'.' * (len(names) - len(failing))}{'F' * len(failing)}", "=" * 30 + " FAILURES "
           + "=" * 30]
    for name in failing:
        out += [f"_____ test_{name} _____", "", f"    def test_{name}():", f"        result = {name}({{}})",
                '>       assert result["status"] == "done"', "E       AssertionError: assert 'ok' == 'done'", "",
                f"{file.path}:{rng.randint(8, len(file.lines))}: AssertionError"]
    out.append(f"{len(failing)} failed, {len(names) - len(failing)} passed in 0.{rng.randint(10, 99)}s")
    return "\n".join(out)


def search_json(rng: random.Random, file: SourceFile) -> str:
    """A search tool's JSON: the same keys every time."""
    hits = [{"path": file.path, "line": i + 1, "text": line.strip()}
            for i, line in enumerate(file.lines) if "raise ValueError" in line]
    return json.dumps({"tool": "search", "query": "raise ValueError", "matches": rng.sample(hits, k=min(4, len(hits)))},
                      indent=2)


def session_turns(seed: int, session: int, turns: int, functions: int) -> list[str]:
    """One session's user messages (tool outputs and the agent's asks), in order: read, test, diff, rewrite, read
    again, search, then the cycle over the next edit."""
    rng = random.Random(seed * 1000 + session)
    file = source_file(rng, session, functions)
    messages: list[str] = [f"Task: make the failing tests pass.\n\n[read_file {file.path}]\n{file.text}"]
    while len(messages) < turns:
        new, diff = edited(rng, file)
        messages += [
            f"[run_tests]\n{pytest_report(rng, file)}",
            f"[apply_diff]\n{diff}\nApplied.",
            f"Rewrite {file.path} with the diff applied. Reply with the whole file.",
            f"[read_file {file.path}]\n{new.text}",
            f"[search]\n{search_json(rng, new)}",
        ]
        file = new
    return messages[:turns]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="agent_replay.py", description="A coding agent's sessions (file reads, diffs, test output, a file "
                "rewritten) replayed against an OpenAI-compatible server, the whole conversation resent each turn: "
                "tok/s, acceptance and time to first token per turn.")
    p.add_argument("--url", default="http://127.0.0.1:8080/v1", help="OpenAI-compatible base URL (ends in /v1)")
    p.add_argument("--model", help="model id to send (default: the first id of GET /v1/models)")
    p.add_argument("--sessions", type=_at_least(1), default=2, help="sessions, replayed one after another")
    p.add_argument("--turns", type=_at_least(1), default=8, help="turns per session")
    p.add_argument("--functions", type=_at_least(1), default=8, help="functions in each session's file")
    p.add_argument("--max-tokens", type=_at_least(1), default=256, help="max_tokens of every reply")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--seed", type=int, default=42, help="seed of the sessions and of every request")
    p.add_argument("--drafter", help="ask for this drafter in every request (speculative.type): suffix, lookup, ...")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    p.add_argument("--json", type=Path, dest="json_out", help="write the results here")
    p.add_argument("--label", default="", help="what is measured (into the JSON)")
    p.add_argument("--api-key", default="none", help="API key (Bearer); servers without one ignore it")
    p.add_argument("--serve", metavar="ARGS", help="start `localspec serve --port 0 ARGS` for each of --drafters "
                   "(a fresh server each: suffix lookup's index of past requests starts empty), replay, stop it")
    p.add_argument("--drafters", help="with --serve: comma-separated drafters, each replayed on its own server; the "
                   "first is the baseline of the CSV's ratio column")
    p.add_argument("--csv", type=Path, help="with --serve: write one row per drafter here (bench/results/README.md's "
                   "raw format: `#` lines, then the table); each drafter's JSON goes beside it")
    return p


def figures(req: Request, session: int) -> dict[str, Any]:
    t = req.timings or {}
    drafted, accepted = t.get("draft_n"), t.get("draft_n_accepted")
    return {"session": session, "turn": req.index + 1, "error": req.error, "ttft_s": req.ttft,
            "decode_tps": req.decode_tps, "tokens": req.tokens, "prompt_n": t.get("prompt_n"),
            "cache_n": t.get("cache_n"), "draft_n": drafted, "draft_n_accepted": accepted,
            "acceptance": accepted / drafted if drafted else None, "server_tps": t.get("predicted_per_second"),
            "text": req.text}


def summarize(rows: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ok = [r for r in rows if r["error"] is None]
    tps = [r["decode_tps"] for r in ok if r["decode_tps"] is not None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    drafted = sum(r["draft_n"] or 0 for r in ok)
    accepted = sum(r["draft_n_accepted"] or 0 for r in ok)
    # The whole replay's decode rate: every turn's tokens after the first over its decode seconds, summed (a turn's
    # decode_tps is (tokens - 1) / its decode time: concurrency.Request).
    timed = [(r["tokens"] - 1, (r["tokens"] - 1) / r["decode_tps"]) for r in ok if r["decode_tps"]]
    seconds = sum(t for _, t in timed)
    return {"requests": len(rows), "errors": len(rows) - len(ok), "wall_s": round(wall, 3),
            "decode_tps_median": round(statistics.median(tps), 3) if tps else None,
            "decode_tps_total": round(sum(n for n, _ in timed) / seconds, 3) if seconds else None,
            "ttft_s_median": round(statistics.median(ttft), 4) if ttft else None,
            "completion_tokens": sum(r["tokens"] for r in ok), "draft_n": drafted, "draft_n_accepted": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "prompt_n_total": sum(r["prompt_n"] or 0 for r in ok), "cache_n_total": sum(r["cache_n"] or 0 for r in ok)}


def print_run(label: str, summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(f"\n{label}: {summary['requests']} requests, {summary['errors']} errors, wall {summary['wall_s']:.1f} s")
    print("session turn  prompt tokens  reused  TTFT s  tokens  decode tok/s  drafted  accepted  acceptance")

    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for r in rows:
        total = (r["prompt_n"] or 0) + (r["cache_n"] or 0)
        print(f"{r['session']:>7} {r['turn']:>4} {total:>14} {r['cache_n'] or 0:>7} {num(r['ttft_s'], '.3f'):>7} "
              f"{r['tokens']:>7} {num(r['decode_tps'], '.1f'):>13} {r['draft_n'] or 0:>8} "
              f"{r['draft_n_accepted'] or 0:>9} {num(r['acceptance'], '.2f'):>11}")
    print(f"decode median {summary['decode_tps_median']} tok/s; TTFT median {summary['ttft_s_median']} s; "
          f"acceptance {summary['acceptance']} ({summary['draft_n_accepted']} of {summary['draft_n']} drafts); "
          f"prompt tokens evaluated {summary['prompt_n_total']}, reused {summary['cache_n_total']}")


async def run(args: argparse.Namespace, argv: list[str]) -> int:
    url = args.url.rstrip("/")
    client = openai.AsyncOpenAI(base_url=url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
    body: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    if args.drafter:
        body["extra_body"] = {"speculative.type": args.drafter}
    rows: list[dict[str, Any]] = []
    started = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        _, model = await served_model(client, url, args.model)
        t0 = time.perf_counter()
        for session in range(args.sessions):
            history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
            for turn, message in enumerate(session_turns(args.seed, session, args.turns, args.functions)):
                history.append({"role": "user", "content": message})
                req = Request(client=session, index=turn, prompt=turn)
                await stream_one(client, model, list(history), body, req, t0)
                rows.append(figures(req, session))
                print(f"session {session} turn {turn + 1}: " + (f"error {req.error}" if req.error else
                      f"TTFT {req.ttft:.3f} s, {req.tokens} tokens, acceptance {rows[-1]['acceptance']}"),
                      file=sys.stderr, flush=True)
                if req.error:
                    break
                history.append({"role": "assistant", "content": req.text})
            if rows and rows[-1]["error"]:
                break
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    summary = summarize(rows, wall)
    print_run(args.label or url, summary, rows)
    if args.json_out is not None:
        settings = {k: getattr(args, k) for k in ("sessions", "turns", "functions", "max_tokens", "temperature",
                                                  "seed", "drafter")}
        write_json(args.json_out, {"label": args.label, "argv": argv, "started": started, "url": url, "model": model,
                                   "client": {"python": sys.version.split()[0], "openai": openai.__version__},
                                   "settings": settings, "summary": summary, "requests": rows})
    return 1 if any(r["error"] for r in rows) else 0


# llama_cpp before numpy: the CUDA build segfaults the other way round (docs/gpu.md)
CLI = [sys.executable, "-c", "import llama_cpp; from localspec.cli.app import main; main()"]
CSV_COLUMNS = ("drafter", "requests", "errors", "completion_tokens", "decode_tps_total", "decode_tps_median",
               "over_first", "ttft_s_median", "acceptance", "draft_n", "draft_n_accepted", "prompt_n_total",
               "cache_n_total", "json")


def start_server(serve_args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """`localspec serve --port 0 ARGS` in its own process, its URL once /health answers 200."""
    with log.open("w") as out:
        proc = subprocess.Popen([*CLI, "serve", "--port", "0", *serve_args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "COLUMNS": "200"})
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"localspec serve exited ({proc.returncode}): {log.read_text().strip()[-300:]}")
        found = re.search(r"http://127\.0\.0\.1:\d+/v1", log.read_text())
        if found and server_health(found.group(0), "none") is not None:  # (None while it loads: 503)
            return proc, found.group(0)
        time.sleep(0.3)
    proc.kill()
    raise BenchError("localspec serve did not become ready in 900 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve_and_compare(args: argparse.Namespace, full: list[str]) -> int:
    """Each drafter of --drafters on a server of its own (the same --serve arguments), replayed in turn; the CSV's
    rows read from each replay's JSON, the ratio against the first drafter's whole-run decode rate."""
    if not args.drafters or args.csv is None:
        raise BenchError("--serve needs --drafters and --csv")
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    out = args.csv.resolve()
    folder = out.with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    rows, rc = [], 0
    for drafter in drafters:
        json_path = folder / f"{drafter}.json"
        proc, url = start_server(shlex.split(args.serve), folder / f"{drafter}-serve.log")
        try:
            one = argparse.Namespace(**{**vars(args), "url": url, "drafter": drafter, "json_out": json_path,
                                        "label": f"{args.label or 'replay'}: {drafter}"})
            rc = max(rc, asyncio.run(run(one, full)))
        finally:
            stop_server(proc)
        summary = json.loads(json_path.read_text())["summary"]
        rows.append({"drafter": drafter, **{k: summary.get(k) for k in CSV_COLUMNS if k in summary},
                     "json": json_path.relative_to(out.parent).as_posix()})
    base = rows[0]["decode_tps_total"]
    for row in rows:
        row["over_first"] = round(row["decode_tps_total"] / base, 3) if base and row["decode_tps_total"] else None
    lines = [f"# what: bench/agent_replay.py's coding-agent sessions ({args.sessions} sessions x {args.turns} turns, "
             f"{args.max_tokens} tokens a reply, temperature {args.temperature:g}, seed {args.seed}) replayed on "
             f"`localspec serve {args.serve}`, a fresh server per drafter; over_first = decode_tps_total / the "
             f"first drafter's ({drafters[0]})",
             f"# date: {datetime.now(UTC).date().isoformat()}",
             f"# machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
             f"# command: python bench/agent_replay.py {shlex.join(full[1:])}",
             "# source: each row read by bench/agent_replay.py from its drafter's replay JSON (the folder beside this "
             "file)",
             f"# written-by: bench/agent_replay.py {shlex.join(full[1:])}"]
    with out.open("w", newline="", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print(f"{row['drafter']}: {row['decode_tps_total']} tok/s over the replay ({row['over_first']}x "
              f"{drafters[0]}), acceptance {row['acceptance']}, TTFT median {row['ttft_s_median']} s")
    return rc


def main(argv: list[str] | None = None) -> int:
    full = list(sys.argv) if argv is None else [__file__, *argv]
    args = build_parser().parse_args(full[1:])
    if args.serve is not None:
        return guarded("agent_replay.py", lambda: serve_and_compare(args, full))
    return guarded("agent_replay.py", lambda: asyncio.run(run(args, full)))


if __name__ == "__main__":
    sys.exit(main())

