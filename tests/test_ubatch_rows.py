"""Every row of a multi-sequence decode is the row of its own sequence (issue #18).

llama.cpp cuts a `llama_decode` of several sequences (one KV stream each) into ubatches; with backend sampler
chains on those sequences, rows of a decode cut into several ubatches came back holding other rows' candidates.
Here, through the real llama.cpp on the CPU: rounds of decodes over several sequences in scrambled orders, with
sequences joining (a prompt in the same decode) and leaving, widths that differ, and n_batch small enough to cut
rounds apart; every row's device candidates (top-k, greedy) and full logits are checked against a reference that
cannot share the bug: a second context without samplers, decoding each sequence alone, full logits.
"""

from __future__ import annotations

import llama_cpp  # noqa: F401, I001  -- before numpy (docs/gpu.md)
import numpy as np
import pytest

from localspec.llama.model import LlamaModel

pytestmark = pytest.mark.slow

K = 16  # device top-k of the model under test


class Reference:
    """Full-logits rows of one sequence decoded alone, from empty cells, in a one-sequence context."""

    def __init__(self, path) -> None:
        self.model = LlamaModel(path, n_ctx=256, device_top_k=0, n_batch=256, n_threads=1, devices=[])

    def rows(self, history: list[int], start: int, n: int) -> np.ndarray:
        self.model.clear()
        logits = self.model.decode(history[: start + n], 0, all_logits=True).logits
        return logits[start : start + n].copy()


def check_rows(scores, expected: np.ndarray, mode: str | None, what: str) -> None:
    for r, ref in enumerate(expected):
        where = f"{what} row {r}"
        if mode is None:
            assert scores.full, where
            np.testing.assert_allclose(scores.logits[r], ref, rtol=0, atol=1e-3, err_msg=where)
        elif mode == "greedy":
            assert int(scores.ids[r, 0]) == int(np.argmax(ref)), where
        else:
            ids, logits = scores.ids[r], scores.logits[r]
            assert len(set(ids.tolist())) == K, where
            # the candidates are a top k of the reference row, with the reference's logits
            assert ref[ids].min() >= np.sort(ref)[-K], f"{where}: not the top {K} of its own row"
            np.testing.assert_allclose(logits, ref[ids], rtol=0, atol=1e-3, err_msg=where)


def _copied(scores):
    # full logits are a view the next decode would overwrite
    return scores.with_logits(scores.logits.copy()) if scores.full else scores


MODES = {"top_k": ["top_k"] * 6, "mixed": ["top_k", "greedy", None, "top_k", "greedy", "top_k"]}


@pytest.mark.parametrize("n_batch", [12, 64])
@pytest.mark.parametrize("modes", sorted(MODES))
def test_every_row_of_scrambled_rounds_is_its_own_sequences_row(tiny_pair, n_batch, modes):
    target = tiny_pair[0]
    n_seq = 6
    reference = Reference(target)
    rng = np.random.default_rng(n_batch)
    with LlamaModel(target, n_ctx=256, n_batch=n_batch, n_threads=1, device_top_k=K, n_seq=n_seq,
                    devices=[]) as model:
        assert model.batches_sequences
        for seq, mode in enumerate(MODES[modes]):
            model.use_device_sampler(mode, seq)
        history: dict[int, list[int]] = {}
        for seq in range(4):  # four start with a prompt each; the others join later
            history[seq] = rng.integers(100, 40_000, size=int(rng.integers(3, 12))).tolist()
            model.decode(history[seq], 0, seq=seq)
        checked = 0
        for round_no in range(24):
            items, new = [], {}
            for seq in rng.permutation(n_seq).tolist():
                if seq not in history:
                    if rng.random() < 0.5:  # joins: its prompt goes into this round's decode
                        new[seq] = rng.integers(100, 40_000, size=int(rng.integers(5, 14))).tolist()
                        items.append((seq, new[seq], 0, False))
                    continue
                if rng.random() < 0.15:  # leaves: its cells are dropped, the slot is free again
                    model.clear(seq)
                    del history[seq]
                    continue
                if rng.random() < 0.2:
                    continue  # sits this round out
                width = int(rng.integers(1, 6))
                new[seq] = rng.integers(100, 40_000, size=width).tolist()
                items.append((seq, new[seq], len(history[seq]), bool(rng.random() < 0.8)))
            if not items:
                continue
            if round_no % 3 == 2:  # one decode per sequence, in the scrambled order (graphs of one size in a row)
                results = [_copied(model.decode(tokens, start, all_rows, seq=seq))
                           for seq, tokens, start, all_rows in items]
            else:
                results = model.decode_many(items)
            for (seq, tokens, start, all_rows), scores in zip(items, results, strict=True):
                history[seq] = history.get(seq, [])[:start] + tokens
                first = start if all_rows else start + len(tokens) - 1
                expected = reference.rows(history[seq], first, len(history[seq]) - first)
                check_rows(scores, expected, model.device_sampler(seq), f"round {round_no} sequence {seq}")
                checked += len(expected)
        assert checked > 150
    reference.model.close()
