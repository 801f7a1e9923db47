#!/usr/bin/env bash
# Drafting ahead on ONE GPU (issue #21): the card pair's `localspec bench` with `--overlap on` (the draft model
# drafts the next round on its own CUDA stream while the target verifies) against `--overlap off` (rounds one after
# the other), the two interleaved per cell. Device call on a warm machine where run.sh has built llama.cpp and
# written the card pair ($WORK/build, $WORK/models), from the repo root:
#     bash bench/gpu/overlap.sh
# Environment (defaults in brackets): WORK [bench/gpu/work]  OUT [WORK/out]  NOISES ["0.013 0.03"]  TEMPS ["0"]
#   MODES ["on off"]  REPEAT [3]  WARMUP [3]  N_PREDICT [256]  BUDGET_S [570]  CARD_SIZE [card32b]
# Results: $WORK/overlap/n<NOISE>-t<T>-<MODE>.json (one that exists is not measured again) and a table on stdout.
set -uo pipefail
T0=$(date +%s)
REPO="$(pwd)"
HERE="$REPO/bench/gpu"
WORK="${WORK:-$HERE/work}"
OUT="${OUT:-$WORK/out}"
RES="$WORK/overlap"
BUDGET_S="${BUDGET_S:-570}"
CARD_SIZE="${CARD_SIZE:-card32b}"
mkdir -p "$RES" "$OUT"
# shellcheck source=bench/gpu/harness.sh
source "$HERE/harness.sh"  # log, left, run, use_build
use_build
LOCALSPEC=(python3 -c "import llama_cpp; from localspec.cli.app import main; main()")
T="$WORK/models/$CARD_SIZE-target.gguf"
for n in ${NOISES:-0.013 0.03}; do
    D="$WORK/models/$CARD_SIZE-n$n-draft.gguf"
    [[ -f "$T" && -f "$D" ]] || { log "no card pair at noise $n in $WORK/models (run.sh writes it)"; continue; }
    for temp in ${TEMPS:-0}; do
        for mode in ${MODES:-on off}; do
            json="$RES/n$n-t$temp-$mode.json"
            [[ -s "$json" ]] && continue
            run "n$n-t$temp-overlap-$mode" 75 "${LOCALSPEC[@]}" bench --raw --target "$T" --draft "$D" \
                --temp "$temp" --draft 6 --max-tokens "${N_PREDICT:-256}" --repeat "${REPEAT:-3}" \
                --warmup "${WARMUP:-3}" --seed 42 --ctx 4096 --overlap "$mode" --json "$json.tmp" \
                > "$RES/n$n-t$temp-$mode.log" 2>&1
            [[ -s "$json.tmp" ]] && mv "$json.tmp" "$json"
        done
    done
done
python3 - "$RES" <<'PY' | tee "$RES/summary.txt"
import json
import sys
from pathlib import Path

print("| cell | overlap | plain tok/s | spec tok/s (min-max) | acceptance | ahead kept | ms a round: draft / verify / host / "
      "waiting for the ahead / ahead (beside) |")
print("|---|---|---|---|---|---|---|")
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    d = json.loads(path.read_text())
    spec, plain = d["speculative"], d["plain"]
    runs = [r for r in d["runs"] if r["mode"] == "speculative"]
    rounds = sum(r["rounds"] for r in runs) or 1
    ms = [1000 * sum(r.get(k, 0.0) for r in runs) / rounds  # (ahead_wait_s: since main after d313657)
          for k in ("draft_s", "verify_s", "host_s", "ahead_wait_s", "ahead_s")]
    made = sum(r["ahead_made"] for r in runs)
    kept = sum(r["ahead_kept"] for r in runs)
    cell, _, mode = path.stem.rpartition("-")
    print(f"| {cell} | {mode} | {plain['median_tps']:.1f} | {spec['median_tps']:.1f} ({spec['min_tps']:.1f}-"
          f"{spec['max_tps']:.1f}) | {spec['acceptance_rate']:.1%} | {kept}/{made} | "
          + " / ".join(f"{x:.2f}" for x in ms) + f" | greedy {d.get('greedy_check', {}).get('passed')}")
PY
tar -C "$RES" -czf "$OUT/overlap-results.tar.gz" .
cp "$RES/summary.txt" "$OUT/overlap-summary.txt"
log "done in $(( $(date +%s) - T0 ))s"
