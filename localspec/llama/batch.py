"""The batch a model decodes: the items callers hand in, the runs of consecutive entries one `llama_decode` holds,
and the one `llama_batch` of a model's life, filled through numpy views (no per-token ctypes calls)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp  # noqa: I001  -- llama_cpp before numpy: on CUDA builds the other order can segfault (docs/gpu.md)
import numpy as np

DecodeItem = tuple[int, Sequence[int], int, bool]  # (sequence id, tokens, first position, a row for every token)
Wanted = tuple[int, int, int, int]  # (item, sequence, first batch index, rows): an item's rows in one decode


@dataclass(slots=True)
class Run:
    """One sequence's consecutive entries of a llama_decode call, and which of its rows an item wants."""

    seq: int
    pos: int  # position of the first token
    tokens: list[int]
    outputs: list[bool]
    item: int = -1  # the item whose rows these are (-1: padding only)
    rows_at: int = 0  # where in the run the item's rows start
    rows: int = 0
    real: int | None = None  # how many of the tokens are the item's (None: all; the rest pad a covering call)


class Batch:
    """One `llama_batch` of `size` entries, one sequence id each, reused for every decode."""

    def __init__(self, size: int, sequences: bool) -> None:
        self.raw = llama_cpp.llama_batch_init(size, 0, 1)
        self._sequences = sequences  # several sequences: each entry's seq_id is set (else 0 for good)
        self._tok = np.ctypeslib.as_array(self.raw.token, shape=(size,))
        self._pos = np.ctypeslib.as_array(self.raw.pos, shape=(size,))
        self._out = np.ctypeslib.as_array(self.raw.logits, shape=(size,))
        np.ctypeslib.as_array(self.raw.n_seq_id, shape=(size,))[:] = 1
        self._seq = np.zeros(size, dtype=np.int32)  # what each entry's seq_id holds (set only on change)
        for i in range(size):
            self.raw.seq_id[i][0] = 0

    def fill(self, runs: Sequence[Run]) -> tuple[int, dict[int, int], list[Wanted]]:
        """Write the runs in order; (entries, output rows per sequence, the rows each item wants)."""
        n = 0
        outputs: dict[int, int] = {}
        wanted: list[Wanted] = []
        for run in runs:
            take = len(run.tokens)
            self._tok[n : n + take] = run.tokens
            self._pos[n : n + take] = np.arange(run.pos, run.pos + take)
            if self._sequences:
                for i in np.flatnonzero(self._seq[n : n + take] != run.seq):
                    self.raw.seq_id[n + i][0] = run.seq
                self._seq[n : n + take] = run.seq
            self._out[n : n + take] = run.outputs
            outputs[run.seq] = sum(run.outputs)
            if run.rows:
                wanted.append((run.item, run.seq, n + run.rows_at, run.rows))
            n += take
        self.raw.n_tokens = n
        return n, outputs, wanted

    def where(self, i: int) -> str:
        """Entry i, for an error message."""
        return f"sequence {self._seq[i]} position {self._pos[i]}"

    def free(self) -> None:
        llama_cpp.llama_batch_free(self.raw)
