#!/usr/bin/env bash
# Hybrid targets on the GPU: a Qwen3.5/3.6-27B-shaped hybrid (48 Gated DeltaNet + 16 gated attention blocks, one
# MTP block, llama.cpp's Q4_K_M mix; bench/synthetic.py --size hybrid27b; HYBRID_SIZE=hybrid35b-a3b: the
# 35B-A3B-shaped mixture of experts) drafting with its own MTP head:
# `localspec bench --drafter mtp --against llama.cpp` (llama.cpp's `llama-speculative-simple --spec-type draft-mtp`
# on the same file, prompt tokens (the bench's shipped set, raw), lengths and draft length), at T = 0 and 0.7, medians
# of REPEAT on both sides; and what rolling the recurrent state back costs (bench/rollback_cost.py).
# Run from the repo root, carrying bench/gpu/carry (make_archive.sh):
#     bash bench/gpu/hybrid.sh
# On a bare H200 (~9.5 minutes a call): llama.cpp builds through run.sh (~250-290 s) while the 16 GB target is
# written (as soon as the carried packages are unpacked); then, each step only if the budget still has room and
# skipped when its output exists, so a second call on the still-warm machine finishes what the first left:
# llama-bench tg128, the bench at T = 0, the rollback costs, the bench at T = 0.7; summarize.py's table last.
# Environment (defaults in brackets; CARRY, WORK, OUT, BUDGET_S, CARRIED_PY, VOCAB, RERUN: harness.sh):
#   HYBRID_SIZE [hybrid27b] (hybrid35b-a3b: the MoE; hybrid-tiny: a CPU dry run)  MTP_NOISE [0.1] (the MTP head's
#   agreement knob)
#   SCALE [8e-5] (the target's extra blocks)  TEMPS ["0 0.7"]  N_PREDICT [128]  DRAFT_MAX [3] (both tools' MTP
#   draft length)  REPEAT [5] (both loops)  WARMUP [2]  ROLLBACK_REPS [30]
#   HYBRID_JOBS ["mtp rollback"]  what to measure, in this order: mtp (the MTP head at TEMPS), rollback (the rollback
#   costs), draft (the 4-block hybrid draft, 3 recurrent + 1 attention, with the draft model: k = 6, against
#   draft-simple), dflash and dspark (the block drafters: a target of the size that repeats its last token, with
#   probability REPEAT_P [0.8] at the default sampling and always at T = 0, and the copying drafter of the public
#   Qwen3.5/3.6-27B DFlash drafter's shape, bench/synthetic.py --repeat-p / --copy-drafter; draft length BLOCK_DRAFT
#   [15], against draft-dflash / draft-dspark at BLOCK_LENGTHS [15]); DRAFT_PAIR=1 adds draft
#   Results: WORK/results-hybrid (hybrid27b) or WORK/results-hybrid-HYBRID_SIZE
#   BENCH_ARGS  more `localspec bench` arguments (a CPU dry run: --threads 1)
#   ALSO_WRITE  more presets whose MTP targets the background writer writes after this run's own files, for a later
#               call (e.g. hybrid35b-a3b beside the block drafters' first call: its minutes hide behind the build)
# A CPU dry run (run.sh builds a CPU llama.cpp into WORK):
#   CARRIED_PY=0 CUDA=0 HYBRID_SIZE=hybrid-tiny N_PREDICT=16 REPEAT=1 WARMUP=0 ROLLBACK_REPS=2 \
#       BENCH_ARGS="--threads 1" BUDGET_S=5000 bash bench/gpu/hybrid.sh
set -uo pipefail
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"

TEMPS="${TEMPS:-0 0.7}"
N_PREDICT="${N_PREDICT:-128}"
DRAFT_MAX="${DRAFT_MAX:-3}"
REPEAT="${REPEAT:-5}"
WARMUP="${WARMUP:-2}"
ROLLBACK_REPS="${ROLLBACK_REPS:-30}"
HYBRID_JOBS="${HYBRID_JOBS:-mtp rollback}"
[[ "${DRAFT_PAIR:-0}" == 1 ]] && HYBRID_JOBS="$HYBRID_JOBS draft"
wants() { [[ " $HYBRID_JOBS " == *" $1 "* ]]; }
export BUILD_SERVER=0  # run.sh's build: llama-server is not needed here
# The yardstick: the newest llama.cpp's draft-mtp loop (harness.sh's `yardstick`), built beside the pinned one unless
# LLAMA_YARDSTICK=pinned; AGAINST_LENGTHS: its draft lengths searched (unset: the preset's).
export NEWEST="${NEWEST:-1}"
[[ "${LLAMA_YARDSTICK:-}" == pinned ]] && NEWEST=0
LLAMA_YARDSTICK="${LLAMA_YARDSTICK:-newest}"
RESULTS_NAME="results-hybrid"; [[ "$HYBRID_SIZE" == hybrid27b ]] || RESULTS_NAME="results-hybrid-$HYBRID_SIZE"
results_in "$WORK/$RESULTS_NAME"
snapshot_env "$RES/env.txt"
T="$(hybrid_target)"
D="$MODELS/$HYBRID_SIZE-n$MTP_NOISE-draft.gguf"
REPEAT_P="${REPEAT_P:-0.8}"
BLOCK_DRAFT="${BLOCK_DRAFT:-15}"
BLOCK_LENGTHS="${BLOCK_LENGTHS:-15}"
RT="$MODELS/$HYBRID_SIZE-repeat$REPEAT_P-target.gguf"  # the block drafters' target, and their files:
copy_drafter() { echo "$MODELS/$HYBRID_SIZE-repeat$REPEAT_P-copy-$1.gguf"; }
also_missing() {
    local size
    for size in ${ALSO_WRITE:-}; do [[ -f "$(hybrid_target "$size")" ]] || return 0; done
    return 1
}
wants_mtp_target() { wants mtp || wants rollback || wants draft; }
mtp_files_missing() { wants_mtp_target && { [[ ! -f "$T" ]] || { wants draft && [[ ! -f "$D" ]]; }; }; }
block_files_missing() {
    local kind
    for kind in dflash dspark; do
        if wants "$kind" && [[ ! -f "$RT" || ! -f "$(copy_drafter "$kind")" ]]; then return 0; fi
    done
    return 1
}
# write_models: what the jobs need and is not there yet (synthetic.py writes a file whole or not at all), in the
# budget's time.
synthetic() { nice -n 5 timeout "$(left)" python3 "$REPO/bench/synthetic.py" "$@"; }
write_models() {
    local only=(--only target) kind
    if mtp_files_missing; then
        wants draft && only=()
        synthetic --size "$HYBRID_SIZE" "${only[@]}" --mtp-noise "$MTP_NOISE" \
            --scale "$SCALE" --out "$MODELS" --prefix "$HYBRID_SIZE-n$MTP_NOISE-" "${VOCAB_ARGS[@]}" || return 1
    fi
    local repeat=(--size "$HYBRID_SIZE" --repeat-p "$REPEAT_P" --out "$MODELS" --prefix "$HYBRID_SIZE-repeat$REPEAT_P-")
    if block_files_missing && [[ ! -f "$RT" ]]; then
        synthetic "${repeat[@]}" --only target --scale "$SCALE" "${VOCAB_ARGS[@]}" || return 1
    fi
    for kind in dflash dspark; do
        if wants "$kind" && [[ ! -f "$(copy_drafter "$kind")" ]]; then
            synthetic "${repeat[@]}" --copy-drafter "$kind" "${VOCAB_ARGS[@]}" || return 1
        fi
    done
    local size
    for size in ${ALSO_WRITE:-}; do  # (in the writer's subshell: the run's own VOCAB_ARGS stay)
        write_hybrid_target "$RES/write-$size.log" "$size" || return 1
    done
}
vocab_args "$HYBRID_SIZE"
log "hybrid: $HYBRID_SIZE, MTP noise $MTP_NOISE, scale $SCALE, k $DRAFT_MAX, temps '$TEMPS', jobs '$HYBRID_JOBS', budget ${BUDGET_S}s"

# -- llama.cpp builds (run.sh, in the background) while the models are written ----------------------------------
( ensure_build ) &
build=$!
writer=""
if mtp_files_missing || block_files_missing || also_missing; then
    await_carried_py
    log "writing $HYBRID_SIZE's models (background)"
    ( use_build; write_models > "$RES/write.log" 2>&1 ) &
    writer=$!
fi
wait "$build"
use_build
have_build || { log "no llama.cpp build (see $RES/prepare.log)"; exit 1; }
if [[ -n "$writer" ]]; then
    log "waiting for the writer"
    wait "$writer" || log "the writer failed: $(tail -3 "$RES/write.log")"
fi
if wants_mtp_target; then
    [[ -f "$T" ]] || { log "no target model (see $RES/write.log)"; exit 1; }
    log "target $T ($(du -h "$T" | cut -f1))"
fi
write_prompts "$RES/prompts" || { log "no prompts written"; exit 1; }
# Never a silent fallback to the pinned build: without the yardstick asked for, nothing is measured.
yardstick || { log "no $LLAMA_YARDSTICK llama.cpp to compare with (see $RES/prepare.log): stopping"; exit 1; }
log "yardstick: $YARDSTICK llama.cpp ($("$YARDSTICK_BIN/llama-speculative-simple" --version 2>&1 | grep -m1 '^version:'))"
# shellcheck disable=SC2086  # AGAINST_LENGTHS is one word
AGAINST=(--against llama.cpp --llama-bin "$YARDSTICK_BIN" ${AGAINST_LENGTHS:+--against-lengths "$AGAINST_LENGTHS"})

# bench_at NAME DRAFTER K TEMP [DRAFT [TARGET [LENGTHS]]]: `localspec bench --against llama.cpp` (the product's own
# comparison: its runs, then llama-speculative-simple with the same --spec-type on the same prompt tokens, REPEAT
# times per sampling mode, all in one JSON), after llama-bench tg128 once per NAME (of the target alone for a
# block drafter, which cannot run without one). TARGET: the MTP target unless named; LENGTHS: llama.cpp's draft
# lengths searched (AGAINST_LENGTHS unless named).
bench_at() {
    local name="$1" drafter="$2" k="$3" temp="$4" dr="${5:-}" target="${6:-$T}" lengths="${7:-}" dir="$RES/$1"
    mkdir -p "$dir"
    if [[ ! -s "$dir/llama-bench.json" ]]; then
        local models=(-m "$target"); [[ -n "$dr" && "$drafter" == model ]] && models+=(-m "$dr")
        run "llama-bench-$name" 30 "$BIN/llama-bench" "${models[@]}" -p 0 -n 128 -fa 1 -ngl 99 -r 3 -o json \
            > "$dir/llama-bench.json.tmp" 2> "$dir/llama-bench.log" && mv "$dir/llama-bench.json.tmp" "$dir/llama-bench.json"
    fi
    [[ -s "$dir/localspec-t$temp.json" ]] && return 0
    local args=(--draft "$k" --drafter "$drafter"); [[ -n "$dr" ]] && args+=(--draft "$dr")
    [[ -n "$lengths" ]] && args+=(--against-lengths "$lengths")  # (after AGAINST's: the last one counts)
    # A repetition on the H200 (27B Q4_K_M, 128 tokens, 3 prompts): ~10 s of localspec, ~35 s of llama.cpp (a model
    # load per prompt and sampling mode); exit 1 = the greedy check failed, 2 = llama.cpp did not run (the JSON
    # says why either way).
    # shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
    run "localspec-$name-t$temp" $(( 40 + 45 * REPEAT )) "${LOCALSPEC[@]}" bench --raw --target "$target" \
        --temp "$temp" --max-tokens "$N_PREDICT" --repeat "$REPEAT" --warmup "$WARMUP" --seed "$SEED" --ctx 4096 \
        "${AGAINST[@]}" "${args[@]}" --json "$dir/localspec-t$temp.json" ${BENCH_ARGS:-} \
        > "$dir/localspec-t$temp.log" 2>&1
}

# In the order that matters if the budget runs out: greedy first, then the rollback costs, then sampling.
first_temp="${TEMPS%% *}"
wants mtp && bench_at mtp mtp "$DRAFT_MAX" "$first_temp"
if wants rollback && [[ ! -s "$RES/mtp/rollback-cost.json" ]]; then
    mkdir -p "$RES/mtp"
    run rollback-cost 40 python3 "$REPO/bench/rollback_cost.py" --model "$T" --k "$DRAFT_MAX" --reps "$ROLLBACK_REPS" \
        --json "$RES/mtp/rollback-cost.json" > "$RES/mtp/rollback-cost.log" 2>&1
fi
for temp in $TEMPS; do
    wants mtp && [[ "$temp" != "$first_temp" ]] && bench_at mtp mtp "$DRAFT_MAX" "$temp"
done
if wants draft; then
    if [[ -f "$D" ]]; then for temp in $TEMPS; do bench_at draft model 6 "$temp" "$D"; done
    else log "no draft model (see $RES/write.log)"; fi
fi
for kind in dflash dspark; do
    wants "$kind" || continue
    if [[ -f "$RT" && -f "$(copy_drafter "$kind")" ]]; then
        for temp in $TEMPS; do
            bench_at "$kind" "$kind" "$BLOCK_DRAFT" "$temp" "$(copy_drafter "$kind")" "$RT" "$BLOCK_LENGTHS"
        done
    else log "no $kind pair (see $RES/write.log)"; fi
done
python3 "$HERE/summarize.py" "$RES" 2>&1 | tee "$RES/summary.txt"
pack "$RESULTS_NAME" "$RES" "$RES/summary.txt" "$RES/summary.json"
