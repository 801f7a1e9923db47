"""models.toml: the shipped file parses, user overrides, strict errors with file and line, default pair."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from localspec.errors import ConfigError
from localspec.models import registry

GOOD = """
[[pair]]
name = "p1"
description = "a pair"
n_ctx = 4096
n_draft = 5

[pair.target]
repo = "org/big-GGUF"
file = "big-Q4_K_M.gguf"
quant = "Q4_K_M"
family = "f"
license = "apache-2.0"
size = 1000
sha256 = "{sha}"

[pair.draft]
repo = "org/small-GGUF"
file = "small-Q8_0.gguf"
quant = "Q8_0"
family = "f"
license = "apache-2.0"
approx_gb = 0.5
""".replace("{sha}", "a" * 64)


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    return tmp_path


def _write(home: Path, text: str) -> Path:
    path = home / "models.toml"
    path.write_text(text)
    return path


def test_shipped_models_toml_parses_and_every_repo_is_cited() -> None:
    path = registry.shipped_path()
    pairs = registry.parse_file(path)
    assert pairs and any(p.recommended for p in pairs)
    text = path.read_text()
    for p in pairs:
        assert p.target is not None and (p.draft is not None or p.drafter in ("mtp", "lookup"))
        for m in (x for x in (p.target, p.draft) if x is not None):
            assert m.file.endswith(".gguf")
            # each model block is preceded by a comment citing its Hugging Face page
            block = text[: text.index(f'repo = "{m.repo}"')].rsplit("[pair.", 1)[1]
            assert "# https://huggingface.co/" in block, m.repo


def test_demo_is_always_listed_and_default_until_set(home: Path) -> None:
    pairs = registry.load_pairs()
    assert "demo" in pairs and pairs["demo"].builtin
    assert registry.default_pair_name() == "demo"


def test_user_file_adds_and_overrides(home: Path) -> None:
    shipped = registry.parse_file(registry.shipped_path())[0]
    _write(
        home,
        GOOD + GOOD.replace('name = "p1"', f'name = "{shipped.name}"').replace("n_ctx = 4096", "n_ctx = 512"),
    )
    pairs = registry.load_pairs()
    assert pairs["p1"].target.size == 1000 and pairs["p1"].draft.expected_bytes == 500_000_000
    assert pairs[shipped.name].n_ctx == 512 and pairs[shipped.name].source.endswith("models.toml")


def test_default_pair_round_trip(home: Path) -> None:
    _write(home, GOOD)
    registry.set_default_pair("p1")
    assert registry.default_pair_name() == "p1"
    with pytest.raises(ConfigError, match="unknown pair 'nope'"):
        registry.set_default_pair("nope")
    (home / "models.toml").unlink()
    with pytest.raises(ConfigError, match="default pair 'p1' is not defined any more"):
        registry.default_pair_name()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.replace("n_draft = 5", 'n_draft = 5\ncolour = "red"'),
            r"models.toml:7: unknown key 'colour'",
        ),
        (lambda t: t.replace('quant = "Q8_0"\n', ""), r"models.toml:\d+: missing key 'quant'"),
        (lambda t: t + t, r"models.toml:\d+: duplicate pair name 'p1' \(first at line 3\)"),
        (lambda t: t.replace("n_ctx = 4096", 'n_ctx = "big"'), r"models.toml:5: n_ctx = 'big': expected int"),
        (
            lambda t: t.replace("size = 1000", "size = 1000\nsizes = 3"),
            r"models.toml:15: unknown key 'sizes'",
        ),
        (lambda t: t.replace('repo = "org/small-GGUF"', 'repo = "small"'), r"repo 'small' is not OWNER/NAME"),
        (lambda t: t.replace('"' + "a" * 64 + '"', '"xyz"'), r"models.toml:15: sha256 must be 64"),
        (lambda t: t.replace('name = "p1"', 'name = "demo"'), r"reserved for a built-in demo"),
        (lambda t: t.replace('name = "p1"', 'name = "demo-chat"'), r"'demo-chat' is reserved"),
        (
            lambda t: t.replace('n_draft = 5', 'n_draft = 5\nkv_type = "q5"'),
            r"models.toml:7: kv_type = 'q5': choose one of",
        ),
        (lambda t: t.replace('size = 1000', 'size = 1000\nbos = -1'), r"bos must be 0 or more"),
        (lambda t: t.replace("[[pair]]", "[pair]"), r"'pair' must be an array of tables"),
        (lambda t: "x = 1\n" + t, r"unknown top-level key 'x'"),
        (lambda t: t + "\n[[pair\n", r"invalid TOML"),
        (
            lambda t: t.replace("n_draft = 5", "n_draft = 0"),
            r"models.toml:6: n_draft = 0: allowed range is 1..32",
        ),
    ],
)
def test_strict_errors_name_file_and_line(home: Path, edit, message: str) -> None:
    _write(home, edit(GOOD))
    with pytest.raises(ConfigError, match=message) as err:
        registry.load_pairs()
    assert str(home / "models.toml") in str(err.value)


def test_parse_spec() -> None:
    spec = registry.parse_spec("Qwen/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q8_0.gguf")
    assert (spec.repo, spec.file) == ("Qwen/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf")
    with pytest.raises(ConfigError, match="expected REPO:FILE"):
        registry.parse_spec("just-a-file.gguf")


# -- the shipped pairs' published tokenizer facts, checked against each other -----------------------------------


def _facts_gguf(path: Path, spec: registry.ModelSpec, other: registry.ModelSpec) -> Path:
    """A header-only GGUF carrying what models.toml says about one file (vocab size, BOS, EOS, quantization)."""
    from gguf import LlamaFileType, TokenType

    from tests.helpers_vocab import write_vocab

    n = spec.n_vocab or other.n_vocab or 300
    return write_vocab(
        path,
        tokens=[f"tok{i}" for i in range(n)],  # same text at every shared id: only the listed facts differ
        types=[TokenType.CONTROL] * 3 + [TokenType.NORMAL] * (n - 3),
        bos=spec.bos if spec.bos is not None else (other.bos if other.bos is not None else 1),
        eos=spec.eos if spec.eos is not None else (other.eos if other.eos is not None else 2),
        ftype=LlamaFileType[f"MOSTLY_{spec.quant}"],
    )


SHIPPED = registry.parse_file(registry.shipped_path())


@pytest.mark.slow
@pytest.mark.parametrize("pair", SHIPPED, ids=[p.name for p in SHIPPED])
def test_each_shipped_pair_passes_check_from_its_published_facts(pair: registry.Pair, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from localspec.cli.app import app

    t, d = pair.target, pair.draft
    assert t is not None
    if d is None:  # its own drafter, no draft model (an MTP head: `check TARGET` reports it from the real header)
        assert pair.drafter in ("mtp", "lookup"), pair.name
        assert t.quant.lower().replace("_", "") in t.file.lower().replace("_", "")
        return
    assert t.family == d.family, "a draft must come from the target's family"
    for m in (t, d):
        assert m.quant.lower().replace("_", "") in m.file.lower().replace("_", ""), f"{m.file} is not {m.quant}"
    target = _facts_gguf(tmp_path / "target.gguf", t, d)
    draft = _facts_gguf(tmp_path / "draft.gguf", d, t)
    result = CliRunner().invoke(app, ["check", str(target), str(draft)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "verdict: compatible" in result.output


@pytest.mark.slow
def test_a_wrong_fact_in_models_toml_fails_the_check(tmp_path: Path) -> None:
    """The facts test above would catch a mistyped entry: a draft whose BOS or vocabulary differs."""
    from localspec.models import compat
    from localspec.models.gguf_header import read_header

    pair = next(p for p in SHIPPED if p.name == "qwen3-32b")
    assert pair.target is not None and pair.draft is not None
    for wrong in ({"bos": 151644}, {"n_vocab": 151936 + 129}):
        bad = dataclasses.replace(pair.draft, **wrong)
        target = _facts_gguf(tmp_path / "t.gguf", pair.target, bad)
        draft = _facts_gguf(tmp_path / "d.gguf", bad, pair.target)
        assert not compat.compare(read_header(target), read_header(draft)).compatible, wrong


def test_qwen3_32b_is_the_recommended_pair_with_its_preset() -> None:
    pairs = registry.load_pairs()
    first = next(iter(pairs.values()))
    assert first.name == "qwen3-32b" and first.recommended and first.preset == "qwen3-thinking"
    assert first.kv_type == "q8_0" and first.n_ctx == 8192
    assert [p.name for p in pairs.values() if p.recommended] == ["qwen3-32b"]
    assert list(pairs)[-2:] == ["demo", "demo-chat"] and all(pairs[n].builtin for n in ("demo", "demo-chat"))
