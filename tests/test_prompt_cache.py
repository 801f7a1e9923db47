"""The host-RAM prompt cache as a store (no model): what a state may serve, lookup, the budget's edge, LRU order,
and what a recurrent or sliding-window state may not serve (a prefix of it)."""

from __future__ import annotations

import dataclasses

import pytest

from localspec.config import ConfigError, load_preset
from localspec.rounds.prompt_cache import (
    MIB,
    ModelState,
    PromptCache,
    SlotState,
    auto_limit,
    limit_bytes,
    shared_prefix,
)


def state(tokens: list[int], size: int = 100, floor: int | None = None, draft: int | None = None) -> SlotState:
    """A slot state holding `tokens` in a target of `size` bytes (floor: its restore floor; None = 0) and, with
    `draft`, a draft model holding that many of them."""
    models = [ModelState(len(tokens), bytearray(size), floor or 0)]
    if draft is not None:
        models.append(ModelState(draft, bytearray(10), 0))
    return SlotState(tuple(tokens), tuple(models))


def test_shared_prefix() -> None:
    assert shared_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert shared_prefix([], [1]) == 0
    assert shared_prefix([1, 2], [1, 2, 3]) == 2


def test_attention_state_serves_any_prefix_it_shares() -> None:
    s = state([1, 2, 3, 4, 5])
    assert s.reusable([1, 2, 3, 4, 5, 6, 7]) == 5
    assert s.reusable([1, 2, 9]) == 2
    assert s.reusable([9]) == 0
    assert s.reusable([1, 2, 3]) == 3  # a shorter prompt: cut back


def test_exact_state_serves_only_its_whole_length() -> None:
    """A recurrent state (floor = its length) is valid at exactly its tokens: a prompt that diverges inside them,
    or stops before their end, gets nothing from it — never a wrong prefix."""
    s = state([1, 2, 3, 4, 5], floor=5)
    assert s.reusable([1, 2, 3, 4, 5, 6]) == 5
    assert s.reusable([1, 2, 3, 4, 5]) == 5
    assert s.reusable([1, 2, 3, 4, 9, 6]) == 0
    assert s.reusable([1, 2, 3, 4]) == 0
    assert s.reusable([9, 2, 3, 4, 5, 6]) == 0  # diverges at token 0


def test_sliding_window_state_serves_its_length_or_one_less() -> None:
    s = state([1, 2, 3, 4, 5], floor=4)
    assert s.reusable([1, 2, 3, 4, 5, 6]) == 5
    assert s.reusable([1, 2, 3, 4, 7]) == 4
    assert s.reusable([1, 2, 3, 7]) == 0


def test_best_picks_the_longest_reuse_and_counts_hits_and_misses() -> None:
    cache = PromptCache(10_000)
    a, b = state([1, 2, 3, 4]), state([1, 2, 7, 8, 9])
    cache.put(a)
    cache.put(b)
    found = cache.best([1, 2, 3, 4, 5])
    assert found is not None and found[0] is a and found[1] == 4
    found = cache.best([1, 2, 7, 8, 0])
    assert found is not None and found[0] is b and found[1] == 4
    assert cache.best([5, 6]) is None
    assert cache.best([1, 2, 3, 4, 5], better_than=4) is None  # the slot holds as much already
    c = cache.counters()
    assert (c.hits, c.misses, c.restored_tokens) == (2, 2, 8)


def test_an_entry_serving_less_than_a_quarter_of_itself_is_not_restored() -> None:
    """Copying a long state in to reuse its first tokens (a BOS, a shared system prompt) costs more than it saves."""
    cache = PromptCache(10_000)
    cache.put(state(list(range(100))))
    assert cache.best([*range(24), 999]) is None
    found = cache.best([*range(25), 999])
    assert found is not None and found[1] == 25


def test_a_restored_entry_stays_cached() -> None:
    cache = PromptCache(10_000)
    a = state([1, 2, 3])
    cache.put(a)
    assert cache.best([1, 2, 3, 4]) is not None
    assert cache.best([1, 2, 3, 4]) is not None
    assert len(cache) == 1


def test_a_longer_state_replaces_the_prefixes_it_serves_and_a_served_one_is_not_kept() -> None:
    cache = PromptCache(10_000)
    short, long = state([1, 2, 3]), state([1, 2, 3, 4, 5])
    assert cache.put(short)
    assert cache.put(long)
    assert len(cache) == 1 and cache.nbytes == long.nbytes
    assert not cache.put(state([1, 2, 3, 4]))  # the long one serves it
    assert len(cache) == 1


def test_exact_states_of_different_lengths_are_both_kept() -> None:
    """A recurrent state at length 3 serves prompts the one at length 5 cannot (those diverging at 3 or 4)."""
    cache = PromptCache(10_000)
    assert cache.put(state([1, 2, 3], floor=3))
    assert cache.put(state([1, 2, 3, 4, 5], floor=5))
    assert len(cache) == 2
    found = cache.best([1, 2, 3, 9, 9])
    assert found is not None and found[1] == 3
    assert not cache.put(state([1, 2, 3], floor=3))  # the same one again


def test_a_draft_holding_less_is_served_by_a_draft_holding_more() -> None:
    cache = PromptCache(10_000)
    assert cache.put(state([1, 2, 3, 4], draft=2))
    assert not cache.put(state([1, 2, 3, 4], draft=1))
    assert cache.put(state([1, 2, 3, 4], draft=4))  # serves more: replaces it
    assert len(cache) == 1


class HeadPart:
    """A drafter's own part of a state (an MTP head's), as the cache sees one: its size."""

    nbytes = 40


def test_a_state_without_a_drafters_part_does_not_replace_one_that_keeps_it() -> None:
    """A longer state that lacks a drafter's part (the MTP head's) does not serve what one keeping it serves: a hit
    on it would read the prompt again for the head. One that keeps it too replaces it, and the part is counted."""
    cache = PromptCache(10_000)
    with_head = dataclasses.replace(state([1, 2, 3]), drafters=(HeadPart(),))
    assert cache.put(with_head) and cache.nbytes == 100 + 40
    assert cache.put(state([1, 2, 3, 4]))
    assert len(cache) == 2
    assert cache.put(dataclasses.replace(state([1, 2, 3, 4, 5]), drafters=(HeadPart(),)))
    assert len(cache) == 1


def test_budget_edge_evicts_least_recently_used_first() -> None:
    cache = PromptCache(300)
    a, b, c = state([1], 100), state([2], 100), state([3], 100)
    for s in (a, b, c):
        assert cache.put(s)
    assert cache.nbytes == 300  # exactly at the budget: nothing leaves
    assert cache.best([1, 0]) is not None  # a becomes the most recently used
    d = state([4], 100)
    assert cache.put(d)
    held = [cache.best([t, 0]) is not None for t in (1, 2, 3, 4)]
    assert held == [True, False, True, True]  # b was the least recently used
    assert cache.counters().evicted == 1 and cache.nbytes == 300


def test_a_state_larger_than_the_budget_is_not_kept_and_evicts_nothing() -> None:
    cache = PromptCache(300)
    a = state([1], 100)
    cache.put(a)
    assert not cache.put(state([2], 301))
    assert len(cache) == 1 and cache.counters().skipped == 1
    assert cache.put(state([3], 200))  # fits with a
    assert cache.put(state([4], 300))  # the whole budget: everything else leaves
    assert len(cache) == 1 and cache.nbytes == 300


def test_an_empty_state_is_not_kept() -> None:
    cache = PromptCache(300)
    assert not cache.put(SlotState((), (ModelState(0, bytearray(), 0),)))
    assert len(cache) == 0


def test_limit_from_the_preset() -> None:
    assert limit_bytes("auto", 8 << 30) == auto_limit(8 << 30) == 2 << 30
    assert limit_bytes("0", 8 << 30) == 0
    assert limit_bytes("512", 0) == 512 * MIB
    preset = load_preset()
    assert preset.server.cache_ram == "auto"
    for bad in ("-1", "lots", "1.5", ""):
        with pytest.raises(ConfigError, match="cache_ram"):
            preset.with_overrides(cache_ram=bad)
