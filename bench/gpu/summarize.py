"""Read one GPU run's results (bench/gpu/run.sh) and print the comparison: llama-bench, `localspec bench --against
llama.cpp`'s JSON (localspec plain and speculative, and llama.cpp's llama-speculative-simple on the same prompts:
medians over repetitions, host and backend sampling), the greedy fidelity of both speculative loops against
single-token decoding, and the verify-width timings. Standard library only: it runs on the GPU image as is, and
here on a copy of the results.

    python3 bench/gpu/summarize.py RESULTS_DIR        # writes RESULTS_DIR/summary.json, prints the tables

RESULTS_DIR holds one folder per pair (card-n0.2, s8e-5, smollm2, ...) with llama-bench.json, localspec-t<T>.json
and verify-widths.json, and prompts/<prompt>.txt; kernels/ holds bench/gpu/kernels.sh's verify_widths.py runs
(<type>-<variant>-fa<on|off>.json); drafters/ holds bench/gpu/drafters.sh's.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any


def parse_llama_bench(text: str) -> dict[str, Any]:
    """llama-bench -o json: one entry per (model, test); keep tg tok/s per model file."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError:
        return {}
    out: dict[str, Any] = {}
    names = {Path(str(row.get("model_filename", ""))).name for row in rows}
    for row in rows:
        name = Path(str(row.get("model_filename", ""))).name
        role = "draft" if name.endswith("draft.gguf") else "target" if name.endswith("target.gguf") else name
        if len(names) == 1:  # a pair whose draft is its target (the greedy-fidelity check)
            role = "target"
        if row.get("n_gen", 0) and not row.get("n_prompt", 0):
            out[role] = {"tg": row["n_gen"], "tok_s": row.get("avg_ts"), "stddev": row.get("stddev_ts"),
                         "build": row.get("build_commit"), "gpu": row.get("gpu_info")}
    return out


def llama_modes(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """llama.cpp's side of one `localspec bench --against llama.cpp` run (its JSON's `against` section, written by
    localspec.sessions.versus): per configuration that ran the full repeats (its label, "k=4 probabilistic-draft
    backend"; a run from before the draft-length search: its sampling mode, "host" or "backend"), the median tok/s
    over complete repetitions, min, max, acceptance, the repetitions counted and its sampling mode."""
    return {m.get("label") or m["mode"]: {"median": m["median_tps"], "min": m["min_tps"], "max": m["max_tps"],
                                          "acceptance": m["acceptance_rate"], "runs": m["runs"], "sampling": m["mode"]}
            for m in (doc.get("against") or {}).get("modes", [])}


def fastest(llama: dict[str, dict[str, Any]], sampling: str | None) -> tuple[str, dict[str, Any]] | None:
    """The fastest of `llama_modes`' configurations with that sampling mode (None: any): (its name, its figures)."""
    found = [(k, c) for k, c in llama.items() if c.get("median") and sampling in (None, c["sampling"])]
    return max(found, key=lambda kc: kc[1]["median"], default=None)


def llama_build(against: dict[str, Any]) -> str | None:
    """Which llama.cpp the row was compared against: "b11549" (its build number; with the commit where known),
    else its version line as printed, else None."""
    build, commit = against.get("build"), against.get("commit")
    if build is None:  # "version: 11549 (abc123)" (an upstream build), "version: 0.6.0-dev (build 11549, commit X)"
        version = against.get("version") or ""
        found = (re.search(r"version:\s*(\d+)\s*\(([^)]*)\)", version)
                 or re.search(r"\(build (\d+), commit ([^)]*)\)", version))
        build, commit = (int(found.group(1)), found.group(2)) if found else (None, None)
    if build is None:
        return against.get("version") or None
    return f"b{build}" + (f" ({commit})" if commit and commit != "unknown" else "")


def fidelity(check: dict[str, Any], against: dict[str, Any]) -> dict[str, Any]:
    """Greedy divergence from single-token decoding: localspec (its bench's check) and llama.cpp (where its T = 0
    text first left localspec's plain output of the same prompts, as the bench's comparison found it)."""
    prompts = {p["name"]: p for p in check["prompts"]}
    result: dict[str, Any] = {"localspec": {
        "invariant_holds": check["invariant_holds"], "exact": check["exact"],
        "prompts": {name: {"first_divergence": p["first_divergence"], "plain_margin": p["plain_margin"],
                           "spec_margin": p["spec_margin"]} for name, p in prompts.items()}}}
    # per sampling mode ("host", "backend") or, since the draft-length search, per finalist ("k=4 greedy-draft host")
    for mode in dict.fromkeys(g["mode"] for g in against.get("greedy", [])):
        per_prompt = {g["prompt"]: {"first_divergence": g["first_divergence"], "plain_margin": g["plain_margin"],
                                    "same_text_every_run": g["same_every_run"]}
                      for g in against.get("greedy", []) if g["mode"] == mode}
        result[f"llama_cpp_{mode}"] = {"prompts": per_prompt}
    for entry in result.values():
        p = entry["prompts"]
        entry["diverged"] = sum(v["first_divergence"] is not None for v in p.values())
        entry["compared"] = len(p)
    return result


def round_profile(doc: dict[str, Any]) -> dict[str, float] | None:
    """Where a speculative round's time goes, summed over the measured speculative runs."""
    runs = [r for r in doc.get("runs", []) if r.get("mode") == "speculative"]
    rounds = sum(r["rounds"] for r in runs)
    if not rounds:
        return None
    total = {k: sum(r[k] for r in runs) for k in ("draft_s", "verify_s", "decode_s", "tokens", "drafted")}
    # The wait for the draft-ahead thread after a verify is on the path but not host work (GenerationStats.host_s
    # leaves it out; runs written before it was counted apart have no such key).
    wait_s = sum(r.get("ahead_wait_s", 0.0) for r in runs)
    return {"round_ms": 1000 * total["decode_s"] / rounds, "draft_ms": 1000 * total["draft_s"] / rounds,
            "verify_ms": 1000 * total["verify_s"] / rounds, "wait_ms": 1000 * wait_s / rounds,
            "host_ms": 1000 * (total["decode_s"] - total["draft_s"] - total["verify_s"] - wait_s) / rounds,
            "tokens_per_round": total["tokens"] / rounds, "draft_len": total["drafted"] / rounds}


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def summarize(res: Path) -> dict[str, Any]:
    prompt_texts = {p.stem: p.read_text().removesuffix("\n") for p in sorted((res / "prompts").glob("*.txt"))}
    result: dict[str, Any] = {"prompts": sorted(prompt_texts), "pairs": {}}
    steps = res / "steps.tsv"
    if steps.is_file():
        result["steps"] = [line.split("\t") for line in steps.read_text().splitlines() if line]
    kern = kernel_runs(res / "kernels")
    if kern:
        result["kernels"] = kern
    extra = drafter_runs(res / "drafters")
    if extra:
        result["drafters"] = extra
    for pair_dir in sorted(p for p in res.iterdir()
                           if p.is_dir() and p.name not in ("prompts", "kernels", "drafters")):
        pair: dict[str, Any] = {"temps": {}}
        bench = pair_dir / "llama-bench.json"
        pair["llama_bench"] = parse_llama_bench(bench.read_text()) if bench.is_file() else {}
        widths = _load(pair_dir / "verify-widths.json")
        if widths:
            pair["verify_widths"] = widths
        rollback = _load(pair_dir / "rollback-cost.json")  # bench/gpu/hybrid.sh: bench/rollback_cost.py's
        if rollback:
            pair["rollback_cost"] = rollback
        tg = (pair["llama_bench"].get("target") or {}).get("tok_s")
        for js in sorted(pair_dir.glob("localspec-t*.json"), key=lambda j: float(j.stem.removeprefix("localspec-t"))):
            doc = _load(js)
            if not doc:
                continue
            temp = f"{float(js.stem.removeprefix('localspec-t')):g}"
            ls_plain, ls_spec = doc["plain"], doc["speculative"]
            llama = llama_modes(doc)
            against = doc.get("against") or {}
            # the faster finalist of each sampling mode (a run from before the search: that mode's result)
            host, backend, best = fastest(llama, "host"), fastest(llama, "backend"), fastest(llama, None)
            host, backend = (host or (None, None))[1], (backend or (None, None))[1]
            faster = best[1] if best else None
            pair["temps"][temp] = {
                "localspec_plain": ls_plain, "localspec_spec": ls_spec, "llama_cpp_host": host,
                "llama_cpp_backend": backend, "llama_cpp_error": (doc.get("against") or {}).get("error"),
                "ratio_vs_llama_cpp": ls_spec["median_tps"] / faster["median"] if faster else None,
                "llama_cpp_faster": best[0] if best else None,
                "llama_cpp_build": llama_build(against) if against and "error" not in against else None,
                "llama_cpp_warnings": list(against.get("warnings") or []),
                "llama_cpp_first_pass": {m.get("label") or m["mode"]: m["median_tps"]
                                         for m in (against.get("search") or {}).get("first_pass", [])},
                "ratio_plain_vs_llama_bench": ls_plain["median_tps"] / tg if tg else None,
                "speedup_vs_plain": doc.get("speedup"),
                "profile": round_profile(doc),
                "environment": {k: doc.get("environment", {}).get(k) for k in ("gpus", "llama_cpp_python", "python")},
            }
            if temp == "0" or "fidelity" not in pair:
                pair["fidelity"] = fidelity(doc["greedy_check"], doc.get("against") or {})
        result["pairs"][pair_dir.name] = pair
    return result


def kernel_runs(folder: Path) -> list[dict[str, Any]]:
    """bench/gpu/kernels.sh's runs: per weight type, variant and flash attention mode, verify ms by width."""
    rows = []
    for js in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        doc = _load(js)
        if not doc or "timings_ms" not in doc:
            continue
        mix = js.stem.split("-")[0]
        ms = {int(w): v for w, v in doc["timings_ms"]["constant"].items()}
        widths = sorted(ms)
        slope = (ms[widths[-1]] - ms[widths[0]]) / (widths[-1] - widths[0]) if len(widths) > 1 else None
        rows.append({"type": mix, "variant": doc.get("label", "?"), "flash_attn": doc.get("flash_attn", "?"),
                     "env": doc.get("env", {}), "ms": ms, "ms_per_extra_token": slope})
    return rows


def drafter_runs(folder: Path) -> list[dict[str, Any]]:
    """bench/gpu/drafters.sh's runs: one row per `localspec bench` JSON (plain and speculative medians, acceptance,
    round profile, greedy check) and per structured.py mode."""
    rows = []
    for js in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        doc = _load(js)
        if not doc:
            continue
        if "table" in doc:  # bench/structured.py speed (a llama.cpp row that failed holds its error instead)
            rows += [{"run": js.stem, "mode": mode, "tok_s": r.get("tok_s_total"), "acceptance": r.get("acceptance"),
                      "tokens": r.get("tokens", r.get("error"))} for mode, r in doc["table"].items()]
            continue
        if "plain" not in doc:  # not a bench report (bench/lab/hedge_probe.py's JSON prints its own table)
            continue
        plain, spec = doc.get("plain") or {}, doc.get("speculative") or {}
        rows.append({"run": js.stem, "drafter": (doc.get("preset", {}).get("draft") or {}).get("drafter"),
                     "adaptive": (doc.get("preset", {}).get("draft") or {}).get("adaptive"),
                     "temperature": (doc.get("preset", {}).get("sampling") or {}).get("temperature"),
                     "plain": plain.get("median_tps"), "spec": spec.get("median_tps"), "speedup": doc.get("speedup"),
                     "acceptance": spec.get("acceptance_rate"), "mean_accepted": spec.get("mean_accepted"),
                     "greedy": (doc.get("greedy_check") or {}).get("summary"), "profile": round_profile(doc)})
    return rows


def drafter_table(rows: list[dict[str, Any]]) -> str:
    bench_rows = [("run", "drafter", "adaptive", "T", "plain tok/s", "spec tok/s", "speed-up", "acc.", "acc./round",
                   "draft/verify/host ms", "greedy")]
    for r in rows:
        if "mode" in r:
            continue
        p = r["profile"] or {}
        bench_rows.append((r["run"], str(r["drafter"]), str(r["adaptive"]), _f(r["temperature"], "{:g}"),
                           _f(r["plain"]), _f(r["spec"]), _f(r["speedup"], "{:.2f}x"),
                           _f(r["acceptance"], "{:.1%}"), _f(r["mean_accepted"], "{:.2f}"),
                           "/".join(_f(p.get(k), "{:.2f}") for k in ("draft_ms", "verify_ms", "host_ms")),
                           str(r["greedy"])))
    out = [_table(bench_rows)] if len(bench_rows) > 1 else []
    modes = [("run", "mode", "tok/s", "acceptance", "tokens")]
    modes += [(r["run"], r["mode"], _f(r["tok_s"]), _f(r["acceptance"], "{:.1%}"), str(r["tokens"]))
              for r in rows if "mode" in r]
    if len(modes) > 1:
        out.append(_table(modes))
    return "\n\n".join(out)


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return fmt.format(x) if isinstance(x, int | float) else "—"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _llama(c: dict[str, Any] | None) -> str:
    if not c or not c.get("median"):
        return "—"
    return f"{c['median']:.1f} [{c['min']:.0f}-{c['max']:.0f}] ({_f(c['acceptance'], '{:.0%}')}, n={c['runs']})"


def tables(result: dict[str, Any]) -> str:
    rows = [("pair", "T", "bench tg", "ls plain", "ls spec (acc)", "host", "llama.cpp host", "llama.cpp backend",
             "ls/llama.cpp", "llama.cpp build, best config", "plain/bench")]
    for name, pair in result["pairs"].items():
        tg = (pair["llama_bench"].get("target") or {}).get("tok_s")
        for temp, r in pair["temps"].items():
            lp, ls = r["localspec_plain"], r["localspec_spec"]
            rows.append((name, temp, _f(tg), _f(lp["median_tps"]),
                         f"{ls['median_tps']:.1f} ({ls['acceptance_rate']:.0%})", _f(ls["host_fraction"], "{:.1%}"),
                         _llama(r["llama_cpp_host"]), _llama(r["llama_cpp_backend"]),
                         _f(r["ratio_vs_llama_cpp"], "{:.2f}x"),
                         f"{r.get('llama_cpp_build') or '—'}, {r.get('llama_cpp_faster') or '—'}",
                         _f(r["ratio_plain_vs_llama_bench"], "{:.3f}")))
    out = [_table(rows) if len(rows) > 1 else "(no localspec results)"]
    out.append("tok/s, medians; llama.cpp: median [min-max] (acceptance, complete runs) of the faster finalist with "
               "that sampling; ls/llama.cpp = localspec speculative / the faster llama.cpp column; llama.cpp build = "
               "the llama.cpp compared against (its build number), best config = its faster finalist (draft length, "
               "draft sampling, sampling); host = localspec's share of a round outside llama_decode")
    firsts = [f"{name} T={temp}: llama.cpp's first pass (one repetition each, tok/s): "
              + ", ".join(f"{label} {tps:.1f}" for label, tps in sorted(r["llama_cpp_first_pass"].items(),
                                                                         key=lambda lt: -lt[1]))
              for name, pair in result["pairs"].items() for temp, r in pair["temps"].items()
              if r.get("llama_cpp_first_pass")]
    out += firsts
    out += [f"{name} T={temp}: llama.cpp did not run: {r['llama_cpp_error']}" for name, pair in result["pairs"].items()
            for temp, r in pair["temps"].items() if r.get("llama_cpp_error")]
    out += [f"{name} T={temp}: ⚠ {w}" for name, pair in result["pairs"].items() for temp, r in pair["temps"].items()
            for w in r.get("llama_cpp_warnings", [])]

    side = side_by_side(result)
    if side:
        out += ["", "side by side (the card's pair: card-n<noise>; the old stand-in: s<scale>)", side]

    prof = [("pair", "T", "round ms", "draft ms", "verify ms", "host ms", "ahead wait ms", "tokens/round",
             "draft len")]
    for name, pair in result["pairs"].items():
        for temp, r in pair["temps"].items():
            p = r.get("profile")
            if p:
                prof.append((name, temp, _f(p["round_ms"], "{:.2f}"), _f(p["draft_ms"], "{:.2f}"),
                             _f(p["verify_ms"], "{:.2f}"), _f(p["host_ms"], "{:.2f}"), _f(p["wait_ms"], "{:.2f}"),
                             _f(p["tokens_per_round"], "{:.2f}"), _f(p["draft_len"], "{:.2f}")))
    if len(prof) > 1:
        out += ["", "localspec speculative round profile", _table(prof)]

    fid = [("pair", "loop", "diverged", "first divergence (token: plain top-2 margin)")]
    for name, pair in result["pairs"].items():
        for loop, entry in pair.get("fidelity", {}).items():
            firsts = ", ".join(f"{p}: {v['first_divergence']} ({_f(v['plain_margin'], '{:.3f}')})"
                               for p, v in entry["prompts"].items() if v["first_divergence"] is not None)
            flag = ""
            if loop == "localspec":
                flag = " ✓ argmax invariant" if entry["invariant_holds"] else " ✗ ARGMAX INVARIANT BROKEN"
            fid.append((name, loop + flag, f"{entry['diverged']}/{entry['compared']}", firsts or "none"))
    if len(fid) > 1:
        out += ["", "greedy (T = 0) divergence from single-token decoding", _table(fid)]

    for name, pair in result["pairs"].items():
        rc = pair.get("rollback_cost")
        if rc:
            def ms(d: dict[str, Any]) -> str:
                return "  ".join(f"{k}: {v:.3f}" for k, v in d.items())
            out += ["", f"{name}: rolling the recurrent state back (k = {rc['k']}, medians of {rc['reps']}; ms)",
                    f"  per rejected token, by tokens rolled back: {ms(rc['per_rejected_ms'])}",
                    f"  snapshot upkeep per verify, by width: {ms(rc['snapshot_upkeep_ms'])}",
                    f"  the rollback call {rc['rollback_call_us']:.1f} us; checkpoint {rc['checkpoint_ms']:.3f}, "
                    f"restore {rc['restore_ms']:.3f}"]
    for name, pair in result["pairs"].items():
        w = pair.get("verify_widths")
        if not w:
            continue
        t = w["timings_ms"]
        out += ["", f"{name}: verify ms by width: " + "  ".join(f"w{k} {v:.2f}" for k, v in t["constant"].items())]
        for pat, v in t["patterns"].items():
            out.append(f"  {pat:>26}: {v['mean_ms']:.2f} ms a call (warm graphs: {_f(v.get('warm_ms'), '{:.2f}')})")
        for k, e in (w.get("logits") or {}).get("by_width", {}).items():
            cpu = (f", |single-cpu| {e['max_abs_diff_single_vs_cpu']:.3f}, |batch-cpu| "
                   f"{e['max_abs_diff_batch_vs_cpu']:.3f}") if "max_abs_diff_batch_vs_cpu" in e else ""
            out.append(f"  logits w{k}: max |batch - single| {e['max_abs_diff']:.4f}, argmax flips "
                       f"{e['argmax_flips']}{cpu}")
    return "\n".join(out)


def side_by_side(result: dict[str, Any]) -> str:
    """One column per pair, one row per measure and temperature: the new pair next to the old stand-in."""
    pairs = [(n, p) for n, p in result["pairs"].items() if p["temps"]]
    if len(pairs) < 2:
        return ""
    temps = sorted({t for _, p in pairs for t in p["temps"]}, key=float)

    def get(p: dict[str, Any], t: str, what: str) -> str:
        r = p["temps"].get(t)
        if r is None:
            return "—"
        best = max((c["median"] for c in (r["llama_cpp_host"], r["llama_cpp_backend"]) if c and c.get("median")),
                   default=None)
        prof = r.get("profile") or {}
        values = {
            "acceptance": _f(r["localspec_spec"]["acceptance_rate"], "{:.1%}"),
            "localspec spec tok/s": _f(r["localspec_spec"]["median_tps"]),
            "localspec plain tok/s": _f(r["localspec_plain"]["median_tps"]),
            "llama.cpp best tok/s": _f(best),
            "localspec / llama.cpp": _f(r["ratio_vs_llama_cpp"], "{:.2f}x"),
            "spec / plain": _f(r["speedup_vs_plain"], "{:.2f}x"),
            "plain / llama-bench": _f(r["ratio_plain_vs_llama_bench"], "{:.3f}"),
            "round ms": _f(prof.get("round_ms"), "{:.2f}"),
            "draft ms": _f(prof.get("draft_ms"), "{:.2f}"),
            "verify ms": _f(prof.get("verify_ms"), "{:.2f}"),
            "host ms": _f(prof.get("host_ms"), "{:.2f}"),
        }
        return values[what]

    rows = [("measure", "T", *[n for n, _ in pairs])]
    for role in ("target", "draft"):
        rows.append((f"llama-bench tg {role}", "", *[_f((p["llama_bench"].get(role) or {}).get("tok_s"))
                                                      for _, p in pairs]))
    for what in ("acceptance", "localspec spec tok/s", "localspec plain tok/s", "llama.cpp best tok/s",
                 "localspec / llama.cpp", "spec / plain", "plain / llama-bench", "round ms", "draft ms",
                 "verify ms", "host ms"):
        for t in temps:
            rows.append((what, t, *[get(p, t, what) for _, p in pairs]))
    return _table(rows)


def kernel_table(rows: list[dict[str, Any]]) -> str:
    widths = sorted({w for r in rows for w in r["ms"]})
    table = [("type", "variant", "FA", *[f"w{w}" for w in widths], "ms/extra token")]
    for r in sorted(rows, key=lambda r: (r["type"], r["variant"] != "default", r["variant"], r["flash_attn"])):
        table.append((r["type"], r["variant"], r["flash_attn"], *[_f(r["ms"].get(w), "{:.2f}") for w in widths],
                      _f(r["ms_per_extra_token"], "{:.2f}")))
    return _table(table)


# -- the raw CSV (bench/results/README.md): one row per `localspec bench` report, read from the reports themselves --
CSV_COLUMNS = ("pair", "report", "kind", "temperature", "n_draft", "policy", "plain_tps", "spec_tps", "acceptance_pct",
               "mean_accepted", "host_share_pct", "llama_best_tps", "llama_best_runs", "llama_best_acceptance_pct",
               "llama_best_config", "llama_build", "spec_over_llama_best", "spec_over_plain", "over_best_fixed",
               "round_ms", "draft_ms", "verify_ms", "host_ms", "tokens_per_round")


def _r(x: float | None, digits: int) -> float | str:
    return "" if x is None else round(x, digits)


def report_rows(doc: dict[str, Any], pair: str, report: str) -> list[dict[str, Any]]:
    """The rows of one `localspec bench --json` report: a bench run (its speculative mode against plain and, with
    --against llama.cpp, against llama.cpp's faster finalist) or a sweep (one row per draft length and the
    default policy, each against plain and against the best fixed length)."""
    temp = doc["preset"]["sampling"]["temperature"]
    base = {"pair": pair, "report": report, "temperature": f"{temp:g}"}
    if "localspec_sweep" in doc:
        rows = doc["rows"]
        best = max((r["median_tps"] for r in rows if r["n_draft"] > 0 and r["policy"] == "fixed"), default=None)
        return [{**base, "kind": "sweep", "n_draft": r["n_draft"], "policy": r["policy"],
                 "spec_tps": _r(r["median_tps"], 1), "acceptance_pct": _r(100 * r["acceptance_rate"], 1),
                 "mean_accepted": _r(r["mean_accepted"], 2), "host_share_pct": _r(100 * r["host_fraction"], 1),
                 "spec_over_plain": _r(r["speedup"], 3),
                 "over_best_fixed": _r(r["median_tps"] / best if best and r["n_draft"] else None, 3)} for r in rows]
    spec, plain = doc["speculative"], doc["plain"]
    best = fastest(llama_modes(doc), None)
    against = doc.get("against") or {}
    profile = round_profile(doc) or {}
    return [{**base, "kind": "bench", "n_draft": doc["n_draft"], "policy": "default" if doc["preset"]["draft"].get(
                 "stand_aside") else "fixed",
             "plain_tps": _r(plain["median_tps"], 1), "spec_tps": _r(spec["median_tps"], 1),
             "acceptance_pct": _r(100 * spec["acceptance_rate"], 1), "mean_accepted": _r(spec["mean_accepted"], 2),
             "host_share_pct": _r(100 * spec["host_fraction"], 1),
             "llama_best_tps": _r(best[1]["median"], 1) if best else "",
             "llama_best_runs": best[1]["runs"] if best else "",
             "llama_best_acceptance_pct": _r(100 * best[1]["acceptance"], 1) if best else "",
             "llama_best_config": best[0] if best else "",
             "llama_build": (llama_build(against) or "") if against and "error" not in against else "",
             "spec_over_llama_best": _r(spec["median_tps"] / best[1]["median"], 3) if best else "",
             "spec_over_plain": _r(doc.get("speedup"), 3),
             **{k: _r(profile.get(k), 2) for k in ("round_ms", "draft_ms", "verify_ms", "host_ms",
                                                   "tokens_per_round")}}]


def write_csv(out: Path, reports: list[tuple[str, Path]], header: dict[str, str], argv: list[str]) -> int:
    """The raw CSV of `reports` ((pair, JSON path) in order), its `#` lines first: what, date and machine (from the
    first report's environment), code, command, source, written-by. Every report must come from one machine (a
    ratio is never taken across machines): a second machine is an error naming the report."""
    rows, machines, dates = [], {}, []
    for pair, path in reports:
        doc = _load(path)
        if not doc:
            raise SystemExit(f"{path}: not a localspec bench JSON report")
        dates.append(str(doc.get("environment", {}).get("time", ""))[:10])
        env = doc.get("environment", {})
        gpus = ", ".join(f"{g['name']} ({g['vram_total_bytes'] // 2**20:,} MiB)" for g in env.get("gpus") or [])
        machines[path] = f"{gpus or 'no GPU'}, {env.get('cpu_cores_physical')} CPU cores, {env.get('platform')}"
        rows += report_rows(doc, pair, path.relative_to(out.parent).as_posix() if path.is_relative_to(out.parent)
                            else path.name)
    if len(set(machines.values())) > 1:
        first = next(iter(machines.values()))
        odd = next(p for p, m in machines.items() if m != first)
        raise SystemExit(f"{odd}: measured on another machine ({machines[odd]}) than {first}")
    lines = [f"# what: {header['what']}", f"# date: {dates[0]}",
             f"# machine: {next(iter(machines.values()))}", f"# code: {header['code']}",
             f"# command: {header['command']}",
             "# source: each row read by bench/gpu/summarize.py from the `localspec bench --json` report its `report` "
             "column names (kept beside this file)",
             f"# written-by: bench/gpu/summarize.py {shlex.join(argv)}"]  # (shlex.split reads it back)
    with out.open("w", newline="", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--csv", type=Path, help="also write the raw CSV of the results' `localspec bench` reports "
                   "(bench/results/README.md's format) to this file")
    p.add_argument("--report", action="append", default=[], metavar="PAIR=JSON",
                   help="with --csv: one more `localspec bench --json` report (a bench or a sweep), after the pairs'")
    p.add_argument("--what", default="", help="with --csv: its `# what:` line")
    p.add_argument("--code", default="", help="with --csv: its `# code:` line (the commit measured)")
    p.add_argument("--command", default="", help="with --csv: its `# command:` line (how the results were made)")
    a = p.parse_args(argv)
    result = summarize(a.results)
    (a.results / "summary.json").write_text(json.dumps(result, indent=2))
    if a.csv:
        reports = [(pair_dir.name, js) for pair_dir in sorted(d for d in a.results.iterdir() if d.is_dir())
                   for js in sorted(pair_dir.glob("localspec-t*.json"))]
        for item in a.report:
            pair, sep, path = item.partition("=")
            if not sep:
                raise SystemExit(f"--report {item!r}: expected PAIR=JSON")
            reports.append((pair, Path(path).resolve()))
        if not reports:
            raise SystemExit(f"{a.results}: no localspec bench reports to write a CSV from")
        missing = [k for k in ("what", "code", "command") if not getattr(a, k)]
        if missing:
            raise SystemExit(f"--csv needs --{', --'.join(missing)}")
        n = write_csv(a.csv.resolve(), [(pair, js.resolve()) for pair, js in reports],
                      {"what": a.what, "code": a.code, "command": a.command}, sys.argv[1:] if argv is None else argv)
        print(f"{a.csv}: {n} rows", file=sys.stderr)
    print(tables(result))
    if result.get("kernels"):
        print("\nverify kernels (bench/gpu/kernels.sh): ms per verify batch by width, device greedy sampler, "
              "200-token context")
        print(kernel_table(result["kernels"]))
    if result.get("drafters"):
        print("\ndrafters (bench/gpu/drafters.sh): localspec bench medians, each with its own plain baseline; "
              "round profile in ms")
        print(drafter_table(result["drafters"]))
    for step in result.get("steps", []):
        if len(step) > 1 and step[1] not in ("0", "skipped"):
            print(f"step {step[0]} failed (rc {step[1]}): see its log under {a.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
