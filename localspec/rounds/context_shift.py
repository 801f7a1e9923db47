"""Context shift (llama-server's `--context-shift`, `n_keep`, `n_discard`): a generation that fills its context
drops a block of tokens after the kept beginning and goes on, instead of stopping.

llama-server's rule (tools/server/server-context.cpp, `pre_decode`), reproduced here: when the cells hold
n_ctx - 1 tokens, keep the first `n_keep` tokens (a negative n_keep: the whole prompt; one more for the BOS token a
model adds, as its `n_keep` does not count it; at most n_ctx - 4), then drop `n_discard` of the rest (0: half of
them), at least one and always leaving one. The sequence goes on from the kept beginning and the rest after the
dropped block.

Where llama-server moves the kept cells' positions (`llama_memory_seq_add`: their keys are rotated again in
place), localspec decodes the tokens after the kept beginning again at their new positions: the output after a shift
is then exactly what a fresh context holding the shifted tokens produces — the reference the tests compare with — at
the cost of reading about half a context again per shift (a prompt's speed, not a reply's). Both models shift
together at the same committed length: the engine keeps every round within the context minus one, so plain decoding
and speculation reach the shift at the same token and shift the same tokens (`Engine._begin`). A recurrent or hybrid
model's state cannot drop tokens from its middle: context shift is refused there (llama-server turns it off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Shift:
    """Keep the first `keep` tokens, drop the `discard` after them, keep the rest."""

    keep: int
    discard: int


def plan(n_cells: int, n_ctx: int, prompt_tokens: int, n_keep: int, n_discard: int, add_bos: bool) -> Shift:
    """llama-server's shift of a sequence whose cells hold `n_cells` tokens (n_ctx - 1 when it shifts), started
    from a prompt of `prompt_tokens`: `n_keep` and `n_discard` are its request fields."""
    keep = prompt_tokens if n_keep < 0 else n_keep
    if add_bos:
        keep += 1
    keep = min(n_ctx - 4, keep)
    left = n_cells - keep
    discard = n_discard if n_discard else left // 2
    discard = min(max(discard, 0), max(0, left - 1))
    return Shift(keep, discard)


def shifted(tokens: Sequence[int], shift: Shift) -> list[int]:
    """The sequence after the shift: the kept beginning, then what followed the dropped block."""
    return [*tokens[: shift.keep], *tokens[shift.keep + shift.discard :]]
