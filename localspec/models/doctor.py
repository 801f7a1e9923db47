"""`localspec doctor`: the pre-tuning checklist, as data. The CLI draws each check as a ✓/⚠/✗ line + fix.

Every check reads headers, the preset and the machine; none loads a weight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from localspec import machine
from localspec.config import Preset
from localspec.errors import LocalspecError
from localspec.models import compat, memory, placement
from localspec.models.gguf_header import GGUFHeader, read_header
from localspec.rounds.prompt_cache import limit_bytes
from localspec.status import Status

GiB = float(1 << 30)
GPU_BUILD_FIX = (
    'reinstall with CUDA: CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=ON -DLLAVA_BUILD=ON" pip install --force-reinstall '
    "--no-cache-dir llama-cpp-python==0.3.36"
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


DEMO_BY_DESIGN = ("the offline demo's draft is its own target requantized, by design: it shows the whole pipeline "
                  "with no download, not a speed-up")


def drafting_facts(h: GGUFHeader, role: str = "target") -> list[tuple[Status, str]]:
    """What a model's header says about drafting for it (`localspec check`): its MTP head, and whether llama.cpp
    can roll its recurrent state back (what speculation on a hybrid or recurrent model needs)."""
    out: list[tuple[Status, str]] = []
    if role == "target":
        n = h.nextn_layers
        out.append((Status.OK, f"{n} MTP layer{'s' * (n > 1)} (nextn_predict_layers): --drafter mtp drafts with the "
                               "model's own head, no draft model needed") if n else
                   (Status.INFO, "no MTP layers: --drafter mtp needs a GGUF converted with them"))
    rec = h.recurrence
    if rec is not None:
        amount = (f"{rec.state_bytes / 2**20:.1f} MiB" if rec.state_bytes >= 2**20 else
                  f"{rec.state_bytes / 2**10:.1f} KiB")
        size = f"{amount} of recurrent state a sequence" if rec.state_bytes else \
            "recurrent state of a size the header does not give"
        n_rec = len(rec.layers)
        what = f"{role} is a {rec.kind} model ({h.arch}: {n_rec} recurrent layer{'s' * (n_rec != 1)}, {size})"
        if rec.rolls_back:
            out.append((Status.OK, f"{what}; llama.cpp rolls it back for speculation (a snapshot per draft token)"))
        else:
            out.append((Status.FAIL, f"{what}; llama.cpp cannot roll it back: no speculation, plain decoding only"))
    return out


def _pair_checks(t: GGUFHeader, d: GGUFHeader | None, demo: bool = False) -> list[Check]:
    """`demo`: the built-in pair, whose draft is its target requantized on purpose; the size and bit-width
    advice cannot apply to it, so it is said as information, not as a warning with a fix nobody can take."""
    if d is None and t.nextn_layers:
        return [Check(Status.OK, "drafter", "no draft model: the target's own MTP head drafts (--drafter mtp)")]
    if d is None:
        return [
            Check(
                Status.WARN, "tokenizer", "no draft model: plain decoding only", "give --draft PATH or --pair NAME"
            )
        ]
    v = compat.compare(t, d)
    token_findings = v.token_findings
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
    if dq and demo:
        out.append(Check(Status.INFO, "draft ≥ 8-bit", f"{dq.message}; {DEMO_BY_DESIGN}"))
    elif dq:
        out.append(Check(Status.WARN, "draft ≥ 8-bit", dq.message, "use the draft's Q8_0 file"))
    else:
        out.append(Check(Status.OK, "draft ≥ 8-bit", f"draft is {d.file_type}"))
    for field, name in (
        ("draft size", "draft ≤ ~10% of target"),
        ("target quantization", "target int4-class"),
    ):
        f = next((x for x in v.findings if x.field == field), None)
        if f and demo:
            out.append(Check(Status.INFO, name, f"{f.message}; {DEMO_BY_DESIGN}"))
        elif f:
            out.append(Check(Status.WARN, name, f.message, f.why))
        else:
            out.append(Check(Status.OK, name, f"target {t.file_type}, draft {d.file_type}"))
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
    window = memory.settings_from_preset(preset, n_ctx=n_ctx, n_draft=k).window
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


RPC_FIX = ("start it there (`localspec rpc-server --host ADDRESS --port PORT`, or llama.cpp's rpc-server), or "
           "drop it from --rpc / [load] rpc")


def _machine_checks(dev: memory.Devices, rpc_servers: tuple[str, ...]) -> list[Check]:
    out = []
    if dev.gpu_offload:
        out.append(Check(Status.OK, "llama-cpp-python GPU offload",
                         f"built with GPU offload: llama.cpp sees {len(dev.gpus)} GPU{'s' * (len(dev.gpus) > 1)}"))
    elif dev.unused_gpus:
        out.append(Check(Status.WARN, "llama-cpp-python GPU offload", "CPU-only build (llama.cpp has no GPU device)",
                         GPU_BUILD_FIX))
    else:  # no NVIDIA GPU found either: a CPU build is the right one here, and the fix is for another machine
        out.append(Check(Status.INFO, "llama-cpp-python GPU offload", "CPU-only build, and no NVIDIA GPU found",
                         "on a machine with an NVIDIA GPU, " + GPU_BUILD_FIX))
    if dev.gpus:
        listed = "; ".join(f"{g.label}: {g.name}, {g.free / GiB:.1f} GiB free of {g.total / GiB:.1f} GiB"
                           for g in dev.gpus)
        out.append(Check(Status.OK, "GPU", listed + (f"; driver {dev.driver}" if dev.driver else "")))
    elif dev.unused_gpus:
        out.append(Check(Status.WARN, "GPU", f"{', '.join(dev.unused_gpus)}, driver {dev.driver}: unused by this "
                         "build", GPU_BUILD_FIX))
    else:
        why = "; ".join(dev.notes) or "no GPU found"
        out.append(Check(Status.INFO, "GPU", f"none usable ({why}); models run on the CPU",
                         "with an NVIDIA GPU: install its driver and nvidia-ml-py for VRAM checks"))
    for endpoint in rpc_servers:
        error = next((e for e in dev.rpc_errors if f"RPC server {endpoint}:" in e), None)
        if error is not None:
            out.append(Check(Status.FAIL, f"RPC server {endpoint}", error.split(": ", 1)[-1], RPC_FIX))
            continue
        devs = [d for d in dev.rpc if d.dev.endpoint == endpoint]
        out.append(Check(Status.OK, f"RPC server {endpoint}", "answers; " + "; ".join(
            f"{d.name}: {d.free / GiB:.1f} GiB free of {d.total / GiB:.1f} GiB" for d in devs)))
    out.append(Check(Status.INFO, "RAM", f"{dev.ram_available / GiB:.1f} GiB available"))
    return out


def threads_check(threads: int, choice: machine.ThreadChoice) -> Check:
    """The CPU threads llama.cpp gets: chosen from the free cores (`threads` 0), or set, and whether a set
    count asks for more cores than other programs leave free (llama.cpp's threads then wait on each other)."""
    name = "CPU threads"
    if threads == 0:
        return Check(Status.OK, name, f"auto: {choice.describe()}")
    free = choice.threads
    if threads > free:
        return Check(Status.WARN, name, f"{threads} set, but {choice.describe()}: llama.cpp's threads wait for "
                     "each other at every step when a core is taken, and decoding can slow down many times",
                     f"--threads {free}, or threads = 0 (auto) under [load]")
    return Check(Status.OK, name, f"{threads} set; {choice.describe()}")


def prompt_cache_check(cache_ram: str, ram_available: int) -> Check:
    """What `serve` keeps finished slots' KV cells in: `[server] cache_ram` in bytes, against the RAM free now."""
    name = "prompt cache (serve)"
    limit = limit_bytes(cache_ram, ram_available)
    if limit == 0:
        return Check(Status.INFO, name, "off (cache_ram = 0): a slot given to another conversation reads it "
                     "again when it returns", "--cache-ram auto, or cache_ram under [server]")
    how = (f"auto: a quarter of the {ram_available / GiB:.1f} GiB RAM available" if cache_ram == "auto"
           else f"{cache_ram} MiB set")
    if limit > ram_available:
        return Check(Status.WARN, name, f"{limit / GiB:.1f} GiB ({how}), more than the {ram_available / GiB:.1f} "
                     "GiB available: the machine would swap before the cache fills", "--cache-ram auto")
    return Check(Status.OK, name, f"up to {limit / GiB:.2f} GiB of host RAM ({how}) for finished slots' KV cells")


def _placement_check(preset: Preset, n_ctx: int, dev: memory.Devices,
                     parallel: int = 1) -> tuple[Check, memory.Settings]:
    s = memory.settings_from_preset(preset, n_ctx=n_ctx, n_seq=parallel)
    try:
        plan = memory.plan_for(s, dev)
    except LocalspecError as exc:
        return Check(Status.FAIL, "placement", str(exc), "see `localspec doctor` for the GPUs llama.cpp sees"), s
    ahead = placement.draft_ahead(preset.load.draft_ahead, plan)
    detail = (f"target: {plan.target.describe()}; draft: {plan.draft.describe()}; draft-ahead "
              f"{'on' if ahead else 'off'} ({preset.load.draft_ahead})")
    if len(dev.gpus) > 1 and not plan.separate and not plan.draft.on_cpu:
        return Check(Status.INFO, "placement", detail, "on two GPUs, --draft-device 1 gives the draft a GPU of its "
                     "own: drafting ahead then shares no GPU with the verify (measure with `localspec bench`)"), s
    return Check(Status.OK, "placement", detail), s


def _fit_check(t: GGUFHeader, d: GGUFHeader | None, s: memory.Settings, dev: memory.Devices) -> Check:
    try:
        est = memory.estimate(t, d, s, dev)
    except LocalspecError as exc:
        return Check(Status.FAIL, "the pair fits", str(exc), "choose a placement this machine has")
    where = est.where() if est.per_device else f"RAM {est.ram_bytes / GiB:.1f} GiB (no GPU: VRAM not checked)"
    if est.fits:
        slots = f" × {s.n_seq} slots" if s.n_seq > 1 else ""
        return Check(Status.OK, "the pair fits", f"at context {s.load.n_ctx}{slots}, {s.load.kv_type} KV: {where}")
    return Check(Status.FAIL, "the pair fits", f"{est.problem} ({where})", "try " + " or ".join(est.suggestions))


def run_checks(
    target: Path | None,
    draft: Path | None,
    preset: Preset,
    *,
    n_ctx: int | None = None,
    devices: memory.Devices | None = None,
    missing: str = "",
    parallel: int = 1,
    demo: bool = False,
    threads: machine.ThreadChoice | None = None,
    mmproj: Path | None = None,
) -> list[Check]:
    """The checklist in order. `missing` explains why there are no files (e.g. a pair not pulled yet);
    `parallel`: the fit of `serve`'s slots, each with a KV cache of the context; `demo`: the files are a
    built-in demo pair; `threads`: the free cores (default: measured now)."""
    servers = placement.rpc_servers(preset.load)
    dev = devices or memory.probe_devices(servers, strict=False)
    ctx = n_ctx or preset.load.n_ctx
    checks: list[Check] = []
    t, d, error = _headers(target, draft) if target else (None, None, missing or "no model files")
    if t is None:
        # A missing pair's message already names `localspec pull`; a bad file needs another file.
        fix = "" if "localspec pull" in error else "give --target/--draft paths to valid GGUF files"
        checks.append(Check(Status.FAIL, "model files", error, fix))
    else:
        checks.extend(_pair_checks(t, d, demo))
    checks.extend(_settings_checks(preset, ctx))
    checks.extend(_machine_checks(dev, servers))
    checks.append(threads_check(preset.load.threads, threads or machine.thread_choice()))
    checks.append(prompt_cache_check(preset.server.cache_ram, dev.ram_available))
    projector = None
    if mmproj is not None:
        found, projector = projector_check(mmproj, preset.images.max_image_tokens)
        checks.append(found)
    placed, settings = _placement_check(preset, ctx, dev, parallel)
    if projector is not None:
        settings = replace(settings, projector=memory.projector_memory(projector, preset.images.max_image_tokens))
    checks.append(placed)
    if t is not None and placed.status != Status.FAIL:
        checks.append(_fit_check(t, d, settings, dev))
        if projector is not None:
            checks.append(card_check(t, d, settings))
    return checks


CARD_BYTES = 24 * 2**30  # an RTX 3090/4090
CARD_RAM = 64 * 2**30  # (the host's RAM is not the question on that card: plenty)


def projector_check(path: Path, max_tokens: int = 0) -> tuple[Check, GGUFHeader | None]:
    """The target's projector: a readable mmproj file and a build with libmtmd; what it adds to the target's
    memory (its weights and the compute buffer of its largest picture: `max_tokens`, [images] max_image_tokens,
    bounds a dynamic-resolution projector's)."""
    from localspec.llama import vision

    try:
        vision.check_projector_file(path)
    except LocalspecError as exc:
        return Check(Status.FAIL, "projector", str(exc), "give --mmproj the mmproj GGUF of the target's model"), None
    header = read_header(path)
    weights, compute = memory.projector_memory(header, max_tokens)
    kind = header.metadata.get("clip.projector_type", "?")
    return Check(Status.OK, "projector", f"{path.name} ({kind}): {weights / 2**20:.0f} MiB of weights and up to "
                 f"{compute / 2**20:.0f} MiB of compute for a picture, counted with the target"), header


def card_check(t: GGUFHeader, d: GGUFHeader | None, s: memory.Settings) -> Check:
    """Whether the pair with its projector fits a 24 GiB card whole (every layer on it), at these settings, and the
    longest context that does."""
    card = memory.Devices(ram_available=CARD_RAM,
                          gpus=(memory.DeviceMem(placement.Dev("gpu", 0), "a 24 GiB card", CARD_BYTES, CARD_BYTES),))
    whole = s.changed(n_gpu_layers=-1, draft_n_gpu_layers=-1, split_mode="none", tensor_split=(), main_gpu=0,
                      draft_device="auto", rpc=())
    try:
        est = memory.estimate(t, d, whole, card)
    except LocalspecError as exc:
        return Check(Status.INFO, "on a 24 GiB card", f"not estimated: {exc}")
    if est.fits:
        return Check(Status.OK, "on a 24 GiB card", f"the pair and its projector fit at context {whole.load.n_ctx} "
                     f"({est.where()})")
    longest = memory.largest_ctx(t, d, whole, card)
    room = f"the longest context that fits: {longest}" if longest else "no context fits"
    return Check(Status.WARN, "on a 24 GiB card", f"{est.problem}; {room}", "a smaller --ctx or --kv-type q8_0")
