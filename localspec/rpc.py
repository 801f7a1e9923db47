"""llama.cpp RPC servers as seen from here: endpoint syntax and the handshake that proves one answers.

ggml's own client aborts the whole process when an endpoint is dead or speaks another protocol version
(`GGML_ABORT` in its connect), so every endpoint is checked here first — a plain socket connect and the RPC
HELLO exchange, written from ggml-rpc's wire format — and only an endpoint that passed is handed to ggml
(`llama.backend.rpc_devices`). No weight is sent before every endpoint has answered.

Wire format (ggml-rpc.cpp, protocol 7): a request is | command (1 byte) | size (u64 LE) | payload |, a response
| size (u64 LE) | payload |. HELLO is command 14 with 24 bytes of transport capabilities (zeros: plain TCP); the
answer is major, minor, patch, padding (one byte each) and the server's 24 capability bytes.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass

from localspec.errors import LocalspecError

# From ggml-rpc.h of the llama.cpp vendored in llama-cpp-python 0.3.36: the client accepts a server of the same
# major version and a minor version no newer than its own.
PROTO_MAJOR = 7
PROTO_MINOR = 0
_CMD_HELLO = 14
_CAPS = 24
HELLO_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_endpoint(text: str) -> Endpoint:
    """`host:port` (ggml splits at the first colon, so IPv6 literals cannot be written; use a host name)."""
    host, sep, port = text.strip().partition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or ":" in port:
        raise LocalspecError(f"RPC server {text.strip()!r}: expected HOST:PORT, e.g. 192.168.1.20:50052")
    return Endpoint(host, int(port))


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """A comma-separated list (`--rpc a:50052,b:50052`); "" = none. Each endpoint once."""
    out: list[Endpoint] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        endpoint = parse_endpoint(part)
        if endpoint in out:
            raise LocalspecError(f"RPC server {endpoint} is listed twice")
        out.append(endpoint)
    return tuple(out)


@dataclass(frozen=True)
class Hello:
    endpoint: Endpoint
    version: str  # the server's protocol version, e.g. "7.0.0"


def hello(endpoint: Endpoint, timeout: float = HELLO_TIMEOUT_S) -> Hello:
    """Connect, exchange HELLO, check the protocol version, disconnect. Raises a one-line LocalspecError naming
    the endpoint: refused, unreachable, silent, not an RPC server, or a version this llama.cpp cannot talk to."""
    where = f"RPC server {endpoint}"
    try:
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
    except socket.gaierror:
        raise LocalspecError(f"{where}: unknown host {endpoint.host!r}") from None
    except ConnectionRefusedError:
        raise LocalspecError(f"{where}: connection refused (is `localspec rpc-server` or llama.cpp's rpc-server "
                             "running there, on that port?)") from None
    except TimeoutError:
        raise LocalspecError(f"{where}: no connection within {timeout:g} s (host down or a firewall?)") from None
    except OSError as exc:
        raise LocalspecError(f"{where}: cannot connect ({exc.strerror or exc})") from None
    with sock:
        try:
            sock.sendall(struct.pack("<BQ", _CMD_HELLO, _CAPS) + bytes(_CAPS))
            size = struct.unpack("<Q", _recv(sock, 8))[0]
            if size != 4 + _CAPS:
                raise LocalspecError(f"{where}: answered, but not as a llama.cpp RPC server of protocol "
                                     f"{PROTO_MAJOR}.x (a HELLO reply of {size} bytes)")
            major, minor, patch = _recv(sock, size)[:3]
        except TimeoutError:
            # An RPC server serves one client at a time: a connection that is accepted but never answered is
            # usually queued behind another client.
            raise LocalspecError(f"{where}: connected but no answer within {timeout:g} s (serving another "
                                 "client? an RPC server takes one client at a time)") from None
        except (ConnectionError, EOFError):
            raise LocalspecError(f"{where}: closed the connection during the handshake (not a llama.cpp RPC "
                                 f"server, or one of another protocol version than {PROTO_MAJOR}.x)") from None
        except OSError as exc:
            raise LocalspecError(f"{where}: handshake failed ({exc.strerror or exc})") from None
    version = f"{major}.{minor}.{patch}"
    if major != PROTO_MAJOR or minor > PROTO_MINOR:
        raise LocalspecError(f"{where}: speaks RPC protocol {version}, this llama.cpp speaks "
                             f"{PROTO_MAJOR}.{PROTO_MINOR}: run the same llama.cpp version on both machines")
    return Hello(endpoint, version)


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data
