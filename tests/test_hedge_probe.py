"""bench/lab/hedge_probe.py's arithmetic: the coverage of hedged bets and the round it predicts (no model; the
probe itself runs the real loop, checked against plain greedy decoding with --check)."""

from __future__ import annotations

import pytest
from hedge_probe import CARD_ROUND, Rounds, predict


def test_coverage_counts_rejections_at_the_least_sure_positions_whose_correction_was_the_runner_up() -> None:
    seen = Rounds(k=6, rejected_at=[None, 2, 5, 1, 3, None], runner_up=[False, True, True, False, True, False],
                  margin_rank=[0, 1, 2, 1, 4, 0], tokens=30)
    assert seen.coverage(1) == pytest.approx(1 / 6)  # round 2 only: round 4's correction was not the runner-up
    assert seen.coverage(2) == pytest.approx(2 / 6)
    assert seen.coverage(4) == pytest.approx(3 / 6)
    summary = seen.summary(2)
    assert summary["all_accepted"] == pytest.approx(2 / 6) and summary["rejected_at"][2] == 1
    assert summary["runner_up_when_rejected"] == pytest.approx(3 / 4)


def test_the_prediction_trades_the_saved_on_path_drafting_against_the_dearer_steps_beside_the_verify() -> None:
    free = predict(CARD_ROUND, coverage=0.14, batch_ratio=1.0, k=6)
    failed = 1 - CARD_ROUND["bets_kept"]
    assert free["saved_ms"] == pytest.approx(CARD_ROUND["draft_ms"] * 0.14 / failed)
    assert free["added_ms"] == 0 and free["round_ms"] < CARD_ROUND["round_ms"]
    assert free["tok_s"] == pytest.approx(1000 * 6.0 / free["round_ms"])
    dear = predict(CARD_ROUND, coverage=0.14, batch_ratio=1.1, k=6)
    assert dear["added_ms"] == pytest.approx(0.1 * 7 * CARD_ROUND["contended_step_ms"])
    assert dear["vs_now"] < 1  # a tenth more per draft step beside the verify costs more than it saves
    # Never more saved than all the on-path drafting there is.
    assert predict(CARD_ROUND, coverage=0.9, batch_ratio=1.0, k=6)["saved_ms"] == pytest.approx(CARD_ROUND["draft_ms"])
