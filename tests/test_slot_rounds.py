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
    # A server's round is the step and its events: timed apart, never shorter; stand-aside off at a held share 1.
    assert timed["round_with_events_s_median"] >= timed["round_s_median"] and timed["stand_aside"] is False


def test_an_mtp_heads_rounds_held_at_no_drafts_share_one_decode_in_scrambled_slots(hybrid_pair, monkeypatch,
                                                                                     capsys) -> None:
    """`--drafter mtp --share 0`: a speculative server's rounds once the load policy cut every draft. Its slots,
    first filled out of order (2, 0, 4, 1, 3), share one target decode a round like a plain load's (`--k 0`);
    drafting the whole length (`--share 1`) shows the head's decodes in the timeline."""
    monkeypatch.setattr(LoadPolicy, "SHARES", LoadPolicy.SHARES)
    target = hybrid_pair[0]
    common = ["--target", str(target), "--slots", "5", "--rounds", "3", "--warmup", "1", "--temperature", "0.7",
              "--ctx", "256", "--timeline"]
    runs = {}
    for name, extra in (("plain", ["--k", "0"]), ("none", ["--drafter", "mtp", "--k", "3", "--share", "0"]),
                        ("all", ["--drafter", "mtp", "--k", "3", "--share", "1"]),
                        ("aside", ["--drafter", "mtp", "--k", "3", "--share", "1", "--stand-aside"])):
        assert slot_rounds.main(common + extra) == 0
        runs[name] = json.loads(capsys.readouterr().out)["timed"]
    assert runs["aside"]["stand_aside"] is True and runs["all"]["stand_aside"] is False
    for name in ("plain", "none"):
        per_round = runs[name]["timeline"]["median_per_round"]
        assert per_round["target_decodes"] == 1 and per_round["head_s"] == 0.0, name
    assert runs["none"]["acceptance"] == 0.0  # (nothing drafted)
    drafting = runs["all"]["timeline"]["median_per_round"]
    assert drafting["head_s"] > 0.0 and drafting["target_decodes"] == 1
