"""Minimal reproduction for llama.cpp: rolling back a hybrid/recurrent sequence through its recurrent-state
snapshots (`llama_context_params.n_rs_seq`), and where `llama_memory_seq_rm` reports success but is wrong.

    python bench/repro_recurrent_rollback.py [--model PATH] [--rs 6] [--threads 1]

It needs llama-cpp-python (0.3.36 vendors the llama.cpp tree where this was found), numpy and gguf. Without
`--model` it writes localspec's tiny Qwen3.5-shaped GGUF (`bench/synthetic.py`, HYBRID_TINY: 2 Gated DeltaNet + 2
full-attention blocks, random weights) into a temporary folder; any `qwen35`/`qwen35moe` GGUF does. On the CPU it:

1. decodes a reference: 20 prompt tokens in one batch, then one token a decode, in a context without snapshots;
2. for each j: in a fresh context with `n_rs_seq = --rs`, decodes the 20 tokens, then 6 more in ONE batch, rolls
   back j of them (`llama_memory_seq_rm(mem, 0, 26 - j, -1)`) and decodes the next tokens: their logits must equal
   the reference's bit for bit;
3. the same after three ONE-token decodes, rolling back 1 or 2 of them;
4. two rollbacks in a row without a decode between (the second must fail), and one deeper than `n_rs_seq`;
5. the checkpoint path: `llama_state_seq_get_data_ext(..., LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY | ON_DEVICE)` after a
   token, three one-token decodes, `llama_state_seq_set_data_ext` back, `seq_rm` of the attention cells past it.

Found (llama-cpp-python 0.3.36): rolling back j tokens is right when j is less than the number of the sequence's
tokens in its last decode (and at most n_rs_seq); when j equals it or exceeds it (all 6 of the batch; 1 after a
one-token decode) `seq_rm` still returns true, and the next decode reads a snapshot slot the last decode never
wrote: wrong logits, silently. Exit status 1 when a case that reports success is wrong, 0 otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import llama_cpp as L  # noqa: I001  -- before numpy (a CUDA build of llama.cpp can crash the other way round)
import numpy as np

PROMPT, BATCH = 20, 6
# llama.cpp keeps the log callback's address for the process: a callback freed with its Runner would leave it
# pointing at freed memory, and the next model load in the process (a test run's) would crash there.
_QUIET_LOG = L.llama_log_callback(lambda level, text, data: None)


class Runner:
    def __init__(self, path: Path, threads: int, quiet: bool = True) -> None:
        """`quiet`: silence llama.cpp's log (off: whatever log the process set stays, as in a test run)."""
        L.llama_backend_init()
        if quiet:
            L.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = False  # repacked CPU weights score a batch differently from one token
        self.model = L.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise SystemExit(f"{path}: llama.cpp could not load it")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.threads = threads
        self.batch = L.llama_batch_init(64, 0, 1)

    def context(self, n_rs_seq: int) -> L.llama_context_p:
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 256, 64, 64
        params.n_threads = params.n_threads_batch = self.threads
        params.n_rs_seq = n_rs_seq
        ctx = L.llama_init_from_model(self.model, params)
        assert ctx, "context"
        return ctx

    def decode(self, ctx: L.llama_context_p, tokens: list[int], pos: int) -> np.ndarray:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos + i, 1, 1
            b.seq_id[i][0] = 0
        rc = L.llama_decode(ctx, b)
        assert rc == 0, f"llama_decode: {rc}"
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(tokens), self.n_vocab)).copy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a rollback-capable hybrid GGUF (default: write a tiny one)")
    p.add_argument("--rs", type=int, default=BATCH, help="n_rs_seq (snapshots per sequence)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from synthetic import hybrid_model_or_tiny

        path = hybrid_model_or_tiny(a.model, tmp)
        results = run(Runner(path, a.threads), a.rs)
    silent = sum(removed and not right for _, removed, right in results)
    print(f"{silent} case(s) where seq_rm reported success and the state was wrong")
    return 1 if silent else 0


def run(r: Runner, n_rs: int) -> list[tuple[str, bool, bool]]:
    """Print one line per case; returns (case, what seq_rm said, whether the next logits equal the reference's)."""
    tokens = np.random.default_rng(0).integers(100, min(r.n_vocab, 20_000), size=40).tolist()
    ref_ctx = r.context(0)
    ref = np.concatenate([r.decode(ref_ctx, tokens[:PROMPT], 0),
                          *[r.decode(ref_ctx, [t], PROMPT + i) for i, t in enumerate(tokens[PROMPT:PROMPT + 12])]])
    L.llama_free(ref_ctx)
    results: list[tuple[str, bool, bool]] = []

    def check(what: str, ctx: L.llama_context_p, removed_ok: bool, keep: int) -> None:
        out = r.decode(ctx, tokens[keep:keep + 2], keep)
        right = np.array_equal(out, ref[keep:keep + 2])
        results.append((what, bool(removed_ok), right))
        verdict = "right" if right else ("WRONG (seq_rm said true)" if removed_ok else "wrong, but seq_rm said false")
        print(f"{what}: seq_rm {removed_ok} -> next logits {verdict}")
        L.llama_free(ctx)

    for j in range(BATCH + 1):
        ctx = r.context(n_rs)
        r.decode(ctx, tokens[:PROMPT], 0)
        r.decode(ctx, tokens[PROMPT:PROMPT + BATCH], PROMPT)
        keep = PROMPT + BATCH - j
        check(f"{BATCH} in one decode, roll back {j}", ctx,
              L.llama_memory_seq_rm(L.llama_get_memory(ctx), 0, keep, -1), keep)
    for j in (1, 2):
        ctx = r.context(n_rs)
        r.decode(ctx, tokens[:PROMPT], 0)
        for i in range(3):
            r.decode(ctx, [tokens[PROMPT + i]], PROMPT + i)
        keep = PROMPT + 3 - j
        check(f"3 one-token decodes, roll back {j}", ctx,
              L.llama_memory_seq_rm(L.llama_get_memory(ctx), 0, keep, -1), keep)
    ctx = r.context(n_rs)
    r.decode(ctx, tokens[:PROMPT], 0)
    r.decode(ctx, tokens[PROMPT:PROMPT + BATCH], PROMPT)
    mem = L.llama_get_memory(ctx)
    first = L.llama_memory_seq_rm(mem, 0, PROMPT + BATCH - 2, -1)
    second = L.llama_memory_seq_rm(mem, 0, PROMPT + BATCH - 3, -1)
    print(f"roll back 2, then 1 more before any decode: {first}, {second} (a pending rollback is single-use)")
    results.append(("a second rollback before a decode", bool(second), False))
    L.llama_free(ctx)
    ctx = r.context(2)
    r.decode(ctx, tokens[:PROMPT], 0)
    r.decode(ctx, tokens[PROMPT:PROMPT + BATCH], PROMPT)
    deeper = L.llama_memory_seq_rm(L.llama_get_memory(ctx), 0, PROMPT + BATCH - 3, -1)
    print(f"roll back 3 with n_rs_seq 2: {deeper}")
    results.append(("a rollback deeper than n_rs_seq", bool(deeper), False))
    L.llama_free(ctx)
    flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY | 2  # | LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
    ctx = r.context(n_rs)
    r.decode(ctx, tokens[:PROMPT + 1], 0)
    size = L.llama_state_seq_get_size_ext(ctx, 0, flags)
    buf = (ctypes.c_uint8 * size)()
    saved = L.llama_state_seq_get_data_ext(ctx, buf, size, 0, flags)
    for i in range(1, 4):
        r.decode(ctx, [tokens[PROMPT + i]], PROMPT + i)
    loaded = L.llama_state_seq_set_data_ext(ctx, buf, size, 0, flags)
    removed = L.llama_memory_seq_rm(L.llama_get_memory(ctx), 0, PROMPT + 1, -1)
    check(f"checkpoint after a token ({saved} B saved, {loaded} B loaded), 3 one-token decodes, restore", ctx,
          bool(saved and loaded and removed), PROMPT + 1)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
