"""The HTTP edge of `localspec serve`: a body refused while the client is still writing it (the client reads the
413, `Connection: close` or not), idle sockets and the header deadline, /metrics' `Process-Start-Time-Unix`
header, slot ids and slot file names, and a bad `--slot-save-path` before any model is read. The fast lane runs
the real app, guard and uvicorn protocol on loopback sockets over a scripted model (tests/helpers_serve); the slow
tests run the same on a live `localspec serve` of the demo-chat pair with the default preset's deadlines.

Every wait is bounded; times are asserted with wide margins only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from localspec.config import load_preset
from localspec.rounds import slot_file
from localspec.server.app import create_app
from localspec.server.guard import GuardSettings
from localspec.server.handling import ServerState
from tests.helpers_serve import fake_backend, live_server
from tests.test_serve import Server

BODY = 4 << 20  # past every server's limit here (1 MiB: the least PromptLimits.body_bytes gives)
SLACK_S = 4.0  # on a busy test machine
LLAMA_SERVER_WAIT_S = 5.0  # how long llama-server (cpp-httplib's keep-alive wait) lets a connection send nothing


@contextmanager
def fake_server(header_timeout: float = 5.0, read_timeout: float = 5.0, **settings: Any) -> Iterator[str]:
    backend = fake_backend(n_ctx=256)
    state = ServerState(model_id="fake", guard=GuardSettings(read_timeout=read_timeout), **settings)
    state.attach(backend)
    try:
        with live_server(create_app(state), read_timeout=read_timeout, header_timeout=header_timeout) as root:
            assert state.body_limit() < BODY
            yield root
    finally:
        backend.worker.shutdown(timeout=30)


def address(root: str) -> tuple[str, int]:
    host, port = root.removeprefix("http://").split(":")
    return host, int(port)


# -- a refused body the client writes whole before reading ---------------------------------------------------


def urllib_post(root: str, size: int) -> tuple[int, dict]:
    """What urllib does: the whole body written, `Connection: close`, then the reply read."""
    request = urllib.request.Request(f"{root}/v1/completions", data=b"x" * size,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def raw_post(root: str, head: bytes, body: bytes) -> bytes:
    """Write the head and the whole body on a fresh socket, then read until the server closes."""
    with socket.create_connection(address(root), timeout=60) as sock:
        sock.sendall(head)
        sock.sendall(body)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def refused_whole_bodies(root: str) -> None:
    for _ in range(3):  # before: a reset 3 times of 3 for urllib
        status, body = urllib_post(root, BODY)
        assert status == 413 and body["error"]["code"] == "request_too_large", body
    for version, framing in (("1.1", f"Content-Length: {BODY}\r\nConnection: close"),
                             ("1.0", f"Content-Length: {BODY}"),
                             ("1.1", "Transfer-Encoding: chunked\r\nConnection: close")):
        head = (f"POST /v1/completions HTTP/{version}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"{framing}\r\n\r\n").encode()
        body = b"x" * BODY if "chunked" not in framing else b"%x\r\n%s\r\n0\r\n\r\n" % (BODY, b"x" * BODY)
        reply = raw_post(root, head, body)
        assert reply.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in reply, (version, reply[:300])


def test_a_body_written_whole_before_reading_gets_its_413_even_when_the_connection_closes() -> None:
    """Before: urllib (and any client writing its whole body, then reading, with `Connection: close` or HTTP/1.0)
    got a reset or a broken pipe instead of the 413: uvicorn closed the socket right after the reply with the rest
    of the body unread, and the kernel answered that with a reset."""
    with fake_server() as root:
        refused_whole_bodies(root)
        assert httpx.get(f"{root}/health", timeout=30).status_code == 200


def test_a_lingering_connection_is_closed_within_read_timeout() -> None:
    """The rest of a refused body is read for `read_timeout` at most: a client that writes on and on (and reads
    nothing) has its connection closed then."""
    with fake_server(read_timeout=1.0) as root:
        sock = socket.create_connection(address(root), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: 100000000\r\n\r\n")
        t0 = time.monotonic()
        with pytest.raises(OSError):  # EPIPE or a reset once the server has closed
            while time.monotonic() - t0 < 30:
                sock.sendall(b"x" * 65536)
                time.sleep(0.01)
        assert time.monotonic() - t0 < 1.0 + SLACK_S
        sock.close()


# -- idle sockets --------------------------------------------------------------------------------------------


def idle_sockets_closed_within(root: str, count: int, bound_s: float) -> float:
    """Open `count` sockets that send nothing; each must be closed by the server (EOF) within `bound_s` of its
    opening. Returns the seconds the last one took."""
    socks = []
    try:
        for _ in range(count):
            socks.append(socket.create_connection(address(root), timeout=30))
        t0 = time.monotonic()
        for sock in socks:
            sock.settimeout(max(0.01, bound_s - (time.monotonic() - t0)))
            try:
                assert sock.recv(1) == b""
            except TimeoutError:
                raise AssertionError(f"an idle socket was still open after {bound_s:.0f} s") from None
        return time.monotonic() - t0
    finally:
        for sock in socks:
            sock.close()


def test_idle_sockets_are_closed_at_the_header_deadline_and_a_body_keeps_its_own() -> None:
    """`header_timeout` closes silent sockets; `read_timeout` (longer here) still bounds a body, not the header
    deadline: a POST whose body arrives after the header deadline is answered."""
    with fake_server(header_timeout=1.0, read_timeout=6.0) as root:
        took = idle_sockets_closed_within(root, 200, 1.0 + SLACK_S)
        print(f"200 idle sockets closed within {took:.1f} s (header deadline 1 s)")
        body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        with socket.create_connection(address(root), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            time.sleep(2.0)  # past the header deadline, within the body's
            sock.sendall(body)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200"), "the body was cut by the header deadline"


def test_the_default_header_deadline_is_short() -> None:
    """llama-server (cpp-httplib) waits 5 s for each request before closing; 20 s let idle sockets pile up."""
    assert load_preset("default").server.header_timeout <= LLAMA_SERVER_WAIT_S


# -- /metrics ------------------------------------------------------------------------------------------------


def check_process_start(reply: httpx.Response, pid: int) -> None:
    assert reply.status_code == 200, reply.text
    value = reply.headers.get("Process-Start-Time-Unix")
    assert value is not None and value.isdigit(), reply.headers
    started = psutil.Process(pid).create_time()
    assert abs(int(value) - started) <= 1 and int(value) <= time.time()


def test_metrics_carry_the_process_start_time() -> None:
    """Before: no `Process-Start-Time-Unix` header (llama-server's, which front-ends read to tell restarts)."""
    with fake_server(metrics=True) as root:
        first = httpx.get(f"{root}/metrics", timeout=30)
        check_process_start(first, os.getpid())
        assert httpx.get(f"{root}/metrics", timeout=30).headers["Process-Start-Time-Unix"] == \
            first.headers["Process-Start-Time-Unix"]


# -- slot ids and file names ---------------------------------------------------------------------------------

ODD_SLOT_IDS = ["%C2%B2", "%D9%A3", "1" * 5000, "%EF%BC%91"]  # ², Arabic-Indic 3, 5,000 digits, fullwidth 1


def check_slot_edges(root: str, saves: Path) -> None:
    for slot in ODD_SLOT_IDS:  # before: 500 (int() refused what str.isdigit() let through)
        r = httpx.post(f"{root}/slots/{slot}?action=erase", json={}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot", (slot[:20], r.text)
    (saves / "notes.txt").write_text("mine")
    for name in (".bashrc", ".localspec-probe", "chat 1.bin", "naïve.bin", "-rf", "notes.txt"):
        r = httpx.post(f"{root}/slots/0?action=save", json={"filename": name}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "filename", (name, r.text)
    assert sorted(p.name for p in saves.iterdir()) == ["notes.txt"]
    assert (saves / "notes.txt").read_text() == "mine"


def test_odd_slot_ids_and_unsafe_file_names_are_400s_naming_the_field(tmp_path: Path) -> None:
    with fake_server(slot_save_path=tmp_path) as root:
        check_slot_edges(root, tmp_path)


# -- a bad --slot-save-path before anything reads a model ----------------------------------------------------


def test_a_bad_slot_save_path_is_one_line_before_any_model_is_read(tmp_path: Path) -> None:
    """Before: the pair was resolved and its files read (a demo built, tokenizers loaded) before the folder was
    looked at. A target that is not a GGUF shows the order: its error would come first."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf at all")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    env = {**os.environ, "LOCALSPEC_HOME": str(tmp_path / "home")}
    env.pop("LOCALSPEC_DEBUG", None)
    for path, why in ((a_file, "is not a folder"), (a_file / "sub", "a file is in the way")):
        done = subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", "serve",
                               "--port", "0", "--target", str(broken), "--draft", "none", "--slot-save-path",
                               str(path)], capture_output=True, text=True, env=env, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert "--slot-save-path" in lines[0] and why in lines[0], lines[0]


# -- the same on a live server over the demo-chat pair (default preset) --------------------------------------


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("edge-saves")


@pytest.fixture(scope="module")
def chat(demo_home, tmp_path_factory, saves: Path) -> Iterator[Server]:
    s = Server(demo_home, tmp_path_factory.mktemp("serve-edge"), "--pair", "demo-chat", "--threads", "1", "--ctx",
               "512", "--metrics", "--slot-save-path", str(saves))
    yield s
    s.stop()


@pytest.mark.slow
def test_live_a_body_written_whole_gets_its_413(chat: Server) -> None:
    refused_whole_bodies(chat.root)
    assert chat.health()["status"] == "ok"


@pytest.mark.slow
def test_live_200_idle_sockets_are_closed_within_the_default_header_deadline(chat: Server) -> None:
    """Before: 200 silent sockets were all still open after 12 s (the deadline was read_timeout's 20 s)."""
    took = idle_sockets_closed_within(chat.root, 200, LLAMA_SERVER_WAIT_S + SLACK_S)
    print(f"200 idle sockets closed within {took:.1f} s (header deadline "
          f"{load_preset('default').server.header_timeout:g} s)")
    assert chat.health()["status"] == "ok"


@pytest.mark.slow
def test_live_metrics_carry_the_process_start_time(chat: Server) -> None:
    check_process_start(httpx.get(f"{chat.root}/metrics", timeout=30), chat.proc.pid)


@pytest.mark.slow
def test_live_slot_ids_and_file_names(chat: Server, saves: Path) -> None:
    check_slot_edges(chat.root, saves)
    for _ in range(2):  # a slot file of that name is replaced
        r = httpx.post(f"{chat.root}/slots/0?action=save", json={"filename": "Chat_1-2.bin"}, timeout=600)
        assert r.status_code == 200, r.text
    assert (saves / "Chat_1-2.bin").read_bytes().startswith(slot_file.MAGIC)
    r = httpx.post(f"{chat.root}/slots/0?action=restore", json={"filename": "Chat_1-2.bin"}, timeout=600)
    assert r.status_code == 200, r.text
