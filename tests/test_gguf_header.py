"""Header-only GGUF reading: real files, huge sparse files, and hostile ones."""

from __future__ import annotations

import struct
from pathlib import Path

import psutil
import pytest
from gguf import GGMLQuantizationType

from localspec.gguf_header import GGUFError, read_header
from tests.helpers_vocab import write_vocab


def test_real_smollm2_header(smollm2_path: Path) -> None:
    h = read_header(smollm2_path)
    assert h.arch == "llama"
    assert h.n_vocab == 49152
    assert h.get("tokenizer.ggml.model") == "gpt2"
    assert h.file_type == "Q4_1"
    assert len(h.tensors) == 272
    # Tensor data is what llama.cpp maps: it reports 92.10 MiB for this file.
    assert h.tensor_bytes == pytest.approx(92.10 * 2**20, rel=1e-3)
    assert h.data_offset + h.tensor_bytes <= h.file_size


def test_header_of_a_20gb_file_reads_only_the_header(tmp_path: Path) -> None:
    # 20 GB of declared Q4_0 weights in a sparse file: the data section is never read.
    rows = 25_000
    tensors = [(f"blk.{i}.ffn.weight", (32 * 1024, rows), GGMLQuantizationType.Q4_0) for i in range(44)]
    path = write_vocab(tmp_path / "big.gguf", tensors=tensors, sparse_size=True)
    assert path.stat().st_size > 20e9
    proc = psutil.Process()
    before = proc.io_counters().read_chars
    h = read_header(path)
    read = proc.io_counters().read_chars - before
    assert h.tensor_bytes > 20e9
    assert read < h.header_bytes + (2 << 20), f"read {read} bytes for a {h.header_bytes}-byte header"


def _prefix(src: Path, dst: Path, n: int) -> Path:
    with src.open("rb") as fh:
        dst.write_bytes(fh.read(n))
    return dst


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        (10, "not a GGUF file"),
        (100_000, "truncated GGUF file"),  # inside the token list
        (5_000_000, "truncated GGUF file"),  # inside the tensor data
    ],
)
def test_truncated_files_give_one_line_naming_the_file(
    tmp_path: Path, cut: int, message: str, smollm2_path: Path
) -> None:
    path = _prefix(smollm2_path, tmp_path / "cut.gguf", cut)
    with pytest.raises(GGUFError, match=message) as err:
        read_header(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_non_gguf_and_corrupt_files(tmp_path: Path) -> None:
    cases = {
        "text.gguf": b"this is not a model at all, just some text padding" * 3,
        "empty.gguf": b"",
        # valid magic and version, then a key whose length claims a petabyte
        "hugekey.gguf": struct.pack("<IIQQ", 0x46554747, 3, 0, 1) + struct.pack("<Q", 1 << 50),
        # an array that claims 2^40 items
        "hugearray.gguf": struct.pack("<IIQQ", 0x46554747, 3, 0, 1)
        + struct.pack("<Q", 1)
        + b"k"
        + struct.pack("<IIQ", 9, 4, 1 << 40),
        "badtype.gguf": struct.pack("<IIQQ", 0x46554747, 3, 0, 1)
        + struct.pack("<Q", 1)
        + b"k"
        + struct.pack("<I", 77)
        + b"\0" * 16,
        "version9.gguf": struct.pack("<IIQQ", 0x46554747, 9, 0, 0) + b"\0" * 16,
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(GGUFError) as err:
            read_header(path)
        assert str(err.value).startswith(str(path)) and "\n" not in str(err.value), name
    with pytest.raises(GGUFError, match="file not found"):
        read_header(tmp_path / "absent.gguf")
    with pytest.raises(GGUFError, match="is a directory"):
        read_header(tmp_path)


def test_header_size_is_bounded(tmp_path: Path, smollm2_path: Path) -> None:
    with pytest.raises(GGUFError, match="header larger than"):
        read_header(smollm2_path, limit=1 << 20)


def test_generated_vocab_round_trips(tmp_path: Path) -> None:
    path = write_vocab(tmp_path / "v.gguf", bos=7)
    h = read_header(path)
    assert h.tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert h.get("tokenizer.ggml.bos_token_id") == 7
    assert list(h.get("tokenizer.ggml.token_type")[:4]) == [3, 3, 3, 1]
    assert h.file_type == "Q8_0"
