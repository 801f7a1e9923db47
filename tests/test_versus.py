"""`localspec bench --against llama.cpp` (localspec.sessions.versus): finding
llama-speculative-simple, reading what it prints (a recorded run of the real tool), running it on the bench's prompts
and comparing; a stand-in tool beside the real one, which the slow test at the end runs when a build is found."""

from __future__ import annotations

import dataclasses
import json
import math
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
    # A seed a repetition, the same for every mode (as localspec's runs of that repetition: Sampling.repetition)
    assert [int(c[c.index("--seed") + 1]) for c in ran] == [7 + e.result.repetition for e in done]
    # host: 17 tokens in 0.25 s a prompt, 34 / 0.5 = 68 tok/s; backend: twice that
    modes = {m.config.mode: m for m in comparison.modes}
    assert [m.mode for m in comparison.modes] == ["k=5 host", "k=5 backend"]  # as the view names them
    assert comparison.first_pass == [] and comparison.first_pass_runs == []  # two configurations: no first pass
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


@pytest.mark.parametrize(("drafter", "spec_type"), [("dflash", "draft-dflash"), ("dspark", "draft-dspark"),
                                                    ("eagle3", "draft-eagle3")])
def test_a_drafter_reading_the_targets_layers_runs_as_its_spec_type_with_its_gguf_as_the_draft(
        tmp_path: Path, monkeypatch, drafter: str, spec_type: str) -> None:
    """DFlash, DSpark and EAGLE-3 are llama.cpp's block and EAGLE-3 loops with the drafter's GGUF as -md (and its
    draft options), the length and DSpark's confidence threshold (`p_min`) as localspec drafts them."""
    log = tmp_path / "ran.jsonl"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    tool = write_tool(tmp_path)
    _run(_plan(tool, (versus.HOST,), drafter=drafter, n_draft=4, p_min=0.25), _report())
    first = commands(log)[0]
    opt = {first[i]: first[i + 1] for i in range(len(first) - 1) if first[i].startswith("-")}
    assert opt["--spec-type"] == spec_type and opt["-md"] == "/m/draft.gguf" and opt["--spec-draft-n-max"] == "4"
    assert opt["--spec-draft-p-min"] == "0.25" and {"-ngld", "-ctkd", "-ctvd", "-td"} <= set(first)


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
        "decode the same prompt" for p in PROMPTS] + [
        "this llama-speculative-simple has no --spec-draft-sampling (an older llama.cpp): its draft is greedy only, "
        "no probabilistic draft was compared"]


def test_a_failing_run_names_the_prompt_mode_and_its_last_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("STANDIN_LOG", str(tmp_path / "ran.jsonl"))
    monkeypatch.setenv("STANDIN_FAIL", "failed to load model '/m/target.gguf'")
    with pytest.raises(LocalspecError, match=r"llama-speculative-simple failed on prompt 'code' \(k=5 host sampling, "
                                             r"exit 1 .*main: error: failed to load model '/m/target.gguf'"):
        _run(_plan(write_tool(tmp_path)), _report())


def test_what_it_cannot_run_alike_is_refused_before_loading() -> None:
    preset = config.load_preset("default")
    versus.check_comparable(preset, has_draft_model=True, sweep=False)
    with pytest.raises(UsageError, match="leave out --sweep"):
        versus.check_comparable(preset, True, sweep=True)
    with pytest.raises(UsageError, match="not --drafter model without a draft model"):
        versus.check_comparable(preset, False, sweep=False)
    alike = (r"--drafter model \(draft-simple\) or --drafter mtp \(draft-mtp\) or --drafter dflash \(draft-dflash\) "
             r"or --drafter dspark \(draft-dspark\) or --drafter eagle3 \(draft-eagle3\) do, not --drafter lookup$")
    with pytest.raises(UsageError, match=alike):
        versus.check_comparable(preset.with_overrides(drafter="lookup"), True, sweep=False)
    versus.check_comparable(preset.with_overrides(drafter="mtp"), False, sweep=False)  # no draft model needed
    for drafter in ("dflash", "dspark", "eagle3"):  # the drafter's GGUF is the tool's -md
        versus.check_comparable(preset.with_overrides(drafter=drafter), True, sweep=False)
        with pytest.raises(UsageError, match=f"not --drafter {drafter} without a draft model"):
            versus.check_comparable(preset.with_overrides(drafter=drafter), False, sweep=False)
    with pytest.raises(UsageError, match="leave out --adaptive"):
        versus.check_comparable(preset.with_overrides(adaptive=True), True, sweep=False)


# -- the search: draft lengths, draft sampling, sampling modes ------------------------------------------------------


def _newer(monkeypatch, tmp_path: Path, **env: str) -> Path:
    """A stand-in for a llama.cpp with --spec-draft-sampling; its command lines logged to tmp_path/ran.jsonl."""
    monkeypatch.setenv("STANDIN_LOG", str(tmp_path / "ran.jsonl"))
    monkeypatch.setenv("STANDIN_DRAFT_SAMPLING", "1")
    monkeypatch.setenv("STANDIN_PROMPT_TOKENS", "4")  # what localspec read of PROMPTS
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return write_tool(tmp_path / "newer")


def _searched(tool: Path, temperature: float, lengths: tuple[int, ...] = (2, 3, 4), **overrides: object) -> versus.Plan:
    plan = _plan(tool, temperature=temperature, **overrides)
    return dataclasses.replace(plan, lengths=lengths,
                               draft_samplings=versus.draft_samplings(plan.tool, temperature))


def _option(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_the_probe_finds_the_draft_sampling_option_and_the_version_gives_build_and_commit(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    old = versus.probe_tool(write_tool(tmp_path / "old"))
    assert not old.draft_sampling and old.build == (4242, "standin")
    new = versus.probe_tool(_newer(monkeypatch, tmp_path, STANDIN_VERSION="version: 11549 (8f2c1a0)"))
    assert new.draft_sampling and new.build == (11549, "8f2c1a0")
    assert versus.Tool(Path("x"), "", False).build == (None, None)
    # Both draft sampling modes where it has them and the temperature samples; greedy alone at T = 0; none named
    # where the tool predates the option.
    assert versus.draft_samplings(new, 0.7) == ("greedy", "probabilistic")
    assert versus.draft_samplings(new, 0.0) == ("greedy",)
    assert versus.draft_samplings(old, 0.7) == (None,)


def test_every_configuration_is_a_length_a_draft_sampling_and_a_sampling_mode(tmp_path: Path, monkeypatch) -> None:
    plan = _searched(_newer(monkeypatch, tmp_path), 0.7)
    assert len(plan.configs) == 3 * 2 * 2
    assert plan.configs[0] == versus.Config(2, "greedy", "host")
    assert {c.label for c in plan.configs} >= {"k=2 greedy-draft host", "k=4 probabilistic-draft backend"}
    cmd = plan.command(Path("p.txt"), versus.Config(4, "probabilistic", "backend"))
    assert _option(cmd, "--spec-draft-n-max") == "4" and _option(cmd, "--spec-draft-sampling") == "probabilistic"
    assert "--backend-sampling" in cmd
    old = plan.command(Path("p.txt"), versus.Config(3, None, "host"))
    assert "--spec-draft-sampling" not in old and "--backend-sampling" not in old
    assert _option(old, "--spec-draft-n-max") == "3"
    # Without lengths (bench/structured.py's plans): the preset's draft length, no draft sampling named.
    assert _plan(tool=write_tool(tmp_path / "old")).configs == (versus.Config(5, None, "host"),
                                                               versus.Config(5, None, "backend"))


def test_the_first_pass_picks_two_finalists_and_the_better_full_median_is_the_comparison(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    """12 configurations at T = 0.7: a probe (one prompt, k = 2 with a greedy and a probabilistic draft: they differ,
    so the search keeps both), then a first pass of one repetition each picks the two fastest (k = 3, then k = 4,
    both probabilistic drafts with backend sampling); in the full repeats the first pass's winner turns out slower
    (the stand-in slows k = 3 down from then on), so the other finalist's median is the comparison."""
    factors = {"k=2": 2.0, "k=3": 1.0, "k=4": 1.2, "probabilistic": 0.7, "backend": 0.8}
    tool = _newer(monkeypatch, tmp_path, STANDIN_SECONDS="0.25", STANDIN_FACTORS=json.dumps(factors),
                  STANDIN_AFTER=str(2 + 12 * 2), STANDIN_LATER_FACTORS=json.dumps({"k=3": 1.5}),
                  STANDIN_PROBABILISTIC_ACCEPT="50")
    done, comparison = _run(_searched(tool, 0.7), _report())
    probe, first, full = done[:2], done[2:26], done[26:]
    assert {e.total for e in done} == {2 + 24 + 2 * 3 * 2} and [e.done for e in done] == list(range(1, 39))
    assert [(e.result.repetition, e.result.config) for e in probe] == [
        (-1, versus.Config(2, "greedy", "host")), (-1, versus.Config(2, "probabilistic", "host"))]
    assert {e.result.repetition for e in first} == {0} and len({e.result.config for e in first}) == 12

    def rate(*names: str) -> float:  # a configuration's tok/s: 17 tokens a prompt in 0.25 s times its factors
        return 17 / (0.25 * math.prod(factors.get(n, 1.0) for n in names))

    by_config = {m.config: m for m in comparison.first_pass}
    assert len(by_config) == 12 and all(m.runs == 1 for m in by_config.values())
    assert by_config[versus.Config(2, "greedy", "host")].median_tps == pytest.approx(rate("k=2"))
    # seconds factors 0.56 (k = 3), 0.672 (k = 4), then 0.7 (k = 3 probabilistic, host sampling), ...
    ranked = sorted(by_config.values(), key=lambda m: -m.median_tps)
    k3, k4 = versus.Config(3, "probabilistic", "backend"), versus.Config(4, "probabilistic", "backend")
    assert [m.config for m in ranked[:3]] == [k3, k4, versus.Config(3, "probabilistic", "host")]
    assert [m.config for m in comparison.modes] == [k3, k4] and all(m.runs == 3 for m in comparison.modes)
    assert {e.result.config for e in full} == {k3, k4} and len(full) == 2 * 3 * 2
    # in the repeats k = 3 runs 1.5 times slower (0.84): k = 4 is the comparison
    assert comparison.best.config == k4
    assert comparison.best.median_tps == pytest.approx(rate("k=4", "probabilistic", "backend"))
    assert comparison.ratio == pytest.approx(96.0 / rate("k=4", "probabilistic", "backend"))
    assert _option(comparison.command, "--spec-draft-sampling") == "probabilistic"
    assert _option(comparison.command, "--spec-draft-n-max") == "4" and "--backend-sampling" in comparison.command
    assert comparison.warnings == [] and comparison.greedy == []  # sampled: no greedy texts compared
    data = json.loads(json.dumps(comparison.as_json()))
    assert data["search"]["lengths"] == [2, 3, 4] and data["search"]["draft_sampling"] == ["greedy", "probabilistic"]
    assert data["search"]["probabilistic_draft"] is True and data["search"]["probabilistic_changed"] is True
    assert data["search"]["finalists"] == ["k=3 probabilistic-draft backend", "k=4 probabilistic-draft backend"]
    assert len(data["search"]["first_pass"]) == 12 and len(data["runs"]) == 12
    assert len(data["first_pass_runs"]) == 2 + 24  # (the probe's runs, repetition -1, and the first pass's)
    assert data["best"]["n_draft"] == 4 and data["best"]["draft_sampling"] == "probabilistic"
    assert data["best_mode"] == "backend" and data["ratio"] == pytest.approx(comparison.ratio)
    assert data["runs"][0]["n_draft"] in (3, 4) and data["runs"][0]["draft_sampling"] == "probabilistic"
    assert data["build"] == 4242 and data["commit"] == "standin"
    # what it ran: the probe's 2, the first pass's 24, then the finalists' repeats, alternating
    ran = commands(tmp_path / "ran.jsonl")
    assert len(ran) == 38
    repeats = [(_option(c, "--spec-draft-n-max"), _option(c, "--spec-draft-sampling")) for c in ran[26:]]
    assert repeats[:4] == [("3", "probabilistic")] * 2 + [("4", "probabilistic")] * 2  # (two prompts)
    assert repeats[4:8] == [("4", "probabilistic")] * 2 + [("3", "probabilistic")] * 2


def test_a_probabilistic_draft_that_changes_nothing_is_reported_as_sample_and_match(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """llama.cpp b11549's llama-speculative-simple takes --spec-draft-sampling probabilistic and still verifies by
    sample-and-match (its rejection sampling is llama-server's): the same runs both ways. The report must not pass
    such a comparison off as one with llama.cpp's rejection sampling."""
    tool = _newer(monkeypatch, tmp_path)  # the stand-in's probabilistic runs accept what its greedy ones do
    done, comparison = _run(_searched(tool, 0.7, lengths=(3, 4)), _report())
    assert comparison.probabilistic_changed is False
    (warning,) = comparison.warnings
    assert warning.startswith("--spec-draft-sampling probabilistic changed nothing in this llama-speculative-simple")
    assert warning.endswith("this comparison at T = 0.7 is with sample-and-match; the search then ran greedy drafts "
                            "only")
    # The probe's two runs showed it, so the search left the probabilistic configurations out: 4 of 8 configurations
    # once over the 2 prompts, then 2 finalists x 3 repetitions x 2 prompts.
    ran = commands(tmp_path / "ran.jsonl")
    assert [_option(c, "--spec-draft-sampling") for c in ran[:2]] == ["greedy", "probabilistic"]
    assert len(ran) == 2 + 4 * 2 + 2 * 3 * 2 and all(_option(c, "--spec-draft-sampling") == "greedy" for c in ran[2:])
    assert {e.total for e in done[2:]} == {2 + 4 * 2 + 2 * 3 * 2}
    assert comparison.as_json()["search"]["probabilistic_changed"] is False
    # One configuration's probabilistic runs differing is enough to call it changed; at T = 0 nothing is compared.
    monkeypatch.setenv("STANDIN_PROBABILISTIC_ACCEPT", "52")
    _, changed = _run(_searched(tool, 0.7, lengths=(3,)), _report())
    assert changed.probabilistic_changed is True and changed.warnings == []
    assert {m.config.draft_sampling for m in changed.first_pass} == {"greedy", "probabilistic"}  # all searched
    _, greedy = _run(_searched(tool, 0.0, lengths=(3,)), _report())
    assert greedy.probabilistic_changed is None


def test_an_older_tool_runs_greedy_drafts_only_and_the_report_says_so(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "ran.jsonl"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    monkeypatch.setenv("STANDIN_PROMPT_TOKENS", "4")
    tool = write_tool(tmp_path / "old")
    plan = _searched(tool, 0.7, lengths=(2, 3), modes=(versus.HOST,))
    _, comparison = _run(plan, _report())
    assert all("--spec-draft-sampling" not in c for c in commands(log))  # it would refuse the option
    assert comparison.first_pass == [] and [m.mode for m in comparison.modes] == ["k=2 host", "k=3 host"]
    assert comparison.warnings == ["this llama-speculative-simple has no --spec-draft-sampling (an older llama.cpp): "
                                   "its draft is greedy only, no probabilistic draft was compared"]
    data = comparison.as_json()
    assert data["search"]["probabilistic_draft"] is False and data["search"]["draft_sampling"] == [None]


def test_at_t0_each_finalist_drafts_greedily_and_its_text_is_checked(tmp_path: Path, monkeypatch) -> None:
    tool = _newer(monkeypatch, tmp_path, STANDIN_FACTORS=json.dumps({"k=2": 3.0}),
                  STANDIN_REPLIES=json.dumps({"Write code.\n": " def f(): pass",
                                              "Question: why?\nAnswer:": " because of physics"}))
    plain = {"code": " def f(): pass", "qa": " because of chemistry"}
    _, comparison = _run(_searched(tool, 0.0, modes=(versus.HOST,)), _report(plain))
    assert {_option(c, "--spec-draft-sampling") for c in commands(tmp_path / "ran.jsonl")} == {"greedy"}
    assert [m.mode for m in comparison.modes] == ["k=3 greedy-draft host", "k=4 greedy-draft host"]
    assert [(g.mode, g.prompt, g.first_divergence) for g in comparison.greedy] == [
        ("k=3 greedy-draft host", "code", None), ("k=3 greedy-draft host", "qa", len(" because of ")),
        ("k=4 greedy-draft host", "code", None), ("k=4 greedy-draft host", "qa", len(" because of "))]
    assert comparison.warnings == []


# -- the preset key and its option ------------------------------------------------------------------------------


def test_the_draft_lengths_are_a_range_or_a_list_and_a_bad_one_names_its_key(tmp_path: Path) -> None:
    assert config.load_preset("default").bench.against_lengths == "2-6"
    assert config.parse_draft_lengths("2-6") == (2, 3, 4, 5, 6)
    assert config.parse_draft_lengths(" 6, 2-3,3 ") == (2, 3, 6)
    assert config.parse_draft_lengths("4") == (4,)
    for bad in ("", "6-2", "0-3", "2-33", "two", "2-", "-3", "2..6"):
        with pytest.raises(ValueError):
            config.parse_draft_lengths(bad)
    preset = config.load_preset("default").with_overrides(against_lengths="3-5")
    assert preset.bench.against_lengths == "3-5"
    with pytest.raises(config.ConfigError, match=r"--against-lengths = '6-2': draft lengths must be between 1 and 32"):
        config.load_preset("default").with_overrides(against_lengths="6-2", flags={"against_lengths":
                                                                                   "--against-lengths"})
    mine = tmp_path / "mine.toml"
    mine.write_text('[bench]\nagainst_lengths = "2 to 6"\n')
    with pytest.raises(config.ConfigError, match=r"mine\.toml.*bench\.against_lengths = '2 to 6': expected draft "
                                                 r"lengths as a range or a list, e\.g\. 2-6 or 2,4,6"):
        config.load_preset(str(mine))


def test_a_bad_against_lengths_option_is_one_line_and_exit_2(tiny_pair) -> None:
    target, draft = tiny_pair
    r = localspec("bench", "--target", str(target), "--draft", str(draft), "--against-lengths", "0-4")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert "--against-lengths" in r.stderr and "between 1 and 32" in r.stderr


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
                  "--threads", "1", "--temp", "0", "--json", str(out), "--against-lengths", "2-4",
                  env={"STANDIN_LOG": str(log), "STANDIN_FACTORS": json.dumps({"k=2": 2.0})})
    assert r.returncode == 0, r.stdout + r.stderr
    said = " ".join(r.stdout.split())
    assert "against llama.cpp" in said and "localspec / llama.cpp:" in said
    assert "3 configurations (draft lengths 2, 3, 4; greedy draft; host sampling) once each, then the 2 fastest" in said
    report = json.loads(out.read_text())
    against = report["against"]
    assert against["tool"] == str(tool) and against["best_mode"] == "host"  # on a CPU: host sampling only
    # the first pass: each length once over the 3 prompts; then the two fastest (k = 3, 4; k = 2 is twice as slow)
    assert [m["n_draft"] for m in against["search"]["first_pass"]] == [2, 3, 4]
    assert against["search"]["finalists"] == ["k=3 host", "k=4 host"] and against["search"]["lengths"] == [2, 3, 4]
    assert len(against["first_pass_runs"]) == 3 * 3 and len(against["runs"]) == 2 * 2 * 3
    assert against["temperature"] == 0
    best = max(m["median_tps"] for m in against["modes"])
    assert against["ratio"] == pytest.approx(report["speculative"]["median_tps"] / best)
    assert {g["mode"] for g in against["greedy"]} == {"k=3 host", "k=4 host"}  # each finalist's greedy text
    assert "gpus" in report["environment"] and "gpu_notes" in report["environment"]
    # The prompt files hold the text localspec read, and llama.cpp was given the bench's settings.
    ran = commands(log)
    assert len(ran) == 9 + 12 and all(c[c.index("-n") + 1] == "8" and c[c.index("--temp") + 1] == "0" for c in ran)


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
