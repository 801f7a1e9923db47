"""The server's fast lane: the real app, guard, uvicorn protocol and worker on real loopback sockets, over a
scripted model (tests/helpers_serve.FakeTextModel: no llama.cpp model is loaded). The same behaviours with the
real demo pair are in test_serve.py, test_serve_guard.py and test_serve_llama.py."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from starlette.testclient import TestClient

from localspec.server.app import create_app
from localspec.server.guard import GuardSettings
from localspec.server.handling import Backend, ServerState
from tests.helpers_serve import fake_backend, live_server, wait_for

LONG = 3000  # tokens: far more than a test waits for

BODIES = {
    "/v1/completions": {"prompt": "1, 2, 3, 4, 5,", "max_tokens": LONG},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "count"}], "max_tokens": LONG},
    "/completion": {"prompt": "1, 2, 3, 4, 5,", "n_predict": LONG},
    "/infill": {"input_prefix": "def f(", "input_suffix": "):", "n_predict": LONG},
}


class Live:
    def __init__(self, backend: Backend, root: str) -> None:
        self.backend, self.root = backend, root
        self.host, port = root.removeprefix("http://").split(":")
        self.port = int(port)

    def connect(self, timeout: float = 30) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=timeout)


@contextmanager
def serving(backend: Backend | None = None, read_timeout_s: float = 5.0, send_buffer: int | None = None,
            **settings: Any) -> Iterator[Live]:
    backend = backend or fake_backend(n_ctx=4096, delay=0.01)
    state = ServerState(model_id="fake", guard=GuardSettings(read_timeout=read_timeout_s), **settings)
    state.attach(backend)
    try:
        with live_server(create_app(state), read_timeout=read_timeout_s, send_buffer=send_buffer) as root:
            yield Live(backend, root)
    finally:
        backend.worker.shutdown(timeout=30)


@pytest.fixture
def live() -> Iterator[Live]:
    with serving() as server:
        yield server


def request_bytes(path: str, body: dict, version: str = "1.1") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/{version}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def drain(sock: socket.socket, quiet: float = 0.3) -> bytes:
    """Read what the server has sent until it pauses for `quiet` s (so a close sends a FIN, not a reset)."""
    sock.settimeout(quiet)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return out
        if not chunk:
            return out
        out += chunk


def read_response(sock: socket.socket, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """One response off a kept-alive connection: status, headers, body (by its Content-Length)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk, "closed inside a response"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def read_all(sock: socket.socket, timeout: float = 30) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


# -- a client that leaves --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", [p if p == "/v1/chat/completions" else pytest.param(p, marks=pytest.mark.slow)
                                  for p in BODIES])  # the fast lane: one route, each waits out a 1 s decode
def test_a_client_that_leaves_is_cancelled_within_2_s(live: Live, path: str, stream: bool) -> None:
    """Before: a JSON request kept generating to its end after its client closed the socket (the half-close
    support took every EOF for a half-close), and a streamed one ran on until two writes had failed. The client
    here reads all it was sent, so its close is a plain FIN, while the model is in a one-second decode."""
    worker = live.backend.worker
    with live.connect() as sock:
        sock.sendall(request_bytes(path, {**BODIES[path], "stream": stream}))
        wait_for(lambda: worker.stats.running == 1 and worker.engine.target.decodes > 3)
        live.backend.model.delay = 1.0  # type: ignore[attr-defined]  # the server is quiet from here
        drain(sock)
    t_closed = time.monotonic()
    wait_for(lambda: worker.stats.cancelled == 1, timeout=30)
    took = time.monotonic() - t_closed
    assert took < 2.0, f"cancelled {took:.2f} s after the client left"
    assert worker.stats.served == 0 and worker.stats.running == 0


def test_a_half_closed_request_still_gets_its_answer(live: Live) -> None:
    """`nc -N` shuts its sending side after the request and reads the answer: the question asked of it (an
    interim 100 Continue) is skipped by any HTTP/1.1 client, and the answer follows."""
    worker = live.backend.worker
    for stream in (False, True):
        with live.connect() as sock:
            sock.sendall(request_bytes("/v1/completions", {"prompt": "hello", "max_tokens": 60, "stream": stream}))
            sock.shutdown(socket.SHUT_WR)
            reply = read_all(sock)
        head, _, rest = reply.partition(b"\r\n\r\n")
        if head == b"HTTP/1.1 100 Continue":
            head, _, rest = rest.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), reply[:200]
        assert (b"data: [DONE]" in rest) if stream else (b'"text_completion"' in rest)
    assert worker.stats.served == 2 and worker.stats.cancelled == 0


def test_an_http_1_0_client_that_closes_its_side_has_left(live: Live) -> None:
    """HTTP/1.0 allows no interim answer to ask with: its EOF is taken as leaving (as uvicorn and llama-server
    take every EOF)."""
    worker = live.backend.worker
    with live.connect() as sock:
        sock.sendall(request_bytes("/v1/completions", BODIES["/v1/completions"], version="1.0"))
        wait_for(lambda: worker.stats.running == 1)
        sock.shutdown(socket.SHUT_WR)
        wait_for(lambda: worker.stats.cancelled == 1, timeout=2)


# -- a body too large, a missing key ---------------------------------------------------------------------------

BIG = b'{"prompt": "' + b"x" * (4 << 20) + b'"}'  # 4 MiB: past the 1 MiB this context's prompts can need


def chunked(data: bytes, size: int = 1 << 16) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(data[i : i + size]), data[i : i + size]) for i in range(0, len(data), size))
    return out + b"0\r\n\r\n"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_client_that_writes_its_whole_body_first_sees_the_413(live: Live, framing: str) -> None:
    """Before: the 413 went out and the connection closed while the body was still arriving, so the client got a
    reset (a broken pipe while writing, or ECONNRESET before it could read the answer)."""
    length = (f"Content-Length: {len(BIG)}" if framing == "content-length" else "Transfer-Encoding: chunked")
    head = ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{length}\r\n\r\n").encode()
    with live.connect() as sock:
        sock.sendall(head + (BIG if framing == "content-length" else chunked(BIG)))
        status, _, body = read_response(sock)
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        # The refused body was read and dropped: the same connection carries the next request.
        sock.sendall(request_bytes("/v1/completions", {"prompt": "hi", "max_tokens": 2}))
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


def test_a_missing_key_is_a_401_before_the_body_size_is_looked_at() -> None:
    """Before: a large unauthenticated body got a 413, telling a stranger the limit; and the 401's type was
    `invalid_request_error` where llama-server and OpenAI's clients expect `authentication_error`."""
    with serving(api_key="sekrit") as live:
        head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(BIG)}\r\n").encode()
        for auth, want in ((b"", 401), (b"Authorization: Bearer wrong\r\n", 401),
                           (b"Authorization: Bearer sekrit\r\n", 413), (b"X-Api-Key: sekrit\r\n", 413)):
            with live.connect() as sock:
                sock.sendall(head + auth + b"\r\n" + BIG)
                status, headers, body = read_response(sock)
            error = json.loads(body)["error"]
            assert status == want, body
            if want == 401:
                assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
                assert headers["www-authenticate"] == "Bearer"
        with live.connect() as sock:  # /health needs no key, and neither does a CORS preflight
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_response(sock)[0] == 200


# -- in process (no socket): what a request may ask ------------------------------------------------------------


@contextmanager
def in_process(backend: Backend | None = None, cors: tuple[str, ...] = (), **settings: Any) -> Iterator[TestClient]:
    backend = backend or fake_backend()
    state = ServerState(model_id="fake", **settings)
    state.attach(backend)
    try:
        with TestClient(create_app(state, cors), base_url="http://localhost") as client:
            yield client
    finally:
        backend.worker.shutdown(timeout=30)


@pytest.mark.parametrize("asked", ["draft-simple", "model", "ngram-simple,draft-simple", "chain"])
def test_a_speculative_type_the_models_cannot_run_is_a_400_naming_what_they_can(asked: str) -> None:
    """Before: 200, decoded plainly (or by lookup alone for the chain) without a word."""
    with in_process(fake_backend(draft=False)) as client:
        for body in ({"speculative.type": asked}, {"speculative": {"type": asked}}):
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "speculative.type" and error["code"] == "unsupported_value"
            assert "no draft model is loaded" in error["message"]
            assert "this server can run ngram-simple (lookup), suffix, none" in error["message"]
        for fine in ("ngram-simple", "lookup", "none"):
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "speculative.type": fine})
            assert r.status_code == 200, r.text
        props = client.get("/props").json()["localspec"]
        assert props["drafters"] == ["lookup", "suffix"]
        assert client.app.state.localspec.backend.worker.stats.served == 3


# -- llama-server's answers where clients rely on them -------------------------------------------------------

GENERATIONS = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/completion": {"prompt": "hi", "n_predict": 2},
    "/infill": {"input_prefix": "a", "input_suffix": "b", "n_predict": 2},
}


def test_any_model_name_means_the_one_model_served_unless_strict() -> None:
    """Before: `"model": "gpt-3.5-turbo"` (what OpenAI-SDK apps send) got a 404; llama-server answers it."""
    with in_process() as client:
        for path, body in GENERATIONS.items():
            r = client.post(path, json={**body, "model": "gpt-3.5-turbo"})
            assert r.status_code == 200, (path, r.text)
    with in_process(strict_model=True, aliases=("gpt-4o",)) as client:
        for path, body in GENERATIONS.items():
            r = client.post(path, json={**body, "model": "gpt-3.5-turbo"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (path, r.text)
            for name in ("fake", "gpt-4o"):
                assert client.post(path, json={**body, "model": name}).status_code == 200


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}


@pytest.mark.parametrize(("cors", "origin", "echoed"), [
    (("*",), "web.mydomain.fr", True), (("*",), "localhost", True), (("http://ui.example",), "http://ui.example", True),
    (("http://ui.example",), "http://evil.example", False), ((), "http://ui.example", False),
])
def test_a_cors_preflight_is_answered_as_llama_server_answers_it(cors: tuple[str, ...], origin: str,
                                                                 echoed: bool) -> None:
    """llama.cpp's own tests (tools/server/tests/unit/test_security.py) ask for exactly these headers. Before: the
    methods came as "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT", the headers as the request's list, a disallowed
    origin got a 400 and a server without --cors-origin a 405."""
    with in_process(cors=cors, api_key="k") as client:  # a preflight carries no key: none is asked
        for path in ("/completions", "/v1/chat/completions", "/slots"):
            r = client.options(path, headers={"Origin": origin, **PREFLIGHT})
            assert r.status_code == 200 and r.content == b"", r.text
            assert r.headers["Access-Control-Allow-Credentials"] == "true"
            assert r.headers["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
            assert r.headers["Access-Control-Allow-Headers"] == "*"
            assert r.headers.get("Access-Control-Allow-Origin") == (origin if echoed else None)
        # The reply itself carries the origin too, a refusal (the missing key here) included.
        r = client.post("/v1/completions", json={"prompt": "hi"}, headers={"Origin": origin})
        assert r.status_code == 401 and r.headers.get("Access-Control-Allow-Origin") == (origin if echoed else None)
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                        headers={"Origin": origin, "X-Api-Key": "k"})
        assert r.status_code == 200 and r.headers.get("Access-Control-Allow-Origin") == (origin if echoed else None)


def test_two_assistant_messages_at_the_end_are_refused_as_llama_server_refuses_them() -> None:
    """Before: rendered and answered (a template that alternates roles would raise on it, or prompt nothing)."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"},
             {"role": "assistant", "content": "there"}]
    with in_process() as client:
        for path in ("/v1/chat/completions", "/apply-template"):
            r = client.post(path, json={"messages": turns, "max_tokens": 2})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "messages"
            assert "cannot have 2 or more assistant messages at the end of the list" in error["message"]
            assert client.post(path, json={"messages": turns[:2], "max_tokens": 2}).status_code == 200
            assert client.post(path, json={"messages": [*turns[:2], {"role": "user", "content": "more"}, turns[2]],
                                           "max_tokens": 2}).status_code == 200


def test_slots_can_be_turned_off_and_then_answer_501_as_llama_server() -> None:
    with in_process(slots=False) as client:
        r = client.get("/slots")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error", r.text
        assert "--slots" in r.json()["error"]["message"]
        assert client.get("/props").json()["endpoint_slots"] is False
    with in_process() as client:
        assert client.get("/slots").status_code == 200 and client.get("/props").json()["endpoint_slots"] is True


# -- /metrics, /slots and timings count as llama-server counts ---------------------------------------------------


def metrics_of(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in (line.split() for line in text.splitlines()
                                                   if line and not line.startswith("#") and "{" not in line)}


def test_metrics_add_up_the_replies_timings_with_llama_servers_names() -> None:
    """Before: prompt_tokens_total lacked each reply's +1 (the prompt's last token, evaluated in the first verify)
    and prompt_tokens_cached_total had it one too many; n_decode_total, n_busy_slots_per_decode and the timings'
    per-token milliseconds were missing."""
    with in_process(metrics=True) as client:
        backend = client.app.state.localspec.backend
        decodes_before = backend.worker.engine.target.decodes
        replies = [client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6}).json()
                   for prompt in ("hello there", "hello there", "hello world")]
        timings = [r["timings"] for r in replies]
        assert [t["cache_n"] for t in timings][1] == len("hello there") - 1  # all of it cached but the last
        m = metrics_of(client.get("/metrics").text)
        assert m["llamacpp:prompt_tokens_total"] == sum(t["prompt_n"] for t in timings)
        assert m["llamacpp:prompt_tokens_cached_total"] == sum(t["cache_n"] for t in timings)
        assert m["llamacpp:prompt_tokens_total"] + m["llamacpp:prompt_tokens_cached_total"] == sum(
            r["usage"]["prompt_tokens"] for r in replies)
        assert m["llamacpp:tokens_predicted_total"] == sum(t["predicted_n"] for t in timings) == 18
        assert m["llamacpp:n_decode_total"] == backend.worker.engine.target.decodes - decodes_before > 0
        assert m["llamacpp:n_busy_slots_per_decode"] == 1.0  # one slot, busy in every decode of a round
        for t in timings:
            assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"], abs=1e-3)
            assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / t["predicted_n"], abs=1e-3)


def test_an_idle_slot_has_n_remain_minus_one_and_a_busy_one_what_is_left() -> None:
    backend = fake_backend(delay=0.05)
    with in_process(backend) as client:
        fresh = client.get("/slots").json()[0]
        assert fresh["is_processing"] is False and "next_token" not in fresh  # never used: llama-server's shape
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        idle = client.get("/slots").json()[0]["next_token"][0]
        assert idle == {"has_next_token": False, "n_remain": -1, "n_decoded": 3}
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(client.post, "/v1/completions", json={"prompt": "hi", "max_tokens": 40})
            wait_for(lambda: client.get("/slots").json()[0]["is_processing"])
            wait_for(lambda: client.get("/slots").json()[0]["next_token"][0]["n_decoded"] > 0)
            busy = client.get("/slots").json()[0]["next_token"][0]
            assert busy["has_next_token"] is True and busy["n_remain"] == 40 - busy["n_decoded"] > 0
            assert running.result().status_code == 200


def test_a_reply_that_fills_the_context_ends_at_it_not_one_past() -> None:
    """Before: prompt + completion came to n_ctx + 1 (`--ctx 512`: 386 + 127 = 513)."""
    with in_process(fake_backend(n_ctx=64)) as client:
        for path, body in (("/v1/completions", {"prompt": "a longer prompt here"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            for stream in (False, True):
                r = client.post(path, json={**body, "max_tokens": 1000, "stream": stream,
                                            "stream_options": {"include_usage": True}} if stream else
                                {**body, "max_tokens": 1000})
                assert r.status_code == 200, r.text
                if stream:
                    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                              if line.startswith("data: {")]
                    usage = chunks[-1]["usage"]
                    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
                else:
                    usage, finish = r.json()["usage"], r.json()["choices"][0]["finish_reason"]
                assert usage["total_tokens"] == 64 and finish == "length", (path, stream, usage)


# -- seeds ----------------------------------------------------------------------------------------------------

SAMPLED = {"prompt": "tell me a story", "max_tokens": 40, "temperature": 0.8, "top_k": 8, "seed": 1234}


@pytest.mark.parametrize("speculative", [{"speculative.n_max": 0}, {"speculative.type": "draft-simple"}],
                         ids=["plain", "draft-model"])
def test_a_seed_gives_the_same_text_whatever_the_slot_count(speculative: dict) -> None:
    """Before: plain decoding at T > 0 drew its tokens with llama.cpp's device sampler with one slot and on the
    host with several, so `--parallel 1` and `--parallel 4` gave other text for one seed."""
    texts = {}
    for slots in (1, 4):
        with in_process(fake_backend(slots=slots)) as client:
            replies = [client.post("/v1/completions", json={**SAMPLED, **speculative}).json() for _ in range(2)]
        texts[slots] = [r["choices"][0]["text"] for r in replies]
        assert texts[slots][0] == texts[slots][1]  # the same seed twice
        if "speculative.type" in speculative:
            assert replies[0]["timings"]["draft_n"] > 0
    assert texts[1] == texts[4]
    with in_process(fake_backend()) as client:
        other = client.post("/v1/completions", json={**SAMPLED, **speculative, "seed": 99}).json()
    assert other["choices"][0]["text"] != texts[1][0]  # (the seed matters)


# -- connections that send nothing ---------------------------------------------------------------------------


def test_silent_connections_are_closed_after_the_header_deadline() -> None:
    """A fresh socket that sends nothing, one stuck inside its request head, and one silent after its reply."""
    with serving(read_timeout_s=1.0) as live:
        socks = [live.connect(), live.connect(), live.connect()]
        socks[1].sendall(b"GET /health HTTP/1.1\r\n")
        socks[2].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        t0 = time.monotonic()
        for sock in socks:
            read_all(sock, timeout=10)  # returns at the server's close
            sock.close()
        assert time.monotonic() - t0 < 8


def test_a_client_that_neither_sends_nor_reads_is_dropped_and_its_job_cancelled() -> None:
    """Before: a streamed reply whose client read nothing waited on it forever once the socket's buffers were full:
    the connection, the reply's buffers and (until max_tokens) the engine stayed taken."""
    with serving(fake_backend(n_ctx=16384, delay=0.002), read_timeout_s=1.0, send_buffer=8192) as live:
        worker = live.backend.worker
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((live.host, live.port))
        sock.sendall(request_bytes("/v1/completions", {"prompt": "x", "max_tokens": 12000, "stream": True}))
        wait_for(lambda: worker.stats.cancelled == 1, timeout=30)
        assert worker.stats.served == 0
        with pytest.raises((ConnectionResetError, AssertionError)):
            while sock.recv(1 << 16):  # what was buffered, then the reset
                pass
            raise AssertionError("closed in order")  # (a FIN would do too)
        sock.close()
