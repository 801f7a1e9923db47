"""Shared `Annotated` option types, each named after the preset key it overlays. Every default is None: the preset
(or the model pair) supplies it.

A command names its parameters after preset keys (`temperature`, shown as `--temp`; `n_ctx`, shown as `--ctx`) and
hands its `locals()` to `resolve_run`, which passes every preset-named value straight to `Preset.with_overrides`.
Types, ranges and choices come from `config.py`'s field metadata, so they are written down once; config checks
the values and names the flag in its one-line error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from localspec import config
from localspec.errors import LocalspecError
from localspec.session import ModelFiles, resolve_files, settle_preset

FLAGS: dict[str, str] = {}  # preset key → the flag users type, for error messages


def _setting(key: str, flag: str, text: str, section: str | None = None) -> Any:
    """The option for one preset key: its type and the allowed values in --help, from config's metadata."""
    meta = config.key_metadata(key, section)
    if "choices" in meta:
        text += f" One of: {', '.join(meta['choices'])}."
    elif "range" in meta:
        lo, hi = meta["range"]
        text += f" Allowed: {lo}..{hi}."
    FLAGS[key] = flag
    kind = meta["kind"]
    return Annotated[kind | None, typer.Option(flag, help=text, show_default=False)]


# -- models ------------------------------------------------------------------------------------------------------

PairOpt = Annotated[
    str | None, typer.Option("--pair", help="A named model pair (see `localspec models`).", show_default=False)
]
TargetOpt = Annotated[
    Path | None, typer.Option("--target", help="Target GGUF file (the big model).", show_default=False)
]
DraftOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--draft",
        help="A number sets the draft length (0 = plain decoding); a path names the draft GGUF. Repeatable.",
        show_default=False,
    ),
]
PresetOpt = Annotated[
    str | None, typer.Option("--preset", help="Preset name or .toml path (default: default).", show_default=False)
]

# -- preset keys -------------------------------------------------------------------------------------------------

temperature = _setting("temperature", "--temp", "Sampling temperature (0 = greedy).")
seed = _setting("seed", "--seed", "Sampling seed.")
n_ctx = _setting("n_ctx", "--ctx", "Context size in tokens for both models.")
n_gpu_layers = _setting("n_gpu_layers", "--ngl", "Target layers to offload to the GPU (-1 = all).")
draft_n_gpu_layers = _setting("draft_n_gpu_layers", "--draft-ngl", "Draft layers to offload to the GPU (-1 = all).")
kv_type = _setting("kv_type", "--kv-type", "KV cache type for both models.")
threads = _setting("threads", "--threads", "CPU threads (0 = physical cores).")
repeat = _setting("repeat", "--repeat", "Measured runs of each mode (median).")
warmup = _setting("warmup", "--warmup", "Short warm-up generations first.")
max_tokens = _setting("max_tokens", "--max-tokens", "Tokens to generate.")


def split_draft_values(values: list[str] | None) -> tuple[int | None, Path | None]:
    """`--draft 4` is a length, `--draft small.gguf` a model; each may be given once."""
    length: int | None = None
    model: Path | None = None
    for value in values or []:
        if value.strip().lstrip("-").isdigit():
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


def resolve_run(values: dict[str, Any], command: str) -> tuple[ModelFiles, config.Preset]:
    """A command's `locals()` → its two model files and its preset.

    `pair`, `target`, `draft` and `preset` pick the files and the preset; every other value named after a preset
    key overlays it (command line first, then what the pair recommends, then the preset). A key that lives in
    several sections (`max_tokens`) means the one in the command's own section.
    """
    n_draft, draft_model = split_draft_values(values.get("draft"))
    files = resolve_files(values.get("pair"), values.get("target"), draft_model)
    keys = config.preset_keys()
    overrides = {k: v for k, v in values.items() if k in keys and v is not None}
    chosen = settle_preset(config.load_preset(values.get("preset") or "default"), files, n_draft=n_draft,
                           prefer=command, flags=FLAGS, **overrides)
    return files, chosen
