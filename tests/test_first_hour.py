"""What a newcomer meets in the first hour (issue #23): which pair each command talks to without arguments, a
`model` the server does not serve, the bench's verdict, legend and live progress, `models`, `check` and `doctor`
on the built-in pairs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from starlette.testclient import TestClient
from typer.testing import CliRunner

from localspec import config
from localspec.cli import chat_cmd, serve_cmd
from localspec.cli.app import app
from localspec.errors import LocalspecError
from localspec.models import demo, doctor, memory, registry
from localspec.server.app import ServerState, create_app
from localspec.sessions import bench
from localspec.sessions.bench import PLAIN, SPEC, BenchReport, GreedyCheck, ModeSummary, RunProgress
from localspec.sessions.session import ModelFiles, open_session
from localspec.status import Status
from localspec.ui.bench_view import LEGEND, live_view, summary

runner = CliRunner()


class Opened(LocalspecError):
    """Raised by a fake loader once it has seen what the command would load."""


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict:
    seen: dict = {}

    def fake(files, preset, **kw):
        seen["files"], seen["preset"] = files, preset
        raise Opened("stop here")

    monkeypatch.setattr(chat_cmd, "open_session", fake)
    monkeypatch.setattr(serve_cmd, "preflight", fake)
    return seen


# -- conversational commands default to the instruct pair ---------------------------------------------------------


@pytest.mark.parametrize(("args", "pair"), [(["serve"], "demo-chat"), (["generate", "hi", "--chat"], "demo-chat"),
                                            (["generate", "hi"], "demo")])
def test_conversations_default_to_the_instruct_demo(args: list[str], pair: str, captured: dict,
                                                    use_demo_home: Path) -> None:
    result = runner.invoke(app, args)
    assert isinstance(result.exception, Opened), result.output
    assert captured["files"].name == pair
    if pair == "demo-chat":
        assert captured["files"].target.name == demo.SMOLLM2_FILE and captured["preset"].name == "smollm2-chat"


def test_model_aliases_reach_the_preset_and_bad_ones_name_the_flag(captured: dict, use_demo_home: Path) -> None:
    result = runner.invoke(app, ["serve", "--model-alias", "gpt-4o", "--model-alias", "my-model"])
    assert isinstance(result.exception, Opened), result.output
    server = captured["preset"].server
    assert server.model_aliases == "gpt-4o,my-model" and server.model_alias_names == ("gpt-4o", "my-model")
    bad = runner.invoke(app, ["serve", "--model-alias", "two words"])
    assert isinstance(bad.exception, LocalspecError) and not isinstance(bad.exception, Opened)
    assert str(bad.exception).startswith("--model-alias = 'two words': expected comma-separated model names")
    assert config.load_preset().server.model_alias_names == ()  # the default: only the pair's own id


def test_an_unknown_model_is_a_404_that_lists_what_is_served_with_strict_model() -> None:
    # (Without --strict-model any name means the one model served: tests/test_serve_fast.py.)
    state = ServerState(model_id="demo-chat", aliases=("gpt-4o",), strict_model=True)  # not loaded: checked first
    with TestClient(create_app(state), base_url="http://localhost") as client:
        for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/completions", {"prompt": "hi"})):
            r = client.post(route, json={"model": "gpt-4", **body})
            assert r.status_code == 404, r.text
            error = r.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model"
            assert error["type"] == "invalid_request_error"
            assert "'gpt-4' is not served here" in error["message"]
            assert "'demo-chat', 'gpt-4o'" in error["message"] and "--model-alias gpt-4" in error["message"]
            for served in ({"model": "demo-chat"}, {"model": "gpt-4o"}, {}):  # past the check: still loading
                r = client.post(route, json={**served, **body})
                assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["demo-chat", "gpt-4o"]
        typo = client.post("/v1/completions", json={"model": "demo-chat", "prompt": "hi", "temprature": 1})
        assert typo.status_code == 400 and "temprature" in typo.json()["error"]["message"]  # still refused


def test_the_serving_docs_snippets_name_models_that_are_served() -> None:
    root = Path(__file__).resolve().parent.parent
    server = (root / "docs" / "server.md").read_text()
    assert 'model="demo-chat"' in server and "model: demo-chat" in server  # the openai snippet, Continue's config
    for page in (root / "README.md", *sorted((root / "docs").glob("*.md"))):
        assert 'model="demo"' not in page.read_text(), page.name  # `serve` serves demo-chat, not demo


# -- the bench verdict, legend and progress ----------------------------------------------------------------------


def _report(speedup: float, exact: bool = True, warnings: tuple[str, ...] = ()) -> BenchReport:
    def mode(name: str, tps: float) -> ModeSummary:
        return ModeSummary(name, 5, tps, tps, tps, 0.8 if name == SPEC else 0.0, 3.1 if name == SPEC else 0.0, 0.05)

    return BenchReport(preset=config.load_preset(), n_draft=6, max_tokens=128, plain=mode(PLAIN, 20.0),
                       speculative=mode(SPEC, 20.0 * speedup),
                       greedy_check=GreedyCheck(exact=exact, prompts=[], near_tie=1.0),
                       runs=[], environment={}, warnings=list(warnings))


def _text(renderable, width: int = 80) -> str:
    console = Console(width=width, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def test_a_slower_verdict_on_a_cpu_says_why_what_a_gpu_does_and_what_to_run_next() -> None:
    text = " ".join(_text(summary(_report(0.42))).split())
    assert "SLOWER than plain decoding on this pair and machine (0.42x)" in text
    assert "expected on a CPU" in text and "verifying 7 tokens in one batch" in text
    assert "on an H100, synthetic models with the recommended pair's shapes" in text
    assert "real models on an RTX 3090/4090 are not measured yet" in text  # what was not measured is labelled so
    assert "next: with an NVIDIA GPU" in text and "localspec bench --pair qwen3-32b" in text
    faster = " ".join(_text(summary(_report(1.6))).split())
    assert "1.60x plain decoding" in faster and "next: `localspec bench --sweep 2,4,6,8`" in faster
    assert "expected on a CPU" not in faster
    gpu = " ".join(_text(summary(_report(0.9, exact=False))).split())
    assert "few drafts are accepted" in gpu and "expected on a CPU" not in gpu
    warned = _text(summary(_report(0.42, warnings=("the load average was 3.0",))))
    assert "⚠ the load average was 3.0" in warned
    assert _report(0.42).as_json()["advice"] == _report(0.42).advice


@pytest.mark.parametrize(("speedup", "exact"), [(0.42, True), (1.6, True), (0.9, False), (1.6, False)])
def test_the_advice_never_quotes_a_synthetic_pairs_speedup_as_a_real_cards(speedup: float, exact: bool) -> None:
    """A speed-up measured on synthetic models is said to be one, in the same sentence, and no card is promised one."""
    for line in _report(speedup, exact=exact).advice:
        for sentence in re.split(r"(?<=[.;])\s", line):
            if re.search(r"\d(\.\d+)?(-\d(\.\d+)?)?x\b", sentence):
                assert "synthetic" in sentence and "3090" not in sentence, sentence


def test_the_live_table_explains_its_columns_and_shows_the_run_under_way() -> None:
    text = _text(live_view([], 5, "decode tok/s", RunProgress(SPEC, 0, 57, 384, 12.34)))
    flat = " ".join(text.split())
    for column in ("accept", "mean acc", "host"):
        assert f"{column}:" in flat
    assert LEGEND.split(" · ")[0] in flat
    assert "run 1/10 (speculative): 57/384 tokens · 12.3 tok/s so far" in flat
    assert max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.slow
def test_bench_reports_progress_inside_every_run(tiny_pair: tuple[Path, Path], monkeypatch) -> None:
    monkeypatch.setattr(bench, "PROGRESS_EVERY_S", 0.0)  # every token: the test must not depend on speed
    target, draft = tiny_pair
    preset = config.load_preset("greedy").with_overrides(n_ctx=256, repeat=1, warmup=1, max_tokens=10, threads=1)
    with open_session(ModelFiles(target=target, draft=draft, name="custom"), preset) as session:
        events = list(bench.run_bench(session, preset, [bench.BenchPrompt("p", text="hello there")], raw=True))
    runs = [e for e in events if isinstance(e, bench.RunDone)]
    assert [r.result.mode for r in runs] == [PLAIN, SPEC]
    for done in runs:
        seen = [e for e in events if isinstance(e, RunProgress) and e.mode == done.result.mode and e.index == 0]
        counts = [e.tokens for e in seen]
        assert counts == sorted(counts) and 0 < counts[-1] <= done.result.stats.tokens <= 10
        assert all(e.total == 10 and e.tok_s > 0 for e in seen)
    report = events[-1]
    assert isinstance(report, BenchReport) and isinstance(report.warnings, list)


# -- models, check, doctor ----------------------------------------------------------------------------------------


def _models(monkeypatch, columns: int, devices: memory.Devices) -> str:
    monkeypatch.setattr(memory, "probe_devices", lambda *a, **k: devices)
    result = runner.invoke(app, ["models"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


def test_models_says_ram_only_without_a_gpu_and_likely_with_one(monkeypatch) -> None:
    out = _models(monkeypatch, 200, memory.Devices(ram_available=256 << 30))
    row = next(line for line in out.splitlines() if line.split()[:1] == ["qwen3-32b"])
    assert "RAM only" in row and "likely" not in row
    assert "judged against available RAM" in out
    gpu = memory.DeviceMem(memory.Dev("gpu", 0), "RTX 4090", 23 << 30, 24 << 30)
    out = _models(monkeypatch, 200, memory.Devices(ram_available=256 << 30, gpus=(gpu,)))
    row = next(line for line in out.splitlines() if line.split()[:1] == ["qwen3-32b"])
    assert "likely" in row and "RAM only" not in row


def test_models_at_80_columns_never_splits_a_file_name(monkeypatch) -> None:
    out = _models(monkeypatch, 80, memory.Devices(ram_available=64 << 30))
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 80
    words = set(out.split())
    for pair in registry.load_pairs().values():
        for spec in (pair.target, pair.draft):
            if spec is not None:
                assert spec.file in words or f"+{spec.file}" in words, spec.file


@pytest.mark.slow
def test_demo_chat_shows_its_size_and_fit_once_built(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    demo.SMOLLM2.draft_path()  # what the first `localspec chat` builds
    assert demo.SMOLLM2.cached() is not None
    out = _models(monkeypatch, 200, memory.Devices(ram_available=64 << 30))
    row = next(line for line in out.splitlines() if line.split()[:1] == ["demo-chat"])
    assert re.search(r"\d\.\d GB", row) and "yes" in row, row


@pytest.mark.slow
def test_check_on_a_good_pair_shows_the_tokenizer_match(use_demo_home: Path) -> None:
    result = runner.invoke(app, ["check", "--pair", "demo"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # rich wraps at a column set by the longest path (the tmp folder's)
    assert "✓ same tokenizer (gemma3 / gemma3): every token id means the same text in both models" in said


def test_doctor_calls_the_demo_drafts_by_design_not_a_problem(demo_home: Path) -> None:
    folder = demo_home / "cache" / "demo"
    target, draft = folder / demo.TARGET_FILE, folder / demo.DRAFT_FILE
    plenty = memory.Devices(ram_available=64 << 30)
    as_user_pair = {c.name: c for c in doctor.run_checks(target, draft, config.load_preset(), devices=plenty)}
    assert as_user_pair["draft ≥ 8-bit"].status == Status.WARN  # a user's pair gets the advice
    as_demo = doctor.run_checks(target, draft, config.load_preset(), devices=plenty, demo=True)
    by = {c.name: c for c in as_demo}
    for name in ("draft ≥ 8-bit", "draft ≤ ~10% of target"):
        assert by[name].status == Status.INFO and "by design" in by[name].detail and not by[name].fix
    cpu_only = by["llama-cpp-python GPU offload"]  # no NVIDIA GPU at all: nothing to fix on this machine
    assert cpu_only.status == Status.INFO and cpu_only.fix.startswith("on a machine with an NVIDIA GPU")
    assert [c for c in as_demo if c.status in (Status.WARN, Status.FAIL)] == []


@pytest.mark.slow
def test_doctor_on_the_default_pair_opens_without_warnings(use_demo_home: Path) -> None:
    env = {**os.environ, "LOCALSPEC_HOME": str(use_demo_home), "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", "doctor"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    checks = [line for line in out.stdout.splitlines() if line[:1] in "✓·⚠✗"]
    assert checks and not any(line.startswith("⚠") for line in checks[:4]), out.stdout
    assert any(line.startswith("✓ CPU threads: auto:") for line in checks), out.stdout

