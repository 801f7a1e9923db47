"""What one decode returns, whatever the device computed: one type, so the loop never asks which kind it got."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class Scores:
    """One row per output position, in the shape the sequence's device sampler chose:

    - full logits: `logits` (rows, n_vocab), `ids` None (column = token id);
    - the device's top candidates: `logits` and `ids` (rows, m) (the greedy sampler: m = 1, logits all zero);
    - a token the device drew (plain decoding at T > 0): `drawn` (rows,), nothing else.
    """

    logits: np.ndarray | None
    ids: np.ndarray | None = None
    drawn: np.ndarray | None = None
    # The target's hidden state after every token of the decode (what an MTP head drafts from), when a drafter
    # asked for it (`LlamaModel.want_hidden`): (tokens, n_embd) float32, a copy.
    hidden: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.drawn) if self.drawn is not None else len(self.logits)  # type: ignore[arg-type]

    @property
    def full(self) -> bool:
        """Whether every row holds every token's logit (what penalties need)."""
        return self.ids is None and self.drawn is None

    def head(self, n: int) -> Scores:
        """The first n rows (the real tokens of a padded verify batch)."""
        return Scores(None if self.logits is None else self.logits[:n], None if self.ids is None else self.ids[:n],
                      None if self.drawn is None else self.drawn[:n], None if self.hidden is None else self.hidden[:n])

    def argmax(self) -> np.ndarray:
        """Each row's greedy token (np.argmax's tie rule: the lower column wins)."""
        if self.drawn is not None:
            return self.drawn
        best = np.argmax(self.logits, axis=1)
        return best if self.ids is None else self.ids[np.arange(len(self.ids)), best]

    def top_prob(self, row: int = 0) -> float:
        """The row's top probability at temperature 1; over the candidates only when the device chose them (an
        overestimate, fine for the p_min stopping heuristic)."""
        assert self.logits is not None
        logits = self.logits[row]
        return 1.0 / float(np.exp(logits - logits.max(), dtype=np.float64).sum())

    def argmax_and_margin(self) -> list[tuple[int, float]]:
        """Each row's argmax and its lead over the runner-up, in logits (for the bench's greedy check)."""
        assert self.logits is not None
        out = []
        for r, row in enumerate(self.logits):
            if len(row) < 2:  # a single candidate: nothing to compare with
                out.append((int(self.ids[r, 0]) if self.ids is not None else 0, float("inf")))
                continue
            top2 = np.argpartition(row, len(row) - 2)[-2:]
            best, second = (top2[1], top2[0]) if row[top2[1]] >= row[top2[0]] else (top2[0], top2[1])
            # np.argmax breaks ties toward the lower index, as the acceptance does; argpartition does not.
            best = int(np.argmax(row)) if row[best] == row[second] else int(best)
            token = int(self.ids[r, best]) if self.ids is not None else best
            out.append((token, float(row[best] - row[second])))
        return out

    def with_logits(self, logits: np.ndarray) -> Scores:
        return Scores(logits, self.ids, self.drawn, self.hidden)


@dataclass(frozen=True, slots=True)
class DeviceDist:
    """Plain decoding's whole sampling pipeline as one device chain: top-k → top-p → min-p → temperature → a draw.

    llama.cpp's order and rules (top-p and min-p on the softmax at temperature 1), the same pipeline as
    `localspec.rounds.sampling`, so a token drawn here follows the same distribution as one drawn on the host.
    """

    top_k: int  # 0 = off
    top_p: float  # 1 = off
    min_p: float  # 0 = off
    temperature: float  # > 0
    seed: int


class ScoringModel(Protocol):
    """The part of `llama.model.LlamaModel` the loop and the drafters use: what a scripted fake implements."""

    n_ctx: int
    n_seq: int
    n_vocab: int
    n_batch: int
    on_gpu: bool
    batches_sequences: bool
    device_top_k: int
    unknown_token: int
    # How far back a sequence's cells rewind exactly: None for a KV cache (to any position); N for a recurrent
    # state (llama.cpp's snapshots: at most N tokens of its last decode; further back, `truncate` keeps less and
    # says how much: a checkpoint's length, or nothing).
    rewind_depth: int | None
    recurrent: bool  # a recurrent or hybrid model: no prefix of a state is valid, and a context cannot shift
    add_bos: bool  # the tokenizer starts a text with BOS (a context shift keeps it besides n_keep)
    decodes: int  # llama_decode calls so far (the server's n_decode_total)

    def decode(self, tokens: Sequence[int], start_pos: int, all_logits: bool = False,
               seq: int = 0) -> Scores | None: ...

    def decode_many(self, items: Sequence[tuple[int, Sequence[int], int, bool]]) -> list[Scores | None]: ...

    def truncate(self, n_keep: int, seq: int = 0) -> int:
        """Drop the sequence's cells from position n_keep on; returns how many it kept (n_keep, or fewer where a
        recurrent state cannot rewind that far: the caller decodes the rest again)."""
        ...

    def checkpoint(self, seq: int = 0) -> None:
        """Remember a recurrent state as it is now, so a later `truncate` can come back to it (a KV cache: no-op)."""
        ...

    def clear(self, seq: int | None = None) -> None: ...

    def want_hidden(self, seq: int, on: bool) -> None: ...

    # A slot's cells saved and restored (the prompt cache, slot files): llama.model.LlamaModel's docstrings.

    def save_state(self, seq: int = 0) -> bytearray: ...

    def load_state(self, data: bytearray, seq: int = 0) -> bool: ...

    def restore_floor(self, n_tokens: int) -> int: ...

    def use_device_sampler(self, mode: Any, seq: int = 0) -> bool: ...

    def full_row(self, token: int, pos: int, seq: int = 0) -> np.ndarray: ...

    def restart_device_sampler(self, seq: int = 0) -> None: ...

    def piece(self, token: int, special: bool = False) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...
