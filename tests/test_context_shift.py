"""llama-server's context shift arithmetic (`n_keep`, `n_discard`), worked out by hand from its pre_decode."""

from __future__ import annotations

import pytest

from localspec.rounds.context_shift import Shift, plan, shifted


@pytest.mark.parametrize(("n_keep", "n_discard", "add_bos", "expected"), [
    # n_ctx 64, cells 63 (one short of full), prompt of 20 tokens
    (0, 0, False, Shift(0, 31)),  # nothing kept: half of the 63 dropped
    (0, 0, True, Shift(1, 31)),  # the BOS kept (n_keep does not count it): half of 62
    (10, 0, True, Shift(11, 26)),
    (-1, 0, False, Shift(20, 21)),  # -1: the whole prompt
    (-1, 0, True, Shift(21, 21)),
    (5, 7, False, Shift(5, 7)),  # n_discard as asked
    (5, 500, False, Shift(5, 57)),  # ... at most all but one of the rest
    (100, 0, False, Shift(60, 1)),  # n_keep at most n_ctx - 4; then at least one goes
])
def test_plan_is_llama_servers(n_keep: int, n_discard: int, add_bos: bool, expected: Shift) -> None:
    assert plan(63, 64, 20, n_keep, n_discard, add_bos) == expected


def test_a_shift_always_frees_at_least_one_cell_and_keeps_one() -> None:
    for n_ctx in (64, 65, 100):
        for n_keep in (-1, 0, 1, 30, n_ctx):
            for n_discard in (0, 1, 5, 10_000):
                s = plan(n_ctx - 1, n_ctx, n_ctx - 2, n_keep, n_discard, True)
                assert s.discard >= 1 and s.keep + s.discard < n_ctx - 1


def test_shifted_keeps_the_beginning_and_the_tail() -> None:
    tokens = list(range(10))
    assert shifted(tokens, Shift(2, 3)) == [0, 1, 5, 6, 7, 8, 9]
    assert shifted(tokens, Shift(0, 9)) == [9]
