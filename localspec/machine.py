"""Facts about this machine — CPU, RAM, NVIDIA GPUs — asked by the memory preflight, doctor and bench alike.

Every probe here is best effort and never raises: a CPU-only machine without a driver is the normal case, and
what could not be read is said in `notes` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
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


@dataclass(frozen=True)
class ThreadChoice:
    """How many CPU threads llama.cpp gets when the preset says 0 (auto), and why."""

    threads: int
    cores: int  # physical cores
    load: float | None  # the 1-minute load average (None: not available on this system)
    busy_now: float | None = None  # cores' worth of CPU in use over the last fraction of a second (None: unknown)

    @property
    def busy(self) -> int:
        """Cores that other programs keep busy: the larger of the two measures, rounded."""
        measures = [m for m in (self.load, self.busy_now) if m is not None]
        return min(self.cores, round(max(0.0, *measures))) if measures else 0

    def describe(self) -> str:
        seen = [f"load average {self.load:.1f}" if self.load is not None else "load average unknown"]
        if self.busy_now is not None:
            seen.append(f"{self.busy_now:.1f} cores in use just now")
        why = ", ".join(seen)
        if self.threads < self.cores:
            return f"{self.threads} of {self.cores} physical cores: {why}, so about {self.busy} are busy elsewhere"
        return f"{self.threads} of {self.cores} physical cores ({why})"


def choose_threads(cores: int, load: float | None, busy_now: float | None = None) -> ThreadChoice:
    """Threads for the cores other programs leave free: physical cores minus what is busy, at least 1.

    llama.cpp's threads meet at a barrier after every operation and spin there; when another program holds
    one of the cores, every barrier waits for the thread that was descheduled: one thread more than the free
    cores can make decoding tens of times slower (docs/hardware.md). One thread too few costs at most
    that core's share; one too many costs far more, so the busier of two measures counts: the 1-minute load
    average (steady load) and the CPU in use just now (a program that started a moment ago, which the average
    has not caught up with yet).
    """
    choice = ThreadChoice(threads=0, cores=max(1, cores), load=load, busy_now=busy_now)
    return dataclasses.replace(choice, threads=max(1, choice.cores - choice.busy))


def load_average() -> float | None:
    """The 1-minute load average: runnable and running processes, which is what competes for the cores."""
    import psutil

    try:
        return float(psutil.getloadavg()[0])
    except (OSError, AttributeError):  # psutil emulates it on Windows; some sandboxes refuse /proc/loadavg
        return None


def cores_in_use(cores: int, interval: float = 0.2) -> float | None:
    """How many cores' worth of CPU the machine used over the next `interval` seconds (this process waits)."""
    import psutil

    try:
        return psutil.cpu_percent(interval=interval) / 100.0 * cores
    except (OSError, RuntimeError):
        return None


def thread_choice() -> ThreadChoice:
    """The automatic thread count for this machine now (what `threads = 0` means)."""
    cores = physical_cores()
    return choose_threads(cores, load_average(), cores_in_use(cores))


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
