"""Facts about this machine — CPU, RAM, NVIDIA GPUs — asked by the memory preflight, doctor and bench alike.

Every probe here is best effort and never raises: a CPU-only machine without a driver is the normal case, and
what could not be read is said in `notes` instead.
"""

from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML's index (the CUDA device number unless CUDA_DEVICE_ORDER says otherwise)
    name: str
    driver: str
    free: int  # bytes
    total: int


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one (platform.processor() is empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def ram_total() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def ram_available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def nvidia_gpus(notes: list[str] | None = None) -> list[Gpu]:
    """The NVIDIA GPUs this process may use, through NVML: those named by CUDA_VISIBLE_DEVICES (in its order) when
    it lists indices, else all. Empty without a driver; `notes` collects why."""
    notes = notes if notes is not None else []
    try:
        import pynvml
    except ImportError:
        notes.append("nvidia-ml-py is not installed: VRAM unknown")
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        notes.append("no NVIDIA driver (NVML unavailable): VRAM unknown")
        return []
    as_str = lambda v: v.decode() if isinstance(v, bytes) else str(v)  # noqa: E731 -- older NVML returns bytes
    try:
        indices = list(range(pynvml.nvmlDeviceGetCount()))
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if visible and all(v.isdigit() for v in visible):
            indices = [int(v) for v in visible if int(v) in indices]
        driver = as_str(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in indices:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(Gpu(index, as_str(pynvml.nvmlDeviceGetName(handle)), driver, int(mem.free), int(mem.total)))
        return gpus
    except Exception as exc:
        notes.append(f"NVML could not read the GPU ({exc.__class__.__name__}): VRAM unknown")
        return []
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
