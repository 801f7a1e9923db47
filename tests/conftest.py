"""Shared fixtures: real GGUF files only (tiny generated pairs and the PyPI-shipped models)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

# The synthetic pair writer lives with its users (tests and the GPU harness), outside the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

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
    """A LOCALSPEC_HOME with the offline demo pair built in it (assembled and requantized once per session)."""
    home = tmp_path_factory.mktemp("localspec_home")
    old = os.environ.get("LOCALSPEC_HOME")
    os.environ["LOCALSPEC_HOME"] = str(home)
    try:
        from localspec import demo

        demo.target_path()
        demo.draft_path()
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


def _write_tiny(tmp_path_factory, spec) -> tuple[Path, Path]:
    import dataclasses

    from synthetic import write_pair

    folder = tmp_path_factory.mktemp("tiny")
    target, draft = folder / "target.gguf", folder / "draft.gguf"
    # Q4_0, like real int4 targets: quantized dot products are exact integers, so llama.cpp's CPU kernels
    # score a position identically in a batch and alone (F32 weights differ in the last bits there).
    write_pair(target, draft, dataclasses.replace(spec, wtype="q4_0"))
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
