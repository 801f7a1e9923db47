"""`localspec bench --prompts FILE` and the chat template: bench measures what users run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from localspec.errors import LocalspecError
from localspec.sessions.bench import BenchPrompt, load_prompts


def _file(tmp_path: Path, text: str, name: str = "prompts.txt") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_lookup_set_is_a_name_and_a_file_of_that_name_is_dot_slash(tmp_path: Path, monkeypatch) -> None:
    shipped = load_prompts("lookup")
    assert [p.name for p in shipped] == ["code-edit", "summarise", "json"]
    assert "def summarize_orders" in (shipped[0].text or "")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lookup").write_text("mine\n")
    assert [p.text for p in load_prompts("./lookup")] == ["mine"]
    assert [p.text for p in load_prompts(Path("lookup"))] == ["mine"]


def test_one_prompt_per_line_skips_blank_lines(tmp_path: Path) -> None:
    prompts = load_prompts(_file(tmp_path, "Explain DNS.\n\n  \nWrite a haiku about rust.\n"))
    assert prompts == [BenchPrompt("line 1", text="Explain DNS."),
                       BenchPrompt("line 4", text="Write a haiku about rust.")]


def test_jsonl_with_prompt_or_messages(tmp_path: Path) -> None:
    lines = [
        json.dumps({"prompt": "Explain DNS."}),
        "",
        json.dumps({"name": "review", "messages": [{"role": "system", "content": "Be terse."},
                                                   {"role": "user", "content": "Review: x = x + 1"}]}),
    ]
    prompts = load_prompts(_file(tmp_path, "\n".join(lines) + "\n", "p.jsonl"))
    assert prompts[0] == BenchPrompt("line 1", text="Explain DNS.")
    assert prompts[1].name == "review" and prompts[1].messages is not None and len(prompts[1].messages) == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "a"}\n{"prompt": 3}\n', r"p\.jsonl:2: 'prompt' must be a non-empty string"),
        ('{"prompt": "a"}\n\n{"prompt": "b"\n', r"p\.jsonl:3: invalid JSON"),
        ('{"prompt": "a", "messages": []}\n', r"p\.jsonl:1: give exactly one of 'prompt' or 'messages'"),
        ('{"promt": "a"}\n', r"p\.jsonl:1: unknown key 'promt'"),
        ('{"messages": [{"role": "user"}]}\n', r"p\.jsonl:1: message 1 must be an object with string 'role'"),
        ('["a"]\n', r"p\.jsonl:1: expected an object"),
        ("\n\n", r"p\.jsonl: no prompts"),
    ],
)
def test_errors_name_the_file_and_the_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(LocalspecError, match=message):
        load_prompts(_file(tmp_path, text, "p.jsonl"))


def test_a_missing_file_is_one_line_before_any_model_loads(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from localspec.cli.app import main; main()", "bench", "--prompts",
         str(tmp_path / "nope.txt"), "--target", str(tmp_path / "absent.gguf")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and out.stderr == f"localspec: error: {tmp_path / 'nope.txt'}: cannot read: " \
                                                 "No such file or directory\n"


@pytest.mark.slow
def test_bench_sends_prompts_through_the_template_unless_raw(tiny_pair: tuple[Path, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from localspec.cli.app import app

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    target, draft = tiny_pair  # SmolLM2's tokenizer and chat template
    prompts = _file(tmp_path, json.dumps({"prompt": "hello"}) + "\n" + json.dumps(
        {"name": "talk", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                      {"role": "user", "content": "and?"}]}) + "\n", "p.jsonl")
    common = ["bench", "--target", str(target), "--draft", str(draft), "--repeat", "1", "--warmup", "0",
              "--max-tokens", "4", "--preset", "greedy", "--ctx", "256"]
    report = tmp_path / "r.json"
    result = CliRunner().invoke(app, [*common, "--prompts", str(prompts), "--json", str(report)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "2 prompt(s): your prompts, as chat template" in result.output
    data = json.loads(report.read_text())
    assert data["prompt_mode"] == "chat template" and data["prompts"] == ["line 1", "talk"]
    assert all(r["tokens"] == 2 * 4 for r in data["runs"])

    raw = CliRunner().invoke(app, [*common, "--raw", "--json", str(report)], env={"COLUMNS": "200"})
    assert raw.exit_code == 0, raw.output
    assert "3 prompt(s): the shipped prompts (code, prose, Q&A), as raw completion" in raw.output
    assert json.loads(report.read_text())["prompt_mode"] == "raw completion"

    refused = CliRunner().invoke(app, [*common, "--raw", "--prompts", str(prompts)])
    assert refused.exit_code != 0
    assert "prompt 'talk' is a conversation (messages): it needs the chat template" in str(refused.exception)
