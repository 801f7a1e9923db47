"""What localspec/llama/ubatch.py's workaround relies on in llama.cpp, checked on the real library: a llama.cpp
update that changes any of it fails here, with what to do, before it can silently corrupt rows (docs/upstream.md).

- the bug is there: two graphs of one size in a row with different device sampler chains active give a row another
  row's candidates (were it fixed, the workaround could go);
- the neutral control-vector call makes llama.cpp plan its graphs afresh, after which every row is right
  (`ubatch.Replans`);
- one ubatch with every chain active is right (`ubatch.covering_calls`);
- llama.cpp's split of a multi-sequence batch into ubatches is `ubatch.ubatch_split`'s rule (`decode_plan` makes
  every decode one ubatch by it).

The rows are checked by bench/lab/repro_ubatch_sampler_rows.py, the self-contained reproduction written for the
upstream report: against a second context without samplers that decodes each sequence alone.
"""

from __future__ import annotations

import ctypes
import os

import llama_cpp  # noqa: I001  -- before numpy (docs/gpu.md)
import pytest
from repro_ubatch_sampler_rows import decode_entries, make_context, run, write_tiny_model

from localspec.llama import backend
from localspec.llama.model import LlamaModel
from localspec.llama.ubatch import decode_plan, ubatch_split

pytestmark = pytest.mark.slow

VERSION = f"llama-cpp-python {llama_cpp.__version__} (the workaround was written against 0.3.36)"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("repro") / "tiny.gguf")


def _wrong(rows) -> list[str]:
    return [f"seq {r.seq} row {r.index}: got {r.got}, expected {r.expected}" for r in rows if not r.right]


@pytest.mark.parametrize(("order", "rows", "separate"), [([1, 0], 2, False), ([1, 0], 2, True), ([2, 1, 0], 3, False)])
def test_the_upstream_bug_is_still_there(tiny, order, rows, separate):
    wrong = _wrong(run(tiny, order, rows, separate=separate))
    assert wrong, (
        f"{VERSION}: device sampler rows of {'separate decodes' if separate else 'one decode'} in the order {order} "
        "are all right now. llama.cpp may have fixed the bug that localspec/llama/ubatch.py works around "
        "(docs/upstream.md): check the fix upstream, then simplify the workaround and this test.")


def test_planning_afresh_makes_every_row_right(tiny):
    """`Replans` relies on this call making llama.cpp reserve its graphs again (the repro's --replan)."""
    wrong = _wrong(run(tiny, [2, 1, 0], 3, separate=True, replan=True))
    assert not wrong, (
        f"{VERSION}: llama_set_adapter_cvec(ctx, NULL, 0, n_embd, -1, -1) no longer makes llama.cpp plan its graphs "
        "afresh, so localspec/llama/ubatch.py's Replans does not protect the rows: " + "; ".join(wrong))


def test_one_ubatch_with_every_chain_active_is_right(tiny):
    """`covering_calls` relies on this: consecutive ascending sequences, the same tokens each, every chain an output."""
    wrong = _wrong(run(tiny, [0, 1, 2], 3))
    assert not wrong, (
        f"{VERSION}: one ubatch in which every chain has its own output rows came back wrong, which "
        "localspec/llama/ubatch.py's covering_calls relies on never happening: " + "; ".join(wrong))


def test_ubatch_split_is_llama_cpps_split(tiny):
    """llama.cpp's batch debugging logs each ubatch it makes: for raw decodes of several layouts (orders, gaps,
    unequal lengths, a small n_ubatch) the count is `ubatch_split`'s; and each of LlamaModel's decodes is one."""
    logged = {"ubatches": 0}

    def count(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        logged["ubatches"] += b"added ubatch" in text

    callback = llama_cpp.llama_log_callback(count)
    layouts = [[(0, 2), (1, 2)], [(1, 2), (0, 2)], [(0, 1), (2, 1), (1, 1)], [(0, 7), (1, 7), (2, 4), (3, 7)],
               [(3, 1), (1, 2), (0, 1), (2, 2)], [(0, 5), (1, 5)]]
    split = f"{VERSION}: llama.cpp's split_equal cuts a batch of several sequences differently from ubatch_split"
    os.environ["LLAMA_BATCH_DEBUG"] = "1"  # read when a context is made
    try:
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        model = llama_cpp.llama_model_load_from_file(str(tiny).encode(), mparams)
        for n_ubatch in (4, 64):
            ctx = make_context(model, 4, n_ubatch, 8)
            llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
            for layout in layouts:
                if sum(c for _, c in layout) > n_ubatch:
                    continue
                llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
                logged["ubatches"] = 0
                decode_entries(ctx, [(5 + t, t, seq, True) for seq, count in layout for t in range(count)])
                assert logged["ubatches"] == len(ubatch_split(layout, n_ubatch)), (split, layout, n_ubatch)
            llama_cpp.llama_log_set(backend._log_to_stderr_when_debugging, ctypes.c_void_p(0))
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)

        with LlamaModel(tiny, n_ctx=64, n_batch=12, n_threads=1, device_top_k=8, n_seq=4, devices=[]) as m:
            llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
            # (sequence 0 has a top-k chain; every call covers it)
            for layout, calls in (([(3, 2), (1, 2), (0, 2), (2, 2)], 1), ([(2, 3), (0, 1)], 1), ([(1, 9)], 2)):
                m.clear()
                logged["ubatches"], decodes = 0, m.decodes
                m.decode_many([(seq, list(range(5, 5 + count)), 0, False) for seq, count in layout])
                assert logged["ubatches"] == m.decodes - decodes == calls, (split, layout)
            m.use_device_sampler(None, 0)  # no chains: decode_plan's calls, each one ubatch
            for layout in ([(3, 2), (1, 2), (0, 2), (2, 2)], [(2, 3), (0, 1)], [(1, 9)], [(0, 1), (2, 1)]):
                m.clear()
                logged["ubatches"], decodes = 0, m.decodes
                m.decode_many([(seq, list(range(5, 5 + count)), 0, False) for seq, count in layout])
                assert logged["ubatches"] == m.decodes - decodes == len(decode_plan(layout, 12, True)), (split, layout)
    finally:
        os.environ.pop("LLAMA_BATCH_DEBUG", None)
        llama_cpp.llama_log_set(backend._log_to_stderr_when_debugging, ctypes.c_void_p(0))
