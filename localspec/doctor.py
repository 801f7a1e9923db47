"""`localspec doctor`: the pre-tuning checklist, as data. The CLI draws each check as a ✓/⚠/✗ line + fix.

Every check reads headers, the preset and the machine; none loads a weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localspec import compat, memory
from localspec.config import Preset
from localspec.errors import LocalspecError
from localspec.gguf_header import GGUFHeader, read_header
from localspec.status import Status

GiB = float(1 << 30)
GPU_BUILD_FIX = (
    'reinstall with CUDA: CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir '
    "llama-cpp-python==0.3.36"
)


@dataclass(frozen=True)
class Check:
    status: Status
    name: str
    detail: str
    fix: str = ""


def _headers(target: Path | None, draft: Path | None) -> tuple[GGUFHeader | None, GGUFHeader | None, str]:
    try:
        t = read_header(target) if target else None
        d = read_header(draft) if draft else None
        for header in (t, d):
            if header is not None:
                header.hparams  # noqa: B018 -- every key's type and range, before any check reads them
    except LocalspecError as exc:
        return None, None, str(exc)
    return t, d, ""


def _pair_checks(t: GGUFHeader, d: GGUFHeader | None) -> list[Check]:
    if d is None:
        return [
            Check(
                Status.WARN, "tokenizer", "no draft model: plain decoding only", "give --draft PATH or --pair NAME"
            )
        ]
    v = compat.compare(t, d)
    token_findings = [
        f for f in v.findings if f.field not in {"draft quantization", "draft size", "target quantization"}
    ]
    worst = max((f.level for f in token_findings), default=Status.OK)
    first = next((f for f in token_findings if f.level == worst), None)
    family = f"{t.arch} / {d.arch}"
    if worst == Status.FAIL:
        out = [
            Check(
                Status.FAIL,
                "same family and tokenizer",
                f"{family}: {first.message}" if first else family,
                "use a draft of the target's own family (same tokenizer), e.g. a pair in `localspec models`",
            )
        ]
    elif worst == Status.WARN and first is not None:
        out = [Check(Status.WARN, "same family and tokenizer", f"{family}: {first.message}", first.why)]
    else:
        out = [Check(Status.OK, "same family and tokenizer", f"{family}: every id means the same token")]
    dq = next((f for f in v.findings if f.field == "draft quantization"), None)
    out.append(
        Check(Status.WARN, "draft ≥ 8-bit", dq.message, "use the draft's Q8_0 file")
        if dq
        else Check(Status.OK, "draft ≥ 8-bit", f"draft is {d.file_type}")
    )
    for field, name in (
        ("draft size", "draft ≤ ~10% of target"),
        ("target quantization", "target int4-class"),
    ):
        f = next((x for x in v.findings if x.field == field), None)
        out.append(
            Check(Status.WARN, name, f.message, f.why)
            if f
            else Check(Status.OK, name, f"target {t.file_type}, draft {d.file_type}")
        )
    return out


def _settings_checks(preset: Preset, n_ctx: int) -> list[Check]:
    out = [
        Check(
            Status.OK,
            "one sampling configuration",
            "the preset's sampling section drives both target and draft "
            f"(temperature {preset.sampling.temperature}, top_k {preset.sampling.top_k}, "
            f"top_p {preset.sampling.top_p})",
        )
    ]
    k = preset.draft.n_draft
    if preset.draft.adaptive:
        out.append(Check(Status.OK, "draft length", f"adaptive, at most {k}"))
    elif 4 <= k <= 6:
        out.append(Check(Status.OK, "draft length", f"{k}"))
    else:
        out.append(Check(Status.WARN, "draft length", f"{k} (4-6 suits most pairs)",
                         "--draft 5, or adaptive = true in a preset, or tune it with `localspec bench --draft N`"))
    window = memory.Settings(n_ctx=n_ctx, n_draft=k).window
    need = preset.bench.max_tokens + window
    room = "KV room for the verification window"
    if n_ctx < need:
        out.append(Check(Status.FAIL, room, f"context {n_ctx} < {preset.bench.max_tokens} generated + {window} "
                         "window tokens", f"--ctx {max(1024, 1 << (need - 1).bit_length())}"))
    else:
        out.append(Check(Status.OK, room, f"context {n_ctx}: {window} tokens reserved for drafting and verification"))
    if preset.bench.warmup > 0:
        out.append(Check(Status.OK, "warm-up", f"{preset.bench.warmup} warm-up generations before measuring"))
    else:
        out.append(Check(Status.WARN, "warm-up", "off: the first runs pay for cold caches and clocks",
                         "--warmup 10 (or bench.warmup in a preset)"))
    out.append(Check(Status.OK, "fixed seed", f"seed {preset.sampling.seed} for every run, so comparisons repeat"))
    return out


def _machine_checks(dev: memory.Devices) -> list[Check]:
    out = []
    if dev.gpu_offload:
        out.append(Check(Status.OK, "llama-cpp-python GPU offload", "built with GPU offload"))
    else:
        out.append(
            Check(
                Status.WARN,
                "llama-cpp-python GPU offload",
                "CPU-only build (llama_supports_gpu_offload = 0)",
                GPU_BUILD_FIX,
            )
        )
    if dev.gpu_name:
        free = f"{(dev.gpu_free or 0) / GiB:.1f} GiB free of {(dev.gpu_total or 0) / GiB:.1f} GiB"
        out.append(
            Check(
                Status.OK if dev.gpu_offload else Status.WARN,
                "GPU",
                f"{dev.gpu_name}, driver {dev.driver}, "
                + (free if dev.gpu_free is not None else "unused by this build"),
                "" if dev.gpu_offload else GPU_BUILD_FIX,
            )
        )
    else:
        why = "; ".join(dev.notes) or "no NVIDIA GPU found"
        out.append(
            Check(
                Status.INFO,
                "GPU",
                f"none usable ({why}); models run on the CPU",
                "install the NVIDIA driver and nvidia-ml-py for VRAM checks",
            )
        )
    out.append(Check(Status.INFO, "RAM", f"{dev.ram_available / GiB:.1f} GiB available"))
    return out


def _fit_check(t: GGUFHeader, d: GGUFHeader | None, preset: Preset, n_ctx: int, dev: memory.Devices) -> Check:
    s = memory.settings_from_preset(preset, n_ctx=n_ctx)
    est = memory.estimate(t, d, s, dev)
    where = (
        f"{est.gpu_bytes / GiB:.1f} GiB VRAM + {est.ram_bytes / GiB:.1f} GiB RAM"
        if dev.gpu_free is not None
        else f"{est.ram_bytes / GiB:.1f} GiB RAM (no GPU: VRAM not checked)"
    )
    if est.fits:
        return Check(Status.OK, "the pair fits", f"needs {where} at context {n_ctx}, {s.kv_type} KV")
    return Check(Status.FAIL, "the pair fits", est.problem, "try " + " or ".join(est.suggestions))


def run_checks(
    target: Path | None,
    draft: Path | None,
    preset: Preset,
    *,
    n_ctx: int | None = None,
    devices: memory.Devices | None = None,
    missing: str = "",
) -> list[Check]:
    """The checklist in order. `missing` explains why there are no files (e.g. a pair not pulled yet)."""
    dev = devices or memory.probe_devices()
    ctx = n_ctx or preset.load.n_ctx
    checks: list[Check] = []
    t, d, error = _headers(target, draft) if target else (None, None, missing or "no model files")
    if t is None:
        # A missing pair's message already names `localspec pull`; a bad file needs another file.
        fix = "" if "localspec pull" in error else "give --target/--draft paths to valid GGUF files"
        checks.append(Check(Status.FAIL, "model files", error, fix))
    else:
        checks.extend(_pair_checks(t, d))
    checks.extend(_settings_checks(preset, ctx))
    checks.extend(_machine_checks(dev))
    if t is not None:
        checks.append(_fit_check(t, d, preset, ctx, dev))
    return checks
