#!/usr/bin/env bash
# GPU benchmark, end to end (facts and reference numbers in docs/gpu.md). Run from the repo root:
#     bash bench/gpu/run.sh
# with bench/gpu/carry/ carried (make_archive.sh). Steps, each timed, logged, skippable and resumable:
#   1. in the background, write the synthetic pairs (bench/synthetic.py needs only numpy and gguf, so it starts
#      before llama.cpp exists): the card's pair (a Qwen3-32B-shaped Q4_K_M target, written once, and a
#      Qwen3-0.6B-shaped Q8_0 draft per acceptance level) and the old stand-in (Q4_0 32B target + 2-block draft of
#      its own width, per scale); meanwhile unpack and build llama.cpp (CUDA sm_90):
#      llama-bench, llama-speculative-simple, llama-server (for bench/gpu/concurrency.sh) and the shared libraries
#      that localspec loads too
#   2. per pair: llama-bench tg128 (target and draft); `localspec bench --against llama.cpp` at each temperature
#      (the product itself: warm-up, interleaved plain/speculative runs over its shipped prompt set, medians, greedy
#      check; then llama.cpp's llama-speculative-simple on the same prompt tokens, REPEAT times, with host and with
#      backend (--backend-sampling) sampling, the modes alternating; the ratio and llama.cpp's greedy text against
#      plain decoding's; all in one JSON)
#   3. bench/gpu/verify_widths.py on the first target of each family (verify cost per width, CUDA graph warmth) and
#      on the real pair's target, if any (batch vs single-token logits)
#   4. bench/gpu/summarize.py: medians, ratios, the greedy-fidelity comparison; summary.txt and summary.json
# Results live in $WORK/results (kept on a warm machine) and are copied to $OUT at the end: a call that runs out of
# budget leaves the rest to the next call on the same machine, which skips every step whose output exists.
# Environment (defaults in brackets; CARRY, WORK, OUT, BUDGET_S, CARRIED_PY, SIZE, CARD_SIZE, VOCAB, RERUN: harness.sh):
#   CARD_NOISES ["0.013 0.03"]   the card pair's draft noise: ~85% and ~70% acceptance at k = 6 (docs/gpu.md);
#                                pairs card-n<NOISE>, measured first
#   SCALES ["8e-5"]              the old stand-in's block scales (pairs s<SCALE>; "" = none): the comparison row
#   TEMPS ["0 0.7"]  N_PREDICT [256]  DRAFT_MAX [6]  REPEAT [5] (localspec bench --repeat)  WARMUP [10]
#   BENCH_REPS [3]               llama-bench repetitions
#   REAL_PAIR                    "NAME:TARGET.gguf:DRAFT.gguf", a real pair for the greedy-fidelity check
#                                (greedy only, REAL_REPEAT [1] runs of each loop)
#   CUDA [1]                     0 = CPU build (dry run on a machine without a GPU)
#   BUILD_SERVER [1]             0 = leave llama-server out of the builds (only concurrency.sh needs it)
#   PINNED_SERVER [BUILD_SERVER] 0 = leave it out of the pinned build only (concurrency.sh, when the newest
#                                llama.cpp's llama-server is the one compared: ~80 s less on an H100)
#   NEWEST [1]                   build the carried newest llama.cpp (llama.cpp-newest.tar.gz) into WORK/build-newest
#                                too, beside the pinned one; 0 = not (then LLAMA_YARDSTICK falls back to pinned)
#   LLAMA_YARDSTICK              newest|pinned: whose llama-speculative-simple `--against llama.cpp` runs
#                                (harness.sh; unset: newest where its build exists). Measurements wait for the newest
#                                build unless it is pinned; results already in WORK are kept: RERUN=1 to redo them
#   AGAINST_LENGTHS              llama.cpp's draft lengths to search (`--against-lengths`; unset: the preset's 2-6)
#   JOBS [nproc]  FORCE_BUILD  SKIP_BUILD  SKIP_WRITE  SKIP_LLAMA_BENCH  SKIP_LOCALSPEC  SKIP_WIDTHS
#   SKIP_LLAMA [0]               1 = `localspec bench` without --against llama.cpp
#   KEEP_MODELS [0]              keep each target after its pairs' runs (else deleted when the disk is short)
#   SWEEP                        draft lengths for `localspec bench --sweep` after each pair's runs (e.g. 4,6,8,12;
#                                empty = none): sweep-t<T>.json beside localspec-t<T>.json
#   LOCALSPEC_ARGS  WIDTHS_ARGS  extra arguments for `localspec bench` and verify_widths.py
set -uo pipefail
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"

SCALES="${SCALES-8e-5}"
CARD_NOISES="${CARD_NOISES-0.013 0.03}"
TEMPS="${TEMPS:-0 0.7}"
N_PREDICT="${N_PREDICT:-256}"
DRAFT_MAX="${DRAFT_MAX:-6}"
REPEAT="${REPEAT:-5}"
WARMUP="${WARMUP:-10}"
BENCH_REPS="${BENCH_REPS:-3}"
REAL_PAIR="${REAL_PAIR:-}"
REAL_REPEAT="${REAL_REPEAT:-1}"
CUDA="${CUDA:-1}"
JOBS="${JOBS:-$(nproc)}"
BUILD_SERVER="${BUILD_SERVER:-1}"
PINNED_SERVER="${PINNED_SERVER:-$BUILD_SERVER}"
KEEP_MODELS="${KEEP_MODELS:-0}"
SRC="$WORK/llama.cpp"
BUILD="$WORK/build"
NEWEST="${NEWEST:-1}"
SRC_NEWEST="$WORK/llama.cpp-newest"
BUILD_NEWEST="$WORK/build-newest"  # its tools land in BIN_NEWEST (harness.sh)
PYDIR="$WORK/pyenv"
results_in "$WORK/results"
STEPS="$RES/steps.tsv"
finish() {  # everything that comes back: the summary, the logs, all results in one archive
    python3 "$HERE/summarize.py" "$RES" 2>&1 | tee "$RES/summary.txt"
    pack results "$RES" "$RES/summary.txt" "$RES/summary.json"
}

snapshot_env "$RES/env.txt"
log "env: $(python3 --version 2>&1), $(nproc) cores, budget ${BUDGET_S}s, card noises: $CARD_NOISES, scales: $SCALES"

# -- Python: the carried packages (llama_cpp bindings, gguf, typer, ...) first on the path ------------------------
# Stamps hold the archive's checksum, not its mtime: each call copies the carry afresh (new mtimes), and a warm
# machine's unpacked tree and build must survive that.
sum_of() { sha256sum "$1" | cut -d' ' -f1; }
if [[ "$(cat "$PYDIR/.stamp" 2>/dev/null)" != "$(sum_of "$CARRY/py.tar.gz")" ]]; then
    rm -rf "$PYDIR" && mkdir -p "$PYDIR" && tar -C "$PYDIR" -xzf "$CARRY/py.tar.gz" \
        && sum_of "$CARRY/py.tar.gz" > "$PYDIR/.stamp"
fi
# CARRIED_PY=0 uses this machine's own packages instead (the CPU dry run: its Python need not be 3.12).
use_build
log "python packages: $(python3 -c 'import gguf, numpy, rich, typer; from importlib.metadata import version as v
print(*(f"{d} {v(d)}" for d in ("numpy", "gguf", "typer", "rich", "pydantic")), sep=", ")' 2>&1 | tail -1)"

# -- models: written in the background while llama.cpp builds ---------------------------------------------------
# One writer per file set: "card-target" (the card's target, shared by its levels), "card-n<NOISE>" (a draft),
# "s<SCALE>" (an old-stand-in pair). The writer renames a finished file into place, so one that exists is whole.
target_of() { stand_in_target "$1"; }
draft_of() { stand_in_draft "$1"; }
writer_files() {  # writer_files ID: the files the writer makes
    case "$1" in
        card-target) card_target ;;
        card-n*) card_draft "${1#card-n}" ;;
        s*) target_of "${1#s}"; draft_of "${1#s}" ;;
    esac
}
writer_gb() {  # the disk a writer needs, with margin
    case "$1" in
        card-target) [[ "$CARD_SIZE" == card32b ]] && echo 21 || echo 1 ;;
        card-n*) echo 1 ;;
        s*) [[ "$SIZE" == gpu32b ]] && echo 20 || echo 1 ;;
    esac
}
declare -A WRITER_PID=()
start_writer() {  # start_writer ID: background write unless its files exist
    local id="$1" f missing=0
    for f in $(writer_files "$id"); do [[ -f "$f" ]] || missing=1; done
    if (( ! missing )); then log "models of $id exist: reusing"; return 0; fi
    [[ -n "${WRITER_PID[$id]:-}" ]] && return 0
    [[ "${SKIP_WRITE:-0}" == 1 ]] && { log "SKIP_WRITE=1 but no models for $id"; return 1; }
    local args=()
    case "$id" in
        card-target) vocab_args "$CARD_SIZE"
                     args=(--size "$CARD_SIZE" --only target --prefix "$CARD_SIZE-") ;;
        card-n*) vocab_args "$CARD_SIZE"
                 args=(--size "$CARD_SIZE" --only draft --noise "${id#card-n}" --prefix "$CARD_SIZE-"
                       --draft-prefix "$CARD_SIZE-n${id#card-n}-") ;;
        s*) vocab_args "$SIZE"
            args=(--size "$SIZE" --scale "${id#s}" --prefix "$SIZE-s${id#s}-") ;;
    esac
    log "writing $id (background)"
    ( t=$(date +%s)
      nice -n 5 timeout "$(left)" python3 "$REPO/bench/synthetic.py" "${args[@]}" --out "$MODELS" "${VOCAB_ARGS[@]}" \
          > "$RES/write-$id.log" 2>&1
      rc=$?; printf 'write-%s\t%s\t%s\tbackground\n' "$id" "$rc" "$(( $(date +%s) - t ))" >> "$STEPS"; exit $rc
    ) &
    WRITER_PID[$id]=$!
}
wait_writers() {  # every pending writer finishes before any measurement: a 20 GB write would skew them
    local id rc
    for id in "${!WRITER_PID[@]}"; do
        log "waiting for the $id writer"
        wait "${WRITER_PID[$id]}"; rc=$?
        unset "WRITER_PID[$id]"
        (( rc == 0 )) || log "writer $id failed (rc $rc): $(tail -3 "$RES/write-$id.log")"
    done
}
free_gb() { df -Pk "$MODELS" | awk 'NR==2 {print int($4 / 1048576)}'; }

# The pairs, in measuring order: "NAME TARGET DRAFT WRITERS...". The card pair first (the new numbers), then the
# old stand-in (the comparison row).
read -r -a CARD_LIST <<< "$CARD_NOISES"
read -r -a SCALE_LIST <<< "$SCALES"
PAIRS=()
for n in "${CARD_LIST[@]}"; do PAIRS+=("card-n$n $(card_target) $(card_draft "$n") card-target card-n$n"); done
for s in "${SCALE_LIST[@]}"; do PAIRS+=("s$s $(target_of "$s") $(draft_of "$s") s$s"); done
# Writers start up front while the disk holds them (the page cache keeps the files warm: 128 GiB RAM there);
# the others start when their pair comes up, after the finished pairs' targets make room.
planned=0
for p in "${PAIRS[@]}"; do
    read -r -a f <<< "$p"
    for id in "${f[@]:3}"; do
        [[ -n "${WRITER_PID[$id]:-}" ]] && continue
        exists=1; for x in $(writer_files "$id"); do [[ -f "$x" ]] || exists=0; done
        (( exists )) && continue
        (( $(free_gb) > planned + $(writer_gb "$id") + 8 )) || continue 2
        planned=$(( planned + $(writer_gb "$id") ))
        start_writer "$id"
    done
done

# -- build ---------------------------------------------------------------------------------------------------------
# Two llama.cpp builds, with the same flags: WORK/build from the pinned source (the library localspec loads, and the
# tools of the same commit) and WORK/build-newest from the newest source carried (llama.cpp-newest.tar.gz), the
# yardstick that `--against llama.cpp` runs unless LLAMA_YARDSTICK=pinned (harness.sh's `yardstick`).
have_bins() { [[ -x "$BIN/llama-bench" && -x "$BIN/llama-speculative-simple" && -e "$BIN/libllama.so" ]]; }
# build_tree ARCHIVE SRC BUILD LOG_SUFFIX [CMAKE_FLAGS...]: ARCHIVE unpacked into SRC (again when it changed), then
# configured and its tools built in BUILD; logs RES/cmake-configure<SUFFIX>.log and RES/cmake-build<SUFFIX>.log.
build_tree() {
    set -e
    local archive="$1" src="$2" build="$3" suffix="$4"; shift 4
    if [[ "$(cat "$src/.stamp" 2>/dev/null)" != "$(sum_of "$archive")" ]]; then
        rm -rf "$src" "$build" && mkdir -p "$src"
        tar -C "$src" --strip-components=1 -xzf "$archive"
        sum_of "$archive" > "$src/.stamp"
    fi
    local flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF
        -DGGML_CCACHE=OFF "$@")
    if [[ "$CUDA" == 1 ]]; then
        flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
    else  # CPU dry run: a portable AVX2 build (native builds have crashed on AMX machines)
        flags+=(-DGGML_CUDA=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
    fi
    # (Re)configure a build dir from before llama-server was built (LLAMA_BUILD_SERVER=OFF in its cache).
    if [[ ! -f "$build/build.ninja" ]] || ! grep -q '^LLAMA_BUILD_SERVER:BOOL=ON' "$build/CMakeCache.txt"; then
        cmake -S "$src" -B "$build" "${flags[@]}" > "$RES/cmake-configure$suffix.log" 2>&1
    fi
    # libllama.so and libggml*.so are dependencies of the tools, so they land in its bin/ too. `-k 0`: a failing
    # llama-server (only concurrency.sh needs it) does not stop the other two from building.
    # libmtmd too: localspec's pictures (--mmproj) load it through llama-cpp-python (harness.sh: MTMD_CPP_LIB).
    local targets=(llama-bench llama-speculative-simple mtmd); [[ "${WITH_SERVER:-$BUILD_SERVER}" == 1 ]] && targets+=(llama-server)
    cmake --build "$build" --target "${targets[@]}" -j "$JOBS" -- -k 0 > "$RES/cmake-build$suffix.log" 2>&1
}
build() { WITH_SERVER="$PINNED_SERVER" build_tree "$CARRY/llama.cpp.tar.gz" "$SRC" "$BUILD" ""; }
# The newest source has no .git: its build number and commit (MANIFEST.txt) are given to CMake, so its tools'
# --version names them as an upstream build does ("version: 11549 (<commit>)").
build_newest() {
    build_tree "$CARRY/llama.cpp-newest.tar.gz" "$SRC_NEWEST" "$BUILD_NEWEST" "-newest" \
        -DLLAMA_BUILD_NUMBER="$(manifest newest-build 0)" -DLLAMA_BUILD_COMMIT="$(manifest newest-commit unknown)"
}
manifest() { local v; v="$(sed -n "s/^$1: //p" "$CARRY/MANIFEST.txt" 2>/dev/null | head -1)"; echo "${v:-$2}"; }
export -f build build_tree build_newest manifest sum_of
export SRC BUILD SRC_NEWEST BUILD_NEWEST CARRY CUDA JOBS RES BUILD_SERVER PINNED_SERVER
build_current() {  # build_current BIN SRC ARCHIVE [WITH_SERVER]
    [[ -x "$1/llama-bench" && -x "$1/llama-speculative-simple" && -e "$1/libllama.so" ]] \
        && { [[ "${4:-$BUILD_SERVER}" != 1 ]] || [[ -x "$1/llama-server" ]]; } \
        && [[ "$(cat "$2/.stamp" 2>/dev/null)" == "$(sum_of "$3")" ]]
}
if [[ "${SKIP_BUILD:-0}" == 1 ]] || { [[ "${FORCE_BUILD:-0}" != 1 ]] && build_current "$BIN" "$SRC" "$CARRY/llama.cpp.tar.gz" "$PINNED_SERVER"; }; then
    log "build: reusing $BIN"
elif ! run build 200 build; then
    log "build failed: $(tail -20 "$RES/cmake-build.log" 2>/dev/null || tail -20 "$RES/cmake-configure.log")"
fi
have_bins || { log "no llama.cpp binaries in $BIN: stopping"; wait; finish; exit 1; }
ls -l "$BIN" > "$RES/bin-ls.txt" 2>&1
# The newest llama.cpp, when carried (NEWEST=0: not built; measurements then compare with the pinned build).
WANT_NEWEST=0
[[ "$NEWEST" == 1 && -f "$CARRY/llama.cpp-newest.tar.gz" && "${LLAMA_YARDSTICK:-}" != pinned ]] && WANT_NEWEST=1
if (( WANT_NEWEST )); then
    if [[ "${SKIP_BUILD:-0}" == 1 ]] || { [[ "${FORCE_BUILD:-0}" != 1 ]] \
            && build_current "$BIN_NEWEST" "$SRC_NEWEST" "$CARRY/llama.cpp-newest.tar.gz"; }; then
        log "build-newest: reusing $BIN_NEWEST"
    elif ! run build-newest 200 build_newest; then
        log "build-newest failed or ran out of time: $(tail -5 "$RES/cmake-build-newest.log" 2>/dev/null \
            || tail -5 "$RES/cmake-configure-newest.log")"
    fi
fi
use_build  # now with the build's libllama
if (( WANT_NEWEST )) && [[ ! -x "$BIN_NEWEST/llama-speculative-simple" ]]; then
    # Never a silent fallback: results measured against the pinned build would be kept and skipped later.
    log "the newest llama.cpp is not built yet ($BIN_NEWEST): measuring nothing in this call; the next call" \
        "resumes its build (LLAMA_YARDSTICK=pinned or NEWEST=0 compares with the pinned build instead)"
    wait; finish; exit 0
fi
yardstick || { log "no llama.cpp to compare with: stopping"; wait; finish; exit 1; }
log "yardstick: $YARDSTICK llama.cpp ($("$YARDSTICK_BIN/llama-speculative-simple" --version 2>&1 | grep -m1 '^version:'))"

write_prompts "$RES/prompts" || { log "no prompts written: stopping"; finish; exit 1; }

NGL=99

# -- one pair ------------------------------------------------------------------------------------------------------
# against_need TEMP REPEAT: seconds one `localspec bench --against llama.cpp` needs on the H200: localspec's runs
# (~12 s a repetition at 256 tokens), then llama.cpp's first pass (every configuration once: each draft length, both
# draft sampling modes at T > 0, host and backend sampling; ~5 s a prompt, a model load each) and its two finalists'
# repetitions.
n_lengths() {  # n_lengths [LENGTHS]: how many draft lengths "2-6" or "2,4,6" names (the preset's 2-6 when unset)
    local part n=0
    for part in ${1//,/ }; do
        if [[ "$part" == *-* ]]; then n=$(( n + ${part#*-} - ${part%-*} + 1 )); else n=$(( n + 1 )); fi
    done
    echo $(( n > 0 ? n : 5 ))
}
against_need() {
    local configs=$(( $(n_lengths "${AGAINST_LENGTHS:-}") * 2 ))
    [[ "$1" != 0 ]] && configs=$(( configs * 2 ))
    (( configs <= 2 )) && configs=0  # two configurations or fewer: no first pass
    echo $(( 20 + 12 * $2 + 5 * 3 * configs + 5 * 3 * 2 * $2 ))
}
done_ok() { [[ -s "$1" ]]; }
measure_pair() {  # measure_pair NAME TARGET DRAFT TEMPS REPEAT: llama-bench, then `localspec bench --against`
    local name="$1" T="$2" DR="$3" temps="$4" repeat="$5"
    local D="$RES/$name"; mkdir -p "$D"
    if [[ "${SKIP_LLAMA_BENCH:-0}" != 1 ]] && ! done_ok "$D/llama-bench.json"; then
        # Plain decoding speed: tg only (-p 0), flash attention, all layers on the GPU; JSON on stdout.
        run "llama-bench-$name" 40 "$BIN/llama-bench" -m "$T" -m "$DR" -p 0 -n 128 -fa 1 -ngl $NGL \
            -r "$BENCH_REPS" -o json > "$D/llama-bench.json.tmp" 2> "$D/llama-bench.log" \
            && mv "$D/llama-bench.json.tmp" "$D/llama-bench.json"
    fi
    [[ "${SKIP_LOCALSPEC:-0}" == 1 ]] && return 0
    # The comparison is the product's own: llama.cpp's loop on the same prompt tokens after localspec's runs
    # (localspec.sessions.versus), each of its runs a process that loads the pair again: 5-8 s a prompt on the H200, two
    # sampling modes, three prompts; localspec's own runs ~12 s a repetition at 256 tokens.
    # The yardstick's tools (harness.sh's `yardstick`: the newest build unless LLAMA_YARDSTICK=pinned); its search
    # over draft lengths and draft sampling runs each configuration once, then the two fastest `repeat` times.
    # shellcheck disable=SC2086  # AGAINST_LENGTHS is one word
    local against=(--against llama.cpp --llama-bin "$YARDSTICK_BIN" ${AGAINST_LENGTHS:+--against-lengths "$AGAINST_LENGTHS"})
    local temp
    for temp in $temps; do
        local json="$D/localspec-t$temp.json"
        done_ok "$json" && continue
        local need; need=$(against_need "$temp" "$repeat")
        [[ "${SKIP_LLAMA:-0}" == 1 ]] && { against=(); need=$(( 20 + 12 * repeat )); }
        # Exit 1: its greedy check failed; 2: llama.cpp did not run (the JSON says why either way): keep going.
        # --raw: the prompts as plain text, as llama-speculative-simple reads them (no chat template there).
        # shellcheck disable=SC2086  # LOCALSPEC_ARGS is a word list on purpose
        run "localspec-$name-t$temp" "$need" "${LOCALSPEC[@]}" bench --raw --target "$T" --draft "$DR" \
            --temp "$temp" --draft "$DRAFT_MAX" --max-tokens "$N_PREDICT" --repeat "$repeat" --warmup "$WARMUP" \
            --seed "$SEED" --ctx 4096 --json "$json" "${against[@]}" ${LOCALSPEC_ARGS:-} \
            > "$D/localspec-t$temp.log" 2>&1
    done
    [[ -z "${SWEEP:-}" ]] && return 0
    # The draft-length sweep (the product's own `--sweep`): plain and each length interleaved, at each temperature.
    for temp in $temps; do
        local sweep_json="$D/sweep-t$temp.json"
        done_ok "$sweep_json" && continue
        # shellcheck disable=SC2086  # LOCALSPEC_ARGS is a word list on purpose
        run "sweep-$name-t$temp" $(( 20 + 8 * repeat * $(tr ',' ' ' <<< "$SWEEP" | wc -w) )) "${LOCALSPEC[@]}" bench \
            --raw --target "$T" --draft "$DR" --temp "$temp" --sweep "$SWEEP" --max-tokens "$N_PREDICT" \
            --repeat "$repeat" --warmup "$WARMUP" --seed "$SEED" --ctx 4096 --json "$sweep_json" ${LOCALSPEC_ARGS:-} \
            > "$D/sweep-t$temp.log" 2>&1
    done
}
widths() {  # widths NAME MODEL [ARGS]: verify cost per width, graph warmth, batch vs single logits
    local name="$1" model="$2"; shift 2
    local json="$RES/$name/verify-widths.json"
    [[ "${SKIP_WIDTHS:-0}" == 1 ]] || done_ok "$json" && return 0
    mkdir -p "$RES/$name"
    # shellcheck disable=SC2086  # WIDTHS_ARGS is a word list on purpose
    run "widths-$name" 45 python3 "$HERE/verify_widths.py" --model "$model" --json "$json" "$@" ${WIDTHS_ARGS:-} \
        > "$RES/$name/verify-widths.log" 2>&1
}

# -- the real pair first (small: its greedy-fidelity figures should not wait for the budget) ----------------------
if [[ -n "$REAL_PAIR" ]]; then
    IFS=: read -r real_name real_target real_draft <<< "$REAL_PAIR"
    if [[ -f "$real_target" && -f "$real_draft" ]]; then
        measure_pair "$real_name" "$real_target" "$real_draft" 0 "$REAL_REPEAT"
        widths "$real_name" "$real_target" --logits
    else
        log "REAL_PAIR: $real_target or $real_draft missing"
    fi
fi

# -- per synthetic pair -----------------------------------------------------------------------------------------
declare -A WIDTHS_DONE=()
for i in "${!PAIRS[@]}"; do
    read -r -a f <<< "${PAIRS[$i]}"
    name="${f[0]}" T="${f[1]}" DR="${f[2]}"
    for id in "${f[@]:3}"; do start_writer "$id"; done
    wait_writers
    [[ -f "$T" && -f "$DR" ]] || { log "no models for $name"; continue; }
    measure_pair "$name" "$T" "$DR" "$TEMPS" "$REPEAT"
    # The verify-width table once per target file: the card's Q4_K_M and the old Q4_0.
    [[ -z "${WIDTHS_DONE[$T]:-}" ]] && { WIDTHS_DONE[$T]=1; widths "$name" "$T"; }

    # Make room for the next pair's target unless it is written, the disk holds it, or a later pair needs this one.
    if (( i + 1 < ${#PAIRS[@]} )) && [[ "$KEEP_MODELS" != 1 ]]; then
        read -r -a nxt <<< "${PAIRS[$((i + 1))]}"
        if [[ "${nxt[1]}" != "$T" && ! -f "${nxt[1]}" ]] && (( $(free_gb) < 24 )); then
            later=0; for q in "${PAIRS[@]:$((i + 1))}"; do [[ "$q" == *" $T "* ]] && later=1; done
            (( later )) || { log "deleting $T to make room"; rm -f "$T"; }
        fi
    fi
done
wait  # any writer still running
finish
