"""`localspec pull` against a local HTTP server standing in for the hub (HF_ENDPOINT), never the internet."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from localspec.errors import LocalspecError
from localspec.models import hub
from localspec.models.registry import ModelSpec
from tests.helpers_hub import FakeHub, HubFile

CONTENT = os.urandom(3 << 20) + b"tail"  # 3 MiB: several http chunks, so a cut lands mid-transfer


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    server = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield server
    server.stop()


def _spec(repo: str = "org/good", file: str = "model.gguf", **kw: object) -> ModelSpec:
    return ModelSpec(repo=repo, file=file, **kw)  # type: ignore[arg-type]


def test_download_lands_in_the_standard_cache_and_resolves_offline(fake_hub: FakeHub, tmp_path: Path) -> None:
    fake_hub.files[("org/good", "model.gguf")] = HubFile(CONTENT)
    [path] = hub.pull([_spec()])
    assert path.read_bytes() == CONTENT
    # huggingface_hub's own layout: models--org--good/snapshots/<commit>/model.gguf -> ../../blobs/<sha256>
    assert path.parent.parent.name == "snapshots"
    assert path.resolve().name == hashlib.sha256(CONTENT).hexdigest()
    assert not list(path.resolve().parent.glob("*" + hub.PARTIAL_SUFFIX))
    # Everything else is offline: the cached file is found with the network gone.
    fake_hub.stop()
    assert hub.cached_path(_spec()) == path
    assert hub.pull([_spec()]) == [path]


def test_a_pull_works_after_huggingface_hub_was_first_imported_offline(fake_hub: FakeHub, monkeypatch) -> None:
    """huggingface_hub reads HF_HUB_OFFLINE once, at its import (a cache lookup by `localspec models` while
    offline, say); localspec reads it at call time, so a later pull with it unset must reach the hub."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what an import with HF_HUB_OFFLINE=1 leaves behind
    fake_hub.files[("org/good", "model.gguf")] = HubFile(CONTENT)
    [path] = hub.pull([_spec()])
    assert path.read_bytes() == CONTENT


def test_pull_resumes_a_partial_file_with_a_range_request(fake_hub: FakeHub) -> None:
    fake_hub.files[("org/good", "model.gguf")] = HubFile(CONTENT)
    remote = hub.resolve(_spec())
    remote.partial.parent.mkdir(parents=True)
    remote.partial.write_bytes(CONTENT[:1000_000])  # what an interrupted earlier run left
    [path] = hub.pull([_spec()])
    assert path.read_bytes() == CONTENT
    assert [r[2] for r in fake_hub.gets("model.gguf")] == ["bytes=1000000-"]


def test_a_connection_dropped_mid_transfer_resumes_where_it_stopped(fake_hub: FakeHub, monkeypatch) -> None:
    from huggingface_hub import constants

    # Written in 64 KiB chunks, so the bytes before the cut reach the disk and the retry asks for the rest.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 << 10)
    fake_hub.files[("org/good", "model.gguf")] = HubFile(CONTENT, cut_first_get_at=1 << 20)
    [path] = hub.pull([_spec()])
    assert path.read_bytes() == CONTENT
    ranges = [r[2] for r in fake_hub.gets("model.gguf")]
    assert ranges[0] is None and ranges[1] == f"bytes={1 << 20}-"


def test_checksum_mismatch_removes_the_file(fake_hub: FakeHub) -> None:
    fake_hub.files[("org/good", "model.gguf")] = HubFile(CONTENT, advertised_sha256="ab" * 32)
    with pytest.raises(LocalspecError, match="checksum mismatch"):
        hub.pull([_spec()])
    assert hub.cached_path(_spec()) is None
    storage = hub.cache_dir() / "models--org--good"
    assert not [p for p in storage.rglob("*") if p.is_file()]  # nothing left that looks complete, or partial


def test_models_toml_sha256_is_checked_against_the_hub(fake_hub: FakeHub) -> None:
    fake_hub.files[("org/good", "model.gguf")] = HubFile(CONTENT)
    with pytest.raises(LocalspecError, match="differs from models.toml"):
        hub.pull([_spec(sha256="cd" * 32)])
    with pytest.raises(LocalspecError, match="models.toml expects 5"):
        hub.pull([_spec(size=5)])


@pytest.mark.parametrize(
    ("setup", "spec", "message"),
    [
        (lambda h: None, _spec(file="absent.gguf"), r"has no file absent.gguf .*\(404\)"),
        (
            lambda h: h.missing_repos.add("org/nope"),
            _spec(repo="org/nope"),
            r"org/nope: repository not found .*404",
        ),
        (
            lambda h: h.private_repos.add("org/private"),
            _spec(repo="org/private"),
            r"not accessible \(401; private",
        ),
        (
            lambda h: h.gated_repos.add("org/gated"),
            _spec(repo="org/gated"),
            r"org/gated is gated \(401\): accept the licence at http://127\.0\.0\.1:\d+/org/gated, then set HF_TOKEN",
        ),
    ],
)
def test_hub_errors_are_one_line(fake_hub: FakeHub, setup, spec: ModelSpec, message: str) -> None:
    fake_hub.files[("org/good", "model.gguf")] = HubFile(CONTENT)
    setup(fake_hub)
    with pytest.raises(LocalspecError, match=message) as err:
        hub.pull([spec])
    assert "\n" not in str(err.value)


def test_gated_repo_with_a_token_that_has_no_access_says_to_accept_the_licence(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.gated_repos.add("org/gated")
    fake_hub.files[("org/gated", "model.gguf")] = HubFile(CONTENT)
    monkeypatch.setenv("HF_TOKEN", "hf_not_accepted")
    with pytest.raises(LocalspecError, match=r"org/gated is gated and the token in HF_TOKEN has no access yet "
                                             r"\(403\): accept the licence at http://.*/org/gated"):
        hub.pull([_spec(repo="org/gated")])
    monkeypatch.setenv("HF_TOKEN", fake_hub.good_token)  # after accepting, the same pull works
    [path] = hub.pull([_spec(repo="org/gated")])
    assert path.read_bytes() == CONTENT


def test_hf_token_is_sent_and_a_bad_one_is_named(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hub.private_repos.add("org/private")
    fake_hub.files[("org/private", "model.gguf")] = HubFile(CONTENT)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(LocalspecError, match="refused the token in HF_TOKEN"):
        hub.pull([_spec(repo="org/private")])
    monkeypatch.setenv("HF_TOKEN", fake_hub.good_token)
    [path] = hub.pull([_spec(repo="org/private")])
    assert path.read_bytes() == CONTENT
    assert fake_hub.gets("model.gguf")[-1][3] == f"Bearer {fake_hub.good_token}"


def test_no_network_is_named(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hub.stop()
    with pytest.raises(LocalspecError, match="cannot reach .* \\(no network\\?\\)"):
        hub.pull([_spec()])


def test_offline_mode_refuses_downloads_but_not_cached_files(fake_hub: FakeHub, monkeypatch) -> None:
    fake_hub.files[("org/good", "model.gguf")] = HubFile(CONTENT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LocalspecError, match="HF_HUB_OFFLINE is set"):
        hub.pull([_spec()])
    assert fake_hub.requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    [path] = hub.pull([_spec()])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.pull([_spec()]) == [path]


def test_disk_space_is_checked_before_the_first_byte(fake_hub: FakeHub) -> None:
    fake_hub.files[("org/good", "model.gguf")] = HubFile(CONTENT, advertised_size=10**16)
    with pytest.raises(LocalspecError, match="not enough disk space"):
        hub.pull([_spec()])
    assert fake_hub.gets("model.gguf") == []


def test_require_cached_names_the_pull_command(fake_hub: FakeHub) -> None:
    with pytest.raises(LocalspecError, match="pair p1 is not downloaded .*run localspec pull p1"):
        hub.require_cached(_spec(), "p1")
