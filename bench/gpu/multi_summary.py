"""Summarise bench/gpu/multi_gpu.sh's results: a Markdown table (stdout) and JSON (--json).

    python3 bench/gpu/multi_summary.py RESULTS_DIR [--json summary.json]

RESULTS_DIR holds s<scale>/localspec-<config>-t<temp>.json (`localspec bench --json`) and
s<scale>/llama/t<temp>-<CUDA0|CUDA1>-r<rep>-<prompt>.log (llama-speculative-simple's stderr). llama.cpp's tok/s of a
repetition is its tokens over its decode seconds summed over the prompts (as `localspec bench` counts a run); the
table shows the median over repetitions.

Greedy mark of the draft-ahead column (T = 0): ✓ when its greedy check held (every emitted token its verify row's
argmax) and its output diverged from plain decoding exactly where the one-GPU run's did (a GPU's batch kernels move
near ties, docs/gpu.md: the same divergence means the placement changed nothing), ✗ otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ACCEPT = (re.compile(r"n_drafted\s+=\s+(\d+)"), re.compile(r"n_accept\s+=\s+(\d+)"))
_LLAMA_RUN = re.compile(r"t(?P<temp>[\d.]+)-(?P<devd>CUDA\d)-r(?P<rep>\d+)-(?P<prompt>.+)\.log$")
_LOCALSPEC = re.compile(r"localspec-(?P<config>[\w-]+)-t(?P<temp>[\d.]+)\.json$")


def llama_runs(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(temp, draft device) -> median tok/s over repetitions, acceptance, repetitions counted."""
    reps: dict[tuple[str, str, str], list[tuple[int, float, int, int]]] = defaultdict(list)
    for log in sorted(folder.glob("*.log")):
        m = _LLAMA_RUN.search(log.name)
        text = log.read_text(errors="replace")
        decoded = _DECODED.search(text)
        if not m or not decoded:
            continue
        drafted, accepted = (int(x[1]) if (x := p.search(text)) else 0 for p in _ACCEPT)
        reps[(m["temp"], m["devd"], m["rep"])].append((int(decoded[1]), float(decoded[2]), drafted, accepted))
    out: dict[tuple[str, str], dict[str, Any]] = {}
    by_config: dict[tuple[str, str], list[list[tuple[int, float, int, int]]]] = defaultdict(list)
    for (temp, devd, _), runs in reps.items():
        by_config[(temp, devd)].append(runs)
    for key, all_reps in by_config.items():
        n_prompts = max(len(r) for r in all_reps)
        whole = [r for r in all_reps if len(r) == n_prompts]  # a repetition cut short by the budget is left out
        tps = [sum(t for t, _, _, _ in r) / sum(s for _, s, _, _ in r) for r in whole]
        drafted = sum(d for r in whole for _, _, d, _ in r)
        out[key] = {"tok_s": statistics.median(tps), "reps": len(whole),
                    "acceptance": sum(a for r in whole for _, _, _, a in r) / drafted if drafted else None}
    return out


def localspec_runs(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(temp, config) -> plain and speculative medians, acceptance, the share of draft-aheads used, greedy ✓."""
    out = {}
    for path in sorted(folder.glob("localspec-*.json")):
        m = _LOCALSPEC.search(path.name)
        if not m:
            continue
        report = json.loads(path.read_text())
        spec = report["speculative"]
        out[(m["temp"], m["config"])] = {
            "plain": report["plain"]["median_tps"], "spec": spec["median_tps"],
            "acceptance": spec["acceptance_rate"], "ahead_hit_rate": spec.get("ahead_hit_rate"),
            # greedy only: whether the invariant held, and where the output left plain decoding's (None: nowhere)
            "greedy": _greedy(report["greedy_check"]) if float(m["temp"]) == 0 else None,
            "placement": report["environment"].get("placement"),
        }
    return out


def _greedy(check: dict[str, Any]) -> dict[str, Any]:
    divergence = [(p["name"], p["first_divergence"]) for p in check.get("prompts", []) if p["first_divergence"]]
    return {"holds": bool(check.get("invariant_holds", check.get("passed"))), "divergence": divergence}


def _greedy_mark(run: dict[str, Any] | None, reference: dict[str, Any] | None) -> str:
    """' ✓' / ' ✗' for a greedy run against the one-GPU run (see the module's docstring); '' when not greedy."""
    if not run or not run.get("greedy"):
        return ""
    same = reference is not None and reference.get("greedy") is not None \
        and run["greedy"]["divergence"] == reference["greedy"]["divergence"]
    return " ✓" if run["greedy"]["holds"] and same else " ✗"


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _scale(folder: Path) -> float:
    try:
        return float(folder.name[1:])
    except ValueError:
        return float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for folder in sorted(args.results.glob("s*"), key=_scale):  # lower scale (higher acceptance) first
        if not folder.is_dir():
            continue
        llama, ours = llama_runs(folder / "llama"), localspec_runs(folder)
        for temp in sorted({t for t, _ in llama} | {t for t, _ in ours}, key=float):
            rows.append({"scale": folder.name[1:], "temp": temp,
                         "llama_1gpu": llama.get((temp, "CUDA0")), "llama_2gpu": llama.get((temp, "CUDA1")),
                         **{config: ours.get((temp, config)) for config in ("one-gpu", "no-ahead", "ahead", "split")}})
    print("| scale | T | llama.cpp, 1 GPU | llama.cpp, draft on GPU 1 | localspec plain | localspec, 1 GPU | "
          "draft on GPU 1 | draft on GPU 1 + draft-ahead (share used) | draft-ahead / best llama.cpp |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tok = lambda d, k="tok_s": d[k] if d else None  # noqa: E731
        llama_best = max((x for x in (tok(r["llama_1gpu"]), tok(r["llama_2gpu"])) if x), default=None)
        ahead = r["ahead"]
        ratio = ahead["spec"] / llama_best if ahead and llama_best else None
        same = _greedy_mark(ahead, r["one-gpu"])
        hit = f" ({ahead['ahead_hit_rate']:.0%})" if ahead and ahead.get("ahead_hit_rate") is not None else ""
        plain = (r["one-gpu"] or r["no-ahead"] or {}).get("plain")
        print(f"| {r['scale']} | {r['temp']} | {_f(tok(r['llama_1gpu']))} | {_f(tok(r['llama_2gpu']))} | "
              f"{_f(plain)} | {_f(tok(r['one-gpu'], 'spec'))} | {_f(tok(r['no-ahead'], 'spec'))} | "
              f"{_f(tok(ahead, 'spec'))}{hit}{same} | {_f(ratio, '{:.2f}×')} |")
    print("\n✓ (T = 0): every emitted token was its verify row's argmax, and the output left plain decoding at the "
          "same tokens as on one GPU (or nowhere)")
    print("\nThe 48 GB case: the target split over both GPUs (layer split), the draft on GPU 0\n")
    print("| scale | T | plain | speculative | speculative / plain |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["split"]:
            s = r["split"]
            ratio = s["spec"] / s["plain"]
            print(f"| {r['scale']} | {r['temp']} | {s['plain']:.1f} | {s['spec']:.1f} | {ratio:.2f}× |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
