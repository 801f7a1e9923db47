"""Downloads into the standard Hugging Face cache, verified; and offline lookups of what is already there.

huggingface_hub >= 1.x deletes a partial download when it fails (its temporary names are per process), so an
interrupted 20 GB pull would start over. localspec keeps its own partial file next to the blobs
(`blobs/<etag>.localspec-partial`), resumes it with a Range request through huggingface_hub's `http_get`
(which also retries dropped connections and draws the progress bar), checks size and sha256, renames it to
`blobs/<etag>` and lets `hf_hub_download` link it into `snapshots/` exactly as it would its own download. The
cache layout stays huggingface_hub's; nothing is left under a final name before it is verified.

Environment, read at call time: HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from localspec.errors import HubError, LocalspecError
from localspec.models.registry import ModelSpec

PARTIAL_SUFFIX = ".localspec-partial"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


# -- environment -------------------------------------------------------------------------------------------


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline() -> bool:
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))


def _tell_the_library_offline() -> None:
    """huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported, and refuses every request after that;
    localspec reads it at call time, so before the library touches the network it is given today's value (else a
    process that imported it while offline, such as a cache lookup, could never pull)."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = offline()


def cache_dir() -> Path:
    """The standard hub cache: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "huggingface" / "hub"


def token() -> str | None:
    env = os.environ.get("HF_TOKEN")
    if env:
        return env
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # a broken token file must not stop public downloads
        return None


# -- offline lookups -----------------------------------------------------------------------------------------


def cached_path(spec: ModelSpec) -> Path | None:
    """The file in the cache, or None. Never touches the network."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(spec.repo, spec.file, cache_dir=str(cache_dir()), revision=spec.revision)
    if not isinstance(found, str):
        return None
    path = Path(found)
    if not path.is_file():
        return None
    if spec.size is not None and path.stat().st_size != spec.size:
        return None
    return path


def require_cached(spec: ModelSpec, pair_name: str) -> Path:
    path = cached_path(spec)
    if path is None:
        raise LocalspecError(
            f"pair {pair_name} is not downloaded ({spec.file} missing): run localspec pull {pair_name}"
        )
    return path


# -- download ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    spec: ModelSpec
    url: str  # where the bytes are (after the hub's redirects)
    etag: str
    commit: str
    size: int
    sha256: str | None  # from models.toml, else the hub's LFS etag (the sha256 of the content)
    partial: Path
    blob: Path

    @property
    def have(self) -> int:
        return self.partial.stat().st_size if self.partial.is_file() else 0


def _storage(spec: ModelSpec) -> Path:
    return cache_dir() / ("models--" + spec.repo.replace("/", "--"))


def _hub_error(exc: BaseException, spec: ModelSpec) -> LocalspecError:
    """One line per failure mode the user can act on."""
    import httpx2
    from huggingface_hub import errors as hf

    where = f"{endpoint()}/{spec.repo}"
    if isinstance(exc, hf.GatedRepoError):
        status = exc.response.status_code if exc.response is not None else "401/403"
        if token():
            return HubError(f"{spec.repo} is gated and the token in HF_TOKEN has no access yet ({status}): "
                            f"accept the licence at {where} with that account, then pull again")
        return HubError(f"{spec.repo} is gated ({status}): accept the licence at {where}, then set HF_TOKEN "
                        f"to a token of that account (https://huggingface.co/settings/tokens) and pull again")
    if isinstance(exc, hf.RemoteEntryNotFoundError):
        return HubError(f"{spec.repo} has no file {spec.file} at revision {spec.revision} (404)")
    if isinstance(exc, hf.RevisionNotFoundError):
        return HubError(f"{spec.repo} has no revision {spec.revision!r} (404)")
    if isinstance(exc, hf.RepositoryNotFoundError):
        status = exc.response.status_code if exc.response is not None else "404"
        hint = "check HF_TOKEN" if token() else "private? set HF_TOKEN"
        return HubError(f"{spec.repo}: repository not found or not accessible ({status}; {hint})")
    if isinstance(exc, hf.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        if status == 401:
            return HubError(f"{spec.repo}: the hub refused the token in HF_TOKEN (401)")
        return HubError(f"{spec.repo}: the hub answered HTTP {status} for {spec.file}")
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return HubError(f"HF_HUB_OFFLINE is set and {spec.file} is not in the cache ({cache_dir()})")
    if isinstance(exc, httpx2.ConnectError | httpx2.TimeoutException | httpx2.RemoteProtocolError):
        return HubError(f"cannot reach {endpoint()} for {spec.repo} (no network?): {exc.__class__.__name__}")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return HubError(
            f"disk full while writing {spec.file} under {cache_dir()}; free space and pull again (resumes)"
        )
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EROFS):
        return HubError(f"cannot write to {cache_dir()}: {exc.strerror} (set HF_HOME or HF_HUB_CACHE)")
    return HubError(f"{spec.repo}:{spec.file}: download failed: {exc}")


def resolve(spec: ModelSpec) -> RemoteFile:
    """HEAD the file on the hub: where it is, its etag, commit, size and sha256."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    if offline():
        raise HubError(f"HF_HUB_OFFLINE is set and {spec.label} is not in the cache ({cache_dir()})")
    _tell_the_library_offline()
    url = hf_hub_url(spec.repo, spec.file, revision=spec.revision, endpoint=endpoint())
    try:
        meta = get_hf_file_metadata(url, token=token())
    except Exception as exc:
        raise _hub_error(exc, spec) from None
    if not meta.etag or not meta.commit_hash:
        raise HubError(
            f"{endpoint()} did not answer like a Hugging Face hub for {spec.label} (no ETag/commit)"
        )
    size = meta.size
    if size is None:
        raise HubError(f"{spec.label}: the hub did not report the file size")
    if spec.size is not None and spec.size != size:
        raise HubError(
            f"{spec.label}: the hub has {size} bytes, models.toml expects {spec.size} (file changed?)"
        )
    hub_sha = meta.etag if _SHA256.match(meta.etag) else None
    if spec.sha256 and hub_sha and spec.sha256 != hub_sha:
        raise HubError(
            f"{spec.label}: the hub's sha256 {hub_sha[:12]}… differs from models.toml's {spec.sha256[:12]}…"
        )
    blobs = _storage(spec) / "blobs"
    return RemoteFile(
        spec=spec,
        url=meta.location or url,
        etag=meta.etag,
        commit=meta.commit_hash,
        size=size,
        sha256=spec.sha256 or hub_sha,
        partial=blobs / (meta.etag + PARTIAL_SUFFIX),
        blob=blobs / meta.etag,
    )


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def check_disk(remotes: Iterable[RemoteFile]) -> None:
    """Refuse before the first byte when the rest of the download cannot fit."""
    import psutil

    todo = [r for r in remotes if not r.blob.is_file()]
    need = sum(r.size - r.have for r in todo)
    if not need:
        return
    where = _existing_parent(cache_dir())
    free = psutil.disk_usage(str(where)).free
    # Keep 1% spare: filling a disk to the last byte breaks other programs.
    if need > free - free // 100:
        raise HubError(
            f"not enough disk space in {where}: {need / 1e9:.1f} GB to download, {free / 1e9:.1f} GB free "
            "(free space or set HF_HUB_CACHE to a larger disk)"
        )


def _sha256_of(path: Path, progress: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
            if progress:
                progress(len(block))
    return digest.hexdigest()


WaitCallback = Callable[[ModelSpec, "int | None"], None]


@contextlib.contextmanager
def _one_pull_per_file(remote: RemoteFile, on_wait: WaitCallback | None) -> Iterator[None]:
    """Two pulls of one file must not append to the same partial file: the second waits for the first, which
    holds a per-file lock (filelock, as huggingface_hub uses; the OS releases it if that process dies). Its
    pid sits next to the lock so the waiting pull can say whom it waits for."""
    from filelock import FileLock, Timeout

    locks = cache_dir() / ".locks" / _storage(remote.spec).name
    owner = locks / f"{remote.etag}.localspec.pid"
    try:
        locks.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _hub_error(exc, remote.spec) from None
    # Not huggingface_hub's own `<etag>.lock`: hf_hub_download takes that one inside this lock.
    lock = FileLock(str(locks / f"{remote.etag}.localspec.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if on_wait is not None:
            on_wait(remote.spec, _pid_in(owner))
        lock.acquire()  # until the other pull ends; Ctrl-C still stops this one
    try:
        owner.write_text(f"{os.getpid()}\n", encoding="utf-8")
        yield
    finally:
        owner.unlink(missing_ok=True)
        lock.release()


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None  # the other pull is just starting or finishing


def download(remote: RemoteFile, on_wait: WaitCallback | None = None) -> Path:
    """Fetch (resuming a partial file), verify, and link into the cache. Returns the snapshot path."""
    with _one_pull_per_file(remote, on_wait):
        if not remote.blob.is_file():  # another pull may have finished it while this one waited
            _fetch(remote)
    return _link(remote.spec)


def _fetch(remote: RemoteFile) -> None:
    """Download into the partial file (resuming it), check size and sha256, then give it the blob's name."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    spec = remote.spec
    _tell_the_library_offline()
    remote.partial.parent.mkdir(parents=True, exist_ok=True)
    have = remote.have
    if have > remote.size:  # a stale partial from another version of the file
        remote.partial.unlink()
        have = 0
    headers = build_hf_headers(token=token())
    # Signed CDN links must not receive the hub token (huggingface_hub drops it the same way).
    if urlparse(remote.url).netloc != urlparse(endpoint()).netloc:
        headers.pop("authorization", None)
    try:
        with remote.partial.open("ab") as fh:
            http_get(
                remote.url,
                fh,
                resume_size=have,
                headers=headers,
                expected_size=remote.size,
                displayed_filename=spec.file,
            )
    except Exception as exc:
        got = remote.have
        if isinstance(exc, OSError) and exc.errno is None and got != remote.size:
            # huggingface_hub's size check, whose advice (force_download=True) is not a localspec option.
            raise _size_mismatch(remote, got) from None
        # The partial file stays (under its partial name) so the next pull resumes it.
        raise _hub_error(exc, spec) from None
    got = remote.partial.stat().st_size
    if got != remote.size:
        raise _size_mismatch(remote, got)
    if remote.sha256:
        actual = _sha256_of(remote.partial)
        if actual != remote.sha256:
            remote.partial.unlink(missing_ok=True)
            raise HubError(
                f"{spec.file}: checksum mismatch (sha256 {actual[:12]}, expected {remote.sha256[:12]}): "
                "the download was removed, pull again"
            )
    remote.partial.replace(remote.blob)


def _size_mismatch(remote: RemoteFile, got: int) -> HubError:
    """The body did not match the size the hub announced: short keeps the partial file (resumable), long is
    corrupt and goes."""
    spec = remote.spec
    if got < remote.size:
        return HubError(f"{spec.file}: the download stopped at {got} of {remote.size} bytes; pull again to resume")
    remote.partial.unlink(missing_ok=True)
    return HubError(
        f"{spec.file}: the server sent {got} bytes where it announced {remote.size}; removed, pull again"
    )


def _link(spec: ModelSpec) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        # The blob is in place, so this only writes refs/ and the snapshots/ link (one HEAD request).
        path = hf_hub_download(
            spec.repo,
            spec.file,
            revision=spec.revision,
            cache_dir=str(cache_dir()),
            endpoint=endpoint(),
            token=token(),
        )
    except Exception as exc:
        raise _hub_error(exc, spec) from None
    return Path(path)


def pull(specs: list[ModelSpec], on_wait: WaitCallback | None = None) -> list[Path]:
    """Download every file that is not cached yet: metadata first, one disk check for all, then the bytes.
    `on_wait(spec, pid)` is told when another process is already downloading a file (this one then waits)."""
    paths: list[Path | None] = [cached_path(s) for s in specs]
    missing = [s for s, p in zip(specs, paths, strict=True) if p is None]
    remotes = {s: resolve(s) for s in missing}
    check_disk(remotes.values())
    return [p if p is not None else download(remotes[s], on_wait) for s, p in zip(specs, paths, strict=True)]
