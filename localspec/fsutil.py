"""Reading and writing localspec's own files: text that must be UTF-8, and writes that never leave a
half-written file or a stray temporary one.

Every file localspec writes (presets, the default pair, bench reports, chat transcripts, the demo models) goes
through here: the bytes go to a temporary file in the target's own folder (so the final rename stays on one file
system and is atomic), are fsynced, and only then replace the target. On any failure, Ctrl-C and SIGTERM
included (the entry point turns SIGTERM into an exception), the temporary file is removed and the error names
the path. Temporary names carry the writer's pid, so a later write also removes what a killed process left.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from localspec.errors import ConfigError, WriteError

# Below this much free space a write is refused up front: a report or preset is a few kB, and a disk this full
# would fail the write anyway, after the work it was meant to save.
MIN_FREE_BYTES = 64 << 10

_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EISDIR: "it is a directory",
    errno.ENOTDIR: "a file is in the way of its folder",
    errno.ENOENT: "its folder does not exist",
}


def not_utf8(where: str, exc: UnicodeDecodeError) -> str:
    """`where: not UTF-8 text (byte 0xff at offset 12)`, the one wording for every text input."""
    return f"{where}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"


def not_a_file(st_mode: int) -> str | None:
    """What a path is when it is not a regular file ("a directory", "a FIFO (named pipe)"), else None.

    Checked before opening: reading a FIFO without a writer blocks forever, a device never ends.
    """
    if stat.S_ISREG(st_mode):
        return None
    if stat.S_ISDIR(st_mode):
        return "a directory"
    if stat.S_ISFIFO(st_mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(st_mode):
        return "a socket"
    if stat.S_ISCHR(st_mode) or stat.S_ISBLK(st_mode):
        return "a device"
    return "not a regular file"


def read_text(path: Path) -> str:
    """A config file's text (presets, models.toml, default-pair): OSError and bad UTF-8 become one line."""
    try:
        kind = not_a_file(path.stat().st_mode)
        if kind is not None:
            raise ConfigError(f"{path}: is {kind}, not a text file")
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(not_utf8(str(path), exc)) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _why(exc: OSError) -> str:
    return _REASONS.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()


def write_error(path: Path, exc: OSError, what: str = "") -> WriteError:
    """One line naming the file, what it is and why the write failed."""
    label = f"{what} {path}" if what else str(path)
    return WriteError(f"cannot write {label}: {_why(exc)}")


def check_writable(path: str | os.PathLike[str], what: str = "", need: int = MIN_FREE_BYTES,
                   parents: bool = False) -> Path:
    """Fail now, before long work, if `path` could not be written later: its folder is missing and cannot be
    made, is read-only or full, or a folder stands where the file would go. Proves it by creating (and removing)
    a temporary file there, which also covers root on a read-only mount, where permission bits say nothing."""
    target = Path(path).expanduser()
    label = f"{what} {target}" if what else str(target)
    if target.is_dir():
        raise WriteError(f"cannot write {label}: it is a directory")
    folder = target.parent
    try:
        if parents:
            folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(probe)
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        raise write_error(target, exc, what) from None
    if free < need:
        raise WriteError(f"cannot write {label}: the disk is full ({free} bytes free)")
    return target


def _remove_stale(folder: Path, name: str) -> None:
    """Temporary files of `name` whose writer no longer runs (killed with SIGKILL, or the machine went down)."""
    pattern = re.compile(rf"^\.{re.escape(name)}\.(\d+)\..*\.tmp$")
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        except OSError:  # EPERM: alive, someone else's
            continue


def _mode_for(target: Path) -> int:
    """The replaced file's mode, else what the umask allows (as open() would create it)."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], what: str = "", parents: bool = False) -> Iterator[Path]:
    """A temporary path next to `path` for a writer that opens the file itself (llama.cpp's quantizer).

    When the block ends normally the file is fsynced and renamed onto `path`; when it raises anything (Ctrl-C,
    SIGTERM, an error) it is removed. OSErrors become a `WriteError` naming `path`. `parents` creates missing
    folders (localspec's own home); a folder the user named must already exist.
    """
    target = Path(path).expanduser()
    folder = target.parent
    try:
        if parents:
            folder.mkdir(parents=True, exist_ok=True)
        _remove_stale(folder, target.name)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError as exc:
        raise write_error(target, exc, what) from None
    tmp = Path(name)
    with contextlib.suppress(OSError):  # mkstemp makes 0600; the file gets the mode a plain open() would give
        os.chmod(tmp, _mode_for(target))
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if target.is_dir():  # os.replace would say EISDIR, or on some systems replace an empty folder
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(target))
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise write_error(target, exc, what) from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], what: str = "", parents: bool = False) -> Iterator[IO[bytes]]:
    """An open (binary) temporary file that becomes `path` (fsynced, renamed) only if the block completes."""
    with atomic_path(path, what, parents) as tmp, open(tmp, "wb") as fh:
        yield fh
        fh.flush()


def atomic_write(path: str | os.PathLike[str], data: str | bytes, what: str = "",
                 parents: bool = False) -> Path:
    """Write `data` (text as UTF-8) to `path` atomically; returns the path. See the module docstring."""
    target = Path(path).expanduser()
    with atomic_file(target, what, parents) as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
    return target
