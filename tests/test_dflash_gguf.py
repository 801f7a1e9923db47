"""Block drafters' GGUFs (bench/synthetic.py `write_block_drafter`, docs/dflash.md): llama.cpp loads the tiny DFlash
and DSpark drafters, takes the tiny target's layer features into the drafter's cache and decodes one block, through
llama-cpp-python's low-level API the way common/speculative.cpp's loop does; and the pair's header checks
(`layer_features.check_block_drafter`) refuse each bad pair in one line naming the file and key."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import gguf
import helpers_gguf as G
import llama_cpp
import numpy as np
import pytest
from llama_cpp import llama_cpp_ext
from synthetic import TINY, BlockDrafterSpec, write_block_drafter

from localspec.errors import UsageError
from localspec.llama import layer_features as lf
from localspec.models.gguf_header import read_header

PROMPT = [1, 504, 3136, 2079, 314, 260, 1345, 30, 6049, 9866, 28, 216]
LAYERS = (1, 3)
DFLASH = BlockDrafterSpec(target_layers=LAYERS, block_size=4)
DSPARK = dataclasses.replace(DFLASH, markov_rank=8)  # the same weights (by name) plus the Markov and confidence heads


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("dflash")
    out = {}
    for name, spec in (("dflash", DFLASH), ("dspark", DSPARK)):
        out[name] = folder / f"{name}.gguf"
        write_block_drafter(out[name], TINY, spec)
    return out


def _load(path: Path) -> ctypes.c_void_p:
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    assert model, path
    return model


def _context(model: ctypes.c_void_p, other: ctypes.c_void_p | None = None) -> ctypes.c_void_p:
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 64
    cparams.n_threads = cparams.n_threads_batch = 1
    if other is not None:
        cparams.ctx_other = other  # the drafter has no token_embd / output: it reads the target's
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    assert ctx
    return ctx


class Target:
    """The tiny target after the prompt, its layer features on."""

    def __init__(self, path: Path) -> None:
        self.model = _load(path)
        self.ctx = _context(self.model)
        n_layer, n_embd = llama_cpp.llama_model_n_layer(self.model), llama_cpp.llama_model_n_embd(self.model)
        self.features = lf.LayerFeatures(self.ctx, n_layer, n_embd, LAYERS, path.name)
        self.features.switch(True)
        arr = (llama_cpp.llama_token * len(PROMPT))(*PROMPT)
        assert llama_cpp.llama_decode(self.ctx, llama_cpp.llama_batch_get_one(arr, len(PROMPT))) == 0
        self.rows = self.features.rows(0, len(PROMPT))  # (n, 2 * n_embd): layer 1's input, then layer 3's
        self.anchor = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1),
                                                          shape=(llama_cpp.llama_vocab_n_tokens(
                                                              llama_cpp.llama_model_get_vocab(self.model)),))))

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


@pytest.fixture(scope="module")
def target(tiny_pair) -> Iterator[Target]:
    t = Target(tiny_pair[0])
    yield t
    t.close()


def _block(path: Path, target: Target, features: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, list[int]]:
    """Load the drafter over the target's context, inject the features at positions 0.., decode the block
    [anchor, MASK x (block - 1)] after them; its logits per position and DSpark's confidence per position."""
    model = _load(path)
    ctx = _context(model, target.ctx)
    batch = llama_cpp.llama_batch_ext_init(ctx)
    pos = llama_cpp.llama_pos(0)
    try:
        assert lf.target_layer_ids(model) == list(LAYERS)
        assert lf.dflash_selector_top_k(model) == 0
        mask = llama_cpp.llama_vocab_mask(llama_cpp.llama_model_get_vocab(model))
        llama_cpp.llama_set_causal_attn(ctx, False)  # the block attends both ways (llama.cpp's loop does this)
        llama_cpp_ext.llama_set_embeddings_nextn(ctx, True, True)  # DSpark's confidence rows
        rows = np.ascontiguousarray(features, dtype=np.float32)
        for i in range(len(rows)):  # one embd row per target token, at its position
            idx = llama_cpp.llama_batch_ext_add_embd(batch, 0, llama_cpp.llama_embd(
                rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, rows.shape[1]))
            assert idx == i
            pos.value = i
            llama_cpp.llama_batch_ext_set_pos(batch, idx, ctypes.byref(pos))
        assert llama_cpp.llama_process(ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
        llama_cpp.llama_batch_ext_clear(batch)
        block = [target.anchor] + [mask] * 3
        for i, token in enumerate(block):
            idx = llama_cpp.llama_batch_ext_add_token(batch, 0, token)
            pos.value = len(rows) + i
            llama_cpp.llama_batch_ext_set_pos(batch, idx, ctypes.byref(pos))
            llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True)
        assert llama_cpp.llama_process(ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                           for i in range(len(block))])
        conf = None
        base = llama_cpp_ext.llama_get_embeddings_nextn(ctx)
        if base:
            n_embd = int(llama_cpp.llama_model_n_embd(model))
            conf = np.ctypeslib.as_array(base, shape=(len(block), n_embd)).copy()
        # The block's cells go (the server's seq_rm from pos0): only the injected features stay cached.
        assert llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, len(rows), -1)
        assert llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(ctx), 0) == len(rows) - 1
        return logits, conf, block
    finally:
        llama_cpp.llama_batch_ext_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def _tensor(path: Path, name: str) -> np.ndarray:
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return np.asarray(t.data, dtype=np.float64).reshape([int(n) for n in reversed(t.shape)])


def test_llama_cpp_loads_the_dflash_drafter_and_drafts_a_block(drafters, target) -> None:
    logits, _, _ = _block(drafters["dflash"], target, target.rows)
    assert logits.shape == (4, 49152) and np.isfinite(logits).all()
    assert not np.allclose(logits[1], logits[2])  # positions differ (rope, the anchor's attention)
    # The features are what the block reads: other features, other logits.
    other, _, _ = _block(drafters["dflash"], target, target.rows[::-1].copy())
    assert np.abs(other - logits).max() > 1e-3


def test_dspark_is_dflash_plus_its_markov_chain_and_a_confidence_per_position(drafters, target) -> None:
    base, _, block = _block(drafters["dflash"], target, target.rows)
    logits, conf, _ = _block(drafters["dspark"], target, target.rows)
    # build_dspark_markov_head: logits_i + markov_w2 . markov_w1[prev_i], prev_0 = the anchor, then the argmax.
    w1, w2 = _tensor(drafters["dspark"], "markov_w1.weight"), _tensor(drafters["dspark"], "markov_w2.weight")
    prev = block[0]
    for i in range(len(block)):
        expected = base[i] + w2 @ w1[prev]
        np.testing.assert_allclose(logits[i], expected, rtol=0, atol=1e-3)
        prev = int(np.argmax(logits[i]))
    assert conf is not None
    assert np.all((conf > 0) & (conf < 1))
    np.testing.assert_array_equal(conf, np.repeat(conf[:, :1], conf.shape[1], axis=1))  # broadcast rows


# -- the pair's checks, before anything loads --------------------------------------------------------------------


def _bad(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "bad-drafter.gguf"
    write_block_drafter(path, TINY, dataclasses.replace(DSPARK, **changes))
    return path


def _refused(target: Path, draft: Path, verify_width: int | None = 64) -> str:
    with pytest.raises(UsageError) as err:
        lf.check_block_drafter(read_header(target), read_header(draft), verify_width=verify_width)
    line = str(err.value)
    assert "\n" not in line and draft.name in line
    return line


def test_a_good_pair_reports_the_kind_and_the_layers(tiny_pair, drafters) -> None:
    facts = lf.check_block_drafter(read_header(tiny_pair[0]), read_header(drafters["dspark"]), verify_width=64)
    assert (facts.kind, facts.layers, facts.block_size, facts.max_drafts, facts.confidence) == (
        "dspark", LAYERS, 4, 4, True)
    assert facts.title == "DSpark with a confidence head, block 4, reads target layers 1, 3"
    plain = lf.check_block_drafter(read_header(tiny_pair[0]), read_header(drafters["dflash"]))
    assert (plain.kind, plain.max_drafts, plain.confidence, plain.own_head) == ("dflash", 3, False, False)


def test_target_layers_beyond_the_target(tiny_pair, tmp_path) -> None:
    line = _refused(tiny_pair[0], _bad(tmp_path, target_layers=(1, 4)))
    assert "dflash.target_layers [1, 4] names layer 4" in line and "layers 0..3 (qwen3.block_count)" in line


def test_a_feature_width_mismatch(tiny_pair, tmp_path) -> None:
    line = _refused(tiny_pair[0], _bad(tmp_path, n_embd=32))
    assert "dflash.embedding_length 32 is not the target's feature width 64" in line


def test_a_block_the_target_cannot_verify(tiny_pair, tmp_path) -> None:
    line = _refused(tiny_pair[0], _bad(tmp_path, block_size=16), verify_width=8)
    assert "dflash.block_size 16 drafts 16 tokens a block" in line and "at most 7 in one decode" in line
    assert "needs 2 or more" in _refused(tiny_pair[0], _bad(tmp_path, block_size=1))


def test_a_drafter_for_another_target_family(tiny_pair, drafters, tmp_path) -> None:
    # A qwen2 target: llama.cpp's qwen2 graph records no layer inputs (it would abort at the first decode).
    qwen2 = G.rewrite(tiny_pair[0], tmp_path / "qwen2-target.gguf",
                      {"general.architecture": G.kv("general.architecture", 8, "qwen2")})
    line = _refused(qwen2, drafters["dflash"])
    assert "qwen2-target.gguf is 'qwen2' (general.architecture)" in line
    # A draft model that is no block drafter at all.
    assert "general.architecture is 'qwen3', not a block drafter" in _refused(tiny_pair[0], tiny_pair[1])


def test_a_drafter_without_a_mask_token_or_layers(tiny_pair, drafters, tmp_path) -> None:
    no_mask = G.rewrite(drafters["dflash"], tmp_path / "no-mask.gguf", {"tokenizer.ggml.mask_token_id": None})
    assert "tokenizer.ggml.mask_token_id is missing" in _refused(tiny_pair[0], no_mask)
    no_layers = G.rewrite(drafters["dflash"], tmp_path / "no-layers.gguf", {"dflash.target_layers": None})
    assert "dflash.target_layers is missing" in _refused(tiny_pair[0], no_layers)
