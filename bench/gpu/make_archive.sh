#!/usr/bin/env bash
# Packs what the GPU machine lacks into bench/gpu/carry/ (git-ignored; the device call names it in `carry`):
#   llama.cpp.tar.gz       the llama.cpp vendored by the pinned llama-cpp-python, trimmed to what CMake needs for
#                          llama-bench, llama-speculative-simple and the shared libllama/ggml libraries
#   py.tar.gz              py/: llama_cpp (ctypes bindings, no compiled lib: LLAMA_CPP_LIB_PATH points at the CUDA
#                          build), gguf and llama_cpp's pure-Python deps; pyfallback/: packages localspec imports
#                          that run.sh links in only where the image lacks them (never shadowing the image's own)
#   ggml-vocab-qwen2.gguf  tokenizer metadata for the synthetic 32B pair (151,936 tokens)
#   MANIFEST.txt           sizes, sources and the versions packed
# Run here (CPU machine), from anywhere:  bash bench/gpu/make_archive.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CARRY="$HERE/carry"
VENDOR_SRC="${VENDOR_SRC:-/work/vendor_src/llama.cpp}"
VOCAB="${VOCAB:-/work/vendor_src/ggml-vocab-qwen2.gguf}"
PY="${PY:-/work/venv/bin/python}"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

[[ -f "$VENDOR_SRC/CMakeLists.txt" ]] || { echo "no llama.cpp source at $VENDOR_SRC" >&2; exit 1; }
[[ -f "$VOCAB" ]] || { echo "no vocab GGUF at $VOCAB" >&2; exit 1; }
[[ -f "$SITE/llama_cpp/llama_cpp.py" ]] || { echo "llama_cpp not installed in $SITE" >&2; exit 1; }

mkdir -p "$CARRY"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT

# -- llama.cpp source ---------------------------------------------------------------------------------------------
# Excluded: what no CMake target we build reads (models/docs/media/benches/tests/web UI, CI files, Python
# converters, app bundles for other platforms). Every examples/ and tools/ folder that a CMakeLists.txt
# add_subdirectory()s stays, or configure fails.
tar -C "$(dirname "$VENDOR_SRC")" -czf "$CARRY/llama.cpp.tar.gz" \
    --exclude-vcs \
    --exclude='__pycache__' \
    --exclude="$(basename "$VENDOR_SRC")/models" \
    --exclude="$(basename "$VENDOR_SRC")/docs" \
    --exclude="$(basename "$VENDOR_SRC")/media" \
    --exclude="$(basename "$VENDOR_SRC")/benches" \
    --exclude="$(basename "$VENDOR_SRC")/tests" \
    --exclude="$(basename "$VENDOR_SRC")/tools/ui" \
    --exclude="$(basename "$VENDOR_SRC")/.github" \
    --exclude="$(basename "$VENDOR_SRC")/.devops" \
    --exclude="$(basename "$VENDOR_SRC")/gguf-py" \
    --exclude="$(basename "$VENDOR_SRC")/conversion" \
    --exclude="$(basename "$VENDOR_SRC")/examples/llama.android" \
    --exclude="$(basename "$VENDOR_SRC")/examples/llama.swiftui" \
    --exclude="$(basename "$VENDOR_SRC")/examples/model-conversion" \
    --exclude="$(basename "$VENDOR_SRC")/build*" \
    --transform "s,^$(basename "$VENDOR_SRC"),llama.cpp," \
    "$(basename "$VENDOR_SRC")"

# -- Python packages ----------------------------------------------------------------------------------------------
mkdir -p "$STAGE/py" "$STAGE/pyfallback"
copy_pkg() {  # copy_pkg DEST NAME...: packages or single modules from site-packages, minus caches and binaries
    local dest="$1"; shift
    for name in "$@"; do
        if [[ -d "$SITE/$name" ]]; then
            cp -r "$SITE/$name" "$dest/"
        elif [[ -f "$SITE/$name.py" ]]; then
            cp "$SITE/$name.py" "$dest/"
        else
            echo "missing package $name in $SITE" >&2; exit 1
        fi
    done
}
# Always on the path there (the image has none of these). llama_cpp without lib/ (CPU build for 3.11) and
# server/ (fastapi etc.); markupsafe without its 3.11 C speedups (it falls back to pure Python).
copy_pkg "$STAGE/py" llama_cpp gguf jinja2 markupsafe diskcache
rm -rf "$STAGE/py/llama_cpp/lib" "$STAGE/py/llama_cpp/server"
find "$STAGE/py" -name '*.so' -delete
# Fallbacks: pure Python (psutil's extension is abi3, so it loads on 3.12 too).
copy_pkg "$STAGE/pyfallback" typing_extensions typer click rich markdown_it mdurl pygments shellingham psutil \
    yaml tqdm
find "$STAGE/pyfallback/yaml" -name '*.so' -delete  # PyYAML falls back to its pure-Python loader
find "$STAGE" -name '__pycache__' -type d -prune -exec rm -rf {} +
tar -C "$STAGE" -czf "$CARRY/py.tar.gz" py pyfallback

cp "$VOCAB" "$CARRY/ggml-vocab-qwen2.gguf"

{
    echo "made $(date -u +%FT%TZ) on $(hostname)"
    echo "llama.cpp source: $VENDOR_SRC"
    "$PY" - <<'EOF'
import importlib.metadata as m
for d in ("llama_cpp_python", "gguf", "jinja2", "markupsafe", "diskcache", "typer", "click", "rich", "psutil",
          "pygments", "PyYAML", "tqdm"):
    try:
        print(f"{d}=={m.version(d)}")
    except m.PackageNotFoundError:
        print(f"{d}: not installed")
EOF
    (cd "$CARRY" && ls -l --block-size=K llama.cpp.tar.gz py.tar.gz ggml-vocab-qwen2.gguf)
} > "$CARRY/MANIFEST.txt"
cat "$CARRY/MANIFEST.txt"
du -sh "$CARRY"
