"""Placement over several GPUs and RPC servers: the plan, the per-device memory preflight and its advice, doctor's
lines and `models`' fit, all against synthetic `Devices` (this machine has no GPU)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from localspec import config
from localspec.cli import models_cmd
from localspec.errors import ConfigError, LocalspecError
from localspec.models import demo, doctor, memory, placement, registry
from localspec.models.gguf_header import read_header
from localspec.models.placement import Dev
from localspec.status import Status

GiB = 1 << 30


def preset_settings(**values: object) -> memory.Settings:
    """The default preset's estimate settings with these values (`memory.Settings.changed`)."""
    return memory.settings_from_preset(config.load_preset()).changed(**values)


def gpus(*free_gib: float, name: str = "RTX 3090") -> tuple[memory.DeviceMem, ...]:
    return tuple(memory.DeviceMem(Dev("gpu", i), name, int(f * GiB), 24 * GiB) for i, f in enumerate(free_gib))


def machine(*free_gib: float, rpc: tuple[memory.DeviceMem, ...] = ()) -> memory.Devices:
    return memory.Devices(ram_available=64 * GiB, gpus=gpus(*free_gib), rpc=rpc, driver="550.1")


@pytest.fixture(scope="module")
def gemma(demo_home: Path):
    """The demo target's header (Gemma 3 270M): real shapes for the byte counts."""
    header = read_header(demo_home / "cache" / "demo" / demo.TARGET_FILE)
    return header, header


# -- the plan ----------------------------------------------------------------------------------------------------

def test_default_plan_follows_llama_cpp() -> None:
    cpu = placement.plan(n_gpus=0, rpc=[])
    assert cpu.target.on_cpu and cpu.draft.on_cpu and not cpu.separate
    one = placement.plan(n_gpus=1, rpc=[])
    assert one.target.devices == one.draft.devices == (Dev("gpu", 0),) and not one.separate
    two = placement.plan(n_gpus=2, rpc=[])
    assert two.target.devices == (Dev("gpu", 0), Dev("gpu", 1)) and two.target.split_mode == "layer"
    assert two.draft.devices == (Dev("gpu", 0),)  # with the target's main GPU
    assert two.target.describe() == "layer split over GPU 0 + GPU 1"


def test_a_gpu_named_for_the_draft_is_its_own() -> None:
    own = placement.plan(n_gpus=2, rpc=[], draft_device="1")
    assert own.target.devices == (Dev("gpu", 0),) and own.draft.devices == (Dev("gpu", 1),)
    assert own.separate and placement.draft_ahead("auto", own)
    assert not placement.draft_ahead("off", own)
    # a share for every GPU keeps the target on the draft's GPU too (the 48 GB case): then nothing is separate
    shared = placement.plan(n_gpus=2, rpc=[], draft_device="1", tensor_split=(1, 1))
    assert shared.target.devices == (Dev("gpu", 0), Dev("gpu", 1)) and not shared.separate
    none = placement.plan(n_gpus=2, rpc=[], split_mode="none", main_gpu=1, draft_device="0")
    assert none.target.devices == (Dev("gpu", 1),) and none.draft.devices == (Dev("gpu", 0),) and none.separate
    # the draft on the CPU beside a GPU target is separate too; on one GPU with the target it is not
    assert placement.plan(n_gpus=1, rpc=[], draft_n_gpu_layers=0).separate
    assert placement.draft_ahead("on", one := placement.plan(n_gpus=1, rpc=[])) and not one.separate


def test_auto_drafts_ahead_on_local_gpus_and_never_beside_the_cpu_or_rpc() -> None:
    # both on one GPU: the draft's launch-bound kernels run beside the verify (measured faster on the H200)
    one = placement.plan(n_gpus=1, rpc=[])
    assert placement.draft_ahead("auto", one) and not placement.draft_ahead("off", one)
    assert placement.draft_ahead("auto", placement.plan(n_gpus=2, rpc=[]))  # target over both, draft on GPU 0
    # either model computing on the CPU with the other: they would share its cores
    assert not placement.draft_ahead("auto", placement.plan(n_gpus=0, rpc=[]))
    assert not placement.draft_ahead("auto", placement.plan(n_gpus=1, rpc=[], n_gpu_layers=20))
    assert not placement.draft_ahead("auto", placement.plan(n_gpus=1, rpc=[], draft_n_gpu_layers=20))
    # a target partly on an RPC server, the draft on the local GPU it also uses: not measured, so off
    remote = [Dev("rpc", 0, "10.0.0.2:50052")]
    with_rpc = placement.plan(n_gpus=1, rpc=remote, target_rpc=("10.0.0.2:50052",))
    assert not with_rpc.separate and not placement.draft_ahead("auto", with_rpc)
    assert placement.draft_ahead("on", with_rpc)


def test_rpc_servers_come_first_and_the_draft_stays_local() -> None:
    remote = [Dev("rpc", 0, "10.0.0.2:50052"), Dev("rpc", 0, "10.0.0.3:50052")]
    p = placement.plan(n_gpus=1, rpc=remote, target_rpc=("10.0.0.2:50052",), tensor_split=(1, 3))
    assert p.target.devices == (remote[0], Dev("gpu", 0)) and p.target.main == 1
    assert p.draft.devices == (Dev("gpu", 0),)
    on_server = placement.plan(n_gpus=0, rpc=remote, target_rpc=("10.0.0.2:50052",), draft_device="10.0.0.3:50052")
    assert on_server.target.devices == (remote[0],) and on_server.draft.devices == (remote[1],)
    assert on_server.separate


@pytest.mark.parametrize(("settings", "message"), [
    ({"draft_device": "2"}, "--draft-device 2: llama.cpp sees 2 GPUs (numbered 0..1)"),
    ({"main_gpu": 3}, "--main-gpu 3: llama.cpp sees 2 GPUs"),
    ({"tensor_split": (1, 2, 3)}, "--tensor-split 1,2,3: 3 proportions for 2 target devices (GPU 0, GPU 1)"),
    ({"draft_device": "10.0.0.9:1"}, "--draft-device 10.0.0.9:1: that RPC server is not connected"),
])
def test_a_placement_the_machine_lacks_names_the_option(settings: dict, message: str) -> None:
    with pytest.raises(LocalspecError) as exc:
        placement.plan(n_gpus=2, rpc=[], **settings)
    assert str(exc.value).startswith(message)


def test_placement_settings_are_checked_where_they_are_read() -> None:
    preset = config.load_preset()
    assert preset.load.split_mode == "layer" and preset.load.draft_device == "auto" and preset.load.rpc == ""
    s = preset.with_overrides(tensor_split="3, 1", rpc="a:1,b:2", draft_device="1")
    assert s.load.tensor_split_values == (3.0, 1.0) and [str(e) for e in s.load.rpc_endpoints] == ["a:1", "b:2"]
    flags = {"tensor_split": "--tensor-split", "rpc": "--rpc", "draft_device": "--draft-device"}
    for key, bad, why in (("tensor_split", "3;1", "comma-separated numbers"), ("tensor_split", "0,0", "not all"),
                          ("rpc", "a:1,a:1", "listed twice"), ("rpc", "host", "HOST:PORT"),
                          ("draft_device", "gpu1", "a GPU number")):
        with pytest.raises(ConfigError) as exc:
            preset.with_overrides(flags=flags, **{key: bad})
        assert str(exc.value).startswith(f"{flags[key]} = {bad!r}: ") and why in str(exc.value)


# -- memory per device -------------------------------------------------------------------------------------------

def test_each_device_gets_its_share(gemma) -> None:
    t, d = gemma
    s = preset_settings(n_ctx=4096, n_draft=6)
    est = memory.estimate(t, d, s, machine(30, 10))
    need = {n.device.label: n.need for n in est.per_device}
    assert set(need) == {"GPU 0", "GPU 1"} and est.fits
    target, draft = est.models
    # the target's layers by free memory (3:1), its compute buffer with the output layer on GPU 1; the draft on GPU 0
    overhead = memory.GPU_RUNTIME_OVERHEAD
    assert need["GPU 1"] == pytest.approx((target.weights + target.kv) / 4 + target.compute + overhead, rel=1e-6)
    assert need["GPU 0"] == pytest.approx((target.weights + target.kv) * 3 / 4 + draft.weights + draft.kv
                                          + draft.compute + overhead, rel=1e-6)
    assert est.gpu_bytes == sum(need.values())
    assert est.where().startswith("GPU 0 ") and "RAM " in est.where()


def test_draft_on_the_other_gpu_is_proposed_with_what_it_frees(gemma) -> None:
    t, d = gemma
    s = preset_settings(n_ctx=4096, n_draft=6, split_mode="none")
    alone = memory.estimate(t, None, s, machine(64, 64)).per_device[0].need  # the target alone on GPU 0
    tight = machine((alone + 100 * 2**20) / GiB / (1 - memory.HEADROOM), 64)
    est = memory.estimate(t, d, s, tight)
    assert not est.fits and est.problem.startswith("needs ") and "VRAM on GPU 0 (RTX 3090)" in est.problem
    draft_bytes = est.models[1].weights + est.models[1].kv + est.models[1].compute
    assert est.suggestions[0] == (f"--draft-device 1 (the draft on GPU 1: frees {draft_bytes / GiB:.1f} GiB on "
                                  "GPU 0)")
    assert memory.estimate(t, d, s.changed(draft_device="1"), tight).fits


def test_a_split_that_fits_is_proposed(gemma) -> None:
    t, d = gemma
    s = preset_settings(n_ctx=4096, n_draft=6, tensor_split=(1, 1))
    need = memory.estimate(t, d, s, machine(64, 64)).per_device
    # GPU 0 (target half + draft) has just too little, GPU 1 plenty: a split that moves layers to GPU 1 fits
    tight = machine((need[0].need - 50 * 2**20) / GiB / (1 - memory.HEADROOM), 64)
    est = memory.estimate(t, d, s, tight)
    assert not est.fits
    split = next(x for x in est.suggestions if x.startswith("--tensor-split "))
    values = tuple(float(v) for v in split.split()[1].split(","))
    assert values[0] < values[1] and memory.estimate(t, d, s.changed(tensor_split=values), tight).fits


def test_rpc_devices_are_counted(gemma) -> None:
    t, d = gemma
    server = memory.DeviceMem(Dev("rpc", 0, "10.0.0.2:50052"), "RPC0", 1 * GiB, 1 * GiB)
    s = preset_settings(n_ctx=4096, n_draft=6, rpc=("10.0.0.2:50052",), tensor_split=(1, 1))
    est = memory.estimate(t, d, s, machine(64, rpc=(server,)))
    by = {n.device.label: n for n in est.per_device}
    assert set(by) == {"RPC 10.0.0.2:50052", "GPU 0"}
    assert by["RPC 10.0.0.2:50052"].need == pytest.approx((est.models[0].weights + est.models[0].kv) / 2, rel=1e-6)
    small = machine(64, rpc=(replace(server, free=by["RPC 10.0.0.2:50052"].need // 2),))
    short = memory.estimate(t, d, s, small)
    assert not short.fits and "on RPC 10.0.0.2:50052" in short.problem


# -- doctor and models -------------------------------------------------------------------------------------------

def test_doctor_reports_placement_per_device(demo_home: Path) -> None:
    path = demo_home / "cache" / "demo" / demo.TARGET_FILE
    preset = config.load_preset()
    by = {c.name: c for c in doctor.run_checks(path, path, preset, devices=machine(20, 20))}
    assert by["GPU"].detail.startswith("GPU 0: RTX 3090, 20.0 GiB free of 24.0 GiB; GPU 1: RTX 3090")
    assert by["placement"].status == Status.INFO  # two GPUs, the draft with the target: a hint, not a problem
    assert by["placement"].detail == ("target: layer split over GPU 0 + GPU 1; draft: GPU 0; draft-ahead on "
                                      "(auto)")
    assert "--draft-device 1" in by["placement"].fix
    assert by["the pair fits"].status == Status.OK and "GPU 0 " in by["the pair fits"].detail
    assert "GPU 1 " in by["the pair fits"].detail
    own = {c.name: c for c in doctor.run_checks(path, path, preset.with_overrides(draft_device="1"),
                                                devices=machine(20, 20))}
    assert own["placement"].status == Status.OK
    assert own["placement"].detail == "target: GPU 0; draft: GPU 1; draft-ahead on (auto)"
    bad = {c.name: c for c in doctor.run_checks(path, path, preset.with_overrides(draft_device="4"),
                                                devices=machine(20, 20))}
    assert bad["placement"].status == Status.FAIL and "--draft-device 4" in bad["placement"].detail
    assert "the pair fits" not in bad


def test_doctor_reports_each_rpc_server(demo_home: Path) -> None:
    path = demo_home / "cache" / "demo" / demo.TARGET_FILE
    preset = config.load_preset().with_overrides(rpc="10.0.0.2:50052,10.0.0.3:50052")
    server = memory.DeviceMem(Dev("rpc", 0, "10.0.0.2:50052"), "RPC0", 10 * GiB, 16 * GiB)
    dev = replace(machine(20, rpc=(server,)), rpc_errors=("RPC server 10.0.0.3:50052: connection refused",))
    by = {c.name: c for c in doctor.run_checks(path, path, preset, devices=dev)}
    assert by["RPC server 10.0.0.2:50052"].status == Status.OK
    assert by["RPC server 10.0.0.2:50052"].detail == "answers; RPC0: 10.0 GiB free of 16.0 GiB"
    down = by["RPC server 10.0.0.3:50052"]
    assert down.status == Status.FAIL and down.detail == "connection refused" and "rpc-server" in down.fix


def test_models_judges_fit_against_every_gpu_together(monkeypatch: pytest.MonkeyPatch) -> None:
    pair = registry.load_pairs()["qwen2.5-coder-32b"]  # 20.4 GB of weights
    # not downloaded (and huggingface_hub not imported here: it reads HF_HUB_OFFLINE once, at its import)
    monkeypatch.setattr(models_cmd, "_cached_files", lambda pair: None)
    preset = config.load_preset()
    assert "no" in models_cmd._fits(pair, machine(12), preset)
    assert "likely" in models_cmd._fits(pair, machine(12, 12), preset)


def test_gpu_offload_comes_from_gpu_devices_not_from_rpc_support() -> None:
    """This CPU build has the RPC backend, which llama_supports_gpu_offload() counts as offload."""
    import llama_cpp

    from localspec.llama import backend

    kinds = {d.kind for d in backend.backend_devices()}
    assert backend.supports_gpu_offload() == bool(kinds & {"gpu", "igpu"})
    if not kinds & {"gpu", "igpu"}:
        assert llama_cpp.llama_supports_gpu_offload()  # the call this replaces would have said yes
        assert not memory.probe_devices().gpu_offload
