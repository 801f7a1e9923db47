"""Memory preflight from GGUF metadata alone: will target + draft fit, and if not, what will?

What llama.cpp allocates per model (checked against its own buffer log in tests/test_memory.py):
- weights: the tensor data, as listed in the header's tensor infos;
- KV cache: n_layer × n_kv_heads × (key_length + value_length) × cells × bytes per element, where cells is the
  context padded to 256 (llama.cpp keeps full-size caches for sliding-window layers by default);
- compute buffer: with flash attention, ≈ n_ubatch × (4·n_vocab + 8·n_embd) bytes (the ubatch's logits);
- output buffer: a row of logits per requested output, the verification window (draft length + 1);
- recurrent state (hybrid and recurrent models, `GGUFHeader.recurrence`): each sequence's state F32, the
  target's times 1 + the draft length (llama.cpp's snapshots for rewinding rejected drafts, `n_rs_seq`), plus
  one checkpoint copy each (`llama.recurrent`: where a rewind reaches further back; a draft rewinds through it alone);
  only the attention layers keep KV;
- an MTP head (`[draft] drafter = "mtp"`): its blocks' KV cache and a second compute buffer (its own context).
The verification window also needs KV room, reserved out of the context. On a GPU a fixed allowance covers
the CUDA context and cuBLAS workspace, which the header cannot tell.

Several devices (`placement`): offloaded weights and KV spread over the target's devices in proportion to
`tensor_split`, or to each device's free memory (llama.cpp's default); the compute buffer sits on the last of
them (the one with the output layer); the draft sits on its one device. Each device is checked on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from localspec.config import DRAFTER_TABLE, LoadSettings, Preset
from localspec.errors import LocalspecError
from localspec.models import placement
from localspec.models.gguf_header import GGUFHeader
from localspec.models.placement import Dev, ModelPlacement, Plan

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
    state: int = 0  # recurrent state, its rollback snapshots and checkpoint (placed with the layers, like KV)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state + self.compute + self.output


@dataclass(frozen=True)
class Settings:
    """What an estimate is asked about: the preset's `[load]` (context, KV type, batch, layers, placement), the
    draft length, the slots (`serve --parallel`: each holds a KV region of n_ctx cells in both models) and the
    drafter (one whose table row has `target_head` runs the target's MTP head in a context of its own). Made by
    `settings_from_preset`; `changed` is the same question with other values, as a fix would set them."""

    load: LoadSettings
    n_draft: int
    n_seq: int
    drafter: str
    projector: tuple[int, int] = (0, 0)  # a multimodal projector's (weights, compute) bytes, beside the target

    def changed(self, **values: object) -> Settings:
        """These settings with other values: `n_draft`, `n_seq`, `drafter`, or any `[load]` key (`tensor_split`
        as proportions, `rpc` as HOST:PORT strings)."""
        own = {key: values.pop(key) for key in ("n_draft", "n_seq", "drafter") if key in values}
        if "tensor_split" in values:
            values["tensor_split"] = ",".join(repr(float(v)) for v in values["tensor_split"])  # type: ignore[attr-defined]
        if "rpc" in values:
            values["rpc"] = ",".join(values["rpc"])  # type: ignore[arg-type]
        return replace(self, load=replace(self.load, **values), **own)  # type: ignore[arg-type]

    @property
    def window(self) -> int:
        """Tokens of KV the verification window needs beyond the text: at least 2 × draft length."""
        return max(2 * self.n_draft, self.n_draft + 1) if self.n_draft else 1


@dataclass(frozen=True)
class DeviceMem:
    dev: Dev
    name: str  # "NVIDIA GeForce RTX 3090"; an RPC device: what its server calls it
    free: int  # bytes
    total: int

    @property
    def label(self) -> str:
        return self.dev.label


@dataclass(frozen=True)
class Devices:
    """Free memory as seen now: RAM, the GPUs this llama.cpp build offloads to (by llama.cpp's number) and the
    devices of connected RPC servers."""

    ram_available: int
    gpus: tuple[DeviceMem, ...] = ()
    rpc: tuple[DeviceMem, ...] = ()
    driver: str | None = None
    unused_gpus: tuple[str, ...] = ()  # NVIDIA GPUs present that this build cannot use (a CPU-only build)
    rpc_errors: tuple[str, ...] = ()  # RPC servers that did not answer (probe_devices(strict=False))
    notes: tuple[str, ...] = ()

    @property
    def gpu_offload(self) -> bool:
        return bool(self.gpus)

    def find(self, dev: Dev) -> DeviceMem | None:
        return next((d for d in (*self.gpus, *self.rpc) if d.dev == dev), None)


@dataclass(frozen=True)
class DeviceNeed:
    device: DeviceMem
    need: int  # bytes this placement puts there

    @property
    def fits(self) -> bool:
        return self.need <= self.device.free * (1 - HEADROOM)


@dataclass(frozen=True)
class Estimate:
    settings: Settings
    models: tuple[ModelMemory, ...]
    devices: Devices
    plan: Plan
    per_device: tuple[DeviceNeed, ...]  # every device either model uses, in device order
    ram_bytes: int
    fits: bool
    problem: str = ""  # what does not fit, one line
    suggestions: tuple[str, ...] = field(default=())
    unknowns: tuple[str, ...] = field(default=())

    @property
    def total(self) -> int:
        return sum(m.total for m in self.models)

    @property
    def gpu_bytes(self) -> int:
        """What goes to this machine's GPUs, all of them together."""
        return sum(n.need for n in self.per_device if n.device.dev.kind == "gpu")

    def where(self) -> str:
        """Per device, what goes there against what is free: one line for doctor and bench."""
        parts = [f"{n.device.label} {n.need / GiB:.1f} of {n.device.free / GiB:.1f} GiB free" for n in self.per_device]
        parts.append(f"RAM {self.ram_bytes / GiB:.1f} of {self.devices.ram_available / GiB:.1f} GiB")
        return ", ".join(parts)


def kv_bytes(header: GGUFHeader, n_ctx: int, kv_type: str, layers: Sequence[int] | None = None) -> int:
    """KV cache bytes at this context, from the header's (checked) attention shape: the trunk's attention layers
    (a recurrent layer, an MTP block and a layer without KV heads keep none in the main context), or `layers`."""
    hp = header.hparams
    cells = -(-n_ctx // CTX_PAD) * CTX_PAD
    heads = sum(hp.n_head_kv[i] for i in (header.attention_layers if layers is None else layers))
    return int(heads * (hp.key_length + hp.value_length) * cells * KV_BYTES[kv_type])


def state_bytes(header: GGUFHeader, snapshots: int) -> int:
    """One sequence's recurrent state as localspec has llama.cpp hold it: the state, its `snapshots` for
    rewinding a verify (`n_rs_seq`: the target's, the draft length) and a checkpoint copy; 0 for an
    attention-only model."""
    rec = header.recurrence
    if rec is None:
        return 0
    return rec.state_bytes * (1 + (snapshots if rec.rolls_back else 0) + 1)


def model_memory(header: GGUFHeader, s: Settings, *, n_outputs: int, n_gpu_layers: int,
                 mtp: bool = False, snapshots: int = 0) -> ModelMemory:
    hp = header.hparams  # validated: n_layer >= 1, so the GPU share below never divides by zero
    n_ubatch = min(s.load.n_batch, s.load.n_ctx)
    frac = 1.0 if n_gpu_layers < 0 else min(n_gpu_layers, hp.n_layer) / hp.n_layer
    compute = n_ubatch * (4 * hp.n_vocab + 8 * hp.n_embd)
    kv = kv_bytes(header, s.load.n_ctx, s.load.kv_type)
    if mtp and header.nextn_layers:  # the MTP context: its blocks' KV and a compute buffer of its own
        kv += kv_bytes(header, s.load.n_ctx, s.load.kv_type, range(header.trunk_layers, hp.n_layer))
        compute *= 2
    return ModelMemory(
        name=header.name,
        n_layer=hp.n_layer,
        weights=header.tensor_bytes,
        kv=kv * s.n_seq,
        compute=compute,
        output=max(1, n_outputs) * hp.n_vocab * 4,
        gpu_fraction=frac,
        state=state_bytes(header, snapshots) * s.n_seq,
    )


def probe_devices(rpc: Sequence[str] = (), *, strict: bool = True) -> Devices:
    """Free RAM, llama.cpp's GPUs with their free memory, the NVIDIA driver, and the devices of these RPC servers
    (HOST:PORT; each is checked to answer first). A dead RPC server raises a one-line LocalspecError, or with
    `strict=False` is listed in `rpc_errors`. Nothing else raises: what could not be read goes in `notes`."""
    from localspec import machine

    notes: list[str] = []
    gpus: list[DeviceMem] = []
    nvml_notes: list[str] = []
    nvidia = machine.nvidia_gpus(nvml_notes)
    try:
        from localspec.llama import backend

        found = backend.gpu_devices()
        # NVML's numbers when they describe the same GPUs in the same order (CUDA's order is NVML's unless
        # CUDA_DEVICE_ORDER or mixed models reorder them); asking llama.cpp instead starts a CUDA context on every
        # GPU, ones this run will not use included.
        same = [g.name for g in nvidia] == [d.description for d in found]
        for i, d in enumerate(found):
            free, total = (nvidia[i].free, nvidia[i].total) if same else d.memory()
            gpus.append(DeviceMem(Dev("gpu", i), d.description, free, total))
    except Exception as exc:  # llama_cpp missing or broken: preflight still works on RAM
        backend = None
        notes.append(f"llama-cpp-python not importable ({exc.__class__.__name__})")
    unused: tuple[str, ...] = ()
    if not gpus:
        notes.extend(nvml_notes)
        if nvidia:
            unused = tuple(g.name for g in nvidia)
            notes.append("llama-cpp-python was built without GPU offload, so the GPU is not used")
    rpc_devs: list[DeviceMem] = []
    errors: list[str] = []
    for endpoint in dict.fromkeys(rpc):
        try:
            if backend is None:
                raise LocalspecError(f"RPC server {endpoint}: llama-cpp-python is not importable")
            for i, d in enumerate(backend.rpc_devices([endpoint])):
                free, total = d.memory()
                rpc_devs.append(DeviceMem(Dev("rpc", i, endpoint), d.name, free, total))
        except LocalspecError as exc:
            if strict:
                raise
            errors.append(str(exc))
    return Devices(ram_available=machine.ram_available(), gpus=tuple(gpus), rpc=tuple(rpc_devs),
                   driver=nvidia[0].driver if nvidia else None, unused_gpus=unused, rpc_errors=tuple(errors),
                   notes=tuple(notes))


def plan_for(s: Settings, devices: Devices) -> Plan:
    """The placement these settings give on these devices (raises LocalspecError naming a bad option)."""
    return placement.plan(
        n_gpus=len(devices.gpus), rpc=[d.dev for d in devices.rpc], split_mode=s.load.split_mode,
        tensor_split=s.load.tensor_split_values, main_gpu=s.load.main_gpu, draft_device=s.load.draft_device,
        n_gpu_layers=s.load.n_gpu_layers, draft_n_gpu_layers=s.load.draft_n_gpu_layers,
        target_rpc=tuple(str(e) for e in s.load.rpc_endpoints),
    )


def _shares(p: ModelPlacement, devices: Devices) -> list[tuple[Dev, float]]:
    """Each device's share of a model's offloaded layers: tensor_split, else free memory (llama.cpp's rule)."""
    if len(p.devices) == 1:
        return [(p.devices[0], 1.0)]
    weights = list(p.tensor_split) or [getattr(devices.find(d), "free", 0) for d in p.devices]
    if not any(weights):
        weights = [1.0] * len(p.devices)
    total = float(sum(weights))
    return [(d, w / total) for d, w in zip(p.devices, weights, strict=True)]


def _on_devices(m: ModelMemory, p: ModelPlacement, devices: Devices) -> dict[Dev, int]:
    """One model's bytes per device: its offloaded weights and KV by share, the compute buffer with the output
    layer (the last device)."""
    shares = [] if p.on_cpu else [(d, w) for d, w in _shares(p, devices) if w > 0]
    out = {dev: int((m.weights + m.kv + m.state) * m.gpu_fraction * share) for dev, share in shares}
    if shares:
        out[shares[-1][0]] += m.compute
    return out


def _place(models: Sequence[ModelMemory], plan: Plan, devices: Devices) -> tuple[dict[Dev, int], int]:
    """(bytes per device, RAM bytes); each local GPU used also pays the CUDA runtime once."""
    need: dict[Dev, int] = {}
    ram = 0
    for m, p in zip(models, (plan.target, plan.draft), strict=False):
        placed = _on_devices(m, p, devices)
        for dev, n in placed.items():
            need[dev] = need.get(dev, 0) + n
        offloaded = m.gpu_fraction if placed else 0.0
        ram += int((m.weights + m.kv + m.state) * (1 - offloaded)) + m.output + (0 if placed else m.compute)
    for dev in need:
        if dev.kind == "gpu":
            need[dev] += GPU_RUNTIME_OVERHEAD
    return need, ram


# Projectors that read a picture at its own size (rounded to whole merged patches) up to a token limit, libmtmd's
# 4096 unless [images] max_image_tokens sets another (tools/mtmd/clip.cpp: set_limit_image_tokens(8, 4096)).
DYNAMIC_PROJECTORS = frozenset({"qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger"})
DYNAMIC_MAX_TOKENS = 4096
# The head widths ggml's CUDA flash attention runs (ggml-cuda/fattn.cu; the CPU's runs every width). libmtmd's warm-up
# (on: llama.vision) turns flash attention on for the vision tower where its backend runs it; then the tower keeps
# no patch-by-patch scores.
FLASH_HEAD_DIMS = frozenset({40, 64, 72, 80, 96, 112, 128, 256})


def projector_patches(header: GGUFHeader, max_tokens: int = 0) -> int:
    """The patches of a projector's largest picture: `image_size` square, or for a dynamic-resolution projector
    (Qwen-VL's) `max_tokens` merged patches ([images] max_image_tokens; 0: libmtmd's limit)."""
    meta = header.metadata
    size, patch = int(meta.get("clip.vision.image_size", 0) or 0), int(meta.get("clip.vision.patch_size", 1) or 1)
    if meta.get("clip.projector_type") in DYNAMIC_PROJECTORS:
        merge = int(meta.get("clip.vision.spatial_merge_size", 2) or 2)
        return (max_tokens or DYNAMIC_MAX_TOKENS) * merge * merge
    return (size // max(1, patch)) ** 2


def _heads_and_width(header: GGUFHeader) -> tuple[int, int, int]:
    meta = header.metadata
    heads = int(meta.get("clip.vision.attention.head_count", 1) or 1)
    n_embd = int(meta.get("clip.vision.embedding_length", 0) or 0)
    return heads, n_embd, max(int(meta.get("clip.vision.feed_forward_length", 0) or 0), n_embd)


def projector_attention_bytes(header: GGUFHeader, patches: int) -> int:
    """Without flash attention: every patch's scores over every other, in each head (F32)."""
    return 4 * patches * patches * _heads_and_width(header)[0]


def projector_activation_bytes(header: GGUFHeader, patches: int) -> int:
    """The activations through the tower's widest layer, as clip.cpp's graph allocator keeps them (F32)."""
    return 4 * 4 * patches * _heads_and_width(header)[2]


def projector_flash_attention(header: GGUFHeader) -> bool:
    """Whether libmtmd's warm-up will find flash attention for this tower (its head width runs on CUDA too)."""
    heads, n_embd, _ = _heads_and_width(header)
    return n_embd % heads == 0 and n_embd // heads in FLASH_HEAD_DIMS


def projector_memory(header: GGUFHeader, max_tokens: int = 0) -> tuple[int, int]:
    """A projector's (weights, compute) bytes: its tensors, and libmtmd's buffer for its largest picture
    (`projector_patches`): the activations, plus every patch's attention scores where flash attention does not run
    for the tower's head width. An upper bound, checked against clip.cpp's own figures by
    bench/projector_memory.py."""
    patches = projector_patches(header, max_tokens)
    compute = projector_activation_bytes(header, patches)
    if not projector_flash_attention(header):
        compute += projector_attention_bytes(header, patches)
    return header.tensor_bytes, compute


def _models(target: GGUFHeader, draft: GGUFHeader | None, s: Settings) -> tuple[ModelMemory, ...]:
    first = model_memory(target, s, n_outputs=s.n_draft + 1, n_gpu_layers=s.load.n_gpu_layers,
                         mtp=s.drafter in DRAFTER_TABLE and DRAFTER_TABLE[s.drafter].target_head, snapshots=s.n_draft)
    if any(s.projector):  # (libmtmd puts the projector where the target's layers go: counted with them)
        first = replace(first, weights=first.weights + s.projector[0], compute=first.compute + s.projector[1])
    models = [first]
    if draft is not None:
        models.append(model_memory(draft, s, n_outputs=1, n_gpu_layers=s.load.draft_n_gpu_layers))
    return tuple(models)


def _needs(plan: Plan, models: Sequence[ModelMemory], devices: Devices) -> tuple[tuple[DeviceNeed, ...], int]:
    need, ram = _place(models, plan, devices)
    known = [(devices.find(dev), n) for dev, n in sorted(need.items())]
    return tuple(DeviceNeed(d, n) for d, n in known if d is not None), ram


def estimate(target: GGUFHeader, draft: GGUFHeader | None, s: Settings, devices: Devices) -> Estimate:
    """What both models will allocate at these settings, placed on the devices and compared with what is free
    on each. Raises LocalspecError when the placement names a device this machine does not have."""
    plan = plan_for(s, devices)
    models = _models(target, draft, s)
    per_device, ram = _needs(plan, models, devices)
    ram_ok = ram <= devices.ram_available * (1 - HEADROOM)
    short = next((n for n in per_device if not n.fits), None)
    problem = ""
    if short is not None:
        memory_kind = "VRAM" if short.device.dev.kind == "gpu" else "memory"
        problem = (
            f"needs {short.need / GiB:.1f} GiB of {memory_kind} on {short.device.label} ({short.device.name}) at "
            f"context {_ctx(s)} ({s.load.kv_type} KV), {short.device.free / GiB:.1f} GiB free there"
        )
    elif not ram_ok:
        problem = (
            f"needs {ram / GiB:.1f} GiB of RAM at context {_ctx(s)} ({s.load.kv_type} KV), "
            f"{devices.ram_available / GiB:.1f} GiB available"
        )
    fits = short is None and ram_ok
    if s.load.n_ctx <= s.window:
        problem = problem or f"context {s.load.n_ctx} leaves no room beside the verification window of {s.window}"
        fits = False
    result = Estimate(s, models, devices, plan, per_device, ram, fits, problem, (), tuple(devices.notes))
    if not result.fits:
        result = replace(result, suggestions=tuple(_suggest(target, draft, s, devices, result)))
    return result


def _ctx(s: Settings) -> str:
    return f"{s.load.n_ctx}" if s.n_seq == 1 else f"{s.load.n_ctx} × {s.n_seq} slots"


def _fits(target: GGUFHeader, draft: GGUFHeader | None, s: Settings, devices: Devices) -> bool:
    try:
        plan = plan_for(s, devices)
    except LocalspecError:
        return False
    per_device, ram = _needs(plan, _models(target, draft, s), devices)
    return all(n.fits for n in per_device) and ram <= devices.ram_available * (1 - HEADROOM) and s.load.n_ctx > s.window


def largest_ctx(target: GGUFHeader, draft: GGUFHeader | None, s: Settings, devices: Devices) -> int | None:
    ctx = (s.load.n_ctx // 2 // CTX_PAD) * CTX_PAD
    while ctx >= MIN_CTX:
        if _fits(target, draft, s.changed(n_ctx=ctx), devices):
            return ctx
        ctx = (ctx // 2 // CTX_PAD) * CTX_PAD if ctx > 4 * CTX_PAD else ctx - CTX_PAD
    return None


def _placement_fixes(target: GGUFHeader, draft: GGUFHeader | None, s: Settings, devices: Devices,
                     est: Estimate) -> list[str]:
    """Other placements that fit at the same context and quality: the draft on another GPU, the target over
    every GPU, or a tensor split that leaves room where the draft sits."""
    out: list[str] = []
    short = {n.device.dev for n in est.per_device if not n.fits}
    draft_dev = est.plan.draft.devices[0] if draft is not None and not est.plan.draft.on_cpu else None
    if draft_dev in short:
        freed = _on_devices(est.models[1], est.plan.draft, devices)[draft_dev]
        for gpu in devices.gpus:
            if gpu.dev != draft_dev and _fits(target, draft, s.changed(draft_device=str(gpu.dev.index)), devices):
                out.append(f"--draft-device {gpu.dev.index} (the draft on {gpu.label}: frees "
                           f"{freed / GiB:.1f} GiB on {draft_dev.label})")
                break
    if s.load.split_mode == "none" and len(devices.gpus) > 1 and _fits(target, draft, s.changed(split_mode="layer"),
                                                                  devices):
        out.append("--split-mode layer (the target over every GPU)")
    devs = est.plan.target.devices
    if len(devs) > 1 and not est.plan.target.on_cpu:
        # Give each device the target share that the room left beside everything else there can take.
        others = {n.device.dev: n.need for n in est.per_device}
        for dev, n in _on_devices(est.models[0], est.plan.target, devices).items():
            others[dev] -= n
        room = [max(0.0, getattr(devices.find(d), "free", 0) * (1 - HEADROOM) - others.get(d, 0)) for d in devs]
        if any(room):
            split = tuple(round(100 * r / sum(room)) for r in room)
            if split != s.load.tensor_split_values and any(split) \
                    and _fits(target, draft, s.changed(tensor_split=split), devices):
                out.append(f"--tensor-split {','.join(map(str, split))} (the target's share per device: "
                           f"{', '.join(d.label for d in devs)})")
    return out


def _suggest(target: GGUFHeader, draft: GGUFHeader | None, s: Settings, devices: Devices,
             est: Estimate) -> list[str]:
    """Each alternative that fits, in the order that costs the least quality or speed."""
    out = _placement_fixes(target, draft, s, devices, est)
    for kv in ("q8_0", "q4_0"):
        if KV_BYTES[kv] < KV_BYTES[s.load.kv_type] and _fits(target, draft, s.changed(kv_type=kv), devices):
            out.append(f"--kv-type {kv} (keeps context {s.load.n_ctx})")
            break
    ctx = largest_ctx(target, draft, s, devices)
    if ctx is not None:
        out.append(f"--ctx {ctx}")
    for n_seq in range(s.n_seq - 1, 0, -1):
        if _fits(target, draft, s.changed(n_seq=n_seq), devices):
            out.append(f"--parallel {n_seq} (slots; keeps context {s.load.n_ctx} each)")
            break
    if devices.gpus:
        n_layer = target.hparams.n_layer
        start = n_layer if s.load.n_gpu_layers < 0 else min(s.load.n_gpu_layers, n_layer)
        for ngl in range(start - 1, -1, -1):
            if _fits(target, draft, s.changed(n_gpu_layers=ngl), devices):
                out.append(f"--ngl {ngl} (of {n_layer} target layers on the GPU; slower)")
                break
    # The compute buffer holds a batch of logits (n_batch x n_vocab floats): 512 MiB for a 262k vocabulary.
    batch = s.load.n_batch // 2
    while batch >= 32:
        if _fits(target, draft, s.changed(n_batch=batch), devices):
            out.append(
                f"n_batch = {batch} in a preset's [load] (smaller prompt batches, smaller compute buffers)"
            )
            break
        batch //= 2
    if not out:
        out.append("a smaller quantization of the target, or a smaller target")
    return out


def settings_from_preset(preset: Preset, n_ctx: int | None = None, n_draft: int | None = None, n_seq: int = 1,
                         projector: GGUFHeader | None = None, **load: object) -> Settings:
    """The preset's load settings (and the pair's recommendations when the preset leaves them; `load`: other
    values of `[load]` keys, as `Settings.changed` takes them); `projector`: the target's mmproj, if any."""
    s = Settings(load=preset.load, n_draft=preset.draft.n_draft if n_draft is None else n_draft, n_seq=n_seq,
                 drafter=preset.draft.drafter,
                 projector=projector_memory(projector, preset.images.max_image_tokens) if projector is not None
                 else (0, 0))
    return s.changed(n_ctx=n_ctx or preset.load.n_ctx, **load)
