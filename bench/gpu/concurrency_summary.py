"""Summarise bench/gpu/concurrency.sh's results (issue #14): Markdown tables (stdout) and JSON (--json).

    python3 bench/gpu/concurrency_summary.py RESULTS_DIR [--json summary.json]
        [--csv FILE.csv --what TEXT --code COMMIT --command TEXT]

RESULTS_DIR holds <pair>/<config>-t<temp>.json (card-n<noise>, or s<scale> for the old stand-in), each written by
bench/concurrency.py against one server:
k0 (`localspec serve`, plain batched decoding), spec (`localspec serve`, speculative) and llama-server (`-np N`) in
three configurations: llama (the same draft model and draft length, its draft's argmax, sample-and-match), llamaprob
(the same with a probabilistic draft verified by rejection sampling, T > 0) and llamaplain (no draft). Per pair and
temperature, one table: aggregate tok/s (all completion tokens / the level's wall time) and median per-request tok/s
at each concurrency, speculative's ratio to k = 0 and to llama-server's best configuration at that concurrency (which
one it was), acceptance; then the crossover: the concurrency levels where localspec's speculative aggregate falls
below its own k = 0 (issue #14's target: none), and where it falls below llama-server's. Then, per configuration
that drafts (spec, llama), every request's own acceptance (its `timings`: draft_n_accepted / draft_n) against the
pair's solo median (the median request at 1 client, same configuration and T): per level the lowest request, how
far it falls below, and how many fall below by more than the T = 0 spread (at T = 0, the furthest any request
falls below its own solo median: what prompts alone account for). Issue #18's target: at T > 0, none.

--csv writes the raw CSV (bench/results/README.md's format): one row per pair, temperature, configuration and
concurrency, read from the client JSONs its `report` column names, with the ratios of the localspec spec rows and,
for localspec's servers, whether the load probe let their target's slots share batches (CONFIG.health.json). The
machine line is env.txt's GPU (concurrency.sh's snapshot_env); llama-server's build is versions.txt's.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

LLAMA_SERVER = ("llama", "llamaprob", "llamaplain")  # llama-server's configurations: the best one is compared with
CONFIGS = ("k0", "spec", *LLAMA_SERVER)
NAMES = {"k0": "localspec k=0", "spec": "localspec spec", "llama": "llama-server (greedy draft)",
         "llamaprob": "llama-server (probabilistic draft)", "llamaplain": "llama-server (no draft)"}
SHORT = {"llama": "greedy draft", "llamaprob": "probabilistic draft", "llamaplain": "no draft"}
_RESULT = re.compile(r"^(?P<config>k0|spec|llamaprob|llamaplain|llama)-t(?P<temp>[\d.]+)\.json$")


_SCALE = re.compile(r"^s(?P<scale>[\d.]+(e[-+]?\d+)?)$")


def pair_name(folder: str) -> str:
    """A results folder's pair: the old stand-in's `s<scale>` by its scale ("8e-5"), the card's by its name."""
    m = _SCALE.match(folder)
    return m["scale"] if m else folder


def pair_order(name: str) -> tuple[int, float, str]:
    """The card's pairs first (by name), then the old stand-in's scales (by value)."""
    try:
        return (1, float(name), "")
    except ValueError:
        return (0, 0.0, name)


def load(folder: Path) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """pair (a scale for the old stand-in) -> temperature -> config -> the client's JSON."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for scale_dir in sorted(folder.iterdir()):
        if not scale_dir.is_dir():
            continue
        for path in sorted(scale_dir.glob("*.json")):
            m = _RESULT.match(path.name)
            if not m:
                continue
            try:
                report = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                print(f"skipping {path}: {exc}", file=sys.stderr)
                continue
            out.setdefault(pair_name(scale_dir.name), {}).setdefault(m["temp"], {})[m["config"]] = report
    return out


def _levels(report: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    return {lv["clients"]: lv for lv in report["levels"]} if report else {}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One scale and temperature: per concurrency level, each configuration's figures and speculative's ratios."""
    levels = {c: _levels(reports.get(c)) for c in CONFIGS}
    clients = sorted({n for by in levels.values() for n in by})
    rows = []
    for n in clients:
        row: dict[str, Any] = {"clients": n}
        for c in CONFIGS:
            lv = levels[c].get(n)
            row[c] = None if lv is None else {
                "aggregate_tps": lv["aggregate_tps"], "per_request_tps_median": lv["per_request_tps_median"],
                "per_request_tps_min": lv["per_request_tps_min"], "ttft_s_median": lv["ttft_s_median"],
                "acceptance": lv["acceptance"], "errors": lv["errors"], "requests": lv["requests"]}
        agg = {c: (row[c] or {}).get("aggregate_tps") for c in CONFIGS}
        ran = [c for c in LLAMA_SERVER if agg[c] is not None]
        row["llama_best"] = max(ran, key=lambda c: agg[c]) if ran else None  # llama-server at its best here
        row["spec_over_k0"] = _ratio(agg["spec"], agg["k0"])
        row["spec_over_llama"] = _ratio(agg["spec"], agg[row["llama_best"]] if ran else None)
        rows.append(row)
    both = [r for r in rows if r["spec_over_k0"] is not None]
    below_k0 = [r["clients"] for r in both if r["spec_over_k0"] < 1]
    vs_llama = [r for r in rows if r["spec_over_llama"] is not None]
    below_llama = [r["clients"] for r in vs_llama if r["spec_over_llama"] < 1]
    return {"rows": rows, "compared_with_k0": [r["clients"] for r in both], "spec_below_k0": below_k0,
            "compared_with_llama": [r["clients"] for r in vs_llama], "spec_below_llama": below_llama}


DRAFTING = ("spec", "llama", "llamaprob")


def request_acceptance(level: dict[str, Any]) -> list[float]:
    """Each request's acceptance at one level, from its own `timings` (requests that drafted nothing left out)."""
    out = []
    for r in level.get("results", []):
        t = r.get("timings") or {}
        if r.get("error") is None and t.get("draft_n"):
            out.append(int(t.get("draft_n_accepted", 0)) / int(t["draft_n"]))
    return out


def acceptance_by_request(temps: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """One scale, per drafting configuration and temperature: every level's request acceptances against the solo
    median, and how many fall below it by more than the T = 0 spread."""
    out: dict[str, Any] = {}
    for config in DRAFTING:
        spread = None
        zero = temps.get("0", {}).get(config)
        if zero:
            levels = _levels(zero)
            solo = request_acceptance(levels.get(1, {}))
            if solo:
                every = [a for lv in levels.values() for a in request_acceptance(lv)]
                spread = max(0.0, statistics.median(solo) - min(every))
        for temp in sorted(temps, key=float):
            report = temps[temp].get(config)
            if not report:
                continue
            levels = _levels(report)
            solo = request_acceptance(levels.get(1, {}))
            median = statistics.median(solo) if solo else None
            rows = []
            for n, lv in sorted(levels.items()):
                acc = request_acceptance(lv)
                if not acc:
                    continue
                low = min(acc)
                below = (sum(a < median - spread - 1e-9 for a in acc)  # (the T = 0 spread's own request: not below)
                         if median is not None and spread is not None else None)
                rows.append({"clients": n, "requests": len(acc), "min": low, "median": statistics.median(acc),
                             "max": max(acc), "min_below_solo": None if median is None else median - low,
                             "below_by_more_than_spread": below, "each": acc})
            out.setdefault(config, {})[temp] = {"solo_median": median, "t0_spread": spread, "levels": rows}
    return out


def acceptance_table(config: str, temp: str, found: dict[str, Any]) -> list[str]:
    head = ("clients", "requests", "lowest", "median", "highest", "lowest below solo median",
            "below by more than the T=0 spread")
    lines = [f"{NAMES[config]}, T = {temp}: solo median {_fmt(found['solo_median'], '.1%')}, T = 0 spread "
             f"{_fmt(found['t0_spread'], '.1%')}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in found["levels"]:
        below = r["below_by_more_than_spread"]
        lines.append(f"| {r['clients']} | {r['requests']} | {r['min']:.1%} | {r['median']:.1%} | {r['max']:.1%} | "
                     f"{_fmt(r['min_below_solo'], '.1%')} | {'–' if below is None else below} |")
    return lines


def crossover_text(cmp: dict[str, Any]) -> str:
    measured, below = cmp["compared_with_k0"], cmp["spec_below_k0"]
    if not measured:
        return "crossover: not measured (k = 0 and speculative need results at the same concurrency)"
    if not below:
        return f"crossover: none: speculative ≥ k = 0 at every measured concurrency ({_list(measured)})"
    first = below[0]
    before = [n for n in measured if n < first]
    where = f"between {before[-1]} and {first} clients" if before else f"already at {first} (the lowest measured)"
    text = f"crossover: speculative falls below k = 0 {where}; below at {_list(below)}"
    again = [n for n in measured if n > first and n not in below]
    return text + (f" (above again at {_list(again)})" if again else "")


def _list(ns: list[int]) -> str:
    return ", ".join(str(n) for n in ns)


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def table(cmp: dict[str, Any]) -> list[str]:
    head = ("clients", "aggregate tok/s: k=0", "spec", "llama-server's best", "per-request tok/s: k=0", "spec",
            "llama-server's best", "spec ÷ k=0", "spec ÷ llama-server's best", "acceptance: spec",
            "llama-server's best", "llama-server's best configuration")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for r in cmp["rows"]:
        shown = ("k0", "spec", r["llama_best"])
        cells = [str(r["clients"])]
        cells += [_fmt((r[c] or {}).get("aggregate_tps") if c else None, ".1f") for c in shown]
        cells += [_fmt((r[c] or {}).get("per_request_tps_median") if c else None, ".1f") for c in shown]
        cells += [_fmt(r["spec_over_k0"], ".2f"), _fmt(r["spec_over_llama"], ".2f")]
        cells += [_fmt((r[c] or {}).get("acceptance") if c else None, ".1%") for c in ("spec", r["llama_best"])]
        cells += [SHORT.get(r["llama_best"] or "", "–")]
        lines.append("| " + " | ".join(cells) + " |")
        for c in CONFIGS:
            if r[c] and r[c]["errors"]:
                notes.append(f"{NAMES[c]} at {r['clients']} clients: {r[c]['errors']} of {r[c]['requests']} "
                             "requests failed (see its JSON)")
    return lines + [f"- {n}" for n in notes]


def settings_line(data: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> str:
    for temps in data.values():
        for reports in temps.values():
            for report in reports.values():
                s = report["settings"]
                return (f"{s['requests_per_client']} requests per client, max_tokens {s['max_tokens']}, "
                        f"{s['n_prompts']} prompts ({s['prompts']}), seed {s['seed']}, top_k {s['top_k']}, "
                        f"top_p {s['top_p']}, min_p {s['min_p']}; tokens counted from: {report['token_count']}")
    return "no results"


CSV_COLUMNS = ("pair", "temperature", "config", "server", "clients", "requests", "errors", "completion_tokens",
               "wall_s", "aggregate_tok_s", "per_request_tok_s_median", "ttft_s_median", "acceptance_pct",
               "target_slots_shared", "spec_over_k0", "llama_best_config", "spec_over_llama_best", "report")


def _r(x: float | None, digits: int) -> float | str:
    return "" if x is None else round(x, digits)


def machine_line(folder: Path) -> str:
    """env.txt's GPU line (nvidia-smi's CSV: index, name, memory.total, ...) and CPU count, or what is missing."""
    try:
        lines = (folder / "env.txt").read_text().splitlines()
    except OSError as exc:
        raise SystemExit(f"{folder / 'env.txt'}: {exc.strerror}: the machine is not recorded") from exc
    gpus = [line.split(", ") for line in lines if re.match(r"^\d+, ", line)]
    cores = next((line for line in lines if line.strip().isdigit()), "?")
    named = "; ".join(f"{g[1]} ({g[2]})" for g in gpus if len(g) > 2) or "no GPU"
    return f"{named}, {cores.strip()} CPU cores"


def slots_shared(folder: Path, config: str) -> bool | str:
    """Whether a localspec server's target slots shared batches (its /health `slot_batches`), "" where unknown."""
    try:
        health = json.loads((folder / f"{config}.health.json").read_text())
        return bool(health["slot_batches"]["target"]["shared"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def csv_rows(results: Path, data: dict[str, dict[str, dict[str, dict[str, Any]]]],
             summary: dict[str, Any], relative_to: Path) -> list[dict[str, Any]]:
    rows = []
    for pair in sorted(data, key=pair_order):
        folder = next(d for d in results.iterdir() if d.is_dir() and pair_name(d.name) == pair)
        for temp in sorted(data[pair], key=float):
            ratios = {r["clients"]: r for r in summary[pair][temp]["rows"]}
            for config in CONFIGS:
                report = data[pair][temp].get(config)
                if not report:
                    continue
                path = folder / f"{config}-t{temp}.json"
                where = (path.resolve().relative_to(relative_to).as_posix()
                         if path.resolve().is_relative_to(relative_to) else path.name)
                for n, lv in sorted(_levels(report).items()):
                    r = ratios[n]
                    spec = config == "spec"
                    rows.append({
                        "pair": pair, "temperature": temp, "config": config,
                        "server": "llama-server" if config in LLAMA_SERVER else "localspec", "clients": n,
                        "requests": lv["requests"], "errors": lv["errors"],
                        "completion_tokens": lv.get("completion_tokens", ""), "wall_s": _r(lv.get("wall_s"), 2),
                        "aggregate_tok_s": _r(lv["aggregate_tps"], 1),
                        "per_request_tok_s_median": _r(lv["per_request_tps_median"], 1),
                        "ttft_s_median": _r(lv.get("ttft_s_median"), 3),
                        "acceptance_pct": _r(None if lv.get("acceptance") is None else 100 * lv["acceptance"], 1),
                        "target_slots_shared": "" if config in LLAMA_SERVER else slots_shared(folder, config),
                        "spec_over_k0": _r(r["spec_over_k0"], 2) if spec else "",
                        "llama_best_config": (r["llama_best"] or "") if spec else "",
                        "spec_over_llama_best": _r(r["spec_over_llama"], 2) if spec else "",
                        "report": where})
    return rows


def write_csv(out: Path, results: Path, data: dict[str, dict[str, dict[str, dict[str, Any]]]],
              summary: dict[str, Any], header: dict[str, str], argv: list[str]) -> int:
    """The raw CSV: `#` lines (what, date, machine, code, command, source, written-by), then one row per pair,
    temperature, configuration and concurrency."""
    try:
        env = (results / "env.txt").read_text().splitlines()
        versions = (results / "versions.txt").read_text()
    except OSError as exc:
        raise SystemExit(f"{exc.filename}: {exc.strerror}: concurrency.sh writes it beside the results") from exc
    server = re.search(r"^llama-server: (.*)$", versions, re.M)
    build = re.search(r"^version: .*$", versions, re.M)
    rows = csv_rows(results, data, summary, out.parent.resolve())
    lines = [f"# what: {header['what']}", f"# date: {env[0][:10] if env else ''}",
             f"# machine: {machine_line(results)}",
             f"# code: {header['code']}; llama-server: {server[1] if server else 'none'}"
             f"{' ' + build[0] if build else ''}",
             f"# command: {header['command']}",
             "# source: each row read by bench/gpu/concurrency_summary.py from the client JSON (bench/concurrency.py "
             "--json) its `report` column names (kept beside this file)",
             f"# written-by: bench/gpu/concurrency_summary.py {shlex.join(argv)}"]
    with out.open("w", newline="", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path)
    p.add_argument("--json", type=Path, dest="json_out")
    p.add_argument("--csv", type=Path, help="also write the raw CSV (bench/results/README.md's format)")
    p.add_argument("--what", default="", help="with --csv: its `# what:` line")
    p.add_argument("--code", default="", help="with --csv: its `# code:` line (the commit measured)")
    p.add_argument("--command", default="", help="with --csv: its `# command:` line (how the results were made)")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        print(f"concurrency_summary.py: error: {args.results} is not a folder", file=sys.stderr)
        return 1
    if args.csv and not all((args.what, args.code, args.command)):
        missing = [k for k in ("what", "code", "command") if not getattr(args, k)]
        print(f"concurrency_summary.py: error: --csv needs --{', --'.join(missing)}", file=sys.stderr)
        return 1
    data = load(args.results)
    print("# Concurrent clients (bench/gpu/concurrency.sh)\n")
    print(settings_line(data))
    summary: dict[str, Any] = {}
    for scale in sorted(data, key=pair_order):
        what = f"scale {scale}" if pair_order(scale)[0] else f"pair {scale}"
        for temp in sorted(data[scale], key=float):
            cmp = compare(data[scale][temp])
            summary.setdefault(scale, {})[temp] = cmp
            print(f"\n## {what}, T = {temp}\n")
            print("\n".join(table(cmp)))
            print(f"\n{crossover_text(cmp)}")
            if cmp["compared_with_llama"]:
                below = cmp["spec_below_llama"]
                print("localspec spec below llama-server's best at: " + (_list(below) if below else "none")
                      + " clients")
        by_request = acceptance_by_request(data[scale])
        if by_request:
            print(f"\n## {what}: each request's acceptance against the solo median\n")
        for config, temps in by_request.items():
            for temp, found in temps.items():
                summary.setdefault(scale, {}).setdefault(temp, {}).setdefault("acceptance_by_request", {})[
                    config] = found
                print("\n".join(acceptance_table(config, temp, found)) + "\n")
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=1) + "\n")
    if args.csv:
        n = write_csv(args.csv, args.results, data, summary,
                      {"what": args.what, "code": args.code, "command": args.command},
                      sys.argv[1:] if argv is None else argv)
        print(f"{args.csv}: {n} rows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
