"""Fill-in-the-middle prompts from the model's own FIM tokens (llama.cpp's vocab: fim_pre/suf/mid, and rep/sep
for the repo-level pattern), for llama-server's /infill and `suffix` on /v1/completions.

The layout is the one llama-server documents (tools/server/README.md, /infill):
`[BOS] [extra context] <FIM_PRE>prefix<FIM_SUF>suffix<FIM_MID>middle`; with FIM_REP and FIM_SEP tokens the extra
context follows the repo-level pattern (https://arxiv.org/pdf/2409.12186), else its chunks are separated by a
plain-text marker. Unlike llama-server nothing is cut to fit one batch: a prompt that does not fit the context is
refused like any other.
"""

from __future__ import annotations

from collections.abc import Sequence

from localspec.llama.model import LlamaModel
from localspec.server.errors import ApiError

SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks when the model has no FIM_SEP token


def fim_prompt(model: LlamaModel, prefix: str, suffix: str, middle: str = "",
               extra: Sequence[tuple[str, str]] = (), param: str = "input_prefix") -> list[int]:
    """The infill prompt's tokens. `extra`: (filename, text) chunks of other files, before the prefix; `middle`:
    the start of the middle (special tokens in it parsed, as in a prompt). A model without FIM tokens is a
    400 naming the missing ones."""
    fim = model.fim_tokens()
    pre, suf, mid = fim["pre"], fim["suf"], fim["mid"]
    if pre is None or suf is None or mid is None:
        missing = ", ".join(f"FIM_{name.upper()}" for name in ("pre", "suf", "mid") if fim[name] is None)
        raise ApiError(400, f"{param}: fill-in-the-middle needs the model's FIM tokens and {model.path.name} has "
                       f"no {missing}", param=param, code="no_fim_tokens")

    def text(s: str) -> list[int]:  # code as text: a `<FIM_PRE>` written in it is not a token
        return model.tokenize(s, add_special=False, parse_special=False)

    out = [model.bos] if model.add_bos and model.bos >= 0 else []
    rep, sep = fim["rep"], fim["sep"]
    if extra and rep is not None:
        out += [rep, *text("myproject\n")]
    for filename, chunk in extra:
        out += [sep, *text(filename + "\n")] if sep is not None else text(SNIPPET_SEPARATOR)
        out += text(chunk)
    if extra and sep is not None:
        out += [sep, *text("filename\n")]
    out += [pre, *text(prefix), suf, *text(suffix), mid]
    return out + model.tokenize(middle, add_special=False, parse_special=True)
