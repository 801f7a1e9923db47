"""The canary of llama.cpp's layer-input features (localspec/llama/layer_features.py, docs/dflash.md): the llama-ext.h
calls llama-cpp-python does not bind, called on a real tiny model and checked against references that share none of
their code: the token embeddings read from the GGUF with the `gguf` package (layer 0's input), and the tiny draft's
final hidden state through llama.cpp's public embeddings API (the draft is the target's first two blocks: its final
norm's output is the RMS norm of the target's layer-2 input). (hidden.py's NextN rows are no reference here: the
qwen3 graph sets no t_h_nextn, so they read zeros on this target family.)"""

from __future__ import annotations

import gguf
import llama_cpp
import numpy as np
import pytest

from localspec.errors import ModelLoadError, UsageError
from localspec.llama import layer_features as lf
from localspec.llama.model import LlamaModel

TOKENS = [1, 504, 3136, 2079, 314, 260, 1345, 30, 6049, 9866, 28, 216, 1201, 42, 77, 1000]


def _token_embd(path) -> np.ndarray:
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))


def _layer_rows(path, tokens: list[int], layers: list[int], n_ubatch: int) -> np.ndarray:
    """One llama_decode of `tokens` in ubatches of `n_ubatch`, its layer features read with LayerFeatures."""
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = 64
    cparams.n_ubatch = n_ubatch
    cparams.n_threads = cparams.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    try:
        features = lf.LayerFeatures(ctx, int(llama_cpp.llama_model_n_layer(model)),
                                    int(llama_cpp.llama_model_n_embd(model)), layers, "target")
        features.switch(True)
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(tokens))) == 0
        return features.rows(0, len(tokens))
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def _final_hidden(path, tokens: list[int]) -> np.ndarray:
    """The model's final norm output per token (llama.h's embeddings, pooling none), by the public API alone."""
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    assert model
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 64
    cparams.n_threads = cparams.n_threads_batch = 1
    cparams.embeddings = True
    cparams.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    try:
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(tokens))) == 0
        n_embd = int(llama_cpp.llama_model_n_embd(model))
        return np.ctypeslib.as_array(llama_cpp.llama_get_embeddings(ctx), shape=(len(tokens), n_embd)).copy()
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def test_every_symbol_binds_on_the_pinned_library() -> None:
    assert lf.layer_features_unsupported() is None


def test_a_missing_symbol_is_one_line_naming_it(monkeypatch) -> None:
    monkeypatch.setitem(lf._BOUND, "llama_get_embeddings_layer_inp", None)
    why = lf.layer_features_unsupported()
    assert why is not None and "llama_get_embeddings_layer_inp" in why and "\n" not in why
    with pytest.raises(ModelLoadError, match="lacks llama_get_embeddings_layer_inp: this llama.cpp build"):
        lf.get_embeddings_layer_inp(None, 0)


def test_layer_inputs_match_the_embeddings_and_the_draft_hidden_state(tiny_pair) -> None:
    target_path, draft_path = tiny_pair
    embd = _token_embd(target_path)
    with LlamaModel(target_path, n_ctx=64, device_top_k=0, n_threads=1) as target:
        n_layer = int(llama_cpp.llama_model_n_layer(target.model))
        n_embd = int(llama_cpp.llama_model_n_embd(target.model))
        assert (n_layer, n_embd) == (4, 64)
        # Not a drafter: no target layers, no selector.
        assert lf.target_layer_ids(target.model) == []
        assert lf.dflash_selector_top_k(target.model) == 0
        features = lf.LayerFeatures(target.ctx, n_layer, n_embd, [0, 2], target.path.name)
        features.switch(True)
        target.decode(TOKENS, 0, all_logits=True)
        rows = features.rows(0, len(TOKENS))
        tail = features.rows(5, 3)
    assert rows.shape == (len(TOKENS), 2 * n_embd) and np.isfinite(rows).all()
    # Layer 0's input is the token embedding itself (qwen3.cpp: inpL = build_inp_embd, no scale), bit for bit.
    np.testing.assert_array_equal(rows[:, :n_embd], embd[TOKENS])
    np.testing.assert_array_equal(tail, rows[5:8])
    # Layer 2's input, RMS-normed (output_norm is all ones), is the two-block draft's final hidden state.
    hidden = _final_hidden(draft_path, TOKENS)
    x = rows[:, n_embd:].astype(np.float64)
    normed = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6)
    assert hidden.shape == (len(TOKENS), n_embd)
    # (Two contexts of different settings: the last bits of a row may differ; a wrong layer differs by O(1).)
    np.testing.assert_allclose(hidden, normed, rtol=0, atol=2e-3)
    assert not np.allclose(rows[:, n_embd:], rows[:, :n_embd])  # (two blocks moved the stream)


def test_a_layer_llama_cpp_would_abort_on_is_refused_first(tiny_pair) -> None:
    # llama.cpp asserts lid <= n_layer and aborts at the decode for lid == n_layer on qwen3 (no t_layer_inp there).
    with pytest.raises(UsageError, match="layers \\[1, 4\\] asked of a model with 4 layers"):
        lf.LayerFeatures(None, 4, 64, [1, 4], "target.gguf")
    with pytest.raises(UsageError):
        lf.LayerFeatures(None, 4, 64, [], "target.gguf")


def test_rows_of_several_ubatches_are_in_token_order(tiny_pair) -> None:
    # extract_layer_inputs writes each ubatch at its first token's row: one decode split in ubatches of 4 gives the
    # rows one ubatch of 16 gives (layer 0 bit for bit: the embeddings do not depend on the split).
    whole = _layer_rows(tiny_pair[0], TOKENS, [0, 3], 16)
    split = _layer_rows(tiny_pair[0], TOKENS, [0, 3], 4)
    np.testing.assert_array_equal(split[:, :64], whole[:, :64])
    np.testing.assert_allclose(split[:, 64:], whole[:, 64:], rtol=0, atol=2e-3)
