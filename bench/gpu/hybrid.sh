#!/usr/bin/env bash
# The hybrid benchmark: a Qwen3.5/3.6-27B-shaped hybrid target (48 Gated DeltaNet + 16 gated attention blocks,
# one MTP block, llama.cpp's Q4_K_M mix; bench/synthetic.py --size hybrid27b) drafting with its own MTP head:
# `localspec bench --drafter mtp` against llama.cpp's `llama-speculative-simple --spec-type draft-mtp` on the same
# file, prompts (the bench's shipped set, raw), lengths and draft length, at T = 0 and 0.7; plus what rolling the
# recurrent state back costs (bench/rollback_cost.py). Run from the repo root, carrying bench/gpu/carry
# (make_archive.sh):
#     bash bench/gpu/hybrid.sh
# On a bare H200 in one call of ~9.5 minutes: llama.cpp builds (run.sh's build, ~250-290 s) while the 16 GB target
# is written; then in order of importance, each step only if the budget still has room: llama-bench tg128,
# localspec at T = 0 and 0.7 (REPEAT medians), the rollback costs, llama-speculative-simple (LLAMA_REPS repetitions
# per temperature, interleaved, so a short budget still gives medians over the repetitions that finished). State
# lives in WORK like run.sh's: the same command on a warm machine finishes what a first call left.
# Environment (defaults in brackets):
#   OUT [bench/gpu/work/out]  CARRY [bench/gpu/carry]  WORK [bench/gpu/work]  BUDGET_S [570]
#   TEMPS ["0 0.7"]  N_PREDICT [128]  DRAFT_MAX [3] (MTP's draft length, both tools)  REPEAT [5]  WARMUP [2]
#   LLAMA_REPS [5]  MTP_NOISE [0.1] (the head's agreement knob)  SCALE [8e-5] (the target blocks')
#   DRAFT_PAIR [0]  1 = also the 2-block hybrid draft with the draft model (k = 6, draft-simple): a second pair
#   SIZE [hybrid27b] (hybrid-tiny: a CPU dry run with CUDA=0 CARRIED_PY=0)  CUDA [1]  CARRIED_PY [1]
set -uo pipefail

T0=$(date +%s)
REPO="$(pwd)"
HERE="$REPO/bench/gpu"
CARRY="${CARRY:-$HERE/carry}"
WORK="${WORK:-$HERE/work}"
OUT="${OUT:-$WORK/out}"
BUDGET_S="${BUDGET_S:-570}"
TEMPS="${TEMPS:-0 0.7}"
N_PREDICT="${N_PREDICT:-128}"
DRAFT_MAX="${DRAFT_MAX:-3}"
REPEAT="${REPEAT:-5}"
WARMUP="${WARMUP:-2}"
LLAMA_REPS="${LLAMA_REPS:-5}"
MTP_NOISE="${MTP_NOISE:-0.1}"
SCALE="${SCALE:-8e-5}"
SIZE="${SIZE:-hybrid27b}"
DRAFT_PAIR="${DRAFT_PAIR:-0}"
SEED=42
RES="$WORK/results"
MODELS="$WORK/models"
BIN="$WORK/build/bin"
mkdir -p "$OUT" "$RES" "$MODELS"
OUT="$(cd "$OUT" && pwd)"
STEPS="$RES/steps.tsv"
touch "$STEPS"
# shellcheck source=bench/gpu/harness.sh
source "$HERE/harness.sh"  # log, left, run, use_build
VOCAB=()
[[ "$SIZE" == hybrid27b ]] && VOCAB=(--vocab "$CARRY/ggml-vocab-qwen2.gguf")
T="$MODELS/$SIZE-n$MTP_NOISE-target.gguf"
D="$MODELS/$SIZE-n$MTP_NOISE-draft.gguf"

# -- the target (and the 2-block draft), written while llama.cpp builds ------------------------------------------
writer=""
if [[ ! -f "$T" || ( "$DRAFT_PAIR" == 1 && ! -f "$D" ) ]]; then
    only=(--only target); [[ "$DRAFT_PAIR" == 1 ]] && only=()
    log "writing $SIZE (mtp noise $MTP_NOISE, scale $SCALE) in the background"
    ( [[ "${CARRIED_PY:-1}" == 1 && -d "$WORK/pyenv/py" ]] && export PYTHONPATH="$WORK/pyenv/py:$REPO"
      nice -n 5 python3 "$REPO/bench/synthetic.py" --size "$SIZE" "${only[@]}" --mtp-noise "$MTP_NOISE" \
          --scale "$SCALE" --out "$MODELS" --prefix "$SIZE-n$MTP_NOISE-" "${VOCAB[@]}" > "$RES/write-$SIZE.log" 2>&1
    ) &
    writer=$!
fi

# -- llama.cpp: run.sh's build (no pairs of its own), which also unpacks the carried packages ---------------------
log "building llama.cpp through run.sh"
CARRY="$CARRY" WORK="$WORK" OUT="$OUT" SCALES="" CARD_NOISES="" BUILD_SERVER=0 SKIP_WIDTHS=1 \
    BUDGET_S=$(( $(left) - 5 )) bash "$HERE/run.sh" > "$RES/run-build.log" 2>&1
[[ -x "$BIN/llama-speculative-simple" ]] || { log "no llama.cpp build: $(tail -5 "$RES/run-build.log")"; exit 1; }
use_build
if [[ -n "$writer" ]]; then
    log "waiting for the writer"
    wait "$writer" || log "writer failed: $(tail -3 "$RES/write-$SIZE.log")"
fi
[[ -f "$T" ]] || { log "no target model"; exit 1; }
log "target: $T ($(du -h "$T" | cut -f1))"

PROMPTS=("$RES"/prompts/*.txt)
LOCALSPEC=(python3 -c "import llama_cpp; from localspec.cli.app import main; main()")
SAMPLING_EXTRA=(--top-k 40 --top-p 0.9 --min-p 0)  # the preset `default` at T > 0
done_ok() { [[ -s "$1" ]]; }

# measure NAME DRAFTER K [DRAFT]: llama-bench, localspec per temperature, rollback costs (the target's).
measure() {
    local name="$1" drafter="$2" k="$3" dr="${4:-}" dir="$RES/$1"; mkdir -p "$dir"
    if ! done_ok "$dir/llama-bench.json"; then
        local models=(-m "$T"); [[ -n "$dr" ]] && models+=(-m "$dr")
        run "llama-bench-$name" 30 "$BIN/llama-bench" "${models[@]}" -p 0 -n 128 -fa 1 -ngl 99 -r 3 -o json \
            > "$dir/llama-bench.json.tmp" 2> "$dir/llama-bench.log" && mv "$dir/llama-bench.json.tmp" "$dir/llama-bench.json"
    fi
    local temp draft_args=(--draft "$k" --drafter "$drafter"); [[ -n "$dr" ]] && draft_args+=(--draft "$dr")
    for temp in $TEMPS; do
        done_ok "$dir/localspec-t$temp.json" && continue
        run "localspec-$name-t$temp" 60 "${LOCALSPEC[@]}" bench --raw --target "$T" "${draft_args[@]}" \
            --temp "$temp" --max-tokens "$N_PREDICT" --repeat "$REPEAT" --warmup "$WARMUP" --seed "$SEED" \
            --ctx 4096 --json "$dir/localspec-t$temp.json" > "$dir/localspec-t$temp.log" 2>&1
    done
}
# llama NAME SPEC_ARGS...: llama-speculative-simple, every prompt per repetition and temperature, interleaved.
llama() {
    local name="$1"; shift
    local dir="$RES/$name/llama" rep temp p; mkdir -p "$dir"
    for rep in $(seq 1 "$LLAMA_REPS"); do
        for temp in $TEMPS; do
            for p in "${PROMPTS[@]}"; do
                local base; base="$dir/t$temp-host-r$rep-$(basename "$p" .txt)"
                grep -q "decoded" "$base.log" 2>/dev/null && continue
                local extra=(); [[ "$temp" != 0 ]] && extra=("${SAMPLING_EXTRA[@]}")
                run "llama-$name-$(basename "$base")" 12 "$BIN/llama-speculative-simple" -m "$T" -ngl 99 -fa on \
                    -c 4096 -n "$N_PREDICT" -f "$p" --seed "$SEED" --temp "$temp" "${extra[@]}" "$@" \
                    > "$base.out" 2> "$base.log" || { (( $? == 99 )) && return 0; }
            done
        done
    done
}

measure mtp mtp "$DRAFT_MAX"
done_ok "$RES/mtp/rollback-cost.json" || run rollback-cost 40 python3 "$REPO/bench/rollback_cost.py" --model "$T" \
    --k "$DRAFT_MAX" --reps 30 --json "$RES/mtp/rollback-cost.json" > "$RES/mtp/rollback-cost.log" 2>&1
llama mtp --spec-type draft-mtp --spec-draft-n-max "$DRAFT_MAX" --spec-draft-n-min 0 --spec-draft-p-min 0
if [[ "$DRAFT_PAIR" == 1 && -f "$D" ]]; then
    measure draft model 6 "$D"
    llama draft -md "$D" -ngld 99 --spec-type draft-simple --spec-draft-n-max 6 --spec-draft-n-min 0 \
        --spec-draft-p-min 0
fi

python3 "$HERE/summarize.py" "$RES" 2>&1 | tee "$RES/summary.txt"
cp "$RES/summary.txt" "$RES/summary.json" "$RES/run.log" "$RES/steps.tsv" "$OUT/" 2>/dev/null
tar -C "$RES" --exclude='*.gguf' -czf "$OUT/results.tar.gz" .
log "done in $(( $(date +%s) - T0 ))s"
