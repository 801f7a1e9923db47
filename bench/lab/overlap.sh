#!/usr/bin/env bash
# Drafting ahead on ONE GPU (a probe; its finding, fitted bets by default, is in docs/lab): the card pair's `localspec bench` with the draft model drafting the next
# round on its own CUDA stream while the target verifies, against rounds one after the other and the drafting-ahead
# variants, one after the other per cell (level x temperature), one loaded pair per level (bench/lab/ahead_variants.py:
# `localspec bench`'s own measurement per variant, as `--json` writes it). Device call on a warm machine where run.sh
# has built llama.cpp and written the card pair ($WORK/build, $WORK/models), from the repo root:
#     bash bench/lab/overlap.sh
# Environment (defaults in brackets; WORK, OUT, BUDGET_S, CARD_SIZE: bench/gpu/harness.sh): NOISES ["0.013 0.03"]
#   TEMPS ["0"]  MODES ["on off"]  REPEAT [3]  WARMUP [3]  N_PREDICT [256]  NEED_S [75]: the budget a level needs
#   left to start
# MODES: on, off (--draft-ahead), fit (drafting ahead with --draft-ahead-length fit: the bet stops when the verify ends, the
# rest drafted by cost), adaptive (drafting ahead with --adaptive: the draft length by the cost model that knows the
# bet), fit+adaptive (both).
# Results: $WORK/overlap/n<NOISE>-t<T>-<MODE>.json (one that exists is not measured again) and a table on stdout.
set -uo pipefail
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/../gpu/harness.sh"
results_in "$WORK/overlap"
use_build
T="$WORK/models/$CARD_SIZE-target.gguf"
for n in ${NOISES:-0.013 0.03}; do
    D="$WORK/models/$CARD_SIZE-n$n-draft.gguf"
    [[ -f "$T" && -f "$D" ]] || { log "no card pair at noise $n in $WORK/models (run.sh writes it)"; continue; }
    run "n$n-overlap-t${TEMPS:-0}-${MODES:-on off}" "${NEED_S:-75}" python3 "$REPO/bench/lab/ahead_variants.py" --target "$T" \
        --draft "$D" --temps "${TEMPS:-0}" --out-prefix "$RES/n$n" --variants "${MODES:-on off}" \
        --max-tokens "${N_PREDICT:-256}" --repeat "${REPEAT:-3}" --warmup "${WARMUP:-3}" > "$RES/n$n.log" 2>&1
done
python3 - "$RES" <<'PY' | tee "$RES/summary.txt"
import json
import sys
from pathlib import Path

print("| cell | mode | plain tok/s | spec tok/s (min-max) | acceptance | drafted a round | ahead kept | ms a round: draft / "
      "verify / host / waiting for the ahead / ahead (beside) | greedy |")
print("|---|---|---|---|---|---|---|---|---|")
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    d = json.loads(path.read_text())
    spec, plain = d["speculative"], d["plain"]
    runs = [r for r in d["runs"] if r["mode"] == "speculative"]
    rounds = sum(r["rounds"] for r in runs) or 1
    ms = [1000 * sum(r.get(k, 0.0) for r in runs) / rounds  # (ahead_wait_s: since main after d313657)
          for k in ("draft_s", "verify_s", "host_s", "ahead_wait_s", "ahead_s")]
    made = sum(r["ahead_made"] for r in runs)
    kept = sum(r["ahead_kept"] for r in runs)
    drafted = sum(r["drafted"] for r in runs) / rounds  # (adaptive: the length it chose, on average)
    level, temp, mode = path.stem.split("-", 2)
    print(f"| {level}-{temp} | {mode} | {plain['median_tps']:.1f} | {spec['median_tps']:.1f} ({spec['min_tps']:.1f}-"
          f"{spec['max_tps']:.1f}) | {spec['acceptance_rate']:.1%} | {drafted:.2f} | {kept}/{made} | "
          + " / ".join(f"{x:.2f}" for x in ms) + f" | {d.get('greedy_check', {}).get('passed')} |")
PY
cp "$RES/summary.txt" "$RES/overlap-summary.txt"
pack overlap-results "$RES" "$RES/overlap-summary.txt"
