"""`localspec bench` end to end on the offline demo pair, and the CLI's error handling."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from localspec.cli.app import app
from localspec.sessions import bench

runner = CliRunner()


def localspec(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real entry point in a subprocess: exit codes and stderr exactly as a user sees them."""
    return subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", *args],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_bench_json_on_demo_pair(use_demo_home, tmp_path):
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "--repeat", "2", "--warmup", "2", "--max-tokens", "8",
                                 "--threads", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "median" in result.output and "✓" in result.output
    report = json.loads(out.read_text())
    assert report["preset"]["sampling"]["temperature"] == 0.7
    assert report["n_draft"] == 6 and report["max_tokens"] == 8
    check = report["greedy_check"]
    assert check["exact"] and check["passed"] and check["diverged"] == 0 and check["broken"] == 0  # CPU
    assert [p["name"] for p in check["prompts"]] == ["code", "prose", "qa"]
    for p in check["prompts"]:
        assert p["first_divergence"] is None and p["divergences"] == [] and p["tokens"] == 8
        assert len(p["plain_tokens"]) == len(p["plain_token_ends"]) == len(p["plain_margins"]) == 8
        assert p["plain_token_ends"][-1] == len(p["plain_text"]) and min(p["plain_margins"]) >= 0
    assert report["plain"]["runs"] == report["speculative"]["runs"] == 2
    assert [r["mode"] for r in report["runs"]] == ["plain", "speculative", "speculative", "plain"]  # interleaved
    spec_runs = [r for r in report["runs"] if r["mode"] == "speculative"]
    assert all(r["tokens"] == 3 * 8 for r in report["runs"])  # every prompt of the set, every run
    assert report["speculative"]["median_tps"] == pytest.approx(
        sorted(r["decode_tps"] for r in spec_runs)[0] / 2 + sorted(r["decode_tps"] for r in spec_runs)[1] / 2)
    # On a CPU the demo's draft step costs about a one-token verify: the default stands aside, and says why.
    spec = report["speculative"]
    assert spec["stood_aside"] >= 0.5 and "a draft step costs" in spec["aside"], spec
    assert 0 <= spec["acceptance_rate"] <= 1 and all(r["stood_aside"] > 0 for r in spec_runs)
    assert report["speedup"] == pytest.approx(report["speculative"]["median_tps"] / report["plain"]["median_tps"])
    env = report["environment"]
    assert env["llama_cpp_python"] == "0.3.36" and env["pair"] == "demo" and env["cpu"]
    assert env["target"]["path"].endswith("gemma-3-270m-q4_k_m.gguf")
    assert env["draft"]["path"].endswith("gemma-3-270m-q2_k-draft.gguf")
    # The verdict tells the truth: it stood aside, at what speed against plain decoding, and why.
    low, high = report["plain_spread"]
    assert low <= 1.0 <= high
    as_plain = spec["stood_aside"] >= bench.ALL_ASIDE and low <= report["speedup"] <= high
    assert report["decoded_as_plain"] == as_plain
    said_first = (f"the draft model does not pay here, so it stood aside and decoded as plain decoding does: "
                  f"{report['speedup']:.2f}x plain is this machine's run-to-run noise" if as_plain else
                  f"the draft model does not pay here, so it stood aside: {report['speedup']:.2f}x")
    assert report["verdict"].startswith(said_first)
    assert spec["aside"] in report["verdict"] and "stood aside" in result.output
    # ... and suggests no draft-length sweep: no length could pay (the GPU quick start instead)
    assert report["advice"][-1].startswith("next: with an NVIDIA GPU") and "--sweep" not in " ".join(report["advice"])
    # The built-in demo's second part: prompt lookup (no draft model), greedy, on the lookup prompt set.
    lookup = report["lookup_demo"]
    assert lookup["preset"]["draft"]["drafter"] == "lookup" and lookup["preset"]["sampling"]["temperature"] == 0.0
    assert [p["name"] for p in lookup["greedy_check"]["prompts"]] == ["code-edit", "summarise", "json"]
    assert lookup["greedy_check"]["passed"] and lookup["greedy_check"]["exact"]
    assert lookup["speculative"]["runs"] == 2 and lookup["speedup"] > 0
    said = " ".join(result.output.split())
    assert f"prompt lookup (no draft model) on replies that repeat their prompt: {lookup['speedup']:.2f}x" in said
    # Each part's verdict under its own table; the drafter to use on this machine last.
    assert said.index("speedup (median speculative") < said.index("next:") < said.index("and prompt lookup")
    assert said.index("plain vs prompt lookup") < said.index("prompt lookup (no draft model) on replies")
    last = said[said.rindex("on this machine:"):]  # the last paragraph (rich wraps it at the runner's width)
    assert said.index("report written to") < said.rindex("on this machine:")
    assert f"prompt lookup {lookup['speedup']:.2f}x plain" in last
    said_aside = "stood aside (decoding as plain does, within this machine's noise)," if as_plain else "stood aside,"
    assert f"the draft model {said_aside} {report['speedup']:.2f}x" in last


@pytest.mark.slow
def test_bench_greedy_preset_checks_token_identity_on_the_cpu(use_demo_home):
    from localspec.models import demo

    # The demo's files by path, not by its name: the built-in demo's second part (prompt lookup, which prints the
    # same check lines) does not run, so the lines below are the draft model's.
    result = runner.invoke(app, ["bench", "--target", str(demo.target_path()), "--draft", str(demo.draft_path()),
                                 "--preset", "greedy", "--repeat", "1", "--warmup", "0", "--max-tokens", "8",
                                 "--draft", "3", "--threads", "1"])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())  # rich wraps long lines at the runner's terminal width
    assert "checking greedy fidelity on 3 prompts" in output
    assert "✓ greedy: speculative output is token-identical to plain decoding on 3 of 3 prompts" in output
    assert "draft length 3" in output and "prompt lookup" not in output


def test_unknown_preset_is_one_line_and_exit_2(demo_home):
    env = {"LOCALSPEC_HOME": str(demo_home), "PATH": "/usr/bin:/bin"}
    r = localspec("bench", "--preset", "nope", env=env)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "localspec: error: unknown preset 'nope' (available: agent, default, greedy, qwen3-instruct, qwen3-thinking, "
        "smollm2-chat)"]
    assert "Traceback" not in r.stderr


def test_bad_preset_file_names_file_key_and_range(tmp_path, demo_home):
    bad = tmp_path / "mine.toml"
    bad.write_text("[draft]\nn_draft = 40\n")
    r = localspec("bench", "--preset", str(bad), env={"LOCALSPEC_HOME": str(demo_home)})
    assert r.returncode == 2
    assert f"{bad}: draft.n_draft = 40: allowed range is 0..32" in r.stderr


def test_debug_shows_the_traceback(demo_home):
    r = localspec("bench", "--preset", "nope", env={"LOCALSPEC_HOME": str(demo_home), "LOCALSPEC_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr and "ConfigError" in r.stderr


def test_draft_option_takes_a_length_or_a_path_once_each(tmp_path):
    from localspec.cli.options import split_draft_values
    from localspec.errors import LocalspecError

    assert split_draft_values(["4", "d.gguf"]) == (4, __import__("pathlib").Path("d.gguf"))
    assert split_draft_values(None) == (None, None)
    with pytest.raises(LocalspecError, match="draft length was already given"):
        split_draft_values(["4", "5"])
    with pytest.raises(LocalspecError, match="draft model was already given"):
        split_draft_values(["a.gguf", "b.gguf"])


def test_missing_model_file_is_named(tmp_path):
    r = localspec("bench", "--target", str(tmp_path / "missing.gguf"), "--draft", str(tmp_path / "d.gguf"),
                  env={"LOCALSPEC_HOME": str(tmp_path)})
    assert r.returncode == 2 and "missing.gguf: model file not found" in r.stderr


def test_bench_refuses_draft_zero(use_demo_home):
    r = localspec("bench", "--draft", "0", env={"LOCALSPEC_HOME": str(use_demo_home)})
    assert r.returncode == 2 and "--draft 0 turns speculation off" in r.stderr


def test_json_folder_must_exist(use_demo_home, tmp_path):
    r = localspec("bench", "--json", str(tmp_path / "no" / "r.json"), env={"LOCALSPEC_HOME": str(use_demo_home)})
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("localspec 0.1.0")


@pytest.mark.slow
def test_sweep_table_json_and_saved_preset(use_demo_home, tmp_path):
    out = tmp_path / "sweep.json"
    result = runner.invoke(app, ["bench", "--sweep", "1,3", "--preset", "greedy", "--repeat", "1", "--warmup", "1",
                                 "--max-tokens", "8", "--threads", "1", "--json", str(out),
                                 "--save-preset", "tuned"])
    assert result.exit_code == 0, result.output
    assert "draft length sweep" in result.output and "█" in result.output
    report = json.loads(out.read_text())
    # the fixed lengths always draft; the preset's own policy (draft length 6, standing aside where it loses) is
    # a row of its own, and never the "best fixed length"
    assert [(r["n_draft"], r["policy"]) for r in report["rows"]] == [(0, "fixed"), (1, "fixed"), (3, "fixed"),
                                                                     (6, "default")]
    assert report["rows"][1]["stood_aside"] == 0 == report["rows"][2]["stood_aside"]
    best_row = max(report["rows"][1:3], key=lambda r: r["median_tps"])
    best = best_row["n_draft"]
    assert report["best_n_draft"] == best
    assert report["default_over_best_fixed"] == report["rows"][3]["median_tps"] / best_row["median_tps"]
    assert "default (6)" in result.output and "x the best fixed length" in result.output
    from localspec.config import load_preset

    saved = load_preset("tuned")
    assert saved.draft.n_draft == best and saved.sampling.temperature == 0.0


@pytest.mark.parametrize(("value", "message"), [("2,x", "expected comma-separated"), ("0,4", "between 1 and 32")])
def test_sweep_values_are_checked(use_demo_home, value, message):
    r = localspec("bench", "--sweep", value, env={"LOCALSPEC_HOME": str(use_demo_home)})
    assert r.returncode == 2 and message in r.stderr


def test_save_preset_needs_sweep(use_demo_home):
    r = localspec("bench", "--save-preset", "x", env={"LOCALSPEC_HOME": str(use_demo_home)})
    assert r.returncode == 2 and "--save-preset needs --sweep" in r.stderr


# -- where each verdict is printed (output redirected: no live terminal) ---------------------------------------------


def _scripted_bench(speedups: dict[str, float], lengths: list[int] | None = None):
    """`run_bench` as a script: one plain and one speculative run per part at the given speed-up (by drafter), then
    the report, so the printing order is tested without minutes of decoding (the real run: the slow test above)."""
    from localspec.rounds.events import GenerationStats
    from localspec.sessions.bench import PLAIN, SPEC, BenchReport, GreedyCheck, ModeSummary, RunDone, RunResult

    def run_bench(session, preset, prompts=None, raw=False):
        speedup = speedups[preset.draft.drafter]
        runs = [RunResult(PLAIN, 0, GenerationStats(tokens=200, rounds=200, decode_s=10.0), 0.0, {}),
                RunResult(SPEC, 0, GenerationStats(tokens=200, rounds=50, drafted=180, accepted=150,
                                                   decode_s=10.0 / speedup, draft_lengths=list(lengths or [])),
                          0.0, {})]
        for i, run in enumerate(runs):
            yield RunDone(run, i + 1, len(runs))
        yield BenchReport(preset=preset, n_draft=preset.draft.n_draft, max_tokens=preset.bench.max_tokens,
                          plain=ModeSummary.of(PLAIN, runs[:1]), speculative=ModeSummary.of(SPEC, runs[1:]),
                          greedy_check=GreedyCheck(exact=True, prompts=[], near_tie=1.0), runs=runs, environment={})

    return run_bench


def _redirected_bench(monkeypatch, pair: str, speedups: dict[str, float], *args: str, session=None,
                      lengths: list[int] | None = None) -> list[str]:
    from contextlib import contextmanager
    from pathlib import Path

    from localspec import config
    from localspec.cli import bench_cmd, options
    from localspec.sessions.session import ModelFiles

    @contextmanager
    def no_session(files, preset):
        yield None

    files = ModelFiles(target=Path("target.gguf"), draft=Path("draft.gguf"), name=pair)
    monkeypatch.setattr(options, "resolve_run", lambda run, command, **more: (
        files, config.load_preset().with_overrides(drafter=run.drafter,
                                                   **{k: v for k, v in more.items() if v is not None})))
    monkeypatch.setattr(bench_cmd, "open_session", session or no_session)
    monkeypatch.setattr(bench_cmd, "placement", lambda s: {"target": "CPU", "draft": "CPU", "draft_ahead": False})
    monkeypatch.setattr(bench_cmd, "threads_line", lambda s: "1")
    monkeypatch.setattr(bench_cmd, "prompt_mode", lambda s, raw: "raw completion")
    monkeypatch.setattr(bench_cmd, "run_bench", _scripted_bench(speedups, lengths))
    result = runner.invoke(app, ["bench", *args], env={"COLUMNS": "200"})  # CliRunner's stdout is no terminal
    assert result.exit_code == 0, result.output
    return [line.strip() for line in result.output.splitlines() if line.strip()]


def test_each_parts_verdict_sits_under_its_own_table_and_the_last_line_names_the_drafter(monkeypatch):
    lines = _redirected_bench(monkeypatch, "demo", {"model": 0.4, "lookup": 1.5})
    text = "\n".join(lines)
    model_table = text.index("decode tok/s, plain vs speculative")
    lookup_intro = text.index("and prompt lookup")
    lookup_table = text.index("decode tok/s, plain vs prompt lookup")
    # The draft model's verdict, its check and its advice: under its table, before the lookup part starts.
    for said in ("speedup (median speculative / median plain): 0.40x", "SLOWER than plain decoding",
                 "✓ greedy", "expected on a CPU", "next: with an NVIDIA GPU"):
        assert model_table < text.index(said) < lookup_intro, said
    # Prompt lookup's: under its own table.
    headline = text.index("prompt lookup (no draft model) on replies that repeat their prompt: 1.50x")
    assert lookup_table < headline and lookup_table < text.rindex("✓ greedy")
    # The summary, last: which drafter to use here, with both parts' figures.
    assert lines[-1].startswith("on this machine: use `--drafter lookup`"), lines[-1]
    assert "0.40x" in lines[-1] and "1.50x" in lines[-1]


@pytest.mark.parametrize(("speedups", "last"), [
    ({"model": 1.6}, "on this machine: use `--drafter model`"),
    ({"model": 0.7}, "on this machine: no drafter measured here beats plain decoding"),
])
def test_a_one_part_bench_ends_with_the_drafter_to_use(monkeypatch, speedups, last):
    lines = _redirected_bench(monkeypatch, "mine", speedups)
    assert lines[-1].startswith(last), lines[-1]
    verdict = next(i for i, line in enumerate(lines) if line.startswith("speedup (median speculative"))
    table = next(i for i, line in enumerate(lines) if line.startswith("decode tok/s, plain vs speculative"))
    assert table < verdict < len(lines) - 1


def test_a_sweep_past_the_preset_length_on_a_hybrid_target(hybrid_pair, tmp_path, monkeypatch):
    """A recurrent target keeps as many snapshots as the longest length it is asked for: a sweep to 7 with the
    MTP head's preset length, 4, loads for 7 (before, "draft length 7: this model's recurrent state rolls back at
    most 4 tokens")."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    out = tmp_path / "sweep.json"
    result = runner.invoke(app, ["bench", "--target", str(hybrid_pair[0]), "--drafter", "mtp", "--sweep", "2,7",
                                 "--preset", "greedy", "--repeat", "1", "--warmup", "0", "--max-tokens", "8",
                                 "--threads", "1", "--raw", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n_draft"], r["policy"]) for r in rows] == [(0, "fixed"), (2, "fixed"), (7, "fixed"), (4, "default")]
    assert rows[2]["acceptance_rate"] > 0  # the 7-token rounds drafted and were verified



def test_several_drafters_each_get_a_table_and_the_last_line_picks_from_all(monkeypatch):
    """`--drafters model,lookup`: each drafter's table and verdict in turn on one session, then the fastest named
    last with both figures (the real run on real files: tests/test_dflash_drafter.py)."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from localspec.cli import bench_cmd

    checked: list[str] = []
    engine = SimpleNamespace(check_drafter=lambda drafting: checked.append(f"engine:{drafting.drafter}"))

    @contextmanager
    def session(files, preset, longest_draft=None):
        checked.append(f"open:{preset.draft.drafter}")
        yield SimpleNamespace(engine=engine)

    monkeypatch.setattr(bench_cmd, "read_header", lambda path: None)
    monkeypatch.setattr(bench_cmd, "check_drafting", lambda target, draft, preset: checked.append(preset.draft.drafter))
    lines = _redirected_bench(monkeypatch, "mine", {"model": 0.9, "lookup": 1.3}, "--drafters", "model,lookup",
                              session=session)
    text = "\n".join(lines)
    model_table = text.index("decode tok/s, plain vs the draft model")
    lookup_table = text.index("decode tok/s, plain vs prompt lookup")
    assert model_table < text.index("speedup (median speculative / median plain): 0.90x") < lookup_table
    assert lookup_table < text.index("speedup (median speculative / median plain): 1.30x")
    assert lines[-1].startswith("on this machine: use `--drafter lookup`"), lines[-1]
    assert "the draft model 0.90x plain" in lines[-1] and "prompt lookup 1.30x plain" in lines[-1]
    # Every drafter checked against the headers and the session's engine before the first is measured; the
    # session opened for the drafter that reads the draft file.
    assert checked == ["model", "lookup", "open:model", "engine:model", "engine:lookup"]


@pytest.mark.parametrize(("args", "message"), [
    (["--drafters", "mtp,nope"], "unknown drafter 'nope'"),
    (["--drafters", "mtp,mtp"], "each drafter once"),
    (["--drafters", "model,lookup", "--sweep", "2,4"], "--sweep and --against take one drafter"),
])
def test_several_drafters_refuse_what_they_cannot_measure(use_demo_home, args, message):
    r = localspec("bench", *args, env={"LOCALSPEC_HOME": str(use_demo_home)})
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_several_drafters_name_the_one_these_models_cannot_run_before_measuring(tiny_pair, tmp_path):
    target, draft = tiny_pair
    r = localspec("bench", "--target", str(target), "--draft", str(draft), "--drafters", "lookup,mtp",
                  "--threads", "1", env={"LOCALSPEC_HOME": str(tmp_path)})
    assert r.returncode == 2 and "mtp" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "decode tok/s" not in r.stdout  # nothing measured: the lookup part did not run first
    r = localspec("bench", "--target", str(target), "--drafters", "lookup,model", "--threads", "1",
                  env={"LOCALSPEC_HOME": str(tmp_path)})
    assert r.returncode == 2 and "model needs a draft file" in r.stderr, r.stderr


@pytest.mark.parametrize(("drafter", "lengths", "said"), [
    ("dspark", [6, 2, 0, 4, 3], "drafts: 3.8 tokens a round where it drafted, of up to 6 (its confidence head"),
    ("lookup", [6, 1], "drafts: 3.5 tokens a round where it drafted, of up to 6 (a match ends"),
    ("model", [6, 6, 0], None),  # every drafting round drafted the whole length: nothing chosen to say
])
def test_the_bench_says_what_length_the_drafter_chose(monkeypatch, drafter, lengths, said):
    lines = _redirected_bench(monkeypatch, "mine", {drafter: 1.4}, "--drafter", drafter, lengths=lengths)
    drafts = [line for line in lines if line.startswith("drafts:")]
    assert drafts == ([] if said is None else [drafts[0]]) and (said is None or drafts[0].startswith(said)), lines
