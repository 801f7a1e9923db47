"""The synthetic pair generator: file layout, bit-identical shared tensors, agreement through llama.cpp."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")  # noqa: F841 -- import before numpy (docs/architecture.md: import order)

import gguf  # noqa: E402
import numpy as np  # noqa: E402
from synthetic import TINY, TINY_HIGH, PairSpec, measure_agreement, write_pair  # noqa: E402


def _pair(root: Path, spec: PairSpec, name: str) -> tuple[Path, Path]:
    target, draft = root / f"{name}-target.gguf", root / f"{name}-draft.gguf"
    write_pair(target, draft, spec)
    return target, draft


@pytest.fixture(scope="module")
def f32_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _pair(tmp_path_factory.mktemp("syn"), TINY, "tiny")


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}


def test_shared_tensors_bit_identical(f32_pair: tuple[Path, Path]) -> None:
    target, draft = (_tensors(p) for p in f32_pair)
    shared = ["token_embd.weight", "output.weight", "output_norm.weight"] + [
        n for n in draft if n.startswith(tuple(f"blk.{b}." for b in range(TINY.shared_blocks)))
    ]
    assert len(shared) == 3 + 11 * TINY.shared_blocks  # qwen3 block: 7 matrices + 4 norms
    for name in shared:
        assert target[name].tobytes() == draft[name].tobytes(), name
    # The target's extra blocks exist and are not copies of a shared block.
    extra = f"blk.{TINY.target_blocks - 1}.ffn_down.weight"
    assert extra in target and extra not in draft
    assert not np.array_equal(target[extra], target["blk.0.ffn_down.weight"])


def test_metadata_and_determinism(tmp_path: Path, f32_pair: tuple[Path, Path]) -> None:
    again, _ = _pair(tmp_path, TINY, "again")
    assert again.read_bytes() == f32_pair[0].read_bytes()  # same seed, same bytes
    reader = gguf.GGUFReader(f32_pair[0])
    f = reader.fields
    assert f["general.architecture"].contents() == "qwen3"
    assert f["qwen3.block_count"].contents() == TINY.target_blocks
    assert len(f["tokenizer.ggml.tokens"].data) == 49152
    assert len(f["tokenizer.ggml.merges"].data) > 40000
    assert "tokenizer.chat_template" in f
    # Zero-mean weights (nibbles 1..15): a -0.5 d bias makes every position pick the same token.
    w = _tensors(f32_pair[0])["blk.0.attn_q.weight"]
    assert abs(float(w.mean())) < 0.05 * TINY.scale * 4.3


def test_q4_0_is_the_same_model(tmp_path: Path) -> None:
    """Q4_0 bytes dequantise (ggml's nibble order) to exactly the F32 pair's values."""
    f32, _ = _pair(tmp_path, TINY, "f32")
    q4, _ = _pair(tmp_path, replace(TINY, wtype="q4_0"), "q4")
    for a, b in zip(gguf.GGUFReader(f32).tensors, gguf.GGUFReader(q4).tensors, strict=True):
        assert a.name == b.name
        deq = gguf.quants.dequantize(b.data, b.tensor_type)
        assert np.array_equal(np.asarray(a.data).reshape(deq.shape), deq), a.name


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        replace(TINY, shared_blocks=3, draft_blocks=2).validate()
    with pytest.raises(ValueError):
        replace(TINY, n_ff=100).validate()


@pytest.mark.slow
def test_loads_in_llama_cpp_and_is_not_degenerate(f32_pair: tuple[Path, Path]) -> None:
    from localspec.llama_ctx import LlamaModel

    for path in f32_pair:
        with LlamaModel(path, n_ctx=512, n_threads=1) as m:
            tokens = m.tokenize("The quick brown fox jumps over the lazy dog while it rains in Spain on Tuesday.")
            logits = m.decode(tokens, 0, all_logits=True).logits
            assert logits is not None and logits.shape == (len(tokens), 49152)
            assert np.isfinite(logits).all()
            # Not degenerate: the argmax follows the context (the input tokens are all distinct here).
            assert len(set(logits.argmax(axis=1).tolist())) > len(tokens) // 2


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_agreement_falls_with_scale(tmp_path: Path, arch: str) -> None:
    rates = []
    for scale in (0.001, 0.0075, 0.02):
        target, draft = _pair(tmp_path, replace(TINY, scale=scale, arch=arch), f"s{scale:g}")
        r = measure_agreement(target, draft, n_prompts=4, gen_len=48)
        assert r["distinct"] > 0.3  # greedy text is not one token repeated
        rates.append(r["greedy"])
    assert rates[0] > rates[1] > rates[2], rates
    assert rates[0] > 0.95 and rates[2] < 0.4, rates


@pytest.mark.slow
def test_preset_agreement_levels(tmp_path: Path) -> None:
    """The two tiny presets the engine tests use: TINY ~60-90% agreement, TINY_HIGH near 100%."""
    mid = measure_agreement(*_pair(tmp_path, TINY, "mid"), n_prompts=8)
    high = measure_agreement(*_pair(tmp_path, TINY_HIGH, "high"), n_prompts=8)
    assert 0.6 <= mid["greedy"] <= 0.9, mid
    assert high["greedy"] >= 0.97, high


def test_an_interrupted_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import synthetic

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "_write_tensors", interrupted)  # Ctrl-C halfway through the tensor data
    with pytest.raises(KeyboardInterrupt):
        write_pair(tmp_path / "t.gguf", tmp_path / "d.gguf", TINY)
    assert list(tmp_path.iterdir()) == []
