"""Grammar masking checks a row's best tokens first and stops as soon as the sampling pipeline's output is known
(`constraints.masked_row`, `constraints.settled`): the distribution it yields must be the fully masked row's, bit for
bit, on hostile rows (peaked, flat, ties at the cut, legal tokens just past the checked ones, few or many legal
tokens) and settings (greedy, top-k, top-p, min-p). No model: a grammar here is a fixed set of legal ids."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from localspec.config import load_preset
from localspec.llama.grammar import matches_text_only
from localspec.rounds.constraints import FIRST_LOOK, WIDEN, best_ids, masked_row, masked_scores, settled
from localspec.rounds.sampling import candidates, candidates_from_top_k
from localspec.rounds.scores import Scores

DEFAULT = load_preset("default").sampling  # T 0.7, top_k 40, top_p 0.9, min_p 0


class FixedGrammar:
    """A grammar state whose legal tokens are a fixed set; it counts the ids it was asked about."""

    source = "fixed"

    def __init__(self, legal: np.ndarray, n_vocab: int) -> None:
        self.mask = np.zeros(n_vocab, dtype=bool)
        self.mask[legal] = True
        self.n_vocab = n_vocab
        self.asked = 0

    def legal(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids).ravel()
        self.asked += len(ids)
        return self.mask[ids]

    def legal_everywhere(self) -> np.ndarray:
        return self.legal(np.arange(len(self.mask)))


def distribution(logits: np.ndarray, sampling) -> dict[int, float]:
    if sampling.greedy:  # the loop's greedy choice: the row's argmax
        return {int(np.argmax(logits)): 1.0}
    row = candidates(logits[None, :], sampling).row(0)
    return {t: p for t, p in zip(row.ids, row.probs, strict=True) if p > 0}


def by_logit(dist: dict[int, float], row: np.ndarray) -> list[tuple[float, float]]:
    """A distribution up to the order of tokens whose logits tie: (logit, probability) pairs, sorted. The pipeline
    sorts ties by their column, and a row of candidates lists them in another order than a whole vocabulary, so
    which of several equal tokens top-p keeps, and the last bit of a sum, may differ; nothing else may."""
    return sorted((float(row[t]), round(q, 12)) for t, q in dist.items())


def hostile_row(rng: np.random.Generator, vocab: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(logits, legal ids) of one kind of row."""
    row = rng.normal(0.0, 3.0, size=vocab).astype(np.float32)
    order = np.argsort(-row, kind="stable")
    if kind == "peaked":  # a model that follows the format: one or two legal tokens far ahead
        legal = rng.choice(vocab, size=rng.integers(1, 4), replace=False)
        row[legal[0]] = row.max() + rng.uniform(4.0, 25.0)
    elif kind == "flat":
        row = rng.normal(0.0, 0.05, size=vocab).astype(np.float32)
        legal = rng.choice(vocab, size=rng.integers(1, 30), replace=False)
    elif kind == "just past the look":  # legal tokens ranked right after the first look
        legal = order[FIRST_LOOK - 2: FIRST_LOOK + rng.integers(2, 8)]
        row[legal[0]] += 0.0
    elif kind == "ties at the cut":  # a coarse row: many equal logits around every boundary
        row = np.round(rng.normal(0.0, 2.0, size=vocab)).astype(np.float32)
        legal = rng.choice(vocab, size=rng.integers(1, 60), replace=False)
        row[legal[0]] = row.max() + rng.integers(0, 6)
    elif kind == "many legal":
        legal = rng.choice(vocab, size=vocab // 2, replace=False)
    else:  # "few legal, mid-ranked"
        legal = order[rng.integers(10, 2000, size=rng.integers(1, 6))]
        row[legal[0]] = row.max() + rng.uniform(-1.0, 8.0)
    return row, np.unique(legal)


SETTINGS = [DEFAULT, dataclasses.replace(DEFAULT, temperature=0.0),
            dataclasses.replace(DEFAULT, top_k=5), dataclasses.replace(DEFAULT, top_p=0.999),
            dataclasses.replace(DEFAULT, top_p=0.5, min_p=0.05), dataclasses.replace(DEFAULT, top_p=1.0, min_p=0.1),
            dataclasses.replace(DEFAULT, top_p=1.0), dataclasses.replace(DEFAULT, top_k=0),
            dataclasses.replace(DEFAULT, top_k=1000, top_p=0.95, temperature=1.3)]
KINDS = ["peaked", "flat", "just past the look", "ties at the cut", "many legal", "few legal, mid-ranked"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_masked_row_samples_exactly_as_the_fully_masked_row(kind: str) -> None:
    rng = np.random.default_rng(KINDS.index(kind))
    vocab = 5000
    stopped_early = 0
    for trial in range(60):
        row, legal = hostile_row(rng, vocab, kind)
        sampling = SETTINGS[trial % len(SETTINGS)]
        grammar = FixedGrammar(legal, vocab)
        reference = np.where(grammar.mask, row, -np.inf).astype(np.float32)
        masked = masked_row(row, grammar, sampling)
        assert distribution(masked, sampling) == distribution(reference, sampling), (kind, trial, sampling)
        stopped_early += grammar.asked < vocab and len(legal) < max(1, sampling.top_k)
    if kind in ("peaked",):
        assert stopped_early > 20  # the early stop is what ran, not only the full check


def test_the_early_stop_is_what_saves_the_full_check_at_a_structural_position() -> None:
    """Two legal tokens in 150k (a JSON key's quote), the model sure of one: the row's best few hundred tokens
    asked, not 150k."""
    rng = np.random.default_rng(7)
    vocab = 150_000
    row = rng.normal(0.0, 3.0, size=vocab).astype(np.float32)
    legal = np.array([17, 90_001])
    row[17] = row.max() + 9.0
    grammar = FixedGrammar(legal, vocab)
    masked = masked_row(row, grammar, DEFAULT)
    first = max(FIRST_LOOK, 4 * DEFAULT.top_k)
    assert first <= grammar.asked <= WIDEN * first  # the first look (`best_ids`), nothing more
    assert distribution(masked, DEFAULT) == {17: 1.0}
    # Without top-p or min-p nothing cuts the row: every token must be checked (top_k 40 > the 2 legal ones).
    everything = FixedGrammar(legal, vocab)
    masked_row(row, everything, dataclasses.replace(DEFAULT, top_p=1.0))
    assert everything.asked >= vocab


def test_settled_refuses_a_cut_that_unchecked_tokens_could_move() -> None:
    row = np.array([5.0, 4.0, 4.0, 0.0], dtype=np.float32)
    sure = dataclasses.replace(DEFAULT, top_p=0.5)
    # legal: token 0 only; unchecked tokens at most 4.0: each could hold up to e^-1 of token 0's weight.
    assert not settled(np.array([0]), row, 4.0, 1000, DEFAULT)  # 0.9 * (1 + 39 e^-1) > 1: top-p may reach them
    assert settled(np.array([0]), row, -10.0, 1000, DEFAULT)
    assert settled(np.array([0]), row, 4.0, 0, sure)  # nothing unchecked
    assert not settled(np.array([0]), row, 5.0, 10, sure)  # an unchecked token may tie the kept one
    greedy = dataclasses.replace(DEFAULT, temperature=0.0)
    assert not settled(np.array([0]), row, -10.0, 1000, greedy)  # greedy stops at its first legal token anyway


@pytest.mark.parametrize("kind", KINDS)
def test_device_candidates_serve_a_row_when_the_cut_is_settled_and_never_otherwise(kind: str) -> None:
    """A row of the device's top 64: masked in place when its legal tokens settle the pipeline, else None (the
    row is decoded again in full); served rows sample exactly as the fully masked full row."""
    rng = np.random.default_rng(100 + KINDS.index(kind))
    vocab, served = 5000, 0
    for trial in range(60):
        row, legal = hostile_row(rng, vocab, kind)
        sampling = SETTINGS[trial % len(SETTINGS)]
        grammar = FixedGrammar(legal, vocab)
        top = np.argsort(-row, kind="stable")[:64]
        scores = Scores(row[top][None, :].copy(), top[None, :].astype(np.int64))
        got = masked_scores(scores, 0, grammar, sampling)  # type: ignore[arg-type]
        if got is None:
            continue
        served += 1
        reference = np.where(grammar.mask, row, -np.inf).astype(np.float32)
        assert got.ids is not None and got.logits is not None
        if sampling.greedy:
            assert int(got.ids[0][np.argmax(got.logits[0])]) == int(np.argmax(reference))
            continue
        p = candidates_from_top_k(got.ids, got.logits, sampling).row(0)
        assert {t: q for t, q in zip(p.ids, p.probs, strict=True) if q > 0} == distribution(reference, sampling)
    if kind == "peaked":
        assert served > 20


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_row_is_handed_to_the_pipeline_as_its_kept_tokens_only(kind: str) -> None:
    """A masked full row reaches the sampling pipeline as candidates (its kept ids, in id order), not as a row of
    a whole vocabulary of -inf, which numpy's argpartition sorts slowly; the greedy choice (ties: the lower id) and
    the distribution are the fully masked row's."""
    rng = np.random.default_rng(200 + KINDS.index(kind))
    vocab = 5000
    for trial in range(40):
        row, legal = hostile_row(rng, vocab, kind)
        sampling = SETTINGS[trial % len(SETTINGS)]
        grammar = FixedGrammar(legal, vocab)
        got = masked_scores(Scores(row[None, :].copy()), 0, grammar, sampling)  # type: ignore[arg-type]
        assert got is not None and got.ids is not None and got.logits is not None
        assert len(got.ids[0]) <= len(legal) and np.all(np.diff(got.ids[0]) > 0)
        assert grammar.mask[got.ids[0]].all()
        reference = np.where(grammar.mask, row, -np.inf).astype(np.float32)
        if sampling.greedy:
            assert int(got.argmax()[0]) == int(np.argmax(reference))
            continue
        p = candidates_from_top_k(got.ids, got.logits, sampling).row(0)
        mine = {t: q for t, q in zip(p.ids, p.probs, strict=True) if q > 0}
        assert by_logit(mine, row) == by_logit(distribution(reference, sampling), row)
        # No ties, and the same arithmetic (top_k = 0 sent the vocabulary-wide row through the pipeline's numpy
        # path; its kept tokens now take the Python one: the same sums in another order, up to the last bit):
        if kind != "ties at the cut" and sampling.top_k:
            assert mine == distribution(reference, sampling)  # the very same tokens and probabilities, bit for bit


@pytest.mark.parametrize("kind", ["normal", "constant", "ties at the cut", "few then flat", "ascending", "tiny"])
def test_best_ids_hold_the_rows_best(kind: str) -> None:
    """At least `look` ids, and no token outside them above any inside: what the mask's bound and its count of
    unchecked tokens rely on, on rows the strided sample misjudges."""
    rng = np.random.default_rng(2)
    vocab = 150_000
    row = {"normal": lambda: rng.normal(0.0, 3.0, vocab),
           "constant": lambda: np.zeros(vocab),
           "ties at the cut": lambda: np.round(rng.normal(0.0, 1.0, vocab), 1),
           "few then flat": lambda: np.where(np.arange(vocab) % 997 == 0, 5.0, 0.0),
           "ascending": lambda: np.arange(vocab, dtype=np.float64),
           "tiny": lambda: rng.normal(0.0, 1.0, 100)}[kind]().astype(np.float32)
    for look in (x for x in (1, 40, 160, 1280, len(row) - 1) if x < len(row)):  # (never the whole row)
        ids = best_ids(row, look)
        assert len(ids) >= look and len(np.unique(ids)) == len(ids)
        outside = np.ones(len(row), dtype=bool)
        outside[ids] = False
        assert not outside.any() or row[outside].max() <= row[ids].min(), (kind, look)


@pytest.mark.parametrize(("gbnf", "text_only"), [
    ('root ::= "<tool_call>" [<!>]+ "!" # a <comment>\nx ::= "\\"" [\\]<]', True),
    ('root ::= "a" <[1000]> "b"', False),
    ('root ::= "a" !<|im_end|>', False),
    ('root ::= "\\\\" <[5]>', False),  # an escaped backslash, then the string's closing quote
    ('root ::= [\\]] <[5]>', False),
])
def test_which_grammars_match_text_only(gbnf: str, text_only: bool) -> None:
    """Token references (by id, where the prefix forest does not hold) are told apart from `<` and `!` in
    strings, character classes and comments."""
    assert matches_text_only(gbnf) is text_only
