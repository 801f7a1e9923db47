"""The engine's long-session paths on the scripted fake (tests/helpers_fake.py, no llama.cpp): the prompt cache
(a slot given to another conversation saved and restored, what a recurrent or sliding-window state may serve,
eviction at the budget's edge), a slot's state restored and erased, and context shift (both models' cells
follow the shifted tokens; plain and speculative shift at the same token). The fake checks every decode starts
where its cells end, and never reads a cell a restored state lacks or cuts one below its floor. The same paths
on real llama.cpp: tests/test_sessions.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers_fake import FakeModel

from localspec.config import ContextSettings, load_preset
from localspec.errors import UsageError
from localspec.rounds.context_shift import plan, shifted
from localspec.rounds.engine import Engine
from localspec.rounds.events import STOP_CONTEXT_FULL, collect
from localspec.rounds.prompt_cache import PromptCache

GREEDY = load_preset("greedy")
SHIFT = ContextSettings(context_shift=True, n_keep=4, n_discard=0)


def drafting(n: int = 4, drafter: str = "model"):
    # (a fixed drafting pattern, token for token: standing aside follows the clock;
    # tests/test_stand_aside.py checks it)
    return dataclasses.replace(GREEDY.draft, n_draft=n, drafter=drafter, stand_aside=False)


def engine(cache: int | None = 1 << 20, n_ctx: int = 512, **fake: object) -> tuple[Engine, FakeModel, FakeModel]:
    target = FakeModel(seed=3, n_ctx=n_ctx, **fake)  # type: ignore[arg-type]
    draft = FakeModel(seed=3, noise=1.0, n_ctx=n_ctx, **fake)  # type: ignore[arg-type]
    return Engine(target, draft, prompt_cache=None if cache is None else PromptCache(cache)), target, draft


def prompt(seed: int, n: int = 40) -> list[int]:
    return np.random.default_rng(seed).integers(0, 8, size=n).tolist()


def turn(e: Engine, p: list[int], k: int = 4, n: int = 12):
    return collect(e.generate(p, GREEDY.sampling, drafting(k), n))


def test_two_conversations_on_one_slot_are_restored_not_read_again() -> None:
    """Two conversations take turns on one slot: with the cache each turn reads only its new tokens; the replies
    are the ones an engine without a cache gives (and plain decoding from the fake's table)."""
    cached, target, draft = engine()
    plain, _, _ = engine(cache=None)
    history = {0: prompt(1), 1: prompt(2)}
    for round_no in range(3):
        for who in (0, 1):
            p = history[who]
            got, ref = turn(cached, p), turn(plain, p)
            assert got.tokens == ref.tokens == target.greedy(p, 12)
            if round_no > 0:  # this conversation's last turn is in the cache: only the 6 new tokens are read
                assert got.stats.prompt_tokens_processed == 6
                assert ref.stats.prompt_tokens_processed == len(p) - 1  # the slot held the other conversation
            history[who] = p + got.tokens + prompt(10 * round_no + who, 6)
    c = cached.prompt_cache.counters()  # type: ignore[union-attr]
    assert (c.hits, c.misses, c.entries) == (4, 2, 2) and target.loads == draft.loads == 4


def test_the_slot_a_conversation_continues_in_is_not_saved_or_counted() -> None:
    e, target, _ = engine()
    p = prompt(1)
    first = turn(e, p)
    turn(e, p + first.tokens + [1, 2, 3])
    c = e.prompt_cache.counters()  # type: ignore[union-attr]
    assert (c.hits, c.misses, c.entries) == (0, 1, 0)  # the first turn found an empty cache; the second its slot


def test_a_prompt_diverging_at_token_zero_gets_nothing() -> None:
    e, _, _ = engine()
    a = prompt(1)
    turn(e, a)
    b = [(a[0] + 1) % 8, *a[1:]]
    out = turn(e, b)
    assert out.stats.prompt_tokens_processed == len(b) - 1
    assert e.prompt_cache.counters().hits == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", [{"recurrent": True}, {"rewind_depth": 4}, {"window": 8}])
def test_a_recurrent_or_windowed_state_serves_only_its_whole_length(kind: dict) -> None:
    """A state that is not valid at its prefixes is restored only for a prompt that holds all of it (the fake
    fails a decode that reads a cell the restored state lacks, and a cut below its floor). With `rewind_depth`
    (a hybrid's snapshots) the draft's cells hold drafted tokens when the slot is saved: they rewind only as far
    as `truncate` says, and the state saved is that many tokens long."""
    e, target, _ = engine(**kind)
    a, b = prompt(1), prompt(2)
    first = turn(e, a)
    turn(e, b)  # a goes to the cache
    branch = a[:30] + [(a[30] + 1) % 8] + a[31:]  # diverges inside what the entry holds
    out = turn(e, branch)
    assert out.tokens == target.greedy(branch, 12)
    assert out.stats.prompt_tokens_processed == len(branch) - 1 and target.loads == 0
    turn(e, b)
    grown = a + first.tokens + [1, 2]
    out = turn(e, grown)  # holds all of a's state: restored
    assert out.tokens == target.greedy(grown, 12) and target.loads == 1
    assert out.stats.prompt_tokens_processed < 6


def test_a_snapshot_holds_what_a_recurrent_model_kept_when_cut_back() -> None:
    """A hybrid draft whose cells went further than its snapshots reach (here: 6 tokens past the committed ones in
    one decode, depth 4) keeps less than the committed prefix when the slot is saved (a checkpoint, or nothing):
    the state records that length, and a slot restored from it decodes the rest and gives plain decoding's reply."""
    e, target, draft = engine(cache=None, rewind_depth=4)
    p = prompt(1)
    first = turn(e, p)
    kv = e.cells.cells(0)[1][1]
    committed = len(kv)
    extra = [1, 2, 3, 4, 5, 6]
    draft.decode(extra, len(kv), seq=0)
    e.drafters["model"].set_cells(0, draft, [*kv, *extra])  # (the drafter's bookkeeping: `cells` hands out copies)
    state = e.snapshot(0)
    assert state.models[1].n_tokens == len(draft.cells[0]) < committed  # what truncate kept, not what was asked
    fresh, target2, _ = engine(cache=None, rewind_depth=4)
    assert fresh.restore(0, state)
    grown = p + first.tokens + [1, 2]
    assert turn(fresh, grown).tokens == target2.greedy(grown, 12)


def test_a_windowed_state_cut_back_after_a_restore_starts_afresh() -> None:
    """After a restore, the slot's own cells lack what lies before the window: a later prompt that shares less
    than the floor with them reads everything again instead of cutting them back."""
    e, target, _ = engine(window=8)
    a, b = prompt(1), prompt(2)
    first = turn(e, a)
    turn(e, b)
    turn(e, a + first.tokens + [1])  # restored
    assert target.loads == 1
    short = a[:20] + [5]  # shares 20 tokens with the slot: below its floor
    out = turn(e, short)
    assert out.tokens == target.greedy(short, 12) and out.stats.prompt_tokens_processed == len(short) - 1


def test_eviction_at_the_budget_edge_keeps_the_most_recent() -> None:
    """A budget of about two conversations: the third evicts the least recently used, which is then read in full
    (and answered the same)."""
    probe, _, _ = engine()
    turn(probe, prompt(1))
    turn(probe, prompt(2))
    size = probe.prompt_cache.nbytes  # type: ignore[union-attr]
    e, target, _ = engine(cache=2 * size + size // 2)
    convs = [prompt(s) for s in (1, 2, 3)]
    for c in convs:
        turn(e, c)
    turn(e, convs[0])  # saves conversation 3; conversation 1 had been evicted
    c = e.prompt_cache.counters()  # type: ignore[union-attr]
    assert c.evicted >= 1 and c.hits == 0
    out = turn(e, convs[2])  # 3 is cached
    assert out.stats.prompt_tokens_processed < len(convs[2]) - 1 and out.tokens == target.greedy(convs[2], 12)


def test_snapshot_restore_and_erase() -> None:
    e, target, draft = engine(cache=None)
    p = prompt(1)
    out = turn(e, p)
    state = e.snapshot(0)
    assert state.tokens == tuple((p + out.tokens)[: len(state.tokens)])
    assert [m.n_tokens for m in state.models][0] == len(p) + len(out.tokens) - 1
    assert e.erase(0) == len(p) + len(out.tokens) - 1
    assert not target.cells.get(0) and not draft.cells.get(0)
    assert e.restore(0, state)
    assert target.cells[0] == list(state.tokens[: state.models[0].n_tokens])
    more = p + out.tokens + [3, 4]
    again = turn(e, more)
    assert again.stats.prompt_tokens_processed == 2 and again.tokens == target.greedy(more, 12)


# -- context shift ------------------------------------------------------------------------------------------


def shift_reference(p: list[int], tokens: list[int], n_ctx: int, ctx: ContextSettings) -> tuple[list[int], int]:
    """Where the shifts fall and what the sequence is at the end, computed from llama-server's rule alone: the
    sequence grows one token at a time and shifts when it reaches n_ctx tokens."""
    seq, shifts = list(p), 0
    for t in tokens:
        if len(seq) >= n_ctx:
            seq = shifted(seq, plan(len(seq) - 1, n_ctx, len(p), ctx.n_keep, ctx.n_discard, False))
            shifts += 1
        seq.append(t)
    return seq, shifts


@pytest.mark.parametrize("k", [0, 3, 6])
@pytest.mark.parametrize("drafter", ["model", "lookup", "chain"])
def test_context_shift_keeps_generating_and_both_models_follow(k: int, drafter: str) -> None:
    n_ctx = 64
    e, target, draft = engine(cache=None, n_ctx=n_ctx)
    p = prompt(1, 30)
    out = collect(e.generate(p, GREEDY.sampling, drafting(k, drafter), 200, context=SHIFT))
    assert len(out.tokens) == 200 and out.done.stop_reason != STOP_CONTEXT_FULL
    assert out.tokens == target.greedy(p, 200)  # the fake's logits read the last two tokens: a shift keeps them
    seq, shifts = shift_reference(p, out.tokens, n_ctx, SHIFT)
    assert out.stats.context_shifts == shifts >= 3
    assert target.cells[0] == seq[:-1]  # the target's cells are the shifted sequence, position for position
    if drafter != "lookup" and k:
        assert draft.cells[0] == seq[: len(draft.cells[0])]  # and the draft's a prefix of it


def test_without_context_shift_the_generation_stops_at_a_full_context() -> None:
    e, _, _ = engine(cache=None, n_ctx=64)
    out = collect(e.generate(prompt(1, 30), GREEDY.sampling, drafting(4), 200))
    assert out.done.stop_reason == STOP_CONTEXT_FULL and out.stats.context_shifts == 0


def test_context_shift_is_refused_on_a_recurrent_model() -> None:
    e, _, _ = engine(cache=None, recurrent=True)
    with pytest.raises(UsageError, match="context shift: the target has a recurrent state"):
        e.start(prompt(1), GREEDY.sampling, drafting(4), 10, context=SHIFT)
