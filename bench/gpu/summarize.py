"""Parse the GPU run's outputs (llama-bench JSON, llama-speculative-simple logs, localspec JSON) into one
JSON file and print a table with the ratios. Standard library only: it runs on the GPU image as is.

    python3 bench/gpu/summarize.py OUT_DIR [--scales "1.2e-4 8e-5"] [--temps "0 0.7"]

localspec.gpu_bench's JSON is read leniently: a list of runs, or {"runs": [...]}, each run a dict with
mode ("plain"/"spec", or draft_max 0 for plain), temp (or temperature), tok_s (or decode_tok_s), and
optionally acceptance (0..1 or percent) and host_frac (share of a round spent outside llama_decode).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

_SPEC_PATTERNS = {
    "encoded_tokens": r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds",
    "decoded_tokens": r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s",
    "n_draft": r"n_draft\s+=\s+(\d+)",
    "n_predict": r"n_predict\s+=\s+(\d+)",
    "n_drafted": r"n_drafted\s+=\s+(\d+)",
    "n_accept": r"n_accept\s+=\s+(\d+)",
    "accept_pct": r"accept\s+=\s+([\d.]+)%",
}


def parse_spec_simple(text: str) -> dict[str, Any]:
    """The summary llama-speculative-simple prints at the end (examples/speculative-simple)."""
    out: dict[str, Any] = {}
    for key, pat in _SPEC_PATTERNS.items():
        m = re.search(pat, text)
        if not m:
            continue
        if key == "decoded_tokens":
            out["decoded_tokens"], out["decode_s"], out["tok_s"] = int(m[1]), float(m[2]), float(m[3])
        elif key == "encoded_tokens":
            out["prompt_tokens"], out["prompt_s"] = int(m[1]), float(m[2])
        elif key == "accept_pct":
            out["acceptance"] = float(m[1]) / 100
        else:
            out[key] = int(m[1])
    if "n_accept" in out and out.get("n_drafted"):
        out["acceptance"] = out["n_accept"] / out["n_drafted"]
    return out


def parse_llama_bench(text: str) -> dict[str, Any]:
    """llama-bench -o json: one entry per (model, test); keep tg tok/s per model file."""
    out: dict[str, Any] = {}
    try:
        rows = json.loads(text)
    except json.JSONDecodeError:
        return out
    for row in rows:
        name = Path(str(row.get("model_filename", ""))).name
        role = "draft" if name.endswith("draft.gguf") else "target" if name.endswith("target.gguf") else name
        if row.get("n_gen", 0) and not row.get("n_prompt", 0):
            out[role] = {
                "tg": row["n_gen"],
                "tok_s": row.get("avg_ts"),
                "stddev": row.get("stddev_ts"),
                "samples": row.get("samples_ts"),
                "build": row.get("build_commit"),
                "gpu": row.get("gpu_info"),
                "flash_attn": row.get("flash_attn"),
            }
    return out


def _runs(doc: Any) -> list[dict[str, Any]]:
    runs = doc.get("runs", []) if isinstance(doc, dict) else doc
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []


def localspec_pick(doc: Any, mode: str, temp: float) -> dict[str, Any] | None:
    for r in _runs(doc):
        r_mode = r.get("mode") or ("plain" if r.get("draft_max", r.get("draft", 1)) == 0 else "spec")
        r_temp = float(r.get("temp", r.get("temperature", 0.0)))
        if r_mode == mode and abs(r_temp - temp) < 1e-9:
            acc = r.get("acceptance")
            if acc is not None and acc > 1:
                acc = acc / 100
            return {
                "tok_s": r.get("tok_s", r.get("decode_tok_s")),
                "acceptance": acc,
                "host_frac": r.get("host_frac"),
            }
    return None


def best_k(doc: Any, temp: float) -> dict[str, Any] | None:
    """The fastest fixed draft length of localspec_bench.py's sweep (modes "sweep-k<N>") at one temperature."""
    best: dict[str, Any] | None = None
    for r in _runs(doc):
        mode = str(r.get("mode", ""))
        same_temp = abs(float(r.get("temp", 0.0)) - temp) < 1e-9
        faster = bool(r.get("tok_s")) and (best is None or r["tok_s"] > best["tok_s"])
        if mode.startswith("sweep-k") and same_temp and faster:
            best = {"k": int(mode.removeprefix("sweep-k")), "tok_s": r["tok_s"], "acceptance": r.get("acceptance")}
    return best


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summarize(out_dir: Path, scales: list[str], temps: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {"scales": {}}
    steps = out_dir / "steps.tsv"
    if steps.is_file():
        result["steps"] = [line.split("\t") for line in steps.read_text().splitlines() if line]
    for s in scales:
        d = out_dir / f"s{s}"
        entry: dict[str, Any] = {}
        bench = d / "llama-bench.json"
        entry["llama_bench"] = parse_llama_bench(bench.read_text()) if bench.is_file() else {}
        loc_path = d / "localspec.json"
        loc: Any = None
        if loc_path.is_file():
            try:
                loc = json.loads(loc_path.read_text())
            except json.JSONDecodeError as e:
                entry["localspec_error"] = str(e)
        entry["localspec_raw"] = loc
        entry["temps"] = {}
        tg = (entry["llama_bench"].get("target") or {}).get("tok_s")
        for t in temps:
            log = d / f"spec-simple-t{t}.log"
            spec = parse_spec_simple(log.read_text(errors="replace")) if log.is_file() else {}
            lp = localspec_pick(loc, "plain", float(t)) if loc is not None else None
            ls = localspec_pick(loc, "spec", float(t)) if loc is not None else None
            entry["temps"][t] = {
                "llama_cpp_spec": spec,
                "localspec_plain": lp,
                "localspec_spec": ls,
                "localspec_adaptive": localspec_pick(loc, "spec-adaptive", float(t)) if loc is not None else None,
                "localspec_best_k": best_k(loc, float(t)) if loc is not None else None,
                "ratio_spec_vs_llama_cpp": _ratio(ls and ls["tok_s"], spec.get("tok_s")),
                "ratio_plain_vs_llama_bench": _ratio(lp and lp["tok_s"], tg),
                "speedup_spec_vs_plain": _ratio(ls and ls["tok_s"], lp and lp["tok_s"]),
            }
        result["scales"][s] = entry
    return result


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return fmt.format(x) if isinstance(x, int | float) else "—"


def table(result: dict[str, Any]) -> str:
    head = (
        "scale",
        "T",
        "bench tg",
        "draft tg",
        "llama.cpp spec",
        "acc",
        "ls plain",
        "ls spec",
        "acc",
        "host",
        "ls adaptive",
        "best k",
        "ls/llama.cpp",
        "plain/bench",
    )
    rows = [head]
    for s, e in result["scales"].items():
        lb = e["llama_bench"]
        for t, r in e["temps"].items():
            spec, lp, ls = r["llama_cpp_spec"], r["localspec_plain"] or {}, r["localspec_spec"] or {}
            rows.append(
                (
                    s,
                    t,
                    _f((lb.get("target") or {}).get("tok_s")),
                    _f((lb.get("draft") or {}).get("tok_s"), "{:.0f}"),
                    _f(spec.get("tok_s")),
                    _f(spec.get("acceptance"), "{:.1%}"),
                    _f(lp.get("tok_s")),
                    _f(ls.get("tok_s")),
                    _f(ls.get("acceptance"), "{:.1%}"),
                    _f(ls.get("host_frac"), "{:.1%}"),
                    _f((r.get("localspec_adaptive") or {}).get("tok_s")),
                    "{k}: {tok_s:.1f}".format(**r["localspec_best_k"]) if r.get("localspec_best_k") else "—",
                    _f(r["ratio_spec_vs_llama_cpp"], "{:.2f}x"),
                    _f(r["ratio_plain_vs_llama_bench"], "{:.3f}"),
                )
            )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = [" | ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--scales", default="8e-5 1.2e-4")
    p.add_argument("--temps", default="0 0.7")
    a = p.parse_args(argv)
    result = summarize(a.out_dir, a.scales.split(), a.temps.split())
    (a.out_dir / "summary.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    print("\ntok/s; acc = accepted / drafted; host = localspec's share of a round outside llama_decode;")
    print("ls/llama.cpp = localspec speculative / llama.cpp speculative-simple (targets: >= 1.3x at T=0,")
    print(">= 1.5x at T=0.7); plain/bench = localspec plain / llama-bench tg128 (target: >= 0.97). summary.json")
    for step in result.get("steps", []):
        if len(step) > 1 and step[1] not in ("0", "skipped"):
            print(f"step {step[0]} failed (rc {step[1]}): see its log under {a.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
