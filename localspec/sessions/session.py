"""From what the user named to a ready engine: resolve files → check the pair → load both models → Engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from localspec import machine
from localspec.config import BLOCK_DRAFTERS, DRAFTER_TABLE, Preset
from localspec.errors import IncompatiblePairError, LocalspecError, RollbackError, UsageError
from localspec.fsutil import not_a_file
from localspec.llama import backend, hidden, recurrent
from localspec.llama.layer_features import (
    BLOCK_DRAFTER_ARCHS,
    EAGLE3_ARCH,
    FEATURE_DRAFTER_ARCHS,
    check_block_drafter,
    check_eagle3_drafter,
)
from localspec.llama.model import LlamaModel
from localspec.llama.vision import Projector, check_projector_file
from localspec.models import compat, demo, hub, memory, placement, registry
from localspec.models.gguf_header import GGUFHeader, read_header
from localspec.rounds.engine import Engine
from localspec.rounds.prompt_cache import CacheBudget, PromptCache, limit_bytes
from localspec.status import Status


@dataclass(frozen=True)
class ModelFiles:
    """The two GGUF files of a run and what their pair recommends (None = use the preset)."""

    target: Path
    draft: Path | None
    name: str
    n_ctx: int | None = None
    n_draft: int | None = None
    kv_type: str | None = None
    preset: str | None = None  # the preset the pair names (used when --preset is not given)
    drafter: str | None = None  # the drafter the pair names (a pair without a draft model: "mtp")
    mmproj: Path | None = None  # the target's multimodal projector (pictures in prompts), if any
    pair_mmproj: Path | None = None  # the named pair's projector where it was pulled (`--mmproj auto` loads it)


def resolve_files(pair: str | None, target: Path | None, draft: Path | None,
                  fallback: str = registry.DEMO.name) -> ModelFiles:
    """Explicit paths win; otherwise the named pair, else the user's default pair, else the offline demo
    `fallback` (chat's is the instruct demo).

    Pairs resolve to files already in the Hugging Face cache, offline; `localspec pull` is the only download.
    """
    if target is not None or draft is not None:
        if target is None:
            raise UsageError("--draft PATH needs --target PATH too")
        for path in (target, draft):
            if path is not None:
                _check_model_file(path)
        return ModelFiles(target=target, draft=draft, name="custom")
    chosen = registry.get_pair(pair or registry.default_pair_name(fallback))
    if chosen.builtin:
        # A demo keeps the preset's context and draft length (its files are tiny).
        built = demo.DEMOS[chosen.name]
        return ModelFiles(target=built.target_path(), draft=built.draft_path(), name=chosen.name,
                          preset=chosen.preset)
    if chosen.target is None:  # only the built-in demos have no specs
        raise LocalspecError(f"pair {chosen.name} names no model files")
    return ModelFiles(
        target=hub.require_cached(chosen.target, chosen.name),
        draft=hub.require_cached(chosen.draft, chosen.name) if chosen.draft is not None else None,
        name=chosen.name,
        n_ctx=chosen.n_ctx,
        n_draft=chosen.n_draft,
        kv_type=chosen.kv_type,
        preset=chosen.preset,
        drafter=chosen.drafter,
        pair_mmproj=hub.cached_path(chosen.mmproj) if chosen.mmproj is not None else None,
    )


def _check_model_file(path: Path) -> None:
    """A model path must be a regular file: say what it is otherwise (a FIFO would block the reader forever)."""
    try:
        kind = not_a_file(path.stat().st_mode)
    except FileNotFoundError:
        raise LocalspecError(f"{path}: model file not found") from None
    except OSError as exc:
        raise LocalspecError(f"{path}: cannot read: {exc.strerror}") from None
    if kind is not None:
        raise LocalspecError(f"{path}: is {kind}, not a GGUF model file")


def settle_preset(preset: Preset, files: ModelFiles | None, *, prefer: str | None = None,
                  flags: dict[str, str] | None = None, **overrides: object) -> Preset:
    """Command-line values win, then what the pair recommends (context, draft length, KV type, drafter; without
    a draft model, prompt lookup unless the pair names another drafter), then the preset."""
    if files is not None:
        drafter = files.drafter or ("lookup" if files.draft is None else None)
        for key, recommended in (("n_ctx", files.n_ctx), ("n_draft", files.n_draft), ("kv_type", files.kv_type),
                                 ("drafter", drafter)):
            if overrides.get(key) is None:
                overrides[key] = recommended
    return preset.with_overrides(prefer=prefer, flags=flags, **overrides)


@dataclass(frozen=True)
class Preflight:
    verdict: compat.Verdict | None  # None without a draft
    estimate: memory.Estimate


def preflight(files: ModelFiles, preset: Preset, devices: memory.Devices | None = None,
              parallel: int = 1) -> Preflight:
    """Every check that needs no weights, from the GGUF headers alone: run before any model is loaded.

    Raises GGUFError for a header llama.cpp would abort on (a hyperparameter out of range, a key of the wrong
    type), IncompatiblePairError for a tokenizer mismatch and LocalspecError (naming what to change) when the
    pair will not fit the free VRAM/RAM at these settings (with `parallel` slots of n_ctx each).
    """
    target = read_header(files.target)
    draft = read_header(files.draft) if files.draft is not None else None
    for header in (target, draft):
        if header is not None:
            header.hparams  # noqa: B018 -- raises GGUFError on what would make llama.cpp abort
    verdict = compat.compare(target, draft) if draft is not None else None
    if verdict is not None and not verdict.compatible:
        raise IncompatiblePairError(verdict.reason)
    check_drafting(target, draft, preset)
    projector = read_header(files.mmproj) if files.mmproj is not None else None
    settings = memory.settings_from_preset(preset, n_ctx=preset.load.n_ctx, n_seq=parallel, projector=projector)
    # RPC servers are checked here, before any weight is read: a dead one is a one-line error naming it.
    est = memory.estimate(target, draft, settings, devices or memory.probe_devices(placement.rpc_servers(preset.load)))
    if not est.fits:
        fixes = " or ".join(est.suggestions)
        raise LocalspecError(f"pair {files.name} will not fit: {est.problem}; try {fixes}")
    return Preflight(verdict=verdict, estimate=est)


def check_drafting(target: GGUFHeader, draft: GGUFHeader | None, preset: Preset) -> None:
    """What speculation needs of hybrid and recurrent models, and of an MTP head, from the headers and the
    installed llama-cpp-python: refused with one line (never a silent fall back to plain decoding)."""
    drafting = preset.draft
    if drafting.n_draft == 0:
        return
    rec = target.recurrence
    if rec is not None:
        why = recurrent.rollback_unsupported()
        if why is not None:
            raise RollbackError(f"{target.name} is a {rec.kind} model: {why}")
        if not rec.rolls_back:
            raise RollbackError(f"{target.name}: llama.cpp cannot roll back a {target.arch} model's recurrent state, "
                                "which speculative decoding needs (plain decoding works: --n-draft 0)")
    if draft is not None and draft.recurrence is not None and (why := recurrent.rollback_unsupported()):
        raise RollbackError(f"{draft.name} (the draft) is a {draft.recurrence.kind} model: {why}")
    # A block drafter's GGUF (DFlash, DSpark) reads the target's layers: its header must fit the target's before
    # either loads (a width or layer llama.cpp would abort on); any other drafter cannot step it token by token.
    if draft is not None and draft.arch in BLOCK_DRAFTER_ARCHS:
        if drafting.drafter not in BLOCK_DRAFTERS:
            raise UsageError(f"{draft.name} is a block drafter (general.architecture {draft.arch}): --drafter "
                             f"{' or '.join(BLOCK_DRAFTERS)}, not {drafting.drafter}")
        check_block_drafter(target, draft, verify_width=preset.load.n_batch)
    if draft is not None and draft.arch == EAGLE3_ARCH:
        if drafting.drafter != "eagle3":
            raise UsageError(f"{draft.name} is an EAGLE-3 drafter (general.architecture {draft.arch}): --drafter "
                             f"eagle3, not {drafting.drafter}")
        check_eagle3_drafter(target, draft)
    # (A target without MTP layers is refused by Engine.check_drafter, as every drafter the models cannot run.)
    if DRAFTER_TABLE[drafting.drafter].target_head and target.nextn_layers \
            and (why := hidden.mtp_unsupported()):
        raise UsageError(f"--drafter {drafting.drafter}: {why}")


def _placed(p: placement.ModelPlacement) -> dict[str, object]:
    """A placement as LlamaModel's arguments: ggml's device handles, split mode, proportions, main device."""
    gpus = backend.gpu_devices()
    devices = [gpus[d.index] if d.kind == "gpu" else backend.rpc_devices([d.endpoint])[d.index]
               for d in p.devices]
    return {"devices": devices, "split_mode": p.split_mode, "tensor_split": p.tensor_split, "main_gpu": p.main}


@dataclass
class Session:
    files: ModelFiles
    preset: Preset
    target: LlamaModel
    draft: LlamaModel | None
    engine: Engine
    plan: placement.Plan | None = None
    threads: machine.ThreadChoice | None = None  # how the thread count was chosen (None: the preset named it)

    def close(self) -> None:
        self.engine.close()
        if self.engine.prompt_cache is not None:  # its share of a budget shared with other pairs goes back
            self.engine.prompt_cache.clear()
        for model in (self.draft, self.target):
            if model is not None:
                model.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_session(files: ModelFiles, preset: Preset, parallel: int = 1, prompt_cache: bool = False,
                 cache_budget: CacheBudget | None = None, longest_draft: int | None = None) -> Session:
    """Check the pair from its headers (no weights read), then load both models and wire up an Engine with
    `parallel` slots (each a sequence of n_ctx cells in both models); with `prompt_cache`, finished slots' cells
    are kept in host RAM up to `[server] cache_ram` (the server), or within `cache_budget`, shared with other
    pairs' caches (the router's). `longest_draft`: the longest draft length the session will be asked for, where
    it can exceed the preset's (a sweep): a recurrent target keeps that many snapshots of its state, and the memory
    check counts them."""
    rewind = max(preset.draft.n_draft, longest_draft or 0)
    if rewind != preset.draft.n_draft:  # (the check and the load see the longest length; the session the preset)
        checked = dataclasses.replace(preset, draft=dataclasses.replace(preset.draft, n_draft=rewind))
    else:
        checked = preset
    if files.mmproj is not None:  # (a wrong file stops here, before the target's weights are read)
        check_projector_file(files.mmproj)
    plan = preflight(files, checked, parallel=parallel).estimate.plan
    load = preset.load
    # Chosen once, so both models get the same count and bench and doctor can say why.
    choice = machine.thread_choice() if load.threads == 0 else None
    threads = choice.threads if choice is not None else load.threads
    # Both models take every setting from the preset's [load], but where the placement and the thread choice decide.
    target = LlamaModel(files.target, load=load, n_threads=threads, n_seq=parallel,
                        rewind=rewind,  # (a recurrent target keeps that many snapshots of its state)
                        **_placed(plan.target))
    draft = None
    try:
        if files.mmproj is not None:
            target.projector = Projector(files.mmproj, target, threads, preset.images.max_image_tokens)
        if files.draft is not None:
            # A block drafter shares the target's embeddings and output head (llama.cpp's ctx_other).
            block = read_header(files.draft).arch in FEATURE_DRAFTER_ARCHS
            draft = LlamaModel(files.draft, load=load, n_gpu_layers=load.draft_n_gpu_layers, n_threads=threads,
                               n_seq=parallel, other=target if block else None, **_placed(plan.draft))
    except BaseException:
        if draft is not None:
            draft.close()
        target.close()
        raise
    cache = None
    if prompt_cache:
        cache = PromptCache(budget=cache_budget) if cache_budget is not None else \
            PromptCache(limit_bytes(preset.server.cache_ram, machine.ram_available()))
    engine = Engine(target, draft, draft_ahead=draft is not None and placement.draft_ahead(load.draft_ahead, plan),
                    constrained_rows=load.constrained_rows, prompt_cache=cache)
    try:
        engine.check_drafter(preset.draft)  # before any work: never plain decoding in a drafter's place
        if preset.context.context_shift:
            engine.check_context_shift()
    except BaseException:
        engine.close()
        for model in (draft, target):
            if model is not None:
                model.close()
        raise
    return Session(files=files, preset=preset, target=target, draft=draft, engine=engine, plan=plan,
                   threads=choice)


def auto_draft(target: Path) -> Path:
    """`--draft auto`: a draft for `target` among the pairs' drafts in models.toml (shipped and the user's) that are
    downloaded, of the target's family (the family models.toml gives the target's file; a file it does not list:
    the architecture both GGUF headers name), smaller than the target, passing the tokenizer check (compat). A
    pair naming this target comes first, then a clean tokenizer match, then the smallest file. None: a one-line
    LocalspecError naming what was tried."""
    header = read_header(target)
    pairs = [p for p in registry.load_pairs().values() if not p.builtin]
    family = next((spec.family for p in pairs for spec in (p.target, p.draft)
                   if spec is not None and spec.file == target.name), None)
    size = target.stat().st_size
    tried: list[str] = []
    found: list[tuple[bool, bool, int, str, Path]] = []
    for spec in dict.fromkeys(p.draft for p in pairs if p.draft is not None):
        path = hub.cached_path(spec)
        if path is None:
            if spec.family in (family, header.arch):
                tried.append(f"{spec.file} (not downloaded)")
            continue
        if path.resolve() == target.resolve():
            continue
        try:
            draft = read_header(path)
            same_family = spec.family == family if family is not None else draft.arch == header.arch
            if not same_family:
                continue
            if path.stat().st_size >= size:
                tried.append(f"{spec.file} (not smaller than the target)")
                continue
            verdict = compat.compare(header, draft)
        except LocalspecError as exc:
            tried.append(f"{spec.file} ({exc})")
            continue
        if not verdict.compatible:
            fail = next(f for f in verdict.findings if f.level == Status.FAIL)
            tried.append(f"{spec.file} (tokenizer: {fail.message})")
            continue
        named = any(p.draft == spec and p.target is not None and p.target.file == target.name for p in pairs)
        found.append((not named, not verdict.tokens_match, path.stat().st_size, str(path), path))
    if not found:
        kind = f"family {family}" if family is not None else f"architecture {header.arch}"
        also = f"; tried {', '.join(tried)}" if tried else ""
        raise LocalspecError(f"--draft auto: no downloaded draft in models.toml fits {target.name} ({kind}){also}; "
                             "name one with --draft PATH, or use --draft none")
    return min(found)[-1]
