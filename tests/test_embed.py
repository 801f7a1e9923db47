"""bench/embed.py: a small llama model written into wider, deeper shapes computes what the small model computes.

The reference is the source file itself run by llama.cpp (or llama.cpp's own dequantisation of it): nothing of the
embedding's index maps, norm scaling or RoPE widening is shared with it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")  # noqa: F841 -- import before numpy (docs/architecture.md: import order)

import numpy as np  # noqa: E402
from embed import (  # noqa: E402
    EMBED_32B,
    EMBED_TINY,
    EmbedSpec,
    main,
    place,
    read_source,
    tensor_plan,
    write_embedded,
)
from synthetic import TINY, Shape, q4_k_m_type, write_pair  # noqa: E402

from localspec.llama.backend import quantize  # noqa: E402
from localspec.llama.model import LlamaModel  # noqa: E402
from tests.helpers_gguf import read_fields, read_tensors  # noqa: E402

# A random tiny llama source (64 wide, 4 heads in 2 KV groups of head_dim 16, 4 blocks) and shapes twice as wide,
# with head_dim 32 (RoPE widening m = 2), 4 query heads per KV head (target) or 1 (draft: KV heads copied), and
# blocks of zeros past the source's.
SOURCE = replace(TINY, arch="llama", wtype="f32")
WIDE = EmbedSpec(
    target=Shape(n_embd=256, n_head=8, n_head_kv=2, head_dim=32, n_ff=256, n_blocks=6),
    draft=Shape(n_embd=128, n_head=4, n_head_kv=4, head_dim=32, n_ff=128, n_blocks=4),
    target_mix="f32",
    draft_type="f32",
)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("source")
    write_pair(folder / "source.gguf", folder / "unused-draft.gguf", SOURCE)
    return folder / "source.gguf"


def _logits(path: Path, tokens: list[int]) -> np.ndarray:
    with LlamaModel(path, n_ctx=256, device_top_k=0, n_batch=256, n_threads=1) as model:
        scores = model.decode(tokens, 0, all_logits=True)
        assert scores is not None and scores.logits is not None
        return np.array(scores.logits, copy=True)


def _greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    with LlamaModel(path, n_ctx=256, device_top_k=0, n_batch=256, n_threads=1) as model:
        scores = model.decode(prompt, 0)
        assert scores is not None
        out = [int(scores.argmax()[0])]
        for _ in range(n - 1):
            scores = model.decode([out[-1]], len(prompt) + len(out) - 1)
            assert scores is not None
            out.append(int(scores.argmax()[0]))
        return out


@pytest.mark.slow
def test_the_wide_f32_models_compute_the_source(tmp_path: Path, source: Path) -> None:
    src = read_source(source)
    write_embedded(tmp_path / "target.gguf", src, WIDE, "target")
    write_embedded(tmp_path / "draft.gguf", src, WIDE, "draft")
    prompt = np.random.default_rng(3).integers(0, 49152, size=12).tolist()
    tokens = prompt + _greedy(source, prompt, 40)  # positions 0..51: RoPE at many angles
    want = _logits(source, tokens)
    for role in ("target", "draft"):
        got = _logits(tmp_path / f"{role}.gguf", tokens)
        # The same arithmetic up to summation order: differences of float32 rounding only.
        assert np.abs(got - want).max() < 1e-3 * want.std(), role
        assert (got.argmax(axis=1) == want.argmax(axis=1)).all(), role


@pytest.mark.slow
def test_the_card_mix_layout_and_zero_blocks(tmp_path: Path, source: Path) -> None:
    spec = replace(WIDE, target_mix="q4_k_m", draft_type="q8_0")
    src = read_source(source)
    path = tmp_path / "target.gguf"
    write_embedded(path, src, spec, "target")
    tensors = read_tensors(path)
    names = [t.name for t in tensors]
    plan = tensor_plan(spec.target, 49152, "target", spec)
    assert names == [n for n, _, _ in plan]
    assert "blk.0.attn_q_norm.weight" not in names and "output.weight" in names  # llama, untied
    n_blocks = spec.target.n_blocks
    for t in tensors:
        want = "f32" if t.name.endswith("norm.weight") else q4_k_m_type(t.name, n_blocks)
        assert t.tensor_type.name.lower() == want, t.name
        if t.name.startswith(f"blk.{n_blocks - 1}.") and not t.name.endswith("norm.weight"):
            assert not np.asarray(t.data).any(), t.name  # a block past the source's: zeros
    fields = read_fields(path)
    assert fields["general.architecture"] == "llama"
    assert fields["llama.attention.key_length"] == 32
    assert fields["llama.rope.dimension_count"] == 32
    eps = fields["llama.attention.layer_norm_rms_epsilon"]
    assert eps == pytest.approx(src.rms_eps * 64 / 256, rel=1e-6)
    draft = tmp_path / "draft.gguf"
    write_embedded(draft, src, spec, "draft")
    d_types = {t.name: t.tensor_type.name for t in read_tensors(draft)}
    assert "output.weight" in d_types and not src.tied  # tied only when the source is (SmolLM2: below)
    assert {v for k, v in d_types.items() if not k.endswith("norm.weight")} == {"Q8_0"}
    # Quantised by llama.cpp and still the source's model: greedy agreement with the F32 source.
    prompt = np.random.default_rng(5).integers(0, 49152, size=8).tolist()
    want = _greedy(source, prompt, 32)
    for p in (path, draft):
        got = _logits(p, prompt + want[:-1])[len(prompt) - 1 :].argmax(axis=1)
        assert (got == np.asarray(want)).mean() >= 0.75, p


def test_the_32b_plan_is_the_cards_bytes() -> None:
    """The card32b target reads the card's weights but for the vocabulary (49,152 tokens, not 151,936)."""
    plan = tensor_plan(EMBED_32B.target, 49152, "target", EMBED_32B)
    assert len(plan) == 3 + 9 * 64
    from embed import row_bytes, rows_of

    total = sum(rows_of(s) * row_bytes(q, s[-1]) for _, s, q in plan)
    vocab_bytes = sum(rows_of(s) * row_bytes(q, s[-1]) for n, s, q in plan if n in ("token_embd.weight",
                                                                                        "output.weight"))
    card = 19_762_149_024  # the real Qwen3-32B-Q4_K_M file (tests/test_synthetic.py checks the card writer)
    per_token = vocab_bytes / 49152
    assert abs(total + per_token * (151936 - 49152) - card) / card < 0.001


@pytest.mark.parametrize(
    ("big", "message"),
    [
        (Shape(n_embd=256, n_head=8, n_head_kv=2, head_dim=24, n_ff=256, n_blocks=6), "not a multiple"),
        (Shape(n_embd=256, n_head=3, n_head_kv=3, head_dim=32, n_ff=256, n_blocks=6), "KV heads"),
        (Shape(n_embd=256, n_head=8, n_head_kv=2, head_dim=32, n_ff=64, n_blocks=6), "smaller than the source"),
        (Shape(n_embd=256, n_head=8, n_head_kv=2, head_dim=32, n_ff=256, n_blocks=3), "smaller than the source"),
    ],
)
def test_shapes_that_cannot_hold_the_source(big: Shape, message: str) -> None:
    src = Shape(n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_blocks=4)
    with pytest.raises(ValueError, match=message):
        place(src, 16, big)
    with pytest.raises(ValueError, match="full RoPE"):
        place(src, 8, WIDE.target)


@pytest.mark.slow
def test_cli_refuses_a_source_it_cannot_embed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    qwen3 = tmp_path / "qwen3.gguf"
    write_pair(qwen3, tmp_path / "d.gguf", TINY)  # qwen3 architecture (per-head Q/K norms)
    assert main(["--size", "tiny", "--source", str(qwen3), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(qwen3) in err and "llama" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert main(["--source", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "out")]) == 2


@pytest.mark.slow
def test_a_draft_source_gives_the_draft_its_weights_and_must_be_the_same_model(
        tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--draft-source: the target from the source, the draft from another file of the same model (the GPU's
    weaker draft is its Q2_K requantization; here a Q4_0 one), under its own --draft-prefix: byte for byte what each
    file embeds alone. A file of another shape is refused in one line, exit 2."""
    q4 = tmp_path / "q4.gguf"
    quantize(source, q4, "Q4_0")
    out = tmp_path / "out"
    assert main(["--size", "tiny", "--source", str(source), "--draft-source", str(q4), "--out", str(out),
                 "--draft-prefix", "speaks-dq4_0-"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["speaks-dq4_0-draft.gguf", "speaks-target.gguf"]
    write_embedded(tmp_path / "same-target.gguf", read_source(source), EMBED_TINY, "target")
    write_embedded(tmp_path / "own-draft.gguf", read_source(q4), EMBED_TINY, "draft")
    write_embedded(tmp_path / "source-draft.gguf", read_source(source), EMBED_TINY, "draft")
    def contents(path: Path) -> dict[str, bytes]:
        return {t.name: t.data.tobytes() for t in read_tensors(path)}

    assert contents(out / "speaks-target.gguf") == contents(tmp_path / "same-target.gguf")
    assert contents(out / "speaks-dq4_0-draft.gguf") == contents(tmp_path / "own-draft.gguf")
    assert contents(out / "speaks-dq4_0-draft.gguf") != contents(tmp_path / "source-draft.gguf")
    other = tmp_path / "other.gguf"
    write_pair(other, tmp_path / "d.gguf", replace(SOURCE, n_embd=128, n_ff=256))
    capsys.readouterr()
    assert main(["--size", "tiny", "--source", str(source), "--draft-source", str(other), "--out",
                 str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(other) in err and "shape" in err


@pytest.mark.slow
def test_smollm2_in_wide_shapes(tmp_path: Path, smollm2_path: Path) -> None:
    """The real source: the F32 embedding matches llama.cpp's own F16 dequantisation of SmolLM2 (F16 rounding
    apart), and the Q4_K_M / Q8_0 pair writes the source's language (the GPU pair is the same code at card32b)."""
    src = read_source(smollm2_path)
    exact = replace(EMBED_TINY, target_mix="f32", draft_type="f32")
    write_embedded(tmp_path / "f32.gguf", src, exact, "target")
    quantize(smollm2_path, tmp_path / "ref-f16.gguf", "F16")
    with LlamaModel(smollm2_path, n_ctx=256, device_top_k=0, n_batch=256, n_threads=1) as m:
        prompt = m.tokenize("<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n"
                            "<|im_start|>assistant\n", parse_special=True)
    want = _logits(tmp_path / "ref-f16.gguf", prompt)
    got = _logits(tmp_path / "f32.gguf", prompt)
    assert np.abs(got - want).max() < 0.03 * want.std()  # F16 weights vs F32: measured 0.053 of std 7.1
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()
    write_embedded(tmp_path / "t.gguf", src, EMBED_TINY, "target")
    write_embedded(tmp_path / "d.gguf", src, EMBED_TINY, "draft")
    assert src.tied and "output.weight" not in {t.name for t in read_tensors(tmp_path / "d.gguf")}
    reference = _greedy(smollm2_path, prompt, 48)
    for p in (tmp_path / "t.gguf", tmp_path / "d.gguf"):
        rows = _logits(p, prompt + reference[:-1])[len(prompt) - 1 :]
        assert (rows.argmax(axis=1) == np.asarray(reference)).mean() >= 0.7, p
