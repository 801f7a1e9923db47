"""`localspec models / pull / check / doctor` end to end, and the session's pre-load checks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from localspec import config
from localspec.cli.app import app
from localspec.errors import IncompatiblePairError, LocalspecError
from localspec.models import demo, memory, registry
from localspec.sessions import session
from tests.helpers_hub import FakeHub, HubFile
from tests.helpers_vocab import write_vocab

runner = CliRunner()

USER_PAIR = """
[[pair]]
name = "tiny"
description = "generated test pair"
n_ctx = 1024
n_draft = 4

[pair.target]
repo = "org/tiny-target"
file = "target.gguf"
quant = "Q4_K_M"
family = "test"
license = "mit"

[pair.draft]
repo = "org/tiny-draft"
file = "draft.gguf"
quant = "Q8_0"
family = "test"
license = "mit"
"""


@pytest.fixture(scope="module")
def gemma(demo_home: Path) -> Path:
    """The demo target (Gemma 3 270M Q4_K_M), assembled once per session by conftest's demo_home."""
    return demo_home / "cache" / "demo" / demo.TARGET_FILE


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh LOCALSPEC_HOME with a user pair, and a fake hub serving its two files."""
    from gguf import LlamaFileType

    home = tmp_path / "home"
    home.mkdir()
    (home / "models.toml").write_text(USER_PAIR)
    target = write_vocab(tmp_path / "target.gguf", ftype=LlamaFileType.MOSTLY_Q4_K_M)
    draft = write_vocab(tmp_path / "draft.gguf")
    hub = FakeHub().start()
    hub.files[("org/tiny-target", "target.gguf")] = HubFile(target.read_bytes())
    hub.files[("org/tiny-draft", "draft.gguf")] = HubFile(draft.read_bytes())
    for key, value in {
        "LOCALSPEC_HOME": str(home),
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield hub
    hub.stop()


def _main(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real entry point in a child process: errors must come out as one line and an exit code."""
    return subprocess.run(
        [sys.executable, "-c", "from localspec.cli.app import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_models_lists_demo_shipped_and_user_pairs(env: FakeHub) -> None:
    result = runner.invoke(app, ["models"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in ["demo", "tiny", *[p.name for p in registry.parse_file(registry.shipped_path())]]:
        assert name in result.output
    assert "* default (demo)" in result.output


def test_pull_downloads_sets_default_and_the_pair_resolves_offline(env: FakeHub, monkeypatch) -> None:
    result = runner.invoke(app, ["pull", "tiny", "--yes"])
    assert result.exit_code == 0, result.output
    assert registry.default_pair_name() == "tiny"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = session.resolve_files(None, None, None)  # no arguments: the default pair, from the cache
    assert files.name == "tiny" and files.n_ctx == 1024 and files.n_draft == 4
    assert files.target.name == "target.gguf" and "models--org--tiny-target" in str(files.target)
    listing = runner.invoke(app, ["models"], env={"COLUMNS": "200"})
    assert "* default (tiny)" in listing.output
    check = runner.invoke(app, ["check", "--pair", "tiny"])
    assert check.exit_code == 0 and "verdict: compatible" in check.output


def test_pull_by_repo_and_file(env: FakeHub) -> None:
    result = runner.invoke(app, ["pull", "--target", "org/tiny-target:target.gguf"])
    assert result.exit_code == 0, result.output
    assert "✓" in result.output


def test_a_pair_that_is_not_pulled_says_how_to_get_it(env: FakeHub) -> None:
    with pytest.raises(LocalspecError, match="pair tiny is not downloaded .*run localspec pull tiny"):
        session.resolve_files("tiny", None, None)


def test_check_incompatible_exits_1_and_names_the_reason(gemma: Path, smollm2_path: Path) -> None:
    result = runner.invoke(app, ["check", str(gemma), str(smollm2_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert "tokenizer models differ: target 'llama', draft 'gpt2'" in result.output
    assert "verdict: incompatible" in result.output


def test_check_on_a_corrupt_file_is_one_line(tmp_path: Path, smollm2_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 40)
    out = _main("check", str(bad), str(smollm2_path))
    assert out.returncode == 2
    assert out.stderr.strip().startswith(f"localspec: error: {bad}:") and out.stderr.count("\n") == 1
    assert "Traceback" not in out.stderr


def test_pull_404_is_one_line(env: FakeHub) -> None:
    import os

    out = _main("pull", "--target", "org/tiny-target:absent.gguf", env=dict(os.environ))
    assert out.returncode == 2 and "has no file absent.gguf" in out.stderr and "Traceback" not in out.stderr


def test_preflight_refuses_an_incompatible_pair_before_loading(gemma: Path, smollm2_path: Path) -> None:
    files = session.ModelFiles(target=gemma, draft=smollm2_path, name="custom")
    with pytest.raises(IncompatiblePairError, match="tokenizer models differ"):
        session.preflight(files, config.load_preset())


def test_preflight_refuses_what_does_not_fit_and_says_what_to_change(gemma: Path) -> None:
    files = session.ModelFiles(target=gemma, draft=gemma, name="custom")
    small = memory.Devices(ram_available=1400 << 20)
    with pytest.raises(
        LocalspecError, match=r"pair custom will not fit: needs .* RAM .*; try .*n_batch = 256"
    ):
        session.preflight(files, config.load_preset(), devices=small)
    ok = session.preflight(files, config.load_preset(), devices=memory.Devices(ram_available=64 << 30))
    assert ok.verdict is not None and ok.verdict.compatible and ok.estimate.fits


def test_open_session_checks_before_reading_weights(gemma: Path, monkeypatch, smollm2_path: Path) -> None:
    loaded: list[Path] = []

    def no_load(path, **kw):  # any load here means a check ran too late
        loaded.append(path)
        raise AssertionError("a model was loaded before the pre-load checks")

    monkeypatch.setattr(session, "LlamaModel", no_load)
    files = session.ModelFiles(target=gemma, draft=smollm2_path, name="custom")
    with pytest.raises(IncompatiblePairError):
        session.open_session(files, config.load_preset())
    assert loaded == []


@pytest.mark.slow
def test_doctor_on_the_demo_pair(use_demo_home: Path) -> None:
    result = runner.invoke(app, ["doctor"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for line in ("same family and tokenizer", "draft ≥ 8-bit", "the pair fits", "GPU offload"):
        assert line in result.output
    slots = runner.invoke(app, ["doctor", "--parallel", "4"], env={"COLUMNS": "200"})
    assert slots.exit_code == 0, slots.output
    assert "× 4 slots" in slots.output  # the fit counts serve's four KV caches


def test_models_at_80_columns_shows_every_pair_name_whole_and_qwen3_first(env: FakeHub) -> None:
    out = _main("models", env={**__import__("os").environ, "COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    names = [*registry.load_pairs()]
    for name in names:  # never cut to "qwen2.5-…"
        assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", out.stdout), name
    assert "…" not in out.stdout
    rows = [line for line in lines if any(re.search(rf"\s{re.escape(n)}\s", f" {line} ") for n in names)]
    assert rows[0].split()[0] == "qwen3-32b"  # the recommended pair comes first, marked as such
    assert re.search(r"qwen3-32b\s+recommended\s+20\.4 GB\s+(likely|no|RAM only|no \(RAM\))\s+8192 q8_0", rows[0])
    assert lines[lines.index(rows[0]) + 1].split()[0] == "Qwen3-32B-Q4_K_M.gguf"  # its files under its name


def test_pull_of_a_gated_repo_without_a_token_prints_the_licence_step(env: FakeHub, tmp_path: Path) -> None:
    import os

    (tmp_path / "home" / "models.toml").write_text(USER_PAIR.replace("org/tiny-target", "org/gated-target"))
    env.gated_repos.add("org/gated-target")
    out = _main("pull", "tiny", env=dict(os.environ))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert re.fullmatch(
        r"localspec: error: org/gated-target is gated \(401\): accept the licence at "
        rf"{re.escape(env.url)}/org/gated-target, then set HF_TOKEN to a token of that account "
        r"\(https://huggingface.co/settings/tokens\) and pull again\n",
        out.stderr,
    ), out.stderr


MMPROJ_PAIR = USER_PAIR.replace('name = "tiny"', 'name = "tinyv"') + """
[pair.mmproj]
repo = "org/tiny-target"
file = "mmproj.gguf"
quant = "F32"
family = "test"
license = "mit"
"""


def test_a_pairs_projector_is_pulled_with_it_and_loaded_only_with_mmproj_auto(env: FakeHub, tmp_path: Path) -> None:
    """`[pair.mmproj]`: `pull` fetches the projector beside the pair; `--mmproj auto` resolves to it (and says why
    not where the pair names none or it is not pulled yet); without the option no projector is loaded."""
    from synthetic import ProjectorSpec, write_projector

    from localspec.cli.options import RunOptions

    (tmp_path / "home" / "models.toml").write_text(USER_PAIR + MMPROJ_PAIR)
    projector = write_projector(tmp_path / "mmproj.gguf", ProjectorSpec(n_embd_text=64))
    env.files[("org/tiny-target", "mmproj.gguf")] = HubFile(projector.read_bytes())
    assert registry.get_pair("tinyv").mmproj.file == "mmproj.gguf"  # type: ignore[union-attr]
    assert registry.get_pair("tinyv").expected_bytes is None  # (no sizes pinned in this test pair)
    assert runner.invoke(app, ["pull", "tiny", "--yes"]).exit_code == 0  # (tinyv's target and draft, not its projector)
    with pytest.raises(LocalspecError, match=r"--mmproj auto: pair tinyv has one \(org/tiny-target:mmproj\.gguf\) "
                                             r"not pulled yet: localspec pull tinyv"):
        RunOptions(pair="tinyv", mmproj=Path("auto")).files()
    result = runner.invoke(app, ["pull", "tinyv", "--yes"])
    assert result.exit_code == 0 and "mmproj.gguf" in result.output, result.output
    files = RunOptions(pair="tinyv", mmproj=Path("auto")).files()
    assert files.mmproj is not None and files.mmproj.read_bytes() == projector.read_bytes()
    assert RunOptions(pair="tinyv").files().mmproj is None  # nothing loads it unasked
    with pytest.raises(LocalspecError, match="--mmproj auto: pair tiny names no projector; give --mmproj PATH"):
        RunOptions(pair="tiny", mmproj=Path("auto")).files()
