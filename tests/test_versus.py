"""`localspec bench --against llama.cpp` (localspec.sessions.versus): finding
llama-speculative-simple, reading what it prints (a recorded run of the real tool), running it on the bench's prompts
and comparing; a stand-in tool beside the real one, which the slow test at the end runs when a build is found."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers_llama_tool import commands, write_tool

from localspec import config
from localspec.errors import LocalspecError, UsageError
from localspec.sessions import versus
from localspec.sessions.bench import RunDone

DATA = Path(__file__).resolve().parent / "data" / "llama-speculative-simple"


def localspec(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=900)


# -- what it prints ----------------------------------------------------------------------------------------------


def test_the_recorded_run_of_the_real_tool_is_read() -> None:
    """stderr and stdout of llama-speculative-simple built from the pinned llama.cpp (CPU), the tiny pair, T = 0."""
    meta = json.loads((DATA / "run.json").read_text())
    timings = versus.parse_timings((DATA / "run.stderr").read_text())
    assert timings == versus.Timings(**meta["timings"])
    assert timings.tokens >= meta["n"] and timings.accepted <= timings.drafted
    text = versus.generated_text((DATA / "run.stdout").read_bytes().decode(), meta["prompt"])
    assert text == meta["generated"]


def test_timings_need_the_whole_summary_and_ignore_colour_and_prefixes() -> None:
    log = (DATA / "run.stderr").read_text()
    assert versus.parse_timings(log.split("n_drafted")[0]) is None  # killed before its summary
    coloured = "\n".join(f"\x1b[32mI {line}\x1b[0m" if line.strip() else line for line in log.splitlines())
    assert versus.parse_timings(coloured) == versus.parse_timings(log)
    assert versus.parse_timings("") is None


def test_generated_text_is_what_follows_the_prompt() -> None:
    assert versus.generated_text("<bos>Question: why?\nAnswer: because\r\nso.\n\n\n\n", "Question: why?\nAnswer:") \
        == " because\r\nso."
    assert versus.generated_text("Q:\n\n\n\n\n\n", "Q:") == "\n\n"  # its own blank lines stay
    assert versus.generated_text("Q: a\n\n", "Q:") == " a"  # killed before its last line
    assert versus.generated_text("something else\n\n", "Question:") is None


def test_divergence_is_the_plain_token_holding_the_first_different_character() -> None:
    text, ends = "one two three", [3, 7, 13]
    assert versus.first_divergence(text, ends, "one two three and more") is None  # it went on: no divergence
    assert versus.first_divergence(text, ends, "one too three") == 1
    assert versus.first_divergence(text, ends, "one") == 1  # stopped early
    assert versus.first_divergence(text, ends, "One") == 0


# -- finding the tool ----------------------------------------------------------------------------------------------


def test_the_tool_is_found_from_the_option_the_environment_or_path(tmp_path: Path) -> None:
    tool = write_tool(tmp_path / "build" / "bin")
    assert versus.find_tool(str(tool), env={}) == tool
    assert versus.find_tool(str(tool.parent), env={}) == tool  # a build's bin folder
    assert versus.find_tool("", env={versus.BIN_ENV: str(tool.parent)}) == tool
    assert versus.find_tool("", env={"PATH": f"/nonexistent:{tool.parent}"}) == tool
    other = write_tool(tmp_path / "other")
    assert versus.find_tool(str(other), env={versus.BIN_ENV: str(tool)}) == other  # the option first


def test_a_missing_or_unusable_tool_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"needs llama-speculative-simple, and none was found on PATH: build "
                                         r"llama.cpp's llama-speculative-simple .* pass --llama-bin"):
        versus.find_tool("", env={"PATH": str(tmp_path)})
    with pytest.raises(UsageError, match=rf"--llama-bin {tmp_path}: no llama-speculative-simple there"):
        versus.find_tool(str(tmp_path), env={})
    with pytest.raises(UsageError, match=rf"{versus.BIN_ENV} /nope: no llama-speculative-simple there"):
        versus.find_tool("", env={versus.BIN_ENV: "/nope"})
    plain = tmp_path / "llama-speculative-simple"
    plain.write_text("not a program")
    with pytest.raises(UsageError, match="is not executable"):
        versus.find_tool(str(plain), env={})


def test_the_probe_reads_the_version_and_refuses_an_older_tool(tmp_path: Path, monkeypatch) -> None:
    tool = versus.probe_tool(write_tool(tmp_path))
    assert tool.version == "version: 4242 (standin)" and tool.backend_sampling
    monkeypatch.setenv("STANDIN_USAGE", "--draft-max N    number of tokens to draft")
    with pytest.raises(UsageError, match="an older llama.cpp, or not the tool"):
        versus.probe_tool(write_tool(tmp_path / "old"))
    monkeypatch.delenv("STANDIN_USAGE")
    broken = tmp_path / "broken"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    with pytest.raises(UsageError, match="does not run"):
        versus.probe_tool(broken)


# -- running it ----------------------------------------------------------------------------------------------------

PROMPTS = (versus.LlamaPrompt("code", "Write code.\n", 4), versus.LlamaPrompt("qa", "Question: why?\nAnswer:", 4))


def _plan(tool: Path, modes: tuple[str, ...] = (versus.HOST, versus.BACKEND), **overrides: object) -> versus.Plan:
    settings: dict[str, object] = {"max_tokens": 16, "repeat": 3, "n_draft": 5, **overrides}
    preset = config.load_preset("default").with_overrides(prefer="bench", **settings)
    return versus.Plan(tool=versus.probe_tool(tool), target=Path("/m/target.gguf"), draft=Path("/m/draft.gguf"),
                       preset=preset, threads=1, prompts=PROMPTS, modes=modes)


def _report(plain_text: dict[str, str] | None = None) -> SimpleNamespace:
    """What the comparison reads of localspec's BenchReport: the rates and the greedy check's plain text."""
    checks = [SimpleNamespace(name=name, plain_text=text, plain_token_ends=list(range(1, len(text) + 1)),
                              plain_margins=[0.5] * len(text)) for name, text in (plain_text or {}).items()]
    return SimpleNamespace(plain=SimpleNamespace(min_tps=50.0), speculative=SimpleNamespace(median_tps=96.0),
                           greedy_check=SimpleNamespace(prompts=checks))


def _run(plan: versus.Plan, report: SimpleNamespace) -> tuple[list[RunDone[versus.LlamaRun]], versus.Comparison]:
    events = list(versus.run_against(plan, report))  # type: ignore[arg-type]
    assert isinstance(events[-1], versus.Comparison)
    return events[:-1], events[-1]  # type: ignore[return-value]


def test_every_prompt_runs_in_each_mode_per_repetition_with_the_bench_settings(tmp_path: Path,
                                                                                monkeypatch) -> None:
    log = tmp_path / "ran.jsonl"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    monkeypatch.setenv("STANDIN_SECONDS", "0.25")
    monkeypatch.setenv("STANDIN_BACKEND_FACTOR", "0.5")  # backend sampling twice as fast
    done, comparison = _run(_plan(write_tool(tmp_path), temperature=0.0, seed=7), _report())
    assert [(e.result.repetition, e.result.mode, e.result.prompt) for e in done] == [
        (0, "host", "code"), (0, "host", "qa"), (0, "backend", "code"), (0, "backend", "qa"),
        (1, "backend", "code"), (1, "backend", "qa"), (1, "host", "code"), (1, "host", "qa"),  # modes alternate
        (2, "host", "code"), (2, "host", "qa"), (2, "backend", "code"), (2, "backend", "qa")]
    assert [e.done for e in done] == list(range(1, 13)) and {e.total for e in done} == {12}
    ran = commands(log)
    assert len(ran) == 12
    first = ran[0]
    opt = {first[i]: first[i + 1] for i in range(len(first) - 1) if first[i].startswith("-")}
    assert opt["-m"] == "/m/target.gguf" and opt["-md"] == "/m/draft.gguf"
    assert opt["-n"] == "16" and opt["--spec-draft-n-max"] == "5" and opt["--spec-draft-n-min"] == "0"
    assert opt["--spec-type"] == "draft-simple" and opt["--spec-draft-p-min"] == "0"
    assert opt["--temp"] == "0" and opt["--seed"] == "7" and opt["--top-k"] == "40" and opt["--top-p"] == "0.9"
    assert opt["-ngl"] == "all" and opt["-ngld"] == "all" and opt["-c"] == "4096" and opt["-t"] == "1"
    assert "--backend-sampling" not in first and "--backend-sampling" in ran[2]
    # host: 17 tokens in 0.25 s a prompt, 34 / 0.5 = 68 tok/s; backend: twice that
    modes = {m.mode: m for m in comparison.modes}
    assert modes["host"].median_tps == pytest.approx(68.0) and modes["host"].runs == 3
    assert modes["backend"].median_tps == pytest.approx(136.0)
    assert modes["host"].acceptance_rate == pytest.approx(0.75)
    assert comparison.best is modes["backend"] and comparison.ratio == pytest.approx(96.0 / 136.0)
    assert comparison.version == "version: 4242 (standin)"
    data = comparison.as_json()
    assert data["best_mode"] == "backend" and data["ratio"] == pytest.approx(96.0 / 136.0)
    assert len(data["runs"]) == 12 and data["runs"][0]["tokens"] == 17 and data["runs"][0]["prompt_tokens"] == 2
    json.dumps(data)  # it goes into bench's JSON as is


def test_the_mtp_head_runs_as_draft_mtp_without_a_draft_model(tmp_path: Path, monkeypatch) -> None:
    """`--drafter mtp` is llama.cpp's `--spec-type draft-mtp` on the target alone (its MTP context takes the
    target's settings): no draft model or draft options; a tool without draft-mtp is refused at the probe."""
    log = tmp_path / "ran.jsonl"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    tool = write_tool(tmp_path)
    plan = dataclasses.replace(_plan(tool, (versus.HOST,), drafter="mtp", n_draft=3), draft=None)
    _run(plan, _report())
    first = commands(log)[0]
    opt = {first[i]: first[i + 1] for i in range(len(first) - 1) if first[i].startswith("-")}
    assert opt["--spec-type"] == "draft-mtp" and opt["--spec-draft-n-max"] == "3" and opt["-m"] == "/m/target.gguf"
    assert not {"-md", "-ngld", "-ctkd", "-ctvd", "-td"} & set(first)
    versus.probe_tool(tool, versus.SPEC_TYPES["mtp"])
    monkeypatch.setenv("STANDIN_USAGE", "--spec-type [none|draft-simple]\n--spec-draft-n-max N")
    with pytest.raises(UsageError, match="--spec-type draft-mtp"):
        versus.probe_tool(write_tool(tmp_path / "old"), versus.SPEC_TYPES["mtp"])


def test_the_prompt_file_holds_the_text_and_one_newline_more(tmp_path: Path, monkeypatch) -> None:
    """llama.cpp's -f drops one trailing newline; the text localspec tokenized must be what it reads."""
    log = tmp_path / "ran.jsonl"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    seen: list[str] = []
    real_run = subprocess.run

    def spy(cmd, *args, **kwargs):
        if "-f" in cmd:
            seen.append(Path(cmd[cmd.index("-f") + 1]).read_text(encoding="utf-8"))
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(versus.subprocess, "run", spy)
    _run(_plan(write_tool(tmp_path), modes=(versus.HOST,), repeat=1), _report())
    assert seen == ["Write code.\n\n", "Question: why?\nAnswer:\n"]


def test_greedy_texts_are_compared_with_plain_decoding_and_token_counts_checked(tmp_path: Path,
                                                                               monkeypatch) -> None:
    monkeypatch.setenv("STANDIN_LOG", str(tmp_path / "ran.jsonl"))
    monkeypatch.setenv("STANDIN_REPLIES", json.dumps({"Write code.\n": " def f(): pass",
                                                      "Question: why?\nAnswer:": " because of physics"}))
    monkeypatch.setenv("STANDIN_PROMPT_TOKENS", "4")
    plain = {"code": " def f(): pass", "qa": " because of chemistry"}
    _, comparison = _run(_plan(write_tool(tmp_path), modes=(versus.HOST,), temperature=0.0), _report(plain))
    by_prompt = {g.prompt: g for g in comparison.greedy}
    assert by_prompt["code"].first_divergence is None and by_prompt["code"].same_every_run
    assert by_prompt["qa"].first_divergence == len(" because of ") and by_prompt["qa"].plain_margin == 0.5
    assert comparison.warnings == []
    monkeypatch.setenv("STANDIN_PROMPT_TOKENS", "5")
    _, sampled = _run(_plan(write_tool(tmp_path), modes=(versus.HOST,), temperature=0.7), _report(plain))
    assert sampled.greedy == []  # sampled texts are not compared
    assert sampled.warnings == [
        f"prompt {p.name!r}: llama-speculative-simple read 5 prompt tokens where localspec read 4: the two did not "
        "decode the same prompt" for p in PROMPTS]


def test_a_failing_run_names_the_prompt_mode_and_its_last_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("STANDIN_LOG", str(tmp_path / "ran.jsonl"))
    monkeypatch.setenv("STANDIN_FAIL", "failed to load model '/m/target.gguf'")
    with pytest.raises(LocalspecError, match=r"llama-speculative-simple failed on prompt 'code' \(host sampling, "
                                             r"exit 1 .*main: error: failed to load model '/m/target.gguf'"):
        _run(_plan(write_tool(tmp_path)), _report())


def test_what_it_cannot_run_alike_is_refused_before_loading() -> None:
    preset = config.load_preset("default")
    versus.check_comparable(preset, has_draft_model=True, sweep=False)
    with pytest.raises(UsageError, match="leave out --sweep"):
        versus.check_comparable(preset, True, sweep=True)
    with pytest.raises(UsageError, match="not --drafter model without a draft model"):
        versus.check_comparable(preset, False, sweep=False)
    alike = r"--drafter model \(draft-simple\) or --drafter mtp \(draft-mtp\) do, not --drafter lookup$"
    with pytest.raises(UsageError, match=alike):
        versus.check_comparable(preset.with_overrides(drafter="lookup"), True, sweep=False)
    versus.check_comparable(preset.with_overrides(drafter="mtp"), False, sweep=False)  # no draft model needed
    with pytest.raises(UsageError, match="leave out --adaptive"):
        versus.check_comparable(preset.with_overrides(adaptive=True), True, sweep=False)


# -- the command ---------------------------------------------------------------------------------------------------


def test_bench_against_without_the_tool_is_one_line_and_exit_2(tiny_pair, tmp_path: Path) -> None:
    target, draft = tiny_pair
    env = {"PATH": os.path.dirname(sys.executable), versus.BIN_ENV: ""}
    r = localspec("bench", "--target", str(target), "--draft", str(draft), "--against", "llama.cpp", env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert "needs llama-speculative-simple" in r.stderr and "--llama-bin" in r.stderr
    r = localspec("bench", "--target", str(target), "--draft", str(draft), "--against", "llama.cpp",
                  "--llama-bin", str(tmp_path / "nope"), env=env)
    assert r.returncode == 2 and f"--llama-bin {tmp_path / 'nope'}: no llama-speculative-simple there" in r.stderr
    r = localspec("bench", "--target", str(target), "--draft", str(draft), "--against", "vllm", env=env)
    assert r.returncode == 2 and "--against" in r.stderr and "none, llama.cpp" in r.stderr


@pytest.mark.slow
def test_bench_against_a_stand_in_writes_the_comparison_into_the_json(tiny_pair, tmp_path: Path) -> None:
    target, draft = tiny_pair
    tool = write_tool(tmp_path / "bin")
    log, out = tmp_path / "ran.jsonl", tmp_path / "bench.json"
    r = localspec("bench", "--target", str(target), "--draft", str(draft), "--against", "llama.cpp",
                  "--llama-bin", str(tool.parent), "--repeat", "2", "--warmup", "0", "--max-tokens", "8",
                  "--threads", "1", "--temp", "0", "--json", str(out), env={"STANDIN_LOG": str(log)})
    assert r.returncode == 0, r.stdout + r.stderr
    said = " ".join(r.stdout.split())
    assert "against llama.cpp" in said and "localspec / llama.cpp:" in said
    report = json.loads(out.read_text())
    against = report["against"]
    assert against["tool"] == str(tool) and against["best_mode"] == "host"  # on a CPU: host sampling only
    assert len(against["runs"]) == 2 * 3 and against["temperature"] == 0
    assert against["ratio"] == pytest.approx(report["speculative"]["median_tps"] / against["modes"][0]["median_tps"])
    assert "gpus" in report["environment"] and "gpu_notes" in report["environment"]
    # The prompt files hold the text localspec read, and llama.cpp was given the bench's settings.
    ran = commands(log)
    assert len(ran) == 6 and all(c[c.index("-n") + 1] == "8" and c[c.index("--temp") + 1] == "0" for c in ran)


def _real_tool() -> Path | None:
    for candidate in (os.environ.get(versus.BIN_ENV, ""), shutil.which(versus.TOOL) or ""):
        try:
            return versus.find_tool(candidate, env={}) if candidate else None
        except UsageError:
            continue
    return None


@pytest.mark.slow
@pytest.mark.skipif(_real_tool() is None, reason=f"no real {versus.TOOL}: set {versus.BIN_ENV} to a llama.cpp build's "
                    "bin folder (building llama.cpp takes minutes; tests build nothing)")
def test_bench_against_the_real_tool_matches_plain_decoding_on_the_cpu(tiny_pair, tmp_path: Path) -> None:
    """On a CPU batch and single-token logits are bitwise equal, so llama.cpp's greedy speculative text must be
    localspec's plain decoding's: the two read the same prompt tokens and run the same model."""
    target, draft = tiny_pair
    out = tmp_path / "bench.json"
    r = localspec("bench", "--target", str(target), "--draft", str(draft), "--against", "llama.cpp",
                  "--llama-bin", str(_real_tool()), "--repeat", "1", "--warmup", "0", "--max-tokens", "24",
                  "--threads", "1", "--temp", "0", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    against = json.loads(out.read_text())["against"]
    assert against["warnings"] == [] and against["version"].startswith("version:")
    assert [g["first_divergence"] for g in against["greedy"]] == [None] * 3
    assert all(run["tokens"] >= 24 and run["seconds"] > 0 for run in against["runs"])
    assert against["ratio"] > 0


@pytest.mark.slow
@pytest.mark.skipif(_real_tool() is None, reason=f"no real {versus.TOOL}: set {versus.BIN_ENV} to a llama.cpp build's "
                    "bin folder (building llama.cpp takes minutes; tests build nothing)")
def test_bench_against_the_real_tool_with_the_mtp_head_matches_plain_decoding(hybrid_pair, tmp_path: Path) -> None:
    """The hybrid target's MTP head in both loops (localspec's `mtp` drafter, llama.cpp's draft-mtp): on a CPU
    llama.cpp's greedy text is plain decoding's too, and both draft."""
    out = tmp_path / "bench.json"
    r = localspec("bench", "--target", str(hybrid_pair[0]), "--drafter", "mtp", "--draft", "3", "--against",
                  "llama.cpp", "--llama-bin", str(_real_tool()), "--repeat", "1", "--warmup", "0", "--max-tokens",
                  "24", "--threads", "1", "--temp", "0", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    against = report["against"]
    assert against["warnings"] == [] and "-md" not in against["command"]
    assert [g["first_divergence"] for g in against["greedy"]] == [None] * 3
    assert all(run["drafted"] > 0 for run in against["runs"])
