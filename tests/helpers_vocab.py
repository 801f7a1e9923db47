"""Tiny GGUF files written with gguf.GGUFWriter: a vocabulary, and optionally tensor infos without data."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType

N_TOKENS = 300


def base_vocab(n: int = N_TOKENS) -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(3, n)]
    types = [TokenType.CONTROL] * 3 + [TokenType.NORMAL] * (n - 3)
    return {
        "model": "gpt2",
        "pre": "default",
        "tokens": tokens,
        "types": types,
        "merges": [f"t o{i}" for i in range(50)],
        "bos": 1,
        "eos": 2,
        "add_bos": True,
        "template": "{% for m in messages %}{{ m.content }}{% endfor %}",
        "ftype": LlamaFileType.MOSTLY_Q8_0,
    }


def write_vocab(
    path: Path,
    *,
    tensors: list[tuple[str, tuple[int, ...], GGMLQuantizationType]] | None = None,
    arch: str = "llama",
    hparams: dict[str, Any] | None = None,
    sparse_size: bool = False,
    **changes: Any,
) -> Path:
    """A GGUF with the base vocabulary plus `changes`; tensor infos declared, data zero-filled or sparse."""
    v = base_vocab()
    v.update(changes)
    w = GGUFWriter(path, arch=arch)
    hp = {
        "block_count": 2,
        "embedding_length": 64,
        "head_count": 4,
        "head_count_kv": 2,
        "context_length": 4096,
    }
    hp.update(hparams or {})
    w.add_block_count(hp["block_count"])
    w.add_embedding_length(hp["embedding_length"])
    w.add_head_count(hp["head_count"])
    w.add_head_count_kv(hp["head_count_kv"])
    w.add_context_length(hp["context_length"])
    if v["ftype"] is not None:
        w.add_file_type(int(v["ftype"]))
    w.add_tokenizer_model(v["model"])
    if v["pre"] is not None:
        w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    if v["merges"] is not None:
        w.add_token_merges(v["merges"])
    w.add_bos_token_id(v["bos"])
    w.add_eos_token_id(v["eos"])
    if v["add_bos"] is not None:
        w.add_add_bos_token(v["add_bos"])
    if v["template"] is not None:
        w.add_chat_template(v["template"])
    data_bytes = 0
    from gguf.constants import GGML_QUANT_SIZES

    for name, shape, qtype in tensors or []:
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * size
        # `shape` is GGUF order (ne[0] first); GGUFWriter wants numpy order with the last dim in bytes.
        byte_shape = (*reversed(shape[1:]), shape[0] // block * size)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        data_bytes += -(-nbytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    if tensors:
        size = path.stat().st_size
        end = -(-size // 32) * 32 + data_bytes
        if sparse_size:
            os.truncate(path, end)  # a sparse file: the data section exists but occupies no disk
        else:
            with path.open("ab") as fh:
                fh.write(b"\0" * (end - size))
    return path
