"""Where each model goes: the target over GPUs and RPC servers, the draft on one device.

Pure logic over the load settings and how many devices there are; `memory` turns a placement into bytes per
device, `session` hands it to `llama.model.LlamaModel` as llama.cpp's model params (`devices`, `split_mode`,
`tensor_split`, `main_gpu`). GPU numbers are llama.cpp's device order (CUDA's), as `localspec doctor` lists them.

The target's device list follows llama.cpp's own default order: RPC servers first (fewer activations cross the
network), then the local GPUs; `tensor_split` gives one proportion per device in that order. The draft always
sits on one device: by default the target's main GPU; a GPU named for it (`--draft-device 1`) is its own, and the
target spreads over the other GPUs unless `tensor_split` gives every GPU a share. Every list is explicit:
llama.cpp's default (all devices) would also put a registered RPC server under the draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localspec.config import LoadSettings
from localspec.errors import LocalspecError
from localspec.rpc import parse_endpoint


@dataclass(frozen=True, order=True)
class Dev:
    """One device: a local GPU by llama.cpp's number, or device `index` of an RPC server."""

    kind: str  # "gpu" or "rpc"
    index: int
    endpoint: str = ""  # RPC only

    @property
    def label(self) -> str:
        if self.kind == "gpu":
            return f"GPU {self.index}"
        return f"RPC {self.endpoint}" + (f" #{self.index}" if self.index else "")


@dataclass(frozen=True)
class ModelPlacement:
    devices: tuple[Dev, ...]  # empty: the CPU only
    split_mode: str = "none"  # "none", "layer" or "row" (llama.cpp's split modes)
    tensor_split: tuple[float, ...] = ()  # one proportion per device; () = by free memory (llama.cpp's default)
    main: int = 0  # index into devices: the device of intermediate results for row split
    n_gpu_layers: int = -1

    @property
    def on_cpu(self) -> bool:
        return not self.devices or self.n_gpu_layers == 0

    @property
    def on_local_gpus(self) -> bool:
        """Computes on this machine's GPUs alone (no layer left on the CPU, no RPC server)."""
        return not self.on_cpu and self.n_gpu_layers < 0 and all(d.kind == "gpu" for d in self.devices)

    def describe(self) -> str:
        if self.on_cpu:
            return "CPU"
        where = " + ".join(d.label for d in self.devices)
        if len(self.devices) > 1:
            where = f"{self.split_mode} split over {where}"
            if self.tensor_split:
                where += " (" + ":".join(f"{v:g}" for v in self.tensor_split) + ")"
        if self.n_gpu_layers >= 0:
            where += f", at most {self.n_gpu_layers} layers offloaded"
        return where


@dataclass(frozen=True)
class Plan:
    target: ModelPlacement
    draft: ModelPlacement

    @property
    def separate(self) -> bool:
        """True when the draft computes on devices the target does not use (the CPU counts as one device)."""
        return _compute_devices(self.target).isdisjoint(_compute_devices(self.draft))


def _compute_devices(p: ModelPlacement) -> set[Dev | None]:
    # A partly offloaded model (--ngl N) also computes on the CPU; counted by its devices only, since N often
    # means "all" (llama.cpp's -ngl 99).
    return {None} if p.on_cpu else set(p.devices)


def plan(*, n_gpus: int, rpc: Sequence[Dev], split_mode: str = "layer", tensor_split: Sequence[float] = (),
         main_gpu: int = 0, draft_device: str = "auto", n_gpu_layers: int = -1,
         draft_n_gpu_layers: int = -1, target_rpc: Sequence[str] = ()) -> Plan:
    """The target's and the draft's placement. `rpc` lists every registered RPC device; the target uses those
    of the servers in `target_rpc` (the `rpc` setting, HOST:PORT each), the draft only its own `draft_device`.

    Raises LocalspecError naming the option when a GPU number or the split's length does not match the machine.
    """
    gpus = tuple(Dev("gpu", i) for i in range(n_gpus))
    served = set(target_rpc)
    remote = tuple(d for d in rpc if d.endpoint in served)
    if n_gpus and main_gpu >= n_gpus:
        raise LocalspecError(f"--main-gpu {main_gpu}: llama.cpp sees {_count(n_gpus)} (numbered 0..{n_gpus - 1})")
    if split_mode == "none":
        devices = gpus[main_gpu : main_gpu + 1] or remote[:1]
        main = 0
    else:
        devices = remote + gpus
        # A GPU given to the draft by number is the draft's own (a spare card for the draft, drafting ahead
        # beside the target): the target spreads over the others, unless a tensor split gives every GPU a share.
        own = int(draft_device) if draft_device.isdigit() and len(gpus) > 1 else None
        if own is not None and len(tensor_split) != len(devices):
            devices = tuple(d for d in devices if d != Dev("gpu", own))
        if gpus and gpus[main_gpu] in devices:
            main = devices.index(gpus[main_gpu])
        else:  # the main GPU is the draft's own: the target's first GPU gathers row results instead
            main = next((i for i, d in enumerate(devices) if d.kind == "gpu"), 0)
    if tensor_split and len(tensor_split) != len(devices):
        listed = ", ".join(d.label for d in devices) or "none: this machine has no GPU"
        raise LocalspecError(f"--tensor-split {','.join(f'{v:g}' for v in tensor_split)}: {len(tensor_split)} "
                             f"proportions for {len(devices)} target devices ({listed})")
    target = ModelPlacement(devices, split_mode if len(devices) > 1 else "none",
                            tuple(tensor_split) if len(devices) > 1 else (), main, n_gpu_layers)
    return Plan(target, ModelPlacement(_draft_devices(draft_device, target, gpus, rpc), "none", (), 0,
                                       draft_n_gpu_layers))


def _draft_devices(choice: str, target: ModelPlacement, gpus: tuple[Dev, ...],
                   rpc: Sequence[Dev]) -> tuple[Dev, ...]:
    if choice == "auto":
        # With the target: its main GPU (a draft split over devices would pay transfers on every token).
        main = target.devices[target.main] if target.devices else None
        return (main,) if main is not None and main.kind == "gpu" else gpus[:1]
    if choice.isdigit():
        n = int(choice)
        if n >= len(gpus):
            raise LocalspecError(f"--draft-device {n}: llama.cpp sees {_count(len(gpus))}"
                                 + (f" (numbered 0..{len(gpus) - 1})" if gpus else ""))
        return (gpus[n],)
    endpoint = str(parse_endpoint(choice))
    on_server = [d for d in rpc if d.endpoint == endpoint]
    if not on_server:
        raise LocalspecError(f"--draft-device {endpoint}: that RPC server is not connected")
    return (on_server[0],)


def _count(n: int) -> str:
    return "no GPU" if n == 0 else ("1 GPU" if n == 1 else f"{n} GPUs")


def rpc_servers(load: LoadSettings) -> tuple[str, ...]:
    """Every RPC server these load settings use (HOST:PORT): the target's, and the draft's own if it names one."""
    servers = [str(e) for e in load.rpc_endpoints]
    if ":" in load.draft_device:
        servers.append(str(parse_endpoint(load.draft_device)))
    return tuple(dict.fromkeys(servers))


def draft_ahead(setting: str, plan: Plan) -> bool:
    """Whether to draft the next round while the target verifies (`setting`: the preset's `[load] draft_ahead`, on, off
    or auto). Auto means when the draft computes on devices the target does not use, or when both models sit on local
    GPUs only: a Qwen3-0.6B-shaped draft's kernels are launch-bound and run on their own CUDA stream beside the verify,
    which hides most of the drafting (docs/performance.md has the card pair's figures on one GPU). Not when either
    computes on the CPU or over RPC with the other: they would share its cores or its link (not measured)."""
    if setting in ("on", "off"):
        return setting == "on"
    return plan.separate or (plan.target.on_local_gpus and plan.draft.on_local_gpus)
