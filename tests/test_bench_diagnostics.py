"""The diagnostic scripts of this session's GPU questions run on a real (tiny) pair and report what they promise:
bench/lab/host_share.py with draft-ahead (`--draft-ahead`, `--draft-ahead-length`) and bench/lab/chain_state.py."""

from __future__ import annotations

import json
from pathlib import Path

import chain_state
import host_share
import pytest


@pytest.mark.slow
@pytest.mark.parametrize(("draft_ahead", "draft_ahead_length"), [("on", "fit"), ("on", "full"), ("off", "fit")])
def test_host_share_drafts_ahead_as_told_and_splits_the_host_time_by_phase(
        tiny_pair: tuple[Path, Path], tmp_path: Path, draft_ahead: str, draft_ahead_length: str) -> None:
    target, draft = tiny_pair
    out = tmp_path / "host.json"
    assert host_share.main(["--target", str(target), "--draft", str(draft), "--temperature", "0.7", "--rounds", "12",
                            "--threads", "1", "--draft-ahead", draft_ahead, "--draft-ahead-length", draft_ahead_length,
                            "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["draft_ahead"] is (draft_ahead == "on") and result["draft_ahead_length"] == draft_ahead_length
    assert result["rounds"] == 12
    assert (result["ahead_made"] > 0) is (draft_ahead == "on")
    assert set(result["host_cpu_split_ms"]) == {"plan", "draft", "verify", "rewind"}
    assert result["ahead_wait_ms"] >= 0.0 and result["cost_model_cpu_ms"] >= 0.0
    assert (result["ahead_cpu_ms"] > 0.0) is (draft_ahead == "on")


@pytest.mark.slow
def test_chain_state_prints_the_chains_cost_figures_after_each_generation(
        tiny_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = tiny_pair
    chain_state.main(["--target", str(target), "--draft", str(draft), "--prompts", "shipped", "--max-tokens", "12",
                      "--repeat", "1", "--ctx", "512"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["warm-up"] * 4 + ["run"] * 3  # 4 warm-ups, 3 prompts
    assert all("could pay (padded)" in line and "verify ms [(" in line and "catch-up of 64 " in line for line in lines)
