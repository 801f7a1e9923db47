"""Shared `Annotated` option types, each named after the preset key it overlays. Every default is None: the preset
(or the model pair) supplies it.

Parameters are named after preset keys (`temperature`, shown as `--temp`; `n_ctx`, shown as `--ctx`), so values
pass straight to `Preset.with_overrides`. The options every model-running command shares are declared once
(`RunOptions`) and added to each command by `with_run_options`; context shift's by `with_shift_options`.
Types, ranges and choices come from `config.py`'s field metadata, so they are written down once; config checks
the values and names the flag in its one-line error.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from localspec import config
from localspec.errors import LocalspecError, UsageError
from localspec.models.registry import load_pairs
from localspec.sessions.session import ModelFiles, auto_draft, resolve_files, settle_preset

FLAGS: dict[str, str] = {}  # preset key → the flag users type, for error messages

# --help groups the shared options in panels, after the command's own options (typer's default panel).
MODELS = "Models"
SAMPLING = "Sampling"
DRAFTING = "Drafting"
LOADING = "Loading"
PLACEMENT = "Placement / GPUs"
RPC = "RPC (other machines' devices)"


@functools.cache
def _shipped_preset() -> config.Preset:
    """The shipped default preset, for the defaults --help shows (the user's own presets cannot break --help)."""
    return config.load_preset(str(config.shipped_preset_dir() / "default.toml"))


def preset_default(key: str, section: str | None = None) -> str:
    """A key's default as --help shows it, from the shipped preset ("" when there is nothing to show).

    Options default to None (the preset fills them in), so typer has no default of its own to show; the text is
    written into the help, escaped for rich markup, in the style typer uses for the defaults it knows."""
    try:
        value = getattr(getattr(_shipped_preset(), config.section_of(key, section)), key)
    except config.ConfigError:  # a broken installation: --help still works, without defaults
        return ""
    if isinstance(value, bool):
        value = "on" if value else "off"
    return default_text(value) if value != "" else ""


def default_text(value: object) -> str:
    """' [default: VALUE]' for an option's help, as typer writes its own defaults (rich markup escaped)."""
    return f" [dim]\\[default: {value}][/dim]"


def range_text(meta: dict[str, Any]) -> str:
    """The allowed values, in the one style every option's help uses."""
    if "choices" in meta:
        return f" One of: {', '.join(meta['choices'])}."
    if "form" in meta:
        return f" Format: {meta['form']}."
    if "range" in meta:
        lo, hi = meta["range"]
        return f" Allowed: {lo}..{hi}."
    return ""


def _setting(key: str, flag: str, text: str, section: str | None = None, panel: str | None = None) -> Any:
    """The option for one preset key: its type, allowed values and default in --help, from config's metadata and
    the shipped preset."""
    meta = config.key_metadata(key, section)
    FLAGS[key] = flag
    kind = meta["kind"]
    switch = {"metavar": ""} if kind is bool else {}  # an on/off switch takes no value: show none
    return Annotated[kind | None, typer.Option(flag, help=text + range_text(meta) + preset_default(key, section),
                                               rich_help_panel=panel, show_default=False, **switch)]


setting = _setting  # for a command module's own preset-key options (rpc-server's host, port, threads)


# -- models ------------------------------------------------------------------------------------------------------

PairOpt = Annotated[
    str | None, typer.Option("--pair", help="A named model pair (see `localspec models`).", show_default=False,
                             rich_help_panel=MODELS)
]
# readable=False: click's own check would answer an unreadable file with a usage box; localspec says it in one line.
TargetOpt = Annotated[
    Path | None,
    typer.Option("--target", help="Target GGUF file (the big model).", show_default=False, readable=False,
                 rich_help_panel=MODELS),
]
MmprojOpt = Annotated[
    Path | None,
    typer.Option("--mmproj", metavar="PATH|auto", help="The target's multimodal projector GGUF (mmproj): prompts may "
                 "then hold pictures (generate --image, chat's /image, the server's image_url parts); auto: the "
                 "pair's own, pulled with it.", show_default=False,
                 readable=False, rich_help_panel=MODELS),
]
DraftOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--draft",
        metavar="K|PATH|auto|none",
        help="A number sets the draft length (0 = plain decoding); a path names the draft GGUF; auto picks a "
             "downloaded draft of the target's family from models.toml that passes the tokenizer check; none loads "
             "no draft model (a pair's target alone: --drafter lookup drafts from the context). Repeatable."
             + preset_default("n_draft"),
        show_default=False,
        rich_help_panel=DRAFTING,
    ),
]
PresetOpt = Annotated[
    str | None, typer.Option("--preset", help="Preset name or .toml path." + default_text("default"),
                             show_default=False, rich_help_panel=MODELS)
]

# -- preset keys -------------------------------------------------------------------------------------------------

temperature = _setting("temperature", "--temp", "Sampling temperature (0 = greedy).", panel=SAMPLING)
seed = _setting("seed", "--seed", "Sampling seed.", panel=SAMPLING)
n_ctx = _setting("n_ctx", "--ctx", "Context size in tokens for both models.", panel=LOADING)
n_gpu_layers = _setting("n_gpu_layers", "--ngl", "Target layers to offload to the GPU (-1 = all).", panel=PLACEMENT)
draft_n_gpu_layers = _setting("draft_n_gpu_layers", "--draft-ngl", "Draft layers to offload to the GPU (-1 = all).",
                              panel=PLACEMENT)
kv_type = _setting("kv_type", "--kv-type", "KV cache type for both models.", panel=LOADING)
threads = _setting("threads", "--threads", "CPU threads (0 = auto: the physical cores other programs leave free).",
                   panel=LOADING)
split_mode = _setting("split_mode", "--split-mode", "How the target spreads over several GPUs.", panel=PLACEMENT)
tensor_split = _setting("tensor_split", "--tensor-split",
                        "The target's share per device: RPC servers first, then GPUs ('' = by free memory).",
                        panel=PLACEMENT)
main_gpu = _setting("main_gpu", "--main-gpu", "The GPU of the whole target with --split-mode none.", panel=PLACEMENT)
draft_device = _setting("draft_device", "--draft-device", "Where the draft runs (auto = the target's main GPU).",
                        panel=PLACEMENT)
draft_ahead = _setting("draft_ahead", "--draft-ahead",
                   "Draft the next round while the target verifies (auto: own device or both on GPUs).",
                   panel=DRAFTING)
rpc = _setting("rpc", "--rpc", "llama.cpp RPC servers whose devices the target uses too.", panel=RPC)
drafter = _setting("drafter", "--drafter",
                   "Who drafts (docs/drafters.md; lookup when there is no draft model).", panel=DRAFTING)
adaptive = _setting("adaptive", "--adaptive/--no-adaptive",
                    "Choose the draft length (0..--draft) by measured cost: draft-step and verify seconds and the "
                    "running acceptance, held 16 rounds at a time.", panel=DRAFTING)
stand_aside = _setting("stand_aside", "--stand-aside/--always-draft",
                       "Draft nothing while a round of --draft drafts measures slower than plain decoding (probed "
                       "now and then); --always-draft drafts every round at its length, whatever the load "
                       "(the server's load policy cuts only requests that may stand aside).", panel=DRAFTING)
draft_ahead_length = _setting("draft_ahead_length", "--draft-ahead-length",
                        "Drafting ahead: the whole next round (full), or what fits beside the verify (fit).",
                        panel=DRAFTING)
lookup_min = _setting("lookup_min", "--lookup-min", "Prompt lookup: the shortest n-gram that counts as a match.",
                      panel=DRAFTING)
lookup_max = _setting("lookup_max", "--lookup-max", "Prompt lookup: the longest n-gram it tries first.",
                      panel=DRAFTING)
repeat = _setting("repeat", "--repeat", "Measured runs of each mode (median).")
warmup = _setting("warmup", "--warmup", "Short warm-up generations first.")
max_tokens = _setting("max_tokens", "--max-tokens", "Tokens to generate per prompt and run.", section="bench")
against = _setting("against", "--against",
                   "Then run llama.cpp's own speculative loop (llama-speculative-simple) on the same files, prompts "
                   "and settings, and print the ratio.")
llama_bin = _setting("llama_bin", "--llama-bin",
                     "llama-speculative-simple, or the folder holding it (a llama.cpp build's build/bin); unset: "
                     "$LOCALSPEC_LLAMA_BIN, then PATH.")
against_lengths = _setting("against_lengths", "--against-lengths",
                           "llama.cpp's draft lengths to try with --against (e.g. 2-6 or 2,4,6); the fastest counts.")
drafters = _setting("drafters", "--drafters",
                    "Measure these drafters in turn instead (e.g. mtp,dflash), each against plain on the same models "
                    "and prompts; the last line names the fastest.")
generate_max_tokens = _setting("max_tokens", "--max-tokens", "Tokens to generate at most.", section="generate")
chat_max_tokens = _setting("max_tokens", "--max-tokens", "Reply limit in tokens, per turn.", section="chat")
host = _setting("host", "--host", "Address to listen on.", section="server")
port = _setting("port", "--port", "Port to listen on (0 = any free port).", section="server")
queue = _setting("queue", "--queue", "Requests that may wait for a free slot; more get HTTP 503.")
allowed_hosts = _setting("allowed_hosts", "--allowed-hosts",
                         "Host names answered without --api-key besides the bound address and loopback ('*' = any).")
control_tokens = _setting("control_tokens", "--control-tokens/--no-control-tokens",
                          "Let chat message content carry the model's control tokens (<|im_end|>, ...).")
parallel = _setting("parallel", "--parallel",
                    "Slots: requests generated together, batched (each with --ctx tokens of KV cache).")
cache_ram = _setting("cache_ram", "--cache-ram",
                     "Host RAM for finished slots' KV cells, reused by later requests that share their prefix "
                     "(auto = a quarter of the RAM available at start; MiB; 0 = off).")
slot_save_path = _setting("slot_save_path", "--slot-save-path",
                          "Folder for the files of llama-server's slot save and restore actions (POST /slots/ID; '' = "
                          "off).")
context_shift = _setting("context_shift", "--context-shift/--no-context-shift",
                         "When a generation fills --ctx, drop tokens after the first --keep and go on (both models, "
                         "still exact); off: it stops there. Not on recurrent/hybrid models.", panel=LOADING)
n_keep = _setting("n_keep", "--keep", "Context shift: tokens kept at the start besides a BOS token (-1 = the whole "
                  "prompt).", panel=LOADING)
models_budget = _setting("models_budget", "--models-budget",
                         "Several --pair: MiB the loaded pairs' memory estimates and the prompt cache (--cache-ram, "
                         "one for all pairs) may take together; auto: each load checks the free VRAM (RAM without a "
                         "GPU).")
models_idle = _setting("models_idle", "--models-idle",
                       "Several --pair: seconds an idle pair stays loaded (0 = until another pair needs its room).")


NO_DRAFT_MODEL = Path("none")  # `--draft none`: no draft model, even where the pair names one
AUTO_DRAFT = Path("auto")  # `--draft auto`: the draft models.toml and the tokenizer check find for the target
AUTO_MMPROJ = Path("auto")  # `--mmproj auto`: the pair's own projector (models.toml), pulled with it


def split_draft_values(values: list[str] | None) -> tuple[int | None, Path | None]:
    """`--draft 4` is a length, `--draft small.gguf` a model, `--draft none` no model (`NO_DRAFT_MODEL`); each may
    be given once."""
    length: int | None = None
    model: Path | None = None
    for value in values or []:
        if value.strip() == "none" and model is None:
            model = NO_DRAFT_MODEL
        elif value.strip() == "auto" and model is None:
            model = AUTO_DRAFT
        elif value.strip().lstrip("-").isdigit():
            if length is not None:
                raise LocalspecError(f"--draft {value}: the draft length was already given ({length})")
            length = int(value)
            if length < 0:
                raise LocalspecError(f"--draft {value}: the draft length must be 0 or more")
        else:
            if model is not None:
                raise LocalspecError(f"--draft {value}: the draft model was already given ({model})")
            model = Path(value)
    return length, model


@dataclass(frozen=True)
class RunOptions:
    """The options every model-running command shares: which models, which preset, how to sample and load."""

    pair: str | None = None
    target: Path | None = None
    mmproj: Path | None = None
    draft: list[str] | None = None
    preset: str | None = None
    temperature: float | None = None
    seed: int | None = None
    n_gpu_layers: int | None = None
    draft_n_gpu_layers: int | None = None
    n_ctx: int | None = None
    kv_type: str | None = None
    threads: int | None = None
    split_mode: str | None = None
    tensor_split: str | None = None
    main_gpu: int | None = None
    draft_device: str | None = None
    draft_ahead: str | None = None
    rpc: str | None = None
    drafter: str | None = None
    adaptive: bool | None = None
    stand_aside: bool | None = None
    draft_ahead_length: str | None = None
    lookup_min: int | None = None
    lookup_max: int | None = None

    def files(self, fallback_pair: str | None = None) -> ModelFiles:
        """The two model files; without model arguments and without a default pair, `fallback_pair` (an offline
        demo: chat's is the instruct one)."""
        _, draft_model = split_draft_values(self.draft)
        fallback = {"fallback": fallback_pair} if fallback_pair else {}
        if draft_model == NO_DRAFT_MODEL:
            files = dataclasses.replace(resolve_files(self.pair, self.target, None, **fallback), draft=None)
        elif draft_model == AUTO_DRAFT:
            files = resolve_files(self.pair, self.target, None, **fallback)
            files = dataclasses.replace(files, draft=auto_draft(files.target))
        else:
            files = resolve_files(self.pair, self.target, draft_model, **fallback)
        if self.mmproj is None:
            return files
        if self.mmproj != AUTO_MMPROJ:
            return dataclasses.replace(files, mmproj=self.mmproj)
        if files.pair_mmproj is None:  # --mmproj auto: the pair's own projector, pulled with it
            pair = load_pairs().get(files.name)
            why = ("names no projector" if pair is None or pair.mmproj is None else
                   f"has one ({pair.mmproj.label}) not pulled yet: localspec pull {files.name}")
            raise UsageError(f"--mmproj auto: pair {files.name} {why}; give --mmproj PATH")
        return dataclasses.replace(files, mmproj=files.pair_mmproj)

    def settle(self, files: ModelFiles | None, command: str, **more: Any) -> config.Preset:
        """The preset with every value overlaid: command line first, then what the pair recommends (its preset,
        context, draft length, KV type), then the preset. `more` are the command's own preset-key options; a key in
        several sections (`max_tokens`) means the one in the command's own section."""
        n_draft, _ = split_draft_values(self.draft)
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in config.preset_keys()}
        preset = self.preset or (files.preset if files is not None else None) or "default"
        return settle_preset(config.load_preset(preset), files, n_draft=n_draft, prefer=command, flags=FLAGS,
                             **settings, **more)


_RUN_OPTIONS: dict[str, Any] = {
    "pair": PairOpt, "target": TargetOpt, "mmproj": MmprojOpt, "draft": DraftOpt, "preset": PresetOpt,
    "temperature": temperature,
    "seed": seed, "n_gpu_layers": n_gpu_layers, "draft_n_gpu_layers": draft_n_gpu_layers, "n_ctx": n_ctx,
    "kv_type": kv_type, "threads": threads, "split_mode": split_mode, "tensor_split": tensor_split,
    "main_gpu": main_gpu, "draft_device": draft_device, "draft_ahead": draft_ahead, "rpc": rpc, "drafter": drafter,
    "adaptive": adaptive, "stand_aside": stand_aside, "draft_ahead_length": draft_ahead_length,
    "lookup_min": lookup_min, "lookup_max": lookup_max,
}


def _with_group(command: Callable[..., None], group: dict[str, Any], param: str,
                build: Callable[[dict[str, Any]], Any]) -> Callable[..., None]:
    """Give a command a group of shared options: typer sees each of them in the command's signature, the command
    receives them together as its `param` (`build` of their values). A command may declare one of them its own way
    (serve's repeatable --pair): it gets that one itself."""
    hints = typing.get_type_hints(command, include_extras=True)
    own = [p.replace(annotation=hints[p.name]) for p in inspect.signature(command).parameters.values()
           if p.name != param]
    taken = {p.name for p in own}
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
              for name, annotation in group.items() if name not in taken]

    @functools.wraps(command)
    def grouped_command(**kwargs: Any) -> None:
        return command(**{param: build({name: kwargs.pop(name) for name in group if name not in taken})}, **kwargs)

    grouped_command.__signature__ = inspect.Signature([*own, *shared])  # type: ignore[attr-defined]
    grouped_command.__annotations__ = {p.name: p.annotation for p in (*own, *shared)}
    return grouped_command


def with_run_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give a command the shared `RunOptions` as its `run` parameter. One list of options, however many commands
    run models."""
    return _with_group(command, _RUN_OPTIONS, "run", lambda values: RunOptions(**values))


# Context shift, for the commands whose generations may fill the context (chat, generate, serve).
_SHIFT_OPTIONS: dict[str, Any] = {"context_shift": context_shift, "n_keep": n_keep}


def with_shift_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give a command `--context-shift` and `--keep` as its `shift` parameter: preset overrides for `resolve_run`."""
    return _with_group(command, _SHIFT_OPTIONS, "shift", dict)


def resolve_run(run: RunOptions, command: str, fallback_pair: str | None = None,
                **more: Any) -> tuple[ModelFiles, config.Preset]:
    """A command's run options (and its own preset-key options) → its two model files and its preset."""
    files = run.files(fallback_pair)
    return files, run.settle(files, command, **more)
