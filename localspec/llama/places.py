"""Where a sequence's cells sit when a picture takes fewer positions than cells (M-RoPE projectors).

Everywhere above `LlamaModel`, a cell's index in its sequence is its position: the engine, the slots, the prompt cache
and every drafter count tokens. A Qwen2/2.5/3-VL projector (and the Qwen3.5/3.6 models built on them) places a picture
of nx x ny tokens at one position on the time axis and spreads it over max(nx, ny) positions in the image plane
(libmtmd's `mtmd_image_tokens_get_decoder_pos`): all of its cells hold the picture's first position, and the text
after it goes on at first + max(nx, ny), not at first + nx * ny (`mtmd_input_chunk_get_n_pos`). `Places` keeps those
pictures per sequence and translates: `LlamaModel` hands llama.cpp positions and gives the rest indexes.

Why here and not throughout: a picture is decoded whole or not at all (llama.vision), so a sequence's indexes and
positions differ only by whole pictures, and a rewind never stops inside one (`cut` keeps its start instead).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Gap:
    """A picture whose `n_tokens` cells take `n_pos` positions (n_pos < n_tokens), its first cell at `index`."""

    index: int
    n_tokens: int
    n_pos: int

    @property
    def end(self) -> int:
        return self.index + self.n_tokens

    @property
    def saved(self) -> int:  # positions fewer than cells
        return self.n_tokens - self.n_pos


class Places:
    """Per sequence, its pictures that take fewer positions than cells (none for most models: every translation is
    then the identity)."""

    def __init__(self) -> None:
        self._gaps: dict[int, tuple[Gap, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self._gaps)

    def gaps(self, seq: int) -> tuple[Gap, ...]:
        return self._gaps.get(seq, ())

    def pos(self, seq: int, index: int) -> int:
        """The position of the cell at `index` (a picture's cells: its first position)."""
        shift = 0
        for g in self._gaps.get(seq, ()):
            if index >= g.end:
                shift += g.saved
            elif index > g.index:
                return g.index - shift  # inside the picture: all of its cells sit at its first position
        return index - shift

    def index(self, seq: int, pos: int) -> int:
        """How many cells are kept when every cell at a position >= `pos` goes: `pos` translated back (a picture's
        cells go together, since they share its first position)."""
        shift = 0
        for g in self._gaps.get(seq, ()):
            first = g.index - shift
            if pos <= first:
                break
            if pos < first + g.n_pos:  # (the picture stays: its cells sit at `first`; no text cell lies between)
                return g.end
            shift += g.saved
        return pos + shift

    def start(self, seq: int, index: int) -> int:
        """`index`, or the first cell of the picture it falls inside (a rewind never keeps part of a picture)."""
        for g in self._gaps.get(seq, ()):
            if g.index < index < g.end:
                return g.index
        return index

    def add(self, seq: int, index: int, n_tokens: int, n_pos: int) -> None:
        """A picture of `n_tokens` cells at `n_pos` positions was decoded at cell `index` (after every other)."""
        if n_pos != n_tokens:
            self._gaps[seq] = (*self._gaps.get(seq, ()), Gap(index, n_tokens, n_pos))

    def cut(self, seq: int, n_keep: int) -> None:
        """The sequence keeps its first `n_keep` cells (never part of a picture: `start`)."""
        kept = tuple(g for g in self._gaps.get(seq, ()) if g.end <= n_keep)
        if kept:
            self._gaps[seq] = kept
        else:
            self._gaps.pop(seq, None)

    def put(self, seq: int, gaps: tuple[Gap, ...]) -> None:
        """The sequence's cells were replaced by a saved state's, whose pictures are `gaps`."""
        if gaps:
            self._gaps[seq] = gaps
        else:
            self._gaps.pop(seq, None)

    def clear(self) -> None:
        self._gaps.clear()


class SavedCells(bytearray):
    """A sequence's cells as llama.cpp serialised them (`LlamaModel.save_state`), with where its pictures sit: the
    bytes alone do not say which of its positions were a picture's (a slot file holds no picture: it keeps the
    bytes only)."""

    gaps: tuple[Gap, ...] = ()
