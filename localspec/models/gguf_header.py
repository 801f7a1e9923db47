"""Bounded, header-only GGUF reading: metadata and tensor infos, never a byte of tensor data.

`gguf.GGUFReader` memory-maps the whole file and builds one numpy view per token string, which is slow for
262k-token vocabularies and turns a truncated file into an IndexError deep inside numpy. Here the header is
parsed sequentially from a buffered file with explicit limits (header size, string length, array length),
using the `gguf` package's constants for the value and quantization types. A truncated, corrupt or non-GGUF
file raises a one-line `GGUFError` that names the file.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
    LlamaFileType,
)

from localspec.errors import GGUFError
from localspec.fsutil import not_a_file

# A 262k-token vocabulary with merges and scores is ~15 MB of header; 256 MiB leaves room and still bounds a
# hostile file that claims a billion strings.
MAX_HEADER_BYTES = 256 << 20
MAX_STRING_BYTES = 16 << 20  # chat templates are the longest strings seen (tens of kB)
MAX_ARRAY_LEN = 1 << 24
MAX_KEYS = 1 << 16  # real files carry 20-60 keys; each kept key costs ~100 bytes of Python objects
MAX_TENSORS = 1 << 16  # real files hold a few hundred to ~3k tensor infos (~250 bytes each in memory)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 3  # arrays of arrays: gguf allows them, no model uses them; deeper is a RecursionError bomb
# Items walked one at a time cost time, not memory: bounded per header so a hostile one fails fast. Real files walk
# their vocabulary and merges (~1M strings for the largest); nested arrays none (262k of them take ~1 s).
MAX_WALKED_STRINGS = 1 << 22
MAX_NESTED_ARRAYS = 1 << 18
# The only string arrays anything compares; every other one is skipped while reading, so a header of millions
# of short strings costs no memory (a Python str is ~50 bytes beyond its text).
KEPT_STRING_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})

# llama.cpp aborts the process (GGML_ASSERT) instead of failing the load beyond these (vendor/llama.cpp,
# src/llama-hparams.h and llama_model_base::load_hparams in src/llama-model.cpp, llama-cpp-python 0.3.36).
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
# Far above any real model, low enough that the memory estimate and llama.cpp's uint32 fields stay sane.
MAX_EMBD = 1 << 18
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 14
MAX_CTX = 1 << 30
MAX_VOCAB = 1 << 22

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


class StringArray(Sequence[str]):
    """A GGUF string array kept as one bytes blob plus the end offset of each item: an item costs its bytes
    and 8, so memory stays the size of the header. Items decode on access; byte tokens that are not valid UTF-8
    keep their bytes as surrogates, so they stay comparable."""

    __slots__ = ("_blob", "_ends")

    def __init__(self, blob: bytes | bytearray = b"", ends: np.ndarray | None = None) -> None:
        self._blob = blob
        self._ends = ends if ends is not None else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._ends)

    def raw(self, i: int) -> bytes:
        start = int(self._ends[i - 1]) if i > 0 else 0
        return bytes(self._blob[start : int(self._ends[i])])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        i = i + n if i < 0 else i
        if not 0 <= i < n:
            raise IndexError(i)
        return self.raw(i).decode("utf-8", errors="surrogateescape")

    def __iter__(self) -> Iterator[str]:
        start = 0
        for end in self._ends.tolist():
            yield bytes(self._blob[start:end]).decode("utf-8", errors="surrogateescape")
            start = end

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return np.array_equal(self._ends, other._ends) and self._blob == other._blob
        if isinstance(other, list):
            return list(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-sized content, like a list

    def __repr__(self) -> str:
        return f"StringArray({len(self)} items)"

    def first_difference(self, other: StringArray) -> int | None:
        """The first index present in both where the items differ, or None: vectorised, since comparing a
        262k-token vocabulary item by item in Python takes a noticeable fraction of a second."""
        n = min(len(self), len(other))
        a_ends, b_ends = self._ends[:n], other._ends[:n]
        moved = np.flatnonzero(a_ends != b_ends)
        # Before the first differing end offset, items have equal lengths, so the blobs align byte for byte.
        m = int(moved[0]) if moved.size else n
        aligned = int(a_ends[m - 1]) if m > 0 else 0
        if aligned:
            a = np.frombuffer(self._blob, dtype=np.uint8, count=aligned)
            b = np.frombuffer(other._blob, dtype=np.uint8, count=aligned)
            differ = np.flatnonzero(a != b)
            if differ.size:
                return int(np.searchsorted(a_ends, differ[0], side="right"))
        return m if m < n else None

    def first_index(self, text: str) -> int | None:
        """The first id whose item is `text`, found by searching the blob (decoding a 262k-token vocabulary item
        by item to look for a few special tokens takes a tenth of a second)."""
        raw = text.encode("utf-8", errors="surrogateescape")
        if not raw:
            return next((i for i in range(len(self)) if not self.raw(i)), None)
        at = self._blob.find(raw)
        while at >= 0:
            i = int(np.searchsorted(self._ends, at, side="right"))  # the item holding byte `at`
            if (int(self._ends[i - 1]) if i else 0) == at and int(self._ends[i]) == at + len(raw):
                return i
            at = self._blob.find(raw, at + 1)
        return None

    def first_duplicate(self) -> tuple[int, int] | None:
        """Two ids with the same text, as llama.cpp sees them (an empty token reads as `[EMPTY_i]`)."""
        blob, ends = bytes(self._blob), self._ends.tolist()
        starts = [0, *ends][: len(ends)]
        texts = [blob[a:b] or b"[EMPTY_%d]" % i for i, (a, b) in enumerate(zip(starts, ends, strict=True))]
        if len(set(texts)) == len(texts):  # (the usual answer, without a Python loop)
            return None
        seen: dict[bytes, int] = {}
        for i, text in enumerate(texts):
            first = seen.setdefault(text, i)
            if first != i:
                return first, i
        return None


@dataclass(frozen=True)
class SkippedArray:
    """An array nothing in localspec reads: skipped while reading, only its item kind and length kept."""

    item: str
    count: int


# The type each key must have where localspec reads it (`GGUFHeader.get`); a wrong one is a one-line error,
# never a traceback further down (a number where a string belongs, an array where an id belongs).
KEY_TYPES: dict[str, str] = {
    "general.architecture": "str",
    "general.file_type": "int",
    "general.alignment": "int",
    "tokenizer.ggml.model": "str",
    "tokenizer.ggml.pre": "str",
    "tokenizer.chat_template": "str",
    "tokenizer.ggml.tokens": "strings",
    "tokenizer.ggml.merges": "strings",
    "tokenizer.ggml.token_type": "ints",
    "tokenizer.ggml.bos_token_id": "int",
    "tokenizer.ggml.eos_token_id": "int",
    "tokenizer.ggml.eot_token_id": "int",
    "tokenizer.ggml.padding_token_id": "int",
    "tokenizer.ggml.fim_pre_token_id": "int",
    "tokenizer.ggml.fim_suf_token_id": "int",
    "tokenizer.ggml.fim_mid_token_id": "int",
    "tokenizer.ggml.add_bos_token": "bool",
    "tokenizer.ggml.add_eos_token": "bool",
}
_WANTED = {
    "str": "a string",
    "int": "an integer",
    "bool": "true or false",
    "strings": "an array of strings",
    "ints": "an array of integers",
    "count": "an integer, or one per layer",
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _has_type(value: object, kind: str) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "int":
        return _is_int(value)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "strings":
        return isinstance(value, StringArray)
    if kind == "ints":
        return isinstance(value, np.ndarray) and value.dtype.kind in "iu"
    raise AssertionError(kind)


def _describe(value: object) -> str:
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a float ({value:g})"
    if isinstance(value, str):
        return f"a string ({value[:40]!r}{'…' if len(value) > 40 else ''})"
    if isinstance(value, StringArray):
        return f"an array of {len(value)} strings"
    if isinstance(value, np.ndarray):
        return f"an array of {len(value)} {value.dtype.name} values"
    if isinstance(value, SkippedArray):
        return f"an array of {value.count} {value.item}s"
    return type(value).__name__


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # relative to the start of the data section
    n_bytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type{self.type_id}"

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class HParams:
    """What the memory estimate and llama.cpp's loader rely on, type- and range-checked (`GGUFHeader.hparams`)."""

    n_layer: int
    n_embd: int
    n_head: tuple[int, ...]  # per layer
    n_head_kv: tuple[int, ...]  # per layer; 0 = a layer without attention
    key_length: int  # per head
    value_length: int
    n_ctx_train: int
    n_vocab: int


# Architectures whose memory keeps a recurrent state (llama.cpp's llm_arch_is_recurrent / llm_arch_is_hybrid), and
# those of them whose state llama.cpp can roll back through per-token snapshots (llm_arch_supports_rs_rollback;
# `llama_context_params.n_rs_seq`): src/llama-arch.cpp of llama-cpp-python 0.3.36. Speculation rewinds rejected
# tokens, so it needs the last kind; the others decode plainly.
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID_ARCHS = frozenset({"jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
                          "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
                          "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01"})
ROLLBACK_ARCHS = frozenset({"kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h",
                            "nemotron_h_moe", "lfm2", "lfm2moe", "bailingmoe3"})
# Gated DeltaNet hybrids: a full-attention block every `full_attention_interval` (llama.cpp's default 4) unless
# `attention.recurrent_layers` lists them (src/models/qwen35.cpp, qwen3next.cpp).
_DELTANET_ARCHS = frozenset({"qwen3next", "qwen35", "qwen35moe"})


def _listed_or_every_interval(listed: Any, interval: int, n: int) -> tuple[int, ...]:
    """A hybrid's recurrent trunk layers: those `attention.recurrent_layers` marks, else all but every
    `interval`-th (a Gated DeltaNet hybrid's `full_attention_interval`)."""
    if isinstance(listed, np.ndarray) and len(listed) >= n:
        return tuple(i for i in range(n) if bool(listed[i]))
    return tuple(i for i in range(n) if (i + 1) % interval)


@dataclass(frozen=True)
class Recurrence:
    """A model whose memory holds a recurrent state beside (hybrid) or instead of (recurrent) a KV cache."""

    kind: str  # "recurrent" or "hybrid"
    layers: tuple[int, ...]  # the trunk layers with a recurrent state (the others attend)
    rolls_back: bool  # llama.cpp can roll the state back a few tokens (what speculation needs)
    state_bytes: int  # one sequence's state (convolution + SSM, F32), 0 when the header does not say


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int
    file_size: int
    header_bytes: int = field(repr=False)
    value_types: dict[str, int] = field(default_factory=dict, repr=False)  # each key's GGUF value type (GGUFValueType)

    # -- generic access ------------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key`; a key localspec knows (`KEY_TYPES`) must have its type or GGUFError names it."""
        value = self.metadata.get(key)
        if value is None:
            return default
        kind = KEY_TYPES.get(key)
        if kind is not None and not _has_type(value, kind):
            raise self.error(f"{key} is {_describe(value)}, expected {_WANTED[kind]}")
        return value

    def error(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} (corrupt file?)")

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def arch(self) -> str:
        return self.get("general.architecture", "?")

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{suffix}", default)

    # -- weights ---------------------------------------------------------------------------------------------

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data llama.cpp will hold for the weights."""
        return sum(t.n_bytes for t in self.tensors)

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.tensor_bytes / self.n_params if self.n_params else 0.0

    @property
    def main_weight_type(self) -> str:
        """The type holding most bytes of the block matrices (the embedding table is often kept at 8 bits)."""
        by_type: dict[str, int] = {}
        for t in self.tensors:
            if len(t.shape) >= 2 and t.name.startswith("blk."):
                by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
        return max(by_type, key=by_type.__getitem__) if by_type else "?"

    @property
    def file_type(self) -> str:
        """`general.file_type` by name (Q4_K_M, Q8_0...), else the main weight type."""
        ftype = self.get("general.file_type")
        if ftype is not None:
            try:
                return LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
            except ValueError:
                pass
        return self.main_weight_type

    # -- tokenizer -------------------------------------------------------------------------------------------

    @property
    def tokens(self) -> StringArray:
        return self.get("tokenizer.ggml.tokens") or StringArray()

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    # -- recurrent state and MTP heads ------------------------------------------------------------------------

    @property
    def nextn_layers(self) -> int:
        """MTP (NextN) blocks appended after the trunk (`nextn_predict_layers`): a head that drafts for the model."""
        value = self.arch_get("nextn_predict_layers", 0)
        return value if _is_int(value) and 0 <= value <= self.hparams.n_layer else 0

    @property
    def trunk_layers(self) -> int:
        """The blocks a decode runs (the MTP blocks only run in an MTP context)."""
        return self.hparams.n_layer - self.nextn_layers

    @cached_property
    def recurrence(self) -> Recurrence | None:
        """The recurrent state's facts, None for an attention-only model."""
        arch = self.arch
        if arch not in RECURRENT_ARCHS and arch not in HYBRID_ARCHS:
            return None
        n = self.trunk_layers

        def count(suffix: str) -> int:
            value = self.arch_get(suffix, 0)
            return value if _is_int(value) and 0 <= value <= MAX_EMBD * 64 else 0

        listed = self.arch_get("attention.recurrent_layers")
        if arch in RECURRENT_ARCHS:
            layers = tuple(range(n))
        elif arch in _DELTANET_ARCHS or (isinstance(listed, np.ndarray) and len(listed) >= n):
            layers = _listed_or_every_interval(listed, count("full_attention_interval") or 4, n)
        else:  # other hybrids: the layers without KV heads hold the state
            layers = tuple(i for i in range(n) if self.hparams.n_head_kv[i] == 0)
        conv, inner, state, groups = (count(f"ssm.{k}") for k in ("conv_kernel", "inner_size", "state_size",
                                                                     "group_count"))
        per_layer = (max(conv - 1, 0) * (inner + 2 * groups * state) + state * inner) * 4  # n_embd_r + n_embd_s
        return Recurrence("recurrent" if arch in RECURRENT_ARCHS else "hybrid", layers, arch in ROLLBACK_ARCHS,
                          per_layer * len(layers))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The trunk layers with a KV cache."""
        rec = self.recurrence
        skip = set(rec.layers) if rec is not None else set()
        return tuple(i for i in range(self.trunk_layers) if i not in skip and self.hparams.n_head_kv[i] > 0)

    # -- what llama.cpp will rely on -------------------------------------------------------------------------

    @cached_property
    def hparams(self) -> HParams:
        """Every check llama.cpp's loader would answer with an abort (GGML_ASSERT) or a division by zero
        instead of a failed load, plus the types of every key localspec reads. Run before any model is loaded:
        a header that passes here reaches llama.cpp with its hyperparameters in range."""
        for key in KEY_TYPES:
            self.get(key)
        return _check_hparams(self)


def _check_hparams(h: GGUFHeader) -> HParams:
    if h.arch == "?":
        raise h.error("general.architecture is missing (not a model file?)")

    def count(suffix: str, lo: int, hi: int, default: int | None = None, why: str = "") -> int:
        key = f"{h.arch}.{suffix}"
        value = h.metadata.get(key)
        if value is None:
            if default is None:
                raise h.error(f"{key} is missing")
            return default
        if not _is_int(value):
            raise h.error(f"{key} is {_describe(value)}, expected {_WANTED['int']}")
        if not lo <= value <= hi:
            raise h.error(f"{key} = {value} is out of range {lo}..{hi}{why}")
        return value

    def per_layer(suffix: str, lo: int, hi: int, n_layer: int, default: tuple[int, ...]) -> tuple[int, ...]:
        key = f"{h.arch}.{suffix}"
        value = h.metadata.get(key)
        if value is None:
            return default
        if _is_int(value):
            values = (value,) * n_layer
        elif isinstance(value, np.ndarray) and value.dtype.kind in "iu":
            if len(value) != n_layer:
                raise h.error(f"{key} has {len(value)} values for {n_layer} layers")
            values = tuple(int(v) for v in value.tolist())
        else:
            raise h.error(f"{key} is {_describe(value)}, expected {_WANTED['count']}")
        bad = next((v for v in values if not lo <= v <= hi), None)
        if bad is not None:
            raise h.error(f"{key} = {bad} is out of range {lo}..{hi}")
        return values

    n_layer = count("block_count", 1, LLAMA_MAX_LAYERS, why=" (llama.cpp's layer limit)")
    n_embd = count("embedding_length", 1, MAX_EMBD)
    n_ctx_train = count("context_length", 1, MAX_CTX)
    n_head = per_layer("attention.head_count", 0, MAX_HEADS, n_layer, (0,) * n_layer)
    n_head_kv = per_layer("attention.head_count_kv", 0, MAX_HEADS, n_layer, n_head)
    for il, (heads, kv) in enumerate(zip(n_head, n_head_kv, strict=True)):
        # Query heads share KV heads in equal groups; ggml asserts the division when it builds the graph.
        if kv > heads or (kv and heads % kv):
            raise h.error(f"layer {il}: {heads} attention heads cannot share {kv} KV heads in equal groups")
    head_dim = n_embd // n_head[0] if n_head[0] else 0  # llama.cpp's default, from layer 0
    key_length = count("attention.key_length", 1, MAX_HEAD_DIM, default=head_dim)
    value_length = count("attention.value_length", 1, MAX_HEAD_DIM, default=head_dim)

    n_expert = count("expert_count", 0, LLAMA_MAX_EXPERTS, default=0, why=" (llama.cpp's expert limit)")
    used = max(per_layer("expert_used_count", 0, LLAMA_MAX_EXPERTS, n_layer, (0,)), default=0)
    groups = count("expert_group_count", 0, LLAMA_MAX_EXPERTS, default=0)
    groups_used = count("expert_group_used_count", 0, LLAMA_MAX_EXPERTS, default=0)
    if n_expert == 0 and (used or groups):
        raise h.error(f"{h.arch}.expert_used_count/expert_group_count set for a model without experts")
    if n_expert and not (0 < used <= n_expert):
        raise h.error(f"{h.arch}.expert_used_count = {used} for {n_expert} experts")
    if n_expert and (groups >= n_expert or (groups > 1 and (n_expert % groups or not 0 < groups_used < groups))):
        raise h.error(f"{h.arch}: {n_expert} experts cannot form {groups} groups with {groups_used} used")
    nextn = count("nextn_predict_layers", 0, n_layer, default=0)
    if h.arch in _DELTANET_ARCHS:
        # A Gated DeltaNet hybrid with no attention layer builds a graph without the KV inputs, and llama.cpp
        # aborts on its first decode (GGML_ASSERT(buffer) in set_inputs: docs/upstream.md).
        trunk, listed = n_layer - nextn, h.metadata.get(f"{h.arch}.attention.recurrent_layers")
        interval = count("full_attention_interval", 1, LLAMA_MAX_LAYERS, default=4)
        if len(_listed_or_every_interval(listed, interval, trunk)) == trunk:
            raise h.error(f"none of its {trunk} layers attends ({h.arch}.full_attention_interval = {interval}): "
                          "llama.cpp aborts on such a hybrid's first decode")
    scaling = h.metadata.get(f"{h.arch}.rope.scaling.type")
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        raise h.error(f"{h.arch}.rope.scaling.type is {_describe(scaling)}, expected one of "
                      + ", ".join(ROPE_SCALING_TYPES))

    n_vocab = len(h.tokens)
    if not 1 <= n_vocab <= MAX_VOCAB:
        raise h.error(f"tokenizer.ggml.tokens holds {n_vocab} tokens, expected 1..{MAX_VOCAB}")
    count("vocab_size", 1, MAX_VOCAB, default=n_vocab)
    duplicate = h.tokens.first_duplicate()
    if duplicate is not None:
        first, second = duplicate
        raise h.error(f"tokens {first} and {second} are both {h.tokens[second]!r} (llama.cpp aborts on that)")
    return HParams(n_layer, n_embd, n_head, n_head_kv, key_length, value_length, n_ctx_train, n_vocab)


class _Cursor:
    """Sequential reads over a buffered file, refusing to go past the header limit or the end of the file.

    Every read or skip is checked against both before a byte is allocated, so a length field cannot make the
    reader reserve memory the file does not back."""

    def __init__(self, fh: Any, path: Path, file_size: int, limit: int) -> None:
        self.fh = fh
        self.path = path
        self.file_size = file_size
        self.limit = limit
        self.pos = 0
        self.walked = {"strings": 0, "nested arrays": 0}

    def walk(self, what: str, n: int, key: str) -> None:
        """Charge `n` items read one by one to the header's budget before reading them."""
        self.walked[what] += n
        most = MAX_WALKED_STRINGS if what == "strings" else MAX_NESTED_ARRAYS
        if self.walked[what] > most:
            raise GGUFError(f"{self.path}: metadata {key!r}: the header holds more than {most} {what} "
                            "(corrupt file?)")

    def room(self, n: int) -> None:
        if n < 0 or self.pos + n > self.limit:
            raise GGUFError(f"{self.path}: GGUF header larger than {self.limit >> 20} MiB (corrupt file?)")
        if self.pos + n > self.file_size:
            raise GGUFError(f"{self.path}: truncated GGUF file (header ends at byte {self.file_size})")

    def read(self, n: int) -> bytes:
        self.room(n)
        data = self.fh.read(n)
        if len(data) != n:
            raise GGUFError(f"{self.path}: truncated GGUF file (header ends at byte {self.pos + len(data)})")
        self.pos += n
        return data

    def read_array(self, dtype: np.dtype, count: int) -> np.ndarray:
        self.room(count * dtype.itemsize)
        out = np.empty(count, dtype=dtype)
        got = self.fh.readinto(memoryview(out).cast("B")) if count else 0
        if got != out.nbytes:
            raise GGUFError(f"{self.path}: truncated GGUF file (header ends at byte {self.pos + got})")
        self.pos += out.nbytes
        return out

    def skip(self, n: int) -> None:
        self.room(n)
        self.fh.seek(n, os.SEEK_CUR)
        self.pos += n

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self.read(size))[0]

    def string_length(self, what: str) -> int:
        n = self.unpack("Q")
        if n > MAX_STRING_BYTES:
            raise GGUFError(f"{self.path}: {what}: string of {n} bytes (corrupt file?)")
        return n

    def string(self, what: str) -> str:
        # Some vocabularies carry byte tokens that are not valid UTF-8; surrogates keep them comparable.
        return self.read(self.string_length(what)).decode("utf-8", errors="surrogateescape")


def _value(cur: _Cursor, vtype: int, key: str) -> Any:
    try:
        kind = GGUFValueType(vtype)
    except ValueError:
        raise GGUFError(
            f"{cur.path}: metadata {key!r} has unknown value type {vtype} (corrupt file?)"
        ) from None
    if kind == GGUFValueType.STRING:
        return cur.string(key)
    if kind == GGUFValueType.ARRAY:
        return _array(cur, key, depth=1)
    return cur.unpack(_SCALARS[kind])


def _array(cur: _Cursor, key: str, depth: int) -> Any:
    """One array (item type, count, items). Kept compactly where something reads it, skipped otherwise."""
    if depth > MAX_NESTING:
        raise GGUFError(f"{cur.path}: metadata {key!r} nests arrays more than {MAX_NESTING} deep (corrupt file?)")
    item_type = cur.unpack("I")
    count = cur.unpack("Q")
    if count > MAX_ARRAY_LEN:
        raise GGUFError(f"{cur.path}: metadata {key!r} claims {count} items (corrupt file?)")
    if item_type == GGUFValueType.STRING:
        cur.walk("strings", count, key)
        if depth == 1 and key in KEPT_STRING_ARRAYS:
            return _string_array(cur, key, count)
        for _ in range(count):
            cur.skip(cur.string_length(key))
        return SkippedArray("string", count)
    if item_type in _SCALARS:
        # Numeric arrays (scores, token types, per-layer counts) stay numpy arrays: as compact as in the file.
        dtype = np.dtype("<" + _SCALARS[GGUFValueType(item_type)])
        if depth == 1:
            return cur.read_array(dtype, count)
        cur.skip(count * dtype.itemsize)
        return SkippedArray(dtype.name, count)
    if item_type == GGUFValueType.ARRAY:
        cur.walk("nested arrays", count, key)
        for _ in range(count):
            _array(cur, key, depth + 1)
        return SkippedArray("array", count)
    raise GGUFError(f"{cur.path}: metadata {key!r} has unknown array item type {item_type} (corrupt file?)")


_READ_AHEAD = 1 << 16  # a string array is parsed from memory in reads of this size


def _string_array(cur: _Cursor, key: str, count: int) -> StringArray:
    """The items parsed out of reads of `_READ_AHEAD` bytes: two reads per item made a 262k-token vocabulary
    cost 0.2 s a file. The cursor's checks still come first (never past the header limit or the file's end,
    the same errors at the same item); what was read past the array is given back."""
    cur.room(8 * count)  # each item has at least its 8-byte length: the file must back the offsets array
    ends = np.empty(count, dtype=np.int64)
    blob = bytearray()
    buf, at, end = b"", 0, 0
    length_at = struct.Struct("<Q").unpack_from

    def refill(n: int) -> tuple[bytes, int, int]:  # the unparsed bytes, then at least n more of the file
        short = n - (end - at)
        bound = min(cur.limit, cur.file_size) - cur.pos
        if short > bound:
            cur.room(short)  # raises the cursor's own error: past the header limit or the end of the file
        data = buf[at:end] + cur.read(max(short, min(_READ_AHEAD, bound)))
        return data, 0, len(data)

    for i in range(count):
        if end - at < 8:
            buf, at, end = refill(8)
        n = length_at(buf, at)[0]
        if n > MAX_STRING_BYTES:
            raise GGUFError(f"{cur.path}: {key}: string of {n} bytes (corrupt file?)")
        at += 8
        if end - at < n:
            buf, at, end = refill(n)
        blob += buf[at : at + n]
        at += n
        ends[i] = len(blob)
    if at < end:
        cur.fh.seek(at - end, os.SEEK_CUR)
        cur.pos -= end - at
    return StringArray(blob, ends)


def _tensor_bytes(path: Path, name: str, shape: tuple[int, ...], type_id: int) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise GGUFError(f"{path}: tensor {name!r} has unknown type {type_id} (newer than gguf-py?)") from None
    n = math.prod(shape)
    if shape and shape[0] % block:
        raise GGUFError(
            f"{path}: tensor {name!r} row of {shape[0]} is not a multiple of its block size {block}"
        )
    return n // block * type_size


def _read(path: Path, limit: int) -> GGUFHeader:
    try:
        st = path.stat()
        kind = not_a_file(st.st_mode)
        if kind is not None:  # opening a FIFO would wait forever for a writer
            raise GGUFError(f"{path}: is {kind}, not a GGUF file")
        file_size = st.st_size
        fh = path.open("rb", buffering=1 << 20)
    except FileNotFoundError:
        raise GGUFError(f"{path}: file not found") from None
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read: {exc.strerror}") from None
    with fh:
        cur = _Cursor(fh, path, file_size, limit)
        if file_size < 24:
            raise GGUFError(f"{path}: not a GGUF file ({file_size} bytes)")
        magic = struct.unpack("<I", cur.read(4))[0]
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (bad magic)")
        version = cur.unpack("I")
        if version not in (2, 3):
            if version & 0xFFFF == 0:
                raise GGUFError(f"{path}: big-endian GGUF files are not supported")
            raise GGUFError(f"{path}: unsupported GGUF version {version}")
        n_tensors = cur.unpack("Q")
        n_kv = cur.unpack("Q")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KEYS:
            raise GGUFError(f"{path}: header claims {n_tensors} tensors and {n_kv} keys (corrupt file?)")
        metadata: dict[str, Any] = {}
        value_types: dict[str, int] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            value_types[key] = cur.unpack("I")
            metadata[key] = _value(cur, value_types[key], key)
        tensors = []
        for _ in range(n_tensors):
            name = cur.string("tensor name")
            n_dims = cur.unpack("I")
            if n_dims > MAX_DIMS:
                raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions (corrupt file?)")
            shape = tuple(cur.unpack("Q") for _ in range(n_dims))
            type_id = cur.unpack("I")
            offset = cur.unpack("Q")
            tensors.append(
                TensorInfo(name, shape, type_id, offset, _tensor_bytes(path, name, shape, type_id))
            )
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not _is_int(alignment) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{path}: general.alignment = {alignment!r} is not a power of two")
        header_bytes = cur.pos
    data_offset = -(-header_bytes // alignment) * alignment
    # The data section must hold every tensor: checked from the sizes alone, without reading the data.
    data_end = max((t.offset + t.n_bytes for t in tensors), default=0)
    if tensors and data_offset + data_end > file_size:
        raise GGUFError(
            f"{path}: truncated GGUF file ({file_size} bytes, tensor data needs {data_offset + data_end})"
        )
    return GGUFHeader(
        path=path,
        version=version,
        metadata=metadata,
        tensors=tuple(tensors),
        data_offset=data_offset,
        file_size=file_size,
        header_bytes=header_bytes,
        value_types=value_types,
    )


@lru_cache(maxsize=8)
def _cached(path: Path, size: int, mtime_ns: int, limit: int) -> GGUFHeader:
    return _read(path, limit)


def read_header(path: str | os.PathLike[str], *, limit: int = MAX_HEADER_BYTES) -> GGUFHeader:
    """The header of one GGUF file (cached per path, size and mtime, so check + preflight read it once)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return _read(p, limit)  # raises the one-line error
    return _cached(p.resolve(), st.st_size, st.st_mtime_ns, limit)
