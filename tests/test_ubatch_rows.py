"""Every row of a multi-sequence decode is the row of its own sequence (issue #18).

llama.cpp cuts a `llama_decode` of several sequences (one KV stream each) into ubatches; with backend sampler
chains on those sequences, rows of a decode cut into several ubatches came back holding other rows' candidates.
Here, through the real llama.cpp on the CPU: rounds of decodes over several sequences in scrambled orders, with
sequences joining (a prompt in the same decode) and leaving, widths that differ, and n_batch small enough to cut
rounds apart; every row's device candidates (top-k, greedy) and full logits are checked against a reference that
cannot share the bug: a second context without samplers, decoding each sequence alone, full logits.
"""

from __future__ import annotations

import ctypes
import os

import llama_cpp  # noqa: I001  -- before numpy (docs/gpu.md)
import numpy as np
import pytest

from localspec import llama_ctx
from localspec.llama_ctx import LlamaModel

pytestmark = pytest.mark.slow

K = 16  # device top-k of the model under test


class Reference:
    """Full-logits rows of one sequence decoded alone, from empty cells, in a one-sequence context."""

    def __init__(self, path) -> None:
        self.model = LlamaModel(path, n_ctx=256, n_batch=256, n_threads=1, devices=[])

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
                check_rows(scores, expected, model._modes.get(seq), f"round {round_no} sequence {seq}")
                checked += len(expected)
        assert checked > 150
    reference.model.close()


# -- the split rules, checked against llama.cpp's own ------------------------------------------------------------

def test_ubatch_split_is_llama_cpps_split(tmp_path):
    """llama.cpp's batch debugging logs each ubatch it makes: for raw decodes of several layouts (orders, gaps,
    unequal lengths, a small n_ubatch) the count is `ubatch_split`'s; and each of LlamaModel's decodes is one."""
    from repro_ubatch_sampler_rows import decode_entries, make_context, write_tiny_model

    from localspec.llama_ctx import decode_plan, ubatch_split

    path = write_tiny_model(tmp_path / "tiny.gguf")
    logged = {"ubatches": 0}

    def count(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        logged["ubatches"] += b"added ubatch" in text

    callback = llama_cpp.llama_log_callback(count)
    layouts = [[(0, 2), (1, 2)], [(1, 2), (0, 2)], [(0, 1), (2, 1), (1, 1)], [(0, 7), (1, 7), (2, 4), (3, 7)],
               [(3, 1), (1, 2), (0, 1), (2, 2)], [(0, 5), (1, 5)]]
    os.environ["LLAMA_BATCH_DEBUG"] = "1"  # read when a context is made
    try:
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        for n_ubatch in (4, 64):
            ctx = make_context(model, 4, n_ubatch, 8)
            llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
            for layout in layouts:
                if sum(c for _, c in layout) > n_ubatch:
                    continue
                llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
                logged["ubatches"] = 0
                decode_entries(ctx, [(5 + t, t, seq, True) for seq, count in layout for t in range(count)])
                assert logged["ubatches"] == len(ubatch_split(layout, n_ubatch)), (layout, n_ubatch)
            llama_cpp.llama_log_set(llama_ctx._log_to_stderr_when_debugging, ctypes.c_void_p(0))
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)

        with LlamaModel(path, n_ctx=64, n_batch=12, n_threads=1, device_top_k=8, n_seq=4, devices=[]) as m:
            llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
            # (sequence 0 has a top-k chain; every call covers it)
            for layout, calls in (([(3, 2), (1, 2), (0, 2), (2, 2)], 1), ([(2, 3), (0, 1)], 1), ([(1, 9)], 2)):
                m.clear()
                logged["ubatches"], decodes = 0, m.decodes
                m.decode_many([(seq, list(range(5, 5 + count)), 0, False) for seq, count in layout])
                assert logged["ubatches"] == m.decodes - decodes == calls, layout
            m.use_device_sampler(None, 0)  # no chains: decode_plan's calls, each one ubatch
            for layout in ([(3, 2), (1, 2), (0, 2), (2, 2)], [(2, 3), (0, 1)], [(1, 9)], [(0, 1), (2, 1)]):
                m.clear()
                logged["ubatches"], decodes = 0, m.decodes
                m.decode_many([(seq, list(range(5, 5 + count)), 0, False) for seq, count in layout])
                assert logged["ubatches"] == m.decodes - decodes == len(decode_plan(layout, 12, True)), layout
    finally:
        os.environ.pop("LLAMA_BATCH_DEBUG", None)
        llama_cpp.llama_log_set(llama_ctx._log_to_stderr_when_debugging, ctypes.c_void_p(0))

