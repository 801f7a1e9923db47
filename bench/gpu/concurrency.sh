#!/usr/bin/env bash
# Many clients at once: `localspec serve --parallel N` plain batched (k = 0) and speculative, against
# llama.cpp's `llama-server -np N` with the same draft model and draft length, all driven by the same client
# (bench/concurrency.py: streaming openai clients, the same prompts and request bodies) at 1, 4, 8, 16 concurrent
# clients. Device call on one GPU (kind nvidia-h200), carry ["bench/gpu/carry"] (make_archive.sh), from the repo
# root:
#     bash bench/gpu/concurrency.sh
# 1. Prepare what this machine lacks (a warm machine keeps $WORK; harness.sh): llama.cpp's CUDA build through run.sh
#    (it builds llama-server too), then the pairs of PAIRS (bench/synthetic.py, the files run.sh writes).
# 2. Per pair and per configuration of CONFIGS, one server is started, waited for (/health = 200), measured at
#    every temperature of TEMPS (the temperature is a request field, so one server serves both) and stopped:
#      k0     localspec serve --draft DRAFT --draft 0 --parallel P   plain batched decoding (the draft is loaded
#                                                                     but not used: the same memory as spec)
#      spec   localspec serve --draft DRAFT --draft K --parallel P   speculative, draft length K (the engine may
#                                                                     choose shorter rounds under load)
#      llama  llama-server -md DRAFT --spec-type draft-simple --spec-draft-n-max K --spec-draft-n-min 0
#             --spec-draft-p-min 0 -np P -c P*CTX -fa on -ngl 99 -ngld 99      its draft's argmax, sample-and-match
#      llamaprob  the same with --spec-draft-sampling probabilistic: llama.cpp's rejection sampling (T > 0 only;
#             at T = 0 it is llama's loop)
#      llamaplain llama-server -np P -c P*CTX -fa on -ngl 99 without a draft: its plain batched decoding
#    llama-server is the yardstick's (the newest llama.cpp's build, harness.sh's `yardstick`) where it is built,
#    else the pinned one's (versions.txt says which); the summary compares localspec with llama-server's best
#    configuration at each concurrency. The client sends the same body to all of them: temperature, max_tokens, seed 42, and top_k 40, top_p 0.9,
#    min_p 0 (localspec's preset `default`; llama-server's own defaults differ: top_p 0.95, min_p 0.05).
# 3. bench/gpu/concurrency_summary.py: aggregate and per-request tok/s per concurrency, the ratios, the crossover
#    where speculative falls below k = 0 (summary.md, summary.json).
# Every result is kept in $WORK/concurrency; one that exists is not measured again, so a call that runs out of
# budget leaves the rest to the next call on the same (warm) machine.
# Environment (defaults in brackets; CARRY, WORK, OUT, BUDGET_S, SIZE, VOCAB, RERUN: harness.sh):
#   PAIRS ["card-n0.013"]     card-n<NOISE>: the card's pair (Qwen3-32B-shaped Q4_K_M target, 0.6B-shaped Q8_0
#                             draft) at that draft noise (0.013: ~85% acceptance, 0.03: ~70%); s<SCALE>: the old
#                             stand-in (Q4_0 32B target, 2-block draft) at that block scale (8e-5, 1.2e-4)
#                             speaks-<SIZE>: a real small model (REAL_TARGET, or REAL_PARTS: harness.sh) embedded
#                             in SIZE's shapes (card32b) by bench/embed.py: real language, so real batch margins
#                             hybrid-mtp: the Qwen3.5/3.6-27B-shaped hybrid target drafting with its own MTP head
#                             (harness.sh's hybrid_target: HYBRID_SIZE, MTP_NOISE, SCALE), no draft model:
#                             localspec serve --drafter mtp, llama-server --spec-type draft-mtp (DRAFT_MAX: try 3,
#                             llama.cpp's default for it); written beside the build
#   TEMPS ["0 0.7"]  CONFIGS ["k0 spec llama llamaprob llamaplain"]  CLIENTS ["1,4,8,16"]  PARALLEL [16] (slots of every server)
#   REQUESTS [2] (requests per client per level)  N_PREDICT [256] (max_tokens)  DRAFT_MAX [6]
#   CTX [2048]                context tokens per slot: llama-server gets -c PARALLEL*CTX
#   LOCALSPEC_CTX [CTX]       `localspec serve --ctx`: per slot, as --parallel's help says
#   PORT [18080]  LOAD_S [240] (seconds a server may take to become ready)
#   CLIENT_S [90]             seconds one client run (every level at one T) is given room for in the budget
#   NEWEST [1]                build the newest llama.cpp (the yardstick) too: its llama-server is the one compared
#   MMPROJ [""]               pictures: "gemma3" (Gemma 3's projector at its real dimensions, 256 tokens a picture),
#                             "qwen-vl" (Qwen3.5/3.6's vision tower at its real dimensions, M-RoPE: 784 tokens for
#                             the 896-pixel picture; for hybrid-mtp) or "tiny" (16 tokens), written for the pair's
#                             target by bench/synthetic.py --projector;
#                             every server loads it (--mmproj) and every request sends one 896 x 896 PNG before its
#                             text (bench/concurrency.py --image); results go to <pair>+<MMPROJ>/
#   LOCALSPEC_ARGS  LLAMA_SERVER_ARGS  CLIENT_ARGS   extra arguments (word lists) for each
set -uo pipefail
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"

PAIRS="${PAIRS:-card-n0.013}"
TEMPS="${TEMPS:-0 0.7}"
CONFIGS="${CONFIGS:-k0 spec llama llamaprob llamaplain}"
CLIENTS="${CLIENTS:-1,4,8,16}"
PARALLEL="${PARALLEL:-16}"
REQUESTS="${REQUESTS:-2}"
N_PREDICT="${N_PREDICT:-256}"
DRAFT_MAX="${DRAFT_MAX:-6}"
CTX="${CTX:-2048}"
LOCALSPEC_CTX="${LOCALSPEC_CTX:-$CTX}"
PORT="${PORT:-18080}"
LOAD_S="${LOAD_S:-240}"
CLIENT_S="${CLIENT_S:-90}"
results_in "$WORK/concurrency"
finish() {
    stop_server
    python3 "$HERE/concurrency_summary.py" "$RES" --json "$RES/summary.json" 2>&1 | tee "$RES/summary.md"
    pack concurrency-results "$RES" "$RES/summary.md" "$RES/summary.json"
}

trap 'stop_server' EXIT  # the server under test (harness.sh's start_server) is always stopped
trap 'log "terminated"; exit 143' TERM INT

snapshot_env "$RES/env.txt"

# -- 1. prepare: the build (run.sh, measuring nothing), the carried Python packages, the pairs ----------------------
export NEWEST="${NEWEST:-1}"  # the yardstick's build too (its llama-server has the probabilistic draft)
# Only the compared llama-server is built: the newest tree's, where it is built (run.sh's PINNED_SERVER)
[[ "$NEWEST" == 1 && "${LLAMA_YARDSTICK:-}" != pinned ]] && export PINNED_SERVER="${PINNED_SERVER:-0}"
writer=""  # the hybrid target is written beside the build (~2 minutes at 27B's size)
[[ " $PAIRS " != *" hybrid-mtp "* ]] || { write_hybrid_target "$RES/write-hybrid.log" & writer=$!; }
ensure_build llama-server || { finish; exit 1; }
[[ -z "$writer" ]] || wait "$writer"
# llama-server: the yardstick's (newest) where it is built, else the pinned build's; never one silently for the other.
LLAMA_SERVER="$BIN/llama-server"
if yardstick && [[ "$YARDSTICK" == newest ]]; then
    if [[ -x "$YARDSTICK_BIN/llama-server" ]]; then LLAMA_SERVER="$YARDSTICK_BIN/llama-server"
    else log "the newest llama.cpp has no llama-server ($BIN_NEWEST): the llama rows stay empty"; LLAMA_SERVER=""; fi
fi
[[ -n "$LLAMA_SERVER" && -x "$LLAMA_SERVER" ]] || { log "no llama-server (see $WORK/results/cmake-build*.log): its rows stay empty"; LLAMA_SERVER=""; }
export COLUMNS=200  # rich wraps serve's help and status lines at 80 columns when not on a terminal
pair_files() {  # pair_files NAME: "TARGET DRAFT" of a PAIRS entry, written unless they exist
    case "$1" in
        card-n*) card_pair "${1#card-n}" && echo "$(card_target) $(card_draft "${1#card-n}")" ;;
        speaks-*) speaks_pair "${1#speaks-}" && echo "$(speaks_target "${1#speaks-}") $(speaks_draft "${1#speaks-}")" ;;
        hybrid-mtp) [[ -f "$(hybrid_target)" ]] && echo "$(hybrid_target) -" ;;  # (no draft model: "-")
        s*) stand_in_pair "${1#s}" && echo "$(stand_in_target "${1#s}") $(stand_in_draft "${1#s}")" ;;
        *) log "unknown pair $1 (card-n<NOISE>, speaks-<SIZE>, s<SCALE> or hybrid-mtp)"; return 1 ;;
    esac
}
declare -A FILES=()
for pair in $PAIRS; do FILES[$pair]="$(pair_files "$pair")"; done
MMPROJ="${MMPROJ:-}"
PROJECTOR=() PICTURE=()  # the servers' --mmproj and the client's --image, with MMPROJ
picture_files() {  # picture_files SIZE: sets PROJECTOR and PICTURE for a pair whose target has synthetic.py's SIZE
    local size="$1"
    local mm="$MODELS/$size-$MMPROJ-mmproj.gguf" png="$MODELS/picture-896.png"
    [[ -f "$mm" ]] || run "write-mmproj-$size-$MMPROJ" 120 python3 "$REPO/bench/synthetic.py" --size "$size" \
        --projector "$MMPROJ" --prefix "$size-$MMPROJ-" --out "$MODELS" > "$RES/write-mmproj.log" 2>&1
    [[ -f "$png" ]] || python3 - "$png" <<'PY'
import random, struct, sys, zlib
rows = random.Random(7)
raw = b"".join(b"\0" + bytes(rows.randrange(256) for _ in range(3 * 896)) for _ in range(896))
chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
open(sys.argv[1], "wb").write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 896, 896, 8, 2, 0, 0, 0))
                              + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
PY
    [[ -f "$mm" && -f "$png" ]] || return 1
    PROJECTOR=(--mmproj "$mm") PICTURE=(--image "$png")
}

{ "${LOCALSPEC[@]}" serve --help; echo "llama-server: ${LLAMA_SERVER:-none} (${YARDSTICK:-pinned})"
  [[ -n "$LLAMA_SERVER" ]] && "$LLAMA_SERVER" --version; } > "$RES/versions.txt" 2>&1
python3 -c "import openai; print('openai', openai.__version__)" 2>&1 | tee -a "$RES/run.log"

# -- 2. measure ----------------------------------------------------------------------------------------------------
SERVER_CMD=()
server_cmd() {  # server_cmd CONFIG TARGET DRAFT: sets SERVER_CMD to that configuration's server command line
    local config="$1" T="$2" D="$3" extra=()
    # who drafts: the draft model D, or (D = "-") the target's own MTP head
    local ours=(--draft "$D") theirs=(-md "$D" --spec-type draft-simple -ngld 99)
    [[ "$D" == - ]] && ours=(--drafter mtp) theirs=(--spec-type draft-mtp)
    case "$config" in
        k0|spec)
            local k=0; [[ "$config" == spec ]] && k="$DRAFT_MAX"
            read -r -a extra <<< "${LOCALSPEC_ARGS:-}"
            SERVER_CMD=("${LOCALSPEC[@]}" serve --target "$T" "${ours[@]}" --draft "$k" --parallel "$PARALLEL"
                --queue $(( 4 * PARALLEL )) --ctx "$LOCALSPEC_CTX" --host 127.0.0.1 --port "$PORT" --seed "$SEED"
                "${PROJECTOR[@]}" "${extra[@]}") ;;
        llama|llamaprob)
            read -r -a extra <<< "${LLAMA_SERVER_ARGS:-}"
            [[ "$config" == llamaprob ]] && extra=(--spec-draft-sampling probabilistic "${extra[@]}")
            SERVER_CMD=("$LLAMA_SERVER" -m "$T" "${theirs[@]}"
                --spec-draft-n-max "$DRAFT_MAX" --spec-draft-n-min 0 --spec-draft-p-min 0 -np "$PARALLEL"
                -c $(( PARALLEL * CTX )) -fa on -ngl 99 --host 127.0.0.1 --port "$PORT" --seed "$SEED"
                "${PROJECTOR[@]}" "${extra[@]}") ;;
        llamaplain)
            read -r -a extra <<< "${LLAMA_SERVER_ARGS:-}"
            SERVER_CMD=("$LLAMA_SERVER" -m "$T" -np "$PARALLEL" -c $(( PARALLEL * CTX )) -fa on -ngl 99
                --host 127.0.0.1 --port "$PORT" --seed "$SEED" "${PROJECTOR[@]}" "${extra[@]}") ;;
        *) return 1 ;;
    esac
}
# Configurations rotate within each pair, so a slow spell of the machine does not hit one of them only.
for s in $PAIRS; do
    read -r T D <<< "${FILES[$s]:-}"
    [[ -n "${T:-}" && -f "$T" && ( "$D" == - || -f "$D" ) ]] || { log "no files for pair $s"; continue; }
    if [[ -n "$MMPROJ" ]]; then
        size="$(basename "$T" -target.gguf)"; [[ "$s" == hybrid-mtp ]] && size="$HYBRID_SIZE"
        picture_files "$size" || { log "no projector or picture for pair $s (MMPROJ=$MMPROJ)"; continue; }
        s="$s+$MMPROJ"
    fi
    mkdir -p "$RES/$s"
    for config in $CONFIGS; do
        todo=()
        for temp in $TEMPS; do
            [[ "$config" == llamaprob && "$temp" == 0 ]] && continue  # (at T = 0 rejection is sample-and-match)
            [[ -s "$RES/$s/$config-t$temp.json" ]] || todo+=("$temp")
        done
        (( ${#todo[@]} )) || continue
        [[ "$config" == llama* && -z "$LLAMA_SERVER" ]] && continue
        need=$(( 60 + CLIENT_S * ${#todo[@]} ))  # loading ~20 GB from the page cache, then a client run per T
        if (( $(left) < need )); then log "SKIP $s-$config: $(left)s left, needs ~${need}s"; continue; fi
        server_cmd "$config" "$T" "$D" || { log "unknown configuration $config"; continue; }
        slog="$RES/$s/$config.server.log"
        log "START server $s-$config: ${SERVER_CMD[*]}"
        printf '%q ' "${SERVER_CMD[@]}" > "$RES/$s/$config.cmd"
        start_server "$slog" "${SERVER_CMD[@]}"
        # /health's body: localspec's says whether its slots share batches, with the load probe's figures
        if ! wait_ready "$slog" "$RES/$s/$config.health.json"; then stop_server; continue; fi
        log "health $s-$config: $(head -c 600 "$RES/$s/$config.health.json" 2>/dev/null)"
        for temp in "${todo[@]}"; do
            json="$RES/$s/$config-t$temp.json"
            read -r -a extra <<< "${CLIENT_ARGS:-}"
            run "client-$s-$config-t$temp" 60 python3 "$REPO/bench/concurrency.py" \
                --url "http://127.0.0.1:$PORT/v1" --clients "$CLIENTS" --requests-per-client "$REQUESTS" \
                --max-tokens "$N_PREDICT" --temperature "$temp" --top-k 40 --top-p 0.9 --min-p 0 --seed "$SEED" \
                --label "$config $s T=$temp" --json "$json" "${PICTURE[@]}" "${extra[@]}" \
                > "$RES/$s/$config-t$temp.log" 2>&1
            tail -8 "$RES/$s/$config-t$temp.log" | tee -a "$RES/run.log"
        done
        stop_server
        log "END server $s-$config"
    done
done
finish
