"""Tokenizer verdicts from headers: a real incompatible pair and generated vocabularies."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import LlamaFileType, TokenType

from localspec.models import demo
from localspec.models.compat import check_files
from localspec.status import Status
from tests.helpers_vocab import N_TOKENS, base_vocab, write_vocab


@pytest.fixture(scope="module")
def gemma(demo_home: Path) -> Path:
    """The demo target (Gemma 3 270M Q4_K_M), assembled once per session by conftest's demo_home."""
    return demo_home / "cache" / "demo" / demo.TARGET_FILE


def _pair(tmp_path: Path, **draft_changes: object):
    target = write_vocab(tmp_path / "target.gguf", ftype=LlamaFileType.MOSTLY_Q4_K_M)
    draft = write_vocab(tmp_path / "draft.gguf", **draft_changes)
    return check_files(target, draft)


def _fields(verdict, level: Status) -> list[str]:
    return [f.field for f in verdict.findings if f.level == level]


def test_gemma_vs_smollm2_is_incompatible_and_says_why(gemma: Path, smollm2_path: Path) -> None:
    v = check_files(gemma, smollm2_path)
    assert v.label == "incompatible" and not v.compatible
    assert "tokenizer models differ: target 'llama', draft 'gpt2'" in v.reason
    assert "SmolLM2-135M-Instruct.Q4_1.gguf cannot draft for gemma-3-270m-q4_k_m.gguf" in v.reason


def test_a_model_is_compatible_with_itself(gemma: Path) -> None:
    v = check_files(gemma, gemma)
    assert v.compatible
    assert _fields(v, Status.FAIL) == []
    # only the seeds' quantization advice remains: the same file as its own draft is too big and below 8 bit
    assert set(_fields(v, Status.WARN)) == {"draft quantization", "draft size"}


def test_identical_generated_vocabs_are_compatible(tmp_path: Path) -> None:
    v = _pair(tmp_path)
    assert v.label == "compatible", v.findings


def test_one_changed_token_names_the_id_and_both_texts(tmp_path: Path) -> None:
    tokens = base_vocab()["tokens"]
    tokens[137] = "changed"
    v = _pair(tmp_path, tokens=tokens)
    assert v.label == "incompatible"
    assert "token id 137 differs: target 'tok137', draft 'changed'" in v.reason


def test_trailing_padding_ids_are_tolerated(tmp_path: Path) -> None:
    base = base_vocab()
    v = _pair(tmp_path, tokens=base["tokens"][: N_TOKENS - 100], types=base["types"][: N_TOKENS - 100])
    assert v.label == "compatible"
    assert _fields(v, Status.INFO) == ["vocab size"]


def test_more_than_128_extra_ids_is_another_vocabulary(tmp_path: Path) -> None:
    base = base_vocab()
    v = _pair(tmp_path, tokens=base["tokens"][:100], types=base["types"][:100])
    assert v.label == "incompatible" and "vocab sizes differ by 200" in v.reason


def test_bos_id_that_differs_is_incompatible(tmp_path: Path) -> None:
    v = _pair(tmp_path, bos=2)
    assert v.label == "incompatible" and "BOS id differs: target 1, draft 2" in v.reason


def test_add_bos_that_differs_is_incompatible(tmp_path: Path) -> None:
    v = _pair(tmp_path, add_bos=False)
    assert v.label == "incompatible" and "add_bos differs: target True, draft False" in v.reason


def test_tokenizer_model_that_differs_is_incompatible(tmp_path: Path) -> None:
    v = _pair(tmp_path, model="llama", merges=None)
    assert v.label == "incompatible" and "tokenizer models differ" in v.reason


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"merges": [f"t o{i}" for i in range(49)] + ["x y"]}, "merges"),
        ({"pre": "qwen2"}, "pre-tokenizer"),
        ({"template": "other"}, "chat template"),
        ({"types": [TokenType.CONTROL] * 4 + [TokenType.NORMAL] * (N_TOKENS - 4)}, "token types"),
        ({"eos": 0}, "EOS id"),
        ({"ftype": LlamaFileType.MOSTLY_Q4_K_M}, "draft quantization"),
    ],
)
def test_differences_that_only_warn(tmp_path: Path, changes: dict, field: str) -> None:
    v = _pair(tmp_path, **changes)
    assert v.label == "compatible with warnings", v.findings
    assert _fields(v, Status.WARN) == [field]
    finding = next(f for f in v.findings if f.field == field)
    assert finding.why  # every finding explains itself


def test_merge_difference_names_the_merge(tmp_path: Path) -> None:
    v = _pair(tmp_path, merges=[f"t o{i}" for i in range(49)] + ["x y"])
    assert "merge 49 differs: target 't o49', draft 'x y'" in v.findings[0].message


def test_target_not_int4_and_big_draft_warn(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType as Q

    t = write_vocab(
        tmp_path / "t.gguf", ftype=LlamaFileType.MOSTLY_Q8_0, tensors=[("blk.0.w", (256, 64), Q.Q8_0)]
    )
    d = write_vocab(tmp_path / "d.gguf", tensors=[("blk.0.w", (256, 16), Q.Q8_0)])
    v = check_files(t, d)
    assert set(_fields(v, Status.WARN)) == {"target quantization", "draft size"}


def _fim_vocab(names: tuple[str, str, str]) -> list[str]:
    tokens = base_vocab()["tokens"]
    return [*tokens[:3], *names, *tokens[6:]]


@pytest.mark.slow  # writes a tiny pair of its own (seconds)
def test_fim_tokens_shared_by_both_models_are_said_so(tiny_fim_pair) -> None:
    from tests.helpers_serve import FIM_TOKENS

    v = check_files(*tiny_fim_pair)
    fim = [f for f in v.findings if f.field == "FIM tokens"]
    pre, suf, mid = FIM_TOKENS
    assert len(fim) == 1 and fim[0].level == Status.INFO
    assert f"pre {pre}, suf {suf}, mid {mid}" in fim[0].message


def test_fim_tokens_numbered_differently_in_the_draft_warn(tmp_path: Path) -> None:
    names = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    target = write_vocab(tmp_path / "target.gguf", tokens=_fim_vocab(names))
    draft = write_vocab(tmp_path / "draft.gguf", tokens=_fim_vocab(("<not_fim>", *names[1:])))
    v = check_files(target, draft)
    fim = [f for f in v.findings if f.field == "FIM tokens"]
    assert fim and fim[0].level == Status.WARN and "pre 3, suf 4, mid 5" in fim[0].message
    # (the differing token text itself is the blocking finding; the FIM line says what it means for /infill)
    assert "token text" in _fields(v, Status.FAIL)


def test_no_fim_finding_without_fim_tokens_in_the_target(gemma: Path, smollm2_path: Path) -> None:
    for model in (gemma, smollm2_path):  # neither has FIM tokens
        assert not [f for f in check_files(model, model).findings if f.field == "FIM tokens"]
