"""Crafted GGUF files packed by hand with `struct`: what a corrupt or hostile file can say.

`pack` builds a header from raw key/value records; `rewrite` copies a real model with some keys replaced,
removed or added, keeping its tensor infos and data, so llama.cpp could load it but for what was changed.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = 0x46554747
ALIGNMENT = 32

# GGUF value types (gguf.GGUFValueType), spelled out: these files must not depend on a writer's opinions.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_FMT = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f", BOOL: "?",
        UINT64: "Q", INT64: "q", FLOAT64: "d"}


def string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def value(vtype: int, v: object) -> bytes:
    """A value's bytes without its type tag (strings and scalars)."""
    if vtype == STRING:
        return string(v)  # type: ignore[arg-type]
    return struct.pack("<" + _FMT[vtype], v)


def array(item_type: int, items: list) -> bytes:
    """An array value's bytes (item type, count, items) without the ARRAY tag."""
    body = b"".join(value(item_type, i) for i in items)
    return struct.pack("<IQ", item_type, len(items)) + body


def kv(key: str, vtype: int, v: object) -> bytes:
    """One metadata record; for ARRAY, `v` is a (item_type, items) pair or the packed array bytes."""
    if vtype != ARRAY:
        return string(key) + struct.pack("<I", vtype) + value(vtype, v)
    payload = v if isinstance(v, bytes) else array(*v)  # type: ignore[misc]
    return string(key) + struct.pack("<I", vtype) + payload


def nested_arrays(depth: int) -> bytes:
    """An array holding an array holding ... `depth` levels, innermost empty (a few bytes per level)."""
    inner = struct.pack("<IQ", UINT8, 0)
    for _ in range(depth - 1):
        inner = struct.pack("<IQ", ARRAY, 1) + inner
    return inner


def pack(records: list[bytes], tensor_infos: bytes = b"", n_tensors: int = 0, data: bytes = b"") -> bytes:
    header = struct.pack("<IIQQ", MAGIC, 3, n_tensors, len(records)) + b"".join(records) + tensor_infos
    pad = b"\0" * (-len(header) % ALIGNMENT) if data else b""
    return header + pad + data


def write(path: Path, records: list[bytes], **kw: object) -> Path:
    path.write_bytes(pack(records, **kw))  # type: ignore[arg-type]
    return path


def rewrite(src: Path, dst: Path, changes: dict[str, bytes | None]) -> Path:
    """`src` with the records of `changes` replaced (bytes from `kv`), removed (None) or appended (new keys)."""
    fields, infos, n_tensors, data_offset = _parsed(Path(src).resolve(), Path(src).stat().st_mtime_ns)
    records: list[bytes] = []
    for name, record in fields.items():
        if name in changes:
            if changes[name] is not None:
                records.append(changes[name])  # type: ignore[arg-type]
            continue
        records.append(record)
    records += [r for k, r in changes.items() if k not in fields and r is not None]
    data = src.read_bytes()[data_offset:]
    dst.write_bytes(pack(records, infos, n_tensors, data))
    return dst


@functools.lru_cache(maxsize=4)
def _parsed(src: Path, _mtime_ns: int) -> tuple[dict[str, bytes], bytes, int, int]:
    """`src`'s raw key/value records, tensor infos, tensor count and data offset, walked once per file with
    `struct` (gguf's reader builds a numpy view per string: seconds over a 49,152-token vocabulary)."""
    raw = src.read_bytes()
    magic, _, n_tensors, n_kv = struct.unpack_from("<IIQQ", raw, 0)
    assert magic == MAGIC, src

    def past_value(vtype: int, pos: int) -> int:
        if vtype == STRING:
            return pos + 8 + struct.unpack_from("<Q", raw, pos)[0]
        if vtype == ARRAY:
            item, count = struct.unpack_from("<IQ", raw, pos)
            pos += 12
            if item in _FMT:
                return pos + count * struct.calcsize("<" + _FMT[item])
            for _ in range(count):
                pos = past_value(item, pos)
            return pos
        return pos + struct.calcsize("<" + _FMT[vtype])

    fields: dict[str, bytes] = {}
    pos = 24
    for _ in range(n_kv):
        start = pos
        length = struct.unpack_from("<Q", raw, pos)[0]
        key = raw[pos + 8 : pos + 8 + length].decode()
        pos = past_value(struct.unpack_from("<I", raw, pos + 8 + length)[0], pos + 12 + length)
        fields[key] = raw[start:pos]
    infos_start = pos
    for _ in range(n_tensors):
        pos += 8 + struct.unpack_from("<Q", raw, pos)[0]  # the name
        pos += 4 + 8 * struct.unpack_from("<I", raw, pos)[0] + 4 + 8  # dimensions, type, offset
    alignment = struct.unpack_from("<I", fields["general.alignment"], len(fields["general.alignment"]) - 4)[0] \
        if "general.alignment" in fields else ALIGNMENT
    return fields, raw[infos_start:pos], n_tensors, -(-pos // alignment) * alignment


# -- reading a written model's tensors ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One tensor of a GGUF file, laid out as `gguf.GGUFReader` lays it out: numpy's dimension order, and the
    quantized types as rows of block bytes (what `gguf.quants.dequantize` takes)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: Any  # a numpy array


def read_tensors(path: Path) -> list[Tensor]:
    """`path`'s tensors in file order, their data memory-mapped: the tensor infos from the header alone
    (localspec.models.gguf_header), since gguf's reader spends seconds on a 49,152-token vocabulary's strings first."""
    import llama_cpp  # noqa: F401, I001  -- before numpy (docs/gpu.md)
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quant_shape_to_byte_shape

    from localspec.models.gguf_header import read_header

    # The types GGUFReader reads as numbers; every other type is read as its blocks' bytes.
    numeric = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
               Q.I32: np.int32, Q.I64: np.int64}
    header = read_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = []
    for info in header.tensors:
        kind = Q(info.type_id)
        start = header.data_offset + info.offset
        data = raw[start : start + info.n_bytes]
        shape = tuple(reversed(info.shape))
        if kind in numeric:
            data = data.view(numeric[kind]).reshape(shape)
        else:
            data = data.reshape(quant_shape_to_byte_shape(shape, kind))
        out.append(Tensor(info.name, kind, data))
    return out


def read_fields(path: Path) -> dict[str, object]:
    """`path`'s metadata as localspec.models.gguf_header reads it (the tokenizer's token list kept, other string arrays
    as their length)."""
    from localspec.models.gguf_header import read_header

    return dict(read_header(path).metadata)
