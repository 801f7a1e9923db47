"""Shared `Annotated` option types. Every default is None: the preset (or the model spec) supplies it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from localspec import config
from localspec.errors import LocalspecError
from localspec.session import ModelFiles, resolve_files, settle_preset

PairOpt = Annotated[
    str | None, typer.Option("--pair", help="A named model pair (see `localspec models`).", show_default=False)
]
# readable=False: click's own check would answer an unreadable file with a usage box; localspec says it in one line.
TargetOpt = Annotated[
    Path | None,
    typer.Option("--target", help="Target GGUF file (the big model).", show_default=False, readable=False),
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
MaxTokensOpt = Annotated[
    int | None, typer.Option("--max-tokens", help="Tokens to generate (preset's bench.max_tokens).", min=1)
]
TempOpt = Annotated[float | None, typer.Option("--temp", help="Sampling temperature (0 = greedy).", min=0.0)]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Sampling seed.", min=0)]
GpuLayersOpt = Annotated[
    int | None, typer.Option("--ngl", help="Target layers to offload to the GPU (-1 = all).", min=-1)
]
DraftGpuLayersOpt = Annotated[
    int | None, typer.Option("--draft-ngl", help="Draft layers to offload to the GPU (-1 = all).", min=-1)
]
CtxOpt = Annotated[int | None, typer.Option("--ctx", help="Context size in tokens for both models.", min=64)]
KvTypeOpt = Annotated[
    str | None, typer.Option("--kv-type", help="KV cache type: f16, q8_0 or q4_0.", show_default=False)
]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="CPU threads (default: physical cores).", min=1)]


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


def resolve_run(pair: str | None, target: Path | None, draft: list[str] | None, preset: str | None,
                **overrides: object) -> tuple[ModelFiles, config.Preset]:
    """The model options of every command → the two files and the preset: command line first, then what the
    pair recommends, then the preset."""
    n_draft, draft_model = split_draft_values(draft)
    files = resolve_files(pair, target, draft_model)
    chosen = settle_preset(config.load_preset(preset or "default"), files, n_draft=n_draft, **overrides)
    return files, chosen
