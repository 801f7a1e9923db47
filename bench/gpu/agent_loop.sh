#!/usr/bin/env bash
# An agent loop with and without the host-RAM prompt cache: `localspec serve --parallel 1` on the card pair,
# driven by bench/agent_loop.py (concurrency.py's streaming openai client): AGENTS conversations of TURNS turns
# take turns on the one slot, each turn resending its whole conversation plus a new tool result (~8k tokens by
# the last turn), so without the cache every turn reads its conversation again. Measured per turn: time to first
# token and decode tok/s, and the server's cache_n / prompt_n; `agent_loop.py --compare` puts the two runs side by
# side (and says whether the greedy replies are the same). Device call on one GPU (kind nvidia-h200), carry
# ["bench/gpu/carry"], after a call that built llama.cpp (run.sh, or any script's ensure_build), from the repo root:
#     bash bench/gpu/agent_loop.sh
# Environment (defaults in brackets; CARRY, WORK, OUT, BUDGET_S, CARD_SIZE, VOCAB, RERUN: harness.sh):
#   CARD_NOISE [0.013]   the card pair's draft (~85% acceptance at k = 6); written here if WORK lacks it
#   CONFIGS ["off on"]   off: --cache-ram 0; on: --cache-ram CACHE_MIB
#   CACHE_MIB [16384]    TURNS [20]  AGENTS [2]  TURN_CHARS [1100] (~320 tokens)  N_PREDICT [64]
#   CTX [12288]          --ctx: the last turn's ~8k tokens and its reply fit
#   PORT [18090]  LOAD_S [240] (seconds a server may take to become ready)  CLIENT_S [200] (room one client run needs)
#   LOCALSPEC_ARGS  CLIENT_ARGS   extra arguments (word lists)
# A CPU dry run (the tiny card pair, this machine's llama_cpp):
#   CARRIED_PY=0 CARD_SIZE=card-tiny TURNS=3 TURN_CHARS=300 N_PREDICT=8 CTX=2048 CACHE_MIB=64 \
#       LOCALSPEC_ARGS="--threads 1" bash bench/gpu/agent_loop.sh
set -uo pipefail
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"

CARD_NOISE="${CARD_NOISE:-0.013}"
CONFIGS="${CONFIGS:-off on}"
CACHE_MIB="${CACHE_MIB:-16384}"
TURNS="${TURNS:-20}"
AGENTS="${AGENTS:-2}"
TURN_CHARS="${TURN_CHARS:-1100}"
N_PREDICT="${N_PREDICT:-64}"
CTX="${CTX:-12288}"
PORT="${PORT:-18090}"
LOAD_S="${LOAD_S:-240}"
CLIENT_S="${CLIENT_S:-200}"
results_in "$WORK/agent-loop"

finish() {
    stop_server
    if [[ -s "$RES/off.json" && -s "$RES/on.json" ]]; then
        python3 "$REPO/bench/agent_loop.py" --compare "$RES/off.json" "$RES/on.json" 2>&1 | tee "$RES/compare.txt"
    fi
    pack agent-loop-results "$RES" "$RES/compare.txt" "$RES/off.json" "$RES/on.json"
}
trap 'stop_server' EXIT
trap 'log "terminated"; exit 143' TERM INT

export COLUMNS=200  # rich wraps serve's status lines at 80 columns when not on a terminal
snapshot_env "$RES/env.txt"
if [[ "${CARRIED_PY:-1}" == 1 ]]; then
    ensure_build || { finish; exit 1; }
else
    use_build  # a CPU dry run: this machine's llama_cpp
fi

TARGET="$MODELS/$CARD_SIZE-target.gguf"
DRAFT="$MODELS/$CARD_SIZE-n$CARD_NOISE-draft.gguf"
vocab_args "$CARD_SIZE"
[[ -f "$TARGET" ]] || run write-card-target 120 python3 "$REPO/bench/synthetic.py" --size "$CARD_SIZE" --only target \
    --out "$MODELS" --prefix "$CARD_SIZE-" "${VOCAB_ARGS[@]}" > "$RES/write-target.log" 2>&1
[[ -f "$DRAFT" ]] || run write-card-draft 30 python3 "$REPO/bench/synthetic.py" --size "$CARD_SIZE" --only draft \
    --noise "$CARD_NOISE" --out "$MODELS" --prefix "$CARD_SIZE-" --draft-prefix "$CARD_SIZE-n$CARD_NOISE-" \
    "${VOCAB_ARGS[@]}" > "$RES/write-draft.log" 2>&1
[[ -f "$TARGET" && -f "$DRAFT" ]] || { log "no card pair in $MODELS"; finish; exit 1; }

for config in $CONFIGS; do
    json="$RES/$config.json"
    [[ -s "$json" ]] && continue
    if (( $(left) < 60 + CLIENT_S )); then log "SKIP $config: $(left)s left"; continue; fi
    cache=0; [[ "$config" == on ]] && cache="$CACHE_MIB"
    read -r -a extra <<< "${LOCALSPEC_ARGS:-}"
    cmd=("${LOCALSPEC[@]}" serve --target "$TARGET" --draft "$DRAFT" --draft 6 --parallel 1 --ctx "$CTX"
         --cache-ram "$cache" --host 127.0.0.1 --port "$PORT" --seed "$SEED" "${extra[@]}")
    printf '%q ' "${cmd[@]}" > "$RES/$config.cmd"
    log "START server $config: ${cmd[*]}"
    ready=0
    start_server "$RES/$config.server.log" "${cmd[@]}" && wait_ready "$RES/$config.server.log" && ready=1
    if (( ready )); then
        read -r -a client_extra <<< "${CLIENT_ARGS:-}"
        run "client-$config" "$CLIENT_S" python3 "$REPO/bench/agent_loop.py" --url "http://127.0.0.1:$PORT/v1" \
            --turns "$TURNS" --agents "$AGENTS" --turn-chars "$TURN_CHARS" --max-tokens "$N_PREDICT" \
            --seed "$SEED" --label "cache_ram=$cache card-n$CARD_NOISE" --json "$json" "${client_extra[@]}" \
            > "$RES/$config.log" 2>&1
        tail -6 "$RES/$config.log" | tee -a "$RES/run.log"
    fi
    stop_server
done
finish
