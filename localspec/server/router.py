"""Several pairs behind one endpoint (`localspec serve --pair A --pair B`), as llama-server's router mode serves
several models: a request's `model` picks the pair, a pair loads when a request first needs it and unloads when
another needs its room (least recently used first) or after `[server] models_idle` seconds idle.

Memory: before a load the pair's estimate (session.preflight: memory.estimate over the GGUF headers, checked
against the free VRAM, or RAM on a CPU-only machine, measured then) must fit, and with `[server] models_budget`
in MiB the loaded pairs' estimates together must stay within it. Other pairs are unloaded until it fits.

A request holds its pair (a lease) from the moment its route picks it until its response has been sent, streamed
or not, whatever way it ends (`ReleaseLeases`, the innermost ASGI middleware, lets go): a pair with a lease is
never unloaded. One that must make room while busy drains instead: it shows "unloading", takes no new requests
(they wait, then load it again) and unloads when its last running one ends; the request that needs the room waits
for that. `POST /models/unload` of a busy pair is deferred the same way (it answers at once). A 503 only when a
pair cannot fit even with every other pair unloaded. A waiting request whose client leaves (a timeout, a closed
connection) stops waiting, and a drain begun only to make its room is called off: the busy pair stays loaded, as
llama-server keeps it.

The prompt caches of the loaded pairs share one budget (`[server] cache_ram`, `shared_cache`), which the router
counts against `models_budget` beside the pairs' estimates. A pair is freed only once its engine thread has
ended (`Worker.stop_then_free`): one that does not end in time keeps its models, leaked, and a warning says so.

Every decision runs on the event loop; loading and freeing a pair (seconds) run in a thread, loads one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from localspec import machine
from localspec.config import Preset, ServerSettings
from localspec.errors import LocalspecError
from localspec.models.memory import Estimate, GiB
from localspec.rounds.prompt_cache import AUTO_SHARE, CacheBudget, limit_bytes
from localspec.server.errors import ApiError, client_gone, shutting_down
from localspec.server.guard import UNBOUNDED_BODY_BYTES
from localspec.server.handling import Backend, ServerState, guarded, read_body
from localspec.server.schema import parse_body
from localspec.sessions.session import ModelFiles, Session, open_session, preflight

LEASES_KEY = "localspec.leases"  # in an ASGI scope: what to call once its response has been sent
log = logging.getLogger("localspec.server")

UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"


def footprint(est: Estimate) -> int:
    """What a pair takes of the memory a budget counts: this machine's GPUs where it offloads, else RAM."""
    return est.gpu_bytes if est.devices.gpu_offload else est.ram_bytes


@dataclass(frozen=True)
class Loaded:
    backend: Backend
    close: Callable[[], bool]  # stops its worker and frees its models (blocking); False: left loaded (leaked)


class Loader(Protocol):
    """How the router loads a pair and asks whether it fits now (a fake one in the fast tests)."""

    def load(self, pair: ServedPair) -> Loaded: ...

    def shortfall(self, pair: ServedPair) -> str | None:
        """Why the pair does not fit the free memory now (None: it fits)."""
        ...


@dataclass
class ServedPair:
    name: str
    files: ModelFiles
    preset: Preset
    footprint: int  # bytes, from the pair's memory estimate (`footprint`)
    status: str = UNLOADED
    loaded: Loaded | None = None
    leases: int = 0  # requests holding it (from the route's pick until their response is sent)
    last_used: float = 0.0  # time.monotonic() of the last lease taken or given back
    unload_wanted: bool = False  # POST /models/unload while busy: unload when the last lease ends
    for_room: bool = False  # ... and drained only to make room for a waiting request (called off if it leaves)
    error: str | None = None  # why the last load failed
    unloaded: asyncio.Event = field(default_factory=asyncio.Event)  # set while not loaded (waiters of a drain)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) when unloaded or kept

    def wake(self) -> None:
        """Tell the requests waiting for this pair's drain that it ended (unloaded, or called off)."""
        woken, self.changed = self.changed, asyncio.Event()
        woken.set()

    @property
    def backend(self) -> Backend | None:
        return self.loaded.backend if self.loaded is not None else None

    @property
    def idle(self) -> bool:
        return self.status == LOADED and self.leases == 0

    def listing(self, created: int) -> dict[str, Any]:
        """Its entry in /v1/models, in llama-server's router shape (`status.value`); files by name, never where
        they live on this machine."""
        status: dict[str, Any] = {"value": self.status}
        if self.error is not None and self.status == UNLOADED:
            status.update(failed=True, message=self.error)
        return {"id": self.name, "object": "model", "created": created, "owned_by": "localspec", "status": status,
                "path": self.files.target.name, "draft_path": self.files.draft.name if self.files.draft else None}

    def unplaced(self, text: str) -> str:
        """`text` with the pair's file paths shown by name (a load error's message, for clients)."""
        for path in (self.files.target, self.files.draft):
            if path is not None:
                text = text.replace(str(path), path.name)
        return text


class SessionLoader:
    """The real loader: `open_session` (which checks the memory estimate again) and a `Backend` with its worker."""

    def __init__(self, parallel: int, queue: int, cache: CacheBudget | None = None) -> None:
        self.parallel = parallel
        self.queue = queue
        self.cache = cache  # the prompt-cache budget every pair's cache shares

    def load(self, pair: ServedPair) -> Loaded:
        session = open_session(pair.files, pair.preset, parallel=self.parallel, prompt_cache=True,
                               cache_budget=self.cache)
        try:
            backend = Backend.build(session.engine, session.target, pair.preset, self.queue)
        except BaseException:
            session.close()
            raise
        backend.model_id = pair.name
        return Loaded(backend, functools.partial(_close, backend, session, pair.name))

    def shortfall(self, pair: ServedPair) -> str | None:
        try:
            preflight(pair.files, pair.preset, parallel=self.parallel)
        except LocalspecError as exc:
            return str(exc)
        return None


def _close(backend: Backend, session: Session, name: str) -> bool:
    return backend.worker.stop_then_free(session.close, f"pair {name!r}")  # never freed under a running decode


def shared_cache(settings: ServerSettings) -> CacheBudget:
    """The prompt-cache budget every loaded pair's cache shares: `cache_ram`, "auto" as with one pair (a quarter
    of the RAM available now), and with `models_budget` at most a quarter of that budget too, since it counts
    there. A `cache_ram` that leaves the pairs nothing of `models_budget` is an error."""
    budget = settings.budget_bytes
    limit = limit_bytes(settings.cache_ram, machine.ram_available())
    if budget is not None and settings.cache_ram == "auto":
        limit = min(limit, int(budget * AUTO_SHARE))
    if budget is not None and limit >= budget:
        raise LocalspecError(f"cache_ram = {settings.cache_ram} MiB is all of models_budget = {budget >> 20} MiB, "
                             "which holds the prompt cache and the loaded pairs together: lower --cache-ram or "
                             "raise --models-budget")
    return CacheBudget(limit)


class PairRouter:
    def __init__(self, pairs: list[ServedPair], loader: Loader, *, budget: int | None = None,
                 idle_s: float = 0.0, cache: CacheBudget | None = None) -> None:
        self.pairs = {p.name: p for p in pairs}
        self.loader = loader
        self.budget = budget  # bytes the loaded pairs' footprints may take together (None: free memory decides)
        self.cache = cache  # the pairs' prompt caches' shared budget, counted within `budget` (`_used`)
        self.idle_s = idle_s
        self.loads = 0  # pairs loaded since the start (and unloads: the tests follow the swaps)
        self.unloads = 0
        # Bytes of pairs whose engine thread did not end when they were unloaded: their models were left loaded
        # (never freed under a running decode), so their memory still counts against the budget (`_used`).
        self.leaked = 0
        self._lock: asyncio.Lock | None = None  # made on the event loop, at first use
        self._sweeper: asyncio.Task | None = None
        self._closed = False
        for p in pairs:
            p.unloaded.set()

    # -- what the routes ask ----------------------------------------------------------------------------------

    def find(self, name: str | None) -> ServedPair:
        if name is None or name == "":
            raise ApiError(400, f"model: this server serves several pairs, name one of {self._names()}",
                           param="model", code="model_missing")
        if name not in self.pairs:
            raise ApiError(404, f"model {name!r} is not served here; this server serves {self._names()}",
                           param="model", code="model_not_found")
        return self.pairs[name]

    async def acquire(self, name: str | None, scope: MutableMapping[str, Any],
                      receive: Receive | None = None) -> Backend:
        """The backend of the pair `name`, loaded if need be, held until the response to `scope` has been sent.
        With `receive` (the request's, its body read), a client that leaves while this waits ends the wait (a 499;
        a drain begun for its room is called off)."""
        pair = self.find(name)
        if pair.status == LOADED and not pair.unload_wanted:
            return self._lease(pair, scope)
        left = asyncio.Event()
        watcher = asyncio.create_task(_departure(receive, left)) if receive is not None else None
        try:
            return await self._wait_for(pair, scope, left)
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _wait_for(self, pair: ServedPair, scope: MutableMapping[str, Any], left: asyncio.Event) -> Backend:
        while True:
            if left.is_set():
                raise _left()
            if pair.status == LOADED and not pair.unload_wanted:
                return self._lease(pair, scope)
            if pair.status in (LOADED, UNLOADING):  # draining or being freed: wait, then load it (or it is kept)
                await _until(pair.changed, left)
                continue
            async with self._guard():
                if pair.status != UNLOADED:  # another request loaded it meanwhile
                    continue
                await self._load(pair, left)
                return self._lease(pair, scope)

    def release(self, pair: ServedPair) -> None:
        pair.leases -= 1
        pair.last_used = time.monotonic()
        if pair.leases == 0 and pair.unload_wanted:
            asyncio.get_running_loop().create_task(self._drain(pair))

    async def load(self, name: str) -> dict[str, Any]:
        """POST /models/load: load it now (answers once it is loaded, or with the 503 that says why not)."""
        pair = self.find(name)
        if pair.status in (LOADED, LOADING) and not pair.unload_wanted:
            raise ApiError(400, f"model {name!r} is already running", param="model", code="model_loaded")
        scope: dict[str, Any] = {}
        await self.acquire(name, scope)
        for release in scope[LEASES_KEY]:
            release()
        return {"success": True}

    async def unload(self, name: str) -> dict[str, Any]:
        """POST /models/unload: unloaded now when idle; with requests running, when the last one ends."""
        pair = self.find(name)
        if pair.status == UNLOADED:
            raise ApiError(400, f"model {name!r} is not running", param="model", code="model_not_loaded")
        if pair.status != LOADED or pair.leases or pair.unload_wanted:
            pair.unload_wanted, pair.for_room = True, False  # asked for: not called off with a waiting request
            if pair.status == LOADED:
                pair.status = UNLOADING
            return {"success": True, "deferred": True, "requests": pair.leases}
        async with self._guard():
            if pair.status == LOADED and pair.leases == 0:
                await self._unload(pair)
        return {"success": True}

    def listing(self, created: int) -> list[dict[str, Any]]:
        return [p.listing(created) for p in self.pairs.values()]

    def health(self) -> dict[str, Any]:
        """/health: the router answers at once; its counters are the loaded pairs' together."""
        workers = [p.backend.worker for p in self.pairs.values() if p.backend is not None]
        busy = any(w.stats.busy for w in workers) or any(p.leases for p in self.pairs.values())
        return {"status": "ok", "busy": busy,
                "running": sum(w.stats.running for w in workers), "queued": sum(w.queued for w in workers),
                "served": sum(w.stats.served for w in workers), "loads": self.loads, "unloads": self.unloads,
                "models": [{"id": p.name, "status": p.status, "requests": p.leases} for p in self.pairs.values()]}

    def body_limit(self) -> int:
        """A request may name a pair not loaded yet, whose tokenizer cannot bound its prompt's bytes."""
        return max([UNBOUNDED_BODY_BYTES] + [p.backend.limits.body_bytes for p in self.pairs.values()
                                             if p.backend is not None])

    def summary(self) -> str:
        """The live status line's part: each pair and its state."""
        return " · ".join(f"{p.name} {p.status}" + (f" ({p.leases} req)" if p.leases else "")
                          for p in self.pairs.values())

    # -- shutdown (from the serve command's thread, the event loop stopped or stopping) --------------------------

    def stop_workers(self) -> None:
        """Cancel every pair's running and queued jobs at once (a shutdown signal)."""
        self._closed = True
        for p in self.pairs.values():
            if p.backend is not None:
                p.backend.worker.shutdown(timeout=0)

    def close(self) -> None:
        self._closed = True
        for p in self.pairs.values():
            if p.loaded is not None:
                p.loaded.close()
                p.loaded, p.status = None, UNLOADED

    # -- the work ---------------------------------------------------------------------------------------------

    def _names(self) -> str:
        return ", ".join(repr(n) for n in self.pairs)

    def _guard(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _lease(self, pair: ServedPair, scope: MutableMapping[str, Any]) -> Backend:
        assert pair.backend is not None
        pair.leases += 1
        pair.last_used = time.monotonic()
        scope.setdefault(LEASES_KEY, []).append(functools.partial(self.release, pair))
        return pair.backend

    @property
    def cache_bytes(self) -> int:
        """What the pairs' prompt caches may take together: counted within the budget whatever they hold now."""
        return self.cache.limit if self.cache is not None else 0

    def _used(self, but: ServedPair) -> int:
        return self.leaked + sum(p.footprint for p in self.pairs.values() if p is not but and p.status != UNLOADED)

    def _cache_words(self) -> str:
        return f" and the prompt cache's {self.cache_bytes / GiB:.2f} GiB (cache_ram)" if self.cache_bytes else ""

    async def _shortfall(self, pair: ServedPair) -> str | None:
        if self.budget is not None and self._used(pair) + self.cache_bytes + pair.footprint > self.budget:
            return (f"its estimate of {pair.footprint / GiB:.2f} GiB{',' if self.cache_bytes else ' and'} the loaded "
                    f"pairs' {self._used(pair) / GiB:.2f} GiB{self._cache_words()} exceed models_budget = "
                    f"{self.budget >> 20} MiB")
        return await anyio.to_thread.run_sync(self.loader.shortfall, pair)

    async def _load(self, pair: ServedPair, left: asyncio.Event) -> None:
        """Make room, then load `pair` (the lock held). Idle pairs go first, least recently used first; while a
        busy pair holds the room, the least recently used of them takes no new requests and this waits until its
        running ones end and it is freed. A 503 only where the pair cannot fit with every other pair unloaded.
        The client leaving (`left`) while this waits calls off the drains it began (`_call_off`)."""
        if self._closed:
            raise shutting_down()
        if left.is_set():
            raise _left()
        if self.budget is not None and pair.footprint + self.cache_bytes > self.budget:
            raise ApiError(503, f"pair {pair.name!r} cannot be loaded: its estimate of {pair.footprint / GiB:.2f} "
                                f"GiB{self._cache_words()} is more than models_budget = {self.budget >> 20} MiB",
                           kind="server_error", code="model_too_large")
        begun: list[ServedPair] = []  # the pairs this load set draining for its room
        while (why := await self._shortfall(pair)) is not None:
            others = [p for p in self.pairs.values() if p is not pair and p.status != UNLOADED]
            idle = sorted((p for p in others if p.idle and not p.unload_wanted), key=lambda p: p.last_used)
            if idle:
                await self._unload(idle[0])
                continue
            if not others:
                raise ApiError(503, f"pair {pair.name!r} cannot be loaded: {why}", kind="server_error",
                               code="model_too_large")
            draining = [p for p in others if p.status == UNLOADING or p.unload_wanted]
            if not draining:
                victim = min(others, key=lambda p: p.last_used)
                victim.unload_wanted, victim.for_room, victim.status = True, True, UNLOADING
                begun.append(victim)
                draining = [victim]
            try:
                await _until(draining[0].unloaded, left)  # its last request's release unloads it (`_drain`)
            except BaseException:  # the client left (or the server stops): nothing waits for that room now
                self._call_off(begun)
                raise
        pair.status, pair.error = LOADING, None
        pair.unloaded.clear()
        try:
            loaded = await anyio.to_thread.run_sync(self.loader.load, pair)
        except Exception as exc:
            detail = str(exc) if isinstance(exc, LocalspecError) else f"{type(exc).__name__}: {exc}"
            log.error("pair %r failed to load: %s", pair.name, detail, exc_info=exc if _debug() else None)
            # Clients see the class name of an unexpected failure, and files by name (the log has it all).
            pair.status = UNLOADED
            pair.error = pair.unplaced(str(exc)) if isinstance(exc, LocalspecError) else type(exc).__name__
            pair.unloaded.set()
            raise ApiError(503, f"pair {pair.name!r} failed to load: {pair.error}", kind="server_error",
                           code="model_load_failed") from None
        pair.loaded, pair.status = loaded, LOADED
        pair.last_used = time.monotonic()
        self.loads += 1
        if self._closed:  # a shutdown came while it loaded
            await self._unload(pair)
            raise shutting_down()
        if pair.unload_wanted:  # POST /models/unload while it loaded
            pair.status = UNLOADING
        self._start_sweeper()

    def _call_off(self, begun: list[ServedPair]) -> None:
        """The request these drains were begun for has left: each pair still draining (not yet being freed) takes
        requests again, and the requests that waited for it go on."""
        for p in begun:
            if p.for_room and p.unload_wanted and p.loaded is not None and p.status == UNLOADING:
                p.unload_wanted, p.for_room, p.status = False, False, LOADED
                p.wake()

    async def _unload(self, pair: ServedPair) -> None:
        assert pair.loaded is not None and pair.leases == 0
        pair.status = UNLOADING
        loaded, pair.loaded = pair.loaded, None
        freed = False
        try:
            freed = await anyio.to_thread.run_sync(loaded.close)
        finally:
            if not freed:
                self.leaked += pair.footprint
            pair.status, pair.unload_wanted, pair.for_room = UNLOADED, False, False
            self.unloads += 1
            pair.unloaded.set()
            pair.wake()

    async def _drain(self, pair: ServedPair) -> None:
        """Unload a pair whose last request just ended. Not under the lock: a load that waits for this room holds
        it. Its memory counts as used (`_used`) until it is freed."""
        if pair.unload_wanted and pair.leases == 0 and pair.loaded is not None:
            await self._unload(pair)

    def _start_sweeper(self) -> None:
        if self.idle_s > 0 and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Unload pairs idle for `idle_s` (asyncio.run cancels this task when the server stops)."""
        while True:
            await asyncio.sleep(min(self.idle_s, 1.0))
            now = time.monotonic()
            for pair in list(self.pairs.values()):
                if pair.idle and not pair.unload_wanted and now - pair.last_used >= self.idle_s:
                    async with self._guard():
                        if pair.idle and time.monotonic() - pair.last_used >= self.idle_s:
                            await self._unload(pair)


def _left() -> ApiError:
    return client_gone("the client disconnected while its pair was being made ready")


async def _departure(receive: Receive, left: asyncio.Event) -> None:
    """Set `left` when the client disconnects (the request's body has been read: nothing else arrives)."""
    with contextlib.suppress(OSError, RuntimeError):
        while (await receive())["type"] != "http.disconnect":
            pass
    left.set()


async def _until(event: asyncio.Event, left: asyncio.Event) -> None:
    """Wait for `event`; a 499 (`_left`) if the client leaves first."""
    if not event.is_set():
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(left.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
    if left.is_set():
        raise _left()


def _debug() -> bool:
    return os.environ.get("LOCALSPEC_DEBUG", "") not in ("", "0")


class ReleaseLeases:
    """Innermost ASGI middleware: once a response has been sent (or the client left, or it failed), the pairs its
    route picked are let go. Pure ASGI, so a streamed response is not buffered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            for release in scope.pop(LEASES_KEY, ()):
                with contextlib.suppress(Exception):
                    release()


def served_pair(files: ModelFiles, preset: Preset, name: str, parallel: int) -> ServedPair:
    """A pair to serve, checked from its headers now (a mismatch or one that can never fit fails before the port is
    taken), with its footprint from the same estimate."""
    est = preflight(files, preset, parallel=parallel).estimate
    return ServedPair(name=name, files=files, preset=preset, footprint=footprint(est))




def add_router_routes(app: FastAPI, state: ServerState) -> None:
    """llama-server's router routes: POST /models/load and /models/unload with `{"model": NAME}`."""

    async def change(request: Request) -> JSONResponse:
        data = parse_body(await read_body(request))
        if not isinstance(data, dict) or set(data) - {"model"}:
            raise ApiError(400, 'the request body must be {"model": NAME}', param="model", code="invalid_value")
        name = data.get("model")
        if not isinstance(name, str):
            raise ApiError(400, 'model: a pair\'s name is required ({"model": NAME})', param="model",
                           code="invalid_value")
        router = state.router
        if not isinstance(router, PairRouter):
            raise ApiError(501, "this server serves one pair, loaded at start; load and unload need several: "
                                "localspec serve --pair A --pair B", kind="not_supported_error",
                           code="router_disabled")
        load = request.url.path.endswith("/load")
        return JSONResponse(await (router.load(name) if load else router.unload(name)))

    for path in ("/models/load", "/models/unload"):
        app.add_api_route(path, guarded(change), methods=["POST"])
