#!/usr/bin/env bash
# Drafters, constrained decoding and the draft length by cost on the GPU. Run from
# the repo root on the GPU machine after run.sh (it reuses WORK's llama.cpp build and the card pair run.sh wrote):
#     bash bench/gpu/drafters.sh
# Every speed number is `localspec bench`'s (or bench/structured.py's, for the constrained modes). Steps, each
# skipped when its JSON exists (resumable on a warm machine, like run.sh):
#   1. the card pair at CARD_NOISE: `localspec bench --raw --temp 0 --drafter D --prompts SET` for each of DRAFTERS
#      and SETS; each run measures its own plain baseline, interleaved
#   2. a real GGUF (REAL_TARGET; made from REAL_PARTS if given): `--draft none --drafter lookup` on each of SETS
#      through its chat template. The synthetic target's text never repeats itself (its tokens are noise), so
#      prompt lookup finds nothing to propose there: its speed-up on replies that quote the prompt needs a real
#      model. A small one fits a call's carry (SmolLM2-135M-Instruct Q4_1, 98 MB, carried in parts over two calls).
#   2b. the same real GGUF embedded in the card's shapes and quant types (bench/embed.py --size SPEAKS_SIZE: a
#      32B-cost target and a 0.6B-cost draft that write the real model's language): each of SPEAKS_DRAFTERS on each
#      of SPEAKS_SETS (a shipped set, or one prompt of one by name) through the chat template (lookup with --draft
#      none: lookup alone)
#   3. bench/structured.py speed on the card pair at each of STRUCTURED_TEMPS (the default sampling: top_k 40,
#      top_p 0.9): a JSON-schema request and a tool call (tool_choice required) unconstrained, constrained on the
#      target only, on draft and target, plain; with the row check's early stop and without (STRUCTURED_ARGS); and
#      llama.cpp's llama-speculative-simple with the same GBNF as --grammar-file, and without, on the same prompts
#   4. the model drafter before and after the drafter seam: the first card run's pair (COMPARE_NOISE, measured on
#      main 7572e82, before the seam) with that run's command, at T = 0
#   5. the draft length chosen by measured cost (ADAPTIVE_ARGS) on each card level of ADAPTIVE_NOISES at each of
#      ADAPTIVE_TEMPS, to set beside run.sh's fixed-k rows
#   6. bench/lab/hedge_probe.py on the card pair (HEDGE_PROBE [1]): how many rounds hedged bets would save, a
#      batched draft step's cost, and the round they predict from run.sh's T = 0 profile of the pair
#   7. bench/gpu/summarize.py: the drafter, structured and adaptive tables too
# Environment (defaults in brackets; CARRY, WORK, OUT, BUDGET_S, CARRIED_PY, CARD_SIZE, VOCAB: harness.sh):
#   CARD_NOISE [0.013]  DRAFTERS ["model lookup chain"]  SETS ["shipped lookup"]  N_PREDICT [128]  REPEAT [3]
#   WARMUP [4]  REAL_TARGET [WORK/models/real.gguf]  REAL_PARTS (files concatenated, in order, into REAL_TARGET)
#   REAL_SHA256 (checked after concatenating)  STRUCTURED [1]  STRUCTURED_TEMPS ["0.7"]  STRUCTURED_RUNS [2]
#   STRUCTURED_ARGS ["--constraint both --rows full --compare-early-stop --no-logprobs"]  STRUCTURED_LLAMA [1]
#   STRUCTURED_LLAMA_RUNS [1]  STRUCTURED_NEED [240]  COMPARE_NOISE [0.035] ("": none)  ADAPTIVE_NOISES ["0.013 0.03"]  ADAPTIVE_TEMPS
#   ["0 0.7"]  ADAPTIVE_ARGS ["--adaptive"]  ADAPTIVE_REPEAT [3]  SKIP_DRAFTERS  SKIP_REAL  SKIP_ADAPTIVE
#   SPEAKS_SIZE [card32b]  SPEAKS_DRAFTERS ["lookup model chain"]  SPEAKS_SETS ["lookup shipped code-edit"]
#   SPEAKS_ARGS (more bench arguments there); a single prompt's greedy reply is kept too (speaks-SET-reply.txt)
#   SKIP_SPEAKS  BENCH_ARGS (more `localspec bench` arguments, e.g. --threads 1)
# A CPU dry run (card-tiny models in WORK/models, this machine's llama_cpp):
#   CARRIED_PY=0 CARD_SIZE=card-tiny BENCH_ARGS="--threads 1" N_PREDICT=32 REPEAT=1 WARMUP=1 bash bench/gpu/drafters.sh
set -uo pipefail
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"

CARD_NOISE="${CARD_NOISE:-0.013}"
DRAFTERS="${DRAFTERS:-model lookup chain}"
SETS="${SETS:-shipped lookup}"
N_PREDICT="${N_PREDICT:-128}"
REPEAT="${REPEAT:-3}"
WARMUP="${WARMUP:-4}"
STRUCTURED="${STRUCTURED:-1}"
STRUCTURED_TEMPS="${STRUCTURED_TEMPS:-0.7}"
STRUCTURED_ARGS="${STRUCTURED_ARGS---constraint both --rows full --compare-early-stop --no-logprobs}"
STRUCTURED_RUNS="${STRUCTURED_RUNS:-2}"
STRUCTURED_LLAMA="${STRUCTURED_LLAMA:-1}"
STRUCTURED_LLAMA_RUNS="${STRUCTURED_LLAMA_RUNS:-1}"
STRUCTURED_NEED="${STRUCTURED_NEED:-240}"
COMPARE_NOISE="${COMPARE_NOISE-0.035}"
ADAPTIVE_NOISES="${ADAPTIVE_NOISES-0.013 0.03}"
ADAPTIVE_TEMPS="${ADAPTIVE_TEMPS:-0 0.7}"
ADAPTIVE_ARGS="${ADAPTIVE_ARGS:---adaptive}"
ADAPTIVE_REPEAT="${ADAPTIVE_REPEAT:-3}"
SPEAKS_SIZE="${SPEAKS_SIZE:-card32b}"
SPEAKS_DRAFTERS="${SPEAKS_DRAFTERS:-lookup model chain}"
SPEAKS_SETS="${SPEAKS_SETS:-lookup shipped code-edit}"
results_in "$WORK/results"
DRES="$RES/drafters"
mkdir -p "$DRES"
use_build
log "drafters: card-n$CARD_NOISE, drafters '$DRAFTERS', sets '$SETS', adaptive on '$ADAPTIVE_NOISES', budget ${BUDGET_S}s"
TARGET="$(card_target)"
bench() {  # bench JSON NEED_S ARGS...: one `localspec bench` run unless its JSON exists; T = 0 unless ARGS say
    local json="$1" need="$2"; shift 2
    [[ -s "$json" ]] && return 0
    # shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
    run "$(basename "$json" .json)" "$need" "${LOCALSPEC[@]}" bench --temp 0 --max-tokens "$N_PREDICT" \
        --repeat "$REPEAT" --warmup "$WARMUP" --seed 42 --ctx 4096 "$@" ${BENCH_ARGS:-} --json "$json.tmp" \
        > "${json%.json}.log" 2>&1
    # exit 1 is a failed greedy check: the JSON says so and is kept (summarize.py shows it)
    [[ -s "$json.tmp" ]] && mv "$json.tmp" "$json"
}

# -- 1. the drafters on the card pair -------------------------------------------------------------------------
if [[ "${SKIP_DRAFTERS:-0}" != 1 ]]; then
    draft="$(card_draft "$CARD_NOISE")"
    if [[ -f "$TARGET" && -f "$draft" ]]; then
        for set in $SETS; do
            for d in $DRAFTERS; do
                bench "$DRES/card-n$CARD_NOISE-$set-$d.json" 40 --raw --target "$TARGET" --draft "$draft" \
                    --draft 6 --drafter "$d" --prompts "$set"
            done
        done
    else
        log "SKIP the card pair's drafters: no $TARGET or $draft (run.sh writes them)"
    fi
fi

# -- 2. prompt lookup on a real model --------------------------------------------------------------------------
# (the file is made from its parts whether or not this step runs: step 2b embeds it)
assemble_real
if [[ "${SKIP_REAL:-0}" != 1 ]]; then
    if [[ -f "$REAL_TARGET" ]]; then
        for set in $SETS; do
            bench "$DRES/real-$set-lookup.json" 20 --target "$REAL_TARGET" --draft none --drafter lookup \
                --prompts "$set"
        done
    else
        log "SKIP the real model: no $REAL_TARGET"
    fi
fi

# -- 2b. the card's costs, real language: the real model embedded in the card's shapes (bench/embed.py) ------------
# A Qwen3-32B-shaped Q4_K_M target and a Qwen3-0.6B-wide Q8_0 draft that compute REAL_TARGET's model exactly (up
# to requantisation): lookup, the model drafter and the chain on text a language model writes, at the card's costs.
if [[ "${SKIP_SPEAKS:-0}" != 1 ]]; then
    speaks_target="$(speaks_target "$SPEAKS_SIZE")" speaks_draft="$(speaks_draft "$SPEAKS_SIZE")"
    if speaks_pair "$SPEAKS_SIZE"; then
        for set in $SPEAKS_SETS; do
            prompts="$set"
            if [[ "$set" != shipped && "$set" != lookup ]]; then  # one prompt of a shipped set, alone
                prompts="$DRES/prompt-$set.jsonl"
                python3 -c "import json, sys; from localspec.sessions.bench import PROMPT_SETS
texts = {name: text for prompts in PROMPT_SETS.values() for name, text in prompts}
print(json.dumps({'prompt': texts[sys.argv[1]]}))" "$set" > "$prompts" || { log "no shipped prompt $set"; continue; }
            fi
            if [[ "$prompts" == *.jsonl && ! -s "$DRES/speaks-$set-reply.txt" ]]; then
                # The greedy reply itself (bench keeps only counts): whether the text quotes its prompt is what
                # lookup's numbers mean.
                # shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
                python3 -c "import json, sys; print(json.loads(open(sys.argv[1]).read())['prompt'], end='')" \
                    "$prompts" | run "speaks-$set-reply" 30 "${LOCALSPEC[@]}" generate --target "$speaks_target" \
                    --draft none --chat --max-tokens "$N_PREDICT" --temp 0 ${BENCH_ARGS:-} - \
                    > "$DRES/speaks-$set-reply.txt" 2> "$DRES/speaks-$set-reply.log"
            fi
            for d in $SPEAKS_DRAFTERS; do
                if [[ "$d" == lookup ]]; then model=(--draft none); else model=(--draft "$speaks_draft" --draft 6); fi
                # shellcheck disable=SC2086  # SPEAKS_ARGS is a word list on purpose
                bench "$DRES/speaks-$set-$d.json" 40 --target "$speaks_target" "${model[@]}" --drafter "$d" \
                    --prompts "$prompts" ${SPEAKS_ARGS:-}
            done
        done
    else
        log "SKIP the embedded pair: no $REAL_TARGET to embed"
    fi
fi

# -- 3. constrained decoding and logprobs -----------------------------------------------------------------------
# At each of STRUCTURED_TEMPS, with STRUCTURED_ARGS; and llama.cpp's own grammar path on the same prompt tokens and
# GBNF (`--against-llama`) where the build has llama-speculative-simple.
if [[ "$STRUCTURED" == 1 ]]; then
    draft="$(card_draft "$CARD_NOISE")"
    against=(); [[ "$STRUCTURED_LLAMA" == 1 && -x "$BIN/llama-speculative-simple" ]] \
        && against=(--against-llama "$BIN" --llama-runs "$STRUCTURED_LLAMA_RUNS")
    for t in $STRUCTURED_TEMPS; do
        json="$DRES/structured-card-n$CARD_NOISE-t$t.json"
        [[ -f "$TARGET" && -f "$draft" && ! -s "$json" ]] || continue
        # shellcheck disable=SC2086  # STRUCTURED_ARGS and BENCH_ARGS are word lists on purpose
        run "structured-t$t" "$STRUCTURED_NEED" python3 "$REPO/bench/structured.py" speed --target "$TARGET" \
            --draft "$draft" --runs "$STRUCTURED_RUNS" --max-tokens "$N_PREDICT" --temp "$t" $STRUCTURED_ARGS \
            "${against[@]}" ${BENCH_ARGS:-} --json "$json.tmp" > "$DRES/structured-t$t.log" 2>&1 \
            && mv "$json.tmp" "$json"
    done
fi

# -- 4. the model drafter on the pair measured before the seam -------------------------------------------------
if [[ -n "$COMPARE_NOISE" && -f "$TARGET" ]]; then
    draft="$(card_draft "$COMPARE_NOISE")"
    [[ -f "$draft" ]] || card_pair "$COMPARE_NOISE"  # the seeded writer gives the same draft again (~5 s)
    # the first card run's command: --repeat 3 --warmup 5, 256 tokens
    [[ -f "$draft" ]] && REPEAT=3 WARMUP=5 N_PREDICT=256 bench "$DRES/seam-card-n$COMPARE_NOISE-t0.json" 50 --raw \
        --target "$TARGET" --draft "$draft" --draft 6
fi

# -- 5. the draft length by cost --------------------------------------------------------------------------------
if [[ "${SKIP_ADAPTIVE:-0}" != 1 ]]; then
    for n in $ADAPTIVE_NOISES; do
        draft="$(card_draft "$n")"
        [[ -f "$TARGET" && -f "$draft" ]] || { log "SKIP adaptive card-n$n: no models"; continue; }
        for t in $ADAPTIVE_TEMPS; do
            # shellcheck disable=SC2086  # ADAPTIVE_ARGS is a word list on purpose
            REPEAT="$ADAPTIVE_REPEAT" N_PREDICT=256 bench "$DRES/adaptive-card-n$n-t$t.json" 50 --raw \
                --target "$TARGET" --draft "$draft" --draft 6 --temp "$t" $ADAPTIVE_ARGS
        done
    done
fi

# -- 6. hedged bets, before building them: the rounds they would save and what a batched draft step costs -----------
if [[ "${HEDGE_PROBE:-1}" == 1 ]]; then
    draft="$(card_draft "$CARD_NOISE")" profile="$RES/card-n$CARD_NOISE/localspec-t0.json"
    probe="$DRES/hedge-probe-card-n$CARD_NOISE.json"
    bench_json=(); [[ -s "$profile" ]] && bench_json=(--bench-json "$profile")  # run.sh's round at T = 0, if any
    if [[ -f "$TARGET" && -f "$draft" && ! -s "$probe" ]]; then
        # shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
        run hedge-probe 60 python3 "$REPO/bench/lab/hedge_probe.py" --target "$TARGET" --draft "$draft" \
            --max-tokens 256 --hedges 3 "${bench_json[@]}" ${BENCH_ARGS:-} --json "$probe" \
            > "$DRES/hedge-probe-card-n$CARD_NOISE.log" 2>&1
        tail -8 "$DRES/hedge-probe-card-n$CARD_NOISE.log" | tee -a "$RES/run.log"
    fi
fi

python3 "$HERE/summarize.py" "$RES" > "$RES/summary.txt" 2>&1
sed -n '/^drafters/,$p' "$RES/summary.txt"
pack drafters-results "$DRES" "$RES/summary.txt" "$RES/summary.json"
