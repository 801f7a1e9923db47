#!/usr/bin/env bash
# The verify kernel experiment: what a verify batch of 1..8 tokens costs on each weight type
# (Q4_K, Q6_K, Q4_0) under each runtime setting of ggml-cuda, with flash attention on and off. Run from the repo
# root on the GPU machine, after run.sh (it reuses WORK's build; without one it builds through run.sh first):
#     bash bench/gpu/kernels.sh
# What decides the kernel, read in the pinned ggml-cuda (docs/gpu.md, "The verify kernels"): for 1..8 columns
# (MMVQ_MAX_BATCH_SIZE) ggml_cuda_mul_mat takes MMVQ on Hopper for every quantized type *before* it looks at
# MMQ or cuBLAS, so GGML_CUDA_FORCE_MMQ / GGML_CUDA_FORCE_CUBLAS (build options in this llama.cpp, not
# environment variables) cannot change a verify batch; only a patched threshold can (BUILDS=mmvq-env below).
# Steps, each skipped when its result exists (resumable on a warm machine, like run.sh):
#   1. per MIXES type, a full-width 32B-shaped target of KERNEL_BLOCKS blocks with every matrix in that type
#      (bench/synthetic.py --mix; 16 blocks: 5.3 GB Q4_K/Q4_0, 7.7 GB Q6_K), plus the card's Q4_K_M target if
#      run.sh left it in WORK/models
#   2. per model, VARIANT and flash attention mode: bench/gpu/verify_widths.py --widths 1-8 --no-patterns in a
#      process of its own (the variables are read once per process) -> WORK/results/kernels/<model>-<variant>-fa<on|off>.json
#   3. summarize.py: the kernel table (ms per width and the cost of each extra token), in $OUT/summary.txt
# Environment (defaults in brackets):
#   (CARRY, WORK, OUT, BUDGET_S, CARRIED_PY, CARD_SIZE, VOCAB: harness.sh)
#   MIXES ["q4_k q6_k q4_0"]  KERNEL_BLOCKS [16]  CALLS [30]
#   VARIANTS ["default graph-opt no-fusion no-graphs"]: default (nothing set), graph-opt (GGML_CUDA_GRAPH_OPT=1),
#       no-fusion (GGML_CUDA_DISABLE_FUSION=1), no-pdl (GGML_CUDA_PDL=0), no-graphs (GGML_CUDA_DISABLE_GRAPHS=1),
#       mmvq<N> (patched build only: MMVQ up to N columns, MMQ above)
#   FA_MODES ["on off"]  BUILDS [""]: "mmvq-env" = also build a patched ggml-cuda (WORK/build-mmvq-env, ~300 s)
#   whose MMVQ threshold comes from GGML_CUDA_MMVQ_MAX_BATCH, and run the mmvq<N> VARIANTS on it
#   WIDTHS_ARGS (extra verify_widths.py arguments, e.g. --threads 1)
set -uo pipefail
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"

MIXES="${MIXES-q4_k q6_k q4_0}"
KERNEL_BLOCKS="${KERNEL_BLOCKS:-16}"
CALLS="${CALLS:-30}"
VARIANTS="${VARIANTS:-default graph-opt no-fusion no-graphs}"
FA_MODES="${FA_MODES:-on off}"
BUILDS="${BUILDS:-}"
results_in "$WORK/results"
KRES="$RES/kernels"
mkdir -p "$KRES"
log "kernels: mixes '$MIXES', $KERNEL_BLOCKS blocks, variants '$VARIANTS', flash attention '$FA_MODES', budget ${BUDGET_S}s"

# -- 1. the build (run.sh's, measuring nothing) and the Python path ---------------------------------------------
ensure_build || exit 1  # (each run below names its own LLAMA_CPP_LIB_PATH: the patched build is another)

# -- 2. the models -------------------------------------------------------------------------------------------------
vocab_args "$CARD_SIZE"
free_gb() { df -Pk "$MODELS" | awk 'NR==2 {print int($4 / 1048576)}'; }
need_gb() {  # need_gb MIX: the 32B-shaped file's size (GB per block, embedding + output), rounded up, plus 2
    [[ "$CARD_SIZE" == card32b ]] || { echo 1; return; }
    case "$1" in q6_k) per=0.400 emb=1.28 ;; *) per=0.274 emb=0.88 ;; esac
    awk -v b="$KERNEL_BLOCKS" -v p="$per" -v e="$emb" 'BEGIN {print int(b * p + e + 3)}'
}
KMODELS=()
for mix in $MIXES; do
    f="$MODELS/kern-$mix-b$KERNEL_BLOCKS-target.gguf"
    if [[ ! -f "$f" ]] && (( $(free_gb) < $(need_gb "$mix") )); then
        log "SKIP the $mix model: $(free_gb) GB free, needs ~$(need_gb "$mix")"
    elif [[ ! -f "$f" ]]; then
        run "write-kern-$mix" 60 python3 "$REPO/bench/synthetic.py" --size "$CARD_SIZE" --only target --mix "$mix" \
            --target-blocks "$KERNEL_BLOCKS" --out "$MODELS" --prefix "kern-$mix-b$KERNEL_BLOCKS-" "${VOCAB_ARGS[@]}" \
            > "$KRES/write-$mix.log" 2>&1
    fi
    [[ -f "$f" ]] && KMODELS+=("$mix:$f")
done
card="$MODELS/$CARD_SIZE-target.gguf"
[[ -f "$card" ]] && KMODELS+=("q4_k_m:$card")

# -- 3. a patched build whose MMVQ threshold is an environment variable (optional) --------------------------------
# ggml_cuda_should_use_mmvq gets a first line: GGML_CUDA_MMVQ_MAX_BATCH=N sends quantized batches wider than N to
# MMQ. Its own source copy and build folder: the main build stays the pinned llama.cpp.
build_mmvq_env() {
    set -e
    local src="$WORK/llama.cpp-mmvq-env" build="$WORK/build-mmvq-env"
    rm -rf "$src" && cp -a "$WORK/llama.cpp" "$src"
    local f="$src/ggml/src/ggml-cuda/mmvq.cu"
    grep -q '^bool ggml_cuda_should_use_mmvq(enum ggml_type type, int cc, int64_t ne11) {$' "$f"
    sed -i '/^bool ggml_cuda_should_use_mmvq(enum ggml_type type, int cc, int64_t ne11) {$/a\
    { static const char * mmvq_max = getenv("GGML_CUDA_MMVQ_MAX_BATCH");\
      if (mmvq_max != nullptr \&\& ggml_is_quantized(type)) { return ne11 <= atoi(mmvq_max); } }' "$f"
    grep -q GGML_CUDA_MMVQ_MAX_BATCH "$f"
    cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 > "$KRES/mmvq-env-configure.log" 2>&1
    cmake --build "$build" --target llama -j "$(nproc)" > "$KRES/mmvq-env-build.log" 2>&1
}
export -f build_mmvq_env
export WORK KRES
if [[ " $BUILDS " == *" mmvq-env "* && ! -e "$WORK/build-mmvq-env/bin/libllama.so" ]]; then
    run build-mmvq-env 250 bash -c build_mmvq_env || log "mmvq-env build failed: $(tail -5 "$KRES/mmvq-env-build.log")"
fi

# -- 4. one process per model, variant and flash attention mode ---------------------------------------------------
variant_env() {  # variant_env NAME: the environment assignments of a variant, or nothing for an unknown name
    case "$1" in
        default) echo "" ;;
        graph-opt) echo "GGML_CUDA_GRAPH_OPT=1" ;;
        no-fusion) echo "GGML_CUDA_DISABLE_FUSION=1" ;;
        no-pdl) echo "GGML_CUDA_PDL=0" ;;
        no-graphs) echo "GGML_CUDA_DISABLE_GRAPHS=1" ;;
        mmvq[0-9]*) echo "GGML_CUDA_MMVQ_MAX_BATCH=${1#mmvq}" ;;
        *) return 1 ;;
    esac
}
for entry in "${KMODELS[@]}"; do
    mix="${entry%%:*}" model="${entry#*:}"
    for variant in $VARIANTS; do
        assigns="$(variant_env "$variant")" || { log "unknown variant $variant: skipped"; continue; }
        lib="$BIN"
        if [[ "$variant" == mmvq* ]]; then
            lib="$WORK/build-mmvq-env/bin"
            [[ -e "$lib/libllama.so" ]] || { log "SKIP $variant: no patched build (BUILDS=mmvq-env)"; continue; }
        fi
        for fa in $FA_MODES; do
            json="$KRES/$mix-$variant-fa$fa.json"
            [[ -s "$json" ]] && continue
            # shellcheck disable=SC2086  # assigns and WIDTHS_ARGS are word lists on purpose
            run "kernel-$mix-$variant-fa$fa" 25 env $assigns LLAMA_CPP_LIB_PATH="$lib" \
                LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" python3 "$HERE/verify_widths.py" \
                --model "$model" --json "$json.tmp" --widths 1-8 --no-patterns --flash-attn "$fa" --calls "$CALLS" \
                --label "$variant" ${WIDTHS_ARGS:-} > "$KRES/$mix-$variant-fa$fa.log" 2>&1 \
                && mv "$json.tmp" "$json"
        done
    done
done

python3 "$HERE/summarize.py" "$RES" 2>&1 | tee "$RES/summary.txt" > /dev/null
sed -n '/^verify kernels/,$p' "$RES/summary.txt"
pack kernels-results "$KRES" "$RES/summary.txt" "$RES/summary.json"
