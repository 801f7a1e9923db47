"""One model in llama.cpp: `LlamaModel` loads a GGUF, makes its context of one or several sequences, decodes, rewinds
and reads its vocabulary.

llama-cpp-python's high-level `Llama` cannot take a second GGUF as a draft and computes logits where we do not need
them, so the engine drives llama.cpp directly: `llama_decode` on a batch filled through numpy views (`batch`),
cut into ubatches around an upstream bug (`ubatch`), rows read as the device sampler made them (`samplers`), the
hidden state per token for the drafters that read it (`hidden`), and `llama_memory_seq_rm` to rewind the KV cache
(a recurrent state through its snapshots and checkpoints: `recurrent`).
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path

import llama_cpp  # noqa: I001  -- llama_cpp before numpy: on CUDA builds the other order can segfault (docs/gpu.md)
import numpy as np

from localspec.config import LoadSettings, load_preset
from localspec.errors import ContextFullError, DecodeError, ModelLoadError, RollbackError, TooManyTokens
from localspec.llama import backend, ubatch
from localspec.llama.backend import BackendDevice
from localspec.llama.batch import Batch, DecodeItem
from localspec.llama.hidden import HiddenRows, mtp_unsupported
from localspec.llama.places import Places, SavedCells
from localspec.llama.recurrent import RecurrentState, rollback_unsupported
from localspec.llama.samplers import MAX_OUTPUTS_PER_DECODE, DeviceSamplers, Rows, as_scores, joined
from localspec.llama.vision import Projector, holds_pictures, runs
from localspec.models.gguf_header import GGUFHeader, read_header
from localspec.rounds.scores import DeviceDist, Scores

KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
_SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}
# Flash attention: llama.cpp decides (auto, the default everywhere in localspec), or forced on or off (the verify
# kernel experiment, bench/gpu/verify_widths.py).
FLASH_ATTN = {
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}
SEQUENCE_BATCH_NOISE = 0.5  # logits: a GPU's multi-sequence batch may always move rows this much at the same width
PROBE_CONTEXT = 8  # tokens each sequence of the load probe holds before the batches it compares
PROBE_WIDTH = 14  # the load probe's shared batch: 9 + 5 tokens (MMQ on CUDA, as a verify of several slots is)
# llama.cpp's CUDA backend multiplies quantized weights with matrix-vector kernels (MMVQ) for batches of up to 8
# tokens and with MMQ above: the step in every row of docs/gpu.md's width table. The probe compares widths on one side.
MMVQ_MAX_WIDTH = 8


def shares_batches(on_gpu: bool, batch_error: float, width_noise: float, cap: float | None) -> bool:
    """Whether sequences may share a batch, from the load probe's figures (`LlamaModel._sequence_batch_error`):
    on the CPU only bit for bit as alone; on a GPU when sharing moves the rows no more than the batch's width alone
    moves them within the same kernels (`width_noise`: the rounding every verify already brings), or than a floor
    of rounding, and never further than `cap` (the preset's `load.max_batch_error`; None: no cap), whatever the
    width noise. A wrong graph moves them further than either."""
    if not on_gpu:
        return batch_error == 0.0
    return batch_error <= max(SEQUENCE_BATCH_NOISE, width_noise) and (cap is None or batch_error <= cap)


def width_warning(on_gpu: bool, width_noise: float, cap: float | None) -> str | None:
    """One line for /health where a model's rows move with the batch width alone by more than `cap`: speculation
    verifies drafts in batches of varying width, so a draft would rarely match the rows that judge it."""
    if not on_gpu or cap is None or width_noise <= cap:
        return None
    return (f"this model's batch rows move {width_noise:.1f} logits with the batch width alone (more than "
            f"{cap:g}): its verify rows are mostly kernel rounding, so draft acceptance will collapse")


def _buffer(data: bytearray) -> ctypes.Array:
    """A bytearray as the uint8 array llama.cpp's state calls take, without a copy."""
    return (ctypes.c_uint8 * len(data)).from_buffer(data)


def save_seq_state(ctx: ctypes.c_void_p, seq: int, what: str) -> SavedCells:
    """A context's sequence `seq` as llama.cpp serialises it (`llama_state_seq_get_data`); `what` names it in the
    error (a model's cells, an MTP head's)."""
    size = int(llama_cpp.llama_state_seq_get_size(ctx, seq))
    data = SavedCells(size)
    if size and llama_cpp.llama_state_seq_get_data(ctx, _buffer(data), size, seq) != size:
        raise DecodeError(f"llama.cpp could not save {what}")
    return data


def load_seq_state(ctx: ctypes.c_void_p, data: bytearray, seq: int) -> bool:
    """Sequence `seq` of a context replaced with a `save_seq_state` of it; False when llama.cpp refuses it."""
    return bool(data) and llama_cpp.llama_state_seq_set_data(ctx, _buffer(data), len(data), seq) == len(data)


class LlamaModel:
    """One GGUF model with its context of `n_seq` sequences (slots), each with a KV region of its own of `n_ctx`
    cells. Positions are managed by the caller (the engine)."""

    def __init__(
        self,
        path: Path,
        *,
        load: LoadSettings | None = None,
        n_ctx: int | None = None,
        n_gpu_layers: int | None = None,
        n_batch: int | None = None,
        kv_type: str | None = None,
        n_threads: int | None = None,
        device_top_k: int | None = None,
        devices: Sequence[BackendDevice] | None = None,
        split_mode: str | None = None,
        tensor_split: Sequence[float] | None = None,
        main_gpu: int | None = None,
        max_batch_error: float | None = None,
        n_seq: int = 1,
        flash_attn: str = "auto",
        rewind: int = 0,
        other: LlamaModel | None = None,
    ) -> None:
        """`load`: the preset's `[load]` settings (None: the default preset's); an argument left None takes its
        value from there (`n_threads` from `threads`, 0: llama.cpp's default count; a draft model passes
        `n_gpu_layers=load.draft_n_gpu_layers`; the placement passes `split_mode`, `tensor_split`, `main_gpu`).
        `devices`: where the offloaded layers go (None = every local GPU; [] = the CPU only), `split_mode` how
        they share them, `tensor_split` each one's proportion, `main_gpu` an index into `devices`. `rewind`: how
        many tokens a recurrent or hybrid model must be able to roll back (the longest draft); llama.cpp keeps that
        many snapshots of its state (`n_rs_seq`), and a model it cannot roll back is refused (RollbackError).
        `max_batch_error`: on a GPU, the most (logits) a shared batch may move a sequence's rows for its sequences
        to share batches (`shares_batches`). `other`: the target a block drafter (DFlash, DSpark) without token
        embeddings or output head of its own reads them from (llama.cpp's `ctx_other`). Three steps: the weights
        (`_load`), the context (`_context`), the device samplers and the load probe (`_samplers_and_probe`)."""
        s = load if load is not None else load_preset().load
        backend.init()
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: model file not found")
        self.model = None
        self.ctx = None
        # A target's projector (images: llama.vision), set by the session; None: a picture's placeholder ids are
        # read as a filler token (a draft model's view of a picture: it drafts without it).
        self.projector: Projector | None = None
        # Where pictures that take fewer positions than cells sit (M-RoPE projectors): llama.cpp gets positions,
        # every caller indexes (llama.places).
        self._places = Places()
        self._batch: Batch | None = None
        self._samplers: DeviceSamplers | None = None
        self._recurrent: RecurrentState | None = None  # the rewind of a recurrent state (hybrid models)
        kv_type = s.kv_type if kv_type is None else kv_type
        if kv_type not in KV_TYPES:
            raise ModelLoadError(f"kv type {kv_type!r}: choose one of {', '.join(KV_TYPES)}")
        if flash_attn not in FLASH_ATTN:
            raise ModelLoadError(f"flash attention {flash_attn!r}: choose one of {', '.join(FLASH_ATTN)}")
        header = self._load(s.n_gpu_layers if n_gpu_layers is None else n_gpu_layers, devices,
                            s.split_mode if split_mode is None else split_mode,
                            s.tensor_split_values if tensor_split is None else tensor_split,
                            s.main_gpu if main_gpu is None else main_gpu)
        self._context(header, s.n_ctx if n_ctx is None else n_ctx, s.n_batch if n_batch is None else n_batch,
                      kv_type, s.threads if n_threads is None else n_threads, flash_attn, n_seq, rewind,
                      s.device_top_k if device_top_k is None else device_top_k, other)
        self._samplers_and_probe(s.device_top_k if device_top_k is None else device_top_k,
                                 s.max_batch_error if max_batch_error is None else max_batch_error)

    def _load(self, n_gpu_layers: int, devices: Sequence[BackendDevice] | None, split_mode: str,
              tensor_split: Sequence[float], main_gpu: int) -> GGUFHeader:
        """The weights, on these devices: llama.cpp's model params. Returns the file's header."""
        # The last wall before llama.cpp's loader, which aborts the process (GGML_ASSERT) on some out-of-range
        # hyperparameters instead of failing: such a header stops here with one line (cached, so cheap).
        header = read_header(self.path)
        header.hparams  # noqa: B018

        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        # Always an explicit, NULL-terminated device list: llama.cpp's default (NULL) takes every registered
        # device, RPC servers included, and this model may not be meant for them.
        self.devices = tuple(backend.gpu_devices() if devices is None else devices)
        self._device_array = (ctypes.c_void_p * (len(self.devices) + 1))(*[d.handle for d in self.devices], None)
        mparams.devices = ctypes.cast(self._device_array, ctypes.c_void_p)
        mparams.split_mode = _SPLIT_MODES[split_mode]
        mparams.main_gpu = main_gpu
        if tensor_split:
            self._tensor_split = (ctypes.c_float * llama_cpp.llama_max_devices())(*tensor_split)
            mparams.tensor_split = self._tensor_split
        # CPU "repacked" weight layouts use other kernels for a batch than for one token, so a verify batch's
        # logits differ from plain decoding's (by ~0.5 on Gemma 270M) and greedy output would not be lossless.
        # Without them one token and a batch give bit-identical logits (checked in tests/test_engine.py).
        mparams.use_extra_bufts = False
        load_mtp = bool(header.nextn_layers) and mtp_unsupported() is None
        if load_mtp:
            mparams.load_mtp = True  # the MTP blocks an `MtpHead` runs (the memory estimate counts them anyway)
        self.model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.model:
            raise ModelLoadError(f"{self.path}: llama.cpp could not load this model (LOCALSPEC_DEBUG=1 shows why)")
        # MTP blocks loaded with the model (`MtpHead` runs them): the drafter `mtp` exists only with them.
        self.mtp_layers = int(llama_cpp.llama_model_n_layer_nextn(self.model)) if load_mtp else 0
        # ... and those the file has (a library without MTP support loads none: the refusal then names the library)
        self.nextn_layers_in_file = header.nextn_layers
        self.arch = header.arch  # (general.architecture: a block drafter's file steps no token alone)
        self.n_gpu_layers = n_gpu_layers
        # Where the layers run decides what is exact and what is fast (batch logits, graph capture): docs/gpu.md.
        # RPC devices count as GPUs, as ggml reports them (a lent machine is usually lent for its GPU).
        self.on_gpu = n_gpu_layers != 0 and any(d.kind in ("gpu", "igpu", "rpc") for d in self.devices)
        return header

    def _context(self, header: GGUFHeader, n_ctx: int, n_batch: int, kv_type: str, n_threads: int,
                 flash_attn: str, n_seq: int, rewind: int, device_top_k: int,
                 other: LlamaModel | None = None) -> None:
        """The context of `n_seq` sequences of `n_ctx` cells each, the rewind of a recurrent state, the vocabulary
        and the batch of the model's life."""
        threads = n_threads or backend.default_threads()
        cparams = llama_cpp.llama_context_default_params()
        # One KV region per sequence (not a unified cache): a slot's cells sit where they would sit alone, so
        # what else runs cannot change its numbers, and a slot cannot fill another's context.
        cparams.n_seq_max = n_seq
        cparams.kv_unified = False
        cparams.n_ctx = n_ctx * n_seq
        n_batch = ubatch.context_n_batch(n_batch, n_seq)
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.type_k = KV_TYPES[kv_type]
        cparams.type_v = KV_TYPES[kv_type]
        cparams.flash_attn_type = FLASH_ATTN[flash_attn]
        cparams.no_perf = True
        if device_top_k:
            cparams.n_outputs_max_per_seq = MAX_OUTPUTS_PER_DECODE
        if other is not None:
            cparams.ctx_other = other.ctx
        self.recurrent = bool(llama_cpp.llama_model_is_recurrent(self.model)
                              or llama_cpp.llama_model_is_hybrid(self.model))
        if self.recurrent and rewind > 0:
            why = rollback_unsupported()
            if why is not None:
                self.close()
                raise RollbackError(f"{self.path.name}: {why}")
            cparams.n_rs_seq = rewind
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            self.close()
            raise ModelLoadError(
                f"{self.path}: llama.cpp could not create a context of {n_ctx} tokens "
                "(out of memory? try a smaller --ctx or --kv-type q8_0)"
            )
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        # None: a KV cache rewinds anywhere; a recurrent state only as far as llama.cpp keeps snapshots of it.
        self.rewind_depth: int | None = None
        if self.recurrent:
            self.rewind_depth = int(llama_cpp.llama_n_rs_seq(self.ctx)) if rewind > 0 else 0
            if self.rewind_depth < rewind:  # llama.cpp clamps n_rs_seq to 0 for the architectures it cannot roll back
                self.close()
                raise RollbackError(f"{self.path.name}: llama.cpp cannot roll back a {header.arch} model's recurrent "
                                    "state, which speculative decoding needs (plain decoding works: --n-draft 0)")
            self._recurrent = RecurrentState(self.ctx, self.memory, self.rewind_depth, self.path.name, n_seq)
        self.n_embd_out = int(llama_cpp.llama_model_n_embd_out(self.model))  # a hidden row's width (Scores.hidden)
        self._hidden = HiddenRows(self.ctx, self.n_embd_out, self.path.name,
                                  int(llama_cpp.llama_model_n_layer(self.model)),
                                  int(llama_cpp.llama_model_n_embd(self.model)))
        # `recurrent` (above) also decides what a saved state may serve once restored, and whether a context shift
        # can drop tokens (restore_floor).
        self.n_swa = int(llama_cpp.llama_model_n_swa(self.model))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        # llama.cpp pads the context to a multiple of 256; the user's number is the limit they asked for.
        self.n_ctx = min(n_ctx, int(llama_cpp.llama_n_ctx_seq(self.ctx)))
        self.n_seq = n_seq
        self.n_batch = min(n_batch, int(llama_cpp.llama_n_batch(self.ctx)))  # clamped to n_ctx by llama.cpp
        self.n_threads = threads
        self.kv_type = kv_type
        self.flash_attn = flash_attn
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self.vocab))
        pad = int(llama_cpp.llama_vocab_pad(self.vocab))
        self.unknown_token = pad if 0 <= pad < self.n_vocab else max(self.bos, 0)

        self._batch = Batch(n_batch, n_seq > 1)  # one for the model's life
        self.decodes = 0  # llama_decode calls so far, each one ubatch
        self._replans = ubatch.Replans(self.ctx, int(llama_cpp.llama_model_n_embd(self.model)), n_seq > 1)
        self._cells_per_seq = int(llama_cpp.llama_n_ctx_seq(self.ctx))

    def _samplers_and_probe(self, device_top_k: int, max_batch_error: float | None) -> None:
        """llama.cpp's backend sampling: a top-k sampler chain that runs inside the decode graph (on the GPU when
        the model is offloaded), so each output row comes back as k candidates instead of n_vocab logits; with
        several sequences, the load probe that decides whether they may share batches."""
        self.device_top_k = device_top_k
        self.batches_sequences = True  # (until the load probe below says otherwise)
        self._samplers = DeviceSamplers(self.ctx, self.n_vocab, device_top_k, self.path.name)
        if device_top_k > 0 and not self.use_device_sampler("top_k"):
            self.device_top_k = 0  # this backend cannot run it: full logits it is
        self.sequence_batch_error = self.width_noise = 0.0
        self.batch_warning: str | None = None  # /health's line where the width noise defeats speculation
        self.sequences_decoded = self.sequence_calls = 0  # decodes of several sequences: their items, their calls
        if self.n_seq > 1:
            self.sequence_batch_error, self.width_noise = self._sequence_batch_error()
            # On the CPU a sequence must score bit for bit as alone (both figures 0). A GPU's kernels differ with
            # the batch's width anyway (docs/gpu.md): there a shared batch counts as wrong only when it moves the
            # rows at the same width further than the width itself moves them (`width_noise`), or than the cap.
            self.batches_sequences = shares_batches(self.on_gpu, self.sequence_batch_error, self.width_noise,
                                                    max_batch_error)
            self.batch_warning = width_warning(self.on_gpu, self.width_noise, max_batch_error)
            if not self.batches_sequences:
                for seq in list(self._samplers.modes):
                    self.use_device_sampler(None, seq)
            self.sequences_decoded = self.sequence_calls = 0  # (the probe's are not a round's)

    # -- decoding -------------------------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], start_pos: int, all_logits: bool = False,
               seq: int = 0) -> Scores | None:
        """Append `tokens` at positions start_pos.. to sequence `seq`'s KV cells and wait for the scores.

        Returns the `Scores` the sequence's device sampler made (full logits are a (rows, n_vocab) float32 view
        into llama.cpp's buffer, valid until the next decode): one row per token with `all_logits`, else one row
        for the last token; None for no tokens. Prompt-sized inputs are split into n_batch chunks.
        """
        if holds_pictures(tokens):
            return self._decode_pictures(tokens, start_pos, all_logits, seq)
        raw, hidden = self._decode_batched([(seq, tokens, start_pos, all_logits)])
        return as_scores(raw[0], hidden[0])

    def _decode_pictures(self, tokens: Sequence[int], start_pos: int, all_logits: bool, seq: int) -> Scores | None:
        """`decode` of tokens that hold pictures' placeholder ids: with a projector, each picture through it and
        the text between in batches of its own (the scores are the last text run's; a picture's positions give no
        scores, and zero rows where the sequence wants hidden rows: a drafter reads them as "no row here"); without
        one, the filler token in each placeholder's place (what a draft model reads)."""
        if self.projector is None:
            raw, hidden = self._decode_batched([(seq, self._filled(tokens), start_pos, all_logits)])
            return as_scores(raw[0], hidden[0])
        if all_logits:
            raise DecodeError(f"{self.path.name}: rows of every position were asked for across a picture")
        pictures = dict(self.projector.pictures_in(tokens))
        rows: list[np.ndarray] | None = [] if seq in self._hidden.seqs else None
        scores: Scores | None = None
        for is_picture, start, end in runs(tokens):
            if not is_picture:
                raw, hidden = self._decode_batched([(seq, tokens[start:end], start_pos + start, False)])
                scores = as_scores(raw[0], hidden[0])
                if rows is not None and hidden[0] is not None:
                    rows.append(hidden[0])
                continue
            i = start
            while i < end:
                index = start_pos + i
                n_pos = self.projector.decode(tokens[i], self._places.pos(seq, index), seq)
                self._places.add(seq, index, pictures[i], n_pos)
                if self._recurrent is not None:
                    self._recurrent.decoded_elsewhere(seq)
                self.decodes += 1
                i += pictures[i]
            if rows is not None:
                rows.append(np.zeros((end - start, self._hidden.width(seq)), dtype=np.float32))
            scores = None  # (the last position is a picture's: no scores)
        if rows is None:
            return scores
        every = np.concatenate(rows)
        return Scores(None, hidden=every) if scores is None else dataclasses.replace(scores, hidden=every)

    def _filled(self, tokens: Sequence[int]) -> list[int]:
        """`tokens` with the filler token in each picture placeholder's place (a model without the projector)."""
        return [self.unknown_token if t < 0 else t for t in tokens]

    def decode_many(self, items: Sequence[DecodeItem]) -> list[Scores | None]:
        """Several sequences' tokens at once (one item per sequence); the scores of each item as `decode` returns
        them. With device sampler chains on several sequences, each call covers every sequence that has one
        (`ubatch.covering_calls`); otherwise the items go in ascending sequence order, one ubatch a call
        (`ubatch.decode_plan`). A model whose multi-sequence batches are not exact here (`batches_sequences`) decodes
        the items one after another, each in a batch of its own (one item too: covering would pad the others in)."""
        if any(holds_pictures(item[1]) for item in items):
            if self.projector is not None:  # (pictures reach a target in its prompt's decode only)
                raise DecodeError(f"{self.path.name}: a picture's placeholder ids in a batch of several sequences")
            items = [(seq, self._filled(tokens), pos, rows) for seq, tokens, pos, rows in items]
        if self.batches_sequences:
            raws, hidden = self._decode_batched(items, cover=True)
            return [as_scores(r, h) for r, h in zip(raws, hidden, strict=True)]
        results, hidden = [], []
        for i, item in enumerate(items):
            raw, rows = self._decode_batched([item])
            scores = raw[0]
            if i < len(items) - 1 and isinstance(scores, np.ndarray) and scores.base is not None:
                scores = scores.copy()  # a view into llama.cpp's buffer, which the next item's decode reuses
            results.append(scores)
            hidden.append(rows[0])
        return [as_scores(r, h) for r, h in zip(results, hidden, strict=True)]

    def _decode_batched(self, items: Sequence[DecodeItem],
                        cover: bool = False) -> tuple[list[Rows | None], list[np.ndarray | None]]:
        """Each item's rows, and its hidden rows where its sequence wants them (`want_hidden`)."""
        for _, tokens, start_pos, all_logits in items:
            if start_pos + len(tokens) > self.n_ctx:
                raise ContextFullError(
                    f"{self.path.name}: {start_pos + len(tokens)} tokens do not fit the context of {self.n_ctx}")
            if all_logits and len(tokens) > self.n_batch:
                raise DecodeError(
                    f"{self.path.name}: {len(tokens)} rows of scores do not fit one batch of {self.n_batch}")
        if self._places:  # (cells count indexes: the context check above; llama.cpp places positions)
            items = [(seq, tokens, self._places.pos(seq, start), rows) for seq, tokens, start, rows in items]
        modes = self._samplers.modes
        covering = ubatch.covering_calls(
            items, modes, self.n_batch, self._cells_per_seq,
            lambda seq: int(llama_cpp.llama_memory_seq_pos_max(self.memory, seq)) + 1, self.unknown_token,
        ) if cover and self.n_seq > 1 and modes else None
        # (one item: no call to share, and no copy of the cell map)
        cells = (self._recurrent.call_plan() if self._recurrent is not None and self.rewind_depth and len(items) > 1
                 else None)
        calls, trims = covering or (ubatch.plain_calls(items, self.n_batch, self.n_seq > 1, self.recurrent, cells), [])
        if len(items) > 1:  # (/health: how many sequences a call of several sequences' decode held)
            self.sequences_decoded += len(items)
            self.sequence_calls += len(calls)
        pieces: list[list[Rows]] = [[] for _ in items]
        hidden: list[list[np.ndarray]] = [[] for _ in items]
        views: list[tuple[int, int]] = []  # (item, piece): views into llama.cpp's buffer, which the next decode reuses
        try:
            for runs in calls:
                for item, piece in views:
                    pieces[item][piece] = pieces[item][piece].copy()
                views.clear()
                n, outputs, wanted = self._batch.fill(runs)
                self._decode(n, tuple(outputs.get(seq, 0) for seq in sorted(modes)))
                if self._recurrent is not None:
                    self._recurrent.decoded(runs)
                if self._hidden.seqs:
                    self._hidden.copy(runs, hidden)
                rows_only = covering is None and (not modes or not any(w[1] in modes for w in wanted))
                if wanted and rows_only:
                    # Full logits for all: one buffer, its rows in batch order (each output row is one wanted row).
                    full = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx),
                                                 shape=(sum(w[3] for w in wanted), self.n_vocab))
                    row = 0
                    for item, _, _, rows in wanted:
                        views.append((item, len(pieces[item])))
                        pieces[item].append(full[row : row + rows])
                        row += rows
                else:
                    for item, seq, first, rows in wanted:
                        pieces[item].append(self._samplers.rows(seq, first, rows))
        finally:
            for seq, keep in trims:  # the stand-in tokens leave the caches again, like rejected drafts
                llama_cpp.llama_memory_seq_rm(self.memory, seq, keep, -1)
        return [joined(p) for p in pieces], [np.concatenate(h) if h else None for h in hidden]

    def _decode(self, n: int, chains: tuple[int, ...]) -> None:
        """llama_decode of the batch's first n entries; `chains` is the output rows of each sequence that has a
        device sampler chain, in sequence order (0: the chain runs on a stand-in row); where a reused graph plan
        could overwrite a chain's output, llama.cpp plans afresh first (`ubatch.Replans`)."""
        dist = self._replans.before(chains, self._samplers.modes.values())
        self.decodes += 1
        rc = llama_cpp.llama_decode(self.ctx, self._batch.raw)
        self._replans.after(chains, dist)
        if rc != 0:
            if self._recurrent is not None:
                self._recurrent.failed()
            where = ", ".join(self._batch.where(i) for i in (0, n - 1))
            raise DecodeError(f"{self.path.name}: llama_decode failed with code {rc} ({where})"
                              + (" (no KV slot: the context is full)" if rc == 1 else ""))

    def _sequence_batch_error(self) -> tuple[float, float]:
        """What sharing a batch moves a sequence's rows, and what the batch's width alone moves them: two short
        made-up sequences (9 and 5 tokens, 8 each on a recurrent model, whose sequences share a call only with runs
        as long; fewer where a batch holds less; each after a context of its own, as a
        slot's round comes after its prompt) decoded in one batch.

        On the CPU the shared batch is compared with each sequence alone (a slot must score bit for bit as
        alone), and the width's effect is the first sequence's first rows at two widths. On a GPU the batch
        kernels change with the width (MMVQ up to 8 columns, MMQ above: docs/gpu.md), so there only the same
        width tells a wrong graph from rounding: the shared batch is compared with each sequence's tokens alone in
        a batch as wide (its own tokens, then made-up ones), and the width's effect is those rows against the
        sequence alone in a narrower batch of the same kernels (its own width, padded to 9 where the shared batch
        is MMQ's: a step between the two kernels is not the rounding a verify of several slots brings). (On the
        CPU that costs twice the rows, each a whole output head.)

        llama.cpp runs consecutive sequences of a non-unified cache as streams of one ubatch, and for some architectures
        that graph is not the single-sequence one: Gemma 3 (sliding-window attention) scores differ on the CPU in
        llama-cpp-python 0.3.36, where Llama-style models match bit for bit. A batch from position 0 is not measured:
        made-up text there drives some models' first rows far from any text's (a synthetic target's by tens of logits on
        a GPU: docs/lab/2026-12-01-drafters.md). Both sequences are cleared again."""
        modes = dict(self._samplers.modes)
        for seq in modes:
            self.use_device_sampler(None, seq)
        rng = np.random.default_rng(0)
        # Made-up text: any ids but the special ones at either end (BOS is the last id of GPT-2-style vocabularies).
        ids = np.setdiff1d(np.arange(min(self.n_vocab, 20_000)), [self.bos, self.eos])
        width = min(PROBE_WIDTH, self.n_batch)  # one batch: a wider one would be decoded as several
        first = max(1, min(width - 1, round(width * 9 / PROBE_WIDTH)))
        if self.recurrent:  # (its sequences share a call only with runs as long: `ubatch.whole_plan`)
            first = width // 2
        probes = [rng.choice(ids, size=n).tolist() for n in (first, width - first)]
        filler = rng.choice(ids, size=width).tolist()
        held = max(1, min(PROBE_CONTEXT, self.n_ctx - width))  # (a context too small for it: less before)
        contexts = [rng.choice(ids, size=held).tolist() for _ in probes]

        holding = [False] * len(probes)  # whether a sequence's cells hold its context

        def after_context(*items: tuple[int, list[int]]) -> list[np.ndarray]:
            for seq, _ in items:
                # Each context decoded alone once, then rewound to (a recurrent state that cannot: decoded again).
                if not (holding[seq] and self.truncate(held, seq) == held):
                    self.clear(seq)
                    self._decode_batched([(seq, contexts[seq], 0, False)])
                    holding[seq] = True
            rows = self._decode_batched([(seq, tokens, held, True) for seq, tokens in items])[0]
            return [r.copy() for r in rows]

        def largest(rows: list[np.ndarray], against: list[np.ndarray]) -> float:
            return max(float(np.abs(r - a).max()) for r, a in zip(rows, against, strict=True))

        def alone(seq: int, tokens: list[int], wide: int) -> np.ndarray:
            """The sequence's rows alone in a batch `wide` tokens wide (made-up tokens after its own)."""
            return after_context((seq, tokens + filler[: wide - len(tokens)]))[0][: len(tokens)]

        # The narrowest width of the shared batch's kernels (MMVQ or MMQ) that holds a probe's tokens.
        floor = MMVQ_MAX_WIDTH + 1 if width > MMVQ_MAX_WIDTH else 1
        for seq in range(len(probes)):
            self.clear(seq)
        try:
            if not self.on_gpu:
                own_width = [after_context((seq, tokens))[0] for seq, tokens in enumerate(probes)]
                together = after_context(*enumerate(probes))
                narrow = after_context((0, probes[0][: len(probes[1])]))
                return largest(together, own_width), largest(narrow, [own_width[0][: len(probes[1])]])
            together = after_context(*enumerate(probes))
            same_width = [alone(seq, tokens, width) for seq, tokens in enumerate(probes)]
            narrower = [alone(seq, tokens, max(len(tokens), floor)) for seq, tokens in enumerate(probes)]
            return largest(together, same_width), largest(same_width, narrower)
        finally:
            for seq in range(len(probes)):
                self.clear(seq)
            for seq, mode in modes.items():
                self.use_device_sampler(mode, seq)

    @property
    def replans(self) -> int:
        """Decodes before which llama.cpp was made to plan its graphs afresh (`ubatch.Replans`)."""
        return self._replans.count

    def use_device_sampler(self, mode: str | DeviceDist | None, seq: int = 0) -> bool:
        """Select what llama.cpp computes on the device for sequence `seq` after each decode: "greedy" (the argmax
        token of each row), "top_k" (each row's top `device_top_k` candidates), a `DeviceDist` chain (one sampled
        token per row) or None (full logits to the host). True if on; False when this build cannot run the chain.

        llama.cpp initialises a chain for the device once, so each switch attaches a fresh chain (and the next
        decode rebuilds its graph: callers switch per generation, not per round).
        """
        if not self.device_top_k or (self.recurrent and self.n_seq > 1) or not self.batches_sequences:
            # (Several sequences' chains need covering calls, whose stand-in tokens a recurrent state cannot undo.
            # Slots that take turns decode one sequence's rows a call, its chain on them and the others' on stand-in
            # rows: each turn's graph differs from the last in where the chains run, so llama.cpp would plan its
            # graphs afresh before every verify (`ubatch.Replans`; far dearer a turn on a large target than reading
            # its few full rows: docs/lab/2026-12-01-drafters.md): full rows there.)
            mode = None
        if mode == self._samplers.modes.get(seq):
            return mode is not None
        self._replans.forget()
        return self._samplers.use(mode, seq)

    def device_sampler(self, seq: int = 0) -> str | DeviceDist | None:
        """Sequence `seq`'s device sampler (`use_device_sampler`): None for full logits."""
        return self._samplers.modes.get(seq)

    def full_row(self, token: int, pos: int, seq: int = 0) -> np.ndarray:
        """Sequence `seq`'s full logits after `token` at `pos`, whatever its device sampler: its cells from `pos`
        on are dropped and `token` decoded again there with the sampler set aside. llama.cpp copies a row's raw
        logits only when some row of the ubatch belongs to a sequence without a device sampler
        (`needs_raw_logits` in llama-context.cpp), so a row the sampler ran on cannot be read whole afterwards.
        Switching the sampler makes llama.cpp plan its graphs again: for the rare row only."""
        mode = self._samplers.modes.get(seq)
        if self.truncate(pos, seq) != pos:
            raise DecodeError(f"{self.path.name}: a recurrent state cannot rewind to position {pos} to read a row "
                              "whole (constrained rows are full rows on such a model)")
        self.use_device_sampler(None, seq)
        try:
            scores = self.decode_many([(seq, [token], pos, True)])[0]
            assert scores is not None and scores.full and scores.logits is not None
            return scores.logits[0].copy()
        finally:
            if mode is not None:
                self.use_device_sampler(mode, seq)

    def restart_device_sampler(self, seq: int = 0) -> None:
        """Reseed a `DeviceDist` chain, so each generation with the same seed draws the same tokens."""
        self._samplers.restart(seq)

    def truncate(self, n_keep: int, seq: int = 0) -> int:
        """Drop every cell of sequence `seq` at position >= n_keep (the one rewind primitive); returns how many
        cells it kept. A KV cache keeps n_keep, or the cells before a picture n_keep falls inside (a picture goes
        whole). A recurrent state rewinds exactly only through llama.cpp's
        snapshots: at most `rewind_depth` tokens, fewer than its last decode held, once per decode. Further back it
        goes to its checkpoint (`checkpoint`) or, without one at or before n_keep, to nothing, and the caller
        decodes the rest again. (llama.cpp's own seq_rm says yes to a rollback past the last decode and then reads
        a stale snapshot: docs/upstream.md; hence the bookkeeping in `recurrent`.)"""
        n_keep = self._places.start(seq, n_keep)
        pos = self._places.pos(seq, n_keep)
        if self._recurrent is not None:
            n_keep = self._places.index(seq, self._recurrent.truncate(pos, seq))
        elif not llama_cpp.llama_memory_seq_rm(self.memory, seq, pos, -1):
            raise DecodeError(f"{self.path.name}: this model's memory cannot be rewound to position {n_keep}")
        self._places.cut(seq, n_keep)
        return n_keep

    def checkpoint(self, seq: int = 0) -> None:
        """Save a recurrent sequence's state (its recurrent part, kept on its device: llama.cpp's
        PARTIAL_ONLY | ON_DEVICE) at its current length, replacing the last checkpoint; a KV cache needs none."""
        if self._recurrent is not None:
            self._recurrent.checkpoint(seq)

    def clear(self, seq: int | None = None) -> None:
        """Forget every sequence's KV cells, or only those of `seq`."""
        if seq is None:
            llama_cpp.llama_memory_clear(self.memory, True)
            self._places.clear()
            if self._recurrent is not None:
                self._recurrent.clear()
        else:
            self.truncate(0, seq)

    def want_hidden(self, seq: int, on: bool, layers: Sequence[int] | None = None) -> None:
        """Whether sequence `seq`'s decodes return the hidden state after each token (`Scores.hidden`: what an MTP
        head drafts from; llama.cpp's nextn embeddings, the final norm's output, one row per token); with `layers`,
        the inputs of those layers instead, concatenated per token (a block drafter's features: DFlash, DSpark)."""
        self._hidden.want(seq, on, layers)

    # -- a sequence's state: the prompt cache and slot files -------------------------------------------------

    def save_state(self, seq: int = 0) -> SavedCells:
        """Sequence `seq`'s cells as llama.cpp serialises them (`llama_state_seq_get_data`): positions, keys and
        values (of sliding-window layers only the window's last positions), or a recurrent state as it is now; and
        where its pictures sit (`SavedCells.gaps`: M-RoPE pictures take fewer positions than cells)."""
        data = save_seq_state(self.ctx, seq, f"{self.path.name}'s sequence {seq}")
        data.gaps = self._places.gaps(seq)
        return data

    def load_state(self, data: bytearray, seq: int = 0) -> bool:
        """Replace sequence `seq`'s cells with a state `save_state` made on this model (with as many sequences);
        False when llama.cpp refuses it, and the sequence is then empty."""
        ok = load_seq_state(self.ctx, data, seq)
        if self._recurrent is not None:  # its snapshots and checkpoint belonged to the cells this replaced
            if ok:
                self._recurrent.loaded(seq)
            else:
                self._recurrent.forget(seq)
                if data:  # (llama.cpp read some of it: where it left the cells is not known)
                    self._recurrent.failed()
        self._places.put(seq, getattr(data, "gaps", ()) if ok else ())
        if not ok:
            self.clear(seq)
        return ok

    def restore_floor(self, n_tokens: int) -> int:
        """The shortest length that a state of `n_tokens` from `save_state` may be cut back to once restored
        (`prompt_cache.ModelState.floor`): any for full attention; one token for sliding-window layers once the
        state is longer than the window (llama.cpp saves only the positions the last one can see: with the older
        ones missing, a shorter prefix would attend to less than a fresh decode does); none for a recurrent
        state (a summary of every token before it)."""
        if self.recurrent:
            return n_tokens
        if self.n_swa and n_tokens > self.n_swa:
            return n_tokens - 1
        return 0

    # -- vocabulary -----------------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False,
                 limit: int | None = None) -> list[int]:
        """`limit`: raise TooManyTokens (with the count) for a text of more tokens, without building their list:
        llama.cpp reports the count it needs when the buffer is short."""
        data = text.encode("utf-8")
        capacity = len(data) + 16 if limit is None else min(len(data) + 16, limit)
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0 and limit is not None and -n > limit:
            raise TooManyTokens(f"the text has {-n} tokens, more than {limit}", -n)
        if n < 0:
            capacity = -n
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    @functools.cached_property
    def max_piece_bytes(self) -> int | None:
        """The most bytes of text one token stands for (control tokens' names included), or None when the
        tokenizer normalizes text first (WPM, UGM: runs of spaces fold), so that no such bound exists."""
        if llama_cpp.llama_vocab_type(self.vocab) not in (llama_cpp.LLAMA_VOCAB_TYPE_SPM,
                                                          llama_cpp.LLAMA_VOCAB_TYPE_BPE):
            return None
        # A character is at least one token of at most 4 bytes, even where no token covers it (byte fallback).
        return max(4, max(len(self.piece(t, special=True)) for t in range(self.n_vocab)))

    @functools.cached_property
    def control_texts(self) -> frozenset[str]:
        """The texts that tokenizing with parse_special turns into control (or unknown) tokens: `<|im_end|>`."""
        mask = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        texts = {self.token_text(t) for t in range(self.n_vocab)
                 if llama_cpp.llama_vocab_get_attr(self.vocab, t) & mask}
        return frozenset(t for t in texts if t)

    def piece(self, token: int, special: bool = False) -> bytes:
        """The token's text. Called from several threads at once (the server's engine thread emitting tokens, its
        event loop detokenizing), so each call has a buffer of its own: with one per model, llama.cpp could write
        one thread's text into it between another's call and its read (tests/test_piece_threads.py)."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 256, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        """`special`: control tokens as their text (`<|im_start|>`), as llama-server's /detokenize shows them."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return "".join(decoder.decode(self.piece(t, special)) for t in tokens) + decoder.decode(b"", final=True)

    def fim_tokens(self) -> dict[str, int | None]:
        """The vocabulary's fill-in-the-middle tokens (llama.cpp finds them by name or GGUF key): pre, suf, mid,
        and the repo-level pattern's rep and sep; None where the model has none."""
        found = {"pre": llama_cpp.llama_vocab_fim_pre(self.vocab), "suf": llama_cpp.llama_vocab_fim_suf(self.vocab),
                 "mid": llama_cpp.llama_vocab_fim_mid(self.vocab), "rep": llama_cpp.llama_vocab_fim_rep(self.vocab),
                 "sep": llama_cpp.llama_vocab_fim_sep(self.vocab)}
        return {name: int(t) if 0 <= t < self.n_vocab else None for name, t in found.items()}

    def token_text(self, token: int) -> str:
        return llama_cpp.llama_vocab_get_text(self.vocab, token).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    # -- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        if self.projector is not None:  # (its context refers to this model's)
            self.projector.close()
            self.projector = None
        if self.ctx and self._samplers is not None:
            self._samplers.close()
        if self._batch is not None:
            self._batch.free()
            self._batch = None
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: llama_cpp may already be gone
            self.close()
