#!/usr/bin/env bash
# GPU benchmark, end to end in one device call (issue #5; facts in ../shared/GPU.md). Run from the repo root:
#     bash bench/gpu/run.sh
# with bench/gpu/carry/ carried (make_archive.sh). Steps, each timed, logged and skippable:
#   1. unpack the trimmed llama.cpp and build llama-bench, llama-speculative-simple and the shared libs (CUDA sm_90);
#      meanwhile, in the background, write the synthetic 32B target + 2-block draft for every scale
#   2. per scale: llama-bench tg (target and draft), llama-speculative-simple at each temperature,
#      then bench/gpu/localspec_bench.py (localspec plain, speculative, adaptive, k sweep) on the same files
#   3. bench/gpu/summarize.py: JSON under $OUT and a table with the ratios
# Environment (defaults in brackets):
#   OUT [bench/gpu/work/out]   results (the device call provides it)
#   WORK [bench/gpu/work]      source, build, models (git-ignored: a warm machine keeps it between calls)
#   SCALES ["8e-5 1.2e-4"]     synthetic block scales (GPU.md: ~74% and ~66% acceptance; 8e-5 first: its
#                              llama.cpp reference numbers are in GPU.md)
#   TEMPS ["0 0.7"]  N_PREDICT [256]  DRAFT_MAX [6]  BENCH_REPS [3]  SEED [42]  PROMPT_FILE [bench/gpu/prompt.txt]
#   SIZE [gpu32b]              synthetic preset (tiny: CPU dry run); VOCAB [carry/ggml-vocab-qwen2.gguf]
#   CUDA [1]                   0 = CPU build (dry run on a machine without a GPU)
#   JOBS [nproc]               build parallelism; FORCE_BUILD=1 rebuilds even if the binaries exist
#   SKIP_BUILD SKIP_WRITE SKIP_LLAMA_BENCH SKIP_SPEC SKIP_LOCALSPEC  =1 to skip a step (SKIP_WRITE reuses files)
#   KEEP_MODELS [0]            keep each scale's 17 GB target after its runs (else deleted when disk is short)
#   BUDGET_S [570]             wall-clock budget: steps that would not fit are skipped and say so
#   LOCALSPEC_ARGS             extra arguments for localspec_bench.py (e.g. "--reps 2 --sweep 4,6");
#   LOCALSPEC_NEED_S [90]      seconds the localspec step needs to be started (else skipped for the budget)
set -uo pipefail

T0=$(date +%s)
REPO="$(pwd)"
HERE="$REPO/bench/gpu"
CARRY="$HERE/carry"
WORK="${WORK:-$HERE/work}"
OUT="${OUT:-$WORK/out}"
SCALES="${SCALES:-8e-5 1.2e-4}"
TEMPS="${TEMPS:-0 0.7}"
N_PREDICT="${N_PREDICT:-256}"
DRAFT_MAX="${DRAFT_MAX:-6}"
BENCH_REPS="${BENCH_REPS:-3}"
SEED="${SEED:-42}"
PROMPT_FILE="${PROMPT_FILE:-$HERE/prompt.txt}"
SIZE="${SIZE:-gpu32b}"
CUDA="${CUDA:-1}"
JOBS="${JOBS:-$(nproc)}"
BUDGET_S="${BUDGET_S:-570}"
KEEP_MODELS="${KEEP_MODELS:-0}"
if [[ "$SIZE" == gpu32b ]]; then VOCAB="${VOCAB:-$CARRY/ggml-vocab-qwen2.gguf}"; else VOCAB="${VOCAB:-}"; fi
SRC="$WORK/llama.cpp"
BUILD="$WORK/build"
BIN="$BUILD/bin"
MODELS="$WORK/models"
PYDIR="$WORK/pyenv"
mkdir -p "$OUT" "$WORK" "$MODELS"
OUT="$(cd "$OUT" && pwd)"
STEPS="$OUT/steps.tsv"
: > "$STEPS"

exec 3>&1  # log lines go to the call's stdout even from inside a step whose output is redirected to a file
log() { printf '[%4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*" | tee -a "$OUT/run.log" >&3; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
# step NAME NEED_S CMD...: run CMD if NEED_S seconds remain, capped at what remains; record rc and time.
# CMD may be a shell function defined here (exported and run through bash -c, since timeout needs a program).
step() {
    local name="$1" need="$2"; shift 2
    local remain; remain=$(left)
    if (( remain < need )); then
        log "SKIP $name: ${remain}s left, needs ~${need}s"
        printf '%s\tskipped\t0\tbudget\n' "$name" >> "$STEPS"
        return 99
    fi
    log "START $name (${remain}s left)"
    local t=$(date +%s) rc=0
    if declare -F "$1" > /dev/null; then
        timeout --kill-after=10 "$remain" bash -c '"$@"' _ "$@" || rc=$?
    else
        timeout --kill-after=10 "$remain" "$@" || rc=$?
    fi
    local dt=$(( $(date +%s) - t ))
    log "END $name rc=$rc ${dt}s"
    printf '%s\t%s\t%s\t\n' "$name" "$rc" "$dt" >> "$STEPS"
    return $rc
}

# -- environment -------------------------------------------------------------------------------------------------
{
    date -u +%FT%TZ; uname -a; nproc; free -g; df -h "$WORK"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || true
    nvcc --version 2>&1 | tail -2 || true
    cmake --version | head -1; python3 --version
    cat "$CARRY/MANIFEST.txt" 2>/dev/null
} > "$OUT/env.txt" 2>&1
log "env: $(python3 --version 2>&1), $(nproc) cores, budget ${BUDGET_S}s, scales: $SCALES"

# -- Python: carried packages (llama_cpp, gguf, ...) + fallbacks the image lacks -----------------------------------
# Stamps hold the archive's checksum, not its mtime: each call copies the carry afresh (new mtimes), and a warm
# machine's unpacked tree and build must survive that.
sum_of() { sha256sum "$1" | cut -d' ' -f1; }
if [[ "$(cat "$PYDIR/.stamp" 2>/dev/null)" != "$(sum_of "$CARRY/py.tar.gz")" ]]; then
    rm -rf "$PYDIR" && mkdir -p "$PYDIR/extra" && tar -C "$PYDIR" -xzf "$CARRY/py.tar.gz" \
        && sum_of "$CARRY/py.tar.gz" > "$PYDIR/.stamp"
fi
# A fallback joins the path only if the image cannot import it: we never shadow the image's own packages.
for pkg in "$PYDIR"/pyfallback/*; do
    name="$(basename "$pkg" .py)"
    if [[ ! -e "$PYDIR/extra/$(basename "$pkg")" ]] && ! python3 -c "import $name" 2>/dev/null; then
        ln -s "$pkg" "$PYDIR/extra/$(basename "$pkg")"
        log "python: using carried $name"
    fi
done
export PYTHONPATH="$PYDIR/py:$PYDIR/extra:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

# -- models: written in the background while llama.cpp builds ---------------------------------------------------
# Files are named by preset and scale; the writer renames a finished file into place, so one that exists is whole.
target_of() { echo "$MODELS/$SIZE-s$1-target.gguf"; }
draft_of() { echo "$MODELS/$SIZE-s$1-draft.gguf"; }
declare -A WRITER_PID=()
start_writer() {  # start_writer SCALE: background write unless the pair exists (and SKIP_WRITE or complete)
    local s="$1"
    if [[ -f "$(target_of "$s")" && -f "$(draft_of "$s")" ]]; then
        log "models for scale $s exist: reusing"; return 0
    fi
    [[ "${SKIP_WRITE:-0}" == 1 ]] && { log "SKIP_WRITE=1 but no models for scale $s"; return 1; }
    local vocab_arg=(); [[ -n "$VOCAB" ]] && vocab_arg=(--vocab "$VOCAB")
    log "writing $SIZE pair at scale $s (background)"
    ( t=$(date +%s)
      nice -n 5 timeout "$(left)" python3 -m localspec.synthetic --size "$SIZE" --scale "$s" --out "$MODELS" \
          --prefix "$SIZE-s$s-" \
          "${vocab_arg[@]}" > "$OUT/write-s$s.log" 2>&1
      rc=$?; printf 'write-s%s\t%s\t%s\tbackground\n' "$s" "$rc" "$(( $(date +%s) - t ))" >> "$STEPS"; exit $rc
    ) &
    WRITER_PID[$s]=$!
}
wait_writer() {
    local s="$1" pid="${WRITER_PID[$1]:-}"
    [[ -z "$pid" ]] && return 0
    log "waiting for the scale $s writer"
    wait "$pid"; local rc=$?
    unset "WRITER_PID[$s]"
    (( rc == 0 )) || log "writer for scale $s failed (rc $rc): $(tail -3 "$OUT/write-s$s.log")"
    return $rc
}
free_gb() { df -Pk "$MODELS" | awk 'NR==2 {print int($4 / 1048576)}'; }
need_gb() { [[ "$SIZE" == gpu32b ]] && echo 20 || echo 1; }  # one pair, with margin

# Write every scale up front when the disk holds them all (page cache keeps them warm: 128 GiB RAM);
# otherwise write the first now and each next one after the previous target is deleted.
read -r -a SCALE_LIST <<< "$SCALES"
n_scales=${#SCALE_LIST[@]}
if (( $(free_gb) > n_scales * $(need_gb) + 8 )); then PREWRITE_ALL=1; else PREWRITE_ALL=0; fi
for s in "${SCALE_LIST[@]}"; do
    start_writer "$s"
    (( PREWRITE_ALL )) || break
done

# -- build ---------------------------------------------------------------------------------------------------------
have_bins() { [[ -x "$BIN/llama-bench" && -x "$BIN/llama-speculative-simple" && -e "$BIN/libllama.so" ]]; }
build() {
    set -e
    if [[ "$(cat "$SRC/.stamp" 2>/dev/null)" != "$(sum_of "$CARRY/llama.cpp.tar.gz")" ]]; then
        rm -rf "$SRC" "$BUILD" && mkdir -p "$SRC"
        tar -C "$SRC" --strip-components=1 -xzf "$CARRY/llama.cpp.tar.gz"
        sum_of "$CARRY/llama.cpp.tar.gz" > "$SRC/.stamp"
    fi
    local flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF
        -DGGML_CCACHE=OFF)
    if [[ "$CUDA" == 1 ]]; then
        flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
    else  # this CPU machine faults on AMX: never a native build here
        flags+=(-DGGML_CUDA=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
    fi
    [[ -f "$BUILD/build.ninja" ]] || cmake -S "$SRC" -B "$BUILD" "${flags[@]}" > "$OUT/cmake-configure.log" 2>&1
    # libllama.so and libggml*.so are dependencies of both tools, so they land in $BIN too.
    cmake --build "$BUILD" --target llama-bench llama-speculative-simple -j "$JOBS" > "$OUT/cmake-build.log" 2>&1
}
export -f build sum_of
export SRC BUILD CARRY CUDA JOBS OUT
build_current() { have_bins && [[ "$(cat "$SRC/.stamp" 2>/dev/null)" == "$(sum_of "$CARRY/llama.cpp.tar.gz")" ]]; }
if [[ "${SKIP_BUILD:-0}" == 1 ]] || { [[ "${FORCE_BUILD:-0}" != 1 ]] && build_current; }; then
    log "build: reusing $BIN"
elif ! step build 200 build; then
    log "build failed: $(tail -20 "$OUT/cmake-build.log" 2>/dev/null || tail -20 "$OUT/cmake-configure.log")"
fi
have_bins || { log "no llama.cpp binaries in $BIN: stopping"; wait; exit 1; }
ls -l "$BIN" > "$OUT/bin-ls.txt" 2>&1
export LLAMA_CPP_LIB_PATH="$BIN"
export LD_LIBRARY_PATH="$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# llama_cpp must be imported before numpy there (GPU.md); this also proves the bindings match the build.
python3 -c "import llama_cpp, sys; print('llama_cpp', llama_cpp.__version__, 'gpu offload:',
bool(llama_cpp.llama_supports_gpu_offload()), 'python', sys.version.split()[0])" 2>&1 | tee -a "$OUT/run.log"

NGL=99
SAMPLING_EXTRA=(--top-k 40 --top-p 0.9 --min-p 0)  # the preset `default` (temperature 0.7, top-k 40, top-p 0.9)

# -- per scale -----------------------------------------------------------------------------------------------------
for i in "${!SCALE_LIST[@]}"; do
    s="${SCALE_LIST[$i]}"
    D="$OUT/s$s"; mkdir -p "$D"
    [[ -n "${WRITER_PID[$s]:-}" ]] || start_writer "$s"
    # Every pending writer finishes before any measurement: a 17 GB write in the background would skew them.
    for w in "${!WRITER_PID[@]}"; do wait_writer "$w"; done
    T="$(target_of "$s")"; DR="$(draft_of "$s")"
    [[ -f "$T" && -f "$DR" ]] || { log "no models for scale $s"; continue; }

    if [[ "${SKIP_LLAMA_BENCH:-0}" != 1 ]]; then
        # Plain decoding speed: tg only (-p 0), flash attention, all layers on the GPU; JSON on stdout.
        step "llama-bench-s$s" 40 "$BIN/llama-bench" -m "$T" -m "$DR" -p 0 -n 128 -fa 1 -ngl $NGL \
            -r "$BENCH_REPS" -o json > "$D/llama-bench.json" 2> "$D/llama-bench.log"
    fi

    if [[ "${SKIP_SPEC:-0}" != 1 ]]; then
        for temp in $TEMPS; do
            extra=(); [[ "$temp" != 0 ]] && extra=("${SAMPLING_EXTRA[@]}")
            step "spec-simple-s$s-t$temp" 30 "$BIN/llama-speculative-simple" -m "$T" -md "$DR" -ngl $NGL -ngld $NGL \
                -fa on -c 4096 -n "$N_PREDICT" -f "$PROMPT_FILE" --seed "$SEED" --temp "$temp" "${extra[@]}" \
                --spec-type draft-simple --spec-draft-n-max "$DRAFT_MAX" --spec-draft-n-min 0 --spec-draft-p-min 0 \
                > "$D/spec-simple-t$temp.log" 2>&1
        done
    fi

    if [[ "${SKIP_LOCALSPEC:-0}" != 1 ]]; then
        # localspec's side; the script imports llama_cpp before numpy (GPU.md: the other order segfaults there).
        # shellcheck disable=SC2086  # LOCALSPEC_ARGS is a word list on purpose
        step "localspec-s$s" "${LOCALSPEC_NEED_S:-90}" python3 "$HERE/localspec_bench.py" --target "$T" --draft "$DR" \
            --prompt-file "$PROMPT_FILE" --n-predict "$N_PREDICT" --draft-max "$DRAFT_MAX" \
            --temps "${TEMPS// /,}" --seed "$SEED" --json "$D/localspec.json" ${LOCALSPEC_ARGS:-} \
            > "$D/localspec.log" 2>&1
    fi

    # Make room for the next scale's target unless it is already written or the disk holds both.
    if (( i + 1 < n_scales )) && [[ "$KEEP_MODELS" != 1 && -z "${WRITER_PID[${SCALE_LIST[$((i + 1))]}]:-}" ]] \
        && (( $(free_gb) < $(need_gb) + 4 )); then
        log "deleting $T to make room"; rm -f "$T"
    fi
done
wait  # any writer still running

# -- summary -------------------------------------------------------------------------------------------------------
python3 "$HERE/summarize.py" "$OUT" --scales "$SCALES" --temps "$TEMPS" 2>&1 | tee "$OUT/summary.txt"
log "done in $(( $(date +%s) - T0 ))s"
