"""Minimal reproduction for llama.cpp: an MTP context's "masked" NextN rows (`llama_set_embeddings_nextn(ctx, true,
true)`) are the batch's first rows, not its output entries' rows.

    python bench/repro_mtp_masked_rows.py [--model PATH] [--threads 1]

It needs llama-cpp-python (0.3.36 vendors the llama.cpp tree where this was found), numpy and gguf. Without
`--model` it writes localspec's tiny Qwen3.5-shaped GGUF with one MTP block (`bench/synthetic.py`, HYBRID_TINY) into
a temporary folder; any `qwen35`/`qwen35moe` GGUF with NextN layers does. On the CPU it makes an MTP context
(`LLAMA_CONTEXT_TYPE_MTP` over the model loaded with `load_mtp`) and decodes one batch of 4 entries (a token, its
position, a hidden-state row), only the last an output, twice: with masked rows, and with unmasked rows (every
entry's row, by batch index). `llama_get_embeddings_nextn_ith(ctx, 3)` must be the same row both times.

Found (llama-cpp-python 0.3.36): masked, it is entry 0's row. The MTP graph (`src/models/qwen35.cpp`, the MTP
builder) sets `res->t_h_nextn` before it selects the output rows (`ggml_get_rows(cur, inp_out_ids)`), and
`llama_context::decode` copies the first `n_outputs` rows of it when masked. llama.cpp's own draft-mtp never meets
it: its MTP decodes that read rows have every entry an output. Exit status 1 when the rows differ.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import llama_cpp as L  # noqa: I001  -- before numpy (a CUDA build of llama.cpp can crash the other way round)
import numpy as np
from llama_cpp import llama_cpp_ext as X

ENTRIES = 4


def rows(model: L.llama_model_p, threads: int, masked: bool, h: np.ndarray, tokens: list[int]) -> np.ndarray:
    """The MTP context's NextN row of the batch's last (its only output) entry."""
    params = L.llama_context_default_params()
    params.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
    params.n_ctx, params.n_batch, params.n_ubatch = 256, 64, 64
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, params)
    assert ctx, "MTP context"
    X.llama_set_embeddings_nextn(ctx, True, masked)
    batch = L.llama_batch_ext_init(ctx)
    pos = L.llama_pos(0)
    n_embd = h.shape[1]
    for i, token in enumerate(tokens):
        idx = L.llama_batch_ext_add_token(batch, 0, token)
        pos.value = i
        L.llama_batch_ext_set_pos(batch, idx, ctypes.byref(pos))
        embd = L.llama_embd(ctypes.cast(h.ctypes.data + i * 4 * n_embd, ctypes.POINTER(ctypes.c_float)), 1, n_embd)
        L.llama_batch_ext_set_embd_token(batch, idx, embd)
        if i == len(tokens) - 1:
            L.llama_batch_ext_set_output_logits(batch, idx, True)
    assert L.llama_process(ctx, L.LLAMA_PROCESS_TYPE_DECODE, batch) == 0, "decode"
    out = np.ctypeslib.as_array(X.llama_get_embeddings_nextn_ith(ctx, len(tokens) - 1), shape=(n_embd,)).copy()
    first = None
    if not masked:
        first = np.ctypeslib.as_array(X.llama_get_embeddings_nextn_ith(ctx, 0), shape=(n_embd,)).copy()
    L.llama_batch_ext_free(batch)
    L.llama_free(ctx)
    return out if first is None else np.stack([out, first])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a qwen35 GGUF with NextN (MTP) layers (default: write a tiny one)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from synthetic import hybrid_model_or_tiny

        path = hybrid_model_or_tiny(a.model, tmp)
        L.llama_backend_init()
        log = L.llama_log_callback(lambda level, text, data: None)
        L.llama_log_set(log, ctypes.c_void_p(0))
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.load_mtp = True
        model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise SystemExit(f"{path}: llama.cpp could not load it")
        n_embd = int(L.llama_model_n_embd_out(model))
        h = np.random.default_rng(0).standard_normal((ENTRIES, n_embd)).astype(np.float32)
        tokens = [100 + 7 * i for i in range(ENTRIES)]
        masked = rows(model, a.threads, True, h, tokens)
        unmasked, first = rows(model, a.threads, False, h, tokens)
        L.llama_model_free(model)
    right = np.allclose(masked, unmasked, atol=1e-5)
    print(f"{ENTRIES} entries, the last the output: masked row {'==' if right else '!='} unmasked row "
          f"{ENTRIES - 1}; masked row {'==' if np.allclose(masked, first, atol=1e-5) else '!='} unmasked row 0")
    return 0 if right else 1


if __name__ == "__main__":
    sys.exit(main())
