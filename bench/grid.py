"""The default policy against plain decoding and the best fixed draft length, over a grid of drafters x prompt
classes x reply lengths: the figures behind docs/performance.md's "Never slower than plain" table.

Each cell is one `localspec bench --sweep` (the one benchmark): plain decoding, the fixed draft lengths (always
drafting) and the preset's own policy (its draft length, standing aside where drafting loses), interleaved, medians
of --repeat runs; the sweep's JSON report is kept beside the CSV. The CSV's rows are what the script read from those
reports, one per cell:

    drafter, class, max_tokens, clients, plain_tps, default_tps, default_over_plain, best_k, best_fixed_tps,
    default_over_best_fixed, stood_aside (share of the default's rounds), aside (its reason), report (the JSON)

Usage (from the repository root, on an otherwise idle machine; `--threads` fixed, or the choice follows the load):

    python bench/grid.py --pair demo --out bench/results/DATE-cpu-grid.csv --threads 2 --repeat 3

Several clients (`--clients 4,16`; 1 is the bench's cell above): per configuration one `localspec serve --parallel
<the most clients>` (plain: `--draft 0`; the default; each fixed length with `--always-draft`), driven by
bench/concurrency.py (the concurrency benchmark: streaming `openai` clients, each sending the class's prompt as a chat
message, every request at the preset's temperature) at each level, the configurations interleaved `--repeat` times;
medians of the aggregate tok/s (all clients' tokens over the level's wall time). `stood_aside` there: the share of
the default's rounds that drafted nothing, from every reply's `timings`. Each run's JSON is kept beside the CSV.

On a GPU machine, the files themselves: `--target T.gguf --draft D.gguf` in place of `--pair`.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from agent_replay import BenchError, start_server, stop_server  # noqa: E402  (bench/: the server's start and stop)

from localspec import paths  # noqa: E402
from localspec.config import load_preset  # noqa: E402
from localspec.sessions.bench import LOOKUP_PROMPTS, PROMPTS  # noqa: E402  (the shipped prompt texts, one home)

# The prompt classes: the shipped prompts that stand for each (a code edit and a JSON reformat repeat their prompt;
# prose and Q&A do not).
CLASSES = {
    "code-edit": dict(LOOKUP_PROMPTS)["code-edit"],
    "prose": dict(PROMPTS)["prose"],
    "qa": dict(PROMPTS)["qa"],
    "json": dict(LOOKUP_PROMPTS)["json"],
}
COLUMNS = ("drafter", "class", "max_tokens", "clients", "plain_tps", "default_tps", "default_over_plain", "best_k",
           "best_fixed_tps", "default_over_best_fixed", "stood_aside", "aside", "report")


def class_prompt(folder: Path, name: str) -> Path:
    """The class's prompt as a one-line prompts file (JSONL: the prompt may hold newlines) that both benchmarks read."""
    path = folder / f"{name}.jsonl"
    path.write_text(json.dumps({"prompt": CLASSES[name]}) + "\n", encoding="utf-8")
    return path


def cell(args: argparse.Namespace, drafter: str, name: str, max_tokens: int, folder: Path,
         time: int = 1) -> dict[str, object]:
    """One cell: a sweep of the fixed lengths with the default's row, read back from its JSON report; `time`: the
    how-manyth run of the same cell (a drafter named again in --drafters), whose report gets a name of its own."""
    prompts = class_prompt(folder, name)
    report = args.reports / f"{drafter}-{name}-{max_tokens}{'' if time == 1 else f'-{time}'}.json"
    cmd = [*LOCALSPEC, "bench", *_models(args),
           "--drafter", drafter, "--prompts", str(prompts), "--raw", "--max-tokens", str(max_tokens),
           "--repeat", str(args.repeat), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--sweep", args.sweep, "--json", str(report), *(["--preset", args.preset] if args.preset else []),
           *args.bench_arg]
    if not (args.reuse and report.is_file()):  # (--reuse: the CSV again from reports an earlier run wrote)
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"})
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()[-400:]}")
    # The report as the bench wrote it, but for the machine's own folder: its model paths under the localspec home
    # are kept as $LOCALSPEC_HOME/... (a tracked file names no machine's folders).
    text = report.read_text()
    home = str(paths.home())
    if home in text:
        report.write_text(text.replace(json.dumps(home)[1:-1], "$LOCALSPEC_HOME"))
    data = json.loads(report.read_text())
    rows = data["rows"]
    plain = next(r for r in rows if r["n_draft"] == 0)
    default = next(r for r in rows if r["policy"] == "default")
    best = max((r for r in rows if r["n_draft"] > 0 and r["policy"] == "fixed"), key=lambda r: r["median_tps"])
    return {
        "drafter": drafter, "class": name, "max_tokens": max_tokens, "clients": 1,
        "plain_tps": round(plain["median_tps"], 2), "default_tps": round(default["median_tps"], 2),
        "default_over_plain": round(default["median_tps"] / plain["median_tps"], 3),
        "best_k": best["n_draft"], "best_fixed_tps": round(best["median_tps"], 2),
        "default_over_best_fixed": round(default["median_tps"] / best["median_tps"], 3),
        "stood_aside": round(default["stood_aside"], 3), "aside": default["aside"] or "",
        "report": str(report.relative_to(args.out.parent)),
    }


LOCALSPEC = [sys.executable, "-c", "from localspec.cli.app import main; main()"]


def _models(args: argparse.Namespace) -> list[str]:
    return (["--target", str(args.target), *(["--draft", str(args.draft)] if args.draft else [])] if args.target
            else ["--pair", args.pair])


@contextmanager
def served(args: argparse.Namespace, drafter: str, flags: list[str], parallel: int, log: Path) -> Iterator[str]:
    """One `localspec serve` (agent_replay's, as that benchmark starts and stops it) while the block runs: its URL."""
    serve_args = [*_models(args), "--drafter", drafter, "--parallel", str(parallel), "--threads", str(args.threads),
                  *(["--preset", args.preset] if args.preset else []), *flags]
    try:
        proc, url = start_server(serve_args, log)
    except BenchError as exc:
        raise SystemExit(f"localspec serve {' '.join(serve_args)}: {exc}") from None
    try:
        yield url
    finally:
        stop_server(proc)


def served_cells(args: argparse.Namespace, drafter: str, name: str, max_tokens: int, folder: Path,
                 time: int = 1) -> list[dict[str, object]]:
    """The cells of several clients: per configuration a server, bench/concurrency.py at every level of
    --clients above 1, the configurations interleaved --repeat times; one row per level from the runs' JSONs."""
    levels = [c for c in args.clients if c > 1]
    prompts = class_prompt(folder, name)
    configs = [("plain", ["--draft", "0"]), ("default", []),
               *((f"k{k}", ["--draft", str(k), "--always-draft"]) for k in args.sweep_lengths)]
    tag = f"{drafter}-{name}-{max_tokens}-served{'' if time == 1 else f'-{time}'}"
    runs: dict[str, list[dict]] = {config: [] for config, _ in configs}
    for repeat in range(1, args.repeat + 1):
        for config, flags in configs:
            report = args.reports / f"{tag}-{config}-{repeat}.json"
            if not (args.reuse and report.is_file()):
                with served(args, drafter, flags, max(levels), folder / "serve.log") as url:
                    cmd = [sys.executable, str(HERE / "concurrency.py"), "--url", url, "--clients",
                           ",".join(map(str, levels)), "--requests-per-client", "1", "--max-tokens",
                           str(max_tokens), "--temperature", str(args.temperature), "--prompts", str(prompts),
                           "--warmup", str(min(args.warmup, 1)), "--json", str(report),
                           "--label", f"localspec {drafter} {config}"]
                    done = subprocess.run(cmd, capture_output=True, text=True)
                    if done.returncode != 0:
                        raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()[-400:]}")
                    # (its argv names the report by this checkout's path: kept relative to the repository root)
                    report.write_text(report.read_text().replace(f"{HERE.parent}/", ""))
            runs[config].append(json.loads(report.read_text()))

    def median_tps(config: str, level: int) -> float:
        return statistics.median(next(lv for lv in run["levels"] if lv["clients"] == level)["aggregate_tps"]
                                 for run in runs[config])

    rows = []
    for level in levels:
        plain, default = median_tps("plain", level), median_tps("default", level)
        best_k, best = max(((k, median_tps(f"k{k}", level)) for k in args.sweep_lengths), key=lambda kb: kb[1])
        timings = [r["timings"] for run in runs["default"] for lv in run["levels"] if lv["clients"] == level
                   for r in lv["results"]]
        rounds = sum(t["rounds"] for t in timings)
        last_aside = runs["default"][-1]["health_after"]["drafting"]["aside"]
        rows.append({
            "drafter": drafter, "class": name, "max_tokens": max_tokens, "clients": level,
            "plain_tps": round(plain, 2), "default_tps": round(default, 2),
            "default_over_plain": round(default / plain, 3), "best_k": best_k, "best_fixed_tps": round(best, 2),
            "default_over_best_fixed": round(default / best, 3),
            "stood_aside": round(sum(t["draft_stood_aside"] for t in timings) / rounds, 3) if rounds else 0.0,
            "aside": last_aside or "",
            "report": str(args.reports.relative_to(args.out.parent) / f"{tag}-*.json"),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="demo")
    parser.add_argument("--target", type=Path, help="a target GGUF instead of --pair (a GPU machine's files)")
    parser.add_argument("--draft", type=Path, help="the draft GGUF beside --target")
    parser.add_argument("--out", type=Path, required=True, help="the CSV to write (its reports go beside it)")
    parser.add_argument("--drafters", default="model,lookup,chain")
    parser.add_argument("--preset", help="the preset every cell's bench runs (e.g. agent: the chain led by suffix "
                        "lookup); default: the pair's")
    parser.add_argument("--bench-arg", action="append", default=[],
                        help="one more argument for every cell's bench (repeat it: --bench-arg=--adaptive)")
    parser.add_argument("--classes", default=",".join(CLASSES))
    parser.add_argument("--lengths", default="32,400")
    parser.add_argument("--sweep", default="1,2,4,6", help="the fixed draft lengths")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", default="1",
                        help="concurrency levels, e.g. 1,4,16: 1 is the bench's cell; more are served cells")
    parser.add_argument("--temperature", type=float,
                        help="the served cells' request temperature (default: the preset's)")
    parser.add_argument("--reuse", action="store_true",
                        help="read the cells' JSON reports already beside --out instead of measuring them again")
    args = parser.parse_args()
    if args.draft and not args.target:
        raise SystemExit("--draft needs --target")
    def integers(flag: str, text: str) -> list[int]:
        try:
            return [int(part) for part in text.split(",")]
        except ValueError:
            raise SystemExit(f"{flag} {text!r}: comma-separated integers") from None

    args.clients = sorted(set(integers("--clients", args.clients)))
    args.sweep_lengths = integers("--sweep", args.sweep)
    if args.clients[0] < 1:
        raise SystemExit(f"--clients: {args.clients[0]} (at least 1)")
    if args.temperature is None:
        args.temperature = load_preset(args.preset or "default").sampling.temperature
    args.out = args.out.resolve()
    args.reports = args.out.with_suffix("")
    args.reports.mkdir(parents=True, exist_ok=True)
    classes = args.classes.split(",")
    unknown = sorted(set(classes) - set(CLASSES))
    if unknown:
        raise SystemExit(f"--classes: unknown {', '.join(unknown)} (known: {', '.join(CLASSES)})")
    lines = [f"# written-by: bench/grid.py {' '.join(sys.argv[1:])}",
             f"# command: python bench/grid.py {' '.join(sys.argv[1:])}",
             "# source: each row read by bench/grid.py from its cell's `localspec bench --sweep --json` report (1 "
             "client) or its configurations' bench/concurrency.py JSONs (several), in the folder beside this file",
             f"# date: {datetime.date.today().isoformat()}",
             "# machine: MACHINE",
             f"# what: the default policy vs plain decoding and the best fixed draft length (--sweep {args.sweep}), "
             f"medians of {args.repeat} interleaved runs per row, one prompt per class; 1 client: raw completion "
             f"through `localspec bench`; several: aggregate tok/s of `localspec serve` driven by bench/concurrency.py"
             f" (chat messages, T = {args.temperature}, one request per client)"
             + (" (--reuse: the reports the same command without --reuse measured)" if args.reuse else "")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        named: dict[str, int] = {}
        for drafter in args.drafters.split(","):  # (a drafter named again runs its cells again: interleaved repeats)
            named[drafter] = named.get(drafter, 0) + 1
            for name in classes:
                for length in (int(x) for x in args.lengths.split(",")):
                    cells = [cell(args, drafter, name, length, Path(tmp), named[drafter])] if 1 in args.clients \
                        else []
                    if args.clients[-1] > 1:
                        cells += served_cells(args, drafter, name, length, Path(tmp), named[drafter])
                    for row in cells:
                        print(" ".join(f"{k}={row[k]}" for k in COLUMNS[:11]), flush=True)
                    rows.extend(cells)
    # The machine as the reports saw it: a GPU's name where the bench ran on one (this process never loads a model).
    benched = [row for row in rows if row["clients"] == 1]  # a served run's JSON does not name the GPU
    first = json.loads((args.out.parent / benched[0]["report"]).read_text()) if benched else {}
    gpus = ", ".join(g["name"] for g in first.get("environment", {}).get("gpus") or [])
    lines[lines.index("# machine: MACHINE")] = (
        f"# machine: {gpus + ', ' if gpus else ''}{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    with args.out.open("w", newline="", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    worst_plain = min(rows, key=lambda r: r["default_over_plain"])
    worst_fixed = min(rows, key=lambda r: r["default_over_best_fixed"])
    print(f"worst default cell vs plain: {worst_plain['default_over_plain']}x ({worst_plain['drafter']}, "
          f"{worst_plain['class']}, {worst_plain['max_tokens']} tokens, {worst_plain['clients']} client(s))")
    print(f"worst default cell vs the best fixed length: {worst_fixed['default_over_best_fixed']}x "
          f"({worst_fixed['drafter']}, {worst_fixed['class']}, {worst_fixed['max_tokens']} tokens, "
          f"{worst_fixed['clients']} client(s))")


if __name__ == "__main__":
    main()
