"""bench/lab/slot_rounds.py on a tiny real pair (CPU): `--share-batches` overrides the load probe's verdict on whether
slots share a verify, and the probe's own figures are reported whatever the override."""

from __future__ import annotations

import json

import pytest
import slot_rounds

from localspec.rounds.policies import LoadPolicy


@pytest.mark.parametrize("share", ["probe", "on", "off"])
def test_share_batches_overrides_the_probe_and_reports_it(tiny_pair, share, monkeypatch, capsys) -> None:
    monkeypatch.setattr(LoadPolicy, "SHARES", LoadPolicy.SHARES)  # the script pins it; restored after the test
    target, draft = tiny_pair
    assert slot_rounds.main(["--target", str(target), "--draft", str(draft), "--slots", "3", "--rounds", "2",
                             "--warmup", "1", "--temperature", "0", "--k", "3", "--ctx", "256",
                             "--share-batches", share]) == 0
    timed = json.loads(capsys.readouterr().out)["timed"]
    probe = timed["probe"]["target"]
    # On the CPU the probe shares only bit for bit as alone: both figures 0 when it shares.
    assert probe["shared"] == (probe["error"] == 0.0)
    expected = {"probe": probe["shared"], "on": True, "off": False}[share]
    assert timed["slots_batched"] is expected
    assert timed["rounds"] == 2 and timed["tokens"] > 0
