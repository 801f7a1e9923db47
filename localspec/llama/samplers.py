"""Device sampler chains: what llama.cpp computes per output row inside the decode graph (on the GPU when the model
is offloaded) instead of copying n_vocab logits to the host: the argmax ("greedy"), the top k candidates ("top_k")
or a token drawn by plain decoding's whole pipeline (`DeviceDist`); and reading each row back as the one `Scores`
type callers see."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp  # noqa: I001  -- llama_cpp before numpy: on CUDA builds the other order can segfault (docs/gpu.md)
import numpy as np

from localspec.errors import DecodeError
from localspec.rounds.scores import DeviceDist, Scores

MAX_OUTPUTS_PER_DECODE = 64  # a verify batch is at most 33 tokens (k <= 32); headroom for the device sampler

Mode = str | DeviceDist  # "greedy", "top_k" or a DeviceDist chain


@dataclass(frozen=True, slots=True)
class TopK:
    """Per output row, the top candidates selected on the device: no full-vocabulary copy, no host top-k."""

    ids: np.ndarray  # (rows, k) int32; k = 1 with the device's greedy sampler
    logits: np.ndarray  # (rows, k) float32 (zeros with the greedy sampler: only the argmax is known)


@dataclass(frozen=True, slots=True)
class Sampled:
    """Per output row, a token drawn on the device by the `DeviceDist` chain (plain decoding at T > 0)."""

    tokens: np.ndarray  # (rows,) int32


Rows = np.ndarray | TopK | Sampled  # what a decode made for some rows of one sequence


def as_scores(raw: Rows | None, hidden: np.ndarray | None = None) -> Scores | None:
    """What the decode made, as the one type callers see (with the hidden rows, when asked: `hidden`)."""
    if raw is None or isinstance(raw, np.ndarray):
        return None if raw is None else Scores(raw, hidden=hidden)
    if isinstance(raw, TopK):
        return Scores(raw.logits, ids=raw.ids, hidden=hidden)
    return Scores(None, drawn=raw.tokens, hidden=hidden)


def joined(pieces: list[Rows]) -> Rows | None:
    """One item's scores from the decodes its rows came from, in row order."""
    if len(pieces) < 2:
        return pieces[0] if pieces else None
    first = pieces[0]
    if isinstance(first, TopK):
        return TopK(np.concatenate([p.ids for p in pieces]), np.concatenate([p.logits for p in pieces]))
    if isinstance(first, Sampled):
        return Sampled(np.concatenate([p.tokens for p in pieces]))
    return np.concatenate(pieces)


class _Memory:
    """Rows of 4-byte values in llama.cpp's memory, `stride` bytes apart, for `np.array` to copy (numpy's array
    interface: unlike np.ctypeslib.as_array, no ctypes array type is built per call)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: tuple[int, int], stride: int, typestr: str) -> None:
        self.__array_interface__ = {"data": (address, True), "shape": shape, "strides": (stride, 4),
                                    "typestr": typestr, "version": 3}


def _device_samplers(mode: Mode, device_top_k: int) -> list[ctypes.c_void_p]:
    """The llama.cpp samplers of one device chain, in pipeline order."""
    if mode == "greedy":
        return [llama_cpp.llama_sampler_init_greedy()]
    if mode == "top_k":
        return [llama_cpp.llama_sampler_init_top_k(device_top_k)]
    assert isinstance(mode, DeviceDist) and mode.temperature > 0.0
    chain = []
    if mode.top_k > 0:
        chain.append(llama_cpp.llama_sampler_init_top_k(mode.top_k))
    if mode.top_p < 1.0:
        chain.append(llama_cpp.llama_sampler_init_top_p(mode.top_p, 1))
    if mode.min_p > 0.0:
        chain.append(llama_cpp.llama_sampler_init_min_p(mode.min_p, 1))
    chain.append(llama_cpp.llama_sampler_init_temp(mode.temperature))
    chain.append(llama_cpp.llama_sampler_init_dist(mode.seed))
    return chain


class DeviceSamplers:
    """The device sampler chain of each sequence of one context that has one (absent: full logits), and its rows.

    llama.cpp initialises a chain for the device once, so each switch attaches a fresh chain (and the next decode
    rebuilds its graph: callers switch per generation, not per round)."""

    def __init__(self, ctx: ctypes.c_void_p, n_vocab: int, device_top_k: int, name: str) -> None:
        self._ctx = ctx
        self._n_vocab = n_vocab
        self._top_k = device_top_k
        self._name = name  # the model file's name, for errors
        self.modes: dict[int, Mode] = {}  # each sequence's mode (absent: full logits)
        self._chains: dict[int, ctypes.c_void_p] = {}

    def use(self, mode: Mode | None, seq: int) -> bool:
        """Attach a fresh chain of `mode` to sequence `seq` (None: none, full logits); True if one is on, False when
        this build cannot run it."""
        if seq in self._chains:
            llama_cpp.llama_set_sampler(self._ctx, seq, None)
            llama_cpp.llama_sampler_free(self._chains.pop(seq))
            del self.modes[seq]
        if mode is None:
            return False
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        for sampler in _device_samplers(mode, self._top_k):
            llama_cpp.llama_sampler_chain_add(chain, sampler)
        if not llama_cpp.llama_set_sampler(self._ctx, seq, chain):
            llama_cpp.llama_sampler_free(chain)
            return False
        self._chains[seq] = chain
        self.modes[seq] = mode
        return True

    def restart(self, seq: int) -> None:
        """Reseed a `DeviceDist` chain, so each generation with the same seed draws the same tokens."""
        if isinstance(self.modes.get(seq), DeviceDist):
            llama_cpp.llama_sampler_reset(self._chains[seq])

    def close(self) -> None:
        for seq in list(self._chains):
            self.use(None, seq)

    def rows(self, seq: int, first: int, rows: int) -> Rows:
        """Sequence `seq`'s scores at batch entries first.., as its device sampler made them (or full logits)."""
        mode = self.modes.get(seq)
        indices = range(first, first + rows)
        if mode is None:
            out = np.empty((rows, self._n_vocab), dtype=np.float32)
            for r, i in enumerate(indices):
                out[r] = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, i), shape=(self._n_vocab,))
            return out
        if mode == "greedy":
            ids = np.array([[llama_cpp.llama_get_sampled_token_ith(self._ctx, i)] for i in indices], dtype=np.int32)
            return TopK(ids, np.zeros(ids.shape, dtype=np.float32))
        if isinstance(mode, DeviceDist):
            tokens = np.array([llama_cpp.llama_get_sampled_token_ith(self._ctx, i) for i in indices], dtype=np.int32)
            # The context allows several outputs per sequence, which makes llama.cpp's dist sampler
            # transactional: each decode draws from a copy of its RNG, and only an accepted token advances it.
            # Plain decoding emits every draw, so each is committed here; without this every token would be
            # drawn with the same uniform number.
            for token in tokens.tolist():
                llama_cpp.llama_sampler_accept(self._chains[seq], token)
            return Sampled(tokens)
        return self._device_top_k(first, rows)

    def _device_top_k(self, first: int, rows: int) -> TopK:
        k = self._top_k
        ctx = self._ctx
        last = first + rows - 1
        for i in {first, last}:  # (one chain makes every row: its first and last stand for all)
            count = llama_cpp.llama_get_sampled_logits_count_ith(ctx, i)
            if count != k:
                raise DecodeError(f"{self._name}: the device sampler returned {count} candidates, not {k}")
        if rows > 1:
            # A verify's rows are consecutive outputs, n_vocab entries apart in llama.cpp's buffers: two strided
            # copies instead of two per row (this is on every T > 0 round's path).
            ids_at = ctypes.addressof(llama_cpp.llama_get_sampled_candidates_ith(ctx, first).contents)
            logits_at = ctypes.addressof(llama_cpp.llama_get_sampled_logits_ith(ctx, first).contents)
            stride = 4 * self._n_vocab
            span = (rows - 1) * stride
            if (ctypes.addressof(llama_cpp.llama_get_sampled_candidates_ith(ctx, last).contents) == ids_at + span
                    and ctypes.addressof(llama_cpp.llama_get_sampled_logits_ith(ctx, last).contents)
                    == logits_at + span):
                return TopK(np.array(_Memory(ids_at, (rows, k), stride, "<i4")),
                            np.array(_Memory(logits_at, (rows, k), stride, "<f4")))
        ids = np.empty((rows, k), dtype=np.int32)
        logits = np.empty((rows, k), dtype=np.float32)
        # Straight copies into the arrays: np.ctypeslib.as_array builds a ctypes array type per call, which cost
        # more than the copy itself (once per row of every draft step and verify at T > 0).
        row_bytes = 4 * k
        ids_to, logits_to = ids.ctypes.data, logits.ctypes.data
        for r, i in enumerate(range(first, first + rows)):
            ctypes.memmove(ids_to + r * row_bytes, llama_cpp.llama_get_sampled_candidates_ith(ctx, i), row_bytes)
            ctypes.memmove(logits_to + r * row_bytes, llama_cpp.llama_get_sampled_logits_ith(ctx, i), row_bytes)
        return TopK(ids, logits)
