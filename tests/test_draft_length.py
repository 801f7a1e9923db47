"""The draft-length chooser (adaptive drafting) on synthetic observations: no model needed."""

from __future__ import annotations

import dataclasses

from localspec.config import Drafting, load_preset
from localspec.policies import DraftLength as _DraftLength


def drafting(n_draft: int, p_min: float, adaptive: bool) -> Drafting:
    return dataclasses.replace(load_preset().draft, n_draft=n_draft, p_min=p_min, adaptive=adaptive)


def feed(chooser: _DraftLength, rounds: int, accepted_of, draft_step: float, verify_base: float,
         verify_per_token: float) -> list[int]:
    ks = []
    for _ in range(rounds):
        k = chooser.next()
        ks.append(k)
        accepted = accepted_of(k)
        chooser.observe(k, accepted, draft_step * k, verify_base + verify_per_token * (k + 1), k + 1)
    return ks


def test_fixed_length_is_the_preset_at_any_temperature():
    chooser = _DraftLength(drafting(12, 0.0, False))
    assert feed(chooser, 40, lambda k: 0, 0.001, 0.01, 0.001) == [12] * 40


def test_adaptive_uses_a_short_ladder_of_lengths():
    assert _DraftLength(drafting(6, 0.0, True)).ladder == [2, 4, 6]
    assert _DraftLength(drafting(10, 0.0, True)).ladder == [3, 7, 10]
    assert not _DraftLength(drafting(1, 0.0, True)).adaptive  # nothing to choose from


def test_adaptive_changes_length_only_at_epoch_boundaries():
    """Every width change re-captures CUDA graphs: k holds for whole epochs."""
    chooser = _DraftLength(drafting(9, 0.0, True))
    ks = feed(chooser, 12 * _DraftLength.EPOCH, lambda k: min(k, 2), 0.0008, 0.010, 0.0014)
    changes = [i for i in range(1, len(ks)) if ks[i] != ks[i - 1]]
    assert changes and all(i % _DraftLength.EPOCH == 0 for i in changes)
    assert set(ks) <= set(chooser.ladder)
    assert len(changes) <= 3  # probe, probe, settle: then it stays


def test_adaptive_keeps_the_longest_length_when_drafts_are_always_right_and_cheap():
    chooser = _DraftLength(drafting(10, 0.0, True))
    ks = feed(chooser, 8 * _DraftLength.EPOCH, lambda k: k, draft_step=0.0005, verify_base=0.010,
              verify_per_token=0.0002)
    assert ks[-1] == 10


def test_adaptive_shrinks_k_when_drafts_fail_early():
    chooser = _DraftLength(drafting(9, 0.0, True))
    ks = feed(chooser, 8 * _DraftLength.EPOCH, lambda k: min(k, 1), draft_step=0.0008, verify_base=0.010,
              verify_per_token=0.0014)
    assert ks[-1] == chooser.ladder[0] == 3


def test_adaptive_prefers_the_length_that_covers_the_burst():
    """Drafts right for exactly 6 tokens, then wrong: 3 leaves tokens behind, 9 wastes work, 6 is best."""
    chooser = _DraftLength(drafting(9, 0.0, True))
    ks = feed(chooser, 8 * _DraftLength.EPOCH, lambda k: min(k, 6), draft_step=0.0008, verify_base=0.010,
              verify_per_token=0.0014)
    assert ks[-1] == 6
