"""`localspec rpc-server`: lend this machine's GPUs (or its CPU) to localspec or llama.cpp on another machine.

It wraps ggml's own RPC server (`ggml_backend_rpc_start_server`), so it speaks exactly the protocol of the
llama.cpp it was built with: a client with `--rpc HOST:PORT` — localspec, llama-cli, llama-server — sees this
machine's devices as its own. The server runs in a thread of its own; this one waits for Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Annotated

import typer
from rich.console import Console

from localspec import config, paths, rpc
from localspec.cli import options
from localspec.errors import LocalspecError

HostOpt = options.setting("host", "--host", "Where to listen (RPC has no authentication: a trusted network only).",
                          section="rpc_server")
PortOpt = options.setting("port", "--port", "Port to listen on.", section="rpc_server")
ThreadsOpt = options.setting("threads", "--threads", "CPU threads when serving the CPU (0 = auto: the free "
                             "physical cores).", section="rpc_server")
CacheOpt = Annotated[bool | None, typer.Option("--cache/--no-cache", help="Keep large tensors on disk here, so "
                                               "loading the same model again sends less."
                                               + options.preset_default("cache", "rpc_server"),
                                               show_default=False, metavar="")]


def rpc_server(host: HostOpt = None, port: PortOpt = None, threads: ThreadsOpt = None, cache: CacheOpt = None,
               preset: options.PresetOpt = None) -> None:
    """Serve this machine's devices over llama.cpp's RPC protocol (clients: --rpc HOST:PORT)."""
    settings = config.load_preset(preset or "default").with_overrides(
        prefer="rpc_server", flags={"host": "--host", "port": "--port", "threads": "--threads", "cache": "--cache"},
        host=host, port=port, threads=threads, cache=cache,
    ).rpc_server
    endpoint = rpc.Endpoint(settings.host, settings.port)
    err = Console(stderr=True)
    if not endpoint.loopback:
        err.print(f"[yellow]⚠ listening on {endpoint}: llama.cpp's RPC protocol has no authentication and no "
                  "encryption: anyone who reaches this port can run code on these devices and read what they "
                  "hold. Use it on a trusted network only.[/]")
    _check_port_free(endpoint)

    from localspec.llama import backend

    devices = backend.gpu_devices() or [backend.cpu_device()]
    cache_dir = paths.home() / "cache" / "rpc" if settings.cache else None
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    n_threads = settings.threads or backend.default_threads()
    console = Console()
    console.print(f"[bold]localspec rpc-server[/] on [cyan]{endpoint}[/]: "
                  + ", ".join(f"{d.name} ({d.description})" for d in devices)
                  + (f", {n_threads} threads" if devices[0].kind == "cpu" else "")
                  + (f"; tensor cache {cache_dir}" if cache_dir else ""))
    console.print(f"clients: localspec bench --rpc {endpoint}   ({_how_to_stop()})", soft_wrap=True)
    server = threading.Thread(target=backend.serve_rpc, args=(str(endpoint), devices, n_threads, cache_dir),
                              name="rpc-server", daemon=True)
    server.start()
    try:
        while server.is_alive():
            server.join(0.5)
    except BaseException:  # Ctrl-C or SIGTERM, which the entry point turns into exceptions: a requested stop
        console.print("rpc-server stopped")
        _exit_now(0)
    raise LocalspecError(f"RPC server {endpoint}: ggml's server stopped (it prints why above)")


def _how_to_stop() -> str:
    """Started from a script or a background job, the process ignores Ctrl-C (cli/app.py keeps it so): say what
    stops it then."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return f"Ctrl-C is ignored here, as in a background job: `kill {os.getpid()}` stops"
    return "Ctrl-C stops"


def _check_port_free(endpoint: rpc.Endpoint) -> None:
    """Bind once ourselves, so a busy port or a foreign address is a one-line error (ggml would only print)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ggml's server socket does
            sock.bind((endpoint.host, endpoint.port))
    except OSError as exc:
        raise LocalspecError(f"cannot listen on {endpoint}: {exc.strerror or exc}") from None


def _exit_now(code: int) -> None:
    # The server thread sits in accept() inside ggml: leave without interpreter or C++ teardown under its feet.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def register(app: typer.Typer) -> None:
    app.command(name="rpc-server")(rpc_server)
