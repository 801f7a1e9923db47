#!/usr/bin/env bash
# Packs what the GPU machine lacks into bench/gpu/carry/ (or CARRY; git-ignored; the GPU machine gets a copy).
# Everything comes from PyPI through pip, at the versions pinned here and in pyproject.toml, so any machine with pip
# makes the same:
#   llama.cpp.tar.gz       the llama.cpp vendored in the llama-cpp-python sdist (the project's pin), trimmed to what
#                          CMake needs for llama-bench, llama-speculative-simple, llama-server (without its web UI)
#                          and the shared libllama/ggml libraries
#   py.tar.gz              py/: llama_cpp's Python bindings from the same sdist (no compiled library: run.sh points
#                          LLAMA_CPP_LIB_PATH at the CUDA build) and the pure-Python packages localspec needs that the
#                          GPU image lacks or may hold at other versions (wheels for CPython 3.12, x86-64 Linux):
#                          the CLI's, `localspec serve`'s HTTP stack, and the `openai` client that
#                          bench/concurrency.py drives the servers with
#   llama.cpp-newest.tar.gz  the yardstick: the newest public llama.cpp source obtainable from PyPI, the one vendored
#                          unpatched in the xllamacpp sdist pinned below (its thirdparty/llama.cpp), trimmed alike;
#                          run.sh builds its tools beside the pinned build, and `--against llama.cpp` runs them
#   ggml-vocab-qwen2.gguf  tokenizer metadata for the synthetic 32B pair (Qwen2, 151,936 tokens): the sdist's
#                          vendor/llama.cpp/models/ggml-vocab-qwen2.gguf (llama.cpp's tokenizer test file)
#   MANIFEST.txt           sizes, sources and the versions packed
# Run here (any machine with Python and pip, network to PyPI), from anywhere:  bash bench/gpu/make_archive.sh
# Environment: PYTHON [python3]; DOWNLOADS [a temporary folder]: keep the downloads there to rerun offline;
# IMAGES [1]: 0 leaves Pillow out (--mmproj runs need it; ~7 MB of the carry's 64 MiB).
set -euo pipefail
# shellcheck source=bench/gpu/harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"  # HERE, CARRY (bench/gpu/carry unless set)
PYTHON="${PYTHON:-python3}"
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"  # = pyproject.toml's pin: the bindings must match the library's ABI
# The yardstick's source: llama.cpp b11549 (2026-10-10; it has --spec-draft-sampling), vendored unpatched in this
# sdist (xllamacpp applies its patches at build time; none ship in the sdist). Fetched by the URL PyPI's JSON API
# gives and checked against this sha256. The sdist does not record llama.cpp's commit: "unknown" until found.
NEWEST_PACKAGE=xllamacpp
NEWEST_VERSION=2026.10.11549
NEWEST_SHA256=c17ee1163006f70726abb9f72137830818f3d8cb60bfc34cb232d08428eaa22b
NEWEST_BUILD=11549
NEWEST_COMMIT=unknown
# Pure-Python packages for the device's Python 3.12, the versions localspec is tested with; pydantic-core is the one
# compiled wheel (typer >= 0.27 validates through pydantic).
WHEELS=(
    gguf==0.19.0 diskcache==5.6.3
    typer==0.29.2 shellingham==1.5.4 annotated-doc==0.0.7 pydantic==2.14.4 pydantic-core==2.50.5
    typing-inspection==0.4.5 annotated-types==0.8.0 typing-extensions==4.16.0
    rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
    # `localspec serve` (pyproject's server pins, the versions tested here) and the concurrency client (issue #14);
    # jiter and psutil are compiled (a cp312 and an abi3 wheel).
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 sse-starlette==3.7.0 click==8.5.1 h11==0.16.0
    anyio==4.16.0 sniffio==1.3.1 idna==3.20 opentelemetry-api==1.45.2 psutil==7.2.2
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
    # pictures (--mmproj: llama/vision.py decodes them with Pillow; a manylinux_2_28 wheel)
    pillow==13.0.0
)
if [[ "${IMAGES:-1}" == 0 ]]; then  # a run without pictures: ~7 MB less to carry (room for a model's parts)
    kept=(); for w in "${WHEELS[@]}"; do [[ "$w" == pillow==* ]] || kept+=("$w"); done; WHEELS=("${kept[@]}")
fi

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
DOWNLOADS="${DOWNLOADS:-$STAGE/downloads}"
mkdir -p "$CARRY" "$DOWNLOADS/wheels" "$STAGE/src" "$STAGE/py"

# -- the pinned sdist ----------------------------------------------------------------------------------------------
sdist="$(ls "$DOWNLOADS"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)"
if [[ -z "$sdist" ]]; then
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps --dest "$DOWNLOADS" "$LLAMA_CPP_PYTHON"
    sdist="$(ls "$DOWNLOADS"/llama_cpp_python-*.tar.gz | head -1)"
fi
top="$(basename "$sdist" .tar.gz)"  # an sdist unpacks into NAME-VERSION/
tar -C "$STAGE/src" -xzf "$sdist" "$top/llama_cpp" "$top/vendor/llama.cpp"
SRC="$STAGE/src/$top"
VENDOR="$SRC/vendor/llama.cpp"
VOCAB="$VENDOR/models/ggml-vocab-qwen2.gguf"
[[ -f "$VENDOR/CMakeLists.txt" ]] || { echo "the sdist $sdist holds no vendor/llama.cpp" >&2; exit 1; }
[[ -f "$VOCAB" ]] || { echo "the sdist $sdist holds no $VOCAB (llama.cpp moved its tokenizer test files?)" >&2; exit 1; }

# -- llama.cpp source ----------------------------------------------------------------------------------------------
# pack_llama PARENT OUT: PARENT/llama.cpp as OUT, a tar.gz whose top folder is llama.cpp/. Excluded: what no CMake
# target we build reads (models/docs/media/benches/tests/web UI, CI files, Python converters, app bundles for other
# platforms). Every examples/ and tools/ folder that a CMakeLists.txt add_subdirectory()s stays, or configure fails.
# llama-server's CMake adds tools/ui (the web UI, 8.5 MB of Svelte sources) and embeds whatever assets it finds
# there; with no assets, no npm build (LLAMA_BUILD_UI defaults to OFF) and no download (run.sh configures
# LLAMA_USE_PREBUILT_UI=OFF) it builds a server without the UI, which the API does not need. These four files
# are all that CMake reads of that folder then.
UI_FILES=(CMakeLists.txt sources.cmake ui.cpp.in ui.h.in)
pack_llama() {
    local parent="$1" out="$2" d f excludes=()
    for d in models docs media benches tests tools/ui .github .devops gguf-py conversion examples/llama.android \
        examples/llama.swiftui examples/model-conversion skills 'build*'; do
        excludes+=(--exclude="llama.cpp/$d")
    done
    for f in "${UI_FILES[@]}"; do
        [[ -f "$parent/llama.cpp/tools/ui/$f" ]] \
            || { echo "$parent/llama.cpp has no tools/ui/$f (llama.cpp moved its UI?)" >&2; exit 1; }
    done
    tar -C "$parent" -cf "$STAGE/pack.tar" --exclude-vcs --exclude='__pycache__' "${excludes[@]}" llama.cpp
    tar -C "$parent" -rf "$STAGE/pack.tar" "${UI_FILES[@]/#/llama.cpp/tools/ui/}"
    gzip -9 < "$STAGE/pack.tar" > "$out"
    rm -f "$STAGE/pack.tar"
}
pack_llama "$SRC/vendor" "$CARRY/llama.cpp.tar.gz"

# -- the newest llama.cpp (the yardstick) --------------------------------------------------------------------------
# Its sdist is not built, so not fetched through pip (pip download would build its metadata): the URL comes from
# PyPI's JSON API, the file's sha256 is checked against the pin above and PyPI's own; one already in DOWNLOADS with
# that sha256 is reused.
newest="$DOWNLOADS/$NEWEST_PACKAGE-$NEWEST_VERSION.tar.gz"
if [[ ! -f "$newest" || "$(sha256sum "$newest" | cut -d' ' -f1)" != "$NEWEST_SHA256" ]]; then
    "$PYTHON" - "$NEWEST_PACKAGE" "$NEWEST_VERSION" "$NEWEST_SHA256" "$newest" <<'EOF'
import hashlib
import json
import sys
import urllib.error
import urllib.request
from urllib.parse import urljoin

package, version, sha256, dest = sys.argv[1:]
api, files = "", None
for api in (f"https://pypi.org/pypi/{package}/{version}/json", f"https://pypi.org/pypi/{package}/json"):
    try:
        with urllib.request.urlopen(api, timeout=60) as r:
            doc = json.load(r)
    except urllib.error.HTTPError:
        continue  # (a mirror may lack the per-version page; the project's lists every release)
    files = doc.get("urls") if api.endswith(f"/{version}/json") else doc.get("releases", {}).get(version)
    if files:
        break
sdist = next((f for f in files or [] if f["packagetype"] == "sdist"), None)
if sdist is None:
    sys.exit(f"PyPI lists no sdist of {package} {version}")
if sdist["digests"]["sha256"] != sha256:
    sys.exit(f"PyPI's sha256 of {sdist['filename']} is {sdist['digests']['sha256']}, not the pinned {sha256}")
url = urljoin(api, sdist["url"])  # an absolute URL, or one relative to the API's page
digest = hashlib.sha256()
with urllib.request.urlopen(url, timeout=600) as r, open(dest + ".part", "wb") as out:
    while chunk := r.read(1 << 20):
        digest.update(chunk)
        out.write(chunk)
if digest.hexdigest() != sha256:
    sys.exit(f"{url}: sha256 {digest.hexdigest()}, not the pinned {sha256}")
print(f"downloaded {url}")
EOF
    mv "$newest.part" "$newest"
fi
newest_top="$NEWEST_PACKAGE-$NEWEST_VERSION"
tar -C "$STAGE/src" -xzf "$newest" "$newest_top/thirdparty/llama.cpp"
NEWEST_SRC="$STAGE/src/$newest_top/thirdparty"
grep -q -- '"--spec-draft-sampling"' "$NEWEST_SRC/llama.cpp/common/arg.cpp" \
    || { echo "$newest: its llama.cpp has no --spec-draft-sampling: not the yardstick" >&2; exit 1; }
pack_llama "$NEWEST_SRC" "$CARRY/llama.cpp-newest.tar.gz"

# -- Python packages -----------------------------------------------------------------------------------------------
cp -r "$SRC/llama_cpp" "$STAGE/py/"
rm -rf "$STAGE/py/llama_cpp/server"  # fastapi & co.; localspec never starts llama-cpp-python's server
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 \
    --platform any --dest "$DOWNLOADS/wheels" "${WHEELS[@]}"
for whl in "$DOWNLOADS"/wheels/*.whl; do
    "$PYTHON" -m zipfile -e "$whl" "$STAGE/py/"
done
rm -rf "$STAGE"/py/*.dist-info/RECORD
find "$STAGE/py" -name '__pycache__' -type d -prune -exec rm -rf {} +
tar -C "$STAGE" -czf "$CARRY/py.tar.gz" py

cp "$VOCAB" "$CARRY/ggml-vocab-qwen2.gguf"

{
    echo "made $(date -u +%FT%TZ) by bench/gpu/make_archive.sh"
    echo "sdist: $(basename "$sdist") (sha256 $(sha256sum "$sdist" | cut -d' ' -f1))"
    echo "vocab: $top/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"
    echo "newest-sdist: $NEWEST_PACKAGE-$NEWEST_VERSION.tar.gz (sha256 $NEWEST_SHA256)"
    echo "newest-build: $NEWEST_BUILD"
    echo "newest-commit: $NEWEST_COMMIT"
    echo "wheels:"; (cd "$DOWNLOADS/wheels" && ls -1 ./*.whl | sed 's,^\./,  ,')
    (cd "$CARRY" && ls -l --block-size=K llama.cpp.tar.gz llama.cpp-newest.tar.gz py.tar.gz ggml-vocab-qwen2.gguf)
} > "$CARRY/MANIFEST.txt"
cat "$CARRY/MANIFEST.txt"
du -sh "$CARRY"
