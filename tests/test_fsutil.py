"""fsutil: the one atomic write every writer uses, tested once and thoroughly; strict UTF-8 config reading."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localspec import fsutil
from localspec.errors import ConfigError, WriteError
from tests.conftest import BadFolder, temp_files


def test_writes_replaces_and_keeps_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    assert fsutil.atomic_write(path, "first\n") == path
    assert path.read_text() == "first\n"
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()  # as open() would create it, not mkstemp's 0600
    path.chmod(0o640)
    fsutil.atomic_write(path, b"second\n")
    assert path.read_bytes() == b"second\n" and path.stat().st_mode & 0o777 == 0o640
    assert os.listdir(tmp_path) == ["out.json"]


def test_a_missing_folder_is_named_unless_asked_to_create_it(tmp_path: Path) -> None:
    with pytest.raises(WriteError, match=r"cannot write report .*/missing/out.json: its folder does not exist"):
        fsutil.atomic_write(tmp_path / "missing" / "out.json", "x", what="report")
    assert not (tmp_path / "missing").exists()
    fsutil.atomic_write(tmp_path / "made" / "deep" / "out.json", "x", parents=True)
    assert (tmp_path / "made" / "deep" / "out.json").read_text() == "x"


def test_read_only_folder(readonly_dir: BadFolder, monkeypatch: pytest.MonkeyPatch) -> None:
    target = readonly_dir.path / "out.json"
    if readonly_dir.how == "fault":  # root without mount: the in-process equivalent of the fault hook
        monkeypatch.setattr(os, "open", _failing(os.open, errno.EROFS, readonly_dir.path))
    with pytest.raises(WriteError, match="read-only file system|permission denied") as err:
        fsutil.atomic_write(target, "x")
    assert str(target) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(WriteError, match="read-only file system|permission denied"):
        fsutil.check_writable(target)
    assert list(readonly_dir.path.iterdir()) == []


def test_a_directory_in_the_way(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    (target / "inside").mkdir(parents=True)
    with pytest.raises(WriteError, match="out.json: it is a directory"):
        fsutil.atomic_write(target, "x")
    with pytest.raises(WriteError, match="out.json: it is a directory"):
        fsutil.check_writable(target)
    assert (target / "inside").is_dir() and temp_files(tmp_path) == []


@pytest.mark.parametrize("fault", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_or_interrupted_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: BaseException
) -> None:
    path = tmp_path / "preset.toml"
    path.write_text("old\n")

    def fsync(fd: int) -> None:  # the disk fills (or Ctrl-C lands) after the bytes went out, before the rename
        raise fault

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(WriteError if isinstance(fault, OSError) else KeyboardInterrupt) as err:
        fsutil.atomic_write(path, "new\n" * 1000)
    if isinstance(fault, OSError):
        assert str(err.value) == f"cannot write {path}: the disk is full"
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["preset.toml"]


def test_a_full_file_system(full_dir: BadFolder) -> None:
    if full_dir.how != "tmpfs":
        pytest.skip("no tmpfs here: the fault-injected write above covers a full disk")
    with pytest.raises(WriteError, match="the disk is full"):
        fsutil.check_writable(full_dir.path / "report.json")
    (full_dir.path / "filler").write_bytes(b"\0" * 8192)  # a little room: the probe passes, the write does not
    fsutil.check_writable(full_dir.path / "report.json", need=0)
    with pytest.raises(WriteError, match="the disk is full"):
        fsutil.atomic_write(full_dir.path / "report.json", b"x" * (1 << 20))
    assert [p.name for p in full_dir.path.iterdir()] == ["filler"]


def test_a_killed_writer_s_temporary_file_is_removed_by_the_next_write(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".model.gguf.{int(dead.stdout)}.abc123.tmp"
    alive = tmp_path / f".model.gguf.{os.getppid()}.def456.tmp"  # another writer, still running
    stale.write_bytes(b"half a model")
    alive.write_bytes(b"in progress")
    with fsutil.atomic_path(tmp_path / "model.gguf") as tmp:
        tmp.write_bytes(b"GGUF")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, "model.gguf"])


def test_check_writable_leaves_nothing_behind(tmp_path: Path) -> None:
    fsutil.check_writable(tmp_path / "report.json")
    fsutil.check_writable(tmp_path / "new" / "preset.toml", parents=True)
    assert [p.name for p in tmp_path.rglob("*")] == ["new"]


def test_config_text_must_be_utf8_and_a_file(tmp_path: Path) -> None:
    bad = tmp_path / "models.toml"
    bad.write_bytes(b'name = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"models.toml: not UTF-8 text \(byte 0xe9 at offset 11\)"):
        fsutil.read_text(bad)
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is a FIFO"):  # must not block waiting for a writer
        fsutil.read_text(fifo)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _failing(real, code: int, under: Path):  # noqa: ANN001, ANN202
    def call(path, flags, *args, **kwargs):  # noqa: ANN001, ANN202
        if flags & os.O_CREAT and str(path).startswith(str(under)):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, flags, *args, **kwargs)

    return call
