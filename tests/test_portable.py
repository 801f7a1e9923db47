"""Nothing in the repository depends on one machine: no absolute path of a developer's or a benchmark machine's
folders in any tracked text file, and the bench scripts find their inputs through the packages and the carry."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Folders that exist on one machine only (written so that this file does not match itself).
MACHINE_ROOTS = ("work", "root", "home", "Users")
MACHINE_PATH = re.compile(r"(?<![\w.$~})-])/(?:" + "|".join(MACHINE_ROOTS) + r")/[\w.-]")
# Tests' own fixtures may hold such paths on purpose (input that must be refused, a fake machine's layout).
FIXTURES = ("tests/fixtures/", "tests/faults/")
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "dist", "carry", "work",
                "real"}


def tracked_files() -> list[Path]:
    """The files git tracks (the repository as shipped); outside a git checkout, every file but the build's."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        return [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts)]


def text_of(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:  # deleted in the working tree, not yet committed
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def test_no_tracked_text_file_names_a_machines_own_folders() -> None:
    found = []
    for path in tracked_files():
        if str(path.relative_to(ROOT)).startswith(FIXTURES):
            continue
        text = text_of(path)
        for number, line in enumerate((text or "").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "paths of one machine (use a relative path, $HOME, or find the file):\n" + "\n".join(found)


def test_the_pattern_catches_what_it_is_for() -> None:
    for line in ("vocab = Path('/" + "work/llama-src/x.gguf')", "W=/" + "root/lsw; mkdir -p $W",
                 "cd /" + "home/me/localspec"):
        assert MACHINE_PATH.search(line), line
    for line in ("W=$HOME/lsw", "https://github.com/owner/" + "home/blob", "bench/gpu/work/out", "/tmp/lsw/x",
                 "~/.config/localspec", "{tmp_path}/" + "work/pyenv", "$(pwd)/" + "work/x"):
        assert not MACHINE_PATH.search(line), line


@pytest.fixture
def structured(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("bench_structured", ROOT / "bench" / "structured.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_structured_bench_finds_the_vocabulary_in_the_carry(structured, tmp_path: Path, monkeypatch) -> None:
    carried = tmp_path / "ggml-vocab-qwen2.gguf"
    carried.write_bytes(b"GGUF")
    monkeypatch.setattr(structured, "CARRIED_VOCAB", carried)
    monkeypatch.setattr(structured.importlib.util, "find_spec", lambda name: None)
    assert structured.default_vocab() == carried


def test_the_structured_bench_without_a_vocabulary_says_where_to_get_one(structured, tmp_path: Path,
                                                                         monkeypatch) -> None:
    monkeypatch.setattr(structured, "CARRIED_VOCAB", structured.ROOT / "bench" / "gpu" / "carry" / "none.gguf")
    monkeypatch.setattr(structured.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"pass --vocab FILE .*bash bench/gpu/make_archive.sh"):
        structured.default_vocab()
