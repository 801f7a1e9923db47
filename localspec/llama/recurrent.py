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
from collections.abc import Sequence

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


class RecurrentState:
    """One context's recurrent sequences: how far each can roll back exactly, and its checkpoint."""

    def __init__(self, ctx: ctypes.c_void_p, memory: ctypes.c_void_p, depth: int, name: str) -> None:
        self._ctx = ctx
        self._memory = memory
        self.depth = depth  # llama.cpp's snapshots per sequence (n_rs_seq)
        self._name = name  # the model file's name, for errors
        self._last_run: dict[int, int] = {}  # per sequence: its tokens in its last llama_decode
        self._pending: set[int] = set()  # sequences with a snapshot rollback not yet decoded past (single-use)
        self._checkpoints: dict[int, tuple[int, ctypes.Array]] = {}  # per sequence: (its length, the saved state)
        self._flags = _checkpoint_flags()  # None: this build keeps no checkpoints (a rewind then starts afresh)

    def decoded(self, runs: Sequence[Run]) -> None:
        """A llama_decode of these runs (one ubatch: a recurrent model's calls never split a sequence's tokens)."""
        for run in runs:
            self._last_run[run.seq] = len(run.tokens)
            self._pending.discard(run.seq)

    def decoded_elsewhere(self, seq: int) -> None:
        """A llama_decode of the sequence that did not go through `decoded` (a picture, through libmtmd): none of
        its tokens can be rolled back through snapshots (a rewind never stops inside a picture)."""
        self._last_run[seq] = 0
        self._pending.discard(seq)

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
            if (llama_cpp.llama_state_seq_set_data_ext(self._ctx, buf, len(buf), seq, self._flags) == len(buf)
                    and llama_cpp.llama_memory_seq_rm(self._memory, seq, length, -1)):
                return length
        llama_cpp.llama_memory_seq_rm(self._memory, seq, 0, -1)
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
        self._checkpoints.clear()
        self._pending.clear()
        self._last_run.clear()
