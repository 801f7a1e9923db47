"""Memory preflight from GGUF metadata alone: will target + draft fit, and if not, what will?

What llama.cpp allocates per model (checked against its own buffer log in tests/test_memory.py):
- weights: the tensor data, as listed in the header's tensor infos;
- KV cache: n_layer × n_kv_heads × (key_length + value_length) × cells × bytes per element, where cells is the
  context padded to 256 (llama.cpp keeps full-size caches for sliding-window layers by default);
- compute buffer: with flash attention, ≈ n_ubatch × (4·n_vocab + 8·n_embd) bytes (the ubatch's logits);
- output buffer: a row of logits per requested output, the verification window (draft length + 1).
The verification window also needs KV room, reserved out of the context. On a GPU a fixed allowance covers
the CUDA context and cuBLAS workspace, which the header cannot tell.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from localspec.gguf_header import GGUFHeader

KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # bytes per element, ggml block sizes
CTX_PAD = 256  # llama.cpp pads n_ctx to a multiple of 256
GPU_RUNTIME_OVERHEAD = 512 << 20  # CUDA context + cuBLAS workspace per process, measured order of magnitude
HEADROOM = 0.05  # keep 5% of free memory spare: drivers, fragmentation, the desktop
MIN_CTX = 512
GiB = float(1 << 30)


@dataclass(frozen=True)
class ModelMemory:
    name: str
    n_layer: int
    weights: int
    kv: int
    compute: int
    output: int
    gpu_fraction: float  # share of the layers (and their KV) on the GPU

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.output


@dataclass(frozen=True)
class Settings:
    n_ctx: int
    n_draft: int
    kv_type: str = "f16"
    n_batch: int = 512
    n_gpu_layers: int = -1
    draft_n_gpu_layers: int = -1

    @property
    def window(self) -> int:
        """Tokens of KV the verification window needs beyond the text: at least 2 × draft length."""
        return max(2 * self.n_draft, self.n_draft + 1) if self.n_draft else 1


@dataclass(frozen=True)
class Devices:
    """Free memory as seen now. `gpu_free` is None when no NVIDIA GPU (or no GPU build) can be used."""

    ram_available: int
    gpu_free: int | None = None
    gpu_total: int | None = None
    gpu_name: str | None = None
    driver: str | None = None
    gpu_offload: bool = False
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Estimate:
    settings: Settings
    models: tuple[ModelMemory, ...]
    devices: Devices
    gpu_bytes: int
    ram_bytes: int
    fits: bool
    problem: str = ""  # what does not fit, one line
    suggestions: tuple[str, ...] = field(default=())
    unknowns: tuple[str, ...] = field(default=())

    @property
    def total(self) -> int:
        return sum(m.total for m in self.models)


def kv_bytes(header: GGUFHeader, n_ctx: int, kv_type: str) -> int:
    """KV cache bytes at this context, from the header's (checked) attention shape."""
    hp = header.hparams
    cells = -(-n_ctx // CTX_PAD) * CTX_PAD
    per_token = sum(hp.n_head_kv) * (hp.key_length + hp.value_length)  # a layer without attention has 0 KV heads
    return int(per_token * cells * KV_BYTES[kv_type])


def model_memory(header: GGUFHeader, s: Settings, *, n_outputs: int, n_gpu_layers: int) -> ModelMemory:
    hp = header.hparams  # validated: n_layer >= 1, so the GPU share below never divides by zero
    n_ubatch = min(s.n_batch, s.n_ctx)
    frac = 1.0 if n_gpu_layers < 0 else min(n_gpu_layers, hp.n_layer) / hp.n_layer
    return ModelMemory(
        name=header.name,
        n_layer=hp.n_layer,
        weights=header.tensor_bytes,
        kv=kv_bytes(header, s.n_ctx, s.kv_type),
        compute=n_ubatch * (4 * hp.n_vocab + 8 * hp.n_embd),
        output=max(1, n_outputs) * hp.n_vocab * 4,
        gpu_fraction=frac,
    )


def probe_devices() -> Devices:
    """Free RAM and the first usable GPU's name, driver and free memory (`machine`); never raises."""
    from localspec import machine

    notes: list[str] = []
    try:
        from localspec.llama_ctx import supports_gpu_offload

        offload = supports_gpu_offload()
    except Exception as exc:  # llama_cpp missing or broken: preflight still works on RAM
        offload = False
        notes.append(f"llama-cpp-python not importable ({exc.__class__.__name__})")
    gpus = machine.nvidia_gpus(notes)
    ram = machine.ram_available()
    if not gpus:
        return Devices(ram_available=ram, gpu_offload=offload, notes=tuple(notes))
    gpu = gpus[0]
    if not offload:
        notes.append("llama-cpp-python was built without GPU offload, so the GPU is not used")
    return Devices(
        ram_available=ram,
        gpu_free=gpu.free if offload else None,
        gpu_total=gpu.total,
        gpu_name=gpu.name,
        driver=gpu.driver,
        gpu_offload=offload,
        notes=tuple(notes),
    )


def _place(models: tuple[ModelMemory, ...], devices: Devices) -> tuple[int, int]:
    """(GPU bytes, RAM bytes). Offloaded layers carry their weights, KV and the compute buffer to the GPU."""
    if devices.gpu_free is None:
        return 0, sum(m.total for m in models)
    gpu = GPU_RUNTIME_OVERHEAD
    ram = 0
    for m in models:
        on_gpu = m.gpu_fraction
        gpu += int((m.weights + m.kv) * on_gpu) + (m.compute if on_gpu > 0 else 0)
        ram += int((m.weights + m.kv) * (1 - on_gpu)) + m.output + (0 if on_gpu > 0 else m.compute)
    return gpu, ram


def estimate(target: GGUFHeader, draft: GGUFHeader | None, s: Settings, devices: Devices) -> Estimate:
    """What both models will allocate at these settings, placed on GPU/RAM and compared with what is free."""
    models = [model_memory(target, s, n_outputs=s.n_draft + 1, n_gpu_layers=s.n_gpu_layers)]
    if draft is not None:
        models.append(model_memory(draft, s, n_outputs=1, n_gpu_layers=s.draft_n_gpu_layers))
    mt = tuple(models)
    gpu, ram = _place(mt, devices)
    unknowns = list(devices.notes)
    gpu_ok = devices.gpu_free is None or gpu <= devices.gpu_free * (1 - HEADROOM)
    ram_ok = ram <= devices.ram_available * (1 - HEADROOM)
    problem = ""
    if not gpu_ok:
        problem = (
            f"needs {gpu / GiB:.1f} GiB of VRAM at context {s.n_ctx} ({s.kv_type} KV), "
            f"{(devices.gpu_free or 0) / GiB:.1f} GiB free on {devices.gpu_name}"
        )
    elif not ram_ok:
        problem = (
            f"needs {ram / GiB:.1f} GiB of RAM at context {s.n_ctx} ({s.kv_type} KV), "
            f"{devices.ram_available / GiB:.1f} GiB available"
        )
    if s.n_ctx <= s.window:
        problem = problem or f"context {s.n_ctx} leaves no room beside the verification window of {s.window}"
        gpu_ok = False
    result = Estimate(s, mt, devices, gpu, ram, gpu_ok and ram_ok, problem, (), tuple(unknowns))
    if not result.fits:
        result = replace(result, suggestions=tuple(_suggest(target, draft, s, devices)))
    return result


def _fits(target: GGUFHeader, draft: GGUFHeader | None, s: Settings, devices: Devices) -> bool:
    models = [model_memory(target, s, n_outputs=s.n_draft + 1, n_gpu_layers=s.n_gpu_layers)]
    if draft is not None:
        models.append(model_memory(draft, s, n_outputs=1, n_gpu_layers=s.draft_n_gpu_layers))
    gpu, ram = _place(tuple(models), devices)
    gpu_ok = devices.gpu_free is None or gpu <= devices.gpu_free * (1 - HEADROOM)
    return gpu_ok and ram <= devices.ram_available * (1 - HEADROOM) and s.n_ctx > s.window


def _largest_ctx(target: GGUFHeader, draft: GGUFHeader | None, s: Settings, devices: Devices) -> int | None:
    ctx = (s.n_ctx // 2 // CTX_PAD) * CTX_PAD
    while ctx >= MIN_CTX:
        if _fits(target, draft, replace(s, n_ctx=ctx), devices):
            return ctx
        ctx = (ctx // 2 // CTX_PAD) * CTX_PAD if ctx > 4 * CTX_PAD else ctx - CTX_PAD
    return None


def _suggest(target: GGUFHeader, draft: GGUFHeader | None, s: Settings, devices: Devices) -> list[str]:
    """Each alternative that fits, in the order that costs the least quality or speed."""
    out: list[str] = []
    for kv in ("q8_0", "q4_0"):
        if KV_BYTES[kv] < KV_BYTES[s.kv_type] and _fits(target, draft, replace(s, kv_type=kv), devices):
            out.append(f"--kv-type {kv} (keeps context {s.n_ctx})")
            break
    ctx = _largest_ctx(target, draft, s, devices)
    if ctx is not None:
        out.append(f"--ctx {ctx}")
    if devices.gpu_free is not None:
        n_layer = target.hparams.n_layer
        start = n_layer if s.n_gpu_layers < 0 else min(s.n_gpu_layers, n_layer)
        for ngl in range(start - 1, -1, -1):
            if _fits(target, draft, replace(s, n_gpu_layers=ngl), devices):
                out.append(f"--ngl {ngl} (of {n_layer} target layers on the GPU; slower)")
                break
    # The compute buffer holds a batch of logits (n_batch x n_vocab floats): 512 MiB for a 262k vocabulary.
    batch = s.n_batch // 2
    while batch >= 32:
        if _fits(target, draft, replace(s, n_batch=batch), devices):
            out.append(
                f"n_batch = {batch} in a preset's [load] (smaller prompt batches, smaller compute buffers)"
            )
            break
        batch //= 2
    if not out:
        out.append("a smaller quantization of the target, or a smaller target")
    return out


def settings_from_preset(preset: object, n_ctx: int | None = None, n_draft: int | None = None) -> Settings:
    """The preset's load settings (and the pair's recommendations when the preset leaves them)."""
    load = preset.load  # type: ignore[attr-defined]
    draft = preset.draft  # type: ignore[attr-defined]
    return Settings(
        n_ctx=n_ctx or load.n_ctx,
        n_draft=draft.n_draft if n_draft is None else n_draft,
        kv_type=load.kv_type,
        n_batch=load.n_batch,
        n_gpu_layers=load.n_gpu_layers,
        draft_n_gpu_layers=load.draft_n_gpu_layers,
    )
