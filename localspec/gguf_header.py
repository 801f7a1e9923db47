"""Bounded, header-only GGUF reading: metadata and tensor infos, never a byte of tensor data.

`gguf.GGUFReader` memory-maps the whole file and builds one numpy view per token string, which is slow for
262k-token vocabularies and turns a truncated file into an IndexError deep inside numpy. Here the header is
parsed sequentially from a buffered file with explicit limits (header size, string length, array length),
using the `gguf` package's constants for the value and quantization types. A truncated, corrupt or non-GGUF
file raises a one-line `GGUFError` that names the file.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
    LlamaFileType,
)

from localspec.errors import GGUFError

# A 262k-token vocabulary with merges and scores is ~15 MB of header; 256 MiB leaves room and still bounds a
# hostile file that claims a billion strings.
MAX_HEADER_BYTES = 256 << 20
MAX_STRING_BYTES = 16 << 20  # chat templates are the longest strings seen (tens of kB)
MAX_ARRAY_LEN = 1 << 24
MAX_TENSORS = 1 << 20
MAX_DIMS = 4  # GGML_MAX_DIMS

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # relative to the start of the data section
    n_bytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type{self.type_id}"

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int
    file_size: int
    header_bytes: int = field(repr=False)

    # -- generic access ------------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{suffix}", default)

    # -- weights ---------------------------------------------------------------------------------------------

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data llama.cpp will hold for the weights."""
        return sum(t.n_bytes for t in self.tensors)

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.tensor_bytes / self.n_params if self.n_params else 0.0

    @property
    def main_weight_type(self) -> str:
        """The type holding most bytes of the block matrices (the embedding table is often kept at 8 bits)."""
        by_type: dict[str, int] = {}
        for t in self.tensors:
            if len(t.shape) >= 2 and t.name.startswith("blk."):
                by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
        return max(by_type, key=by_type.__getitem__) if by_type else "?"

    @property
    def file_type(self) -> str:
        """`general.file_type` by name (Q4_K_M, Q8_0...), else the main weight type."""
        ftype = self.metadata.get("general.file_type")
        if isinstance(ftype, int):
            try:
                return LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
            except ValueError:
                pass
        return self.main_weight_type

    # -- tokenizer -------------------------------------------------------------------------------------------

    @property
    def tokens(self) -> list[str]:
        return self.metadata.get("tokenizer.ggml.tokens") or []

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


class _Cursor:
    """Sequential reads over a buffered file, refusing to go past the header limit or the end of the file."""

    def __init__(self, fh: Any, path: Path, file_size: int, limit: int) -> None:
        self.fh = fh
        self.path = path
        self.file_size = file_size
        self.limit = limit
        self.pos = 0

    def read(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.limit:
            raise GGUFError(f"{self.path}: GGUF header larger than {self.limit >> 20} MiB (corrupt file?)")
        data = self.fh.read(n)
        if len(data) != n:
            raise GGUFError(f"{self.path}: truncated GGUF file (header ends at byte {self.pos + len(data)})")
        self.pos += n
        return data

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self.read(size))[0]

    def string(self, what: str) -> str:
        n = self.unpack("Q")
        if n > MAX_STRING_BYTES:
            raise GGUFError(f"{self.path}: {what}: string of {n} bytes (corrupt file?)")
        raw = self.read(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Some vocabularies carry byte tokens that are not valid UTF-8; keep them comparable.
            return raw.decode("utf-8", errors="surrogateescape")


def _value(cur: _Cursor, vtype: int, key: str) -> Any:
    try:
        kind = GGUFValueType(vtype)
    except ValueError:
        raise GGUFError(
            f"{cur.path}: metadata {key!r} has unknown value type {vtype} (corrupt file?)"
        ) from None
    if kind == GGUFValueType.STRING:
        return cur.string(key)
    if kind == GGUFValueType.ARRAY:
        item_type = cur.unpack("I")
        count = cur.unpack("Q")
        if count > MAX_ARRAY_LEN:
            raise GGUFError(f"{cur.path}: metadata {key!r} claims {count} items (corrupt file?)")
        if item_type == GGUFValueType.STRING:
            return [cur.string(key) for _ in range(count)]
        if item_type in _SCALARS:
            fmt = _SCALARS[GGUFValueType(item_type)]
            raw = cur.read(count * struct.calcsize(fmt))
            # Numeric arrays (scores, token types) stay numpy arrays: compact and fast to compare.
            return np.frombuffer(raw, dtype=np.dtype("<" + fmt)).copy()
        if item_type == GGUFValueType.ARRAY:
            return [_value(cur, GGUFValueType.ARRAY, key) for _ in range(count)]
        raise GGUFError(
            f"{cur.path}: metadata {key!r} has unknown array item type {item_type} (corrupt file?)"
        )
    return cur.unpack(_SCALARS[kind])


def _tensor_bytes(path: Path, name: str, shape: tuple[int, ...], type_id: int) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise GGUFError(f"{path}: tensor {name!r} has unknown type {type_id} (newer than gguf-py?)") from None
    n = math.prod(shape)
    if shape and shape[0] % block:
        raise GGUFError(
            f"{path}: tensor {name!r} row of {shape[0]} is not a multiple of its block size {block}"
        )
    return n // block * type_size


def _read(path: Path, limit: int) -> GGUFHeader:
    try:
        file_size = path.stat().st_size
        fh = path.open("rb", buffering=1 << 20)
    except FileNotFoundError:
        raise GGUFError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise GGUFError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read: {exc.strerror}") from None
    with fh:
        cur = _Cursor(fh, path, file_size, limit)
        if file_size < 24:
            raise GGUFError(f"{path}: not a GGUF file ({file_size} bytes)")
        magic = struct.unpack("<I", cur.read(4))[0]
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (bad magic)")
        version = cur.unpack("I")
        if version not in (2, 3):
            if version & 0xFFFF == 0:
                raise GGUFError(f"{path}: big-endian GGUF files are not supported")
            raise GGUFError(f"{path}: unsupported GGUF version {version}")
        n_tensors = cur.unpack("Q")
        n_kv = cur.unpack("Q")
        if n_tensors > MAX_TENSORS or n_kv > MAX_ARRAY_LEN:
            raise GGUFError(f"{path}: header claims {n_tensors} tensors and {n_kv} keys (corrupt file?)")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            metadata[key] = _value(cur, cur.unpack("I"), key)
        tensors = []
        for _ in range(n_tensors):
            name = cur.string("tensor name")
            n_dims = cur.unpack("I")
            if n_dims > MAX_DIMS:
                raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions (corrupt file?)")
            shape = tuple(cur.unpack("Q") for _ in range(n_dims))
            type_id = cur.unpack("I")
            offset = cur.unpack("Q")
            tensors.append(
                TensorInfo(name, shape, type_id, offset, _tensor_bytes(path, name, shape, type_id))
            )
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{path}: general.alignment = {alignment!r} is not a power of two")
        header_bytes = cur.pos
    data_offset = -(-header_bytes // alignment) * alignment
    # The data section must hold every tensor: checked from the sizes alone, without reading the data.
    data_end = max((t.offset + t.n_bytes for t in tensors), default=0)
    if tensors and data_offset + data_end > file_size:
        raise GGUFError(
            f"{path}: truncated GGUF file ({file_size} bytes, tensor data needs {data_offset + data_end})"
        )
    return GGUFHeader(
        path=path,
        version=version,
        metadata=metadata,
        tensors=tuple(tensors),
        data_offset=data_offset,
        file_size=file_size,
        header_bytes=header_bytes,
    )


@lru_cache(maxsize=8)
def _cached(path: Path, size: int, mtime_ns: int, limit: int) -> GGUFHeader:
    return _read(path, limit)


def read_header(path: str | os.PathLike[str], *, limit: int = MAX_HEADER_BYTES) -> GGUFHeader:
    """The header of one GGUF file (cached per path, size and mtime, so check + preflight read it once)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return _read(p, limit)  # raises the one-line error
    return _cached(p.resolve(), st.st_size, st.st_mtime_ns, limit)
