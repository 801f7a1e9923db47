"""A model's MTP (NextN) head in a context of its own: llama.cpp's LLAMA_CONTEXT_TYPE_MTP over the target's own
weights, fed a token and the target's hidden state before it (`hidden`), scoring the next token (drafters/mtp.py);
and an EAGLE-3 drafter's decoder, which is fed the same way, beside its encoder (drafters/eagle3.py)."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence

import llama_cpp  # noqa: I001  -- llama_cpp before numpy: on CUDA builds the other order can segfault (docs/gpu.md)
import numpy as np

from localspec.errors import DecodeError, ModelLoadError, UsageError
from localspec.llama import backend
from localspec.llama.hidden import llama_cpp_ext, mtp_unsupported
from localspec.llama.model import FLASH_ATTN, KV_TYPES, LlamaModel, load_seq_state, save_seq_state
from localspec.llama.samplers import DeviceSamplers, as_scores
from localspec.rounds.scores import DeviceDist, Scores

MtpEntry = tuple[int, int, int, np.ndarray, bool]  # (sequence, token, position, hidden state before it, scored)


class MtpHead:
    """A model's MTP (NextN) blocks in a context of their own: llama.cpp's LLAMA_CONTEXT_TYPE_MTP over the target's
    own weights (loaded with `load_mtp`). At position p it reads token x_p and the target's hidden state after
    x_{p-1} (`Scores.hidden`) and scores x_{p+1}; its own hidden state there stands in for the target's at the next
    step (chained drafts). Its memory is a plain KV cache of its blocks: it rewinds to any position."""

    def __init__(self, target: LlamaModel, *, n_ctx: int, n_batch: int = 512, kv_type: str = "f16",
                 n_threads: int = 0, n_seq: int = 1, flash_attn: str = "auto", device_top_k: int = 0) -> None:
        self.ctx = None
        self._batch = None
        self._samplers: DeviceSamplers | None = None
        why = mtp_unsupported()
        if why is not None:
            raise ModelLoadError(why)
        if not target.model or llama_cpp.llama_model_n_layer_nextn(target.model) <= 0:
            raise UsageError(f"{target.path.name} has no MTP layers (nextn_predict_layers): --drafter mtp needs a "
                             "model converted with them (an \"MTP\" GGUF)")
        cparams = llama_cpp.llama_context_default_params()
        cparams.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP  # (mtp_unsupported: declared, never a stand-in value)
        cparams.n_seq_max = n_seq
        cparams.kv_unified = False
        cparams.n_ctx = n_ctx * n_seq
        cparams.n_batch = cparams.n_ubatch = n_batch
        threads = n_threads or backend.default_threads()
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
        cparams.flash_attn_type = FLASH_ATTN[flash_attn]
        cparams.no_perf = True
        self.path = target.path
        self.ctx = llama_cpp.llama_init_from_model(target.model, cparams)
        if not self.ctx:
            raise ModelLoadError(f"{target.path.name}: llama.cpp could not create the MTP head's context (was the "
                                 "model loaded without its MTP layers?)")
        # Its own hidden rows, every entry's, by batch index: "masked" (scored entries' rows only) hands back the
        # batch's first rows instead of its scored ones, as the MTP graph takes them before it picks the outputs
        # (docs/upstream.md); at most n_batch rows each decode.
        llama_cpp_ext.llama_set_embeddings_nextn(self.ctx, True, False)
        self._batch = llama_cpp.llama_batch_ext_init(self.ctx)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = target.n_vocab
        self.n_embd = target.n_embd_out  # (the target's hidden rows it reads, and its own)
        self.n_batch = min(n_batch, int(llama_cpp.llama_n_batch(self.ctx)))
        self.n_ctx = min(n_ctx, int(llama_cpp.llama_n_ctx_seq(self.ctx)))
        self.n_seq = n_seq
        self.on_gpu = target.on_gpu
        self._pos = llama_cpp.llama_pos(0)
        self.decodes = 0
        # Device sampler chains (`use_sampler`): a scored row comes back as its top candidates (or its argmax), not
        # n_vocab logits to copy and rank on the host, a step of every draft. One sequence only: the head's later
        # steps carry just the sequences still drafting, and with chains on several sequences a decode that leaves
        # one without a row can hand rows back holding another row's candidates (llama.cpp's graph plan reuse,
        # docs/upstream.md; the target's workaround, covering calls, pads every chained sequence into every call).
        if device_top_k > 0 and n_seq == 1:
            self._samplers = DeviceSamplers(self.ctx, self.n_vocab, device_top_k, f"{target.path.name}'s MTP head")
        self.device_top_k = device_top_k if self._samplers is not None else 0

    def use_sampler(self, mode: str | DeviceDist | None, seq: int) -> bool:
        """What llama.cpp computes for sequence `seq`'s scored rows (`drafters.base.device_mode`: "greedy", "top_k"
        or None, full logits); True if a chain is on."""
        if self._samplers is None:
            return False
        if mode == self._samplers.modes.get(seq):
            return mode is not None
        return self._samplers.use(mode, seq)

    def decode(self, entries: Sequence[MtpEntry]) -> list[tuple[Scores, np.ndarray]]:
        """Decode the entries (each sequence's positions consecutive after its cells, in ascending sequence order)
        in n_batch chunks; per scored entry, in order: its scores (one row: full logits, or its sequence's device
        candidates, `use_sampler`) and its own hidden state (n_embd,)."""
        out: list[tuple[Scores, np.ndarray]] = []
        for first in range(0, len(entries), self.n_batch):
            out += self._decode_chunk(entries[first : first + self.n_batch])
        return out

    def _decode_chunk(self, entries: Sequence[MtpEntry]) -> list[tuple[Scores, np.ndarray]]:
        batch = self._batch
        llama_cpp.llama_batch_ext_clear(batch)
        rows = np.ascontiguousarray(np.stack([e[3] for e in entries]), dtype=np.float32)  # alive until processed
        row_bytes = 4 * self.n_embd
        base = rows.ctypes.data
        scored = []
        for i, (seq, token, pos, _, wanted) in enumerate(entries):
            idx = llama_cpp.llama_batch_ext_add_token(batch, seq, token)
            if idx < 0:
                raise DecodeError(f"{self.path.name}: the MTP head's batch refused token {token} (code {idx})")
            self._pos.value = pos
            llama_cpp.llama_batch_ext_set_pos(batch, idx, ctypes.byref(self._pos))
            embd = llama_cpp.llama_embd(ctypes.cast(base + i * row_bytes, ctypes.POINTER(ctypes.c_float)), 1,
                                        self.n_embd)
            llama_cpp.llama_batch_ext_set_embd_token(batch, idx, embd)
            if wanted:
                llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True)
                scored.append((idx, seq))
        rc = llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch)
        self.decodes += 1
        if rc != 0:
            raise DecodeError(f"{self.path.name}: the MTP head's decode failed with code {rc}"
                              + (" (no KV slot: the context is full)" if rc == 1 else ""))
        out = []
        for idx, seq in scored:
            if self._samplers is not None:
                row = as_scores(self._samplers.rows(seq, idx, 1))
                assert row is not None
            else:
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
                row = Scores(logits[None, :].copy())
            hidden = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn_ith(self.ctx, idx),
                                           shape=(self.n_embd,))
            out.append((row, hidden.copy()))
        return out

    def truncate(self, n_keep: int, seq: int = 0) -> None:
        if not llama_cpp.llama_memory_seq_rm(self.memory, seq, n_keep, -1):
            raise DecodeError(f"{self.path.name}: the MTP head's cells cannot be rewound to position {n_keep}")

    def clear(self, seq: int | None = None) -> None:
        if seq is None:
            llama_cpp.llama_memory_clear(self.memory, True)
        else:
            self.truncate(0, seq)

    def save_state(self, seq: int) -> bytearray:
        """Sequence `seq`'s cells as llama.cpp serialises them (the prompt cache keeps them beside the target's)."""
        return save_seq_state(self.ctx, seq, f"{self.path.name}'s MTP head's sequence {seq}")

    def load_state(self, data: bytearray, seq: int) -> bool:
        """Replace sequence `seq`'s cells with a `save_state` of this head; False (and the sequence empty) when
        llama.cpp refuses it."""
        ok = load_seq_state(self.ctx, data, seq)
        if not ok:
            self.clear(seq)
        return ok

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_ext_free(self._batch)
            self._batch = None
        if self._samplers is not None and self.ctx:
            self._samplers.close()
            self._samplers = None
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class Eagle3Head(MtpHead):
    """An EAGLE-3 drafter (src/models/eagle3.cpp) in the draft model's own context (loaded over the target:
    `LlamaModel(other=target)`, whose token embeddings and output head it reads). Its ENCODE pass (`encode`) fuses a
    position's target layer inputs into one row (`fc`); its one decoder block then reads, like an MTP head, the token
    at p and that row of p - 1 (or its own hidden state there, drafting on) and scores p + 1 over the target's whole
    vocabulary (a reduced draft vocabulary is mapped back by llama.cpp, -inf elsewhere). Its graph picks no output
    rows, so llama.cpp hands back the batch's first rows: every entry is an output here and the scored ones are
    read by batch index."""

    def __init__(self, draft: LlamaModel, *, n_seq: int) -> None:
        self.ctx = None
        self._batch = None
        self._samplers = None  # (full rows: q is the drafter's whole distribution over a mapped vocabulary)
        self.device_top_k = 0
        why = mtp_unsupported()
        if why is not None:
            raise ModelLoadError(why)
        self.path = draft.path
        self.ctx = draft.ctx  # (the draft model's: closed with it, not here)
        llama_cpp_ext.llama_set_embeddings_nextn(self.ctx, True, False)
        self._batch = llama_cpp.llama_batch_ext_init(self.ctx)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = draft.n_vocab
        self.n_embd = int(llama_cpp.llama_model_n_embd(draft.model))
        self.n_batch = min(draft.n_batch, int(llama_cpp.llama_n_ubatch(self.ctx)))
        self.n_ctx = draft.n_ctx
        self.n_seq = n_seq
        self.on_gpu = draft.on_gpu
        self._pos = llama_cpp.llama_pos(0)
        self.decodes = 0

    def decode(self, entries: Sequence[MtpEntry]) -> list[tuple[Scores, np.ndarray]]:
        every = [(seq, token, pos, row, True) for seq, token, pos, row, _ in entries]
        out = []
        for first in range(0, len(every), self.n_batch):
            chunk = entries[first : first + self.n_batch]
            results = self._decode_chunk(every[first : first + self.n_batch])
            out += [r for r, e in zip(results, chunk, strict=True) if e[4]]
        return out

    def encode(self, features: np.ndarray) -> np.ndarray:
        """The decoder's input rows (n, n_embd) for these target features (n, 3 x the target's width): the ENCODE
        pass, which reads no cells. Its positions are placeholders, but llama.cpp checks them against sequence 0's
        cells as a decode's: they go on from there (as its own draft-eagle3 loop places them)."""
        out = []
        for at in range(0, len(features), self.n_batch):
            chunk = np.ascontiguousarray(features[at : at + self.n_batch], dtype=np.float32)
            llama_cpp.llama_batch_ext_clear(self._batch)
            after = int(llama_cpp.llama_memory_seq_pos_max(self.memory, 0)) + 1
            for i in range(len(chunk)):
                idx = llama_cpp.llama_batch_ext_add_embd(self._batch, 0, llama_cpp.llama_embd(
                    chunk[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, chunk.shape[1]))
                if idx < 0:
                    raise DecodeError(f"{self.path.name}: llama.cpp refused a feature row ({idx})")
                self._pos.value = after + i
                llama_cpp.llama_batch_ext_set_pos(self._batch, idx, ctypes.byref(self._pos))
                llama_cpp.llama_batch_ext_set_output_logits(self._batch, idx, True)
            rc = llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_ENCODE, self._batch)
            self.decodes += 1
            if rc != 0:
                raise DecodeError(f"{self.path.name}: the EAGLE-3 encoder failed with code {rc}")
            rows = llama_cpp_ext.llama_get_embeddings_nextn(self.ctx)
            if not rows:
                raise DecodeError(f"{self.path.name}: the EAGLE-3 encoder returned no rows")
            out.append(np.ctypeslib.as_array(rows, shape=(len(chunk), self.n_embd)).copy())
        return np.concatenate(out) if out else np.zeros((0, self.n_embd), np.float32)

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_ext_free(self._batch)
            self._batch = None
        self.ctx = None
