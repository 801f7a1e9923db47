"""llama.cpp for the whole process, before and beside any model: its log, Ctrl-C inside its callbacks, the backend
and ggml's device registry (local GPUs, RPC servers), the build's capabilities, and the quantizer.
"""

from __future__ import annotations

import _thread
import ctypes
import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import llama_cpp  # noqa: I001  -- llama_cpp before numpy: on CUDA builds the other order can segfault (docs/gpu.md)

from localspec.errors import LocalspecError, ModelLoadError

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


def log_callback() -> ctypes._CFuncPtr:
    """The callback llama.cpp's log goes through (kept alive here), for libmtmd's log too (llama.vision)."""
    return _log_to_stderr_when_debugging


def init() -> None:
    """Once per process, before anything else is asked of llama.cpp: route its log through our callback, start
    it, and open ggml's device registry (libggml next to libllama, every device enumerated). Every entry point
    (models, devices, the quantizer) comes through here, so a model is never loaded before the registry is up: a
    CUDA build can crash inside llama_model_load_from_file when a load is the process's first call into llama.cpp,
    where the same load after a device query works (docs/gpu.md)."""
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


# -- devices: local GPUs and RPC servers (ggml's backend registry, declared from ggml-backend.h) -----------------

_DEV_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
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
    init()  # (which comes back here once, to enumerate the devices)
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
    init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.allow_requantize = True
    params.nthread = default_threads()
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), params)
    if rc != 0:
        raise ModelLoadError(f"{source}: llama.cpp could not requantize it to {ftype_name} (code {rc})")
