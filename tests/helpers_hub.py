"""A tiny stand-in for the Hugging Face hub on 127.0.0.1, speaking what `hf_hub_download` uses.

HEAD/GET `/{owner}/{repo}/resolve/{revision}/{file}` with `X-Repo-Commit`, `ETag`/`X-Linked-Etag` (the sha256
of LFS content) and `X-Linked-Size`; GET honours `Range: bytes=N-` with 206. Errors carry the hub's
`X-Error-Code` header, which huggingface_hub maps to its exception classes. Behaviour per repo is set by
`files` and a few flags, and every request is recorded for the tests to inspect.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_file(hub_cache: Path, repo: str, name: str, data: bytes) -> Path:
    """A file laid out as huggingface_hub caches it (refs/main -> snapshots/<commit>/name), as if pulled."""
    folder = hub_cache / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    (folder / "snapshots" / COMMIT).mkdir(parents=True, exist_ok=True)
    path = folder / "snapshots" / COMMIT / name
    path.write_bytes(data)
    return path


@dataclass
class HubFile:
    content: bytes
    advertised_sha256: str | None = None  # None = the real sha256 of content
    advertised_size: int | None = None  # None = len(content)
    cut_first_get_at: int | None = None  # drop the connection after this many bytes, once
    seconds_per_mib: float = 0.0  # serve GET bodies this slowly (concurrent pulls draft_ahead)
    _cut_done: bool = False

    @property
    def sha256(self) -> str:
        return self.advertised_sha256 or hashlib.sha256(self.content).hexdigest()


@dataclass
class FakeHub:
    files: dict[tuple[str, str], HubFile] = field(default_factory=dict)  # (repo, file) -> content
    missing_repos: set[str] = field(default_factory=set)  # 404 RepoNotFound
    private_repos: set[str] = field(default_factory=set)  # 401 RepoNotFound without the right token
    gated_repos: set[str] = field(default_factory=set)  # 401 (no token) / 403 (token without access) GatedRepo
    good_token: str = "hf_good"
    requests: list[tuple[str, str, str | None, str | None]] = field(
        default_factory=list
    )  # method, path, range, auth
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def gets(self, file: str) -> list[tuple[str, str, str | None, str | None]]:
        return [r for r in self.requests if r[0] == "GET" and r[1].endswith("/" + file)]

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

            def _error(self, status: int, code: str | None, message: str = "") -> None:
                body = message.encode()
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                if message:
                    self.send_header("X-Error-Message", message)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _serve(self) -> None:
                hub.requests.append(
                    (self.command, self.path, self.headers.get("Range"), self.headers.get("Authorization"))
                )
                m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", self.path)
                if not m:
                    return self._error(404, "RepoNotFound", "Repository not found")
                repo, _rev, name = m.groups()
                auth = self.headers.get("Authorization")
                if repo in hub.missing_repos:
                    return self._error(404, "RepoNotFound", "Repository not found")
                if repo in hub.private_repos and auth != f"Bearer {hub.good_token}":
                    if auth:
                        return self._error(401, None, "Invalid credentials in Authorization header")
                    return self._error(401, "RepoNotFound", "Invalid username or password.")
                if repo in hub.gated_repos and auth != f"Bearer {hub.good_token}":
                    # As the hub does: 401 without a token, 403 with one that has not accepted the licence.
                    return self._error(403 if auth else 401, "GatedRepo", "Access to model is restricted")
                f = hub.files.get((repo, name))
                if f is None:
                    return self._error(404, "EntryNotFound", "Entry not found")
                size = f.advertised_size if f.advertised_size is not None else len(f.content)
                start = 0
                rng = self.headers.get("Range")
                if self.command == "GET" and rng:
                    start = int(re.match(r"bytes=(\d+)-", rng).group(1))
                body = f.content[start:]
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{f.sha256}"')
                self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                self.send_header("X-Linked-Size", str(size))
                self.send_header("Accept-Ranges", "bytes")
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(f.content) - 1}/{len(f.content)}")
                self.send_header("Content-Length", str(len(body) if self.command == "GET" else size))
                self.end_headers()
                if self.command != "GET":
                    return None
                if f.cut_first_get_at is not None and not f._cut_done:
                    f._cut_done = True
                    self.wfile.write(body[: f.cut_first_get_at])
                    self.wfile.flush()
                    self.close_connection = True
                    return None
                if f.seconds_per_mib:
                    step = 1 << 16
                    for i in range(0, len(body), step):
                        self.wfile.write(body[i : i + step])
                        self.wfile.flush()
                        time.sleep(f.seconds_per_mib / 16)
                    return None
                self.wfile.write(body)
                return None

            do_HEAD = _serve  # noqa: N815 -- http.server's naming
            do_GET = _serve  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # shutdown() waits for the serve loop's next poll: 0.5 s by default, paid by every test that stops a hub.
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
