"""Slot state files: a slot's cells on disk (the server's `POST /slots/{id}?action=save`, `localspec chat`'s /save),
checked in full before llama.cpp reads a byte of them.

llama.cpp's own state files (`llama_state_seq_save_file`) hold one context's cells and its token ids, and restore
into any model whose tensors have the same shapes: the wrong model's state loads without a word and then
generates from another model's keys and values. A localspec file names what it was saved from and is refused,
with one line saying why, when any of it differs: another model file (its fingerprint: the GGUF header and samples
of its weights), KV type, slot count (llama.cpp's state carries the number of sequences), localspec or
llama-cpp-python version, or this format's version; a file cut short or changed on disk fails its SHA-256.

Layout (little-endian): the magic `LOCALSPEC-SLOT\\n\\0`, u32 format version, u32 header length, the header (UTF-8
JSON: versions, the models and the byte size of each one's state, the token count, the drafters' own parts — an MTP
head's cells and the target rows it drafts from: each part's kind, fields and blob sizes — and the writer's own
`extra`), the tokens (int32 each), each model's state in the header's order, each drafter part's blobs, then the
SHA-256 of everything before it. Format 1 (no drafters' parts) is read too.
Written through fsutil's one atomic write: a file that exists is whole.

File names (the server's `filename`) are one name in the save folder, never a path, of a safe set narrower than
llama.cpp's `fs_validate_filename`: ASCII letters, digits, `.`, `_` and `-`, starting with a letter or digit (no
dotfiles: the folder's own, the atomic writes' temporary files), no trailing dot. A save replaces only a slot file:
any other file of that name is left alone.
"""

from __future__ import annotations

import functools
import hashlib
import json
import string
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from localspec import __version__
from localspec.errors import LocalspecError
from localspec.fsutil import atomic_file, not_a_file
from localspec.llama.vision import holds_pictures
from localspec.models.gguf_header import read_header
from localspec.rounds.prompt_cache import ModelState, SeqFile, SlotState

MAGIC = b"LOCALSPEC-SLOT\n\0"
FORMAT = 2
READS = (1, 2)  # format 1: written before the drafters' parts
MAX_HEADER = 1 << 20  # a header is a few hundred bytes plus the writer's extra (a transcript's digest)
MAX_NAME_BYTES = 255
_U32 = struct.Struct("<I")
_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10  # a fingerprint reads the header and 1 MiB of weights, whatever the size


class SlotFileError(LocalspecError):
    """A slot file that cannot be restored here: the message names the file and what differs."""


@dataclass(frozen=True)
class ModelIdentity:
    """What a state's cells are only valid for: one model file, KV type and slot count."""

    name: str  # the file name, for messages
    fingerprint: str
    kv_type: str
    n_seq: int

    def describe(self) -> str:
        return f"{self.name} ({self.fingerprint[:12]}, KV {self.kv_type}, {self.n_seq} slot{'s' * (self.n_seq > 1)})"


@functools.lru_cache(maxsize=16)
def _fingerprint(path: Path, size: int, mtime_ns: int) -> str:
    header = read_header(path)
    digest = hashlib.sha256(struct.pack("<Q", size))
    with open(path, "rb") as fh:
        digest.update(fh.read(header.header_bytes))
        span = max(0, size - header.data_offset - _SAMPLE_BYTES)
        for i in range(_SAMPLES):
            fh.seek(header.data_offset + span * i // max(1, _SAMPLES - 1))
            digest.update(fh.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def fingerprint(path: Path) -> str:
    """A model file's identity: SHA-256 over its size, its GGUF header (metadata and tensor layout) and 16 samples
    of its weights spread over the file. A different model, quantization or fine-tune of the same shapes differs
    there; reading it costs about a megabyte, not the whole file."""
    st = path.stat()
    return _fingerprint(path.resolve(), st.st_size, st.st_mtime_ns)


def identity(model: Any) -> ModelIdentity:
    """A loaded `LlamaModel`'s identity (its file, KV type and slot count)."""
    return ModelIdentity(model.path.name, fingerprint(model.path), model.kv_type, model.n_seq)


def _llama_cpp_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        return "unknown"


NAME_CHARS = frozenset(string.ascii_letters + string.digits + "._-")
NAME_RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit, not ending with '.'"


def check_name(name: str) -> str:
    """A slot file's name as given, if it is one safe name in the save folder (see the module docstring); else
    SlotFileError saying why."""
    if not name:
        raise SlotFileError("the file name is empty")
    if len(name) > MAX_NAME_BYTES:
        raise SlotFileError(f"the file name is longer than {MAX_NAME_BYTES} characters")
    if "/" in name or "\\" in name:
        raise SlotFileError(f"file name {name[:100]!r}: a name, not a path (no '/' or '\\')")
    bad = next((ch for ch in name if ch not in NAME_CHARS), None)
    if bad is not None:
        raise SlotFileError(f"file name {name[:100]!r}: character {bad!r} is not allowed ({NAME_RULE})")
    if not name[0].isalnum() or name.endswith("."):
        raise SlotFileError(f"file name {name[:100]!r}: {NAME_RULE} (no dotfiles)")
    return name


def path_in(folder: Path, name: str) -> Path:
    """`folder/name` for a checked name, refusing a symbolic link there (it could point anywhere)."""
    path = folder / check_name(name)
    if path.is_symlink():
        raise SlotFileError(f"{name}: is a symbolic link, not a slot file")
    return path


def save_path_in(folder: Path, name: str) -> Path:
    """`path_in` for a save: a file of that name is replaced only if it is a slot file (the name is the client's:
    a save must not overwrite whatever else the folder holds)."""
    path = path_in(folder, name)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise SlotFileError(f"{name}: cannot read: {exc.strerror or exc}") from None
    kind = not_a_file(st.st_mode)
    if kind is not None:
        raise SlotFileError(f"{name}: is {kind}, not a slot file")
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(MAGIC))
    except OSError as exc:
        raise SlotFileError(f"{name}: cannot read: {exc.strerror or exc}") from None
    if head != MAGIC:
        raise SlotFileError(f"{name}: a file that is not a slot file has this name (it is not replaced)")
    return path


# -- writing -------------------------------------------------------------------------------------------------


class _Hashing:
    """A writer that hashes what it writes (the trailer's SHA-256) and counts it."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh, self.digest, self.size = fh, hashlib.sha256(), 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.fh.write(data)
        self.digest.update(data)
        self.size += len(data)


def write(path: Path, state: SlotState, models: Sequence[ModelIdentity], extra: dict[str, Any] | None = None,
          *, what: str = "slot file", parents: bool = False) -> int:
    """Write `state` (one ModelState per identity, in the engine's order) to `path` atomically; returns the bytes
    written."""
    if len(models) != len(state.models):
        raise ValueError("one identity per model state")
    if holds_pictures(state.tokens):
        raise SlotFileError(f"{path.name}: the {what}'s cells hold a picture, which {what}s do not keep yet")
    parts = [d.to_file() for d in state.drafters if d is not None]
    header = {
        "format": FORMAT, "localspec": __version__, "llama_cpp_python": _llama_cpp_version(),
        "tokens": len(state.tokens),
        "models": [{"file": m.name, "fingerprint": m.fingerprint, "kv_type": m.kv_type, "n_seq": m.n_seq,
                    "n_tokens": s.n_tokens, "floor": s.floor, "bytes": len(s.data)}
                   for m, s in zip(models, state.models, strict=True)],
        "drafters": [{"kind": part.kind, "meta": part.meta, "bytes": [len(b) for b in part.blobs]} for part in parts],
        "extra": extra or {},
    }
    head = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    with atomic_file(path, what, parents=parents) as fh:
        out = _Hashing(fh)
        out.write(MAGIC)
        out.write(_U32.pack(FORMAT))
        out.write(_U32.pack(len(head)))
        out.write(head)
        out.write(struct.pack(f"<{len(state.tokens)}i", *state.tokens))
        for model in state.models:
            out.write(model.data)
        for part in parts:
            for blob in part.blobs:
                out.write(blob)
        fh.write(out.digest.digest())
        return out.size + 32


# -- reading -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    """A checked slot file: the state to restore (its models matched to this engine's), the writer's extra, and
    the bytes read."""

    state: SlotState
    extra: dict[str, Any]
    nbytes: int
    saved: tuple[str, ...]  # the files its models' states came from, in its order
    parts: tuple[SeqFile, ...] = ()  # the drafters' parts (`Engine.restore` has its drafters read them back)


def _int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SlotFileError(f"{where}: header field {name} is {value!r}, not a count (corrupt file?)")
    return value


def read(path: Path, models: Sequence[ModelIdentity], *, n_vocab: int, n_ctx: int) -> Loaded:
    """The state in `path`, for an engine whose models are `models` (the target first): every check made before
    any of it reaches llama.cpp. The target must be the one it was saved from; a draft whose state the file holds
    must be the saved draft (a file without one leaves the draft's cells to be decoded, one from an engine with a
    draft restores without it here). SlotFileError names the file and what differs."""
    where = str(path)
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise SlotFileError(f"{where}: no such slot file") from None
    except OSError as exc:
        raise SlotFileError(f"{where}: cannot read: {exc.strerror or exc}") from None
    kind = "a symbolic link" if path.is_symlink() else not_a_file(st.st_mode)
    if kind is not None:
        raise SlotFileError(f"{where}: is {kind}, not a slot file")
    try:
        with open(path, "rb") as fh:
            return _read(fh, st.st_size, where, models, n_vocab, n_ctx)
    except OSError as exc:
        raise SlotFileError(f"{where}: cannot read: {exc.strerror or exc}") from None


def _read(fh: BinaryIO, size: int, where: str, models: Sequence[ModelIdentity], n_vocab: int,
          n_ctx: int) -> Loaded:
    fixed = len(MAGIC) + 2 * _U32.size
    start = fh.read(fixed)
    if len(start) < fixed or not start.startswith(MAGIC):
        raise SlotFileError(f"{where}: not a localspec slot file")
    (version,) = _U32.unpack_from(start, len(MAGIC))
    (head_len,) = _U32.unpack_from(start, len(MAGIC) + _U32.size)
    if version not in READS:
        raise SlotFileError(f"{where}: slot file format {version}; this localspec reads formats "
                            f"{', '.join(map(str, READS))}")
    if head_len > MAX_HEADER or fixed + head_len > size:
        raise SlotFileError(f"{where}: header of {head_len} bytes does not fit the file (corrupt file?)")
    raw_head = fh.read(head_len)
    try:
        header = json.loads(raw_head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise SlotFileError(f"{where}: the header is not JSON (corrupt file?)") from None
    if not isinstance(header, dict) or not isinstance(header.get("models"), list) or not header["models"]:
        raise SlotFileError(f"{where}: the header names no models (corrupt file?)")
    n_tokens = _int(header.get("tokens"), "tokens", where)
    saved = header["models"]
    sizes, counts, floors = [], [], []
    for i, entry in enumerate(saved):
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str)
                                                  for k in ("file", "fingerprint", "kv_type")):
            raise SlotFileError(f"{where}: model {i} of the header is malformed (corrupt file?)")
        sizes.append(_int(entry.get("bytes"), "bytes", where))
        counts.append(_int(entry.get("n_tokens"), "n_tokens", where))
        floors.append(_int(entry.get("floor"), "floor", where))
        _int(entry.get("n_seq"), "n_seq", where)
        if counts[-1] > n_tokens or floors[-1] > counts[-1]:
            raise SlotFileError(f"{where}: model {i} holds {counts[-1]} of {n_tokens} tokens (corrupt file?)")
    drafters = header.get("drafters", [])
    if not isinstance(drafters, list):
        raise SlotFileError(f"{where}: the header's drafters is not a list (corrupt file?)")
    part_sizes: list[list[int]] = []
    for i, entry in enumerate(drafters):
        if not (isinstance(entry, dict) and isinstance(entry.get("kind"), str) and isinstance(entry.get("meta"), dict)
                and isinstance(entry.get("bytes"), list)):
            raise SlotFileError(f"{where}: drafter part {i} of the header is malformed (corrupt file?)")
        part_sizes.append([_int(n, "bytes", where) for n in entry["bytes"]])
    expected = fixed + head_len + 4 * n_tokens + sum(sizes) + sum(map(sum, part_sizes)) + 32
    if size != expected:
        raise SlotFileError(f"{where}: {size} bytes where its header says {expected} (cut short or corrupt)")
    # Versions and models before the payload is read (a 2 GB state of another model is refused at once).
    extra = header.get("extra")
    if not isinstance(extra, dict):
        raise SlotFileError(f"{where}: the header's extra is not an object (corrupt file?)")
    if header.get("localspec") != __version__:
        raise SlotFileError(f"{where}: saved by localspec {header.get('localspec')!r}; this is {__version__} (a state "
                            "is only restored by the version that wrote it)")
    if header.get("llama_cpp_python") != _llama_cpp_version():
        raise SlotFileError(f"{where}: saved with llama-cpp-python {header.get('llama_cpp_python')!r}; this is "
                            f"{_llama_cpp_version()} (llama.cpp's state layout may differ)")
    if n_tokens > n_ctx:
        raise SlotFileError(f"{where}: holds {n_tokens} tokens; the context holds {n_ctx}")
    for i, (entry, mine) in enumerate(zip(saved, models, strict=False)):
        role = "the target" if i == 0 else "the draft"
        theirs = ModelIdentity(entry["file"], entry["fingerprint"], entry["kv_type"], entry["n_seq"])
        if theirs.fingerprint != mine.fingerprint:
            raise SlotFileError(f"{where}: saved with {role} {theirs.describe()}; {role} here is {mine.describe()}")
        if theirs.kv_type != mine.kv_type:
            raise SlotFileError(f"{where}: saved with KV type {theirs.kv_type}; {role} here uses {mine.kv_type} "
                                "(--kv-type)")
        if theirs.n_seq != mine.n_seq:
            raise SlotFileError(f"{where}: saved from {theirs.n_seq} slot(s); {role} here has {mine.n_seq} "
                                "(llama.cpp's state carries the slot count: restore it with --parallel "
                                f"{theirs.n_seq})")
    digest = hashlib.sha256()
    digest.update(start)
    digest.update(raw_head)
    token_bytes = fh.read(4 * n_tokens)
    digest.update(token_bytes)
    def blob(n: int) -> bytearray:
        data = bytearray(n)
        if fh.readinto(data) != n:
            raise SlotFileError(f"{where}: cut short (corrupt file?)")
        digest.update(data)
        return data

    blobs = [blob(n) for n in sizes]
    parts = tuple(SeqFile(entry["kind"], entry["meta"], tuple(blob(n) for n in part))
                  for entry, part in zip(drafters, part_sizes, strict=True))
    if fh.read(32) != digest.digest():
        raise SlotFileError(f"{where}: checksum mismatch (the file was changed or damaged)")
    tokens = struct.unpack(f"<{n_tokens}i", token_bytes)
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise SlotFileError(f"{where}: token id {bad} is outside the vocabulary (0..{n_vocab - 1})")
    states = []
    for i in range(len(models)):
        if i < len(saved):
            states.append(ModelState(counts[i], blobs[i], floors[i]))
        else:  # a draft the file has no state for: its cells start empty
            states.append(ModelState(0, bytearray(), 0))
    return Loaded(SlotState(tokens, tuple(states)), extra, size, tuple(e["file"] for e in saved), parts)

