"""Presets: the one place defaults live, strict parsing, CLI overlay."""

from __future__ import annotations

from pathlib import Path

import pytest

from localspec.config import available_presets, load_preset, save_user_preset
from localspec.errors import ConfigError


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_default_preset_values():
    p = load_preset()
    assert (p.sampling.temperature, p.sampling.top_p, p.sampling.top_k, p.sampling.repeat_penalty) == (
        0.7, 0.9, 40, 1.0)
    assert p.draft.n_draft == 6
    assert p.bench.repeat == 5 and p.bench.warmup == 10


def test_greedy_overlays_default():
    g = load_preset("greedy")
    assert g.sampling.temperature == 0.0 and g.sampling.greedy
    assert g.sampling.top_k == load_preset().sampling.top_k  # everything else comes from default
    assert {"default", "greedy"} <= set(available_presets())


def write(path, text):
    path.write_text(text)
    return path


def test_unknown_key_names_file_and_key(tmp_path):
    f = write(tmp_path / "mine.toml", "[sampling]\ntemprature = 0.5\n")
    with pytest.raises(ConfigError, match=r"mine\.toml: unknown key sampling\.temprature"):
        load_preset(str(f))


@pytest.mark.parametrize(("section", "old", "value", "new"), [("load", "overlap", '"on"', "draft_ahead"),
                                                         ("draft", "ahead_length", '"fit"', "draft_ahead_length")])
def test_a_renamed_key_is_unknown_and_names_its_new_name(tmp_path, section, old, value, new):
    """Draft-ahead's keys were renamed: a preset or an override naming the old key is an unknown key whose error
    says the new name (never silently taken)."""
    f = write(tmp_path / "old.toml", f"[{section}]\n{old} = {value}\n")
    with pytest.raises(ConfigError, match=rf"old\.toml: unknown key {section}\.{old} .*`{old}` is now `{new}`"):
        load_preset(str(f))
    with pytest.raises(ConfigError, match=rf"unknown setting '{old}'; `{old}` is now `{new}`"):
        load_preset().with_overrides(**{old: "on"})
    write(tmp_path / "new.toml", f"[{section}]\n{new} = {value}\n")
    assert getattr(getattr(load_preset(str(tmp_path / "new.toml")), section), new) == value.strip('"')


def test_unknown_section(tmp_path):
    f = write(tmp_path / "s.toml", "[sampler]\ntop_k = 1\n")
    with pytest.raises(ConfigError, match=r"unknown section \[sampler\]"):
        load_preset(str(f))


@pytest.mark.parametrize(("text", "pattern"), [
    ("[sampling]\ntop_p = 1.5\n", r"sampling\.top_p = 1\.5: allowed range is 0\.0\.\.1\.0"),
    ("[draft]\nn_draft = 99\n", r"draft\.n_draft = 99: allowed range is 0\.\.32"),
    ("[draft]\nn_draft = 2.5\n", r"expected a whole number"),
    ("[sampling]\ntemperature = \"hot\"\n", r"expected a number"),
    ("[draft]\nadaptive = 1\n", r"expected true or false"),
    ("[load]\nkv_type = \"q5\"\n", r"choose one of f16, q8_0, q4_0"),
    ("[sampling\n", r"invalid TOML"),
])
def test_bad_values_name_key_and_range(tmp_path, text, pattern):
    f = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_preset(str(f))
    assert "bad.toml" in str(info.value)


def test_unknown_preset_lists_available():
    with pytest.raises(ConfigError, match=r"unknown preset 'fast' \(available: agent, default, greedy, qwen3-instruct"):
        load_preset("fast")


def test_overrides_are_checked_and_none_keeps_preset():
    p = load_preset().with_overrides(temperature=None, n_draft=3, max_tokens=7)
    assert p.sampling.temperature == 0.7 and p.draft.n_draft == 3 and p.bench.max_tokens == 7
    with pytest.raises(ConfigError, match=r"command line: sampling\.top_p = 2\.0: allowed range"):
        load_preset().with_overrides(top_p=2.0)


def test_reply_limits_are_preset_keys_of_their_own():
    p = load_preset()
    assert (p.chat.max_tokens, p.generate.max_tokens, p.bench.max_tokens) == (1024, 512, 128)
    # max_tokens is a key of bench, chat and generate: each command's option means its own section's.
    chat = p.with_overrides(prefer="chat", max_tokens=50)
    gen = p.with_overrides(prefer="generate", max_tokens=60)
    assert (chat.chat.max_tokens, chat.generate.max_tokens, chat.bench.max_tokens) == (50, 512, 128)
    assert (gen.chat.max_tokens, gen.generate.max_tokens, gen.bench.max_tokens) == (1024, 60, 128)
    with pytest.raises(ConfigError, match=r"command line: chat\.max_tokens = 0: allowed range is 1\.\."):
        p.with_overrides(prefer="chat", max_tokens=0)


def test_qwen3_presets_carry_the_recommended_sampling():
    thinking, instruct = load_preset("qwen3-thinking"), load_preset("qwen3-instruct")
    t, i = thinking.sampling, instruct.sampling
    assert (t.temperature, t.top_p, t.top_k, t.min_p) == (0.6, 0.95, 20, 0.0)
    assert (i.temperature, i.top_p, i.top_k, i.min_p) == (0.7, 0.8, 20, 0.0)
    assert thinking.chat.max_tokens == 4096  # thinking counts against the reply limit
    assert thinking.draft == load_preset().draft  # one sampling object; drafting stays the default's


def test_a_pair_names_its_preset_and_the_command_line_still_wins(tmp_path, monkeypatch):
    from localspec.cli import options
    from localspec.sessions.session import ModelFiles

    files = ModelFiles(target=tmp_path / "t.gguf", draft=tmp_path / "d.gguf", name="qwen3-32b", n_ctx=8192,
                       n_draft=6, kv_type="q8_0", preset="qwen3-thinking")
    monkeypatch.setattr(options, "resolve_files", lambda *a, **k: files)
    _, chosen = options.resolve_run(options.RunOptions(pair="qwen3-32b"), "chat")
    assert chosen.name == "qwen3-thinking" and chosen.sampling.top_k == 20 and chosen.load.kv_type == "q8_0"
    assert chosen.chat.max_tokens == 4096 and chosen.load.n_ctx == 8192
    _, chosen = options.resolve_run(options.RunOptions(pair="qwen3-32b", preset="greedy", kv_type="f16"), "chat")
    assert chosen.name == "greedy" and chosen.sampling.temperature == 0.0 and chosen.load.kv_type == "f16"


def test_user_preset_roundtrip_and_precedence(home):
    tuned = load_preset("greedy").with_overrides(n_draft=4)
    path = save_user_preset("tuned", tuned)
    assert path == home / "presets" / "tuned.toml"
    again = load_preset("tuned")
    assert again.sampling == tuned.sampling and again.draft == tuned.draft and again.load == tuned.load
    # A user preset with a shipped name wins over the shipped one.
    (home / "presets" / "greedy.toml").write_text("[sampling]\ntemperature = 0.1\n")
    assert load_preset("greedy").sampling.temperature == 0.1


def test_pair_recommendations_sit_between_preset_and_command_line(tmp_path):
    from localspec.sessions.session import ModelFiles, settle_preset

    files = ModelFiles(target=tmp_path / "t.gguf", draft=tmp_path / "d.gguf", name="p", n_ctx=8192, n_draft=5)
    pair_only = settle_preset(load_preset(), files)
    assert (pair_only.load.n_ctx, pair_only.draft.n_draft) == (8192, 5)
    cli = settle_preset(load_preset(), files, n_ctx=1024, n_draft=3)
    assert (cli.load.n_ctx, cli.draft.n_draft) == (1024, 3)
    plain_files = ModelFiles(target=files.target, draft=files.draft, name="custom")
    assert settle_preset(load_preset(), plain_files).load.n_ctx == load_preset().load.n_ctx


def test_without_a_draft_model_the_drafter_is_lookup_unless_given(tmp_path):
    from localspec.sessions.session import ModelFiles, settle_preset

    solo = ModelFiles(target=tmp_path / "t.gguf", draft=None, name="custom")
    assert settle_preset(load_preset(), solo).draft.drafter == "lookup"
    assert settle_preset(load_preset(), solo, drafter="model").draft.drafter == "model"  # then: plain decoding
    paired = ModelFiles(target=solo.target, draft=tmp_path / "d.gguf", name="custom")
    assert settle_preset(load_preset(), paired).draft.drafter == "model"


def test_lookup_sizes_are_checked_together():
    with pytest.raises(ConfigError, match="draft.lookup_min = 9 is above draft.lookup_max = 8"):
        load_preset().with_overrides(lookup_min=9)
    with pytest.raises(ConfigError, match="--drafter = 'medusa': choose one of chain, chain-mtp, dflash, dspark, "
                                          "eagle3, lookup, model, mtp, suffix"):
        load_preset().with_overrides(drafter="medusa", flags={"drafter": "--drafter"})


def test_tests_never_see_the_developers_own_home() -> None:
    """conftest points LOCALSPEC_HOME at an empty folder per test: a developer's greedy.toml cannot leak in."""
    from localspec import paths

    home = paths.home()
    assert home != Path.home() / ".config" / "localspec"
    assert not home.exists() or not any(home.iterdir())


def test_server_section_is_a_preset_like_the_others(tmp_path):
    p = load_preset()
    assert (p.server.host, p.server.port, p.server.queue) == ("127.0.0.1", 8080, 8)
    assert load_preset().with_overrides(port=0, queue=1).server.port == 0
    f = write(tmp_path / "srv.toml", "[server]\nport = 70000\n")
    with pytest.raises(ConfigError, match=r"srv\.toml: server\.port = 70000: allowed range is 0\.\.65535"):
        load_preset(str(f))
    f = write(tmp_path / "host.toml", "[server]\nhost = \"\"\n")
    with pytest.raises(ConfigError, match=r"server\.host = '': expected a non-empty string"):
        load_preset(str(f))


def test_each_drafter_declares_its_own_facts_and_config_reads_them_without_importing_model_code() -> None:
    import subprocess
    import sys

    from localspec.config import DRAFTER_TABLE, MODEL_FREE_DRAFTERS

    assert DRAFTER_TABLE["lookup"].title == "prompt lookup" and not DRAFTER_TABLE["lookup"].needs_draft_model
    assert DRAFTER_TABLE["mtp"].target_head and not DRAFTER_TABLE["mtp"].needs_draft_model
    assert DRAFTER_TABLE["model"].needs_draft_model and DRAFTER_TABLE["chain"].needs_draft_model
    assert set(MODEL_FREE_DRAFTERS) == {"chain-mtp", "lookup", "mtp", "suffix"}
    assert DRAFTER_TABLE["chain-mtp"].target_head and DRAFTER_TABLE["chain-mtp"].reads_target
    # Presets and header checks must not load llama.cpp: reading the facts imports no drafter module.
    code = "import sys, localspec.config; print(sorted(m for m in sys.modules if m.startswith('localspec.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "drafters" not in loaded and "llama_cpp" not in loaded, loaded


def test_the_agent_preset_chains_suffix_lookup_before_the_draft_model():
    agent = load_preset("agent")
    assert (agent.draft.drafter, agent.draft.chain_lead) == ("chain", "suffix")
    assert agent.sampling == load_preset().sampling  # it changes drafting only


def test_switching_to_the_mtp_head_without_a_length_takes_its_own(tmp_path, monkeypatch):
    """`mtp_n_draft`: a layer that switches the drafter to the MTP head naming no length (an option, a request, a
    pair, a preset over the default) drafts the head's length; a length named with it, or a drafter that was the
    MTP head already, keeps its own."""
    base = load_preset()
    assert (base.draft.n_draft, base.draft.mtp_n_draft) == (6, 4)
    assert base.with_overrides(drafter="mtp").draft.n_draft == 4
    assert base.with_overrides(drafter="mtp", n_draft=5).draft.n_draft == 5
    assert base.with_overrides(drafter="mtp", n_draft=0).draft.n_draft == 0  # plain decoding stays plain
    assert base.with_overrides(drafter="mtp", mtp_n_draft=2).draft.n_draft == 2
    assert base.with_overrides(drafter="lookup").draft.n_draft == 6
    chosen = base.with_overrides(drafter="mtp", n_draft=7)
    assert chosen.with_overrides(drafter="mtp").draft.n_draft == 7  # (already the head: a request keeps the length)
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    folder = tmp_path / "presets"
    folder.mkdir()
    (folder / "head.toml").write_text('[draft]\ndrafter = "mtp"\n')
    (folder / "head5.toml").write_text('[draft]\ndrafter = "mtp"\nn_draft = 5\n')
    assert load_preset("head").draft.n_draft == 4 and load_preset("head5").draft.n_draft == 5
