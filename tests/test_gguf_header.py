"""Header-only GGUF reading: real files, huge sparse files, and hostile ones."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from gguf import GGMLQuantizationType

from localspec.models.gguf_header import GGUFError, SkippedArray, read_header
from tests import helpers_gguf as G
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


# -- hostile headers: types, nesting, hyperparameters, memory ------------------------------------------------


def _model(tmp_path: Path, name: str = "m.gguf", **changes: bytes | None) -> Path:
    """A minimal llama header (no tensors) with records replaced (`key=kv(...)`) or removed (`key=None`)."""
    records = {
        "general.architecture": G.kv("general.architecture", G.STRING, "llama"),
        "llama.block_count": G.kv("llama.block_count", G.UINT32, 2),
        "llama.embedding_length": G.kv("llama.embedding_length", G.UINT32, 64),
        "llama.context_length": G.kv("llama.context_length", G.UINT32, 2048),
        "llama.attention.head_count": G.kv("llama.attention.head_count", G.UINT32, 4),
        "llama.attention.head_count_kv": G.kv("llama.attention.head_count_kv", G.UINT32, 2),
        "tokenizer.ggml.model": G.kv("tokenizer.ggml.model", G.STRING, "gpt2"),
        "tokenizer.ggml.tokens": G.kv("tokenizer.ggml.tokens", G.ARRAY, (G.STRING, ["a", "b", "c"])),
        "tokenizer.ggml.bos_token_id": G.kv("tokenizer.ggml.bos_token_id", G.UINT32, 1),
    }
    for key, record in changes.items():
        key = key.replace("__", ".")
        if record is None:
            records.pop(key, None)
        else:
            records[key] = record
    return G.write(tmp_path / name, list(records.values()))


def test_a_well_formed_minimal_header_passes(tmp_path: Path) -> None:
    hp = read_header(_model(tmp_path)).hparams
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.key_length, hp.n_vocab) == (2, 64, (4, 4), (2, 2), 16, 3)


def test_a_thousand_nested_arrays_are_refused_not_a_recursion_error(tmp_path: Path) -> None:
    path = G.write(tmp_path / "deep.gguf", [G.kv("general.architecture", G.STRING, "llama"),
                                             G.kv("x", G.ARRAY, G.nested_arrays(1000))])
    assert path.stat().st_size < 13_000
    with pytest.raises(GGUFError, match="'x' nests arrays more than 3 deep"):
        read_header(path)
    # three levels are legal GGUF: read (and skipped, since nothing reads them)
    ok = G.write(tmp_path / "three.gguf", [G.kv("x", G.ARRAY, G.nested_arrays(3))])
    assert read_header(ok).get("x") == SkippedArray("array", 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("item", ["nested arrays", "strings"])
def test_a_header_of_millions_of_empty_items_is_refused_in_well_under_a_second(tmp_path: Path, item: str) -> None:
    """Issue #22: 16M empty nested arrays (or 16M empty strings) fill a legal 200 MB header, written byte by byte
    and sparse here: each costs a Python call, so `localspec check` spent 122 s of CPU before saying
    "incompatible". The header's item budget refuses it before walking one."""
    count = 1 << 24
    inner = G.ARRAY if item == "nested arrays" else G.STRING
    head = G.pack([G.kv("general.architecture", G.STRING, "llama"),
                   G.kv("x", G.ARRAY, struct.pack("<IQ", inner, count))])
    path = tmp_path / "hostile.gguf"
    with path.open("wb") as out:
        out.write(head)  # the rest is zeros: an empty UINT8 array is 12 zero bytes, an empty string 8
        out.truncate(len(head) + count * (12 if inner == G.ARRAY else 8))
    import time

    t0 = time.process_time()
    with pytest.raises(GGUFError, match=f"'x': the header holds more than \\d+ {item}"):
        read_header(path)
    assert time.process_time() - t0 < 5  # CPU time, not wall: the walk took minutes


@pytest.mark.parametrize(
    ("key", "record", "wanted"),
    [
        ("tokenizer.ggml.tokens", G.kv("tokenizer.ggml.tokens", G.ARRAY, (G.UINT32, [1, 2, 3])), "an array of strings"),
        ("tokenizer.ggml.tokens", G.kv("tokenizer.ggml.tokens", G.STRING, "abc"), "an array of strings"),
        ("tokenizer.chat_template", G.kv("tokenizer.chat_template", G.UINT32, 7), "a string"),
        ("tokenizer.ggml.bos_token_id", G.kv("tokenizer.ggml.bos_token_id", G.STRING, "1"), "an integer"),
        ("tokenizer.ggml.bos_token_id", G.kv("tokenizer.ggml.bos_token_id", G.ARRAY, (G.UINT32, [1, 2])),
         "an integer"),
        ("tokenizer.ggml.add_bos_token", G.kv("tokenizer.ggml.add_bos_token", G.UINT8, 1), "true or false"),
        ("tokenizer.ggml.token_type", G.kv("tokenizer.ggml.token_type", G.ARRAY, (G.STRING, ["1"])),
         "an array of integers"),
        ("general.architecture", G.kv("general.architecture", G.FLOAT32, 1.5), "a string"),
    ],
)
def test_a_key_of_the_wrong_type_is_named_where_it_is_read(tmp_path: Path, key: str, record: bytes,
                                                            wanted: str) -> None:
    h = read_header(_model(tmp_path, **{key.replace(".", "__"): record}))  # reading the header itself is fine
    with pytest.raises(GGUFError, match=f"{key} is .*, expected {wanted}") as err:
        h.get(key)
    assert str(err.value).startswith(str(h.path)) and "\n" not in str(err.value)
    with pytest.raises(GGUFError, match=key):
        h.hparams  # noqa: B018 -- the load check reads every known key


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"llama.block_count": G.kv("llama.block_count", G.UINT32, 0)}, r"block_count = 0 is out of range 1\.\.512"),
        ({"llama.block_count": G.kv("llama.block_count", G.UINT32, 513)}, "llama.cpp's layer limit"),
        ({"llama.block_count": G.kv("llama.block_count", G.STRING, "2")}, "block_count is a string"),
        ({"llama.block_count": None}, "llama.block_count is missing"),
        ({"llama.embedding_length": G.kv("llama.embedding_length", G.INT32, -64)}, "embedding_length = -64"),
        ({"llama.context_length": G.kv("llama.context_length", G.UINT32, 0)}, "context_length = 0"),
        ({"llama.attention.head_count_kv": G.kv("llama.attention.head_count_kv", G.UINT32, 3)},
         "4 attention heads cannot share 3 KV heads"),
        ({"llama.attention.head_count_kv": G.kv("llama.attention.head_count_kv", G.ARRAY, (G.UINT32, [2]))},
         "head_count_kv has 1 values for 2 layers"),
        ({"llama.attention.head_count": G.kv("llama.attention.head_count", G.FLOAT32, 4.0)},
         "head_count is a float"),
        ({"llama.attention.key_length": G.kv("llama.attention.key_length", G.UINT32, 0)}, "key_length = 0"),
        ({"llama.expert_count": G.kv("llama.expert_count", G.UINT32, 2000)}, "expert_count = 2000"),
        ({"llama.expert_count": G.kv("llama.expert_count", G.UINT32, 8)}, "expert_used_count = 0 for 8 experts"),
        ({"llama.rope.scaling.type": G.kv("llama.rope.scaling.type", G.STRING, "bogus")},
         "rope.scaling.type is a string"),
        ({"general.architecture": None}, "general.architecture is missing"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens holds 0 tokens"),
        ({"tokenizer.ggml.tokens": G.kv("tokenizer.ggml.tokens", G.ARRAY, (G.STRING, ["a", "b", "a"]))},
         "tokens 0 and 2 are both 'a'"),
        ({"tokenizer.ggml.tokens": G.kv("tokenizer.ggml.tokens", G.ARRAY, (G.STRING, ["[EMPTY_1]", ""]))},
         "tokens 0 and 1 are both"),  # llama.cpp renames an empty token [EMPTY_<id>]
    ],
)
def test_hyperparameters_llama_cpp_would_abort_on_are_refused(tmp_path: Path, changes: dict, message: str) -> None:
    h = read_header(_model(tmp_path, **{k.replace(".", "__"): v for k, v in changes.items()}))
    with pytest.raises(GGUFError, match=message) as err:
        h.hparams  # noqa: B018
    assert str(err.value).startswith(str(h.path)) and "\n" not in str(err.value)


def test_per_layer_counts_and_a_layer_without_attention(tmp_path: Path) -> None:
    kv = G.kv("llama.attention.head_count_kv", G.ARRAY, (G.INT32, [2, 0]))
    hp = read_header(_model(tmp_path, llama__attention__head_count_kv=kv)).hparams
    assert hp.n_head_kv == (2, 0)


def test_string_arrays_compare_without_decoding_every_item(tmp_path: Path) -> None:
    words = ["<s>", "a", "b\xe9", "c"]
    base = read_header(_model(tmp_path, "a.gguf", tokenizer__ggml__tokens=G.kv(
        "tokenizer.ggml.tokens", G.ARRAY, (G.STRING, words)))).tokens
    for changed, first in [(["<s>", "a", "bé", "d"], 3), (["<s>", "ab", "\xe9", "c"], 1), (words + ["x"], None)]:
        other = read_header(_model(tmp_path, f"{first}.gguf", tokenizer__ggml__tokens=G.kv(
            "tokenizer.ggml.tokens", G.ARRAY, (G.STRING, changed)))).tokens
        assert base.first_difference(other) == first and other.first_difference(base) == first
    assert base == words and list(base) == words and base[-1] == "c" and base[1:3] == ["a", "b\xe9"]


def test_a_token_is_found_by_its_whole_text_not_inside_another(tmp_path: Path) -> None:
    """`first_index` searches the blob: a match must start and end on one item's bounds (empty items between)."""
    words = ["", "ab", "<P>", "", "b", "<P>", "x<P>y", "\xe9"]
    tokens = read_header(_model(tmp_path, tokenizer__ggml__tokens=G.kv(
        "tokenizer.ggml.tokens", G.ARRAY, (G.STRING, words)))).tokens
    for text in ["ab", "<P>", "b", "x<P>y", "\xe9", "", "a", "P>", "<P>x", "zz"]:
        assert tokens.first_index(text) == (words.index(text) if text in words else None), text


def test_a_fifo_is_named_not_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GGUFError, match="is a FIFO"):  # opening it would wait for a writer forever
        read_header(fifo)


# Peak RSS of this process since exec (VmHWM; ru_maxrss would start at pytest's own size, inherited at fork).
_PEAK_RSS = """
import sys
from localspec.models.gguf_header import read_header
def peak():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
before = peak()
h = read_header(sys.argv[1])
print(peak() - before, h.header_bytes, len(h.tokens))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from Linux's /proc")
def test_peak_memory_stays_within_twice_the_header(tmp_path: Path) -> None:
    # Inside every size limit: a million 16-byte tokens (kept), a million 2-byte strings nothing reads (skipped),
    # a 4 MB numeric array (kept as numpy) and nested arrays (skipped). The old reader held each string as a
    # Python object (~60 bytes beyond its text): about 6x the header in memory.
    rng = np.random.default_rng(0)
    tokens = [bytes(row) for row in rng.integers(0, 256, size=(1 << 20, 16), dtype=np.uint8)]
    path = G.write(tmp_path / "big.gguf", [
        G.kv("general.architecture", G.STRING, "llama"),
        G.kv("tokenizer.ggml.tokens", G.ARRAY, (G.STRING, tokens)),
        G.kv("unused.strings", G.ARRAY, (G.STRING, [b"ab"] * (1 << 20))),
        G.kv("tokenizer.ggml.scores", G.ARRAY, (G.FLOAT32, [0.0] * (1 << 20))),
        G.kv("unused.nested", G.ARRAY, struct.pack("<IQ", G.ARRAY, 1 << 16)
             + G.nested_arrays(2) * (1 << 16)),
    ])
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(path)], capture_output=True, text=True, check=True)
    peak, header_bytes, n_tokens = map(int, out.stdout.split())
    assert n_tokens == 1 << 20 and header_bytes == path.stat().st_size > 40e6
    # The bound: what is kept (16 MB of token text + 8 MB of offsets + 4 MB of scores) plus the read buffer,
    # never more than twice the header's size.
    print(f"header {header_bytes / 1e6:.1f} MB, peak RSS growth {peak / 1e6:.1f} MB")
    assert peak < 2 * header_bytes
    assert peak < 64e6
