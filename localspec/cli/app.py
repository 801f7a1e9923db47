"""Wires the command groups into one typer app and maps known errors to one line.

Each command group lives in its own module and registers itself through `register(app)`; this module only
collects them. Click objects stay out of the app (typer >= 0.26 bundles its own click).
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Annotated

# The import-order guard lives in the entry points (and localspec/llama), not in the package: llama_cpp must load before
# numpy, or a CUDA build's model load can crash (docs/architecture.md). Config and header code need no libllama.
import llama_cpp  # noqa: F401, I001
import typer

from localspec.cli import bench_cmd, chat_cmd, models_cmd, rpc_cmd, serve_cmd
from localspec.errors import LocalspecError
from localspec.llama import backend

app = typer.Typer(
    name="localspec",
    help="Lossless speculative decoding on llama.cpp: a big int4 target, a small same-family draft.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



def _show_version(value: bool) -> None:
    if value:
        from localspec import __version__

        print(f"localspec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, metavar="",
                           help="Show the version and exit.")
    ] = False,
) -> None:
    """Lossless speculative decoding on llama.cpp. Set LOCALSPEC_DEBUG=1 for tracebacks and llama.cpp logs."""


for _module in (bench_cmd, models_cmd, chat_cmd, serve_cmd, rpc_cmd):
    _module.register(app)


def debug_enabled() -> bool:
    return os.environ.get("LOCALSPEC_DEBUG", "") not in ("", "0")


class _Terminated(BaseException):
    """SIGTERM as an exception, so every `finally` and atomic write cleans up (typer does not catch it)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    if not backend.deferred_in_callback(signum, frame):
        raise _Terminated


def _interrupted(exc: BaseException) -> bool:
    """typer turns Ctrl-C into a silent exit 130; find the KeyboardInterrupt behind it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def main() -> None:
    """Console entry point: known errors become one line on stderr and a non-zero exit."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the shell made us ignore it
        signal.signal(signal.SIGINT, backend.interrupt_handler)
    try:
        app(standalone_mode=True)
    except LocalspecError as exc:
        if debug_enabled():
            raise
        print(f"localspec: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        if debug_enabled():
            raise
        print("localspec: interrupted", file=sys.stderr)
        sys.exit(130)
    except SystemExit as exc:
        if exc.code == 130 and _interrupted(exc):
            print("localspec: interrupted", file=sys.stderr)
        raise
    except _Terminated:
        print("localspec: terminated", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    except OSError as exc:  # a file-system failure no command anticipated: still one line, naming the file
        if debug_enabled():
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"localspec: error: {where}{exc.strerror or exc}", file=sys.stderr)
        sys.exit(2)
