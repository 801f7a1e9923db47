"""llama.cpp RPC: `localspec rpc-server` on localhost serves the target's layers and the output does not change; an
endpoint that is dead, silent, foreign or of another protocol version is a one-line error naming it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from localspec import rpc
from localspec.errors import LocalspecError
from tests.helpers_proc import as_from_a_terminal, stop

CLI = [sys.executable, "-c", "from localspec.cli.app import main; main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str, debug: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("LOCALSPEC_DEBUG", None)
    if debug:
        env["LOCALSPEC_DEBUG"] = "1"  # llama.cpp's log: which device got which buffers
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=600)


# -- endpoints that are not (working) RPC servers: fast, no model ---------------------------------------------------

@pytest.fixture
def fake_server() -> Iterator[Callable[[bytes | None], str]]:
    """A TCP server on localhost that answers every connection with fixed bytes (None: accepts and stays silent)."""
    servers: list[socket.socket] = []

    def start(reply: bytes | None) -> str:
        srv = socket.create_server(("127.0.0.1", 0))
        servers.append(srv)

        def serve() -> None:
            with srv:
                while True:
                    try:
                        conn, _ = srv.accept()
                    except OSError:
                        return
                    conn.recv(64)
                    if reply is None:
                        time.sleep(2)
                    else:
                        conn.sendall(reply)
                    conn.close()

        threading.Thread(target=serve, daemon=True).start()
        return f"127.0.0.1:{srv.getsockname()[1]}"

    yield start
    for srv in servers:
        srv.close()


def _hello_reply(major: int, minor: int) -> bytes:
    return struct.pack("<Q", 28) + bytes([major, minor, 0, 0]) + bytes(24)


@pytest.mark.parametrize(("reply", "message"), [
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", "answered, but not as a llama.cpp RPC server of protocol 7.x"),
    (b"", "closed the connection during the handshake"),
    (_hello_reply(3, 0), "speaks RPC protocol 3.0.0, this llama.cpp speaks 7.0"),
    (None, "connected but no answer within 0.5 s"),
])
def test_a_foreign_endpoint_is_named(fake_server, reply: bytes | None, message: str) -> None:
    endpoint = fake_server(reply)
    with pytest.raises(LocalspecError) as exc:
        rpc.hello(rpc.parse_endpoint(endpoint), timeout=0.5)
    assert str(exc.value).startswith(f"RPC server {endpoint}: ") and message in str(exc.value)


def test_a_matching_hello_passes(fake_server) -> None:
    endpoint = fake_server(_hello_reply(rpc.PROTO_MAJOR, rpc.PROTO_MINOR))
    assert rpc.hello(rpc.parse_endpoint(endpoint)).version == f"{rpc.PROTO_MAJOR}.{rpc.PROTO_MINOR}.0"


def test_a_dead_endpoint_is_one_line_before_any_weight(tiny_pair) -> None:
    target, draft = tiny_pair
    port = free_port()  # nothing listens there now
    out = run_cli("generate", "hello", "--target", str(target), "--draft", str(draft), "--rpc", f"127.0.0.1:{port}")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [f"localspec: error: RPC server 127.0.0.1:{port}: connection refused (is "
                                       "`localspec rpc-server` or llama.cpp's rpc-server running there, on that "
                                       "port?)"]


# -- a real server ---------------------------------------------------------------------------------------------------

def start_rpc_server(preexec_fn: Callable[[], None]) -> tuple[subprocess.Popen, rpc.Endpoint]:
    """`localspec rpc-server` on a free localhost port, in a child process, once it answers."""
    port = free_port()
    proc = subprocess.Popen([*CLI, "rpc-server", "--port", str(port), "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    endpoint = rpc.parse_endpoint(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    while True:
        try:
            rpc.hello(endpoint, timeout=2)
            return proc, endpoint
        except LocalspecError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"rpc-server did not come up: {proc.communicate()}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def rpc_server() -> Iterator[str]:
    """A server for the module's tests; stopped with Ctrl-C (SIGINT), as from its terminal."""
    proc, endpoint = start_rpc_server(as_from_a_terminal)
    yield str(endpoint)
    stdout, stderr = stop(proc, signal.SIGINT, grace=30)
    assert proc.returncode == 0, stderr
    assert f"localspec rpc-server on {endpoint}: CPU" in stdout and "rpc-server stopped" in stdout


@pytest.mark.slow
def test_target_layers_on_rpc_give_the_local_output(tiny_pair, rpc_server: str) -> None:
    """Greedy output with the target's layers on the RPC server (the draft local) equals the all-local run."""
    target, draft = tiny_pair
    args = ["generate", "The", "--target", str(target), "--draft", str(draft), "--temp", "0", "--max-tokens", "40",
            "--always-draft", "--json"]  # (drafts every round: the two runs' acceptance is compared)
    local = run_cli(*args)
    assert local.returncode == 0, local.stderr
    remote = run_cli(*args, "--rpc", rpc_server, debug=True)
    assert remote.returncode == 0, remote.stderr[-3000:]
    # llama.cpp's own log: the target's weights went to the RPC device, the draft's stayed on the CPU
    assert re.search(rf"RPC\d+\[{re.escape(rpc_server)}\] model buffer size = +[\d.]+ MiB", remote.stderr), \
        remote.stderr[-3000:]
    local_out, remote_out = json.loads(local.stdout), json.loads(remote.stdout)
    assert remote_out["tokens"] == local_out["tokens"] == 40
    assert remote_out["text"] == local_out["text"]
    assert remote_out["stats"]["accepted"] == local_out["stats"]["accepted"]


@pytest.mark.slow
def test_doctor_reports_the_server_and_its_memory(tiny_pair, rpc_server: str) -> None:
    target, draft = tiny_pair
    out = run_cli("doctor", "--target", str(target), "--draft", str(draft), "--rpc", rpc_server)
    line = next(x for x in out.stdout.splitlines() if f"RPC server {rpc_server}" in x)
    assert re.search(r"answers; RPC\d+: [\d.]+ GiB free of [\d.]+ GiB", line), out.stdout
    assert f"target: RPC {rpc_server}; draft: CPU" in out.stdout


def test_rpc_server_in_the_background_says_how_to_stop_it_and_stops_on_sigterm() -> None:
    """Started with SIGINT ignored (`localspec rpc-server &` in a script), Ctrl-C cannot stop it: the banner says
    what does, and SIGTERM stops it cleanly."""
    proc, _ = start_rpc_server(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    stdout, stderr = stop(proc, signal.SIGTERM, grace=30)
    assert f"(Ctrl-C is ignored here, as in a background job: `kill {proc.pid}` stops)" in stdout
    assert proc.returncode == 0 and "rpc-server stopped" in stdout, stderr


def test_rpc_server_refuses_a_busy_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        out = run_cli("rpc-server", "--port", str(port))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == f"localspec: error: cannot listen on 127.0.0.1:{port}: Address " \
                                                  "already in use"


def test_rpc_server_warns_off_loopback(tmp_path: Path) -> None:
    with socket.create_server(("0.0.0.0", 0)) as busy:  # busy, so the command stops right after the warning
        port = busy.getsockname()[1]
        out = run_cli("rpc-server", "--host", "0.0.0.0", "--port", str(port))
    assert "no authentication" in out.stderr and out.returncode == 2
