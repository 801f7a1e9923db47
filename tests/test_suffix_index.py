"""The suffix drafter's index (localspec/drafters/_suffix_index.py) against a brute-force reference that scans every
position of every document with plain list comparisons: the deepest match, its occurrences' next-token counts and
the proposed continuation; the budget, eviction (no entry outlives its tokens) and a hostile 10 MB prompt, checked
by the work counted and entries held, not by wall time."""

from __future__ import annotations

import tracemalloc
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localspec.drafters._suffix_index import (
    ANCHOR,
    CANDIDATES,
    ContextStream,
    SuffixStore,
    TokenStream,
    best_continuation,
)

UNBOUNDED = 1 << 30


def reference(docs: Sequence[list[int]], context: list[int], k: int, depth: int, factor: float, min_prob: float,
              anchor: int = ANCHOR) -> tuple[int, dict[int, int], list[int]]:
    """(deepest match, its occurrences' next-token counts, the continuation) by scanning everything: each earlier
    document kept (one that starts with the whole previous one replaces it; one shorter than the anchor is not
    kept), then the context up to the token before its last."""
    kept: list[list[int]] = []
    for doc in docs:
        if len(doc) < anchor:
            continue
        if kept and doc[: len(kept[-1])] == kept[-1]:
            kept.pop()
        kept.append(list(doc))
    sources = [(doc, False) for doc in kept] + [(context, True)]
    last = len(context) - 1
    found = []
    for rank, (doc, is_context) in enumerate(sources):
        for end in range(last if is_context else len(doc)):
            n = 0
            while n < depth and n <= end and n <= last and doc[end - n] == context[last - n]:
                n += 1
            if n >= anchor:
                found.append((n, rank, end))
    if not found or k <= 0:
        return 0, {}, []
    deepest = max(n for n, _, _ in found)
    on_path = sorted((rank, end) for n, rank, end in found if n == deepest)
    path: list[int] = []
    first: dict[int, int] = {}
    probability = 1.0
    for step in range(min(k, max(1, int(factor * deepest)))):
        nexts: list[int | None] = []
        for rank, end in on_path:
            doc, is_context = sources[rank]
            pos = end + 1 + step
            nexts.append(doc[pos] if pos < len(doc) else path[pos - len(doc)] if is_context else None)
        votes = Counter(t for t in nexts if t is not None)
        if not votes:
            break
        if step == 0:
            first = dict(votes)
        best = max(votes, key=lambda t: (votes[t], max(i for i, x in enumerate(nexts) if x == t)))
        probability *= votes[best] / sum(votes.values())
        if probability < min_prob:
            break
        path.append(best)
        on_path = [c for c, t in zip(on_path, nexts, strict=True) if t == best]
    return deepest, first, path


def indexed(docs: Sequence[list[int]], context: list[int], cut: int, owner: str = "a",
            candidates: int = UNBOUNDED) -> tuple[SuffixStore, ContextStream]:
    """The index of `docs` (one owner) and of `context`, the context synced in two steps (first `cut` tokens)."""
    store = SuffixStore(UNBOUNDED, candidates=candidates)
    for doc in docs:
        store.add(owner, doc)
    stream = ContextStream(context[:cut], UNBOUNDED, candidates=candidates)
    stream.sync(context[:cut], index=True)
    stream.sync(context, index=True)
    return store, stream


def query(store: SuffixStore, stream: ContextStream, context: list[int], k: int, depth: int, factor: float,
          min_prob: float, owner: str = "a"):
    corpus = store.corpus(owner)
    streams = ([corpus.stream] if corpus is not None else []) + [stream]
    return best_continuation(streams, context, k, depth=depth, factor=factor, min_prob=min_prob,
                             follows_query=stream)


tokens = st.lists(st.integers(0, 3), min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(docs=st.lists(tokens, max_size=4), context=st.lists(st.integers(0, 3), min_size=1, max_size=60),
       cut=st.integers(1, 60), k=st.integers(0, 9), depth=st.integers(3, 12),
       factor=st.sampled_from([0.5, 1.0, 2.0, 4.0]), min_prob=st.sampled_from([0.0, 0.1, 0.5]))
def test_the_index_answers_as_a_scan_of_every_position(docs, context, cut, k, depth, factor, min_prob) -> None:
    store, stream = indexed(docs, context, min(cut, len(context)))
    got = query(store, stream, context, k, depth, factor, min_prob)
    want_depth, want_counts, want_tokens = reference(docs, context, k, depth, factor, min_prob)
    assert (got.depth if k > 0 else 0, got.counts, got.tokens) == (want_depth, want_counts, want_tokens)
    assert got.support >= sum(want_counts.values())  # (occurrences at a document's end have no next token)
    assert all(a >= b for a, b in zip(got.probability, got.probability[1:], strict=False))  # a path's estimate


def test_a_deep_match_speculates_long_and_a_shallow_one_short() -> None:
    """factor x depth: the same continuation after a 3-token match is cut to 3 tokens, after a 9-token one to k."""
    body = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    store, stream = indexed([body], [9, 9, 5, 6, 7], 5)
    assert query(store, stream, [9, 9, 5, 6, 7], 8, 16, 1.0, 0.1).tokens == [8, 9, 10]
    deep = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    store, stream = indexed([[*deep, *body]], deep, 9)
    assert query(store, stream, deep, 8, 16, 1.0, 0.1).tokens == body[:8]


def test_the_most_frequent_continuation_wins_and_a_split_vote_stops_the_path() -> None:
    docs = [[9, 1, 2, 3, 4, 5], [8, 1, 2, 3, 4, 5], [1, 2, 3, 7, 8], [1, 2, 3, 4, 6]]
    store, stream = indexed(docs, [0, 1, 2, 3], 4)
    got = query(store, stream, [0, 1, 2, 3], 4, 8, 2.0, 0.4)
    assert got.counts == {4: 3, 7: 1} and got.support == 4
    # 4 (3 of 4), then 5 (2 of 3): 0.75 x 0.67 = 0.5 >= 0.4; nothing follows 5 in any document
    assert got.tokens == [4, 5] and got.probability == pytest.approx([0.75, 0.5])
    assert query(store, stream, [0, 1, 2, 3], 4, 8, 2.0, 0.6).tokens == [4]  # 0.5 < 0.6: the second is cut


def test_the_budget_evicts_the_oldest_documents_and_their_entries() -> None:
    rng = np.random.default_rng(0)
    store = SuffixStore(100)
    docs = [rng.integers(0, 50, size=30).tolist() for _ in range(12)]
    for i, doc in enumerate(docs):
        store.add("a" if i % 3 else "b", doc)
        assert store.tokens <= 100
    kept = store.documents("a") + store.documents("b")
    assert sum(map(len, kept)) == store.tokens == 90 and sorted(map(tuple, kept)) == sorted(map(tuple, docs[-3:]))
    # No entry outlives its tokens: each owner's stream holds what one built from its kept documents holds.
    for owner in store.owners():
        fresh = SuffixStore(UNBOUNDED)
        for doc in store.documents(owner):
            fresh.add(owner, doc)
        assert store.corpus(owner).stream.entries() == fresh.corpus(owner).stream.entries()
        assert len(store.corpus(owner).stream) <= 100 + 3
    # Evicted text is never proposed again.
    stream = ContextStream(docs[0][:10], UNBOUNDED)
    stream.sync(docs[0][:10], index=True)
    corpus = store.corpus("a")
    assert best_continuation([corpus.stream], docs[0][:10], 4, depth=16, factor=4.0, min_prob=0.0).depth < 10


def test_a_document_that_extends_the_latest_replaces_it() -> None:
    """A conversation's turns: each request holds the last one's text and more; the store keeps the latest."""
    store = SuffixStore(1000)
    history: list[int] = []
    for turn in range(20):
        history += [turn % 7, 1, 2, 3, turn % 5]
        store.add("a", history)
    assert store.documents("a") == [history] and store.tokens == len(history)
    store.add("a", [9, 9, 9, 9])
    assert store.documents("a") == [history, [9, 9, 9, 9]]


def test_a_document_longer_than_the_budget_keeps_its_latest_tokens_and_a_zero_budget_keeps_none() -> None:
    store = SuffixStore(50)
    store.add("a", list(range(200)))
    assert store.documents("a") == [list(range(150, 200))]
    empty = SuffixStore(0)
    empty.add("a", list(range(200)))
    assert empty.owners() == [] and empty.tokens == 0


def test_the_store_stays_within_its_memory_bound() -> None:
    """At most ~200 bytes a budget token however much text goes through (random text, every anchor its own key:
    202 measured; repeated text shares keys)."""
    rng = np.random.default_rng(1)
    budget = 20_000
    docs = [rng.integers(0, 50_000, size=int(rng.integers(100, 3000))).tolist() for _ in range(150)]
    tracemalloc.start()
    try:
        store = SuffixStore(budget)
        for doc in docs:
            store.add("a", doc)
            assert store.tokens <= budget
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    keys, entries = store.corpus("a").stream.entries()
    assert entries <= store.tokens and keys <= entries
    assert held < 300 * budget, held


def test_the_context_window_slides_and_a_cut_removes_its_entries() -> None:
    rng = np.random.default_rng(2)
    context = rng.integers(0, 1000, size=50).tolist()
    stream = ContextStream(context, window=64)
    for _ in range(100):
        context += rng.integers(0, 1000, size=int(rng.integers(1, 8))).tolist()
        stream.sync(context, index=True)
        assert len(stream) <= 2 * 64 and stream.entries()[1] <= len(stream)
        assert stream.tokens.tolist() == context[stream.base :]
    cut = len(context) - 3  # a reply that ended inside its last round
    del context[cut:]
    stream.sync(context, index=True)
    fresh = ContextStream(context[stream.base :], window=UNBOUNDED)
    fresh.sync(context[stream.base :], index=True)
    assert stream.tokens.tolist() == context[stream.base :]
    assert stream.entries() == fresh.entries()


def test_a_hostile_10_mb_repetitive_prompt_costs_a_window_and_a_bounded_round() -> None:
    """A prompt of 10 Mi tokens repeating one short phrase: the context stream keeps its window, its entries stay
    within the per-anchor cap, and a round's work (entries touched, tokens compared) is what a short prompt's is."""
    phrase = [11, 12, 13, 14, 15, 16, 17]
    hostile = phrase * (10 * 2**20 // len(phrase))
    short = phrase * 200  # (enough occurrences to fill the per-anchor cap)
    work = []
    for prompt in (short, hostile):
        stream = ContextStream(prompt, window=4096)
        assert len(stream) <= 4096
        stream.sync(prompt, index=True)
        keys, entries = stream.entries()
        assert keys <= len(phrase) and entries <= len(phrase) * CANDIDATES
        before = stream.work
        for _ in range(20):  # rounds: a few tokens committed, a query
            prompt.extend([phrase[(len(prompt) + i) % len(phrase)] for i in range(3)])
            stream.sync(prompt, index=True)
            got = best_continuation([stream], prompt, 8, depth=64, factor=4.0, min_prob=0.1, follows_query=stream)
            assert got.depth == 64 and len(got.tokens) == 8
        work.append(stream.work - before)
    assert work[1] <= work[0] * 1.1 + 100, work
    assert work[1] < 20 * (CANDIDATES * (64 + 7 * 7 + 8) + 3), work  # (a bound that no prompt length moves)


def test_a_token_stream_forgets_exactly_what_it_drops() -> None:
    stream = TokenStream()
    stream.append([1, 2, 3, 1, 2, 3, 1, 2, 3, 4])
    stream.index_to(stream.end)
    stream.drop_front(4)
    assert stream.base == 4 and stream.tokens.tolist() == [2, 3, 1, 2, 3, 4]
    assert stream.occurrences([1, 2, 3]) == [8]  # position 5's [1, 2, 3] reached back before the base: dropped
    stream.truncate(8)
    assert stream.occurrences([1, 2, 3]) == [] and stream.entries() == (2, 2)  # [2, 3, 1] at 6, [3, 1, 2] at 7
