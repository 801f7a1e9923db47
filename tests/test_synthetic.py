"""The synthetic pair generator: file layout, bit-identical shared tensors, agreement through llama.cpp."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")  # noqa: F841 -- import before numpy (docs/architecture.md: import order)

import gguf  # noqa: E402
import numpy as np  # noqa: E402
from synthetic import TINY, TINY_HIGH, PairSpec, measure_agreement, write_pair  # noqa: E402

from tests.helpers_gguf import read_fields, read_tensors  # noqa: E402


def _pair(root: Path, spec: PairSpec, name: str) -> tuple[Path, Path]:
    target, draft = root / f"{name}-target.gguf", root / f"{name}-draft.gguf"
    write_pair(target, draft, spec)
    return target, draft


@pytest.fixture(scope="module")
def f32_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _pair(tmp_path_factory.mktemp("syn"), TINY, "tiny")


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.asarray(t.data) for t in read_tensors(path)}


@pytest.mark.slow
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


@pytest.mark.slow
def test_metadata_and_determinism(tmp_path: Path, f32_pair: tuple[Path, Path]) -> None:
    again, _ = _pair(tmp_path, TINY, "again")
    assert again.read_bytes() == f32_pair[0].read_bytes()  # same seed, same bytes
    f = read_fields(f32_pair[0])
    assert f["general.architecture"] == "qwen3"
    assert f["qwen3.block_count"] == TINY.target_blocks
    assert len(f["tokenizer.ggml.tokens"]) == 49152  # type: ignore[arg-type]
    assert len(f["tokenizer.ggml.merges"]) > 40000  # type: ignore[arg-type]
    assert "tokenizer.chat_template" in f
    # Zero-mean weights (nibbles 1..15): a -0.5 d bias makes every position pick the same token.
    w = _tensors(f32_pair[0])["blk.0.attn_q.weight"]
    assert abs(float(w.mean())) < 0.05 * TINY.scale * 4.3


@pytest.mark.slow
def test_q4_0_is_the_same_model(tmp_path: Path) -> None:
    """Q4_0 bytes dequantise (ggml's nibble order) to exactly the F32 pair's values."""
    f32, _ = _pair(tmp_path, TINY, "f32")
    q4, _ = _pair(tmp_path, replace(TINY, wtype="q4_0"), "q4")
    for a, b in zip(read_tensors(f32), read_tensors(q4), strict=True):
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
    from localspec.llama.model import LlamaModel

    for path in f32_pair:
        with LlamaModel(path, n_ctx=512, device_top_k=0, n_threads=1) as m:
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


# -- the card's pair: Qwen3-32B-shaped Q4_K_M target, Qwen3-0.6B-shaped Q8_0 draft ----------------------------------

from synthetic import (  # noqa: E402
    CARD_32B,
    CARD_NOISE_70,
    CARD_NOISE_85,
    CARD_TINY,
    CardSpec,
    card_tensor_plan,
    write_card_model,
)


def _card(root: Path, spec: CardSpec, name: str) -> tuple[Path, Path]:
    target, draft = root / f"{name}-target.gguf", root / f"{name}-draft.gguf"
    write_card_model(target, spec, "target")
    write_card_model(draft, spec, "draft")
    return target, draft


@pytest.fixture(scope="module")
def card_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _card(tmp_path_factory.mktemp("card"), CARD_TINY, "q")


@pytest.fixture(scope="module")
def card_pair_f32(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _card(tmp_path_factory.mktemp("card32"), replace(CARD_TINY, target_mix="f32", draft_type="f32"), "f")


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in read_tensors(path)}


def test_card_full_size_is_the_real_files_size() -> None:
    """At full size the plan is Qwen3-32B Q4_K_M's and Qwen3-0.6B Q8_0's: the real Q4_K_M file is
    19,762,149,024 B, tokenizer metadata included (~6 MB); 65 Q6_K tensors (output, 32 attn_v, 32 ffn_down)."""
    target = card_tensor_plan(CARD_32B, 151_936, "target")
    draft = card_tensor_plan(CARD_32B, 151_936, "draft")
    size = sum(synthetic_nbytes(shape, q) for _, shape, q in target)
    assert 19_762_149_024 - 8_000_000 < size < 19_762_149_024
    assert sum(q == "q6_k" for _, _, q in target) == 65
    assert len(target) == 3 + 64 * 11 and len(draft) == 2 + 28 * 11  # the draft is tied: no output.weight
    assert {q for n, _, q in draft if not n.endswith("norm.weight")} == {"q8_0"}
    assert 630_000_000 < sum(synthetic_nbytes(shape, q) for _, shape, q in draft) < 640_000_000


def synthetic_nbytes(shape: tuple[int, ...], qtype: str) -> int:
    import synthetic

    return synthetic._nbytes(shape, qtype)  # type: ignore[arg-type]


@pytest.mark.slow
def test_card_quantized_files_hold_exactly_the_f32_model(card_pair, card_pair_f32) -> None:
    """K-quant and Q8_0 blocks written directly dequantize (gguf's reference code) to the F32 twin's values."""
    for quant, f32 in zip(card_pair, card_pair_f32, strict=True):
        ref = {t.name: t for t in read_tensors(f32)}
        checked = set()
        for t in read_tensors(quant):
            if t.name.startswith(("blk.1.", "blk.2.")):
                continue  # the same noise tensors as blk.3 (one random tensor per role and type)
            rows = np.asarray(t.data)[:2048]  # the embeddings: enough rows for every code value
            deq = gguf.quants.dequantize(rows, t.tensor_type)
            want = np.asarray(ref[t.name].data)[: len(deq)]
            assert np.array_equal(deq.reshape(want.shape), want), t.name
            checked.add(t.tensor_type.name)
        assert checked >= ({"Q4_K", "Q6_K", "F32"} if "target" in quant.name else {"Q8_0", "F32"})


@pytest.mark.slow
def test_card_target_is_shared_by_every_level_and_drafts_differ_only_in_the_embedding(tmp_path, card_pair) -> None:
    target, draft = card_pair
    other_target, other_draft = _card(tmp_path, replace(CARD_TINY, noise=CARD_NOISE_70), "other")
    assert other_target.read_bytes() == target.read_bytes()  # the target ignores the draft's noise
    a, b = _tensors(draft), _tensors(other_draft)
    assert [n for n in a if not np.array_equal(a[n], b[n])] == ["token_embd.weight"]


def test_card_spec_validation() -> None:
    with pytest.raises(ValueError, match="at least as wide"):
        replace(CARD_TINY, draft=replace(CARD_TINY.draft, n_embd=1024)).validate()
    with pytest.raises(ValueError, match="multiple of 256"):
        replace(CARD_TINY, target=replace(CARD_TINY.target, n_ff=1000)).validate()
    with pytest.raises(ValueError, match="code dimension"):
        replace(CARD_TINY, draft=replace(CARD_TINY.draft, n_ff=64)).validate()


@pytest.mark.slow
def test_card_types_are_llama_cpp_quantizers(tmp_path, card_pair, card_pair_f32) -> None:
    """The direct writer's tensor names and types equal what llama.cpp's own quantizer makes of the F32 twin:
    Q4_K_M for the target, Q8_0 for the tied draft (llama_tensor_get_type, src/llama-quant.cpp)."""
    from localspec.llama.backend import quantize

    for ours, f32, ftype in zip(card_pair, card_pair_f32, ("Q4_K_M", "Q8_0"), strict=True):
        theirs = tmp_path / f"{ftype}.gguf"
        quantize(f32, theirs, ftype)
        assert _types(ours) == _types(theirs), ftype
        file_type = [read_fields(p)["general.file_type"] for p in (ours, theirs)]
        assert file_type[0] == file_type[1], ftype


@pytest.mark.slow
def test_card_pair_loads_and_runs_in_llama_cpp(card_pair) -> None:
    """The qwen3 loader takes both files (it refuses a missing or an extra tensor) and the text is not
    degenerate; forcing flash attention off or on changes nothing the argmax sees."""
    from localspec.errors import ModelLoadError
    from localspec.llama.model import LlamaModel
    text = "The quick brown fox jumps over the lazy dog while it rains in Spain on Tuesday."
    for path in card_pair:
        argmax = []
        for fa in ("off", "on"):
            with LlamaModel(path, n_ctx=512, device_top_k=0, n_threads=1, flash_attn=fa) as m:
                logits = m.decode(m.tokenize(text), 0, all_logits=True).logits
                assert logits is not None and np.isfinite(logits).all()
                argmax.append(logits.argmax(axis=1))
        assert np.array_equal(*argmax)
        assert len(set(argmax[0].tolist())) > len(argmax[0]) // 2
    with pytest.raises(ModelLoadError, match="flash attention 'yes'"):
        LlamaModel(card_pair[0], n_ctx=512, device_top_k=0, n_threads=1, flash_attn="yes")


@pytest.mark.slow
def test_card_agreement_levels(tmp_path) -> None:
    """The two levels of the GPU pair land in their bands on the scaled-down spec (per-position greedy agreement;
    the bench's accepted/drafted at k = 6 is lower: ~85% and ~70% need ~95.5% and ~90%); no noise, ~no
    disagreement."""
    rates = {}
    for noise in (0.0, CARD_NOISE_85, CARD_NOISE_70):
        r = measure_agreement(*_card(tmp_path, replace(CARD_TINY, noise=noise), f"n{noise:g}"), n_prompts=6)
        assert r["distinct"] > 0.5, r  # greedy text is not a short cycle
        rates[noise] = r["greedy"]
    assert rates[0.0] >= 0.97, rates
    assert 0.92 <= rates[CARD_NOISE_85] <= 0.99, rates
    assert 0.84 <= rates[CARD_NOISE_70] <= 0.95, rates
    assert rates[0.0] > rates[CARD_NOISE_85] > rates[CARD_NOISE_70], rates


@pytest.mark.slow
def test_card_cli_writes_one_model_and_the_kernel_mixes(tmp_path, capsys) -> None:
    """run.sh writes the card's target once and a draft per level; kernels.sh one target per weight type."""
    from synthetic import main

    assert main(["--size", "card-tiny", "--only", "draft", "--noise", "0.05", "--out", str(tmp_path),
                 "--prefix", "c-", "--draft-prefix", "c-n0.05-"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["c-n0.05-draft.gguf"]
    assert capsys.readouterr().out.strip() == str(tmp_path / "c-n0.05-draft.gguf")
    for mix, ggml_type in (("q4_0", "Q4_0"), ("q6_k", "Q6_K")):
        assert main(["--size", "card-tiny", "--only", "target", "--mix", mix, "--target-blocks", "2",
                     "--out", str(tmp_path), "--prefix", f"k-{mix}-"]) == 0
        types = _types(tmp_path / f"k-{mix}-target.gguf")
        assert {t for n, t in types.items() if not n.endswith("norm.weight")} == {ggml_type}
        assert sum(n.endswith("ffn_down.weight") for n in types) == 2
    # Every mix holds the same values (the Q4_0 bytes too: ggml's nibble order).
    q4_0, q6_k = (read_tensors(tmp_path / f"k-{mix}-target.gguf") for mix in ("q4_0", "q6_k"))
    for a, b in zip(q4_0, q6_k, strict=True):
        if a.name.startswith("blk."):
            assert np.array_equal(gguf.quants.dequantize(a.data, a.tensor_type),
                                  gguf.quants.dequantize(b.data, b.tensor_type)), a.name


# -- hybrid pairs: Qwen3.5/3.6-shaped (Gated DeltaNet + full attention), with an MTP block ---------------------------

from synthetic import HYBRID_27B, HYBRID_35B_A3B, HYBRID_MOE_TINY, HYBRID_TINY, hybrid_tensor_plan  # noqa: E402


@pytest.mark.slow
def test_hybrid_layout(hybrid_pair: tuple[Path, Path]) -> None:
    """qwen35's tensors and keys: blocks alternate Gated DeltaNet / full attention, the MTP block comes last, and
    the draft's blocks and global tensors are the target's, byte for byte."""
    target, draft = (_tensors(p) for p in hybrid_pair)
    assert "blk.0.ssm_conv1d.weight" in target and "blk.0.attn_q.weight" not in target
    assert "blk.1.attn_q.weight" in target and "blk.1.ssm_a" not in target
    assert "blk.4.nextn.eh_proj.weight" in target and "blk.4.attn_q.weight" in target  # the MTP block
    assert not any(n.startswith(("blk.2.", "blk.4.")) for n in draft)
    for name, data in draft.items():
        assert target[name].tobytes() == data.tobytes(), name
    f = read_fields(hybrid_pair[0])
    assert f["general.architecture"] == "qwen35"
    assert f["qwen35.block_count"] == 5 and f["qwen35.nextn_predict_layers"] == 1
    assert f["qwen35.rope.dimension_sections"].tolist() == [2, 1, 1, 0]  # type: ignore[attr-defined]
    assert "qwen35.nextn_predict_layers" not in read_fields(hybrid_pair[1])


def test_hybrid_27b_shape_and_mix() -> None:
    """The GPU preset's tensors: Qwen3.5-27B's 64 trunk blocks (48 Gated DeltaNet) and one MTP block, in the Q4_K_M
    mix, about the real Q4_K_M file's size with the Qwen2 vocabulary."""
    plan = hybrid_tensor_plan(HYBRID_27B, 151_936, "target")
    assert sum(n.endswith(".ssm_conv1d.weight") for n, _, _ in plan) == 48
    assert sum(n.endswith(".attn_q.weight") for n, _, _ in plan) == 17  # 16 in the trunk + the MTP block
    types = {n: t for n, _, t in plan}
    assert types["output.weight"] == "q6_k" and types["blk.10.attn_qkv.weight"] == "q4_k"
    assert types["blk.0.ssm_a"] == "f32" and types["blk.0.ssm_conv1d.weight"] == "f32"
    size = sum(synthetic_nbytes(s, t) for _, s, t in plan)
    assert 15.5e9 < size < 17.5e9, size


@pytest.mark.slow
def test_hybrid_moe_layout(hybrid_moe_pair: tuple[Path, Path]) -> None:
    """qwen35moe's tensors and keys (src/models/qwen35moe.cpp): every FFN, the MTP block's too, is a router, routed
    experts in one 3-D tensor each and a shared expert behind a vector gate, in the shapes the loader asks for."""
    import gguf as g

    f = read_fields(hybrid_moe_pair[0])
    assert f["general.architecture"] == "qwen35moe"
    assert (f["qwen35moe.expert_count"], f["qwen35moe.expert_used_count"]) == (8, 2)
    assert (f["qwen35moe.expert_feed_forward_length"], f["qwen35moe.expert_shared_feed_forward_length"]) == (32, 32)
    shapes = {t.name: (tuple(int(x) for x in t.shape), t.tensor_type) for t in g.GGUFReader(hybrid_moe_pair[0]).tensors}
    e = HYBRID_MOE_TINY.target.n_embd
    for b in (0, 1, 4):  # a Gated DeltaNet block, an attention block, the MTP block
        assert shapes[f"blk.{b}.ffn_gate_inp.weight"] == ((e, 8), g.GGMLQuantizationType.F32)  # ggml order
        assert shapes[f"blk.{b}.ffn_up_exps.weight"][0] == (e, 32, 8)
        assert shapes[f"blk.{b}.ffn_down_exps.weight"][0] == (32, e, 8)
        assert shapes[f"blk.{b}.ffn_gate_inp_shexp.weight"] == ((e,), g.GGMLQuantizationType.F32)
        assert f"blk.{b}.ffn_up.weight" not in shapes
    assert "blk.4.nextn.eh_proj.weight" in shapes


def test_hybrid_35b_a3b_shape_and_mix() -> None:
    """The MoE GPU preset: Qwen3.5/3.6-35B-A3B's 40 trunk blocks (30 Gated DeltaNet), 256 experts of 512 in every
    FFN, one MTP block, in the Q4_K_M mix (routers in F32, the experts' down projections Q6_K in the quantizer's
    use_more_bits layers), about the real Q4_K_M file's size."""
    plan = hybrid_tensor_plan(HYBRID_35B_A3B, 151_936, "target")
    assert sum(n.endswith(".ssm_conv1d.weight") for n, _, _ in plan) == 30
    assert sum(n.endswith(".attn_q.weight") for n, _, _ in plan) == 11  # 10 in the trunk + the MTP block
    assert sum(n.endswith(".ffn_gate_exps.weight") for n, _, _ in plan) == 41
    types, shapes = {n: t for n, _, t in plan}, {n: s for n, s, _ in plan}
    assert shapes["blk.7.ffn_down_exps.weight"] == (256, 2048, 512)
    assert types["blk.0.ffn_gate_inp.weight"] == "f32" and types["blk.0.ffn_up_exps.weight"] == "q4_k"
    assert types["blk.0.ffn_down_exps.weight"] == "q6_k" and types["blk.6.ffn_down_exps.weight"] == "q4_k"
    size = sum(synthetic_nbytes(s, t) for _, s, t in plan)
    assert 20e9 < size < 22.5e9, size


def test_hybrid_spec_validation() -> None:
    with pytest.raises(ValueError):
        replace(HYBRID_TINY, wtype="q4_k_m").validate()  # 64-wide rows are no K-quant super-blocks
    with pytest.raises(ValueError):
        replace(HYBRID_TINY, target=replace(HYBRID_TINY.target, rope_dims=6)).validate()
    with pytest.raises(ValueError):
        replace(HYBRID_TINY, wtype="q6_k").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="experts"):
        replace(HYBRID_MOE_TINY, target=replace(HYBRID_MOE_TINY.target, n_expert_used=9)).validate()
    with pytest.raises(ValueError, match="n_ff_exp"):
        replace(HYBRID_MOE_TINY, target=replace(HYBRID_MOE_TINY.target, n_ff_exp=48)).validate()  # not Q4_0 rows


@pytest.mark.slow
def test_hybrid_loads_decodes_and_agrees(hybrid_pair: tuple[Path, Path]) -> None:
    """Through the real llama.cpp: a hybrid model with (target) and without (draft) MTP layers, finite, context-
    dependent logits, and a draft that agrees with the target most of the time but not always."""
    import llama_cpp as L

    from localspec.llama.model import LlamaModel

    for path, nextn in zip(hybrid_pair, (1, 0), strict=True):
        with LlamaModel(path, n_ctx=512, device_top_k=0, n_threads=1) as m:
            assert L.llama_model_is_hybrid(m.model) and L.llama_model_n_layer_nextn(m.model) == nextn
            tokens = m.tokenize("The quick brown fox jumps over the lazy dog while it rains in Spain on Tuesday.")
            logits = m.decode(tokens, 0, all_logits=True).logits
            assert np.isfinite(logits).all()
            assert len(set(logits.argmax(axis=1).tolist())) > len(tokens) // 2
    r = measure_agreement(*hybrid_pair, n_prompts=6, gen_len=48)
    assert r["distinct"] > 0.3, r
    assert 0.5 <= r["greedy"] <= 0.95, r


@pytest.mark.slow
def test_recurrent_rollback_in_llama_cpp(hybrid_pair: tuple[Path, Path]) -> None:
    """What localspec's rewind relies on, through llama.cpp's own API (bench/repro_recurrent_rollback.py): rolling
    back fewer tokens than the last decode held is bit-exact, and so is restoring a recurrent-state checkpoint.
    Rolling back all of them (or any after a one-token decode) reports success and is wrong: the upstream bug
    `llama.recurrent` guards against (docs/upstream.md). If this part fails, llama.cpp fixed it: relax the guard."""
    from repro_recurrent_rollback import BATCH, Runner, run

    results = {what: (removed, right) for what, removed, right in run(Runner(hybrid_pair[0], 1, quiet=False), BATCH)}
    for j in range(BATCH):
        assert results[f"{BATCH} in one decode, roll back {j}"] == (True, True), j
    assert results[f"{BATCH} in one decode, roll back {BATCH}"] == (True, False)
    assert results["3 one-token decodes, roll back 1"] == (True, False)
    assert results["a second rollback before a decode"][0] is False
    assert results["a rollback deeper than n_rs_seq"][0] is False
    checkpoint = next(v for k, v in results.items() if k.startswith("checkpoint"))
    assert checkpoint == (True, True)


@pytest.mark.slow
def test_hybrid_cli(tmp_path: Path) -> None:
    from synthetic import main

    assert main(["--size", "hybrid-tiny", "--only", "target", "--mtp-noise", "0.2", "--out", str(tmp_path),
                 "--prefix", "h-"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["h-target.gguf"]
    assert "0.2" in read_fields(tmp_path / "h-target.gguf")["general.name"]  # type: ignore[operator]


@pytest.mark.slow
def test_the_repeat_target_and_its_copying_drafter_from_the_cli(tmp_path: Path) -> None:
    """--repeat-p writes the repeating target (tied: no output.weight); --copy-drafter its drafter, DSpark's with the
    Markov and confidence heads; a copying drafter without --repeat-p is a usage error, nothing written."""
    from synthetic import main

    args = ["--size", "hybrid-tiny", "--repeat-p", "0.8", "--out", str(tmp_path), "--prefix", "r-"]
    assert main([*args, "--only", "target"]) == 0 and main([*args, "--copy-drafter", "dspark"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r-copy-dspark.gguf", "r-target.gguf"]
    assert "output.weight" not in {t.name for t in read_tensors(tmp_path / "r-target.gguf")}
    drafter = {t.name for t in read_tensors(tmp_path / "r-copy-dspark.gguf")}
    assert {"markov_w1.weight", "conf_proj.bias", "fc.weight"} <= drafter
    assert read_fields(tmp_path / "r-copy-dspark.gguf")["general.architecture"] == "dflash"
    with pytest.raises(SystemExit) as usage:
        main(["--size", "hybrid-tiny", "--copy-drafter", "dflash", "--out", str(tmp_path / "none")])
    assert usage.value.code == 2 and not (tmp_path / "none").exists()
