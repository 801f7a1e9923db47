"""`localspec serve`: the OpenAI-compatible server, with a live status line.

The socket is bound first (a busy port is a one-line error), uvicorn starts answering at once (/health says 503
"loading"), and the pair loads on a background thread; then the server is ready. Ctrl-C (or SIGTERM) cancels the
running and queued requests, lets uvicorn close the connections, frees both models and exits 0.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import signal
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from localspec.cli import options
from localspec.errors import LocalspecError, UsageError
from localspec.fsutil import check_writable
from localspec.models import registry
from localspec.rounds.events import drafting_note
from localspec.sessions.session import ModelFiles, Session, open_session, preflight

if TYPE_CHECKING:
    from localspec.server.handling import ServerState

MAX_TOKENS_RANGE = (1, 1_000_000)  # as every preset's max_tokens
ApiKeyOpt = Annotated[
    str | None, typer.Option("--api-key", envvar="LOCALSPEC_API_KEY", show_default=False, metavar="KEY",
                             help="Require this key (Bearer or X-Api-Key); /health stays open.")
]
CorsOpt = Annotated[
    list[str] | None, typer.Option("--cors-origin", show_default=False, metavar="URL",
                                   help="Allow browser requests from this origin ('*' = any). Repeatable.")
]
MetricsOpt = Annotated[
    bool | None, typer.Option("--metrics/--no-metrics", show_default=False,
                              help="Serve /metrics (Prometheus text, llama-server's names; preset key "
                                   "server.metrics).")
]
SlotsOpt = Annotated[
    bool | None, typer.Option("--slots/--no-slots", show_default=False,
                              help="Serve /slots (llama-server's; preset key server.slots, on by default).")
]
ModelAliasOpt = Annotated[
    list[str] | None, typer.Option("--model-alias", metavar="NAME", show_default=False,
                                   help="Another name for the served model in /v1/models (with --strict-model, "
                                        "the names requests may give). Repeatable.")
]
StrictModelOpt = Annotated[
    bool | None, typer.Option("--strict-model/--any-model", show_default=False,
                              help="A request's model must be the served id or an alias (else 404); by default any "
                                   "name means the one model served, as llama-server answers (preset key "
                                   "server.strict_model).")
]
options.FLAGS["model_aliases"] = "--model-alias"  # a bad name's error names the flag users typed
ServePairsOpt = Annotated[
    list[str] | None, typer.Option("--pair", metavar="NAME", show_default=False, rich_help_panel=options.MODELS,
                                   help="A named model pair (see `localspec models`). Repeatable: several pairs "
                                        "behind one endpoint, each request's model picks one, loaded on demand.")
]
ServeMaxTokensOpt = Annotated[
    int | None, typer.Option("--max-tokens", show_default=False,
                             help="Cap on tokens per reply." + options.range_text({"range": MAX_TOKENS_RANGE})
                                  + options.default_text("none, until the turn ends or the context is full"))
]


@options.with_run_options
@options.with_shift_options
def serve(
    run: options.RunOptions,
    shift: dict[str, Any],
    host: options.host = None,
    port: options.port = None,
    queue: options.queue = None,
    parallel: options.parallel = None,
    allowed_hosts: options.allowed_hosts = None,
    control_tokens: options.control_tokens = None,
    api_key: ApiKeyOpt = None,
    cors_origin: CorsOpt = None,
    model_alias: ModelAliasOpt = None,
    max_tokens: ServeMaxTokensOpt = None,
    metrics: MetricsOpt = None,
    cache_ram: options.cache_ram = None,
    slot_save_path: options.slot_save_path = None,
    slots: SlotsOpt = None,
    strict_model: StrictModelOpt = None,
    pair: ServePairsOpt = None,
    models_budget: options.models_budget = None,
    models_idle: options.models_idle = None,
) -> None:
    """Serve the pair over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions).

    Requests overlay the preset's sampling; each draws a random seed unless it (or --seed) gives one."""
    if max_tokens is not None and not MAX_TOKENS_RANGE[0] <= max_tokens <= MAX_TOKENS_RANGE[1]:
        raise LocalspecError(f"--max-tokens = {max_tokens}: allowed range is {MAX_TOKENS_RANGE[0]}.."
                             f"{MAX_TOKENS_RANGE[1]}")
    # The HTTP stack loads here, not with the CLI: the other commands start no slower for it.
    from rich.live import Live

    from localspec.server.app import create_app
    from localspec.server.guard import GuardSettings
    from localspec.server.handling import Backend, ServerState

    key = _api_key(api_key)
    # The save folder before anything reads a model file (a demo may be built, a tokenizer loaded): a bad one is one
    # line and exit 2 at once. One from the preset is known only once the pair's preset is: checked right after.
    saves = _slot_folder(slot_save_path) if slot_save_path is not None else None
    runs = _pair_runs(run, pair or [], model_alias)
    # Front-ends send conversations: without model arguments serve the instruct demo, which answers them.
    resolved = [options.resolve_run(r, "server", fallback_pair=registry.DEMO_CHAT.name, host=host, port=port,
                                    queue=queue, parallel=parallel, allowed_hosts=allowed_hosts,
                                    control_tokens=control_tokens,
                                    model_aliases=",".join(model_alias) if model_alias else None,
                                    metrics=metrics, slots=slots, strict_model=strict_model,
                                    cache_ram=cache_ram, slot_save_path=slot_save_path,
                                    models_budget=models_budget, models_idle=models_idle, **shift) for r in runs]
    files, chosen = resolved[0]
    settings = chosen.server
    if slot_save_path is None:
        saves = _slot_folder(settings.slot_save_path)
    router = _router(resolved, settings) if len(resolved) > 1 else None
    if router is None:
        preflight(files, chosen, parallel=settings.parallel)  # headers only: fails before the port is taken
    sock = listen(settings.host, settings.port)
    bound_port = sock.getsockname()[1]
    guard = GuardSettings(bound_host=sock.getsockname()[0], max_requests=settings.max_requests,
                          allowed_hosts=(settings.host.lower(), *_names(settings.allowed_hosts)),
                          read_timeout=settings.read_timeout)
    state = ServerState(model_id=model_id(files), aliases=settings.model_alias_names, api_key=key,
                        max_tokens=max_tokens, seed=run.seed, control_tokens=settings.control_tokens, guard=guard,
                        metrics=settings.metrics, slots=settings.slots, strict_model=settings.strict_model,
                        slot_save_path=saves, router=router)
    app = create_app(state, tuple(cors_origin or ()))

    console = Console(highlight=False)
    _route_logs_to(console)
    url = f"http://{_url_host(settings.host)}:{bound_port}/v1"
    draft_name = files.draft.name if files.draft else "none (plain decoding)"
    what = (f"pair [cyan]{escape(files.name)}[/]: target {escape(files.target.name)}, draft {escape(draft_name)}"
            if router is None else "pairs " + ", ".join(f"[cyan]{escape(n)}[/]" for n in router.pairs) +
            " (loaded on demand: " + ("free memory decides" if router.budget is None else
                                       f"within {router.budget >> 20} MiB") + ")")
    console.print(
        f"[bold]localspec serve[/] · {what}\n"
        f"base URL [bold]{escape(url)}[/] · model id" + ("s " if router is not None else " ") +
        f"[cyan]{escape(state.model_id if router is None else ', '.join(router.pairs))}[/]"
        f"{escape(' (also ' + ', '.join(state.aliases) + ')') if state.aliases else ''} · "
        f"{'API key required' if key else 'no API key'} · {_plural(settings.parallel, 'slot')} · "
        f"queue {settings.queue} · Ctrl-C stops"
    )
    if not is_loopback(sock.getsockname()[0]) and key is None:
        console.print(f"[yellow]warning: listening on {escape(settings.host)} without --api-key: anyone who can "
                      "reach this port can use the models (requests naming another Host than loopback or "
                      "--allowed-hosts get 403)[/]")

    loaded: dict[str, Any] = {}

    def on_exit() -> None:  # a shutdown signal cancels the engine's work at once instead of waiting for it
        if router is not None:
            router.stop_workers()
        if state.backend is not None:
            state.backend.worker.shutdown(timeout=0)

    server = uvicorn_server(app, on_exit, settings.header_timeout, settings.read_timeout)

    def load() -> None:
        try:
            session = open_session(files, chosen, parallel=settings.parallel, prompt_cache=True)
            loaded["session"] = session
            state.attach(Backend.build(session.engine, session.target, chosen, settings.queue))
            if server.should_exit:  # Ctrl-C while loading
                state.backend.worker.shutdown()  # type: ignore[union-attr]
        except BaseException as exc:  # reported after the server stops
            loaded["error"] = exc
            state.load_error = str(exc)
            server.should_exit = True

    loader = threading.Thread(target=load, name="localspec-load", daemon=True)
    if router is None:  # several pairs load when a request first names one
        loader.start()
    try:
        with Live(console=console, refresh_per_second=2, get_renderable=lambda: _status(state, files)):
            _run_quietly(server, sock)
        console.print("[dim]localspec serve stopped[/]")
    finally:
        if loader.is_alive():
            loader.join()
        if router is not None:
            router.close()
        session: Session | None = loaded.get("session")
        if session is not None and state.backend is None:  # its engine thread never started
            session.close()
        elif session is not None and state.backend is not None:  # never freed under a running decode
            state.backend.worker.stop_then_free(session.close, f"pair {state.model_id!r}")
        sock.close()
    if "error" in loaded:
        raise loaded["error"]


def _pair_runs(run: options.RunOptions, pairs: list[str],
               model_alias: list[str] | None) -> list[options.RunOptions]:
    """One run per `--pair` (the others' options shared); none given: the run as it is."""
    if len(pairs) <= 1:
        return [dataclasses.replace(run, pair=pairs[0] if pairs else None)]
    if run.target is not None:
        raise UsageError("--target with several --pair: serve named pairs only (a file pair goes in models.toml)")
    if model_alias:
        raise UsageError("--model-alias with several --pair: each pair is requested by its own name")
    if run.mmproj is not None:
        raise UsageError("--mmproj with several --pair: a projector fits one target (serve that pair alone)")
    twice = next((p for i, p in enumerate(pairs) if p in pairs[:i]), None)
    if twice is not None:
        raise UsageError(f"--pair {twice}: given twice")
    return [dataclasses.replace(run, pair=p) for p in pairs]


def _router(resolved: list[tuple[ModelFiles, Any]], settings: Any) -> Any:
    """Several pairs: each checked from its headers now (before the port is taken), loaded on demand later."""
    from localspec.server.router import PairRouter, SessionLoader, served_pair, shared_cache

    served = [served_pair(f, preset, model_id(f), settings.parallel) for f, preset in resolved]
    cache = shared_cache(settings)  # one prompt-cache budget for every pair, counted within models_budget
    return PairRouter(served, SessionLoader(settings.parallel, settings.queue, cache), budget=settings.budget_bytes,
                      idle_s=settings.models_idle, cache=cache)


def _slot_folder(text: str) -> Path | None:
    """`--slot-save-path`'s folder, made if missing and proven writable before the port is taken (None: off)."""
    text = text.strip()
    if not text:
        return None
    if "\n" in text or "\0" in text:
        raise LocalspecError(f"--slot-save-path {text!r}: a path on one line")
    folder = Path(text).expanduser()
    if folder.exists() and not folder.is_dir():
        raise LocalspecError(f"--slot-save-path {text}: is not a folder")
    check_writable(folder / ".localspec-probe", what="--slot-save-path", parents=True)
    return folder.resolve()


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip().lower() for n in text.split(",") if n.strip())


def _api_key(given: str | None) -> str | None:
    """An empty key (an unset variable in a service file) must not mean "no authentication"."""
    import os

    from_env = os.environ.get("LOCALSPEC_API_KEY")
    if (given is not None and not given.strip()) or (given is None and from_env is not None and not from_env.strip()):
        where = "--api-key" if given is not None and from_env != given else "LOCALSPEC_API_KEY"
        raise UsageError(f"{where} is empty: give a key, or leave it out to serve without one")
    return given


def uvicorn_server(app: Any, on_exit: Any, header_timeout: float, read_timeout: float) -> Any:
    """uvicorn's server with the guarded connection handling (localspec.server.guard), plus `on_exit` when a
    shutdown signal arrives (uvicorn itself would wait for in-flight requests to finish)."""
    import asyncio

    import uvicorn

    from localspec.server.guard import (
        ACCEPT_BATCH,
        LISTEN_BACKLOG,
        guarded_protocol,
        max_connections,
        quiet_accept_errors,
        raise_open_files_limit,
    )
    from localspec.server.handling import SHUTDOWN_GRACE_S

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            on_exit()

        async def startup(self, sockets: Any = None) -> None:
            quiet_accept_errors(asyncio.get_running_loop())
            await super().startup(sockets)
            for sock in sockets or ():  # uvicorn set the kernel's queue to ACCEPT_BATCH too: see guard.py
                sock.listen(LISTEN_BACKLOG)

    protocol = guarded_protocol(header_timeout, read_timeout, max_connections(raise_open_files_limit()))
    # uvicorn's own keep-alive timer (idle after a reply) follows the header deadline: one value for both.
    return Server(uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                 http=protocol, backlog=ACCEPT_BATCH, timeout_keep_alive=header_timeout,
                                 timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 5))


def _run_quietly(server: Any, sock: socket.socket) -> None:
    """Run until a signal. uvicorn re-raises the signal that stopped it once it is done; with these no-op handlers
    in place the re-raised Ctrl-C ends nothing more, so the command returns and exits 0."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def model_id(files: ModelFiles) -> str:
    """The id clients send and /v1/models lists: the pair's name, or the target file's name for custom paths."""
    return files.target.stem if files.name == "custom" else files.name


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; a busy port or an unknown host is a one-line error."""
    from localspec.server.guard import LISTEN_BACKLOG

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise LocalspecError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise LocalspecError(f"cannot listen on {host}:{port}: {exc.strerror} (try another --port)") from None
    return sock


def is_loopback(address: str) -> bool:
    """Whether only this machine can connect (0.0.0.0 and :: mean every interface)."""
    return ipaddress.ip_address(address).is_loopback


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"  # where a browser on this machine reaches it
    return f"[{host}]" if ":" in host else host


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _status(state: ServerState, files: ModelFiles) -> Text:
    """The live line: loading, or requests served/queued and the last request's speed and acceptance."""
    backend = state.backend
    if state.router is not None:
        return Text(f"● {state.router.summary()}", style="green")  # type: ignore[attr-defined]
    if backend is None:
        if state.load_error:
            return Text(f"● failed to load: {state.load_error}", style="red")
        return Text(f"● loading {files.target.name} …", style="yellow")
    worker, stats = backend.worker, backend.worker.stats
    line = Text("● ", style="green" if not stats.busy else "cyan")
    busy = f"generating {stats.running}/{worker.slots}" if worker.slots > 1 else "generating"
    line.append(f"{busy if stats.busy else 'ready'} · served {stats.served} · queued {worker.queued}")
    if worker.slots > 1 and not worker.engine.batches_slots:
        line.append(" · slots take turns (llama.cpp's batches of several sequences are not exact for this model)")
    if stats.cancelled:
        line.append(f" · cancelled {stats.cancelled}")
    if stats.rejected:
        line.append(f" · turned away {stats.rejected} (queue full)")
    cache = worker.engine.prompt_cache
    if cache is not None and len(cache):
        line.append(f" · prompt cache {_plural(len(cache), 'prompt')}, {cache.nbytes / 2**30:.2f} of "
                    f"{cache.limit / 2**30:.1f} GiB")
    if stats.last is not None:
        last = stats.last.stats
        accepted = drafting_note(last, stats.last.aside)
        line.append(f" · last: {last.tokens} tokens, {last.decode_tps:.1f} tok/s, {accepted}, mean accepted "
                    f"{last.mean_accepted:.2f}, prompt {stats.last.prompt_n}/{last.prompt_tokens} processed",
                    style="dim")
    return line


class _ConsoleHandler(logging.Handler):
    """Server log lines printed through rich, so they land above the live status line, not through it."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.WARNING)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:  # only under LOCALSPEC_DEBUG=1 (see server/app.py)
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self.console.print(Text(text, style="red" if record.levelno >= logging.ERROR else "yellow"))


def _route_logs_to(console: Console) -> None:
    handler = _ConsoleHandler(console)
    for name in ("localspec.server", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False


def register(app: typer.Typer) -> None:
    app.command()(serve)

