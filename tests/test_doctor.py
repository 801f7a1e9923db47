"""The doctor checklist as data: every item present, and each one flips when its cause is there."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from localspec import config
from localspec.models import demo, doctor, memory
from localspec.models.placement import Dev
from localspec.status import Status

PLENTY = memory.Devices(ram_available=64 << 30)
NAMES = [
    "same family and tokenizer",
    "draft ≥ 8-bit",
    "draft ≤ ~10% of target",
    "target int4-class",
    "one sampling configuration",
    "draft length",
    "KV room for the verification window",
    "warm-up",
    "fixed seed",
    "llama-cpp-python GPU offload",
    "GPU",
    "RAM",
    "CPU threads",
    "prompt cache (serve)",
    "placement",
    "the pair fits",
]


@pytest.fixture(scope="module")
def gemma(demo_home: Path) -> Path:
    """The demo target (Gemma 3 270M Q4_K_M), assembled once per session by conftest's demo_home."""
    return demo_home / "cache" / "demo" / demo.TARGET_FILE


def _by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {c.name: c for c in checks}


def test_every_item_of_the_checklist_is_there(gemma: Path) -> None:
    checks = doctor.run_checks(gemma, gemma, config.load_preset(), devices=PLENTY)
    assert [c.name for c in checks] == NAMES
    by = _by_name(checks)
    assert by["same family and tokenizer"].status == Status.OK
    assert by["the pair fits"].status == Status.OK
    assert by["GPU"].status == Status.INFO  # no GPU given: says so instead of guessing
    for c in checks:
        if c.status in (Status.WARN, Status.FAIL):
            assert c.fix, c  # every problem comes with a fix


def test_prompt_cache_line_says_what_auto_means_here() -> None:
    auto = doctor.prompt_cache_check("auto", 8 << 30)
    assert auto.status == Status.OK and "2.00 GiB" in auto.detail and "a quarter of the 8.0 GiB" in auto.detail
    off = doctor.prompt_cache_check("0", 8 << 30)
    assert off.status == Status.INFO and "off" in off.detail
    too_much = doctor.prompt_cache_check("16384", 8 << 30)
    assert too_much.status == Status.WARN and too_much.fix == "--cache-ram auto"


def test_incompatible_pair_fails_with_the_reason(gemma: Path, smollm2_path: Path) -> None:
    by = _by_name(doctor.run_checks(gemma, smollm2_path, config.load_preset(), devices=PLENTY))
    c = by["same family and tokenizer"]
    assert c.status == Status.FAIL and "tokenizer models differ" in c.detail
    assert by["draft ≥ 8-bit"].status == Status.WARN  # SmolLM2 here is Q4_1


def test_settings_checks_flip(gemma: Path) -> None:
    preset = config.load_preset().with_overrides(n_draft=12, warmup=0)
    by = _by_name(doctor.run_checks(gemma, gemma, preset, devices=PLENTY, n_ctx=128))
    assert by["draft length"].status == Status.WARN and "--draft 5" in by["draft length"].fix
    assert by["warm-up"].status == Status.WARN
    kv = by["KV room for the verification window"]
    assert kv.status == Status.FAIL and kv.fix.startswith("--ctx ")


def test_pair_that_does_not_fit_proposes_a_fix(gemma: Path) -> None:
    small = dataclasses.replace(PLENTY, ram_available=600 << 20)
    c = _by_name(doctor.run_checks(gemma, gemma, config.load_preset(), devices=small))["the pair fits"]
    assert c.status == Status.FAIL and "RAM" in c.detail and c.fix.startswith("try ")


def test_gpu_build_and_gpu_lines() -> None:
    dev = memory.Devices(
        ram_available=1 << 30,
        gpus=(memory.DeviceMem(Dev("gpu", 0), "RTX 4090", 20 << 30, 24 << 30),),
        driver="550.1",
    )
    by = _by_name(doctor.run_checks(None, None, config.load_preset(), devices=dev, missing="no files"))
    assert by["llama-cpp-python GPU offload"].status == Status.OK
    assert by["GPU"].detail == "GPU 0: RTX 4090, 20.0 GiB free of 24.0 GiB; driver 550.1"
    assert by["model files"].status == Status.FAIL
    assert by["placement"].detail.startswith("target: GPU 0; draft: GPU 0; draft-ahead on (auto)")
    cpu = dataclasses.replace(dev, gpus=(), unused_gpus=("RTX 4090",))
    by = _by_name(doctor.run_checks(None, None, config.load_preset(), devices=cpu))
    assert by["llama-cpp-python GPU offload"].status == Status.WARN
    assert "GGML_CUDA" in by["llama-cpp-python GPU offload"].fix
    assert by["GPU"].status == Status.WARN and "unused by this build" in by["GPU"].detail
