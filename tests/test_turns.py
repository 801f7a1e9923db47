"""Slots that take turns (a target whose multi-sequence batches are not exact) with a draft model that may work
beside the verify: each round verifies one stream at a time and drafts the next stream's proposal beside each
verify (`Schedule._take_turns`). The reference is each request alone in a one-slot engine that drafts on the path:
the tokens must be the same at T = 0, whatever arrives, stops or sits out when; at T > 0 each stream's tokens
follow the target's own distribution (a seed's text may differ from alone: with other streams the load policy may
shorten drafts, and a lone stream's draft-ahead draws on its own)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Sequence

import pytest
from helpers_fake import FakeModel
from helpers_rounds import run_together
from helpers_stats import chi_square, joint_probs

from localspec.config import load_preset
from localspec.rounds.engine import Engine
from localspec.rounds.events import collect

GREEDY = load_preset("greedy")
HOT = dataclasses.replace(GREEDY.sampling, temperature=0.8, top_k=0, top_p=1.0)
BESIDE = "localspec-draft-beside"


def drafting(n: int = 6, drafter: str = "model", **more: object):
    # (a fixed drafting pattern, token for token: standing aside follows the clock;
    # tests/test_stand_aside.py checks it)
    return dataclasses.replace(GREEDY.draft, n_draft=n, drafter=drafter, **{"stand_aside": False, **more})


class Recording(FakeModel):
    """A fake that notes each decode's thread and interval, and may take `seconds` over it."""

    def __init__(self, seconds: float = 0.0, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.seconds = seconds
        self.log: list[tuple[str, float, float, int]] = []  # (thread, start, end, how many sequences)

    def decode_many(self, items):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        if self.seconds:
            time.sleep(self.seconds)
        out = super().decode_many(items)
        self.log.append((threading.current_thread().name, t0, time.perf_counter(), len(items)))
        return out


def turn_taking_pair(n_seq: int, target_s: float = 0.0, draft_s: float = 0.0) -> tuple[Recording, Recording]:
    target = Recording(target_s, vocab=12, seed=3, n_seq=n_seq)
    target.batches_sequences = False  # as the load probe decides for a model whose shared batches differ
    return target, Recording(draft_s, vocab=12, seed=3, noise=0.4, n_seq=n_seq)


def requests(sampling) -> list[dict]:  # type: ignore[no-untyped-def]
    """Different prompts, lengths and drafters: the draft model (k 6 and 3), no drafting, the chain, lookup."""
    return [
        dict(prompt=[0, 3, 6, 9, 1], sampling=dataclasses.replace(sampling, seed=11), drafting=drafting(6),
             max_tokens=40),
        dict(prompt=[2, 5, 8], sampling=dataclasses.replace(sampling, seed=12), drafting=drafting(3), max_tokens=27),
        dict(prompt=[7, 7, 1], sampling=dataclasses.replace(sampling, seed=13), drafting=drafting(0),
             max_tokens=15),
        dict(prompt=[4, 1, 4, 1, 4, 1, 4], sampling=dataclasses.replace(sampling, seed=14),
             drafting=drafting(4, "chain", lookup_min=2), max_tokens=33),
        dict(prompt=[9, 2, 9, 2, 9], sampling=dataclasses.replace(sampling, seed=15),
             drafting=drafting(5, "lookup", lookup_min=2), max_tokens=21),
    ]


def alone(reqs: Sequence[dict]) -> list[list[int]]:
    """Each request in a one-slot engine of its own that drafts on the path (no work beside the verify)."""
    out = []
    for r in reqs:
        target, draft = turn_taking_pair(1)
        engine = Engine(target, draft, draft_ahead=False)
        out.append(collect(engine.generate(**r)).tokens)
        engine.close()
    return out


@pytest.mark.parametrize("draft_batches", [True, False], ids=["draft-shares-batches", "draft-takes-turns"])
def test_greedy_streams_taking_turns_with_drafts_beside_get_their_output_alone(draft_batches: bool) -> None:
    reqs = requests(GREEDY.sampling)
    expected = alone(reqs)
    target, draft = turn_taking_pair(5)
    draft.batches_sequences = draft_batches
    engine = Engine(target, draft, draft_ahead=True)
    assert not engine.batches_slots
    assert run_together(engine, reqs, arrivals=[0, 0, 2, 2, 5], slots=[0, 1, 2, 3, 4]) == expected
    beside = [entry for entry in draft.log if entry[0].startswith(BESIDE)]
    assert beside, "no proposal was drafted beside a verify"
    assert all(n == 1 for *_, n in target.log), "the target shared a batch between sequences"
    # Again in other slots and another order (slots that hold the last requests' cells), one asked to stop early.
    order = [3, 0, 4, 1, 2]
    again = run_together(engine, [reqs[i] for i in order], arrivals=[0, 1, 1, 3, 3], slots=[4, 2, 0, 3, 1],
                     stop_after={1: 10})
    engine.close()
    for got, i in zip(again, order, strict=True):
        assert got == (expected[i][:10] if i == 0 else expected[i])


def test_at_t_above_0_streams_taking_turns_keep_the_targets_distribution() -> None:
    """Two streams of the same request, first in each round (drafted on the path) and last (drafted beside the
    verify before it), with a third at other settings between them: over many seeds each one's first three tokens
    fit the target's own p(t1) p(t2|t1) p(t3|t1,t2) (vocabulary 4: 64 outcomes)."""
    target = Recording(vocab=4, seed=5, n_seq=3)
    target.batches_sequences = False
    draft = Recording(vocab=4, seed=5, noise=1.0, n_seq=3)
    engine = Engine(target, draft, draft_ahead=True)
    prompt = [0, 1, 2, 3, 1]
    first: Counter[tuple[int, ...]] = Counter()
    last: Counter[tuple[int, ...]] = Counter()
    for seed in range(2500):
        measured = [dict(prompt=prompt, sampling=dataclasses.replace(HOT, seed=2 * seed + i), drafting=drafting(2),
                         max_tokens=3) for i in range(2)]
        other = dict(prompt=[3, 0, 1, 1], sampling=dataclasses.replace(HOT, temperature=1.2, seed=seed),
                     drafting=drafting(3), max_tokens=3)
        tokens = run_together(engine, [measured[0], other, measured[1]], arrivals=[0, 0, 0], slots=[0, 1, 2])
        first[tuple(tokens[0])] += 1
        last[tuple(tokens[2])] += 1
    engine.close()
    assert any(name.startswith(BESIDE) for name, *_ in draft.log)
    joint = joint_probs(lambda context: target.next_probs(context, HOT), prompt, 3)
    for counts in (first, last):
        assert chi_square(counts, joint) < 103.4  # 63 degrees of freedom, the 99.9th percentile


@pytest.mark.parametrize("draft_batches", [True, False], ids=["draft-shares-batches", "draft-takes-turns"])
def test_the_other_streams_drafting_runs_while_the_target_verifies(draft_batches: bool) -> None:
    """Three streams, a 25 ms verify, draft steps of 1 ms: the second and third streams' drafts are made on the
    worker thread inside a verify, together beside the first one where the draft model shares batches, else each
    beside the verify before its own; the round's drafting on the path is the first stream's."""
    target, draft = turn_taking_pair(3, target_s=0.025, draft_s=0.001)
    draft.batches_sequences = draft_batches
    engine = Engine(target, draft, draft_ahead=True)
    streams = [engine.start([1 + i, 2, 3], GREEDY.sampling, drafting(4), 24, slot=i) for i in range(3)]
    while not all(s.finished for s in streams):
        engine.step([s for s in streams if not s.finished])
        for s in streams:
            list(s.events())
    engine.close()
    verifies = [(t0, t1) for name, t0, t1, _ in target.log if not name.startswith(BESIDE)]
    beside = [(t0, t1, n) for name, t0, t1, n in draft.log if name.startswith(BESIDE)]
    on_path = [n for name, _, _, n in draft.log if not name.startswith(BESIDE)]
    assert beside and on_path
    assert set(on_path) == {1}  # the first stream's drafting alone (its prompt went in at start)
    assert {n for *_, n in beside} == ({2} if draft_batches else {1})
    inside = sum(any(v0 <= t1 <= v1 for v0, v1 in verifies) for _, t1, _ in beside)
    assert inside >= 0.9 * len(beside), (inside, len(beside))
    # Each stream's stats count the round's drafting on the path: the first stream's steps, not all three's.
    drafting_s = sum(t1 - t0 for _, t0, t1, _ in draft.log)
    assert streams[0].stats.draft_s < 0.6 * drafting_s


def test_a_drafter_error_beside_the_verify_surfaces_and_the_draft_model_is_idle() -> None:
    """A draft decode that fails on the worker thread raises from the round (after the verify it ran beside),
    never later, and leaves no decode running."""
    target, draft = turn_taking_pair(2)
    engine = Engine(target, draft, draft_ahead=True)
    streams = [engine.start([1 + i, 2, 3], GREEDY.sampling, drafting(3), 20, slot=i) for i in range(2)]
    engine.step(streams)
    for s in streams:
        list(s.events())

    def broken(items):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith(BESIDE):
            raise RuntimeError("draft decode failed")
        return FakeModel.decode_many(draft, items)

    draft.decode_many = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="draft decode failed"):
        engine.step(streams)
    assert engine._beside is not None and engine._beside._work_queue.empty()
    engine.close()


def test_streams_taking_turns_draft_their_full_length_with_no_load_probing(monkeypatch) -> None:
    """The load policy shortens drafts where a shared verify grows compute-bound; taking turns, each stream's verify
    is its own, so every round of every stream drafts the length its own policy chose (here k = 4 throughout, no
    probing epochs of k = 0 or k = 2), and the policy is not consulted. (The streams may stand aside, which puts
    them under the load policy; the draft model's own rule for that is set aside: it follows the clock.)"""
    from localspec.drafters.base import DrafterBase

    monkeypatch.setattr(DrafterBase, "stand_aside", lambda self, req, k, rule, lag=1: k)
    target, draft = turn_taking_pair(3)
    engine = Engine(target, draft, draft_ahead=True)
    lengths: list[int] = []
    streams = [engine.start([1 + i, 2, 3], GREEDY.sampling, drafting(4, stand_aside=True), 200, slot=i)
               for i in range(3)]
    while not all(s.finished for s in streams):
        live = [s for s in streams if not s.finished]
        engine.step(live)
        for s in live:
            list(s.events())
            if not s.finished or s.stats.tokens < 200:
                lengths.append(s.stats.draft_lengths[-1])
    engine.close()
    assert len(lengths) > 3 * (len(engine.load.SHARES) * engine.load.EPOCH)  # past every probing epoch
    assert set(lengths) == {4} and {share for _, share in engine.load.rate} == {1.0}
