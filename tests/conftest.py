"""Shared fixtures: real GGUF files only (tiny generated pairs and the PyPI-shipped models)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# The synthetic pair writer lives with its users (tests and the GPU harness), outside the installed package; the
# one-off probes that tests still run live in bench/lab.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "bench" / "lab"))

# Tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Nor read the developer's own settings: test modules load presets at import time, before any fixture runs, so
# the isolation starts here; `_isolated_home` then gives every test a fresh home of its own.
os.environ["LOCALSPEC_HOME"] = tempfile.mkdtemp(prefix="localspec-tests-")
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="localspec-tests-hf-")
os.environ.pop("HF_HUB_CACHE", None)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch) -> None:
    """Every test starts with an empty LOCALSPEC_HOME (fixtures such as use_demo_home point it elsewhere)."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory) -> Path:
    """A LOCALSPEC_HOME with both offline demo pairs built in it (assembled and requantized once per session:
    a command resolving a demo in an empty home builds it first, ~1 s of llama.cpp's quantizer each time)."""
    home = tmp_path_factory.mktemp("localspec_home")
    old = os.environ.get("LOCALSPEC_HOME")
    os.environ["LOCALSPEC_HOME"] = str(home)
    try:
        from localspec.models import demo

        demo.target_path()
        demo.draft_path()
        demo.SMOLLM2.draft_path()
    finally:
        if old is None:
            os.environ.pop("LOCALSPEC_HOME", None)
        else:
            os.environ["LOCALSPEC_HOME"] = old
    return home


@pytest.fixture
def use_demo_home(demo_home, monkeypatch) -> Path:
    monkeypatch.setenv("LOCALSPEC_HOME", str(demo_home))
    return demo_home


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from synthetic import smollm2_vocab_path

    return smollm2_vocab_path()


def _write_tiny(tmp_path_factory, spec, **kw) -> tuple[Path, Path]:
    import dataclasses

    from synthetic import write_pair

    folder = tmp_path_factory.mktemp("tiny")
    target, draft = folder / "target.gguf", folder / "draft.gguf"
    # Q4_0, like real int4 targets: quantized dot products are exact integers, so llama.cpp's CPU kernels
    # score a position identically in a batch and alone (F32 weights differ in the last bits there).
    write_pair(target, draft, dataclasses.replace(spec, wtype="q4_0"), **kw)
    return target, draft


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny pair whose draft often disagrees with the target (rejections on most rounds)."""
    from synthetic import TINY

    return _write_tiny(tmp_path_factory, TINY)


@pytest.fixture(scope="session")
def tiny_pair_high(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny pair whose draft almost always agrees (exercises the all-accepted path)."""
    from synthetic import TINY_HIGH

    return _write_tiny(tmp_path_factory, TINY_HIGH)


@pytest.fixture(scope="session")
def tiny_fim_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny pair with fill-in-the-middle tokens (`tests.helpers_serve.FIM_TOKENS`) named in both files."""
    from synthetic import TINY

    from tests.helpers_serve import FIM_TOKENS

    return _write_tiny(tmp_path_factory, TINY, fim_tokens=FIM_TOKENS)


def _write_hybrid(tmp_path_factory, spec) -> tuple[Path, Path]:
    from synthetic import write_hybrid_pair

    folder = tmp_path_factory.mktemp("hybrid")
    target, draft = folder / "target.gguf", folder / "draft.gguf"
    write_hybrid_pair(target, draft, spec)  # Q4_0 matrices: a position scores the same in a batch and alone
    return target, draft


@pytest.fixture(scope="session")
def hybrid_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3.5-shaped hybrid pair (Gated DeltaNet + attention; the target with an MTP block) whose drafts,
    the draft model's and the MTP head's, are often rejected."""
    from synthetic import HYBRID_TINY

    return _write_hybrid(tmp_path_factory, HYBRID_TINY)


@pytest.fixture(scope="session")
def hybrid_moe_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny hybrid with mixture-of-experts FFNs (llama.cpp's `qwen35moe`: 8 routed experts, 2 a token, and a
    shared one; the MTP block's FFN too): the 35B-A3B's kind of model."""
    from synthetic import HYBRID_MOE_TINY

    return _write_hybrid(tmp_path_factory, HYBRID_MOE_TINY)


@pytest.fixture(scope="session")
def hybrid_pair_high(tmp_path_factory) -> tuple[Path, Path]:
    """The hybrid pair whose drafts (model and MTP) are almost always accepted."""
    from synthetic import HYBRID_TINY_HIGH

    return _write_hybrid(tmp_path_factory, HYBRID_TINY_HIGH)


# -- file systems that refuse writes (tests of every writer) -------------------------------------------------

FAULTS = Path(__file__).resolve().parent / "faults"


@dataclass(frozen=True)
class BadFolder:
    """A folder where writes fail. `how` is "tmpfs" (a real mount), "chmod" (permission bits) or "fault"
    (tests/faults/sitecustomize.py, for CLI subprocesses run with `env`), whichever the machine allows."""

    path: Path
    how: str
    env: dict[str, str]


def fault_env(op: str, code: str, path: Path) -> dict[str, str]:
    """Environment for a CLI subprocess whose file-system calls of kind `op` under `path` fail with `code`."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p),
            "LOCALSPEC_TEST_FAULT": f"{op}:{code}:{path}"}


def _mount_tmpfs(path: Path, options: str) -> bool:
    """A small tmpfs at `path`: only root can, and only where the container allows mounts."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@pytest.fixture
def readonly_dir(tmp_path: Path) -> Iterator[BadFolder]:
    """A folder nothing can be created in: a read-only tmpfs as root (permission bits do not stop root), mode
    0555 otherwise, fault-injected EROFS as a last resort."""
    path = tmp_path / "readonly"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield BadFolder(path, "chmod", {})
        path.chmod(0o755)
    elif _mount_tmpfs(path, "ro,size=64k"):
        yield BadFolder(path, "tmpfs", {})
        _unmount(path)
    else:
        yield BadFolder(path, "fault", fault_env("create", "EROFS", path))


@pytest.fixture
def full_dir(tmp_path: Path) -> Iterator[BadFolder]:
    """A folder on a full file system: a 64 kB tmpfs filled to the last byte where mounts work, else a fault-
    injected ENOSPC when the written file is synced (a disk that fills during the write)."""
    path = tmp_path / "full"
    path.mkdir()
    if _mount_tmpfs(path, "size=64k"):
        with contextlib.suppress(OSError), (path / "filler").open("wb") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        assert shutil.disk_usage(path).free == 0
        yield BadFolder(path, "tmpfs", {})
        _unmount(path)
    else:
        yield BadFolder(path, "fault", fault_env("fsync", "ENOSPC", path))


def temp_files(folder: Path) -> list[Path]:
    """What a failed write could leave behind: localspec's `.NAME.PID.*.tmp` files and older suffixes."""
    return [p for p in folder.rglob("*") if p.name.endswith((".tmp", ".partial")) or ".part-" in p.name]
