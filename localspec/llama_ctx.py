"""The one wall around llama.cpp: every call into llama-cpp-python goes through this module.

`LlamaModel` is one model, one context, one reusable batch. llama-cpp-python's high-level `Llama` cannot take a
second GGUF as a draft and computes logits where we do not need them, so the engine drives llama.cpp directly:
`llama_decode` on a batch we fill through numpy views, `llama_get_logits` as a zero-copy numpy view, and
`llama_memory_seq_rm` to rewind the KV cache. Beside it: chat templates (llama.cpp's built-ins and the GGUF's own
Jinja template through llama-cpp-python's sandboxed formatter), the quantizer, and the build's capabilities.
"""

from __future__ import annotations

import _thread
import codecs
import contextlib
import ctypes
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import llama_cpp  # noqa: I001  -- llama_cpp before numpy: on CUDA builds the other order can segfault (docs/gpu.md)
import numpy as np

from localspec.errors import (
    ContextFullError,
    DecodeError,
    GrammarError,
    LocalspecError,
    ModelLoadError,
    RollbackError,
    TooManyTokens,
    UsageError,
)
from localspec.gguf_header import read_header
from localspec.scores import DeviceDist, Scores

KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}

_backend_ready = False


def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp logs every load step; users see them only with LOCALSPEC_DEBUG=1.
    if os.environ.get("LOCALSPEC_DEBUG", "") not in ("", "0"):
        os.write(2, text)


_log_to_stderr_when_debugging = llama_cpp.llama_log_callback(_log)


def deferred_in_callback(signum: int, frame: FrameType | None) -> bool:
    """For signal handlers that raise (Ctrl-C, SIGTERM). Python runs a handler at the next bytecode, which can be
    inside the log callback above while llama.cpp calls it; ctypes would print the exception there and drop it,
    so the signal would be lost. Inside the callback this re-arms the signal from another thread, which runs once
    llama.cpp has released the GIL again, and returns True: the handler then runs where Python can raise."""
    while frame is not None:
        if frame.f_code is _log.__code__:
            threading.Timer(0.001, _thread.interrupt_main, args=(signum,)).start()
            return True
        frame = frame.f_back
    return False


def interrupt_handler(signum: int, frame: FrameType | None) -> None:
    """The SIGINT handler for entry points: KeyboardInterrupt, never lost inside a llama.cpp callback."""
    if not deferred_in_callback(signum, frame):
        raise KeyboardInterrupt


def _init_backend() -> None:
    """Once per process, before anything else is asked of llama.cpp: route its log through our callback, start
    it, and open ggml's device registry (libggml next to libllama, every device enumerated). Every entry point
    (models, devices, the quantizer) comes through here, so a model is never loaded before the registry is up:
    on the H200 image `LlamaModel(path)` as a process's first call crashed inside llama_model_load_from_file
    while the same load after a device query worked (docs/gpu.md)."""
    global _backend_ready
    if _backend_ready:
        return
    llama_cpp.llama_log_set(_log_to_stderr_when_debugging, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    _backend_ready = True
    backend_devices()


def supports_gpu_offload() -> bool:
    """Whether this build has a local GPU to offload to. Not llama_supports_gpu_offload(): that also counts the
    RPC backend, so a CPU build with -DGGML_RPC=ON says yes."""
    return bool(gpu_devices())


# -- what this llama-cpp-python can do for hybrid models and MTP heads (llama_cpp's own declarations) ---------------
#
# Everything below is declared by llama-cpp-python 0.3.36 (`llama_cpp.llama_cpp` and the staging `llama_cpp_ext`);
# an older build lacks some of it, and then the features that need it are refused with one line, never approximated.
# tests/test_hybrid.py checks the struct fields against the library itself (a context's n_rs_seq reads back).

# A recurrent checkpoint: only the recurrent part of a hybrid's memory, kept in device memory.
_CHECKPOINT_FLAGS = (getattr(llama_cpp, "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY", 1)
                     | getattr(llama_cpp, "LLAMA_STATE_SEQ_FLAGS_ON_DEVICE", 2))


def _has_field(struct: type, name: str) -> bool:
    return any(field[0] == name for field in getattr(struct, "_fields_", ()))


def rollback_unsupported() -> str | None:
    """Why this llama-cpp-python cannot roll a recurrent state back (speculation on hybrid models), None if it can."""
    have = (_has_field(llama_cpp.llama_context_params, "n_rs_seq") and hasattr(llama_cpp, "llama_n_rs_seq")
            and hasattr(llama_cpp, "llama_state_seq_get_data_ext"))
    if have:
        return None
    return (f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} cannot roll back a recurrent state "
            "(no llama_context_params.n_rs_seq), which speculative decoding on this model needs: install "
            "llama-cpp-python 0.3.36 or newer, or decode plainly (--n-draft 0)")


try:
    from llama_cpp import llama_cpp_ext
except (ImportError, AttributeError):  # an older build: no staging API (MTP heads unavailable)
    llama_cpp_ext = None  # type: ignore[assignment]


def mtp_unsupported() -> str | None:
    """Why this llama-cpp-python cannot run a model's MTP head, None if it can."""
    have = (llama_cpp_ext is not None and _has_field(llama_cpp.llama_model_params, "load_mtp")
            and _has_field(llama_cpp.llama_context_params, "ctx_type") and hasattr(llama_cpp, "llama_process")
            and hasattr(llama_cpp, "llama_batch_ext_set_embd_token"))
    if have:
        return None
    return (f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} cannot run MTP heads (no MTP context type "
            "or nextn embeddings): install llama-cpp-python 0.3.36 or newer")


# -- devices: local GPUs and RPC servers (ggml's backend registry, declared from ggml-backend.h) -----------------

_DEV_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
_SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}
# Flash attention: llama.cpp decides (auto, the default everywhere in localspec), or forced on or off (the verify
# kernel experiment, bench/gpu/verify_widths.py).
FLASH_ATTN = {
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}
_ggml_lib: ctypes.CDLL | None = None
_rpc_servers: dict[str, list[int]] = {}  # endpoint -> its ggml device handles, registered once per process


@dataclass(frozen=True)
class BackendDevice:
    """One ggml device. `handle` is its ggml_backend_dev_t, valid for the life of the process."""

    name: str  # ggml's name: "CUDA0", "RPC0", "CPU"
    description: str  # "NVIDIA GeForce RTX 3090"; an RPC device's is its server's HOST:PORT
    kind: str  # "cpu", "gpu", "igpu", "accel" or "rpc"
    handle: int = dataclasses.field(repr=False, compare=False, default=0)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes as llama.cpp sees them (a CUDA device starts its context for this)."""
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _ggml().ggml_backend_dev_memory(self.handle, ctypes.byref(free), ctypes.byref(total))
        return int(free.value), int(total.value)


def _ggml() -> ctypes.CDLL:
    """libggml with the prototypes this module calls (llama-cpp-python binds libllama only)."""
    global _ggml_lib
    _init_backend()  # (which comes back here once, to enumerate the devices)
    if _ggml_lib is None:
        from llama_cpp._ctypes_extensions import load_shared_library

        # The libggml next to the libllama actually loaded: LLAMA_CPP_LIB_PATH may point at another build (the GPU
        # harness's), and llama_cpp._ggml would load the package's own copy instead.
        libggml = load_shared_library("ggml", Path(llama_cpp.llama_cpp._lib._name).parent)
        vp, size, text = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        for name, restype, argtypes in (
            ("ggml_backend_dev_count", size, []),
            ("ggml_backend_dev_get", vp, [size]),
            ("ggml_backend_dev_by_type", vp, [ctypes.c_int]),
            ("ggml_backend_dev_name", text, [vp]),
            ("ggml_backend_dev_description", text, [vp]),
            ("ggml_backend_dev_type", ctypes.c_int, [vp]),
            ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(size), ctypes.POINTER(size)]),
            ("ggml_backend_dev_backend_reg", vp, [vp]),
            ("ggml_backend_reg_name", text, [vp]),
            ("ggml_backend_reg_by_name", vp, [text]),
            ("ggml_backend_reg_get_proc_address", vp, [vp, text]),
            ("ggml_backend_reg_dev_count", size, [vp]),
            ("ggml_backend_reg_dev_get", vp, [vp, size]),
            ("ggml_backend_register", None, [vp]),
        ):
            fn = getattr(libggml, name)
            fn.restype, fn.argtypes = restype, argtypes
        _ggml_lib = libggml
    return _ggml_lib


def _device(handle: int) -> BackendDevice:
    g = _ggml()
    kind = _DEV_KINDS.get(g.ggml_backend_dev_type(handle), "other")
    if kind == "gpu" and g.ggml_backend_reg_name(g.ggml_backend_dev_backend_reg(handle)) == b"RPC":
        kind = "rpc"  # RPC devices report themselves as GPUs
    return BackendDevice(g.ggml_backend_dev_name(handle).decode(), g.ggml_backend_dev_description(handle).decode(),
                         kind, handle)


def backend_devices() -> list[BackendDevice]:
    """Every device ggml has registered, in its order (RPC servers once they are added)."""
    g = _ggml()
    return [_device(g.ggml_backend_dev_get(i)) for i in range(g.ggml_backend_dev_count())]


def gpu_devices() -> list[BackendDevice]:
    """The local GPUs llama.cpp offloads to, numbered as llama.cpp numbers them: discrete GPUs, or the integrated
    ones when there is none (llama.cpp's own rule). RPC devices are not local GPUs."""
    devices = backend_devices()
    return [d for d in devices if d.kind == "gpu"] or [d for d in devices if d.kind == "igpu"]


def cpu_device() -> BackendDevice:
    return _device(_ggml().ggml_backend_dev_by_type(0))


def _rpc_function(name: str, prototype: type) -> Callable:
    g = _ggml()
    reg = g.ggml_backend_reg_by_name(b"RPC")
    address = g.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg else None
    if not address:
        raise LocalspecError("this llama.cpp was built without RPC support: reinstall llama-cpp-python with "
                             'CMAKE_ARGS="-DGGML_RPC=ON ..." (see the README)')
    return prototype(address)


def rpc_devices(endpoints: Sequence[str]) -> list[BackendDevice]:
    """The devices of these RPC servers, registered with ggml once each (after `rpc.hello` proved each one
    answers: ggml's own connect aborts the process on a dead endpoint). Raises a one-line LocalspecError naming
    the first endpoint that does not answer, before anything is registered or sent."""
    from localspec import rpc

    todo = [e for e in endpoints if e not in _rpc_servers]
    for endpoint in todo:
        rpc.hello(rpc.parse_endpoint(endpoint))
    if todo:
        add_server = _rpc_function("ggml_backend_rpc_add_server", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p))
    g = _ggml()
    for endpoint in todo:
        reg = add_server(endpoint.encode())
        if not reg:
            raise LocalspecError(f"RPC server {endpoint}: offers no device")
        g.ggml_backend_register(reg)  # as llama.cpp's --rpc does: its devices join ggml's list
        _rpc_servers[endpoint] = [g.ggml_backend_reg_dev_get(reg, i) for i in range(g.ggml_backend_reg_dev_count(reg))]
    return [_device(h) for e in endpoints for h in _rpc_servers[e]]


def serve_rpc(endpoint: str, devices: Sequence[BackendDevice], threads: int, cache_dir: Path | None) -> None:
    """Run ggml's RPC server on `endpoint` (HOST:PORT) for these devices. Blocks for as long as it serves;
    returns when it cannot listen (ggml prints why)."""
    start = _rpc_function("ggml_backend_rpc_start_server", ctypes.CFUNCTYPE(
        None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)))
    handles = (ctypes.c_void_p * len(devices))(*[d.handle for d in devices])
    start(endpoint.encode(), str(cache_dir).encode() if cache_dir else None, threads, len(devices), handles)


def system_info() -> str:
    """llama.cpp's build and CPU feature summary (for bench reports)."""
    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


def default_threads() -> int:
    """Threads when none are given: the physical cores other programs leave free (machine.thread_choice)."""
    from localspec.machine import thread_choice

    return thread_choice().threads


def quantize(source: Path, dest: Path, ftype_name: str) -> None:
    """Requantize `source` into `dest` with llama.cpp's own quantizer (e.g. ftype_name "Q2_K")."""
    _init_backend()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.allow_requantize = True
    params.nthread = default_threads()
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), params)
    if rc != 0:
        raise ModelLoadError(f"{source}: llama.cpp could not requantize it to {ftype_name} (code {rc})")


# -- chat templates ----------------------------------------------------------------------------------------------

ChatMessages = list[dict[str, str]]


def builtin_chat_templates() -> list[str]:
    """The names of llama.cpp's built-in chat templates (`gemma`, `chatml`, `llama3`, ...)."""
    out = (ctypes.c_char_p * 256)()
    n = llama_cpp.llama_chat_builtin_templates(out, 256)
    return [out[i].decode() for i in range(min(n, 256))]


def apply_builtin_template(name: str, messages: ChatMessages) -> str:
    """Render messages with one of llama.cpp's built-in templates, ending with the assistant's turn opened."""
    encoded = [(m["role"].encode(), m["content"].encode()) for m in messages]  # kept alive during the call
    chat = (llama_cpp.llama_chat_message * len(encoded))()
    for i, (role, content) in enumerate(encoded):
        chat[i].role = role
        chat[i].content = content
    size = 2 * sum(len(r) + len(c) for r, c in encoded) + 256
    for _ in range(2):  # the first call reports the size it needs when the buffer is short
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(encoded), True, buf, size)
        if n < 0:
            raise LocalspecError(f"llama.cpp built-in chat template {name!r} failed (code {n})")
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n
    raise LocalspecError(f"llama.cpp built-in chat template {name!r} kept asking for a larger buffer")


def jinja_chat_renderer(template: str, bos_token: str, eos_token: str, source: str) -> Callable[..., str]:
    """A GGUF's Jinja chat template, rendered by llama-cpp-python's sandboxed formatter (a hostile template cannot
    reach Python). Parse errors become a LocalspecError naming `source`. Keyword arguments of the renderer reach the
    template as variables (the formatter passes them through): Qwen3's `enable_thinking`."""
    import jinja2
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    try:
        formatter = Jinja2ChatFormatter(template=template, eos_token=eos_token, bos_token=bos_token,
                                        add_generation_prompt=True)
    except jinja2.TemplateError as exc:
        raise LocalspecError(f"chat template ({source}) does not parse: {exc}") from None
    return lambda messages, **variables: formatter(messages=messages, **variables).prompt


SEQUENCE_BATCH_NOISE = 0.5  # logits: above this, a GPU's multi-sequence batch is wrong, not kernel rounding
MAX_OUTPUTS_PER_DECODE = 64  # a verify batch is at most 33 tokens (k <= 32); headroom for the device sampler


@dataclass(frozen=True, slots=True)
class TopK:
    """Per output row, the top candidates selected on the device: no full-vocabulary copy, no host top-k."""

    ids: np.ndarray  # (rows, k) int32; k = 1 with the device's greedy sampler
    logits: np.ndarray  # (rows, k) float32 (zeros with the greedy sampler: only the argmax is known)


@dataclass(frozen=True, slots=True)
class Sampled:
    """Per output row, a token drawn on the device by the `DeviceDist` chain (plain decoding at T > 0)."""

    tokens: np.ndarray  # (rows,) int32


def _as_scores(raw: np.ndarray | TopK | Sampled | None, hidden: np.ndarray | None = None) -> Scores | None:
    """What the decode made, as the one type callers see."""
    if raw is None or isinstance(raw, np.ndarray):
        return None if raw is None else Scores(raw, hidden=hidden)
    if isinstance(raw, TopK):
        return Scores(raw.logits, ids=raw.ids, hidden=hidden)
    return Scores(None, drawn=raw.tokens, hidden=hidden)


DecodeItem = tuple[int, Sequence[int], int, bool]  # (sequence id, tokens, first position, a row for every token)
Chunk = tuple[int, int, int]  # (item, its first token in this decode, tokens)


@dataclass(slots=True)
class _Run:
    """One sequence's consecutive entries of a llama_decode call, and which of its rows an item wants."""

    seq: int
    pos: int  # position of the first token
    tokens: list[int]
    outputs: list[bool]
    item: int = -1  # the item whose rows these are (-1: padding only)
    rows_at: int = 0  # where in the run the item's rows start
    rows: int = 0
    real: int | None = None  # how many of the tokens are the item's (None: all; the rest pad a covering call)


def ubatch_split(layout: Sequence[tuple[int, int]], n_ubatch: int) -> list[list[Chunk]]:
    """The ubatches llama.cpp makes of one `llama_decode` whose batch holds, in this order, `count` tokens of each
    (sequence, count) of `layout` (distinct sequences), in a context with one KV stream per sequence
    (`kv_unified = false`): `llama_batch_allocr::split_equal(n_ubatch, sequential = true)` in src/llama-batch.cpp
    of llama-cpp-python 0.3.36's llama.cpp. A ubatch takes, starting from the first sequence with tokens left,
    the sequences whose ids follow each other (id + 1) in batch order, and the same number of tokens from each
    (the fewest any has left, at most n_ubatch in all). Each ubatch: (layout index, first token, tokens) per
    sequence in it, in batch order."""
    left = [count for _, count in layout]
    done = [0] * len(layout)
    ubatches = []
    while True:
        chosen: list[int] = []
        for i, (seq, _) in enumerate(layout):
            if left[i] and (not chosen or seq == layout[chosen[-1]][0] + 1):
                chosen.append(i)
        if not chosen:
            return ubatches
        take = max(1, min(min(left[i] for i in chosen), n_ubatch // len(chosen)))
        ubatches.append([(i, done[i], take) for i in chosen])
        for i in chosen:
            left[i] -= take
            done[i] += take


def whole_plan(layout: Sequence[tuple[int, int]], n_batch: int) -> list[list[Chunk]]:
    """`decode_plan` for a model with a recurrent state: every item's tokens in one call (an item longer than
    n_batch, a prompt, in n_batch chunks of its own), calls of sequences with consecutive ids and as many tokens
    each. llama.cpp can roll a recurrent state back only within the sequence's last ubatch (its snapshots), so a
    verify's tokens must never be split; and a ubatch of a recurrent model holds equal runs of consecutive
    sequences (`split_equal`), so each call is still exactly one ubatch."""
    live = sorted((i for i, (_, count) in enumerate(layout) if count > 0), key=lambda i: layout[i][0])
    calls: list[list[Chunk]] = []
    group: list[int] = []

    def close() -> None:
        if group:
            calls.append([(i, 0, layout[i][1]) for i in group])
            group.clear()

    for i in live:
        seq, count = layout[i]
        if count > n_batch:
            close()
            calls.extend([[(i, first, min(n_batch, count - first))] for first in range(0, count, n_batch)])
            continue
        if group and (seq != layout[group[-1]][0] + 1 or count != layout[group[-1]][1]
                      or (len(group) + 1) * count > n_batch):
            close()
        group.append(i)
    close()
    return calls


def decode_plan(layout: Sequence[tuple[int, int]], n_batch: int, streams: bool) -> list[list[Chunk]]:
    """How `LlamaModel` decodes items of (sequence, token count): a list of `llama_decode` calls, each a list of
    (item, first token, tokens). Every call is exactly one llama.cpp ubatch, so no decode depends on how
    llama.cpp splits a batch and maps rows back: with backend sampler chains on several sequences, rows of a
    decode split into several ubatches come back holding other rows' candidates (docs/upstream.md). With one KV
    stream per sequence (`streams`) the items go in ascending sequence order, which makes the fewest ubatches
    (`ubatch_split`); in a context of one sequence they go in order, n_batch tokens a call."""
    live = [i for i, (_, count) in enumerate(layout) if count > 0]
    if not streams:
        calls: list[list[Chunk]] = [[]]
        room = n_batch
        for i in live:
            done, count = 0, layout[i][1]
            while done < count:
                if room == 0:
                    calls.append([])
                    room = n_batch
                take = min(room, count - done)
                calls[-1].append((i, done, take))
                done += take
                room -= take
        return calls if calls[0] else []
    if len({layout[i][0] for i in live}) != len(live):
        raise ValueError("decode_plan: one item per sequence")
    live.sort(key=lambda i: layout[i][0])
    return [[(live[j], first, take) for j, first, take in ubatch]
            for ubatch in ubatch_split([layout[i] for i in live], n_batch)]


class _Memory:
    """Rows of 4-byte values in llama.cpp's memory, `stride` bytes apart, for `np.array` to copy (numpy's array
    interface: unlike np.ctypeslib.as_array, no ctypes array type is built per call)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: tuple[int, int], stride: int, typestr: str) -> None:
        self.__array_interface__ = {"data": (address, True), "shape": shape, "strides": (stride, 4),
                                    "typestr": typestr, "version": 3}


def _buffer(data: bytearray) -> ctypes.Array:
    """A bytearray as the uint8 array llama.cpp's state calls take, without a copy."""
    return (ctypes.c_uint8 * len(data)).from_buffer(data)


def _joined(pieces: list[np.ndarray | TopK | Sampled]) -> np.ndarray | TopK | Sampled | None:
    """One item's scores from the decodes its rows came from, in row order."""
    if len(pieces) < 2:
        return pieces[0] if pieces else None
    first = pieces[0]
    if isinstance(first, TopK):
        return TopK(np.concatenate([p.ids for p in pieces]), np.concatenate([p.logits for p in pieces]))
    if isinstance(first, Sampled):
        return Sampled(np.concatenate([p.tokens for p in pieces]))
    return np.concatenate(pieces)


class LlamaModel:
    """One GGUF model with its context of `n_seq` sequences (slots), each with a KV region of its own of `n_ctx`
    cells. Positions are managed by the caller (the engine)."""

    def __init__(
        self,
        path: Path,
        *,
        n_ctx: int,
        n_gpu_layers: int = -1,
        n_batch: int = 512,
        kv_type: str = "f16",
        n_threads: int = 0,
        device_top_k: int = 0,
        devices: Sequence[BackendDevice] | None = None,
        split_mode: str = "layer",
        tensor_split: Sequence[float] = (),
        main_gpu: int = 0,
        n_seq: int = 1,
        flash_attn: str = "auto",
        rewind: int = 0,
    ) -> None:
        """`devices`: where the offloaded layers go (None = every local GPU; [] = the CPU only), `split_mode` how
        they share them, `tensor_split` each one's proportion, `main_gpu` an index into `devices`. `rewind`: how
        many tokens a recurrent or hybrid model must be able to roll back (the longest draft); llama.cpp keeps that
        many snapshots of its state (`n_rs_seq`), and a model it cannot roll back is refused (RollbackError)."""
        _init_backend()
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: model file not found")
        if kv_type not in KV_TYPES:
            raise ModelLoadError(f"kv type {kv_type!r}: choose one of {', '.join(KV_TYPES)}")
        if flash_attn not in FLASH_ATTN:
            raise ModelLoadError(f"flash attention {flash_attn!r}: choose one of {', '.join(FLASH_ATTN)}")
        self.model = None
        self.ctx = None
        self._batch = None
        self._chains: dict[int, ctypes.c_void_p] = {}  # the device sampler chain of each sequence that has one

        # The last wall before llama.cpp's loader, which aborts the process (GGML_ASSERT) on some out-of-range
        # hyperparameters instead of failing: such a header stops here with one line (cached, so cheap).
        read_header(self.path).hparams  # noqa: B018

        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        # Always an explicit, NULL-terminated device list: llama.cpp's default (NULL) takes every registered
        # device, RPC servers included, and this model may not be meant for them.
        self.devices = tuple(gpu_devices() if devices is None else devices)
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
        header = read_header(self.path)
        mparams_mtp = bool(header.nextn_layers) and mtp_unsupported() is None
        if mparams_mtp:
            mparams.load_mtp = True  # the MTP blocks an `MtpHead` runs (the memory estimate counts them anyway)
        self.model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.model:
            raise ModelLoadError(f"{self.path}: llama.cpp could not load this model (LOCALSPEC_DEBUG=1 shows why)")

        threads = n_threads or default_threads()
        cparams = llama_cpp.llama_context_default_params()
        # One KV region per sequence (not a unified cache): a slot's cells sit where they would sit alone, so
        # what else runs cannot change its numbers, and a slot cannot fill another's context.
        cparams.n_seq_max = n_seq
        cparams.kv_unified = False
        cparams.n_ctx = n_ctx * n_seq
        if n_seq > 1:
            # A multiple of n_seq: llama.cpp's worst-case graph then gives every sequence's chain an output row,
            # so the memory plan it leaves behind frees no sampler output (see _covering_calls).
            n_batch = -(-n_batch // n_seq) * n_seq
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
        # None: a KV cache rewinds anywhere; a recurrent state only as far as llama.cpp keeps snapshots of it.
        self.rewind_depth: int | None = None
        if self.recurrent:
            self.rewind_depth = int(llama_cpp.llama_n_rs_seq(self.ctx)) if rewind > 0 else 0
            if self.rewind_depth < rewind:  # llama.cpp clamps n_rs_seq to 0 for the architectures it cannot roll back
                self.close()
                raise RollbackError(f"{self.path.name}: llama.cpp cannot roll back a {header.arch} model's recurrent "
                                    "state, which speculative decoding needs (plain decoding works: --n-draft 0)")
        self._last_run: dict[int, int] = {}  # per sequence: its tokens in its last llama_decode (recurrent only)
        self._pending: set[int] = set()  # sequences with a snapshot rollback not yet decoded past (single-use)
        self._checkpoints: dict[int, tuple[int, ctypes.Array]] = {}  # per sequence: (its length, the saved state)
        self._hidden_seqs: set[int] = set()  # sequences whose decodes return hidden rows (`want_hidden`)
        self._hidden: list[np.ndarray | None] = []  # per item of the last _decode_batched: its hidden rows
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
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
        # MTP blocks loaded with the model (`MtpHead` runs them): the drafter `mtp` exists only with them.
        self.mtp_layers = int(llama_cpp.llama_model_n_layer_nextn(self.model)) if mparams_mtp else 0
        self.n_gpu_layers = n_gpu_layers
        # Where the layers run decides what is exact and what is fast (batch logits, graph capture): docs/gpu.md.
        # RPC devices count as GPUs, as ggml reports them (a lent machine is usually lent for its GPU).
        self.on_gpu = n_gpu_layers != 0 and any(d.kind in ("gpu", "igpu", "rpc") for d in self.devices)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self.vocab))
        pad = int(llama_cpp.llama_vocab_pad(self.vocab))
        self.unknown_token = pad if 0 <= pad < self.n_vocab else max(self.bos, 0)

        # One batch for the model's life; numpy views let us fill it without per-token ctypes calls.
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(n_batch,))
        self._out = np.ctypeslib.as_array(self._batch.logits, shape=(n_batch,))
        np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n_batch,))[:] = 1
        self._seq = np.zeros(n_batch, dtype=np.int32)  # what each batch entry's seq_id holds (set only on change)
        for i in range(n_batch):
            self._batch.seq_id[i][0] = 0
        self.decodes = 0  # llama_decode calls so far, each one ubatch
        self.replans = 0  # of them, those llama.cpp was made to plan afresh before (`_decode`)
        self._dirty_plan: tuple[int, ...] | None = None  # the last graph's layout, if its plan had freed sampler nodes
        self._n_embd = int(llama_cpp.llama_model_n_embd(self.model))
        self._n_embd_out = int(llama_cpp.llama_model_n_embd_out(self.model))
        self._cells_per_seq = int(llama_cpp.llama_n_ctx_seq(self.ctx))

        # llama.cpp's backend sampling: a top-k sampler chain that runs inside the decode graph (on the GPU when
        # the model is offloaded), so each output row comes back as k candidates instead of n_vocab logits.
        self.device_top_k = device_top_k
        self._modes: dict[int, str | DeviceDist] = {}  # each sequence's device sampler (absent: full logits)
        if device_top_k > 0 and not self.use_device_sampler("top_k"):
            self.device_top_k = 0  # this backend cannot run it: full logits it is
        self.batches_sequences = True
        self.sequence_batch_error = 0.0
        if n_seq > 1:
            self.sequence_batch_error = self._sequence_batch_error()
            # On the CPU a sequence must score bit for bit as alone; a GPU's kernels differ with the batch shape
            # anyway (docs/gpu.md), so there only a structural error (whole logits off) turns batching off.
            self.batches_sequences = self.sequence_batch_error <= (SEQUENCE_BATCH_NOISE if self.on_gpu else 0.0)

    # -- decoding -------------------------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], start_pos: int, all_logits: bool = False,
               seq: int = 0) -> Scores | None:
        """Append `tokens` at positions start_pos.. to sequence `seq`'s KV cells and wait for the scores.

        Returns the `Scores` the sequence's device sampler made (full logits are a (rows, n_vocab) float32 view
        into llama.cpp's buffer, valid until the next decode): one row per token with `all_logits`, else one row
        for the last token; None for no tokens. Prompt-sized inputs are split into n_batch chunks.
        """
        raw = self._decode_batched([(seq, tokens, start_pos, all_logits)])[0]
        return _as_scores(raw, self._hidden[0])

    def decode_many(self, items: Sequence[DecodeItem]) -> list[Scores | None]:
        """Several sequences' tokens at once (one item per sequence); the scores of each item as `decode` returns
        them. With device sampler chains on several sequences, each call covers every sequence that has one
        (`_covering_calls`); otherwise the items go in ascending sequence order, one ubatch a call
        (`decode_plan`). A model whose multi-sequence batches are not exact here (`batches_sequences`) decodes
        the items one after another."""
        if self.batches_sequences or len({item[0] for item in items}) < 2:
            raws = self._decode_batched(items, cover=True)
            return [_as_scores(r, h) for r, h in zip(raws, self._hidden, strict=True)]
        results, hidden = [], []
        for item in items:
            results.append(self._decode_batched([item])[0])
            hidden.append(self._hidden[0])
        for i, scores in enumerate(results[:-1]):
            if isinstance(scores, np.ndarray) and scores.base is not None:
                results[i] = scores.copy()  # a view into llama.cpp's buffer, which the next decode reuses
        return [_as_scores(r, h) for r, h in zip(results, hidden, strict=True)]

    def _decode_batched(self, items: Sequence[DecodeItem],
                        cover: bool = False) -> list[np.ndarray | TopK | Sampled | None]:
        for _, tokens, start_pos, all_logits in items:
            if start_pos + len(tokens) > self.n_ctx:
                raise ContextFullError(
                    f"{self.path.name}: {start_pos + len(tokens)} tokens do not fit the context of {self.n_ctx}")
            if all_logits and len(tokens) > self.n_batch:
                raise DecodeError(
                    f"{self.path.name}: {len(tokens)} rows of scores do not fit one batch of {self.n_batch}")
        covering = self._covering_calls(items) if cover and self.n_seq > 1 and self._modes else None
        calls, trims = covering or (self._plain_calls(items), [])
        pieces: list[list[np.ndarray | TopK | Sampled]] = [[] for _ in items]
        hidden: list[list[np.ndarray]] = [[] for _ in items]
        self._hidden = [None] * len(items)
        views: list[tuple[int, int]] = []  # (item, piece): views into llama.cpp's buffer, which the next decode reuses
        try:
            for runs in calls:
                for item, piece in views:
                    pieces[item][piece] = pieces[item][piece].copy()
                views.clear()
                wanted: list[tuple[int, int, int, int]] = []  # (item, sequence, first batch index, rows)
                n = 0
                outputs: dict[int, int] = {}  # output rows per sequence
                for run in runs:
                    take = len(run.tokens)
                    self._tok[n : n + take] = run.tokens
                    self._pos[n : n + take] = np.arange(run.pos, run.pos + take)
                    if self.n_seq > 1:  # (with one sequence every entry's seq_id is 0 for good)
                        for i in np.flatnonzero(self._seq[n : n + take] != run.seq):
                            self._batch.seq_id[n + i][0] = run.seq
                        self._seq[n : n + take] = run.seq
                    self._out[n : n + take] = run.outputs
                    outputs[run.seq] = sum(run.outputs)
                    if run.rows:
                        wanted.append((run.item, run.seq, n + run.rows_at, run.rows))
                    n += take
                self._decode(n, tuple(outputs.get(seq, 0) for seq in sorted(self._modes)))
                if self.recurrent:
                    for run in runs:
                        self._last_run[run.seq] = len(run.tokens)
                        self._pending.discard(run.seq)
                if self._hidden_seqs:
                    self._copy_hidden(runs, hidden)
                rows_only = covering is None and (not self._modes or not any(w[1] in self._modes for w in wanted))
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
                        pieces[item].append(self._rows(seq, first, rows))
        finally:
            for seq, keep in trims:  # the stand-in tokens leave the caches again, like rejected drafts
                llama_cpp.llama_memory_seq_rm(self.memory, seq, keep, -1)
        self._hidden = [np.concatenate(h) if h else None for h in hidden]
        return [_joined(p) for p in pieces]

    def _copy_hidden(self, runs: Sequence[_Run], hidden: list[list[np.ndarray]]) -> None:
        """Each wanted item's hidden rows of this call: one per token (llama.cpp's nextn rows, by batch index)."""
        base = llama_cpp_ext.llama_get_embeddings_nextn(self.ctx)
        if not base:
            raise DecodeError(f"{self.path.name}: llama.cpp returned no hidden states")
        n = 0
        for run in runs:
            take = len(run.tokens)
            if run.item >= 0 and run.seq in self._hidden_seqs:
                rows = np.ctypeslib.as_array(base, shape=(n + take, self._n_embd_out))[n : n + take]
                hidden[run.item].append(rows[: take if run.real is None else run.real].copy())
            n += take

    def _plain_calls(self, items: Sequence[DecodeItem]) -> list[list[_Run]]:
        """`decode_plan`'s calls: each item's tokens, an output on every one of them with `all_logits`, else on
        its last."""
        calls = []
        layout = [(seq, len(tokens)) for seq, tokens, _, _ in items]
        plan = whole_plan(layout, self.n_batch) if self.recurrent else decode_plan(layout, self.n_batch,
                                                                                   self.n_seq > 1)
        for chunks in plan:
            runs = []
            for item, first, take in chunks:
                seq, tokens, start_pos, all_logits = items[item]
                last = first + take == len(tokens)
                outputs = [all_logits] * take
                rows = take if all_logits else int(last)
                if last:
                    outputs[-1] = True
                runs.append(_Run(seq, start_pos + first, list(tokens[first : first + take]), outputs, item,
                                 take - rows, rows))
            calls.append(runs)
        return calls

    def _covering_calls(self, items: Sequence[DecodeItem]) -> tuple[list[list[_Run]], list[tuple[int, int]]] | None:
        """Calls in which every sequence with a device sampler chain has an output row, each call one ubatch.

        Why: llama.cpp computes every attached chain in every decode graph, on a row of its own for the sequences
        in the ubatch and on a stand-in row, whose results nobody reads, for the others. ggml then reuses the
        previous graph's memory plan for a new graph of the same size, and when the two graphs differ in which
        chains are active, an output of the new one can sit where the old plan let a later node write: rows
        come back holding other rows' candidates (docs/upstream.md). With every chain active in every graph,
        no chain's output is ever freed, so no plan can put a node over one.

        So each call holds the same number of tokens of every sequence from the lowest to the highest one that
        has a chain or an item (consecutive ids, equal lengths: one ubatch): an item's own tokens, then copies
        of its last token; a sequence without an item gets stand-in tokens after its last cell. The padding is
        computed like rejected drafts (positions after every real one, so no real row sees it) and removed
        from the caches after the decode. Returns (calls, [(sequence, first position to remove)]), or None when
        the padding does not fit (more sequences than n_batch, or a sequence at the end of its context)."""
        live = {seq: i for i, (seq, tokens, _, _) in enumerate(items) if len(tokens)}
        if not live:
            return [], []
        if len(live) != sum(1 for _, tokens, _, _ in items if len(tokens)):
            raise ValueError("decode_many: one item per sequence")
        seqs = set(live) | set(self._modes)
        lo, hi = min(seqs), max(seqs)
        span = hi - lo + 1
        length = max(len(items[i][1]) for i in live.values())
        per_call = self.n_batch // span
        if per_call == 0:
            return None
        starts = {}
        for seq in range(lo, hi + 1):
            if seq in live:
                start = items[live[seq]][2]
            else:  # after its last cell
                start = int(llama_cpp.llama_memory_seq_pos_max(self.memory, seq)) + 1
            if start + length > self._cells_per_seq:
                return None
            starts[seq] = start
        calls = []
        for t0 in range(0, length, per_call):
            take = min(per_call, length - t0)
            runs = []
            for seq in range(lo, hi + 1):
                if seq in live:
                    item = live[seq]
                    _, tokens, _, all_logits = items[item]
                    real = list(tokens[t0 : t0 + take])
                    outputs = [all_logits] * len(real) + [False] * (take - len(real))
                    rows_at, rows = 0, (len(real) if all_logits else 0)
                    if not all_logits and t0 <= len(tokens) - 1 < t0 + take:
                        rows_at, rows = len(tokens) - 1 - t0, 1
                        outputs[rows_at] = True
                    padded = real + [tokens[-1]] * (take - len(real))
                else:
                    item, rows_at, rows = -1, 0, 0
                    outputs = [False] * take
                    padded = [self.unknown_token] * take
                if seq in self._modes and not any(outputs):
                    outputs[-1] = True  # a row nobody reads: keeps this sequence's chain active in the graph
                runs.append(_Run(seq, starts[seq] + t0, padded, outputs, item, rows_at, rows,
                                 len(real) if item >= 0 else None))
            calls.append(runs)
        trims = [(seq, starts[seq] + (len(items[live[seq]][1]) if seq in live else 0))
                 for seq in range(lo, hi + 1)
                 if (len(items[live[seq]][1]) if seq in live else 0) < length]
        return calls, trims

    def _decode(self, n: int, chains: tuple[int, ...]) -> None:
        """llama_decode of the batch's first n entries; `chains` is the output rows of each sequence that has a
        device sampler chain, in sequence order (0: the chain runs on a stand-in row).

        A graph where some chain runs on a stand-in row (or a sampling chain with intermediate results) leaves
        ggml a memory plan with freed sampler nodes; a next graph of the same size but another layout would
        reuse that plan and could overwrite its own outputs. Then llama.cpp is made to plan afresh before the
        next graph of another layout (a neutral control-vector call that makes it reserve its graphs again).
        One row alone is safe when every chain is the same kind (the same nodes, so both graphs' sampler nodes
        line up): the only node computed after that row's result is its own consumer, which ggml places before
        it frees the result."""
        dist = any(isinstance(mode, DeviceDist) for mode in self._modes.values())
        same_kind = len({mode if isinstance(mode, str) else "dist" for mode in self._modes.values()}) == 1
        if (self.n_seq > 1 and self._dirty_plan is not None and chains != self._dirty_plan
                and (sum(chains) > 1 or dist or not same_kind)):
            llama_cpp.llama_set_adapter_cvec(self.ctx, None, 0, self._n_embd, -1, -1)
            self.replans += 1
        self._batch.n_tokens = n
        self.decodes += 1
        rc = llama_cpp.llama_decode(self.ctx, self._batch)
        self._dirty_plan = chains if 0 in chains or dist else None
        if rc != 0:
            where = ", ".join(f"sequence {self._seq[i]} position {self._pos[i]}" for i in (0, n - 1))
            raise DecodeError(f"{self.path.name}: llama_decode failed with code {rc} ({where})"
                              + (" (no KV slot: the context is full)" if rc == 1 else ""))

    def _sequence_batch_error(self) -> float:
        """The largest logit difference between two sequences decoded in one batch and each decoded alone.

        llama.cpp runs consecutive sequences of a non-unified cache as streams of one ubatch, and for some
        architectures that graph is not the single-sequence one: Gemma 3 (sliding-window attention) scores
        differ by up to 10 logits on the CPU in llama-cpp-python 0.3.36, where Llama-style models match bit
        for bit. Measured once at load on two short made-up sequences; both are cleared again."""
        modes = dict(self._modes)
        for seq in modes:
            self.use_device_sampler(None, seq)
        rng = np.random.default_rng(0)
        # Made-up text: any ids but the special ones at either end (BOS is the last id of GPT-2-style vocabularies).
        ids = np.setdiff1d(np.arange(min(self.n_vocab, 20_000)), [self.bos, self.eos])
        probes = [rng.choice(ids, size=n).tolist() for n in (9, 5)]
        try:
            alone = []
            for seq, tokens in enumerate(probes):
                alone.append(self._decode_batched([(seq, tokens, 0, True)])[0].copy())
                self.clear(seq)
            together = self._decode_batched([(seq, tokens, 0, True) for seq, tokens in enumerate(probes)])
            return max(float(np.abs(t - a).max()) for t, a in zip(together, alone, strict=True))
        finally:
            for seq in range(len(probes)):
                self.clear(seq)
            for seq, mode in modes.items():
                self.use_device_sampler(mode, seq)

    def _rows(self, seq: int, first: int, rows: int) -> np.ndarray | TopK | Sampled:
        """Sequence `seq`'s scores at batch entries first.., as its device sampler made them (or full logits)."""
        mode = self._modes.get(seq)
        indices = range(first, first + rows)
        if mode is None:
            out = np.empty((rows, self.n_vocab), dtype=np.float32)
            for r, i in enumerate(indices):
                out[r] = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
            return out
        if mode == "greedy":
            ids = np.array([[llama_cpp.llama_get_sampled_token_ith(self.ctx, i)] for i in indices], dtype=np.int32)
            return TopK(ids, np.zeros(ids.shape, dtype=np.float32))
        if isinstance(mode, DeviceDist):
            tokens = np.array([llama_cpp.llama_get_sampled_token_ith(self.ctx, i) for i in indices], dtype=np.int32)
            # The context allows several outputs per sequence, which makes llama.cpp's dist sampler
            # transactional: each decode draws from a copy of its RNG, and only an accepted token advances it.
            # Plain decoding emits every draw, so each is committed here; without this every token would be
            # drawn with the same uniform number.
            for token in tokens.tolist():
                llama_cpp.llama_sampler_accept(self._chains[seq], token)
            return Sampled(tokens)
        return self._device_top_k(first, rows)

    def _device_top_k(self, first: int, rows: int) -> TopK:
        k = self.device_top_k
        ctx = self.ctx
        last = first + rows - 1
        for i in {first, last}:  # (one chain makes every row: its first and last stand for all)
            count = llama_cpp.llama_get_sampled_logits_count_ith(ctx, i)
            if count != k:
                raise DecodeError(f"{self.path.name}: the device sampler returned {count} candidates, not {k}")
        if rows > 1:
            # A verify's rows are consecutive outputs, n_vocab entries apart in llama.cpp's buffers: two strided
            # copies instead of two per row (this is on every T > 0 round's path).
            ids_at = ctypes.addressof(llama_cpp.llama_get_sampled_candidates_ith(ctx, first).contents)
            logits_at = ctypes.addressof(llama_cpp.llama_get_sampled_logits_ith(ctx, first).contents)
            stride = 4 * self.n_vocab
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

    def use_device_sampler(self, mode: str | DeviceDist | None, seq: int = 0) -> bool:
        """Select what llama.cpp computes on the device for sequence `seq` after each decode: "greedy" (the argmax
        token of each row), "top_k" (each row's top `device_top_k` candidates), a `DeviceDist` chain (one sampled
        token per row) or None (full logits to the host). True if on; False when this build cannot run the chain.

        llama.cpp initialises a chain for the device once, so each switch attaches a fresh chain (and the next
        decode rebuilds its graph: callers switch per generation, not per round).
        """
        if not self.device_top_k or (self.recurrent and self.n_seq > 1):
            # (Several sequences' chains need covering calls, whose stand-in tokens a recurrent state cannot undo.)
            mode = None
        if mode == self._modes.get(seq):
            return mode is not None
        self._dirty_plan = None  # llama.cpp plans afresh after any change of chains (it reserves its graphs again)
        if seq in self._chains:
            llama_cpp.llama_set_sampler(self.ctx, seq, None)
            llama_cpp.llama_sampler_free(self._chains.pop(seq))
            del self._modes[seq]
        if mode is not None:
            chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
            for sampler in _device_samplers(mode, self.device_top_k):
                llama_cpp.llama_sampler_chain_add(chain, sampler)
            if not llama_cpp.llama_set_sampler(self.ctx, seq, chain):
                llama_cpp.llama_sampler_free(chain)
                return False
            self._chains[seq] = chain
            self._modes[seq] = mode
        return mode is not None

    def full_row(self, token: int, pos: int, seq: int = 0) -> np.ndarray:
        """Sequence `seq`'s full logits after `token` at `pos`, whatever its device sampler: its cells from `pos`
        on are dropped and `token` decoded again there with the sampler set aside. llama.cpp copies a row's raw
        logits only when some row of the ubatch belongs to a sequence without a device sampler
        (`needs_raw_logits` in llama-context.cpp), so a row the sampler ran on cannot be read whole afterwards.
        Switching the sampler makes llama.cpp plan its graphs again: for the rare row only."""
        mode = self._modes.get(seq)
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
        if isinstance(self._modes.get(seq), DeviceDist):
            llama_cpp.llama_sampler_reset(self._chains[seq])

    def truncate(self, n_keep: int, seq: int = 0) -> int:
        """Drop every cell of sequence `seq` at position >= n_keep (the one rewind primitive); returns how many
        cells it kept. A KV cache keeps n_keep. A recurrent state rewinds exactly only through llama.cpp's
        snapshots: at most `rewind_depth` tokens, fewer than its last decode held, once per decode. Further back it
        goes to its checkpoint (`checkpoint`) or, without one at or before n_keep, to nothing, and the caller
        decodes the rest again. (llama.cpp's own seq_rm says yes to a rollback past the last decode and then reads
        a stale snapshot: docs/upstream.md; hence the bookkeeping here.)"""
        if not self.recurrent:
            if not llama_cpp.llama_memory_seq_rm(self.memory, seq, n_keep, -1):
                raise DecodeError(f"{self.path.name}: this model's memory cannot be rewound to position {n_keep}")
            return n_keep
        have = int(llama_cpp.llama_memory_seq_pos_max(self.memory, seq)) + 1
        if n_keep >= have:
            return n_keep
        back = have - n_keep
        depth = min(self.rewind_depth or 0, self._last_run.get(seq, 0) - 1)
        if n_keep > 0 and back <= depth and seq not in self._pending:
            if not llama_cpp.llama_memory_seq_rm(self.memory, seq, n_keep, -1):
                raise DecodeError(f"{self.path.name}: llama.cpp refused to roll sequence {seq} back {back} tokens")
            self._pending.add(seq)
            kept = n_keep
        else:
            kept = self._restore(seq, n_keep)
        saved = self._checkpoints.get(seq)
        if saved is not None and saved[0] > kept:
            del self._checkpoints[seq]  # its cells are gone: what it saved no longer follows from them
        return kept

    def _restore(self, seq: int, n_keep: int) -> int:
        """Back to the sequence's checkpoint if it is at or before n_keep (its length), else to nothing."""
        saved = self._checkpoints.get(seq)
        self._pending.discard(seq)
        self._last_run.pop(seq, None)
        if saved is not None and saved[0] <= n_keep:
            length, buf = saved
            # The recurrent part is the checkpoint's; the attention cells after it go (the recurrent part's own
            # seq_rm is then a no-op: its cell ends at the checkpoint).
            if (llama_cpp.llama_state_seq_set_data_ext(self.ctx, buf, len(buf), seq, _CHECKPOINT_FLAGS) == len(buf)
                    and llama_cpp.llama_memory_seq_rm(self.memory, seq, length, -1)):
                return length
        llama_cpp.llama_memory_seq_rm(self.memory, seq, 0, -1)
        self._checkpoints.pop(seq, None)
        return 0

    def checkpoint(self, seq: int = 0) -> None:
        """Save a recurrent sequence's state (its recurrent part, kept on its device: llama.cpp's
        PARTIAL_ONLY | ON_DEVICE) at its current length, replacing the last checkpoint; a KV cache needs none."""
        if not self.recurrent:
            return
        length = int(llama_cpp.llama_memory_seq_pos_max(self.memory, seq)) + 1
        size = llama_cpp.llama_state_seq_get_size_ext(self.ctx, seq, _CHECKPOINT_FLAGS)
        buf = (ctypes.c_uint8 * max(size, 1))()
        self._checkpoints.pop(seq, None)
        if length > 0 and size and llama_cpp.llama_state_seq_get_data_ext(self.ctx, buf, size, seq,
                                                                         _CHECKPOINT_FLAGS) == size:
            self._checkpoints[seq] = (length, buf)

    def clear(self, seq: int | None = None) -> None:
        """Forget every sequence's KV cells, or only those of `seq`."""
        if seq is None:
            llama_cpp.llama_memory_clear(self.memory, True)
            self._checkpoints.clear()
            self._pending.clear()
            self._last_run.clear()
        else:
            self.truncate(0, seq)

    def want_hidden(self, seq: int, on: bool) -> None:
        """Whether sequence `seq`'s decodes return the hidden state after each token (`Scores.hidden`: what an MTP
        head drafts from; llama.cpp's nextn embeddings, the final norm's output, one row per token)."""
        was = bool(self._hidden_seqs)
        if on:
            if llama_cpp_ext is None:
                raise ModelLoadError(mtp_unsupported() or "no nextn embeddings in this llama-cpp-python")
            self._hidden_seqs.add(seq)
        else:
            self._hidden_seqs.discard(seq)
        if bool(self._hidden_seqs) != was:  # (a context-wide switch: only when it changes)
            llama_cpp_ext.llama_set_embeddings_nextn(self.ctx, bool(self._hidden_seqs), False)

    # -- a sequence's state: the prompt cache and slot files -------------------------------------------------

    def save_state(self, seq: int = 0) -> bytearray:
        """Sequence `seq`'s cells as llama.cpp serialises them (`llama_state_seq_get_data`): positions, keys and
        values (of sliding-window layers only the window's last positions), or a recurrent state as it is now."""
        size = int(llama_cpp.llama_state_seq_get_size(self.ctx, seq))
        data = bytearray(size)
        if size and llama_cpp.llama_state_seq_get_data(self.ctx, _buffer(data), size, seq) != size:
            raise DecodeError(f"{self.path.name}: llama.cpp could not save sequence {seq}'s state")
        return data

    def load_state(self, data: bytearray, seq: int = 0) -> bool:
        """Replace sequence `seq`'s cells with a state `save_state` made on this model (with as many sequences);
        False when llama.cpp refuses it, and the sequence is then empty."""
        ok = bool(data) and llama_cpp.llama_state_seq_set_data(self.ctx, _buffer(data), len(data), seq) == len(data)
        # A recurrent state's snapshots and checkpoint belonged to the cells it replaced: none serves any more.
        self._pending.discard(seq)
        self._last_run.pop(seq, None)
        self._checkpoints.pop(seq, None)
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
        if self.ctx:
            for seq in list(self._chains):
                self.use_device_sampler(None, seq)
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
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


# -- MTP heads: a model's NextN blocks in a context of their own -------------------------------------------------

MtpEntry = tuple[int, int, int, np.ndarray, bool]  # (sequence, token, position, hidden state before it, scored)


class MtpHead:
    """A model's MTP (NextN) blocks in a context of their own: llama.cpp's LLAMA_CONTEXT_TYPE_MTP over the target's
    own weights (loaded with `load_mtp`). At position p it reads token x_p and the target's hidden state after
    x_{p-1} (`Scores.hidden`) and scores x_{p+1}; its own hidden state there stands in for the target's at the next
    step (chained drafts). Its memory is a plain KV cache of its blocks: it rewinds to any position."""

    def __init__(self, target: LlamaModel, *, n_ctx: int, n_batch: int = 512, kv_type: str = "f16",
                 n_threads: int = 0, n_seq: int = 1, flash_attn: str = "auto") -> None:
        self.ctx = None
        self._batch = None
        why = mtp_unsupported()
        if why is not None:
            raise ModelLoadError(why)
        if not target.model or llama_cpp.llama_model_n_layer_nextn(target.model) <= 0:
            raise UsageError(f"{target.path.name} has no MTP layers (nextn_predict_layers): --drafter mtp needs a "
                             "model converted with them (an \"MTP\" GGUF)")
        cparams = llama_cpp.llama_context_default_params()
        cparams.ctx_type = getattr(llama_cpp, "LLAMA_CONTEXT_TYPE_MTP", 1)
        cparams.n_seq_max = n_seq
        cparams.kv_unified = False
        cparams.n_ctx = n_ctx * n_seq
        cparams.n_batch = cparams.n_ubatch = n_batch
        threads = n_threads or default_threads()
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
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(target.model))
        self.n_batch = min(n_batch, int(llama_cpp.llama_n_batch(self.ctx)))
        self.n_ctx = min(n_ctx, int(llama_cpp.llama_n_ctx_seq(self.ctx)))
        self.n_seq = n_seq
        self.on_gpu = target.on_gpu
        self._pos = llama_cpp.llama_pos(0)
        self.decodes = 0

    def decode(self, entries: Sequence[MtpEntry]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Decode the entries (each sequence's positions consecutive after its cells, in ascending sequence order)
        in n_batch chunks; per scored entry, in order: its logits (n_vocab,) and its own hidden state (n_embd,)."""
        out: list[tuple[np.ndarray, np.ndarray]] = []
        for first in range(0, len(entries), self.n_batch):
            out += self._decode_chunk(entries[first : first + self.n_batch])
        return out

    def _decode_chunk(self, entries: Sequence[MtpEntry]) -> list[tuple[np.ndarray, np.ndarray]]:
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
                scored.append(idx)
        rc = llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch)
        self.decodes += 1
        if rc != 0:
            raise DecodeError(f"{self.path.name}: the MTP head's decode failed with code {rc}"
                              + (" (no KV slot: the context is full)" if rc == 1 else ""))
        out = []
        for idx in scored:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
            hidden = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn_ith(self.ctx, idx),
                                           shape=(self.n_embd,))
            out.append((logits.copy(), hidden.copy()))
        return out

    def truncate(self, n_keep: int, seq: int = 0) -> None:
        if not llama_cpp.llama_memory_seq_rm(self.memory, seq, n_keep, -1):
            raise DecodeError(f"{self.path.name}: the MTP head's cells cannot be rewound to position {n_keep}")

    def clear(self, seq: int | None = None) -> None:
        if seq is None:
            llama_cpp.llama_memory_clear(self.memory, True)
        else:
            self.truncate(0, seq)

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_ext_free(self._batch)
            self._batch = None
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# -- grammars: llama.cpp's GBNF sampler as a token mask ---------------------------------------------------------

# llama_token_data as numpy sees it, so a whole candidate array is filled and read without per-token ctypes calls.
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)

def json_object_gbnf() -> str:
    """GBNF for any JSON object (OpenAI's `json_object`): llama.cpp's own json.gbnf, as llama-cpp-python ships it."""
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


def json_schema_gbnf(schema: dict, source: str) -> str:
    """A JSON schema → GBNF, by llama-cpp-python's port of llama.cpp's json_schema_to_grammar. Schemas it cannot
    convert (a remote $ref, a malformed keyword) are a GrammarError naming `source`."""
    import json

    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter raises bare ValueError/KeyError/TypeError on what it cannot read
        raise GrammarError(f"{source}: this JSON schema cannot be turned into a grammar: {exc}") from None


@contextlib.contextmanager
def _stderr_captured() -> Iterator[list[str]]:
    """What C code writes to file descriptor 2 inside the block, as the list's one string (after the block)."""
    import tempfile

    said: list[str] = []
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            said.append(sink.read(4096).decode("utf-8", errors="replace"))


class Grammar:
    """A GBNF grammar's state over one model's vocabulary (llama.cpp's grammar sampler): which tokens may come
    next (`legal`), and `accept` to advance by one token. `clone` copies the state, so a draft run can be masked
    position by position without touching the real state.

    Lazy (`trigger`, a literal marker such as `<tool_call>`): every token is legal until the emitted text holds the
    marker, and the grammar applies from the marker on (llama.cpp's lazy patterns, as llama-server does for tool
    calls). llama.cpp replays the text from the marker into the grammar when the trigger fires and aborts the
    process if that text breaks the grammar, so a token that would complete the marker with text the grammar
    forbids after it is illegal here (checked by tokenizing that text into a fresh, eager copy of the grammar)."""

    def __init__(self, model: LlamaModel, gbnf: str, source: str, *, trigger: str | None = None) -> None:
        self.model = model
        self.source = source
        self.n_vocab = model.n_vocab
        self.gbnf = gbnf
        self.trigger = trigger.encode() if trigger else None
        self.awaiting = bool(trigger)
        self._seen = b""  # while awaiting: the emitted text (bytes, as llama.cpp's trigger buffer holds it)
        self._sampler = None
        if trigger and not all(c.isalnum() or c in "<>_/:-" for c in trigger):
            raise GrammarError(f"{source}: a trigger is letters, digits and <>_/:- only (got {trigger!r})")
        # llama.cpp's GBNF parser prints its complaint to stderr itself (fprintf): caught here, it becomes part
        # of the one-line error instead of a second message around it.
        with _stderr_captured() as said:
            if trigger:
                pattern = f"^[\\s\\S]*?({trigger})[\\s\\S]*$".encode()  # from the first match on
                patterns = (ctypes.c_char_p * 1)(pattern)
                sampler = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
                    model.vocab, gbnf.encode(), b"root", patterns, 1, None, 0)
            else:
                sampler = llama_cpp.llama_sampler_init_grammar(model.vocab, gbnf.encode(), b"root")
        if not sampler:
            reason = said[0].strip().splitlines()[0] if said and said[0].strip() else "no `root` rule?"
            reason = reason.split("error parsing grammar: ", 1)[-1].strip()
            reason += " the end" if reason.endswith(" at") else ""  # llama.cpp quotes the rest of the text there
            raise GrammarError(f"{source}: the grammar does not parse: {reason}")
        self._sampler = sampler

    def clone(self) -> Grammar:
        twin = object.__new__(Grammar)
        twin.__dict__.update(self.__dict__)
        twin._sampler = llama_cpp.llama_sampler_clone(self._sampler)
        return twin

    def legal(self, ids: np.ndarray) -> np.ndarray:
        """Which of the token ids may come next (a bool per id). Ids outside the vocabulary never may."""
        ids = np.asarray(ids, dtype=np.int32).ravel()
        inside = (ids >= 0) & (ids < self.n_vocab)
        data = np.zeros(int(inside.sum()), dtype=_TOKEN_DATA)
        data["id"] = ids[inside]
        out = np.zeros(ids.shape, dtype=bool)
        if len(data):
            array = llama_cpp.llama_token_data_array(
                data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=len(data), selected=-1,
                sorted=False)
            llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
            out[inside] = np.isfinite(data["logit"])
        if self.awaiting:
            for i in np.flatnonzero(out):
                out[i] = self._trigger_is_safe(int(ids[i]))
        return out

    def _trigger_is_safe(self, token: int) -> bool:
        """While awaiting: False only for a token that completes the marker with text the grammar forbids."""
        assert self.trigger is not None
        text = self._seen + self.model.piece(token, special=True)  # (the grammar reads special tokens' text too)
        at = text.find(self.trigger)
        if at < 0:
            return True
        replay = text[at:].decode("utf-8", errors="ignore")
        probe = Grammar(self.model, self.gbnf, self.source)
        try:
            for t in self.model.tokenize(replay, add_special=False, parse_special=False):
                if not probe.legal(np.array([t]))[0]:
                    return False
                llama_cpp.llama_sampler_accept(probe._sampler, t)
            return True
        finally:
            probe.close()

    def accept(self, token: int) -> None:
        """Advance by one emitted token. A token the grammar forbids is refused here: llama.cpp would throw a C++
        exception through the C API (an abort)."""
        if not self.legal(np.array([token]))[0]:
            raise GrammarError(f"{self.source}: token {token} ({self.model.token_text(token)!r}) is not allowed "
                               "by the grammar here")
        if self.awaiting:
            assert self.trigger is not None
            self._seen += self.model.piece(token, special=True)
            if self.trigger in self._seen:
                self.awaiting, self._seen = False, b""
            else:  # only a marker's worth of tail can still become one
                self._seen = self._seen[max(0, len(self._seen) - len(self.trigger) + 1) :]
        llama_cpp.llama_sampler_accept(self._sampler, token)

    def close(self) -> None:
        if self._sampler:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _device_samplers(mode: str | DeviceDist, device_top_k: int) -> list[ctypes.c_void_p]:
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
