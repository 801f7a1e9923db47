#!/usr/bin/env bash
# Hybrid targets on the GPU: a Qwen3.5/3.6-27B-shaped hybrid (48 Gated DeltaNet + 16 gated attention blocks, one
# MTP block, llama.cpp's Q4_K_M mix; bench/synthetic.py --size hybrid27b) drafting with its own MTP head:
# `localspec bench --drafter mtp` against llama.cpp's `llama-speculative-simple --spec-type draft-mtp` on the same
# file, prompts (the bench's shipped set, raw), lengths and draft length, at T = 0 and 0.7, medians of REPEAT
# (localspec) and LLAMA_REPS (llama.cpp); and what rolling the recurrent state back costs (bench/rollback_cost.py).
# Run from the repo root, carrying bench/gpu/carry (make_archive.sh):
#     bash bench/gpu/hybrid.sh
# On a bare H200 in one call (~9.5 minutes): llama.cpp builds through run.sh (~250-290 s) while the 16 GB target is
# written (as soon as the carried packages are unpacked); then, each step only if the budget still has room and
# skipped when its output exists (a second call on a warm machine finishes what the first left): llama-bench tg128,
# localspec at each temperature, the rollback costs, llama-speculative-simple (the repetitions interleaved, so a
# short budget still gives medians over the repetitions that finished); summarize.py's table last.
# Environment (defaults in brackets; CARRY, WORK, OUT, BUDGET_S, CARRIED_PY, VOCAB, RERUN: harness.sh):
#   HYBRID_SIZE [hybrid27b] (hybrid-tiny: a CPU dry run)  MTP_NOISE [0.1] (the MTP head's agreement knob)
#   SCALE [8e-5] (the target's extra blocks)  TEMPS ["0 0.7"]  N_PREDICT [128]  DRAFT_MAX [3] (both tools' MTP
#   draft length)  REPEAT [5]  WARMUP [2]  LLAMA_REPS [5]  ROLLBACK_REPS [30]
#   DRAFT_PAIR [0]  1 = also the 2-block hybrid draft with the draft model (k = 6 against draft-simple)
#   BENCH_ARGS  more `localspec bench` arguments (a CPU dry run: --threads 1)
# A CPU dry run (run.sh builds a CPU llama.cpp into WORK):
#   CARRIED_PY=0 CUDA=0 HYBRID_SIZE=hybrid-tiny N_PREDICT=16 REPEAT=1 WARMUP=0 LLAMA_REPS=1 ROLLBACK_REPS=2 \
#       BENCH_ARGS="--threads 1" BUDGET_S=5000 bash bench/gpu/hybrid.sh
set -uo pipefail
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"

HYBRID_SIZE="${HYBRID_SIZE:-hybrid27b}"
MTP_NOISE="${MTP_NOISE:-0.1}"
SCALE="${SCALE:-8e-5}"
TEMPS="${TEMPS:-0 0.7}"
N_PREDICT="${N_PREDICT:-128}"
DRAFT_MAX="${DRAFT_MAX:-3}"
REPEAT="${REPEAT:-5}"
WARMUP="${WARMUP:-2}"
LLAMA_REPS="${LLAMA_REPS:-5}"
ROLLBACK_REPS="${ROLLBACK_REPS:-30}"
DRAFT_PAIR="${DRAFT_PAIR:-0}"
export BUILD_SERVER=0  # run.sh's build: llama-server is not needed here
results_in "$WORK/results-hybrid"
snapshot_env "$RES/env.txt"
T="$MODELS/$HYBRID_SIZE-n$MTP_NOISE-target.gguf"
D="$MODELS/$HYBRID_SIZE-n$MTP_NOISE-draft.gguf"
[[ -z "${VOCAB+set}" && "$HYBRID_SIZE" == hybrid27b ]] && VOCAB="$CARRY/ggml-vocab-qwen2.gguf"
vocab_args "$HYBRID_SIZE"
log "hybrid: $HYBRID_SIZE, MTP noise $MTP_NOISE, scale $SCALE, k $DRAFT_MAX, temps '$TEMPS', budget ${BUDGET_S}s"

# -- llama.cpp builds (run.sh, in the background) while the models are written ----------------------------------
( ensure_build ) &
build=$!
writer=""
if [[ ! -f "$T" || ( "$DRAFT_PAIR" == 1 && ! -f "$D" ) ]]; then
    # The writer needs the carried gguf package, which run.sh unpacks first thing.
    for _ in $(seq 1 120); do
        [[ "${CARRIED_PY:-1}" == 0 || -f "$WORK/pyenv/.stamp" ]] && break
        sleep 1
    done
    only=(--only target); [[ "$DRAFT_PAIR" == 1 ]] && only=()
    log "writing $HYBRID_SIZE (background)"
    ( use_build; nice -n 5 timeout "$(left)" python3 "$REPO/bench/synthetic.py" --size "$HYBRID_SIZE" "${only[@]}" \
          --mtp-noise "$MTP_NOISE" --scale "$SCALE" --out "$MODELS" --prefix "$HYBRID_SIZE-n$MTP_NOISE-" \
          "${VOCAB_ARGS[@]}" > "$RES/write.log" 2>&1 ) &
    writer=$!
fi
wait "$build"
use_build
have_build || { log "no llama.cpp build (see $RES/prepare.log)"; exit 1; }
if [[ -n "$writer" ]]; then
    log "waiting for the writer"
    wait "$writer" || log "the writer failed: $(tail -3 "$RES/write.log")"
fi
[[ -f "$T" ]] || { log "no target model (see $RES/write.log)"; exit 1; }
log "target $T ($(du -h "$T" | cut -f1))"
write_prompts "$RES/prompts" || { log "no prompts written"; exit 1; }

# measure NAME DRAFTER K [DRAFT]: llama-bench tg128, then `localspec bench` at each temperature.
measure() {
    local name="$1" drafter="$2" k="$3" dr="${4:-}" dir="$RES/$1"
    mkdir -p "$dir"
    if [[ ! -s "$dir/llama-bench.json" ]]; then
        local models=(-m "$T"); [[ -n "$dr" ]] && models+=(-m "$dr")
        run "llama-bench-$name" 30 "$BIN/llama-bench" "${models[@]}" -p 0 -n 128 -fa 1 -ngl 99 -r 3 -o json \
            > "$dir/llama-bench.json.tmp" 2> "$dir/llama-bench.log" && mv "$dir/llama-bench.json.tmp" "$dir/llama-bench.json"
    fi
    local temp args=(--draft "$k" --drafter "$drafter"); [[ -n "$dr" ]] && args+=(--draft "$dr")
    for temp in $TEMPS; do
        [[ -s "$dir/localspec-t$temp.json" ]] && continue
        # shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
        run "localspec-$name-t$temp" 60 "${LOCALSPEC[@]}" bench --raw --target "$T" "${args[@]}" --temp "$temp" \
            --max-tokens "$N_PREDICT" --repeat "$REPEAT" --warmup "$WARMUP" --seed "$SEED" --ctx 4096 \
            --json "$dir/localspec-t$temp.json" ${BENCH_ARGS:-} > "$dir/localspec-t$temp.log" 2>&1
    done
}
# llama NAME SPEC_ARGS...: llama-speculative-simple on every prompt, per repetition and temperature, interleaved
# (summarize.py's layout: NAME/llama/t<T>-host-r<REP>-<prompt>.log).
llama() {
    local name="$1"; shift
    local dir="$RES/$name/llama" rep temp p base extra
    mkdir -p "$dir"
    for rep in $(seq 1 "$LLAMA_REPS"); do
        for temp in $TEMPS; do
            for p in "${PROMPT_FILES[@]}"; do
                base="$dir/t$temp-host-r$rep-$(basename "$p" .txt)"
                grep -q "decoded" "$base.log" 2>/dev/null && continue
                extra=(); [[ "$temp" != 0 ]] && extra=(--top-k 40 --top-p 0.9 --min-p 0)  # the preset `default`
                run "llama-$name-$(basename "$base")" 12 "$BIN/llama-speculative-simple" -m "$T" -ngl 99 -fa on \
                    -c 4096 -n "$N_PREDICT" -f "$p" --seed "$SEED" --temp "$temp" "${extra[@]}" "$@" \
                    > "$base.out" 2> "$base.log"
                (( $? == 99 )) && return 0  # out of budget
            done
        done
    done
}

measure mtp mtp "$DRAFT_MAX"
if [[ ! -s "$RES/mtp/rollback-cost.json" ]]; then
    run rollback-cost 40 python3 "$REPO/bench/rollback_cost.py" --model "$T" --k "$DRAFT_MAX" --reps "$ROLLBACK_REPS" \
        --json "$RES/mtp/rollback-cost.json" > "$RES/mtp/rollback-cost.log" 2>&1
fi
llama mtp --spec-type draft-mtp --spec-draft-n-max "$DRAFT_MAX" --spec-draft-n-min 0 --spec-draft-p-min 0
if [[ "$DRAFT_PAIR" == 1 && -f "$D" ]]; then
    measure draft model 6 "$D"
    llama draft -md "$D" -ngld 99 --spec-type draft-simple --spec-draft-n-max 6 --spec-draft-n-min 0 \
        --spec-draft-p-min 0
fi
python3 "$HERE/summarize.py" "$RES" 2>&1 | tee "$RES/summary.txt"
pack results-hybrid "$RES" "$RES/summary.txt" "$RES/summary.json"
