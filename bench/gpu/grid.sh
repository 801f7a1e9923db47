#!/usr/bin/env bash
# The "never slower than plain" grid on the GPU: bench/grid.py (the default policy against plain decoding and the
# best fixed draft length, `localspec bench --sweep` for one client, `localspec serve` driven by bench/concurrency.py
# for several) on the 27B-shaped hybrid drafting with its MTP head and on the card pair; and bench/projector_memory.py
# --gpu (a projector's compute buffer, no model needed) once the build is there.
# Run from the repo root, carrying bench/gpu/carry (make_archive.sh); resumable on the warm machine (a job whose CSV
# exists is skipped; one cut short by the budget goes on from the reports it left, `grid.py --reuse`):
#     W=$HOME/lsw; mkdir -p $W; cp -r bench/gpu/carry $W/
#     CARRY=$W/carry WORK=$W BUDGET_S=560 bash bench/gpu/grid.sh      # repeat until it logs "all jobs done"
# A bare H100: the pinned build (~250 s, no llama-server, no newest tree: every figure here is localspec's own)
# while the targets its jobs need are written, then the jobs in GRID_JOBS' order.
# Environment (defaults in brackets; CARRY, WORK, OUT, BUDGET_S, CARD_SIZE, VOCAB, RERUN: harness.sh):
#   GRID_JOBS ["projector hybrid-mtp hybrid-mtp-clients card-clients"]
#     projector            bench/projector_memory.py --gpu (Gemma 3 and Qwen-VL towers, flash attention on and off)
#     hybrid-mtp           one client: --drafters mtp --classes HYBRID_CLASSES --lengths LENGTHS --sweep HYBRID_SWEEP
#     hybrid-mtp-clients   several: --clients CLIENTS --classes SERVED_CLASSES --lengths SERVED_LENGTHS
#                          --sweep SERVED_HYBRID_SWEEP
#     card-clients         the card pair (~85%), the draft model, several clients, --sweep SERVED_CARD_SWEEP
#     hybrid-rounds        bench/lab/slot_rounds.py on the hybrid, ROUND_SLOTS slots, one JSON per kind of round:
#                          plain (a plain load), none (the MTP head's load, every draft cut: the load policy's
#                          stand-aside), none-lookup (rollback snapshots, no hidden rows), none-ascending (slots
#                          filled in order), all (drafting the whole length, 4)
#   HYBRID_SIZE [hybrid27b] (hybrid-tiny: a CPU dry run)  MTP_NOISE [0.1]  SCALE [8e-5]  CARD_NOISE [0.013]
#   HYBRID_CLASSES [code-edit,prose,qa,json]  LENGTHS [32,400]  HYBRID_SWEEP [2,3,4,5]
#   CLIENTS [4,16]  SERVED_CLASSES [code-edit,prose]  SERVED_LENGTHS [32]  SERVED_HYBRID_SWEEP [3,5]
#   SERVED_CARD_SWEEP [2,4,6]  ROUND_SLOTS [16]  REPEAT [3] (served: SERVED_REPEAT [2])  WARMUP [1]  THREADS [4]
#   GRID_ARGS  more bench/grid.py arguments (a word list)
# Results: WORK/results/grid/DATE-MACHINE-grid-JOB.csv (bench/results' naming; the reports in the folder of its
# name), projector-memory.csv; $OUT/grid-results.tar.gz, the CSVs and the log.
# A CPU dry run (this machine's llama_cpp; tiny models):
#   CARRIED_PY=0 HYBRID_SIZE=hybrid-tiny CARD_SIZE=card-tiny VOCAB= LENGTHS=16 SERVED_LENGTHS=16 REPEAT=1 \
#       SERVED_REPEAT=1 THREADS=1 CLIENTS=2 WORK=/tmp/lsgrid BUDGET_S=3000 bash bench/gpu/grid.sh
set -uo pipefail
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"

GRID_JOBS="${GRID_JOBS:-projector hybrid-mtp hybrid-mtp-clients card-clients}"
CARD_NOISE="${CARD_NOISE:-0.013}"
HYBRID_CLASSES="${HYBRID_CLASSES:-code-edit,prose,qa,json}"
LENGTHS="${LENGTHS:-32,400}"
HYBRID_SWEEP="${HYBRID_SWEEP:-2,3,4,5}"
CLIENTS="${CLIENTS:-4,16}"
SERVED_CLASSES="${SERVED_CLASSES:-code-edit,prose}"
SERVED_LENGTHS="${SERVED_LENGTHS:-32}"
SERVED_HYBRID_SWEEP="${SERVED_HYBRID_SWEEP:-3,5}"
SERVED_CARD_SWEEP="${SERVED_CARD_SWEEP:-2,4,6}"
ROUND_SLOTS="${ROUND_SLOTS:-16}"
REPEAT="${REPEAT:-3}"
SERVED_REPEAT="${SERVED_REPEAT:-2}"
WARMUP="${WARMUP:-1}"
THREADS="${THREADS:-4}"
export BUILD_SERVER=0 NEWEST=0  # localspec against itself: the pinned build alone
results_in "$WORK/results/grid"
finish() { pack grid-results "$RES" "$RES"/*.csv; }
trap 'log "terminated"; finish; exit 143' TERM INT
snapshot_env "$RES/env.txt"

HT="$(hybrid_target)"  # (hybrid.sh's file names: a warm machine's are reused)
write_models() {  # the targets GRID_JOBS measure (and the card's draft), one after the other, beside the build
    await_carried_py; use_build
    [[ " $GRID_JOBS " != *" hybrid-"* ]] || write_hybrid_target "$RES/write-hybrid.log"
    [[ " $GRID_JOBS " != *" card-clients "* ]] || card_pair "$CARD_NOISE" > /dev/null
}
if [[ "${CARRIED_PY:-1}" == 1 ]]; then
    ( ensure_build ) & build=$!
else
    build=""
fi
write_models & writer=$!
written() { [[ -z "$writer" ]] || wait "$writer"; writer=""; }
[[ -z "$build" ]] || wait "$build"
use_build
[[ "${CARRIED_PY:-1}" == 0 ]] || have_build || { log "no llama.cpp build (see $RES/prepare.log)"; finish; exit 1; }
export COLUMNS=200
tag="$(machine_tag)"
[[ -s "$RES/day" ]] || date -u +%F > "$RES/day"  # (the first call's date names the files: a later call may be past midnight)
day="$(cat "$RES/day")"

# result JOB: the file a job writes (its presence: the job is done).
result() {
    case "$1" in
        projector) echo "$RES/projector-memory.csv" ;;
        hybrid-rounds) echo "$RES/$day-$tag-rounds/all.json" ;;  # (its last round kind)
        *) echo "$RES/$day-$tag-grid-$1.csv" ;;
    esac
}
ROUND_KINDS=("plain:--k 0" "none:--drafter mtp --k 4 --share 0" "none-lookup:--drafter lookup --k 4 --share 0"
             "none-ascending:--drafter mtp --k 4 --share 0 --order ascending" "all:--drafter mtp --k 4 --share 1")
# grid JOB NEED_S ARGS...: bench/grid.py into DAY-TAG-grid-JOB.csv unless it exists; going on from the reports an
# earlier call left (--reuse) when its folder is there.
grid() {
    local job="$1" need="$2"; shift 2
    local csv; csv="$(result "$job")"
    [[ -s "$csv" ]] && { log "$job: done earlier"; return 0; }
    local again=(); [[ -d "${csv%.csv}" ]] && again=(--reuse)
    run "grid-$job" "$need" python3 "$REPO/bench/grid.py" --out "$csv" --repeat "$REPEAT" --warmup "$WARMUP" \
        --threads "$THREADS" "$@" "${again[@]}" ${GRID_ARGS:-} > "$RES/grid-$job.log" 2>&1
    grep -E "^drafter=" "$RES/grid-$job.log" | tee -a "$RES/run.log" > /dev/null
}

for job in $GRID_JOBS; do
    case "$job" in
        projector)
            [[ -s "$(result projector)" ]] && continue
            run projector-memory 120 python3 "$REPO/bench/projector_memory.py" --gpu \
                --synthetic-text "$CARRY/ggml-vocab-qwen2.gguf" --out "$(result projector)" \
                > "$RES/projector-memory.log" 2>&1 ;;
        hybrid-rounds)
            written
            [[ -f "$HT" ]] || { log "no hybrid target (see $RES/write-hybrid.log)"; continue; }
            mkdir -p "$RES/$day-$tag-rounds"
            for kind in "${ROUND_KINDS[@]}"; do
                name="${kind%%:*}"; json="$RES/$day-$tag-rounds/$name.json"
                [[ -s "$json" ]] && continue
                # shellcheck disable=SC2086  # (the kind's arguments: a word list)
                run "rounds-$name" 90 python3 "$REPO/bench/lab/slot_rounds.py" --target "$HT" ${kind#*:} \
                    --slots "$ROUND_SLOTS" --rounds 60 --warmup 5 --temperature 0.7 --threads "$THREADS" --timeline \
                    --json "$json" > "$RES/rounds-$name.log" 2>&1
            done ;;
        hybrid-mtp|hybrid-mtp-clients)
            [[ -z "$writer" ]] || { log "waiting for the models' writer (no measuring beside it)"; written; }
            [[ -f "$HT" ]] || { log "no hybrid target (see $RES/write-hybrid.log)"; continue; }
            if [[ "$job" == hybrid-mtp ]]; then
                grid "$job" 90 --target "$HT" --drafters mtp --classes "$HYBRID_CLASSES" --lengths "$LENGTHS" \
                    --sweep "$HYBRID_SWEEP"
            else
                REPEAT="$SERVED_REPEAT" grid "$job" 90 --target "$HT" --drafters mtp --classes "$SERVED_CLASSES" \
                    --lengths "$SERVED_LENGTHS" --sweep "$SERVED_HYBRID_SWEEP" --clients "$CLIENTS"
            fi ;;
        card-clients)
            written
            card_pair "$CARD_NOISE" || { log "no card pair"; continue; }
            REPEAT="$SERVED_REPEAT" grid "$job" 90 --target "$(card_target)" --draft "$(card_draft "$CARD_NOISE")" \
                --drafters model --classes "$SERVED_CLASSES" --lengths "$SERVED_LENGTHS" --sweep "$SERVED_CARD_SWEEP" \
                --clients "$CLIENTS" ;;
        *) log "GRID_JOBS: unknown job $job" ;;
    esac
done
done_all=1
for job in $GRID_JOBS; do [[ -s "$(result "$job")" ]] || done_all=0; done
(( done_all )) && log "all jobs done"
finish
