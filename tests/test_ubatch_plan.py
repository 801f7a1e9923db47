"""How LlamaModel cuts a multi-sequence decode into llama.cpp ubatches (`decode_plan`, `ubatch_split`): pure
logic here; tests/test_ubatch_rows.py checks it against llama.cpp's own split and every row against a reference."""

from __future__ import annotations

from localspec.llama.ubatch import decode_plan, ubatch_split


def test_consecutive_ascending_sequences_of_equal_length_make_one_ubatch():
    assert ubatch_split([(0, 3), (1, 3), (2, 3)], 64) == [[(0, 0, 3), (1, 0, 3), (2, 0, 3)]]


def test_descending_order_or_a_gap_splits():
    assert ubatch_split([(1, 2), (0, 2)], 64) == [[(0, 0, 2)], [(1, 0, 2)]]
    assert ubatch_split([(0, 1), (2, 1), (1, 1)], 64) == [[(0, 0, 1), (2, 0, 1)], [(1, 0, 1)]]
    assert ubatch_split([(0, 1), (2, 1)], 64) == [[(0, 0, 1)], [(1, 0, 1)]]


def test_unequal_lengths_take_the_shortest_then_the_rest():
    # widths 7, 7, 4, 7 of sequences 0..3: four tokens of all, then three of 0 and 1, then three of 3
    assert ubatch_split([(0, 7), (1, 7), (2, 4), (3, 7)], 64) == [
        [(0, 0, 4), (1, 0, 4), (2, 0, 4), (3, 0, 4)], [(0, 4, 3), (1, 4, 3)], [(3, 4, 3)]]


def test_n_ubatch_caps_the_tokens_per_sequence():
    assert ubatch_split([(0, 5), (1, 5)], 4) == [[(0, 0, 2), (1, 0, 2)], [(0, 2, 2), (1, 2, 2)],
                                                 [(0, 4, 1), (1, 4, 1)]]
    assert ubatch_split([(0, 9)], 4) == [[(0, 0, 4)], [(0, 4, 4)], [(0, 8, 1)]]


def test_the_plan_sorts_by_sequence_and_maps_back_to_items():
    # items in stream order 3, 1, 0, 2: one ubatch in ascending order, chunks naming the original items
    assert decode_plan([(3, 2), (1, 2), (0, 2), (2, 2)], 64, True) == [[(2, 0, 2), (1, 0, 2), (3, 0, 2), (0, 0, 2)]]
    # an empty item takes no part; a gap left by a finished slot costs one more ubatch
    assert decode_plan([(5, 1), (0, 0), (4, 1), (7, 1)], 64, True) == [[(2, 0, 1), (0, 0, 1)], [(3, 0, 1)]]
    assert decode_plan([], 64, True) == []


def test_one_sequence_context_goes_in_order_n_batch_at_a_time():
    assert decode_plan([(0, 5)], 2, False) == [[(0, 0, 2)], [(0, 2, 2)], [(0, 4, 1)]]
    assert decode_plan([(0, 0)], 2, False) == []


def test_every_token_is_planned_once_and_no_call_exceeds_n_batch():
    import itertools

    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        seqs = rng.permutation(12)[:n].tolist()
        counts = rng.integers(0, 10, size=n).tolist()
        n_batch = int(rng.integers(n, 40))
        plan = decode_plan(list(zip(seqs, counts, strict=True)), n_batch, True)
        seen = {i: [] for i in range(n)}
        for call in plan:
            assert sum(take for _, _, take in call) <= n_batch
            ids = [seqs[i] for i, _, _ in call]
            assert ids == list(range(ids[0], ids[0] + len(ids)))  # consecutive ascending ids: one ubatch
            assert len({take for _, _, take in call}) == 1  # equal tokens per sequence
            for i, first, take in call:
                seen[i].append((first, take))
        for i, count in enumerate(counts):
            covered = list(itertools.chain.from_iterable(range(f, f + t) for f, t in seen[i]))
            assert covered == list(range(count))
