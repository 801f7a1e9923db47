# shellcheck shell=bash
# The one harness of the GPU benchmarks: every bench/gpu/*.sh (and bench/lab's GPU probes) sources it first, from
# the repository root, and gets the same folders, time budget, log, steps, llama.cpp build, Python path, synthetic
# stand-in pairs and prompt files. A script sets what is its own, then calls `results_in DIR`.
# Shared environment (defaults in brackets):
#   CARRY [bench/gpu/carry]   make_archive.sh's output (the pinned llama.cpp source, Python packages, Qwen2 vocab)
#   WORK [bench/gpu/work]     source, build, models, results: kept on a warm machine, so a later call resumes
#   OUT [WORK/out]            what comes back from a call
#   BUDGET_S [570]            wall-clock budget: a step that would not fit is skipped and says so
#   CARRIED_PY [1]            0 = this machine's Python packages instead of the carried ones (a CPU dry run)
#   SIZE [gpu32b]             the old stand-in pair's preset (tiny: a CPU dry run)
#   CARD_SIZE [card32b]       the card pair's preset (card-tiny: a CPU dry run)
#   VOCAB                     tokenizer of the synthetic pairs ('' = synthetic.py's own); unset: the carried Qwen2
#                             vocabulary for the GPU-sized presets (gpu32b, card32b, hybrid27b, hybrid35b-a3b),
#                             synthetic.py's own for the rest
#   RERUN [0]                 1 = forget this script's earlier results
#   LLAMA_YARDSTICK           which llama.cpp `--against llama.cpp` runs: newest (WORK/build-newest, made by run.sh
#                             from the carried llama.cpp-newest.tar.gz) or pinned (WORK/build, the one localspec
#                             loads); unset: newest where that build exists, else pinned
T0=$(date +%s)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/bench/gpu"
CARRY="${CARRY:-$HERE/carry}"
WORK="${WORK:-$HERE/work}"
OUT="${OUT:-$WORK/out}"
BUDGET_S="${BUDGET_S:-570}"
SIZE="${SIZE:-gpu32b}"
CARD_SIZE="${CARD_SIZE:-card32b}"
BIN="$WORK/build/bin"
BIN_NEWEST="$WORK/build-newest/bin"  # the yardstick: the newest llama.cpp's tools (run.sh builds them)
MODELS="$WORK/models"
SEED=42
# localspec's CLI with llama.cpp imported before numpy (docs/gpu.md: the CUDA build segfaults the other way round)
LOCALSPEC=(python3 -c "import llama_cpp; from localspec.cli.app import main; main()")
exec 3>&1  # log lines go to the call's stdout even from inside a step whose output is redirected to a file

# results_in DIR: this script's results folder (RES; steps.tsv records each step), OUT made absolute.
results_in() {
    RES="$1"
    [[ "${RERUN:-0}" == 1 ]] && rm -rf "$RES"
    mkdir -p "$OUT" "$MODELS" "$RES"
    OUT="$(cd "$OUT" && pwd)"
    touch "$RES/steps.tsv"
}
log() { printf '[%4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*" | tee -a "$RES/run.log" >&3; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
# run NAME NEED_S CMD...: CMD if NEED_S seconds remain (capped at what remains), its rc recorded in steps.tsv.
# CMD may be a shell function (exported with `export -f`: it runs through bash -c, since timeout needs a program).
run() {
    local name="$1" need="$2"; shift 2
    local remain; remain=$(left)
    if (( remain < need )); then
        log "SKIP $name: ${remain}s left, needs ~${need}s"
        printf '%s\tskipped\t0\tbudget\n' "$name" >> "$RES/steps.tsv"
        return 99
    fi
    log "START $name (${remain}s left)"
    local t rc=0; t=$(date +%s)
    if declare -F "$1" > /dev/null; then
        timeout --kill-after=10 "$remain" bash -c '"$@"' _ "$@" || rc=$?
    else
        timeout --kill-after=10 "$remain" "$@" || rc=$?
    fi
    log "END $name rc=$rc $(( $(date +%s) - t ))s"
    printf '%s\t%s\t%s\t\n' "$name" "$rc" "$(( $(date +%s) - t ))" >> "$RES/steps.tsv"
    return $rc
}
# use_build: Python finds the carried packages (WORK/pyenv, unless CARRIED_PY=0) and localspec (REPO); llama_cpp
# loads WORK's llama.cpp build when there is one.
use_build() {
    if [[ "${CARRIED_PY:-1}" == 1 ]]; then export PYTHONPATH="$WORK/pyenv/py:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    else export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"; fi
    export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
    if [[ -e "$BIN/libllama.so" ]]; then
        export LLAMA_CPP_LIB_PATH="$BIN"
        export LD_LIBRARY_PATH="$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        [[ -e "$BIN/libmtmd.so" ]] && export MTMD_CPP_LIB="$BIN"  # (llama-cpp-python's image bindings: --mmproj)
    fi
}
# have_build [llama-server]: the shared libraries and llama.cpp's tools (and llama-server when asked) are built.
have_build() {
    [[ -e "$BIN/libllama.so" && -x "$BIN/llama-speculative-simple" ]] || return 1
    [[ "${1:-}" != llama-server || "${PINNED_SERVER:-1}" == 0 || -x "$BIN/llama-server" ]]
}
# ensure_build [llama-server]: build llama.cpp through run.sh (measuring nothing) unless WORK has it; then
# use_build. The scripts after run.sh on a warm machine find it there.
ensure_build() {
    # (NEWEST=1: the yardstick's build too, when it is missing)
    if ! have_build "${1:-}" || { [[ "${NEWEST:-0}" == 1 ]] && { [[ ! -x "$BIN_NEWEST/llama-speculative-simple" ]] \
            || [[ "${1:-}" == llama-server && ! -x "$BIN_NEWEST/llama-server" ]]; }; }; then
        # (NEWEST=0: the scripts that need a build need the pinned one; run.sh builds the yardstick)
        run prepare 330 env SCALES="" CARD_NOISES="" NEWEST="${NEWEST:-0}" OUT="$RES/prepare" WORK="$WORK" CARRY="$CARRY" \
            BUDGET_S="$(left)" bash "$HERE/run.sh" > "$RES/prepare.log" 2>&1
    fi
    use_build
    have_build || { log "no llama.cpp build in $BIN (see $RES/prepare.log)"; return 1; }
}
# yardstick: which llama.cpp's tools `localspec bench --against llama.cpp` runs (LLAMA_YARDSTICK: newest, the build
# of the carried newest source in WORK/build-newest; pinned, WORK/build, the llama.cpp localspec loads; unset:
# newest where that build exists, else pinned). Sets YARDSTICK (newest|pinned) and YARDSTICK_BIN, the folder for
# --llama-bin; 1 (and a log line) when the one asked for is not there. The newest build's tools are reached through
# a wrapper that puts their own libraries first: use_build's LD_LIBRARY_PATH names the pinned build's, which would
# win over the tools' RUNPATH.
yardstick() {
    local want="${LLAMA_YARDSTICK:-}"
    if [[ -z "$want" ]]; then
        [[ -x "$BIN_NEWEST/llama-speculative-simple" ]] && want=newest || want=pinned
    fi
    case "$want" in
        pinned) YARDSTICK=pinned YARDSTICK_BIN="$BIN" ;;
        newest)
            [[ -x "$BIN_NEWEST/llama-speculative-simple" ]] \
                || { log "LLAMA_YARDSTICK=newest: no llama-speculative-simple in $BIN_NEWEST"; return 1; }
            YARDSTICK=newest YARDSTICK_BIN="$WORK/yardstick-newest"
            mkdir -p "$YARDSTICK_BIN"
            local tool
            for tool in llama-speculative-simple llama-server; do  # (llama-server: concurrency.sh's)
                [[ -x "$BIN_NEWEST/$tool" ]] || continue
                # shellcheck disable=SC2016  # the wrapper expands LD_LIBRARY_PATH when it runs
                printf '#!/usr/bin/env bash\nexport LD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\nexec "%s" "$@"\n' \
                    "$BIN_NEWEST" "$BIN_NEWEST/$tool" > "$YARDSTICK_BIN/$tool"
                chmod +x "$YARDSTICK_BIN/$tool"
            done ;;
        *) log "LLAMA_YARDSTICK=$want: expected newest or pinned"; return 1 ;;
    esac
}
# snapshot_env FILE: the machine, its GPUs and the tools, for the record.
snapshot_env() {
    { date -u +%FT%TZ; uname -a; nproc; free -g; df -h "$WORK"
      nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version,clocks.max.sm --format=csv 2>&1 || true
      nvidia-smi topo -m 2>&1 || true
      nvcc --version 2>&1 | tail -2 || true
      cmake --version 2>&1 | head -1; python3 --version
      cat "$CARRY/MANIFEST.txt" 2>/dev/null
    } > "$1" 2>&1
}
# machine_tag: the GPU's model for bench/results' file names (DATE-MACHINE-TOPIC.csv: h100, h200, ...), else cpu.
machine_tag() {
    local tag
    tag="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
        | grep -oiE 'h100|h200|a100|l40s|[0-9]{4}' | head -1 | tr '[:upper:]' '[:lower:]')"
    echo "${tag:-cpu}"
}
# vocab_args PRESET: VOCAB_ARGS, the writer's --vocab for a synthetic pair of that preset (see VOCAB above).
vocab_args() {
    local vocab=""
    if [[ -n "${VOCAB+set}" ]]; then vocab="$VOCAB"
    elif [[ "$1" == gpu32b || "$1" == card32b || "$1" == hybrid27b || "$1" == hybrid35b-a3b ]]; then
        vocab="$CARRY/ggml-vocab-qwen2.gguf"
    fi
    VOCAB_ARGS=(); [[ -n "$vocab" ]] && VOCAB_ARGS=(--vocab "$vocab")
    return 0
}
# stand_in_pair SCALE: the old stand-in pair at a block scale (a Q4_0 32B target, a 2-block draft of its width),
# written unless it exists; prints "TARGET DRAFT".
stand_in_target() { echo "$MODELS/$SIZE-s$1-target.gguf"; }
stand_in_draft() { echo "$MODELS/$SIZE-s$1-draft.gguf"; }
stand_in_pair() {
    local s="$1"; vocab_args "$SIZE"
    if [[ ! -f "$(stand_in_target "$s")" || ! -f "$(stand_in_draft "$s")" ]]; then
        run "write-s$s" 60 python3 "$REPO/bench/synthetic.py" --size "$SIZE" --scale "$s" --out "$MODELS" \
            --prefix "$SIZE-s$s-" "${VOCAB_ARGS[@]}" > "$RES/write-s$s.log" 2>&1
    fi
    [[ -f "$(stand_in_target "$s")" && -f "$(stand_in_draft "$s")" ]]
}
# The 27B-shaped hybrid target with its MTP head (grid.sh, concurrency.sh's hybrid-mtp; hybrid.sh names it alike):
# HYBRID_SIZE [hybrid27b] (hybrid-tiny: a CPU dry run), MTP_NOISE [0.1] (the head's agreement knob), SCALE [8e-5].
HYBRID_SIZE="${HYBRID_SIZE:-hybrid27b}"
MTP_NOISE="${MTP_NOISE:-0.1}"
SCALE="${SCALE:-8e-5}"
hybrid_target() { echo "$MODELS/${1:-$HYBRID_SIZE}-n$MTP_NOISE-target.gguf"; }  # [PRESET]: another preset's
# await_carried_py: up to 2 minutes for the carried Python packages (run.sh unpacks them as its build starts), for
# a writer that runs beside the build (synthetic.py needs the carried gguf package).
await_carried_py() {
    [[ "${CARRIED_PY:-1}" == 0 ]] || for _ in $(seq 1 120); do [[ -f "$WORK/pyenv/.stamp" ]] && break; sleep 1; done
}
# write_hybrid_target LOG [PRESET]: hybrid_target (of PRESET: another preset's) written unless it exists
# (synthetic.py writes it whole or not at all; ~2 minutes at 27B's size), beside the build.
write_hybrid_target() {
    local size="${2:-$HYBRID_SIZE}"
    [[ -f "$(hybrid_target "$size")" ]] && return 0
    await_carried_py; use_build; vocab_args "$size"
    nice -n 5 python3 "$REPO/bench/synthetic.py" --size "$size" --only target --mtp-noise "$MTP_NOISE" \
        --scale "$SCALE" --out "$MODELS" --prefix "$size-n$MTP_NOISE-" "${VOCAB_ARGS[@]}" > "$1" 2>&1
}
# card_pair NOISE: the card's pair (a Qwen3-32B-shaped Q4_K_M target, written once, and a Qwen3-0.6B-shaped Q8_0
# draft at that noise), each written unless it exists (run.sh writes them in the background during its build).
card_target() { echo "$MODELS/$CARD_SIZE-target.gguf"; }
card_draft() { echo "$MODELS/$CARD_SIZE-n$1-draft.gguf"; }
card_pair() {
    local n="$1"; vocab_args "$CARD_SIZE"
    [[ -f "$(card_target)" ]] || run write-card-target 90 python3 "$REPO/bench/synthetic.py" --size "$CARD_SIZE" \
        --only target --prefix "$CARD_SIZE-" --out "$MODELS" "${VOCAB_ARGS[@]}" > "$RES/write-card-target.log" 2>&1
    [[ -f "$(card_draft "$n")" ]] || run "write-card-n$n" 30 python3 "$REPO/bench/synthetic.py" --size "$CARD_SIZE" \
        --only draft --noise "$n" --prefix "$CARD_SIZE-" --draft-prefix "$CARD_SIZE-n$n-" --out "$MODELS" \
        "${VOCAB_ARGS[@]}" > "$RES/write-card-n$n.log" 2>&1
    [[ -f "$(card_target)" && -f "$(card_draft "$n")" ]]
}
# assemble_real: REAL_TARGET [WORK/models/real.gguf], a real GGUF too big for one call's carry, made from its parts
# (REAL_PARTS, carried over several calls to a warm machine; checked against REAL_SHA256 when given) once all are here.
# Parts named *.xz.* are pieces of one xz-compressed file (split -b N FILE.xz FILE.xz.), unpacked as they are joined.
REAL_TARGET="${REAL_TARGET:-$MODELS/real.gguf}"
REAL_PARTS="${REAL_PARTS:-}"
assemble_real() {
    [[ -f "$REAL_TARGET" || -z "$REAL_PARTS" ]] && return 0
    local p; for p in $REAL_PARTS; do [[ -f "$p" ]] || { log "REAL_PARTS: not all here yet ($REAL_PARTS)"; return 0; }; done
    # shellcheck disable=SC2086  # REAL_PARTS is a word list on purpose
    if [[ "$REAL_PARTS" == *.xz.* ]]; then  # parts of an xz stream (~8% fewer bytes to carry): Python's lzma unpacks
        cat $REAL_PARTS | python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' \
            > "$REAL_TARGET.tmp"
    else
        cat $REAL_PARTS > "$REAL_TARGET.tmp"
    fi
    if [[ -n "${REAL_SHA256:-}" && "$(sha256sum "$REAL_TARGET.tmp" | cut -d' ' -f1)" != "$REAL_SHA256" ]]; then
        log "REAL_PARTS: sha256 differs from REAL_SHA256: not used"; rm -f "$REAL_TARGET.tmp"
    else
        mv "$REAL_TARGET.tmp" "$REAL_TARGET"
    fi
}
# speaks_pair SIZE: REAL_TARGET's model embedded in SIZE's shapes and quant types (bench/embed.py: a 32B-cost target
# and a 0.6B-cost draft that write real language), written unless it exists; 0 when both files are there.
# SPEAKS_DRAFT_FTYPE (unset: the draft is the model itself, agreeing ~9 tokens in 10): the draft embeds the model
# requantized to this llama.cpp type instead (Q2_K: ~2 in 3, as a real 0.6B draft of a 32B; its own file name).
speaks_target() { echo "$MODELS/speaks-$1-target.gguf"; }
speaks_draft() { echo "$MODELS/speaks-$1${SPEAKS_DRAFT_FTYPE:+-d${SPEAKS_DRAFT_FTYPE,,}}-draft.gguf"; }
speaks_pair() {
    local size="$1" only=() draft_source=() log="$RES/write-speaks-$1.log"
    assemble_real
    [[ -f "$(speaks_target "$size")" && -f "$(speaks_draft "$size")" ]] && return 0
    [[ -f "$REAL_TARGET" ]] || return 1
    [[ -f "$(speaks_target "$size")" ]] && only=(--only draft)
    [[ -f "$(speaks_draft "$size")" ]] && only=(--only target)
    if [[ -n "${SPEAKS_DRAFT_FTYPE:-}" && "${only[*]}" != "--only target" ]]; then
        local requantized="$MODELS/real-${SPEAKS_DRAFT_FTYPE,,}.gguf"
        [[ -f "$requantized" ]] || run "requantize-$SPEAKS_DRAFT_FTYPE" 120 python3 -c 'import sys, llama_cpp
from pathlib import Path
from localspec.llama.backend import quantize
quantize(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])' "$REAL_TARGET" "$requantized" "$SPEAKS_DRAFT_FTYPE" > "$log" 2>&1
        draft_source=(--draft-source "$requantized")
    fi
    # (one call for both files reads the source once)
    run "write-speaks-$size" 150 python3 "$REPO/bench/embed.py" --size "$size" --source "$REAL_TARGET" \
        "${draft_source[@]}" "${only[@]}" --out "$MODELS" --prefix "speaks-$size-" \
        --draft-prefix "$(basename "$(speaks_draft "$size")" draft.gguf)" >> "$log" 2>&1
    [[ -f "$(speaks_target "$size")" && -f "$(speaks_draft "$size")" ]]
}
# write_prompts DIR: the bench's shipped prompts as files for llama.cpp's -f, which drops one trailing newline: one
# is added, so both sides tokenize exactly the text localspec does. Also proves the bindings load the build.
write_prompts() {
    mkdir -p "$1"
    python3 - "$1" <<'EOF' 2>&1 | tee -a "$RES/run.log"
import llama_cpp  # noqa: I001  -- before numpy (docs/gpu.md)
import sys
from pathlib import Path

from localspec.sessions.bench import PROMPTS
from localspec.llama.backend import gpu_devices

print("llama_cpp", llama_cpp.__version__, "python", sys.version.split()[0], "GPUs:",
      ", ".join(f"{d.name} ({d.description})" for d in gpu_devices()) or "none")
for name, text in PROMPTS:
    (Path(sys.argv[1]) / f"{name}.txt").write_text(text + "\n")
print("prompts:", ", ".join(name for name, _ in PROMPTS))
EOF
    mapfile -t PROMPT_FILES < <(ls "$1"/*.txt 2>/dev/null)
    (( ${#PROMPT_FILES[@]} ))
}
# pack NAME DIR FILES...: what comes back: FILES (those that exist), the run log and the steps in OUT, and DIR as
# OUT/NAME.tar.gz.
pack() {
    local name="$1" dir="$2"; shift 2
    cp "$@" "$RES/run.log" "$RES/steps.tsv" "$OUT/" 2>/dev/null
    tar -C "$dir" -czf "$OUT/$name.tar.gz" .
    log "done in $(( $(date +%s) - T0 ))s"
}
# A server under test (serving benchmarks: concurrency.sh, agent_loop.sh), one at a time; a script that starts one
# traps EXIT to stop_server. wait_ready reads PORT and LOAD_S.
SERVER_PID=""
start_server() {  # start_server LOG CMD...: in the background, in a process group of its own
    local logf="$1"; shift
    setsid "$@" > "$logf" 2>&1 < /dev/null &
    SERVER_PID=$!
}
stop_server() {
    [[ -n "$SERVER_PID" ]] || return 0
    # SIGINT: both servers then cancel their requests, free the models and exit (localspec in ~1 s)
    kill -INT "$SERVER_PID" 2>/dev/null

    for _ in $(seq 1 60); do
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 1
    done
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        log "server $SERVER_PID still running after 60 s: killing its process group"
        kill -KILL -- "-$SERVER_PID" 2>/dev/null
    fi
    wait "$SERVER_PID" 2>/dev/null
    SERVER_PID=""
}
health_ok() {  # health_ok URL [BODY]: 0 when GET URL answers 200 (both servers: 503 while loading); its body to BODY
    python3 - "$1" "${2:-}" <<'EOF'
import sys
import urllib.request

try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        body = r.read()
        if sys.argv[2]:
            with open(sys.argv[2], "wb") as f:
                f.write(body)
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
EOF
}
wait_ready() {  # wait_ready LOG [HEALTH]: until /health is 200 (its body kept in HEALTH), the server exits,
    local logf="$1" health="${2:-}" t; t=$(date +%s)  # LOAD_S passes or the budget ends
    while (( $(date +%s) - t < LOAD_S && $(left) > 5 )); do
        kill -0 "$SERVER_PID" 2>/dev/null || { log "server exited while loading: $(tail -3 "$logf")"; return 1; }
        health_ok "http://127.0.0.1:$PORT/health" "$health" && { log "ready in $(( $(date +%s) - t ))s"; return 0; }
        sleep 1
    done
    log "server not ready after $(( $(date +%s) - t ))s: $(tail -3 "$logf")"
    return 1
}
