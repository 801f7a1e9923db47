"""Named model pairs: the shipped `models.toml`, the user's `$LOCALSPEC_HOME/models.toml`, the built-in demo.

Parsing is strict: an unknown key, a missing field, a wrong type or a duplicate name is an error that names
the file and the line. A user pair with the name of a shipped one replaces it (that is how overrides
work); the same name twice in one file is a mistake. The default pair lives in `$LOCALSPEC_HOME/default-pair`
(one line), so localspec never rewrites the user's models.toml.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localspec import paths
from localspec.config import DRAFTERS, MODEL_FREE_DRAFTERS
from localspec.errors import ConfigError
from localspec.fsutil import atomic_write, read_text
from localspec.models import demo

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A file name in the repository's top folder: it becomes a path in the cache, so no separators and no `..`.
_FILE = re.compile(r"^[A-Za-z0-9._+-]+\.gguf$")

# key -> (type, required)
_PAIR_KEYS: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "name": (str, True),
    "description": (str, True),
    "n_ctx": (int, True),
    "n_draft": (int, True),
    "recommended": (bool, False),
    "preset": (str, False),  # the preset this pair's family wants (sampling, reply limit); --preset wins
    "kv_type": (str, False),  # the KV cache type its n_ctx was sized for (see the memory arithmetic there)
    "drafter": (str, False),  # who drafts by default: a drafter that needs no draft model ("mtp") allows none
    "target": (dict, True),
    "draft": (dict, False),  # required unless the drafter needs no draft model
    "mmproj": (dict, False),  # the target's multimodal projector (pictures: `--mmproj auto` loads it)
}
_MODEL_KEYS: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "repo": (str, True),
    "file": (str, True),
    "quant": (str, True),
    "family": (str, True),
    "license": (str, True),
    "size": (int, False),  # exact bytes, only where the hub page lists them
    "approx_gb": ((int, float), False),  # the page's rounded size, for fit estimates before download
    "sha256": (str, False),
    "revision": (str, False),
    # Tokenizer facts as published (config.json / GGUF metadata): a test checks target against draft with
    # localspec's own compatibility rules, so a wrong pairing fails CI before anyone downloads 20 GB.
    "n_vocab": (int, False),
    "bos": (int, False),
    "eos": (int, False),
}
_KV_TYPES = ("f16", "q8_0", "q4_0")


@dataclass(frozen=True)
class ModelSpec:
    repo: str
    file: str
    quant: str = ""
    family: str = ""
    license: str = ""
    size: int | None = None
    approx_gb: float | None = None
    sha256: str | None = None
    revision: str = "main"
    n_vocab: int | None = None
    bos: int | None = None
    eos: int | None = None

    @property
    def label(self) -> str:
        return f"{self.repo}:{self.file}"

    @property
    def expected_bytes(self) -> int | None:
        if self.size is not None:
            return self.size
        return int(self.approx_gb * 1e9) if self.approx_gb is not None else None


@dataclass(frozen=True)
class Pair:
    name: str
    description: str
    target: ModelSpec | None  # None for the built-in demos, whose files come from PyPI packages
    draft: ModelSpec | None
    n_ctx: int | None  # None: the preset's (the built-in demos are tiny)
    n_draft: int | None
    source: str  # the file it came from, or "built-in"
    recommended: bool = False
    preset: str | None = None
    kv_type: str | None = None
    drafter: str | None = None  # the pair's drafter when the preset's would not do (None: the preset's)
    mmproj: ModelSpec | None = None  # the target's projector (pictures), pulled with the pair

    @property
    def builtin(self) -> bool:
        return self.source == "built-in"

    @property
    def files(self) -> list[ModelSpec]:
        """Every file the pair names (what `pull` downloads): target, draft, projector."""
        return [m for m in (self.target, self.draft, self.mmproj) if m is not None]

    @property
    def expected_bytes(self) -> int | None:
        sizes = [m.expected_bytes for m in self.files]
        return sum(s for s in sizes if s is not None) if sizes and None not in sizes else None


DEMO = Pair(
    name=demo.GEMMA.name,
    description=demo.GEMMA.description,
    target=None,
    draft=None,
    n_ctx=None,
    n_draft=None,
    source="built-in",
)
DEMO_CHAT = Pair(
    name=demo.SMOLLM2.name,
    description=demo.SMOLLM2.description,
    target=None,
    draft=None,
    n_ctx=None,
    n_draft=None,
    source="built-in",
    preset="smollm2-chat",
)
BUILTIN = {p.name: p for p in (DEMO, DEMO_CHAT)}


def shipped_path() -> Path:
    return paths.data_path("models.toml")


def user_path() -> Path:
    return paths.home() / "models.toml"


def default_file() -> Path:
    return paths.home() / "default-pair"


def parse_spec(text: str) -> ModelSpec:
    """`REPO:FILE` from the command line (`--target bartowski/X-GGUF:X-Q4_K_M.gguf`)."""
    repo, sep, file = text.partition(":")
    if not sep or not _REPO.match(repo) or not _FILE.match(file):
        raise ConfigError(f"{text!r}: expected REPO:FILE, e.g. Qwen/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q8_0.gguf")
    return ModelSpec(repo=repo, file=file)


class _Locator:
    """Line numbers for error messages: tomllib gives none for valid TOML with bad content."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        self.headers = [i for i, line in enumerate(self.lines) if re.match(r"^\s*\[\[\s*pair\s*\]\]", line)]

    def pair_line(self, index: int) -> int:
        return self.headers[index] + 1 if index < len(self.headers) else 1

    def key_line(self, index: int, key: str, table: str | None = None) -> int:
        start = self.headers[index] if index < len(self.headers) else 0
        end = self.headers[index + 1] if index + 1 < len(self.headers) else len(self.lines)
        in_table = table is None
        for i in range(start, end):
            line = self.lines[i]
            if table is not None and re.match(rf"^\s*\[\s*pair\.{table}\s*\]", line):
                in_table = True
                continue
            if table is None and re.match(r"^\s*\[\s*pair\.", line):
                break
            if in_table and (
                re.match(rf"^\s*{re.escape(key)}\s*=", line)
                or re.search(rf"[{{,]\s*{re.escape(key)}\s*=", line)
            ):
                return i + 1
        return self.pair_line(index)


def _check_table(
    where: str, table: dict[str, Any], schema: dict[str, tuple[Any, bool]], line_of: Any
) -> None:
    for key, value in table.items():
        if key not in schema:
            raise ConfigError(f"{where}:{line_of(key)}: unknown key {key!r} (allowed: {', '.join(schema)})")
        kind, _ = schema[key]
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            want = kind.__name__ if isinstance(kind, type) else "number"
            raise ConfigError(f"{where}:{line_of(key)}: {key} = {value!r}: expected {want}")
    for key, (_, required) in schema.items():
        if required and key not in table:
            raise ConfigError(f"{where}:{line_of(None)}: missing key {key!r}")


def _model(where: str, loc: _Locator, index: int, part: str, table: dict[str, Any]) -> ModelSpec:
    def line_of(key: str | None) -> int:
        return loc.key_line(index, key, part) if key else loc.key_line(index, part)

    _check_table(where, table, _MODEL_KEYS, line_of)
    if not _REPO.match(table["repo"]):
        raise ConfigError(f"{where}:{line_of('repo')}: repo {table['repo']!r} is not OWNER/NAME")
    if not table["file"].endswith(".gguf"):
        raise ConfigError(f"{where}:{line_of('file')}: file {table['file']!r} is not a .gguf file")
    if not _FILE.match(table["file"]):
        raise ConfigError(
            f"{where}:{line_of('file')}: file {table['file']!r}: a file name without folders or '..' "
            "(letters, digits, '.', '_', '-', '+')"
        )
    sha = table.get("sha256")
    if sha is not None and not _SHA256.match(sha):
        raise ConfigError(f"{where}:{line_of('sha256')}: sha256 must be 64 lowercase hex digits")
    if table.get("size") is not None and table["size"] <= 0:
        raise ConfigError(f"{where}:{line_of('size')}: size must be a positive number of bytes")
    for key in ("n_vocab", "bos", "eos"):
        if table.get(key) is not None and table[key] < 0:
            raise ConfigError(f"{where}:{line_of(key)}: {key} must be 0 or more")
    return ModelSpec(
        repo=table["repo"],
        file=table["file"],
        quant=table["quant"],
        family=table["family"],
        license=table["license"],
        size=table.get("size"),
        approx_gb=float(table["approx_gb"]) if "approx_gb" in table else None,
        sha256=sha,
        revision=table.get("revision", "main"),
        n_vocab=table.get("n_vocab"),
        bos=table.get("bos"),
        eos=table.get("eos"),
    )


def parse_file(path: Path) -> list[Pair]:
    """Every pair in one models.toml, strictly."""
    text = read_text(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    loc = _Locator(text)
    unknown = [k for k in data if k != "pair"]
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key {unknown[0]!r} (pairs are [[pair]] tables)")
    tables = data.get("pair", [])
    if not isinstance(tables, list):
        raise ConfigError(f"{path}: 'pair' must be an array of tables ([[pair]])")
    pairs: list[Pair] = []
    seen: dict[str, int] = {}
    for index, table in enumerate(tables):
        if not isinstance(table, dict):
            raise ConfigError(
                f"{path}:{loc.pair_line(index)}: pair #{index + 1} = {table!r}: expected a [[pair]] table"
            )

        def line_of(key: str | None, index: int = index) -> int:
            return loc.key_line(index, key) if key else loc.pair_line(index)

        _check_table(str(path), table, _PAIR_KEYS, line_of)
        name = table["name"]
        if not _NAME.match(name):
            raise ConfigError(
                f"{path}:{line_of('name')}: pair name {name!r}: use letters, digits, '.', '_', '-'"
            )
        if name in BUILTIN:
            raise ConfigError(
                f"{path}:{line_of('name')}: pair name {name!r} is reserved for a built-in demo"
            )
        if name in seen:
            raise ConfigError(
                f"{path}:{line_of('name')}: duplicate pair name {name!r} (first at line {seen[name]})"
            )
        seen[name] = line_of("name")
        for key, lo, hi in (("n_ctx", 256, 1 << 20), ("n_draft", 1, 32)):
            if not lo <= table[key] <= hi:
                raise ConfigError(f"{path}:{line_of(key)}: {key} = {table[key]}: allowed range is {lo}..{hi}")
        if table.get("kv_type") is not None and table["kv_type"] not in _KV_TYPES:
            raise ConfigError(
                f"{path}:{line_of('kv_type')}: kv_type = {table['kv_type']!r}: choose one of {', '.join(_KV_TYPES)}"
            )
        drafter = table.get("drafter")
        if drafter is not None and drafter not in DRAFTERS:
            raise ConfigError(
                f"{path}:{line_of('drafter')}: drafter = {drafter!r}: choose one of {', '.join(DRAFTERS)}")
        if "draft" not in table and drafter not in MODEL_FREE_DRAFTERS:
            raise ConfigError(f"{path}:{line_of(None)}: missing key 'draft' (a pair without a draft model names a "
                              f"drafter that needs none: drafter = {' or '.join(map(repr, MODEL_FREE_DRAFTERS))})")
        pairs.append(
            Pair(
                name=name,
                description=table["description"],
                target=_model(str(path), loc, index, "target", table["target"]),
                draft=_model(str(path), loc, index, "draft", table["draft"]) if "draft" in table else None,
                mmproj=_model(str(path), loc, index, "mmproj", table["mmproj"]) if "mmproj" in table else None,
                n_ctx=table["n_ctx"],
                n_draft=table["n_draft"],
                source=str(path),
                recommended=table.get("recommended", False),
                preset=table.get("preset"),
                kv_type=table.get("kv_type"),
                drafter=drafter,
            )
        )
    return pairs


def load_pairs() -> dict[str, Pair]:
    """The shipped pairs (recommended first), the user's (which may replace shipped ones by name), the demos."""
    pairs: dict[str, Pair] = {}
    for path in (shipped_path(), user_path()):
        if path.is_file():
            for pair in parse_file(path):
                pairs[pair.name] = pair
    ordered = sorted(pairs.values(), key=lambda p: not p.recommended)  # stable: file order within each group
    return {p.name: p for p in [*ordered, *BUILTIN.values()]}


def get_pair(name: str) -> Pair:
    pairs = load_pairs()
    if name not in pairs:
        raise ConfigError(f"unknown pair {name!r} (available: {', '.join(pairs)}; see `localspec models`)")
    return pairs[name]


def default_pair_name(fallback: str = DEMO.name) -> str:
    """The pair commands use without model arguments: the user's choice, else `fallback`, an offline demo
    (`chat` falls back to the instruct demo, since a base model cannot hold a conversation)."""
    path = default_file()
    if not path.exists() and not path.is_symlink():
        return fallback
    name = read_text(path).strip()
    if not name:
        return fallback
    pairs = load_pairs()
    if name not in pairs:
        raise ConfigError(
            f"{path}: default pair {name!r} is not defined any more; run localspec models --default NAME"
        )
    return name


def set_default_pair(name: str) -> Path:
    get_pair(name)  # refuse unknown names before writing
    return atomic_write(default_file(), name + "\n", what="the default pair to", parents=True)
