"""What stands between the network and the routes: limits a web page, a LAN neighbour or one big request cannot
get past. Every route gets them, including routes added later, because they are ASGI middleware and a uvicorn
protocol, not per-route code.

- `Guard` (ASGI middleware): without an API key, a `Host` header must name the bound address or a loopback name
  (a web page that rebinds its DNS name to 127.0.0.1 sends its own name; `[server] allowed_hosts` adds more); with
  one, every request but /health and a CORS preflight must carry it (401, before anything else is looked at:
  its size, its type); a POST must say `Content-Type: application/json` (a cross-site "simple request" cannot,
  without a CORS preflight); at most `max_requests` requests are handled at once (more: 503 at once; /health is
  exempt, it is what a monitor asks when everything else is busy); a body is read whole here within
  `read_timeout`, refused as soon as it passes what any prompt the context can hold needs
  (`PromptLimits.body_bytes`), then replayed to the route. A refusal sent before the body was read leaves the
  connection open: uvicorn then reads the rest of the body and drops it (bounded, `guarded_protocol`), so a client
  that writes its whole body before reading sees the refusal, not a reset; a connection that closes after it
  (`Connection: close`, HTTP/1.0) lingers as long to read and drop it.
- `Cors` (ASGI middleware, outside `Guard`): CORS as llama-server answers it (its pre-routing handler): every
  OPTIONS request is a 200 with its methods and headers lists and nothing else (no key asked: a browser's preflight
  carries none), and an allowed `Origin` is echoed on every response, refusals included.
- `guarded_protocol`: uvicorn's h11 protocol with a deadline for each request's headers (h11 and uvicorn have none:
  uvicorn's keep-alive timeout is disarmed by the first byte, so a slowloris client sending a header line every
  few seconds, or a silent socket, stays forever) and one for a reply the client does not take (a client that
  sends nothing and reads nothing kept its connection, the reply's buffers and its job forever), a lingering close
  (uvicorn closes a `Connection: close` request's socket right after the reply: with the client's body still
  unread there, the kernel answers with a reset that can destroy the reply before the client reads it), a cap on open
  connections that closes the longest-idle one when full (uvicorn's `limit_concurrency` counts idle connections
  too and answers plain-text 503s, so 1,000 idle sockets would make /health a 503), an answer for half-closed
  requests (uvicorn closes on EOF, before replying), and the question that tells such a client from one that
  left (`_probe`): TCP shows both as EOF.
- `raise_open_files_limit`, `quiet_accept_errors`: the soft open-files limit raised to the hard one at start, and
  asyncio's per-event "out of system resource" traceback for a failed accept() logged once instead.
- `PromptLimits`: the bounds a prompt must pass before it is rendered or tokenized in full.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import resource
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from localspec.config import ImageSettings
from localspec.server.errors import ApiError, context_exceeded
from localspec.server.schema import MAX_STOP_CHARS, MAX_STOPS

log = logging.getLogger("localspec.server")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
UNGUARDED_PATHS = ("/health", "/v1/health")  # answered even when max_requests are running, and without the key
MIN_BODY_BYTES = 1 << 20  # room for any ordinary request, whatever the context
UNBOUNDED_BODY_BYTES = 16 << 20  # where a tokenizer can fold long runs into one token (no byte bound per token)
JSON_ESCAPE = 6  # the most bytes JSON needs for one byte of text (a control character as \u0001)
PER_TOKEN_OVERHEAD = 64  # JSON per message (role, braces) when every message is one token
# asyncio accepts up to uvicorn's `backlog` connections per loop turn, and they reach a protocol (which counts and
# sheds them) only two or three turns later, while a closed connection's file is released a turn after closing:
# uvicorn's default of 2048 per turn overshoots any cap (even 128 per turn ran out of files: the hostile-requests
# note in docs/lab/). So asyncio takes 32 per turn, the cap keeps room for eight turns, and the kernel's queue of
# waiting connections is set larger again after uvicorn starts, so bursts wait there instead of being dropped.
ACCEPT_BATCH = 32
LISTEN_BACKLOG = 1024
FD_RESERVE = 8 * ACCEPT_BATCH
MAX_SOFT_NOFILE = 1 << 16
# A client's EOF during a request is a half-close (it still reads the answer) or a departure; only bytes sent to it
# tell them apart (a departed client's kernel answers them with a reset). The question is asked this soon after the
# EOF, and the answer looked for this often, so a departed client's work stops well within 2 s.
PROBE_AFTER_S = 0.2
PROBE_EVERY_S = 0.2
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"  # an interim answer every HTTP/1.1 client must accept and skip
# A streamed reply's scope names bytes that mean nothing to its client (an SSE comment): the question asked once
# the response has started.
PROBE_BYTES_KEY = "localspec.probe_bytes"
# A body refused before it was read is read and dropped up to this much, within `read_timeout`; past either the
# connection is closed (a reset, for a client still sending).
DRAIN_BYTES = 256 << 20

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# -- prompt bounds ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt of at most `n_ctx` tokens can be. `max_piece_bytes`: the longest text any one token stands
    for (None when the tokenizer normalizes text, e.g. folds runs of spaces, so bytes do not bound tokens)."""

    n_ctx: int
    max_piece_bytes: int | None
    picture_bytes: int = 0  # the room a request's pictures may take besides its text (`picture_room`)

    @property
    def text_chars(self) -> int | None:
        """A text with more characters than this has more than n_ctx tokens (each token covers at most
        max_piece_bytes bytes, and a character is at least one byte), so it is refused before tokenizing."""
        return None if self.max_piece_bytes is None else self.n_ctx * self.max_piece_bytes

    @property
    def body_bytes(self) -> int:
        """The largest request body worth reading: a full context of the longest tokens, JSON-escaped, one
        message per token, plus every stop string."""
        if self.text_chars is None:
            return UNBOUNDED_BODY_BYTES
        stops = MAX_STOPS * MAX_STOP_CHARS * JSON_ESCAPE
        text = JSON_ESCAPE * self.text_chars + PER_TOKEN_OVERHEAD * self.n_ctx + stops
        return max(MIN_BODY_BYTES, text + self.picture_bytes)

    def check_text(self, text: str, param: str) -> None:
        if self.text_chars is not None and self.max_piece_bytes is not None and len(text) > self.text_chars:
            at_least = -(-len(text.encode("utf-8", "surrogatepass")) // self.max_piece_bytes)  # tokens
            raise ApiError(400,
                f"{param}: {len(text)} characters are more than {self.n_ctx} tokens (no token of this model stands "
                f"for more than {self.max_piece_bytes} bytes) and the context holds {self.n_ctx}: prompt and reply "
                "must fit", param=param, **context_exceeded(at_least, self.n_ctx))

    def check_messages(self, contents: list[str]) -> None:
        """Before the chat template runs: a message takes at least one token, and the text bound holds for all
        messages together."""
        if len(contents) >= self.n_ctx:
            raise ApiError(400, f"messages: {len(contents)} messages cannot fit a context of {self.n_ctx} tokens",
                           param="messages", **context_exceeded(len(contents), self.n_ctx))
        self.check_text("".join(contents) if self.text_chars is not None else "", "messages")


def picture_room(images: ImageSettings, model: Any) -> int:
    """The bytes a request's pictures may take in its body with a projector loaded: `max_images` data: URIs of
    `max_image_bytes` each (base64: 4 bytes for 3, and the URI's prefix); none without a projector."""
    if getattr(model, "projector", None) is None:
        return 0
    return images.max_images * (4 * -(-images.max_image_bytes // 3) + 64)


# -- the middleware -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GuardSettings:
    bound_host: str = "127.0.0.1"  # the address the socket listens on
    allowed_hosts: tuple[str, ...] = ()  # more Host names answered without a key ("*" = any)
    max_requests: int = 64
    read_timeout: float = 20.0


class GuardedState(Protocol):
    """What the guard reads from the server's state (localspec.server.app.ServerState)."""

    api_key: str | None
    guard: GuardSettings

    def body_limit(self) -> int: ...


CORS_METHODS = b"GET, POST, DELETE, OPTIONS"  # llama-server's --cors-methods default
CORS_HEADERS = b"*"  # llama-server's --cors-headers default (browsers never let `*` cover Authorization)


class Cors:
    """llama-server's CORS: `origins` ("*" = any) are echoed in `Access-Control-Allow-Origin` with credentials
    allowed; another origin gets no such header, so the browser keeps the reply from the page. An OPTIONS request
    is answered here, 200 and empty, whatever its origin, as llama-server answers it."""

    def __init__(self, app: ASGIApp, origins: tuple[str, ...] = ()) -> None:
        self.app = app
        self.origins = origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = next((v for k, v in scope["headers"] if k.lower() == b"origin"), None)
        allowed = origin is not None and ("*" in self.origins or origin.decode("latin-1") in self.origins)
        echo = [(b"access-control-allow-origin", origin), (b"access-control-allow-credentials", b"true"),
                (b"vary", b"Origin")] if allowed else []
        if scope["method"] == "OPTIONS":
            headers = [*echo[:1], (b"access-control-allow-credentials", b"true"),
                       (b"access-control-allow-methods", CORS_METHODS), (b"access-control-allow-headers", CORS_HEADERS),
                       *echo[2:], (b"content-type", b"text/html"), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        if not echo:
            await self.app(scope, receive, send)
            return

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *echo]}
            await send(message)

        await self.app(scope, receive, with_cors)


class Guard:
    """Pure ASGI middleware (not BaseHTTPMiddleware: that would buffer streaming responses)."""

    def __init__(self, app: ASGIApp, state: GuardedState) -> None:
        self.app = app
        self.state = state
        self.running = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _respond(send, refusal)  # no `Connection: close`: see the module docstring
            return
        counted = scope["path"] not in UNGUARDED_PATHS
        if counted and self.running >= self.state.guard.max_requests:
            await _respond(send, ApiError(
                503, f"the server is handling {self.running} requests, its limit ([server] max_requests); retry later",
                kind="server_error", code="too_many_requests", headers={"Retry-After": "1"}))
            return
        self.running += counted
        try:
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(headers, receive, send)
                if body is None:
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, send)
        finally:
            self.running -= counted

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> ApiError | None:
        key = self.state.api_key
        if key is None and "host" in headers and not self._host_allowed(headers["host"]):
            allowed = ", ".join(self._allowed_names())
            return ApiError(
                403, f"Host {headers['host'][:100]!r} is not this server's address: without an API key only {allowed} "
                "are answered (a web page can point its own name at this machine); allow more with --allowed-hosts "
                "or [server] allowed_hosts, or set --api-key", param="Host", code="host_not_allowed")
        # A browser's CORS preflight carries no credentials (llama-server answers it without the key too).
        if key is not None and scope["path"] not in UNGUARDED_PATHS and scope["method"] != "OPTIONS" \
                and not _key_matches(headers, key):
            return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'",
                            kind="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if scope["method"] in ("POST", "PUT", "PATCH"):
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json" and not kind.endswith("+json"):
                return ApiError(
                    415, f"Content-Type must be application/json (got {kind[:60]!r}): a browser sends other types "
                    "cross-site without asking", param="Content-Type", code="unsupported_media_type")
        return None

    def _allowed_names(self) -> list[str]:
        settings = self.state.guard
        names = [*LOOPBACK_NAMES, settings.bound_host.lower(), *settings.allowed_hosts]
        return list(dict.fromkeys(n for n in names if n not in ("0.0.0.0", "::", "")))

    def _host_allowed(self, host: str) -> bool:
        names = self._allowed_names()
        if "*" in names:
            return True
        host = host.strip().lower()
        if host.startswith("["):  # [::1]:8080
            name = host[1 : host.find("]")] if "]" in host else host
        else:
            name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return name.rstrip(".") in names

    async def _read_body(self, headers: dict[str, str], receive: Receive, send: Send) -> bytes | None:
        """The whole body within the limit and the read timeout, or None once an error is sent (or the client
        left)."""
        limit = self.state.body_limit()
        too_large = ApiError(
            413, f"the request body is larger than {limit} bytes, more than any prompt this server's context can hold "
            "needs", code="request_too_large")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _respond(send, too_large)  # the connection drains the body: see the module docstring
            return None
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.state.guard.read_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        await _respond(send, too_large)
                        return None
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            await _respond(send, ApiError(
                408, f"the request body did not arrive within {self.state.guard.read_timeout:g} s ([server] "
                "read_timeout)", code="request_timeout", headers={"Connection": "close"}))
            return None


def _key_matches(headers: dict[str, str], key: str) -> bool:
    """`X-Api-Key: KEY` or `Authorization: Bearer KEY`, compared in constant time."""
    given = headers.get("x-api-key")
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if given is None and scheme.lower() == "bearer":
        given = token.strip()
    return bool(given) and hmac.compare_digest(given.encode(), key.encode())  # type: ignore[union-attr]


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body once, then the client's own messages (a disconnect, when it leaves)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _respond(send: Send, error: ApiError) -> None:
    """A refusal before any route: the error's own status, body and headers."""
    data = json.dumps(error.body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


# -- connections ----------------------------------------------------------------------------------------------


def raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one (desktops often start with 1024: a thousand idle sockets
    would then starve everything else); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_SOFT_NOFILE if hard == resource.RLIM_INFINITY else min(hard, MAX_SOFT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # a container may refuse: the connection cap below follows whatever limit holds
    return soft


def max_connections(open_files: int) -> int:
    """Connections kept open at most: the open-files limit less what the process needs besides."""
    return max(64, open_files - FD_RESERVE)


class _CloseAfterReply:
    """The transport as a request's cycle sees it: its `close` (uvicorn's, once the reply to a `Connection: close`
    or HTTP/1.0 request is sent) goes to `close`, the protocol's lingering close; the rest is the transport's."""

    def __init__(self, transport: asyncio.Transport, close: Callable[[], None]) -> None:
        self._transport = transport
        self._close = close

    def close(self) -> None:
        self._close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded_protocol(header_timeout: float, read_timeout: float, connection_cap: int) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a header deadline (`header_timeout`), a write deadline and a bounded drain of a
    refused body (`read_timeout`), a lingering close, a connection cap and half-close support (see the module
    docstring for why each is needed beyond what uvicorn and h11 offer)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # Connections waiting for a request head (or lingering), longest first (a dict keeps insertion order): shedding
    # is O(1).
    waiting: dict[Any, None] = {}

    class GuardedH11Protocol(H11Protocol):
        half_closed = False
        lingering = False  # the reply is sent and the write side shut: the rest of the body is read and dropped
        drained = 0  # bytes of a refused body read and dropped
        stalled: asyncio.TimerHandle | None = None  # the write deadline, while the client takes no bytes
        deadline: asyncio.TimerHandle | None = None  # for a request head, a refused body's rest, or a linger

        def data_received(self, data: bytes) -> None:
            if self.lingering:
                self._drop(len(data))
                return
            cycle = self.cycle
            if cycle is not None and cycle.response_complete and self.conn.their_state is h11.SEND_BODY:
                # A body refused before it was read: uvicorn drops it as it comes (keep-alive); bounded here.
                if self._drop(len(data)):
                    return
                super().data_received(data)
                if self.cycle is cycle and self.conn.their_state is not h11.SEND_BODY:
                    self._arm(header_timeout)  # all of it: now the next request's head is due
                return
            super().data_received(data)

        def _drop(self, size: int) -> bool:
            """Count dropped bytes; past DRAIN_BYTES the connection is closed (True)."""
            self.drained += size
            if self.drained > DRAIN_BYTES:
                self.transport.close()
                return True
            return False

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            super().connection_made(transport)  # type: ignore[arg-type]
            self._await_head()
            if len(self.connections) > connection_cap:
                self._shed_one()

        def connection_lost(self, exc: Exception | None) -> None:
            waiting.pop(self, None)
            for timer in (self.stalled, self.deadline):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            """The reply's bytes wait on the client (the socket's buffers are full): arm the write deadline."""
            super().pause_writing()
            if self.stalled is None:
                self.stalled = self.loop.call_later(read_timeout, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self.stalled is not None:
                self.stalled.cancel()
                self.stalled = None

        def _stalled(self) -> None:
            """The client has taken none of its reply for `read_timeout` (a slow-read attack, a hung client): it
            sends nothing and reads nothing, and would hold the connection, the reply's buffers and its job
            forever. Dropped (close would wait for the buffer to drain): the request sees the disconnect."""
            self.stalled = None
            self.transport.abort()

        def handle_events(self) -> None:
            super().handle_events()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:  # a request is running: not idle
                waiting.pop(self, None)
                if self.deadline is not None:
                    self.deadline.cancel()
                    self.deadline = None
                if not isinstance(cycle.transport, _CloseAfterReply):  # (its task has not run yet)
                    cycle.transport = _CloseAfterReply(self.transport, self._close_after_reply)

        def _arm(self, seconds: float) -> None:
            """The one deadline of an idle connection: past it, it is closed."""
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(seconds, self._deadline_passed, self.cycle)

        def _await_head(self) -> None:
            """Arm the deadline for the next request's headers (its cycle is not there yet)."""
            waiting.pop(self, None)
            waiting[self] = None
            self._arm(header_timeout)

        def _deadline_passed(self, cycle: Any) -> None:
            self.deadline = None
            idle = self.cycle is None or self.cycle.response_complete
            if self.cycle is cycle and idle and not self.transport.is_closing():
                # No complete request head in time (slowloris, a silent socket), or a refused body or a linger
                # that went on too long.
                self.transport.close()

        def _close_after_reply(self) -> None:
            """uvicorn closes a connection the client asked to close as soon as the reply is written. With the
            client still sending its body (a refused one: a 413 from its Content-Length, a 408), the kernel would
            answer the unread bytes with a reset, which destroys the reply in the client's buffers before it reads
            it: urllib, which writes its whole body before reading, saw only "connection reset". So the reply
            goes out followed by a FIN (shut down the write side), and the rest of the body is read and dropped,
            within `read_timeout` and DRAIN_BYTES, until the client closes its side: then the connection closes."""
            cycle = self.cycle
            if cycle is None or not cycle.more_body or self.half_closed or self.transport.is_closing():
                self.transport.close()  # the whole request was read: nothing to linger for
                return
            self.lingering = True
            self.transport.write_eof()  # after what is buffered: the reply
            self.flow.resume_reading()  # (uvicorn paused reading while the unread body piled up)
            waiting.pop(self, None)
            waiting[self] = None  # the connection cap may shed it
            self._arm(read_timeout)

        def _shed_one(self) -> None:
            """Full: close the connection that has waited longest for a request (this one, if none else). A
            closed one stays in uvicorn's set until the loop's next turn: skip those."""
            while waiting:
                oldest = next(iter(waiting))
                del waiting[oldest]
                if not oldest.transport.is_closing():
                    oldest.transport.close()
                    return
            self.transport.close()

        def on_response_complete(self) -> None:
            if self.lingering:  # the connection closes once the client has sent the rest
                self.server_state.total_requests += 1
                return
            still_sending = self.cycle is not None and self.cycle.more_body
            self.drained = 0
            self._await_head()
            if still_sending:  # a refused body: read and dropped within read_timeout, then the next head is due
                self._arm(read_timeout)
            if self.half_closed:  # the client said it sends nothing more: no next request will come
                self.server_state.total_requests += 1
                self.transport.close()
                return
            super().on_response_complete()

        def eof_received(self) -> bool | None:  # type: ignore[override]
            """A client that shuts down its sending side after a request (`nc -N`, some proxies) still waits
            for the answer: keep the socket open until it is sent, and ask whether it is still there (`_probe`):
            one that closed its socket (curl -m, a closed tab) looks the same until then, and its work would run
            to the end. An HTTP/1.0 client may not be sent the question: its EOF means it left. A lingering
            connection's EOF is the client done sending: it closes."""
            cycle = self.cycle
            if self.lingering or cycle is None or cycle.response_complete \
                    or cycle.scope.get("http_version") == "1.0":
                return None
            self.half_closed = True
            self.loop.call_later(PROBE_AFTER_S, self._probe, cycle, True)
            return True

        def _probe(self, cycle: Any, ask: bool) -> None:
            """Send bytes the client skips (a `100 Continue` before the response, a streamed reply's comment
            after it starts); a client that closed its socket answers them with a reset, which sets the socket's
            error: then the connection is dropped, and the request sees the disconnect (its jobs are cancelled).
            Looked at until the response is complete."""
            if self.cycle is not cycle or cycle.response_complete or self.transport.is_closing():
                return
            if ask:
                if not cycle.response_started:
                    self.transport.write(CONTINUE)
                elif (probe := cycle.scope.get(PROBE_BYTES_KEY)) is not None:
                    self.transport.write(self.conn.send(h11.Data(data=probe)))
            sock = self.transport.get_extra_info("socket")
            if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self.transport.abort()  # connection_lost marks the request disconnected
                return
            self.loop.call_later(PROBE_EVERY_S, self._probe, cycle, False)

    return GuardedH11Protocol


_ACCEPT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio reports each accept() that fails for lack of file descriptors with a traceback (and retries a
    second later); say it once, in one line, until accepting works again."""
    told = False

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        nonlocal told
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _ACCEPT_ERRNOS and "accept" in context.get("message", ""):
            if not told:
                told = True
                soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
                log.warning("cannot accept connections: %s (open-files limit %d); new clients wait until some "
                            "close (this is said once)", exc.strerror, soft)
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
