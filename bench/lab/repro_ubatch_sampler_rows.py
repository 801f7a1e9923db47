"""Minimal reproduction for llama.cpp: backend (device) sampler rows of one `llama_decode` that llama.cpp splits
into several ubatches come back holding another row's candidates.

    python bench/lab/repro_ubatch_sampler_rows.py [--order 1,0] [--rows 2] [--gpu-layers 0] [--top-k 8]

Self-contained on purpose (it is meant for an upstream report): it needs only llama-cpp-python (0.3.36 vendors
the llama.cpp tree where this was found), numpy and gguf, and writes its own tiny random-weight GGUF (a 2-block
Llama, 64-token vocabulary) into a temporary folder. It then:

1. makes a context of 2+ sequences with one KV stream per sequence (`kv_unified = false`), `n_outputs_max_per_seq`
   room for several rows, and a backend top-k sampler chain (`llama_sampler_init_top_k`) on every sequence;
2. decodes a short prompt into each sequence, one `llama_decode` per sequence;
3. decodes ONE batch holding `--rows` new tokens of every sequence, in the sequence order `--order`, an output on
   every token, and reads each row's candidates (`llama_get_sampled_candidates_ith`,
   `llama_get_sampled_logits_ith`);
4. compares every row with the reference: a second context with no sampler decodes each sequence alone (its
   whole history, full logits) and takes the top k of that row's logits on the host.

With the order 0,1 llama.cpp makes one ubatch and every row is right. With 1,0 its `split_equal` (non-unified
KV: sequences of one ubatch must have consecutive ascending ids) makes two ubatches, and a row comes back wrong:
ids and logits consistent with each other (another row's top k), so nothing downstream notices. The same
happens with `--separate` (two decodes, seq 1's then seq 0's): what matters is two graphs of the same size in a
row with different chains active (docs/upstream.md has the mechanism). Exit status 1 when any row is wrong, 0
when all are right.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import llama_cpp  # noqa: I001  -- before numpy (a CUDA build of llama.cpp can crash the other way round)
import numpy as np

N_VOCAB = 64
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_BLOCKS = 2


def write_tiny_model(path: Path, seed: int = 0, bos: int = 1) -> Path:
    """A random-weight Llama GGUF small enough to load in milliseconds: F32, N_VOCAB tokens ("gpt2" BPE, no
    merges needed for raw token ids). `bos` picks the BOS id (the last id, N_VOCAB - 1, is a GPT-2-style vocab)."""
    import gguf  # (imports numpy: only here, after llama_cpp)

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(N_BLOCKS)
    w.add_context_length(512)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    specials = {bos, 0}
    w.add_token_list([f"<s{i}>" if i in specials else f"t{i}" for i in range(N_VOCAB)])
    w.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(N_VOCAB)])
    w.add_token_merges(["t 1"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    kv = N_HEAD_KV * (N_EMBD // N_HEAD)
    w.add_tensor("token_embd.weight", mat(N_VOCAB, N_EMBD, 1.0))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output.weight", mat(N_VOCAB, N_EMBD, 0.5))
    for b in range(N_BLOCKS):
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{b}.attn_q.weight", mat(N_EMBD, N_EMBD, 0.2))
        w.add_tensor(f"blk.{b}.attn_k.weight", mat(kv, N_EMBD, 0.2))
        w.add_tensor(f"blk.{b}.attn_v.weight", mat(kv, N_EMBD, 0.2))
        w.add_tensor(f"blk.{b}.attn_output.weight", mat(N_EMBD, N_EMBD, 0.2))
        w.add_tensor(f"blk.{b}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{b}.ffn_gate.weight", mat(N_FF, N_EMBD, 0.2))
        w.add_tensor(f"blk.{b}.ffn_up.weight", mat(N_FF, N_EMBD, 0.2))
        w.add_tensor(f"blk.{b}.ffn_down.weight", mat(N_EMBD, N_FF, 0.2))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_QUIET = llama_cpp.llama_log_callback(lambda level, text, user_data: None)  # kept alive: llama.cpp holds it


@dataclass(frozen=True)
class Row:
    seq: int
    index: int  # the row's place among its sequence's new tokens
    batch_index: int
    right: bool
    got: list[int]  # the device's candidate ids, sorted
    expected: list[int]  # the reference top k, sorted


def make_context(model: ctypes.c_void_p, n_seq: int, n_batch: int, max_outputs: int) -> ctypes.c_void_p:
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = 256 * n_seq
    params.n_batch = params.n_ubatch = n_batch
    params.n_seq_max = n_seq
    params.kv_unified = False
    params.n_threads = params.n_threads_batch = 1
    params.n_outputs_max_per_seq = max_outputs
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit("llama.cpp could not create a context")
    return ctx


def decode_entries(ctx: ctypes.c_void_p, entries: list[tuple[int, int, int, bool]]) -> None:
    """One llama_decode of (token, position, sequence, output) entries, in this order."""
    batch = llama_cpp.llama_batch_init(len(entries), 0, 1)
    try:
        for i, (token, pos, seq, out) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, out
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise SystemExit(f"llama_decode failed with code {rc}")
    finally:
        llama_cpp.llama_batch_free(batch)


def run(model_path: Path, order: list[int], rows: int, top_k: int = 8, gpu_layers: int = 0,
        prompt_len: int = 5, n_batch: int = 64, separate: bool = False, replan: bool = False) -> list[Row]:
    """Every row of one multi-sequence decode (sequences in `order`), checked against the reference. With
    `separate`, each sequence's rows go in a decode of their own instead, one after another in `order`; with
    `replan` too, llama.cpp is made to reserve its graphs again between those decodes."""
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = gpu_layers
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise SystemExit(f"llama.cpp could not load {model_path}")
    n_seq = max(order) + 1
    rng = np.random.default_rng(1)
    history = {seq: rng.integers(2, N_VOCAB, size=prompt_len + rows).tolist() for seq in order}
    ctx = make_context(model, n_seq, n_batch, max(rows, 1))
    chains = []
    try:
        for seq in range(n_seq):
            chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(top_k))
            if not llama_cpp.llama_set_sampler(ctx, seq, chain):
                raise SystemExit("this build cannot run a top-k sampler on the backend")
            chains.append(chain)
        for seq in order:  # the prompts: one decode per sequence
            tokens = history[seq][:prompt_len]
            decode_entries(ctx, [(t, p, seq, p == prompt_len - 1) for p, t in enumerate(tokens)])
        got = {}
        where = []
        for b, batch in enumerate([order] if not separate else [[seq] for seq in order]):
            if replan and b:  # a neutral call after which llama.cpp reserves (plans) its graphs again
                llama_cpp.llama_set_adapter_cvec(ctx, None, 0, llama_cpp.llama_model_n_embd(model), -1, -1)
            entries, read = [], []
            for seq in batch:  # the batch under test: `rows` tokens of each sequence, every one an output
                for r in range(rows):
                    read.append((seq, r, len(entries)))
                    entries.append((history[seq][prompt_len + r], prompt_len + r, seq, True))
            decode_entries(ctx, entries)
            for seq, r, i in read:
                count = llama_cpp.llama_get_sampled_candidates_count_ith(ctx, i)
                ids = np.ctypeslib.as_array(llama_cpp.llama_get_sampled_candidates_ith(ctx, i), shape=(count,))
                got[seq, r] = sorted(ids.tolist())
            where += read
    finally:
        for seq in range(len(chains)):
            llama_cpp.llama_set_sampler(ctx, seq, None)
        for chain in chains:
            llama_cpp.llama_sampler_free(chain)
        llama_cpp.llama_free(ctx)

    reference = make_context(model, 1, n_batch, 0)  # no sampler: full logits; each sequence alone
    out = []
    try:
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        for seq in order:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(reference), True)
            tokens = history[seq]
            decode_entries(reference, [(t, p, 0, True) for p, t in enumerate(tokens)])
            for r in range(rows):
                i = prompt_len + r
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(reference, i), shape=(n_vocab,))
                expected = sorted(np.argsort(-logits, kind="stable")[:top_k].tolist())
                batch_index = next(b for s, q, b in where if s == seq and q == r)
                out.append(Row(seq, r, batch_index, got[seq, r] == expected, got[seq, r], expected))
    finally:
        llama_cpp.llama_free(reference)
        llama_cpp.llama_model_free(model)
    return out


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if len(set(values)) != len(values) or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected distinct sequence ids >= 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="repro_ubatch_sampler_rows.py", description=__doc__.splitlines()[0])
    p.add_argument("--order", type=_ints, default=[1, 0], help="sequence ids in batch order (default 1,0)")
    p.add_argument("--rows", type=int, default=2, help="new tokens (output rows) per sequence (default 2)")
    p.add_argument("--top-k", type=int, default=8, help="k of the backend top-k sampler (default 8)")
    p.add_argument("--gpu-layers", type=int, default=0, help="layers to offload (default 0: CPU)")
    p.add_argument("--model", type=Path, help="use this GGUF instead of writing the tiny one")
    p.add_argument("--separate", action="store_true",
                   help="one llama_decode per sequence, in --order, instead of one for all (fails the same way)")
    p.add_argument("--replan", action="store_true",
                   help="with --separate: make llama.cpp reserve its graphs again between the decodes (all right)")
    a = p.parse_args(argv)
    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model or write_tiny_model(Path(tmp) / "tiny.gguf")
        rows = run(path, a.order, a.rows, a.top_k, a.gpu_layers, separate=a.separate, replan=a.replan)
    print(f"llama-cpp-python {llama_cpp.__version__}; order {a.order}, {a.rows} row(s) per sequence, "
          f"top-k {a.top_k}, {'one decode per sequence' if a.separate else 'one decode'}"
          f"{', graphs reserved again between them' if a.separate and a.replan else ''}")
    for row in rows:
        verdict = "right" if row.right else f"WRONG: got {row.got}, expected {row.expected}"
        print(f"seq {row.seq} row {row.index} (batch index {row.batch_index}): {verdict}")
    wrong = sum(not r.right for r in rows)
    print(f"{wrong} of {len(rows)} rows wrong")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
