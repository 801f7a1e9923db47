"""A recurrent state's rewind (hybrid and recurrent models: Qwen3.5/3.6's Gated DeltaNet): llama.cpp's snapshots
(`n_rs_seq`), the bookkeeping around its silent rollback past the last decode (docs/upstream.md), and checkpoints
of the recurrent part for rewinds further back.

Everything used here is declared by llama-cpp-python 0.3.36; an older build lacks some of it, and then speculation on
such a model is refused with one line naming what it lacks (`rollback_unsupported`), never approximated (no stand-in
enum values either). tests/test_hybrid.py checks the
struct field against the library itself (a context's n_rs_seq reads back).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence

import llama_cpp

from localspec.errors import DecodeError
from localspec.llama.batch import Run

# What a rewind through snapshots and checkpoints needs of llama-cpp-python: no stand-in values for a build that
# lacks them (a guessed enum value would go wrong silently the day llama.h renumbers it): such a build is refused.
_NEEDED = ("llama_n_rs_seq", "llama_state_seq_get_data_ext", "llama_state_seq_set_data_ext",
           "llama_state_seq_get_size_ext", "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY", "LLAMA_STATE_SEQ_FLAGS_ON_DEVICE")


def _checkpoint_flags() -> int | None:
    """A recurrent checkpoint: only the recurrent part of a hybrid's memory, kept in device memory (llama.h's flags,
    as this build declares them); None where it declares no such checkpoints."""
    if rollback_unsupported() is not None:
        return None
    return int(llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY | llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE)


def has_field(struct: type, name: str) -> bool:
    """Whether llama-cpp-python's declaration of a C struct has this field."""
    return any(field[0] == name for field in getattr(struct, "_fields_", ()))


def rollback_unsupported() -> str | None:
    """Why this llama-cpp-python cannot roll a recurrent state back (speculation on hybrid models), None if it can."""
    missing = ([] if has_field(llama_cpp.llama_context_params, "n_rs_seq") else ["llama_context_params.n_rs_seq"])
    missing += [name for name in _NEEDED if not hasattr(llama_cpp, name)]
    if not missing:
        return None
    return (f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} cannot roll back a recurrent state "
            f"(it lacks {', '.join(missing)}), which speculative decoding on this model needs: install "
            "llama-cpp-python 0.3.36 or newer, or decode plainly (--n-draft 0)")


class CellMap:
    """Which of llama.cpp's recurrent cells holds each sequence's state: a mirror of `llama_memory_recurrent`'s
    cell bookkeeping (`find_slot`, `seq_rm`, `state_read`, `clear` in src/llama-memory-recurrent.cpp of
    llama-cpp-python 0.3.36's llama.cpp) for the calls localspec makes, so that sequences may share a ubatch again.

    Why: a ubatch of several sequences needs their states in neighbouring cells, in sequence order; llama.cpp swaps
    cells to get there, and a swapped cell's rollback snapshots stay behind (docs/upstream.md). One sequence a call
    never moves a cell, but costs a decode a slot (on a large target on a GPU, several times a shared batch). With
    the cells known, a group of sequences shares a call where `moved` says no state that still needs its snapshots
    moves: the mirror is checked against llama.cpp's own layout (a whole-context state lists its cells in order) by
    tests/test_hybrid.py, which fails the day llama.cpp allocates cells otherwise. Anything it cannot follow (a
    failed decode or state load) makes it `lost` until every cell is cleared: sequences go one a call meanwhile.

    Each sequence holds at most one cell (localspec never copies a sequence into another: `seq_cp`), and the
    context has as many cells as sequences (llama.cpp's recurrent size is n_seq_max)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.owner: list[int | None] = [None] * size  # per cell: the sequence whose state it holds
        self.tail: list[int] = [-1] * size  # per sequence: its cell (-1: none)
        self.head = 0  # where llama.cpp's search for an empty cell starts
        self.lost = False  # a call it cannot follow happened: it no longer says where the states are

    def copy(self) -> CellMap:
        other = CellMap.__new__(CellMap)
        other.size, other.owner, other.tail, other.head, other.lost = (self.size, list(self.owner), list(self.tail),
                                                                       self.head, self.lost)
        return other

    def moved(self, seqs: Sequence[int]) -> set[int]:
        """The sequences (holding a state) whose cells a ubatch of `seqs` (ascending) would move."""
        first = self.tail[seqs[0]]
        if first >= 0 and all(self.tail[seq] == first + i for i, seq in enumerate(seqs)):
            return set()  # (in neighbouring cells in order already: the round's usual case, without a copy)
        return self.copy()._find_slot(seqs)

    def decoded(self, seqs: Iterable[int]) -> set[int]:
        """One ubatch of these sequences (ascending) was decoded; returns the sequences whose cells it moved."""
        return self._find_slot(list(seqs))

    def removed(self, seq: int) -> None:
        """`seq_rm` of all of a sequence's positions (a rollback within its snapshots keeps its cell)."""
        cell = self.tail[seq]
        if cell < 0:
            return
        self.owner[cell], self.tail[seq] = None, -1
        self.head = min(self.head, cell)  # ("if we freed up a slot, set head to it")

    def loaded(self, seq: int, holds: bool) -> None:
        """A saved state of the sequence was read into the context (`state_read`: its cells removed, then a slot
        found for the one it saved, if any)."""
        self.removed(seq)
        if holds:
            self._find_slot([seq])

    def cleared(self) -> None:
        """Every cell emptied (`llama_memory_clear`): the layout is known again."""
        self.__init__(self.size)  # type: ignore[misc]

    def _find_slot(self, seqs: Sequence[int]) -> set[int]:
        owner, tail, size, n = self.owner, self.tail, self.size, len(seqs)
        if self.head > sum(o is not None for o in owner) + 2 * n:
            self.head = 0
        empty = self.head  # the first empty cell from head on
        for _ in range(size):
            empty %= size
            if owner[empty] is None:
                break
            empty += 1
        low = size - 1
        for s, seq in enumerate(seqs):
            if tail[seq] < 0:  # takes the empty cell (its owner is set below, as llama.cpp inserts its id)
                tail[seq] = empty
                if s + 1 < n:
                    for _ in range(size):
                        empty = (empty + 1) % size
                        if owner[empty] is None:
                            break
            low = min(low, tail[seq])
        moved: set[int] = set()
        for s, seq in enumerate(seqs):  # gather and re-order: sequence s of the ubatch goes to cell low + s
            dst, src = low + s, tail[seq]
            if dst != src:
                moved |= {o for o in (owner[dst], owner[src]) if o is not None}
                owner[dst], owner[src] = owner[src], owner[dst]
                for q in range(size):
                    if tail[q] == src:
                        tail[q] = dst
                    elif tail[q] == dst:
                        tail[q] = src
        for s, seq in enumerate(seqs):
            owner[low + s], tail[seq] = seq, low + s
        self.head = low
        return moved


class CallPlan:
    """The cells as a decode's calls are planned (`ubatch.whole_plan`): a scratch copy that each planned call
    advances, so that a later call is judged on the cells the earlier ones leave."""

    def __init__(self, cells: CellMap) -> None:
        self.cells = cells.copy()

    def shares(self, seqs: Sequence[int]) -> bool:
        """Whether one ubatch of these sequences (ascending) moves no state but theirs. A sequence in the ubatch
        may move: llama.cpp copies its state, or the snapshot a pending rollback names, from its old cell
        (`s_copy`: rs_idx * size + src0), and its new snapshots are written where it now is. One outside it keeps
        its old snapshots behind, which a later rollback would read in its new cell (docs/upstream.md)."""
        if len(seqs) == 1:
            return True  # (a lone sequence keeps its cell, or takes an empty one)
        return not self.cells.lost and self.cells.moved(seqs) <= set(seqs)

    def called(self, seqs: Sequence[int]) -> None:
        self.cells.decoded(seqs)


class RecurrentState:
    """One context's recurrent sequences: how far each can roll back exactly, and its checkpoint."""

    def __init__(self, ctx: ctypes.c_void_p, memory: ctypes.c_void_p, depth: int, name: str, n_seq: int = 1) -> None:
        self._ctx = ctx
        self._memory = memory
        self.depth = depth  # llama.cpp's snapshots per sequence (n_rs_seq)
        self._name = name  # the model file's name, for errors
        self._last_run: dict[int, int] = {}  # per sequence: its tokens in its last llama_decode
        self._pending: set[int] = set()  # sequences with a snapshot rollback not yet decoded past (single-use)
        self._checkpoints: dict[int, tuple[int, ctypes.Array]] = {}  # per sequence: (its length, the saved state)
        self._flags = _checkpoint_flags()  # None: this build keeps no checkpoints (a rewind then starts afresh)
        self.cells = CellMap(n_seq)  # which cell holds each sequence (`CellMap`): whether sequences may share a call
        self.moves = 0  # states llama.cpp moved to another cell (sequences of a shared call, into cell order)
        self.stranded = 0  # moved states of sequences outside the call (their snapshots left behind)

    def call_plan(self) -> CallPlan:
        """The cells as they stand, for planning a decode's calls (`ubatch.whole_plan`)."""
        return CallPlan(self.cells)

    def decoded(self, runs: Sequence[Run]) -> None:
        """A llama_decode of these runs (one ubatch: a recurrent model's calls never split a sequence's tokens)."""
        seqs = [run.seq for run in runs]
        for run in runs:
            self._last_run[run.seq] = len(run.tokens)
            self._pending.discard(run.seq)
        moved = self.cells.decoded(seqs)
        self.moves += len(moved)
        for seq in moved - set(seqs):  # its snapshots stayed behind: a rewind of it goes to its checkpoint
            self._last_run[seq] = 0  # (`CallPlan.shares` plans no such call)
            self.stranded += 1

    def decoded_elsewhere(self, seq: int) -> None:
        """A llama_decode of the sequence that did not go through `decoded` (a picture, through libmtmd): none of
        its tokens can be rolled back through snapshots (a rewind never stops inside a picture)."""
        self._last_run[seq] = 0
        self._pending.discard(seq)
        self.cells.decoded([seq])

    def failed(self) -> None:
        """A decode or a state load failed part way: where llama.cpp left the cells is not known."""
        self.cells.lost = True

    def loaded(self, seq: int) -> None:
        """A saved state of the sequence was loaded whole (`LlamaModel.load_state`)."""
        self.forget(seq)
        self.cells.loaded(seq, int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq)) >= 0)

    def truncate(self, n_keep: int, seq: int) -> int:
        """`LlamaModel.truncate` of a recurrent sequence: the cells it kept."""
        have = int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq)) + 1
        if n_keep >= have:
            return n_keep
        back = have - n_keep
        depth = min(self.depth, self._last_run.get(seq, 0) - 1)
        if n_keep > 0 and back <= depth and seq not in self._pending:
            if not llama_cpp.llama_memory_seq_rm(self._memory, seq, n_keep, -1):
                raise DecodeError(f"{self._name}: llama.cpp refused to roll sequence {seq} back {back} tokens")
            self._pending.add(seq)
            kept = n_keep
        else:
            kept = self._restore(seq, n_keep)
        saved = self._checkpoints.get(seq)
        if saved is not None and saved[0] > kept:
            del self._checkpoints[seq]  # its cells are gone: what it saved no longer follows from them
        return kept

    def _restore(self, seq: int, n_keep: int) -> int:
        """Back to the sequence's checkpoint if it is at or before n_keep (its length), else to nothing."""
        saved = self._checkpoints.get(seq)
        self._pending.discard(seq)
        self._last_run.pop(seq, None)
        if saved is not None and saved[0] <= n_keep and self._flags is not None:
            length, buf = saved
            # The recurrent part is the checkpoint's; the attention cells after it go (the recurrent part's own
            # seq_rm is then a no-op: its cell ends at the checkpoint).
            read = llama_cpp.llama_state_seq_set_data_ext(self._ctx, buf, len(buf), seq, self._flags) == len(buf)
            if read:
                self.cells.loaded(seq, True)
            else:
                self.failed()
            if read and llama_cpp.llama_memory_seq_rm(self._memory, seq, length, -1):
                return length
        llama_cpp.llama_memory_seq_rm(self._memory, seq, 0, -1)
        self.cells.removed(seq)
        self._checkpoints.pop(seq, None)
        return 0

    def checkpoint(self, seq: int) -> None:
        """Save the sequence's recurrent part (on its device) at its current length, replacing the last one."""
        self._checkpoints.pop(seq, None)
        if self._flags is None:
            return
        length = int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq)) + 1
        size = llama_cpp.llama_state_seq_get_size_ext(self._ctx, seq, self._flags)
        buf = (ctypes.c_uint8 * max(size, 1))()
        if length > 0 and size and llama_cpp.llama_state_seq_get_data_ext(self._ctx, buf, size, seq,
                                                                         self._flags) == size:
            self._checkpoints[seq] = (length, buf)

    def forget(self, seq: int) -> None:
        """The sequence's cells were replaced (a saved state loaded): no snapshot or checkpoint of it serves."""
        self._pending.discard(seq)
        self._last_run.pop(seq, None)
        self._checkpoints.pop(seq, None)

    def clear(self) -> None:
        """Every sequence's cells are gone."""
        self.cells.cleared()
        self._checkpoints.clear()
        self._pending.clear()
        self._last_run.clear()
