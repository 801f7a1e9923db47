"""Presets: the one place sampling, drafting and bench defaults live.

`presets/default.toml` holds every default; another preset names only what it changes and overlays the default.
CLI options default to None and overlay the loaded preset through `Preset.with_overrides`. The same `Sampling`
object configures the target and the draft, so p and q always go through the same pipeline.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localspec import paths
from localspec.errors import ConfigError, LocalspecError
from localspec.fsutil import atomic_write, read_text
from localspec.rpc import Endpoint, parse_endpoint, parse_endpoints

_PRESET_NAME = re.compile(r"^(?!.*\.toml$)[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _rng(lo: float, hi: float, kind: type) -> dict[str, Any]:
    return {"range": (lo, hi), "kind": kind}


def _text(check: Callable[[str], object], form: str) -> dict[str, Any]:
    """A free-form string key: `check` raises ValueError (its message says what is wrong) on a bad value; `form`
    is what --help and errors show as the expected format."""
    return {"kind": str, "check": check, "form": form}


def _proportions(text: str) -> object:
    """`3,1`: one non-negative proportion per device, not all zero ("" = llama.cpp's default, by free memory)."""
    if not text.strip():
        return ()
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError("expected comma-separated numbers, e.g. 3,1") from None
    if any(not math.isfinite(v) or v < 0 for v in values) or not any(values):
        raise ValueError("proportions must be finite, non-negative and not all zero")
    return values


def _endpoints(text: str) -> object:
    try:
        return parse_endpoints(text)
    except LocalspecError as exc:
        raise ValueError(str(exc)) from None


def _address(text: str) -> object:
    if not text.strip() or any(c.isspace() or c in ",:" for c in text.strip()):
        raise ValueError("expected one host name or IPv4 address, e.g. 127.0.0.1")
    return text.strip()


def _host_names(text: str) -> object:
    """`lan-box,192.168.1.20`: Host names (no port) a browser may use besides the bound address and loopback; `*` =
    any ("" = none more)."""
    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    for name in names:
        if any(c.isspace() or c in "/@" for c in name) or name.count(":") == 1:
            raise ValueError(f"{name!r} is not a host name (give names or addresses without a port)")
    return names


def _model_names(text: str) -> object:
    """`gpt-4o,my-model`: names the server also answers to; each without spaces or commas ("" = none)."""
    names = tuple(n.strip() for n in text.split(",")) if text.strip() else ()
    if any(not n or any(c.isspace() for c in n) for n in names):
        raise ValueError("expected comma-separated model names without spaces, e.g. gpt-4o,my-model")
    return names


def _cache_ram(text: str) -> object:
    """`auto` (a quarter of the RAM available at start), or whole MiB (0 = no prompt cache)."""
    if text.strip() != "auto" and not text.strip().isdigit():
        raise ValueError("expected auto or a whole number of MiB, e.g. 8192 (0 = off)")
    return text.strip()


def _models_budget(text: str) -> object:
    """`auto` (the free memory measured before each load), or whole MiB that the loaded pairs may take together."""
    if text.strip() != "auto" and not (text.strip().isdigit() and int(text.strip()) > 0):
        raise ValueError("expected auto or a whole number of MiB above 0, e.g. 20000")
    return text.strip()


def parse_draft_lengths(text: str) -> tuple[int, ...]:
    """`2-6` or `2,4,6` (or both, `2-4,6`): draft lengths from 1 to 32, sorted, each once."""
    lengths: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        low, dash, high = part.partition("-")
        if not low.strip().isdigit() or (dash and not high.strip().isdigit()):
            raise ValueError("expected draft lengths as a range or a list, e.g. 2-6 or 2,4,6")
        first, last = int(low), int(high or low)
        if not 1 <= first <= last <= 32:
            raise ValueError("draft lengths must be between 1 and 32, a range's low end first")
        lengths.update(range(first, last + 1))
    return tuple(sorted(lengths))


def _any_path(text: str) -> object:
    if "\n" in text or "\0" in text:
        raise ValueError("a path on one line")
    return text.strip()


def _draft_device(text: str) -> object:
    text = text.strip()
    if text == "auto" or text.isdigit():
        return text
    if ":" in text:
        try:
            return parse_endpoint(text)
        except LocalspecError as exc:
            raise ValueError(str(exc)) from None
    raise ValueError("expected auto, a GPU number or an RPC server HOST:PORT")


@dataclass(frozen=True)
class Sampling:
    temperature: float = field(metadata=_rng(0.0, 5.0, float))
    top_k: int = field(metadata=_rng(0, 1_000_000, int))  # 0 = off
    top_p: float = field(metadata=_rng(0.0, 1.0, float))  # 1 = off
    min_p: float = field(metadata=_rng(0.0, 1.0, float))  # 0 = off
    repeat_penalty: float = field(metadata=_rng(0.5, 2.0, float))  # 1 = off
    repeat_last_n: int = field(metadata=_rng(0, 4096, int))
    presence_penalty: float = field(metadata=_rng(-2.0, 2.0, float))  # 0 = off (OpenAI's range)
    frequency_penalty: float = field(metadata=_rng(-2.0, 2.0, float))  # 0 = off
    seed: int = field(metadata=_rng(0, 2**32 - 1, int))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes logits (they depend on history, so they need full logit rows)."""
        active = self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        return active and self.repeat_last_n > 0

    def repetition(self, rep: int) -> Sampling:
        """These settings for a benchmark's repetition `rep` (0, 1, ...): the seed moved by `rep` (wrapping at 2^32),
        the same for every mode of that repetition. At T > 0 one seed is one sampled text per mode, and plain and
        speculative decoding draw theirs differently (same distribution, other tokens): with one seed for every
        repetition each mode's median timed a single text, and the ratio between modes followed which texts they
        drew (the CPU demo pair's code edit at T = 0.7: one draft length drew a reply that copied its prompt, 94% of
        its drafts kept, the next 79%). A seed a repetition makes each median one over as many texts."""
        return dataclasses.replace(self, seed=(self.seed + rep) % 2**32)



@dataclass(frozen=True)
class DrafterFacts:
    """One row of the drafter table: what presets, pairs, memory estimates and reports must know of a drafter before
    any model code loads, and where the registry (`localspec.drafters`) finds its code."""

    module: str  # the module with its `build(target, draft, built)` factory ("localspec.drafters.lookup")
    title: str  # how reports name it ("prompt lookup")
    needs_draft_model: bool = True  # False: a pair may name it and no draft
    reads_target: bool = False  # True: it drafts from the target's hidden states (the loop's target-rows hook)
    target_head: bool = False  # True: it runs the target's own MTP head in a context of its own (memory, support)


# The drafters `[draft] drafter`, `--drafter` and the server's `speculative.type` may name: one row per drafter, its
# name → its facts. A new drafter is its module in localspec/drafters/ plus its row here; read here (not from the
# module) because presets and header checks must not load llama.cpp, which the drafters' modules import.
# tests/test_architecture.py checks the rows against the package: a module with no row, a row with no module, facts
# that disagree with what the module's factory builds.
DRAFTER_TABLE: dict[str, DrafterFacts] = {
    "chain": DrafterFacts("localspec.drafters.chain", "lookup chained with the model"),
    "chain-mtp": DrafterFacts("localspec.drafters.chain_mtp", "lookup or the MTP head", needs_draft_model=False,
                              reads_target=True, target_head=True),
    "lookup": DrafterFacts("localspec.drafters.lookup", "prompt lookup", needs_draft_model=False),
    "model": DrafterFacts("localspec.drafters.model", "the draft model"),
    "mtp": DrafterFacts("localspec.drafters.mtp", "the MTP head", needs_draft_model=False, reads_target=True,
                        target_head=True),
    "suffix": DrafterFacts("localspec.drafters.suffix", "suffix lookup", needs_draft_model=False),
    "dflash": DrafterFacts("localspec.drafters.dflash", "the DFlash drafter", reads_target=True),
    "dspark": DrafterFacts("localspec.drafters.dspark", "the DSpark drafter", reads_target=True),
    "eagle3": DrafterFacts("localspec.drafters.eagle3", "the EAGLE-3 drafter", reads_target=True),
}

DRAFTERS = tuple(sorted(DRAFTER_TABLE))


def parse_drafter_list(text: str) -> tuple[str, ...]:
    """`mtp,dflash`: drafter names, each once, in the order given ("" = none)."""
    names = tuple(part.strip() for part in text.split(",")) if text.strip() else ()
    for name in names:
        if name not in DRAFTERS:
            raise ValueError(f"unknown drafter {name!r}: expected drafter names from {', '.join(DRAFTERS)}, "
                             "comma-separated")
    if len(set(names)) != len(names):
        raise ValueError("each drafter once")
    return names


# Drafters that need no draft model (a pair may name one and no draft).
MODEL_FREE_DRAFTERS = tuple(name for name, facts in sorted(DRAFTER_TABLE.items()) if not facts.needs_draft_model)
# Drafters whose draft GGUF is a block drafter reading the target's layers (general.architecture dflash): no other
# drafter can step such a file, and it cannot draft for another (sessions.session.check_drafting).
BLOCK_DRAFTERS = ("dflash", "dspark")


@dataclass(frozen=True)
class Drafting:
    n_draft: int = field(metadata=_rng(0, 32, int))  # 0 = plain decoding through the same engine
    # The MTP head's length where a layer (a preset over the default, a pair, an option, a request) switches the
    # drafter to "mtp" naming no length: a chained head's acceptance falls faster with depth than a draft model's.
    mtp_n_draft: int = field(metadata=_rng(1, 32, int))
    p_min: float = field(metadata=_rng(0.0, 1.0, float))  # stop a draft early below this top probability
    adaptive: bool = field(metadata={"kind": bool})  # the draft model's length by measured cost (policies)
    # Drafting stands aside (drafts nothing, probed now and then) while its measured price says a round of k drafts
    # is slower than plain decoding (the draft model's and the MTP head's rule: policies, drafters/model.py)
    stand_aside: bool = field(metadata={"kind": bool})
    # Who drafts: a drafter of localspec/drafters/ (the draft model, prompt lookup, lookup then the model, ...).
    drafter: str = field(metadata={"kind": str, "choices": DRAFTERS})
    lookup_min: int = field(metadata=_rng(1, 64, int))  # prompt lookup: the shortest n-gram that counts as a match
    lookup_max: int = field(metadata=_rng(1, 64, int))  # ... and the longest it tries first
    # Draft-ahead's length: "full" drafts the whole next round beside the verify; "fit" only what the cost model says
    # fits in it, stopping when the verify ends, the rest drafted (or not) by cost in the next round (policies).
    draft_ahead_length: str = field(metadata={"kind": str, "choices": ("full", "fit")})
    # The suffix drafter (drafters/suffix.py): the deepest match it measures, its draft's length as a multiple of the
    # match's depth, the path probability below which it stops, and the tokens of past requests it keeps per pair.
    suffix_depth: int = field(metadata=_rng(3, 256, int))
    suffix_factor: float = field(metadata=_rng(0.25, 16.0, float))
    suffix_min_prob: float = field(metadata=_rng(0.0, 1.0, float))
    suffix_budget: int = field(metadata=_rng(0, 1 << 26, int))
    # The chain's lead (drafters/chain.py): prompt lookup's or suffix lookup's tokens first, then the draft model's.
    chain_lead: str = field(metadata={"kind": str, "choices": ("lookup", "suffix")})
    # DSpark (drafters/dflash.py): its confidence head cuts a block's drafts at the first position it rates below this.
    dspark_p_min: float = field(metadata=_rng(0.0, 1.0, float))

    def __post_init__(self) -> None:
        if self.lookup_min > self.lookup_max:
            raise ConfigError(f"draft.lookup_min = {self.lookup_min} is above draft.lookup_max = {self.lookup_max}")


@dataclass(frozen=True)
class BenchSettings:
    warmup: int = field(metadata=_rng(0, 1000, int))
    repeat: int = field(metadata=_rng(1, 1000, int))
    max_tokens: int = field(metadata=_rng(1, 1_000_000, int))
    # Logits: off the CPU, a speculative token that is not the target's single-token choice passes the greedy
    # check only as that row's runner-up within this much of its top (a near-tie kernel rounding can swap)
    near_tie: float = field(metadata=_rng(0.0, 1000.0, float))
    # After the bench, llama.cpp's own speculative loop on the same files and prompts (localspec.sessions.versus)
    against: str = field(metadata={"kind": str, "choices": ("none", "llama.cpp")})
    # Its llama-speculative-simple, or the folder holding it ("": $LOCALSPEC_LLAMA_BIN, then PATH)
    llama_bin: str = field(metadata=_text(_any_path, "a path to llama-speculative-simple or its folder"))
    # llama.cpp's draft lengths to try there (the best of them is the comparison): a range or a list
    against_lengths: str = field(metadata=_text(parse_draft_lengths, "draft lengths, e.g. 2-6 or 2,4,6"))
    # Drafters to measure in turn instead of the preset's one, each against plain on the same session and prompts;
    # the closing line picks from what they measured ("" = the preset's drafter alone)
    drafters: str = field(metadata=_text(parse_drafter_list, "drafter names, e.g. mtp,dflash"))


@dataclass(frozen=True)
class ChatSettings:
    max_tokens: int = field(metadata=_rng(1, 1_000_000, int))  # reply limit: a base model never stops on its own


@dataclass(frozen=True)
class GenerateSettings:
    max_tokens: int = field(metadata=_rng(1, 1_000_000, int))


@dataclass(frozen=True)
class LoadSettings:
    n_ctx: int = field(metadata=_rng(64, 1 << 20, int))
    n_gpu_layers: int = field(metadata=_rng(-1, 1000, int))  # -1 = all
    draft_n_gpu_layers: int = field(metadata=_rng(-1, 1000, int))
    kv_type: str = field(metadata={"kind": str, "choices": ("f16", "q8_0", "q4_0")})
    threads: int = field(metadata=_rng(0, 1024, int))  # 0 = auto: free physical cores (machine.thread_choice)
    n_batch: int = field(metadata=_rng(8, 8192, int))
    device_top_k: int = field(metadata=_rng(0, 1024, int))  # 0 = full logits to the host
    # A grammar's rows: "full" logits, or "device" top candidates (a row re-decoded where too few are legal)
    constrained_rows: str = field(metadata={"kind": str, "choices": ("full", "device")})
    # Placement (llama.cpp's model params): how the target spreads over devices, and where the draft goes.
    split_mode: str = field(metadata={"kind": str, "choices": ("none", "layer", "row")})
    tensor_split: str = field(metadata=_text(_proportions, "proportions per target device, e.g. 3,1"))
    main_gpu: int = field(metadata=_rng(0, 15, int))
    draft_device: str = field(metadata=_text(_draft_device, "auto, a GPU number or HOST:PORT"))
    rpc: str = field(metadata=_text(_endpoints, "HOST:PORT[,HOST:PORT...]"))
    # Draft the next round while the target verifies (auto: when the draft runs on another device than the target)
    draft_ahead: str = field(metadata={"kind": str, "choices": ("auto", "on", "off")})
    # Logits: on a GPU, slots share batches only where sharing moves a sequence's rows no further than this
    max_batch_error: float = field(metadata=_rng(0.0, 1000.0, float))

    @property
    def tensor_split_values(self) -> tuple[float, ...]:
        return _proportions(self.tensor_split)  # type: ignore[return-value]

    @property
    def rpc_endpoints(self) -> tuple[Endpoint, ...]:
        return parse_endpoints(self.rpc)


@dataclass(frozen=True)
class RpcServerSettings:
    """`localspec rpc-server`: where it listens and how it computes."""

    host: str = field(metadata=_text(_address, "an address to listen on, e.g. 127.0.0.1"))
    port: int = field(metadata=_rng(1, 65535, int))
    threads: int = field(metadata=_rng(0, 1024, int))  # 0 = auto (machine.thread_choice)
    cache: bool = field(metadata={"kind": bool})  # keep large tensors on disk there, so a reload sends less


@dataclass(frozen=True)
class ServerSettings:
    host: str = field(metadata={"kind": str})  # where `localspec serve` listens
    port: int = field(metadata=_rng(0, 65535, int))  # 0 = any free port
    queue: int = field(metadata=_rng(0, 10_000, int))  # requests that may wait for a free slot
    parallel: int = field(metadata=_rng(1, 64, int))  # slots: requests generated together, each with n_ctx of KV
    allowed_hosts: str = field(metadata=_text(_host_names, "NAME[,NAME...] or *"))  # Host names allowed without a key
    control_tokens: bool = field(metadata={"kind": bool})  # chat content may carry control tokens (<|im_end|>)
    max_requests: int = field(metadata=_rng(1, 100_000, int))  # HTTP requests handled at once; more: 503 at once
    read_timeout: float = field(metadata=_rng(0.5, 3600.0, float))  # seconds to send a request's body
    header_timeout: float = field(metadata=_rng(0.5, 3600.0, float))  # seconds to send a request's headers
    metrics: bool = field(metadata={"kind": bool})  # serve /metrics (llama-server's --metrics)
    slots: bool = field(metadata={"kind": bool})  # serve /slots (llama-server's --slots / --no-slots)
    # Other names requests may give as `model` (front-ends that insist on their own); with strict_model any other
    # name is a 404, without it any name means the one model served.
    model_aliases: str = field(metadata=_text(_model_names, "NAME[,NAME...]"))
    strict_model: bool = field(metadata={"kind": bool})
    # Finished slots' KV cells kept in host RAM for later requests that share their prefix (llama-server's
    # --cache-ram): "auto" (a quarter of the RAM available at start), or MiB (0 = off).
    cache_ram: str = field(metadata=_text(_cache_ram, "auto or MiB"))
    # Where POST /slots/{id}?action=save|restore keeps its files ("" = those actions are off; llama-server's
    # --slot-save-path).
    slot_save_path: str = field(metadata=_text(_any_path, "a folder"))
    # Several pairs (`serve --pair A --pair B`): the memory their estimates may take together ("auto": each load
    # checks the free VRAM, or RAM on a CPU-only machine), and the seconds an idle pair stays loaded (0 = until
    # another pair needs its room).
    models_budget: str = field(metadata=_text(_models_budget, "auto or MiB"))
    models_idle: float = field(metadata=_rng(0.0, 7 * 86400.0, float))

    @property
    def budget_bytes(self) -> int | None:
        """`models_budget` in bytes (None: auto)."""
        return None if self.models_budget == "auto" else int(self.models_budget) << 20

    @property
    def model_alias_names(self) -> tuple[str, ...]:
        return _model_names(self.model_aliases)  # type: ignore[return-value]


@dataclass(frozen=True)
class ImageSettings:
    """What a picture (`--image`, chat's /image, a request's image_url part) may be at most: checked from its
    header before a pixel is decoded (llama.vision)."""

    max_image_bytes: int = field(metadata=_rng(1, 1 << 31, int))
    max_image_side: int = field(metadata=_rng(1, 1 << 16, int))
    max_image_pixels: int = field(metadata=_rng(1, 1 << 31, int))
    max_images: int = field(metadata=_rng(1, 64, int))  # pictures a request or a message may carry
    # Tokens one picture may take (0: the projector's own limit): libmtmd shrinks a larger picture of a
    # dynamic-resolution projector (Qwen-VL's) to fit, which bounds its compute buffer (models.memory).
    max_image_tokens: int = field(metadata=_rng(0, 1 << 20, int))


@dataclass(frozen=True)
class ContextSettings:
    """What a generation does when it fills its context (llama-server's --context-shift, n_keep, n_discard)."""

    context_shift: bool = field(metadata={"kind": bool})  # drop a block after the kept beginning and go on
    n_keep: int = field(metadata=_rng(-1, 1 << 20, int))  # tokens kept at the start (-1 = the whole prompt)
    n_discard: int = field(metadata=_rng(0, 1 << 20, int))  # tokens dropped per shift (0 = half of the rest)


_SECTIONS: dict[str, type] = {
    "sampling": Sampling,
    "draft": Drafting,
    "bench": BenchSettings,
    "chat": ChatSettings,
    "generate": GenerateSettings,
    "load": LoadSettings,
    "server": ServerSettings,
    "context": ContextSettings,
    "images": ImageSettings,
    "rpc_server": RpcServerSettings,  # after server: an unqualified host or port means `localspec serve`'s
}


@dataclass(frozen=True)
class Preset:
    name: str
    sampling: Sampling
    draft: Drafting
    bench: BenchSettings
    chat: ChatSettings
    generate: GenerateSettings
    load: LoadSettings
    server: ServerSettings
    context: ContextSettings
    images: ImageSettings
    rpc_server: RpcServerSettings

    def with_overrides(self, *, prefer: str | None = None, flags: dict[str, str] | None = None,
                       **overrides: Any) -> Preset:
        """Overlay CLI or request values (None = keep the preset's), each named by its preset key.

        A key that lives in several sections (`max_tokens`) goes to `prefer`'s section when it has one. `flags`
        maps keys to the option the user typed (`temperature` → `--temp`), so an out-of-range value names it.
        """
        changes: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
        for key, value in overrides.items():
            if value is None:
                continue
            section = section_of(key, prefer)
            where = (flags or {}).get(key) or f"command line: {section}.{key}"
            changes[section][key] = _check(section, key, value, where=where)
        _mtp_length(changes["draft"], self.draft.drafter, self.draft.mtp_n_draft)
        return dataclasses.replace(
            self, **{section: dataclasses.replace(getattr(self, section), **values)
                     for section, values in changes.items()},
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _mtp_length(layer: dict[str, Any], drafter: str, mtp_n_draft: int) -> None:
    """A layer of settings that switches the drafter to the MTP head (from `drafter`, the one below it) and names no
    draft length gets the head's own, `mtp_n_draft` (the layer's, else the one below's), in place."""
    if layer.get("drafter") == "mtp" and drafter != "mtp" and "n_draft" not in layer:
        layer["n_draft"] = layer.get("mtp_n_draft", mtp_n_draft)


# Keys that were renamed: a preset or override that names the old one is told the new name in its error.
RENAMED_KEYS = {"overlap": "draft_ahead", "ahead_length": "draft_ahead_length"}


def _renamed(key: str) -> str:
    """The unknown-key error's note for a key that was renamed ("", else "; `old` is now `new`")."""
    return f"; `{key}` is now `{RENAMED_KEYS[key]}`" if key in RENAMED_KEYS else ""


def section_of(key: str, prefer: str | None = None) -> str:
    """The preset section that holds `key` (`prefer` first, when it has it)."""
    if prefer in _SECTIONS and key in _keys(prefer):
        return prefer
    for section in _SECTIONS:
        if key in _keys(section):
            return section
    raise ConfigError(f"unknown setting {key!r}{_renamed(key)}")


def _keys(section: str) -> set[str]:
    return {f.name for f in dataclasses.fields(_SECTIONS[section])}


def preset_keys() -> set[str]:
    """Every key of every section: the names CLI parameters and request fields take when they overlay a preset."""
    return set().union(*(_keys(section) for section in _SECTIONS))


def key_metadata(key: str, prefer: str | None = None) -> dict[str, Any]:
    """A key's kind and allowed range or choices: the one place they are written down."""
    section = section_of(key, prefer)
    return dict(next(f.metadata for f in dataclasses.fields(_SECTIONS[section]) if f.name == key))


def _check(section: str, key: str, value: Any, where: str) -> Any:
    """Type- and range-check one value; the error names where it came from and the allowed range."""
    meta = key_metadata(key, section)
    kind = meta["kind"]
    if kind is str and "check" in meta:
        if not isinstance(value, str):
            raise ConfigError(f"{where} = {value!r}: expected a string ({meta['form']})")
        try:
            meta["check"](value)
        except ValueError as exc:
            raise ConfigError(f"{where} = {value!r}: {exc}") from None
        return value.strip()
    if kind is str:
        if "choices" not in meta:
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{where} = {value!r}: expected a non-empty string")
            return value
        if value not in meta["choices"]:
            raise ConfigError(f"{where} = {value!r}: choose one of {', '.join(meta['choices'])}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r}: expected true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where} = {value!r}: expected a number")
    if kind is int and not float(value).is_integer():
        raise ConfigError(f"{where} = {value!r}: expected a whole number")
    value = kind(value)
    lo, hi = meta["range"]
    if not (lo <= value <= hi) or (isinstance(value, float) and math.isnan(value)):
        raise ConfigError(f"{where} = {value!r}: allowed range is {lo}..{hi}")
    return value


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(read_text(path))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def _sections_from(path: Path, data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for section, table in data.items():
        if section not in _SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}] (allowed: {', '.join(_SECTIONS)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section} must be a table ([{section}])")
        known = _keys(section)
        for key, value in table.items():
            if key not in known:
                raise ConfigError(f"{path}: unknown key {section}.{key} (allowed: {', '.join(sorted(known))})"
                                  f"{_renamed(key)}")
            out.setdefault(section, {})[key] = _check(section, key, value, where=f"{path}: {section}.{key}")
    return out


def user_preset_dir() -> Path:
    return paths.home() / "presets"


def shipped_preset_dir() -> Path:
    return paths.data_path("presets")


def preset_path(name: str) -> Path:
    """A path as given, else `$LOCALSPEC_HOME/presets/NAME.toml`, else the shipped `presets/NAME.toml`."""
    as_path = Path(name)
    if as_path.suffix == ".toml":
        if not as_path.is_file():
            raise ConfigError(f"{as_path}: preset file not found")
        return as_path
    for folder in (user_preset_dir(), shipped_preset_dir()):
        candidate = folder / f"{name}.toml"
        if candidate.is_file():
            return candidate
    raise ConfigError(f"unknown preset {name!r} (available: {', '.join(available_presets())})")


def available_presets() -> list[str]:
    names = {p.stem for d in (shipped_preset_dir(), user_preset_dir()) if d.is_dir() for p in d.glob("*.toml")}
    return sorted(names)


def load_preset(name: str = "default") -> Preset:
    """The shipped default overlaid with the named preset. Every field must end up set."""
    base_path = shipped_preset_dir() / "default.toml"
    merged = _sections_from(base_path, _read_toml(base_path))
    path = preset_path(name)
    if path.resolve() != base_path.resolve():
        for section, values in _sections_from(path, _read_toml(path)).items():
            if section == "draft":
                base = merged.get("draft", {})
                _mtp_length(values, base.get("drafter", ""), base.get("mtp_n_draft", 0))
            merged.setdefault(section, {}).update(values)
    built: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        values = merged.get(section, {})
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in values]
        if missing:
            raise ConfigError(f"{base_path}: missing key {section}.{missing[0]}")
        built[section] = cls(**values)
    return Preset(name=Path(name).stem, **built)


def preset_text(preset: Preset) -> str:
    """Every value of `preset` as a stand-alone preset file."""
    lines = [f"# written by localspec from preset {preset.name!r}"]
    for section in _SECTIONS:
        lines.append(f"\n[{section}]")
        for key, value in dataclasses.asdict(getattr(preset, section)).items():
            if isinstance(value, bool):
                text = str(value).lower()
            else:
                text = f'"{value}"' if isinstance(value, str) else repr(value)
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def user_preset_path(name: str) -> Path:
    """`$LOCALSPEC_HOME/presets/NAME.toml`; NAME may not leave that folder (no path separators, no `..`)."""
    if not _PRESET_NAME.match(name):
        raise ConfigError(f"preset name {name!r}: use letters, digits, '.', '_', '-' (no path, no .toml)")
    return user_preset_dir() / f"{name}.toml"


def save_user_preset(name: str, preset: Preset) -> Path:
    """Write every value of `preset` to `$LOCALSPEC_HOME/presets/NAME.toml` (atomically), so it stands alone."""
    return atomic_write(user_preset_path(name), preset_text(preset), what="preset", parents=True)
