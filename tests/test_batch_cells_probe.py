"""bench/lab/batch_cells.py, and the llama.cpp behaviour docs/lossless.md states from it: on the CPU a prompt's cells
are bit for bit the same when its beginning was decoded inside a longer batch of up to 63 tokens, and not from 64 (so
a reply reusing a slot's or the prompt cache's cells can differ from a fresh run at a near-tie). A canary: if a
llama.cpp update makes the two agree (or the small batch differ), this fails and the docs' sentence must change."""

from __future__ import annotations

import pytest
from batch_cells import measure

pytestmark = pytest.mark.slow


def test_a_prompts_cells_depend_on_the_batch_from_64_tokens() -> None:
    m = measure([33, 63, 64])
    assert m.shared == 24 and m.prompt_tokens == 47  # (the premise: the shipped prompts share their beginning)
    assert m.by_batch[33] == (0.0, m.alone_argmax) and m.by_batch[63] == (0.0, m.alone_argmax)
    assert m.by_batch[64][0] > 0.1, m.by_batch
