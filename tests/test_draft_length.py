"""The draft-length chooser (adaptive drafting) on synthetic observations: no model needed."""

from __future__ import annotations

from localspec.config import Drafting
from localspec.engine import GREEDY_MAX_DRAFT, _DraftLength


def feed(chooser: _DraftLength, rounds: int, accepted_of, draft_step: float, verify_base: float,
         verify_per_token: float) -> None:
    for _ in range(rounds):
        k = chooser.next()
        accepted = accepted_of(k)
        chooser.observe(k, accepted, draft_step * k, verify_base + verify_per_token * (k + 1))


def test_fixed_length_is_the_preset_and_greedy_is_capped():
    assert _DraftLength(Drafting(6, 0.0, False), 32).next() == 6
    assert _DraftLength(Drafting(12, 0.0, False), GREEDY_MAX_DRAFT).next() == GREEDY_MAX_DRAFT


def test_adaptive_grows_k_when_drafts_are_always_right_and_cheap():
    chooser = _DraftLength(Drafting(10, 0.0, True), 32)
    feed(chooser, 60, lambda k: k, draft_step=0.0005, verify_base=0.010, verify_per_token=0.0002)
    assert chooser.next() == 10


def test_adaptive_shrinks_k_when_drafts_fail_early():
    chooser = _DraftLength(Drafting(10, 0.0, True), 32)
    feed(chooser, 60, lambda k: min(k, 1), draft_step=0.0008, verify_base=0.010, verify_per_token=0.0014)
    assert chooser.next() <= 2


def test_adaptive_finds_the_burst_length():
    """Drafts right for exactly 5 tokens, then wrong: any k > 5 wastes work, k < 5 leaves tokens behind."""
    chooser = _DraftLength(Drafting(10, 0.0, True), 32)
    feed(chooser, 80, lambda k: min(k, 5), draft_step=0.0008, verify_base=0.010, verify_per_token=0.0014)
    assert chooser.next() == 5
