"""Where llama.cpp keeps each sequence's recurrent state (`recurrent.CellMap`), and the shared calls it allows.

A hybrid target with rollback snapshots decodes several slots' tokens in one ubatch only where that moves no
state that still needs its snapshots (docs/upstream.md). The map is a mirror of llama.cpp's cell bookkeeping: it is
checked here against the library's own layout after every step of scrambled rounds, rollbacks, rewinds past the
snapshots, state loads and clears, and every row those steps decode against each sequence decoded alone."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from localspec.llama.recurrent import CallPlan, CellMap


def test_cells_go_out_in_order_and_come_back_to_their_sequence() -> None:
    cells = CellMap(4)
    for seq in (2, 0, 3):  # each alone: the first empty cell from the head on
        assert cells.decoded([seq]) == set()
    assert cells.owner == [2, 0, 3, None]
    cells.removed(0)  # the head goes back to the freed cell, which the next sequence without one takes
    assert cells.decoded([1]) == set() and cells.owner == [2, 1, 3, None]
    assert cells.decoded([0]) == set() and cells.owner == [2, 1, 3, 0]


def test_a_ubatch_of_sequences_in_scattered_cells_moves_them_and_the_ones_in_the_way() -> None:
    """The canary's layout (tests/test_hybrid.py): sequences 2, 0, 3 in cells 0, 1, 2. A ubatch of 2 and 3 gathers
    them into cells 0 and 1, moving sequence 0 (outside the ubatch) to cell 2: not shared."""
    cells = CellMap(4)
    for seq in (2, 0, 3):
        cells.decoded([seq])
    assert cells.moved([2, 3]) == {0, 3}
    assert not CallPlan(cells).shares([2, 3])
    cells.decoded([1])  # the empty cell 3
    assert cells.moved([0, 1]) == {1, 3}  # 0 stays in cell 1; 1 goes from cell 3 to 2, moving 3 out of the way
    assert not CallPlan(cells).shares([0, 1])
    assert cells.owner == [2, 0, 3, 1]  # (`moved` only asked)
    assert CallPlan(cells).shares([2])


def test_sequences_of_the_ubatch_may_move_and_then_sit_in_order() -> None:
    cells = CellMap(3)
    for seq in (1, 0, 2):
        cells.decoded([seq])  # cells: 1, 0, 2
    assert cells.moved([0, 1]) == {0, 1}  # they swap: both in the ubatch
    assert CallPlan(cells).shares([0, 1]) and not CallPlan(cells).shares([1, 2])  # (1 and 2: 0 would move)
    assert cells.decoded([0, 1]) == {0, 1}
    assert cells.owner == [0, 1, 2] and cells.moved([0, 1, 2]) == set()


def test_a_plan_judges_each_call_on_the_cells_the_earlier_calls_leave() -> None:
    """whole_plan's calls in order: a run's longest first part that shares, then the rest on the cells it leaves."""
    from localspec.llama.ubatch import whole_plan

    cells = CellMap(4)
    cells.decoded([0])
    cells.decoded([2])  # cells: 0, 2, -, -
    plan = CallPlan(cells)
    assert not plan.shares([0, 1])  # 1 takes the empty cell 2; gathering it into cell 1 moves 2 out of the way
    # All three together move only themselves (1 into cell 1, 2 into cell 2); 3, with another count, goes alone.
    assert plan.shares([0, 1, 2])
    assert whole_plan([(0, 1), (1, 1), (2, 1), (3, 2)], 64, plan) == [[(0, 0, 1), (1, 0, 1), (2, 0, 1)], [(3, 0, 2)]]
    assert plan.cells.owner == [0, 1, 2, 3] and cells.owner == [0, 2, None, None]  # (the plan's own copy)
    plan = CallPlan(cells)
    cells_after = whole_plan([(2, 1), (3, 1)], 64, plan)  # 3 takes cell 2, 2 stays in cell 1: in order already
    assert cells_after == [[(0, 0, 1), (1, 0, 1)]] and plan.cells.owner == [0, 2, 3, None]
    plan = CallPlan(cells)
    plan.called([3])  # (an earlier call: 3 takes cell 2 alone)
    plan.cells.removed(0)
    assert not plan.shares([0, 1])  # 0 takes cell 0 again, 1 takes cell 3 and goes to 1, moving 2

    cells = CellMap(4)
    for seq in (0, 3, 1):
        cells.decoded([seq])  # cells: 0, 3, 1, -
    plan = CallPlan(cells)
    assert not plan.shares([0, 1, 2]) and not plan.shares([0, 1])  # (1 into cell 1 moves 3)
    # 0 alone; then 1 stays in cell 2 and 2 takes cell 3 beside it: no one else moves.
    assert whole_plan([(0, 1), (1, 1), (2, 1)], 64, plan) == [[(0, 0, 1)], [(1, 0, 1), (2, 0, 1)]]
    assert plan.cells.owner == [0, 3, 1, 2]


def test_sequences_in_scrambled_cells_share_a_call_all_together_and_then_sit_in_order() -> None:
    """Slots first filled out of order (a server's requests come as they come): grown one sequence at a time no
    group would share (0 and 1 alone move 2 out of the way), all four together move only themselves."""
    from localspec.llama.ubatch import whole_plan

    cells = CellMap(4)
    for seq in (2, 0, 3, 1):
        cells.decoded([seq])
    assert cells.owner == [2, 0, 3, 1]
    plan = CallPlan(cells)
    assert not plan.shares([0, 1]) and plan.shares([0, 1, 2, 3])
    assert whole_plan([(seq, 2) for seq in range(4)], 64, plan) == [[(i, 0, 2) for i in range(4)]]
    assert plan.cells.owner == [0, 1, 2, 3] and plan.cells.moved([0, 1, 2, 3]) == set()


def test_lost_cells_share_nothing_until_every_cell_is_cleared() -> None:
    cells = CellMap(2)
    cells.decoded([0])
    cells.decoded([1])
    assert CallPlan(cells).shares([0, 1])
    cells.lost = True
    assert not CallPlan(cells).shares([0, 1]) and CallPlan(cells).shares([1])
    cells.cleared()
    assert not cells.lost and cells.owner == [None, None]


# -- against llama.cpp --------------------------------------------------------------------------------------------


def _llama_layout(model) -> list[int]:
    """The sequences of llama.cpp's non-empty recurrent cells, in cell order: a whole-context state of the recurrent
    part (`llama_state_seq_get_data_ext` of sequence -1, PARTIAL_ONLY) starts with them, after its header."""
    import llama_cpp

    flags = int(llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    size = llama_cpp.llama_state_seq_get_size_ext(model.ctx, -1, flags)
    buf = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_seq_get_data_ext(model.ctx, buf, size, -1, flags) == size
    data = bytes(buf)
    assert int.from_bytes(data[4:8], "little", signed=True) == -1  # (after a magic number: the sequence asked for)
    count = int.from_bytes(data[8:12], "little")
    out, at = [], 12
    for _ in range(count):
        n_seq_id = int.from_bytes(data[at + 4 : at + 8], "little")
        assert n_seq_id == 1, "a cell shared by sequences"
        out.append(int.from_bytes(data[at + 8 : at + 12], "little", signed=True))
        at += 8 + 4 * n_seq_id
    return out


@pytest.mark.slow
def test_the_cell_map_takes_llama_cpps_turns(hybrid_pair) -> None:
    """Scripted turns of llama.cpp's cell search: the search starting over from cell 0 when the head is far past
    the cells in use, a saved state loaded into an emptied sequence, a rewind to a checkpoint."""
    from localspec.llama.model import LlamaModel

    with LlamaModel(hybrid_pair[0], n_seq=8, n_ctx=64, device_top_k=0, n_threads=1, rewind=3) as m:
        assert m._recurrent is not None
        cells = m._recurrent.cells

        def check() -> None:
            assert [o for o in cells.owner if o is not None] == _llama_layout(m)

        for seq in range(6):
            m.decode([5, 6], 0, seq=seq)
            check()
        for seq in range(5):
            m.clear(seq)
            check()
        m.decode([7], 2, seq=5)  # the head at cell 5, one cell in use
        m.decode([5, 6], 0, seq=1)  # far past it: the search starts at cell 0 again
        check()
        assert cells.owner.index(1) == 0
        state = m.save_state(5)
        m.clear(5)
        m.decode([5], 0, seq=7)
        check()
        assert m.load_state(state, 5)
        check()
        m.checkpoint(1)
        m.decode([8, 9, 10, 11], 2, seq=1)
        m.decode([12], 6, seq=1)
        assert m.truncate(3, 1) == 2  # past its last decode: back to the checkpoint (a state read into the context)
        check()
        assert not m.load_state(bytearray(b"not a state" * 40), 2)  # refused part way: the map no longer knows
        assert cells.lost
        m.clear()
        check()
        assert cells.owner == [None] * 8 and not cells.lost


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cell_map_follows_llama_cpp_and_shared_calls_are_each_sequence_alone(hybrid_pair, seed: int) -> None:
    """Scrambled steps on four sequences of the tiny hybrid (rollback snapshots kept): rounds of random sequences
    and widths (equal widths often, so calls are shared), rollbacks within the last decode, rewinds past it (to a
    checkpoint or to nothing), a sequence emptied, a saved state loaded back, every cell cleared. After each step
    the map's cells are llama.cpp's; every row decoded is bit for bit the row the same sequence gives in a context
    of its own."""
    from localspec.llama.model import LlamaModel

    target: Path = hybrid_pair[0]
    rng = np.random.default_rng(seed)
    n_seq, depth = 6, 6
    common = dict(n_ctx=256, device_top_k=0, n_threads=1, rewind=depth)
    shared_calls = 0
    with LlamaModel(target, n_seq=n_seq, **common) as many:
        alone = [LlamaModel(target, **common) for _ in range(n_seq)]
        try:
            tokens: list[list[int]] = [[] for _ in range(n_seq)]
            saved: dict[int, tuple[list[int], bytearray, bytearray]] = {}
            last_width = [0] * n_seq
            recurrent = many._recurrent
            assert recurrent is not None

            def new(n: int) -> list[int]:
                return rng.integers(3, 60, size=n).tolist()

            ops = ["round"] * 5 + ["rollback"] * 3 + ["far", "empty", "save", "load", "checkpoint"]
            # The first prompts in a scrambled order: llama.cpp hands cells out in the order sequences come.
            script = [("first", int(s)) for s in rng.permutation(n_seq)]
            script += [(str(rng.choice(ops)), int(rng.integers(n_seq))) for _ in range(120)]
            script[60] = ("clear", 0)
            for step, (op, seq) in enumerate(script):
                if op == "first":
                    toks = new(int(rng.integers(3, 9)))
                    assert np.array_equal(many.decode(toks, 0, all_logits=True, seq=seq).logits,
                                          alone[seq].decode(toks, 0, all_logits=True).logits)
                    tokens[seq], last_width[seq] = toks, len(toks)
                elif op == "round":
                    width = int(rng.choice([1, 1, 4, 4, 7]))  # (often equal: shared calls)
                    chosen = sorted(rng.choice(n_seq, size=int(rng.integers(1, n_seq + 1)), replace=False).tolist())
                    items = []
                    for s in chosen:
                        w = width if rng.random() < 0.8 else int(rng.integers(1, 8))
                        w = w if tokens[s] else max(w, 3)
                        items.append((s, new(w), len(tokens[s]), True))
                    before = many.decodes
                    rows = many.decode_many(items)
                    shared_calls += len(items) - (many.decodes - before)
                    for (s, toks, pos, _), got in zip(items, rows, strict=True):
                        want = alone[s].decode(toks, pos, all_logits=True)
                        assert np.array_equal(got.logits, want.logits), f"step {step}: sequence {s}'s rows"
                        tokens[s] += toks
                        last_width[s] = len(toks)
                elif op == "rollback" and last_width[seq] > 1 and len(tokens[seq]) > last_width[seq]:
                    keep = len(tokens[seq]) - int(rng.integers(1, min(last_width[seq], depth + 1)))
                    kept = many.truncate(keep, seq)
                    assert alone[seq].truncate(keep, 0) == kept
                    del tokens[seq][kept:]
                    last_width[seq] = 0
                elif op == "far" and len(tokens[seq]) > 2:
                    keep = int(rng.integers(1, len(tokens[seq])))
                    kept = many.truncate(keep, seq)
                    assert alone[seq].truncate(keep, 0) == kept
                    del tokens[seq][kept:]
                    last_width[seq] = 0
                elif op == "empty":
                    many.clear(seq)
                    alone[seq].clear()
                    tokens[seq], last_width[seq] = [], 0
                elif op == "checkpoint" and tokens[seq]:
                    many.checkpoint(seq)
                    alone[seq].checkpoint(0)
                elif op == "save" and tokens[seq]:
                    saved[seq] = (list(tokens[seq]), many.save_state(seq), alone[seq].save_state(0))
                elif op == "load" and seq in saved:
                    held, mine, its = saved[seq]
                    assert many.load_state(mine, seq) and alone[seq].load_state(its, 0)
                    tokens[seq], last_width[seq] = list(held), 0
                elif op == "clear":
                    many.clear()
                    for model in alone:
                        model.clear()
                    tokens, last_width = [[] for _ in range(n_seq)], [0] * n_seq
                assert not recurrent.cells.lost
                assert [o for o in recurrent.cells.owner if o is not None] == _llama_layout(many), f"step {step}: {op}"
        finally:
            for model in alone:
                model.close()
        assert recurrent.stranded == 0  # no state outside a call was moved
        assert many.sequences_decoded > many.sequence_calls  # (/health's sequences_per_call above 1)
    assert shared_calls > 5  # (the steps did share calls)
