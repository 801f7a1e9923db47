"""bench/gpu/summarize.py: parsing llama.cpp's output and comparing its greedy text with localspec's (no models)."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "gpu"))

import summarize  # noqa: E402

LOG = """encoded   20 tokens in    0.050 seconds, speed:  400.000 t/s
decoded  257 tokens in    1.250 seconds, speed:  205.600 t/s

n_draft   = 6
n_predict = 257
n_drafted = 300
n_accept  = 250
accept    = 83.333%
"""


def _against(median: float, greedy: list[dict] | None = None) -> dict:
    """The `against` section `localspec bench --against llama.cpp` writes
    (localspec.sessions.versus.Comparison.as_json)."""
    return {"against": "llama.cpp", "modes": [
        {"mode": "host", "runs": 3, "median_tps": median * 0.9, "min_tps": median * 0.8, "max_tps": median,
         "acceptance_rate": 0.8},
        {"mode": "backend", "runs": 3, "median_tps": median, "min_tps": median * 0.9, "max_tps": median * 1.1,
         "acceptance_rate": 0.81}], "greedy": greedy or [], "runs": []}


def test_summarize_compares_both_loops_from_the_bench_json(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "p.txt").write_text("Hi\n")
    pair = tmp_path / "s1"
    pair.mkdir()
    check = {"exact": False, "invariant_holds": True, "prompts": [
        {"name": "p", "first_divergence": None, "plain_margin": None, "spec_margin": None,
         "plain_text": " a b", "plain_token_ends": [2, 4], "plain_margins": [1.0, 0.01]}]}
    greedy = [{"prompt": "p", "mode": "host", "first_divergence": 1, "plain_margin": 0.01, "same_every_run": True},
              {"prompt": "p", "mode": "backend", "first_divergence": None, "plain_margin": None,
               "same_every_run": True}]
    doc = {"plain": {"median_tps": 100.0}, "speculative": {"median_tps": 250.0, "acceptance_rate": 0.8,
                                                           "host_fraction": 0.01},
           "speedup": 2.5, "greedy_check": check, "runs": [], **{"against": _against(205.6, greedy)}}
    (pair / "localspec-t0.json").write_text(json.dumps(doc))
    failed = {**doc, "against": {"error": "llama-speculative-simple failed on prompt 'p'"}}
    (pair / "localspec-t0.7.json").write_text(json.dumps(failed))
    result = summarize.summarize(tmp_path)
    entry = result["pairs"]["s1"]["temps"]["0"]
    assert entry["ratio_vs_llama_cpp"] == pytest.approx(250.0 / 205.6) and entry["llama_cpp_faster"] == "backend"
    assert entry["llama_cpp_host"]["median"] == pytest.approx(205.6 * 0.9)
    fid = result["pairs"]["s1"]["fidelity"]
    assert fid["localspec"]["diverged"] == 0
    assert fid["llama_cpp_host"]["prompts"]["p"]["first_divergence"] == 1
    assert fid["llama_cpp_backend"]["diverged"] == 0
    text = summarize.tables(result)
    assert "greedy (T = 0) divergence" in text
    assert "s1 T=0.7: llama.cpp did not run: llama-speculative-simple failed on prompt 'p'" in text
    assert result["pairs"]["s1"]["temps"]["0.7"]["ratio_vs_llama_cpp"] is None


def test_the_comparisons_warnings_are_printed_with_the_tables(tmp_path):
    """A comparison the bench warned about (its llama.cpp matched samples though asked for rejection) says so in the
    summary a maintainer reads, not only in the JSON."""
    (tmp_path / "prompts").mkdir()
    _pair_folder(tmp_path, "card-n0.013", 180.0, 0.85,
                 warnings=["--spec-draft-sampling probabilistic changed nothing in this llama-speculative-simple"])
    text = summarize.tables(summarize.summarize(tmp_path))
    assert "card-n0.013 T=0: ⚠ --spec-draft-sampling probabilistic changed nothing in this" in text
    plain = tmp_path / "plain"
    (plain / "prompts").mkdir(parents=True)
    _pair_folder(plain, "card-n0.013", 180.0, 0.85)
    assert "⚠" not in summarize.tables(summarize.summarize(plain))


def _pair_folder(root: Path, name: str, spec_tps: float, acceptance: float,
                 warnings: list[str] | None = None) -> None:
    pair = root / name
    pair.mkdir(parents=True)
    check = {"exact": True, "invariant_holds": True, "prompts": []}
    doc = {"plain": {"median_tps": 100.0}, "speculative": {"median_tps": spec_tps, "acceptance_rate": acceptance,
                                                           "host_fraction": 0.01},
           "speedup": spec_tps / 100.0, "greedy_check": check, "runs": [],
           "against": {**_against(205.6), "warnings": warnings or []}}
    (pair / "localspec-t0.json").write_text(json.dumps(doc))


def test_side_by_side_puts_the_card_pair_next_to_the_old_stand_in(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "p.txt").write_text("Hi\n")
    _pair_folder(tmp_path, "card-n0.2", 180.0, 0.85)
    _pair_folder(tmp_path, "s8e-5", 250.0, 0.86)
    text = summarize.tables(summarize.summarize(tmp_path))
    side = text.split("side by side")[1]
    header = side.splitlines()[1]
    assert header.index("card-n0.2") < header.index("s8e-5")
    spec_row = next(line for line in side.splitlines() if line.lstrip().startswith("localspec spec tok/s"))
    assert "180.0" in spec_row and "250.0" in spec_row
    ratio_row = next(line for line in side.splitlines() if line.lstrip().startswith("localspec / llama.cpp"))
    assert f"{180.0 / 205.6:.2f}x" in ratio_row and f"{250.0 / 205.6:.2f}x" in ratio_row
    # One pair alone: no side-by-side table.
    alone = tmp_path / "alone"
    (alone / "prompts").mkdir(parents=True)
    _pair_folder(alone, "card-n0.2", 180.0, 0.85)
    assert "side by side" not in summarize.tables(summarize.summarize(alone))


def test_kernel_runs_give_ms_per_width_and_per_extra_token(tmp_path, capsys):
    kern = tmp_path / "kernels"
    kern.mkdir()
    for variant, fa, step in (("default", "on", 1.8), ("graph-opt", "off", 1.0)):
        doc = {"label": variant, "flash_attn": fa, "env": {},
               "timings_ms": {"constant": {str(w): 10.0 + step * (w - 1) for w in range(1, 9)}, "patterns": {}}}
        (kern / f"q4_k-{variant}-fa{fa}.json").write_text(json.dumps(doc))
    (kern / "q4_k-broken-faon.json").write_text("{not json")  # an unfinished run: left out
    (tmp_path / "prompts").mkdir()
    rows = summarize.kernel_runs(kern)
    assert [(r["variant"], r["flash_attn"]) for r in rows] == [("default", "on"), ("graph-opt", "off")]
    assert rows[0]["ms_per_extra_token"] == pytest.approx(1.8)
    assert rows[0]["ms"][8] == pytest.approx(10.0 + 1.8 * 7)
    assert summarize.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "graph-opt" in x)
    assert "17.00" in line and line.rstrip().endswith("1.00")


def test_drafter_runs_are_a_table_of_their_own_not_a_pair(tmp_path, capsys):
    (tmp_path / "prompts").mkdir()
    drafters = tmp_path / "drafters"
    drafters.mkdir()
    runs = [{"mode": "speculative", "rounds": 10, "draft_s": 0.0, "verify_s": 0.2, "decode_s": 0.25, "tokens": 30,
             "drafted": 25}]
    for d, spec in (("lookup", 180.0), ("chain", 210.0)):
        doc = {"preset": {"draft": {"drafter": d, "adaptive": False}, "sampling": {"temperature": 0.0}},
               "plain": {"median_tps": 100.0}, "speculative": {"median_tps": spec, "acceptance_rate": 0.8,
                                                               "mean_accepted": 2.0},
               "speedup": spec / 100.0, "greedy_check": {"summary": "token-identical"}, "runs": runs}
        (drafters / f"card-lookup-{d}.json").write_text(json.dumps(doc))
    table = {"constrained, draft + target": {"tok_s_total": 90.0, "acceptance": 0.95, "tokens": 300}}
    (drafters / "structured-card.json").write_text(json.dumps({"table": table}))
    (drafters / "card-lookup-model.json").write_text("{unfinished")  # a run cut short: left out
    result = summarize.summarize(tmp_path)
    assert "drafters" not in result["pairs"]
    rows = {r["run"]: r for r in result["drafters"] if "drafter" in r}
    assert set(rows) == {"card-lookup-lookup", "card-lookup-chain"}
    assert rows["card-lookup-chain"]["speedup"] == pytest.approx(2.1)
    assert rows["card-lookup-chain"]["profile"]["host_ms"] == pytest.approx(5.0)
    assert summarize.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    chain = next(x for x in out.splitlines() if "card-lookup-chain" in x)
    assert "210.0" in chain and "2.10x" in chain and "0.00/20.00/5.00" in chain
    structured = next(x for x in out.splitlines() if "draft + target" in x)
    assert "90.0" in structured and "95.0%" in structured


# -- bench/gpu/multi_summary.py (two GPUs) ------------------------------------------------------------------


def _bench_report(plain: float, spec: float, divergence: list[tuple[str, int]], holds: bool = True,
                  ahead_hit_rate: float | None = None) -> dict:
    prompts = [{"name": name, "first_divergence": dict(divergence).get(name)} for name in ("code", "prose", "qa")]
    return {"plain": {"median_tps": plain},
            "speculative": {"median_tps": spec, "acceptance_rate": 0.85, "ahead_hit_rate": ahead_hit_rate},
            "greedy_check": {"invariant_holds": holds, "passed": holds, "prompts": prompts},
            "environment": {"placement": {"target": "GPU 0"}}}


def test_multi_summary_compares_placements_and_marks_greedy_against_one_gpu(tmp_path, capsys):
    import multi_summary

    for scale, ahead_divergence in (("8e-5", [("qa", 209)]), ("1.2e-4", [("qa", 150)])):
        folder = tmp_path / f"s{scale}"
        (folder / "llama").mkdir(parents=True)
        reports = {"one-gpu": _bench_report(98.0, 250.0, [("qa", 209)]),
                   "no-ahead": _bench_report(98.0, 251.0, [("qa", 209)]),
                   "ahead": _bench_report(99.0, 300.0, ahead_divergence, ahead_hit_rate=0.75)}
        if scale == "8e-5":
            reports["split"] = _bench_report(96.0, 240.0, [("qa", 209)])
        for config, report in reports.items():
            (folder / f"localspec-{config}-t0.json").write_text(json.dumps(report))
        for devd, seconds in (("CUDA0", 1.25), ("CUDA1", 1.0)):
            for prompt in ("code", "prose", "qa"):
                (folder / "llama" / f"t0-{devd}-r1-{prompt}.log").write_text(LOG.replace("1.250", f"{seconds:.3f}"))
    out = tmp_path / "summary.json"
    assert multi_summary.main([str(tmp_path), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| 8e-5") or line.startswith("| 1.2e-4")]
    # llama.cpp: 3 × 257 tokens over 3 × 1.25 s (one GPU) and 3 × 1.0 s (draft on GPU 1); the best is 257 tok/s
    assert rows[0] == "| 8e-5 | 0 | 205.6 | 257.0 | 98.0 | 250.0 | 251.0 | 300.0 (75%) ✓ | 1.17× |"
    # the same placement left plain decoding somewhere else than one GPU did: not the same computation
    assert rows[1].startswith("| 1.2e-4 | 0 |") and "300.0 (75%) ✗" in rows[1]
    assert "| 8e-5 | 0 | 96.0 | 240.0 | 2.50× |" in lines
    summary = json.loads(out.read_text())
    assert summary[0]["ahead"]["greedy"] == {"holds": True, "divergence": [["qa", 209]]}


def test_the_round_profile_counts_the_wait_for_the_ahead_thread_apart_from_host_work():
    runs = [{"mode": "plain", "rounds": 99, "draft_s": 9.0, "verify_s": 9.0, "decode_s": 99.0, "tokens": 99,
             "drafted": 0},
            {"mode": "speculative", "rounds": 10, "draft_s": 0.05, "verify_s": 0.3, "decode_s": 0.37,
             "ahead_wait_s": 0.015, "tokens": 60, "drafted": 60},
            {"mode": "speculative", "rounds": 10, "draft_s": 0.05, "verify_s": 0.3, "decode_s": 0.36, "tokens": 60,
             "drafted": 60}]  # (written before the wait was counted apart: no key, no wait)
    profile = summarize.round_profile({"runs": runs})
    assert profile["round_ms"] == pytest.approx(36.5)
    assert profile["wait_ms"] == pytest.approx(0.75)
    assert profile["host_ms"] == pytest.approx(36.5 - 5.0 - 30.0 - 0.75)
    assert profile["tokens_per_round"] == pytest.approx(6.0)


def test_the_rollback_costs_of_a_hybrid_pair_come_with_its_table(tmp_path):
    """bench/gpu/hybrid.sh leaves bench/rollback_cost.py's JSON in the pair's folder: the summary prints it."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "p.txt").write_text("Hi\n")
    _pair_folder(tmp_path, "mtp", 180.0, 0.7)
    cost = {"k": 3, "reps": 30, "per_rejected_ms": {"1": 0.012, "2": 0.01, "3": 0.011},
            "snapshot_upkeep_ms": {"1": 0.0, "2": 0.05, "3": 0.07, "4": 0.09}, "rollback_call_us": 14.2,
            "checkpoint_ms": 0.2, "restore_ms": 0.25}
    (tmp_path / "mtp" / "rollback-cost.json").write_text(json.dumps(cost))
    text = summarize.tables(summarize.summarize(tmp_path))
    assert "mtp: rolling the recurrent state back (k = 3, medians of 30; ms)" in text
    assert "per rejected token, by tokens rolled back: 1: 0.012  2: 0.010  3: 0.011" in text
    assert "the rollback call 14.2 us; checkpoint 0.200, restore 0.250" in text


def test_each_row_names_the_llama_cpp_build_and_configuration_it_was_compared_against(tmp_path):
    """Since the draft-length search the `against` section holds two finalists (labelled by draft length, draft
    sampling and sampling mode), the first pass of every configuration, and the build the tool's --version named."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "p.txt").write_text("Hi\n")
    pair = tmp_path / "card-n0.013"
    pair.mkdir()

    def mode(n: int, draft: str, sampling: str, median: float) -> dict:
        return {"mode": sampling, "n_draft": n, "draft_sampling": draft, "label": f"k={n} {draft}-draft {sampling}",
                "runs": 3, "median_tps": median, "min_tps": median - 1, "max_tps": median + 1,
                "acceptance_rate": 0.7}

    finalists = [mode(4, "probabilistic", "backend", 150.0), mode(3, "greedy", "host", 140.0)]
    first = finalists + [mode(2, "greedy", "backend", 120.0)]
    against = {"against": "llama.cpp", "version": "version: 11549 (unknown)", "build": 11549, "commit": "unknown",
               "modes": finalists, "search": {"first_pass": first, "finalists": [m["label"] for m in finalists]},
               "greedy": [], "runs": []}
    check = {"exact": True, "invariant_holds": True, "prompts": []}
    doc = {"plain": {"median_tps": 100.0}, "speculative": {"median_tps": 180.0, "acceptance_rate": 0.8,
                                                           "host_fraction": 0.01},
           "speedup": 1.8, "greedy_check": check, "runs": [], "against": against}
    (pair / "localspec-t0.7.json").write_text(json.dumps(doc))
    old = {**doc, "against": {**_against(205.6), "version": "version: 1 (b3b5a3f)"}}  # before the search
    (pair / "localspec-t0.json").write_text(json.dumps(old))
    result = summarize.summarize(tmp_path)
    t07, t0 = result["pairs"]["card-n0.013"]["temps"]["0.7"], result["pairs"]["card-n0.013"]["temps"]["0"]
    assert t07["ratio_vs_llama_cpp"] == pytest.approx(180.0 / 150.0)
    assert t07["llama_cpp_faster"] == "k=4 probabilistic-draft backend" and t07["llama_cpp_build"] == "b11549"
    assert t07["llama_cpp_backend"]["median"] == 150.0 and t07["llama_cpp_host"]["median"] == 140.0
    assert t07["llama_cpp_first_pass"]["k=2 greedy-draft backend"] == 120.0
    assert t0["llama_cpp_build"] == "b1 (b3b5a3f)" and t0["llama_cpp_faster"] == "backend"
    text = summarize.tables(result)
    row = next(line for line in text.splitlines() if line.lstrip().startswith("card-n0.013 |") and "| 0.7 |" in line)
    assert "b11549, k=4 probabilistic-draft backend" in row and f"{180.0 / 150.0:.2f}x" in row
    assert ("card-n0.013 T=0.7: llama.cpp's first pass (one repetition each, tok/s): k=4 probabilistic-draft backend "
            "150.0, k=3 greedy-draft host 140.0, k=2 greedy-draft backend 120.0") in text


RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
H100_HYBRID = RESULTS / "2026-12-06-h100-hybrid-mtp.csv"


def _csv_rows(path: Path) -> tuple[list[str], list[str]]:
    lines = path.read_text().splitlines()
    return [x for x in lines if x.startswith("#")], [x for x in lines if not x.startswith("#")]


def test_a_kept_raw_csv_is_what_the_script_writes_from_the_kept_reports(tmp_path):
    """The raw CSV beside its `localspec bench` reports is the script's output, not a retyped table: written again
    from the same reports with the command its `# written-by:` line records, every row comes out the same."""
    heads, rows = _csv_rows(H100_HYBRID)
    written_by = next(x for x in heads if x.startswith("# written-by: "))
    argv = shlex.split(written_by.removeprefix("# written-by: bench/gpu/summarize.py "))
    results, options = Path(argv[0]), list(zip(argv[1::2], argv[2::2], strict=True))
    copy = tmp_path / "results" / H100_HYBRID.stem
    shutil.copytree(RESULTS.parent.parent / results, copy)
    out = tmp_path / "results" / H100_HYBRID.name
    args = [str(copy), "--csv", str(out)]
    for key, value in options:
        if key == "--csv":
            continue
        if key == "--report":
            pair, _, path = value.partition("=")
            value = f"{pair}={copy / Path(path).relative_to(results)}"
        args += [key, value]
    assert summarize.main(args) == 0
    assert _csv_rows(out)[1] == rows
    assert len(rows) > 10 and rows[0].startswith("pair,report,kind,temperature")


def test_a_raw_csv_refuses_reports_from_two_machines(tmp_path):
    """A ratio is never taken across machines: reports whose environments name other GPUs are refused, naming the
    odd report."""
    src = RESULTS / "2026-12-06-h100-hybrid-mtp" / "mtp"
    (tmp_path / "mtp").mkdir()
    for name in ("localspec-t0.json", "localspec-t0.7.json"):
        doc = json.loads((src / name).read_text())
        if name == "localspec-t0.7.json":
            doc["environment"]["gpus"][0]["name"] = "NVIDIA H200"
        (tmp_path / "mtp" / name).write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match=r"localspec-t0\.json: measured on another machine|localspec-t0\.7\.json"):
        summarize.main([str(tmp_path), "--csv", str(tmp_path / "x.csv"), "--what", "w", "--code", "c",
                        "--command", "c"])
    assert not (tmp_path / "x.csv").exists()
    with pytest.raises(SystemExit, match="--csv needs --code, --command"):
        summarize.main([str(tmp_path), "--csv", str(tmp_path / "x.csv"), "--what", "w"])


def test_a_report_option_names_its_pair(tmp_path) -> None:
    with pytest.raises(SystemExit, match=r"--report 'x\.json': expected PAIR=JSON"):
        summarize.main([str(tmp_path), "--csv", str(tmp_path / "x.csv"), "--report", "x.json", "--what", "w",
                        "--code", "c", "--command", "c"])
    assert not (tmp_path / "x.csv").exists()
