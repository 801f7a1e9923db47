"""Fault injection for CLI subprocesses in tests (this folder is on their PYTHONPATH only).

`LOCALSPEC_TEST_FAULT=OP:ERRNO:PATH` makes one kind of file-system call under PATH fail the way a full disk, a
read-only mount or an unreadable file would, where the test machine cannot produce that for real (root ignores
permission bits; mounting a tmpfs needs root). OP is `fsync` (the last step of a write: a disk that fills
during it), `create` (creating a file or folder) or `read` (opening a file for reading, and os.access).
"""

from __future__ import annotations

import builtins
import errno
import io
import os

_SPEC = os.environ.get("LOCALSPEC_TEST_FAULT", "")


def _under(path: object, prefix: str) -> bool:
    try:
        return os.path.abspath(os.fsdecode(path)).startswith(prefix)  # type: ignore[arg-type]
    except TypeError:
        return False


def _install(op: str, code: int, prefix: str) -> None:
    def fail(path: object) -> OSError:
        return OSError(code, os.strerror(code), os.fsdecode(path))  # type: ignore[arg-type]

    if op == "fsync":
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if _under(os.readlink(f"/proc/self/fd/{fd}"), prefix):
                raise fail(os.readlink(f"/proc/self/fd/{fd}"))
            real_fsync(fd)

        os.fsync = fsync
    elif op == "create":
        real_open, real_mkdir = os.open, os.mkdir

        def os_open(path, flags, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
            if flags & os.O_CREAT and _under(path, prefix):
                raise fail(path)
            return real_open(path, flags, mode, dir_fd=dir_fd)

        def mkdir(path, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
            if _under(path, prefix):
                raise fail(path)
            return real_mkdir(path, mode, dir_fd=dir_fd)

        os.open, os.mkdir = os_open, mkdir
    elif op == "read":
        real_open_file, real_access = builtins.open, os.access

        def open_file(file, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
            if "r" in mode and not isinstance(file, int) and _under(file, prefix):
                raise fail(file)
            return real_open_file(file, mode, *args, **kwargs)

        def access(path, mode, **kwargs):  # type: ignore[no-untyped-def]
            if mode & os.R_OK and _under(path, prefix):
                return False
            return real_access(path, mode, **kwargs)

        builtins.open = io.open = open_file
        os.access = access
    else:
        raise SystemExit(f"LOCALSPEC_TEST_FAULT: unknown operation {op!r}")


if _SPEC:
    _op, _errno, _prefix = _SPEC.split(":", 2)
    _install(_op, getattr(errno, _errno), os.path.abspath(_prefix))
