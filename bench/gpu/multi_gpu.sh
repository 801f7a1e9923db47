#!/usr/bin/env bash
# Two GPUs: the draft on a GPU of its own, drafting the next round while the target verifies, against
# one GPU and llama.cpp's speculative-simple; and the 48 GB case (the target split over both GPUs). Device call on a
# machine with two GPUs (kind nvidia-h200-x2), carry ["bench/gpu/carry"] (make_archive.sh), from the repo root:
#     bash bench/gpu/multi_gpu.sh
# 1. Prepare what this machine lacks (a warm machine keeps $WORK; harness.sh): llama.cpp's CUDA build through run.sh,
#    then the synthetic 32B pairs (bench/synthetic.py, the same files run.sh writes).
# 2. Per scale and temperature, `localspec bench` (warm-up, REPEAT interleaved plain/speculative runs over its three
#    prompts, medians, greedy check, JSON) in each placement of CONFIGS:
#      one-gpu    --split-mode none --draft-device 0               target and draft on GPU 0 (draft-ahead: auto = off)
#      ahead      --split-mode none --draft-device 1 --draft-ahead on   target on GPU 0, draft on GPU 1, drafting ahead
#      no-ahead   --split-mode none --draft-device 1 --draft-ahead off  the same placement, rounds one after the other
#      split      --split-mode layer                               the 48 GB case: the target over both GPUs, the
#                                                                  draft with its main GPU (GPU 0)
#    and llama-speculative-simple on the same prompts, LLAMA_REPS times each: -dev CUDA0 -devd CUDA0 (one GPU) and
#    -dev CUDA0 -devd CUDA1 (the draft on GPU 1).
# 3. bench/gpu/multi_summary.py: medians and ratios as a Markdown table (summary.md) and JSON (summary.json).
# Every result is kept in $WORK/multi; one that exists is not measured again, so a call that runs out of budget
# leaves the rest to the next call on the same (warm) machine.
# Environment (defaults in brackets; CARRY, WORK, OUT, BUDGET_S, RERUN: harness.sh):
#   SCALES ["8e-5 1.2e-4"]    synthetic block scales: the two acceptance levels of docs/performance.md
#   TEMPS ["0 0.7"]  CONFIGS ["ahead no-ahead one-gpu split"]  N_PREDICT [256]  DRAFT_MAX [6]
#   REPEAT [5]  WARMUP [5]    `localspec bench --repeat/--warmup`
#   LLAMA_REPS [5]            llama-speculative-simple runs per prompt and placement (the summary takes medians)
#   LOCALSPEC_ARGS (extra `localspec bench` arguments)
set -uo pipefail
SIZE=gpu32b
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"

SCALES="${SCALES:-8e-5 1.2e-4}"
TEMPS="${TEMPS:-0 0.7}"
CONFIGS="${CONFIGS:-ahead no-ahead one-gpu split}"
N_PREDICT="${N_PREDICT:-256}"
DRAFT_MAX="${DRAFT_MAX:-6}"
REPEAT="${REPEAT:-5}"
WARMUP="${WARMUP:-5}"
LLAMA_REPS="${LLAMA_REPS:-5}"
results_in "$WORK/multi"
finish() {
    python3 "$HERE/multi_summary.py" "$RES" --json "$RES/summary.json" 2>&1 | tee "$RES/summary.md"
    pack multi-results "$RES" "$RES/summary.md" "$RES/summary.json"
}

snapshot_env "$RES/env.txt"
(( $(nvidia-smi -L 2>/dev/null | wc -l) >= 2 )) || log "WARNING: fewer than two GPUs: the two-GPU rows will fail"

# -- 1. prepare: the build (run.sh, measuring nothing), the carried Python packages, the pairs, the prompts ---------
ensure_build || { finish; exit 1; }
for s in $SCALES; do stand_in_pair "$s"; done
write_prompts "$RES/prompts" || { log "no prompts written: stopping"; finish; exit 1; }

# -- 2. measure ----------------------------------------------------------------------------------------------------
placement() {
    case "$1" in
        one-gpu) echo "--split-mode none --main-gpu 0 --draft-device 0" ;;
        ahead) echo "--split-mode none --main-gpu 0 --draft-device 1 --draft-ahead on" ;;
        no-ahead) echo "--split-mode none --main-gpu 0 --draft-device 1 --draft-ahead off" ;;
        split) echo "--split-mode layer" ;;
        *) return 1 ;;
    esac
}
# Rotate through the configurations within each (scale, temperature): a slow spell of the machine then hits all.
for s in $SCALES; do
    T="$(stand_in_target "$s")"; D="$(stand_in_draft "$s")"
    [[ -f "$T" && -f "$D" ]] || { log "no pair for scale $s"; continue; }
    for temp in $TEMPS; do
        for config in $CONFIGS; do
            json="$RES/s$s/localspec-$config-t$temp.json"
            [[ -s "$json" ]] && continue
            mkdir -p "$RES/s$s"
            # --raw: the prompts as plain text, as llama-speculative-simple reads them (no chat template there)
            # shellcheck disable=SC2046,SC2086  # word lists on purpose
            run "localspec-s$s-$config-t$temp" 90 "${LOCALSPEC[@]}" bench --raw --target "$T" --draft "$D" \
                --temp "$temp" --draft "$DRAFT_MAX" --max-tokens "$N_PREDICT" --repeat "$REPEAT" \
                --warmup "$WARMUP" --seed "$SEED" --ctx 4096 $(placement "$config") --json "$json.tmp" \
                ${LOCALSPEC_ARGS:-} \
                > "$RES/s$s/localspec-$config-t$temp.log" 2>&1
            [[ -s "$json.tmp" ]] && mv "$json.tmp" "$json"
        done
        for rep in $(seq 1 "$LLAMA_REPS"); do
            for devd in CUDA0 CUDA1; do
                for p in "${PROMPT_FILES[@]}"; do
                    base="$RES/s$s/llama/t$temp-$devd-r$rep-$(basename "$p" .txt)"
                    grep -q "decoded" "$base.log" 2>/dev/null && continue
                    mkdir -p "$(dirname "$base")"
                    extra=(); [[ "$temp" != 0 ]] && extra=(--top-k 40 --top-p 0.9 --min-p 0)
                    run "llama-$(basename "$base")" 15 "$BIN/llama-speculative-simple" -m "$T" -md "$D" \
                        -dev CUDA0 -devd "$devd" -ngl 99 -ngld 99 -fa on -c 4096 -n "$N_PREDICT" -f "$p" \
                        --seed "$SEED" --temp "$temp" "${extra[@]}" --spec-type draft-simple \
                        --spec-draft-n-max "$DRAFT_MAX" --spec-draft-n-min 0 --spec-draft-p-min 0 \
                        > "$base.out" 2> "$base.log"
                done
            done
        done
    done
done
finish
