"""bench/concurrency.py, the client of issue #14's concurrency table: against a live `localspec serve` on the demo
pair, and its one-line failures."""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

import concurrency  # bench/concurrency.py (conftest puts bench/ on the path)
import pytest

from tests.test_serve import Server


@pytest.mark.slow
def test_levels_against_serve(demo_home, tmp_path, capsys):
    # (the instruct demo: its two slots decode in one batch, bit for bit as each alone, and it loads in a third of
    # the base demo's time)
    server = Server(demo_home, tmp_path, "--pair", "demo-chat", "--threads", "1", "--parallel", "2")
    try:
        out = tmp_path / "conc.json"
        rc = concurrency.main(["--url", server.url, "--clients", "1,2", "--requests-per-client", "1",
                               "--max-tokens", "12", "--json", str(out), "--label", "demo test"])
        printed = capsys.readouterr().out
    finally:
        assert server.stop() == 0
    assert rc == 0, printed
    data = json.loads(out.read_text())
    assert data["label"] == "demo test" and data["model"] == "demo-chat"
    assert [m["id"] for m in data["models_response"]["data"]] == ["demo-chat"]
    assert data["argv"][1:3] == ["--url", server.url]
    assert data["token_count"] == "usage"
    assert data["health_before"]["slots"] == 2 and data["health_before"]["served"] == 0
    assert data["health_after"]["served"] == 2 + 3  # a warm-up request before each level, then 1 + 2
    assert [lv["clients"] for lv in data["levels"]] == [1, 2]
    for level in data["levels"]:
        assert level["requests"] == level["clients"] and level["errors"] == 0
        assert level["tokens_from_usage"] == level["requests"]
        assert 0 < level["completion_tokens"] <= 12 * level["requests"]
        assert level["aggregate_tps"] == pytest.approx(level["completion_tokens"] / level["wall_s"], abs=1e-3)
        assert level["ttft_s_median"] > 0
        per_request = [r["decode_tps"] for r in level["results"]]
        assert level["per_request_tps_median"] == pytest.approx(statistics.median(per_request), abs=1e-3)
        assert level["per_request_tps_min"] == pytest.approx(min(per_request), abs=1e-3)
        # the two clients of level 2 send different prompts
        assert len({r["prompt"] for r in level["results"]}) == level["clients"]
        for r in level["results"]:
            assert r["error"] is None and r["tokens"] == r["usage_tokens"] > 0
            assert r["text"] and len(r["text"]) >= r["text_chunks"]  # the reply, every chunk's text in order
            assert r["sent"] <= r["first_token"] <= r["last_token"] <= r["end"] <= level["wall_s"]
        if level["clients"] == 2:  # two slots: the second request starts before the first one ends
            first, second = sorted(level["results"], key=lambda r: r["first_token"])
            assert second["first_token"] < first["end"]
            assert r["timings"]["predicted_n"] == r["tokens"]  # localspec's own count agrees with the usage chunk
    # T = 0 on the CPU: prompt 0's reply is the same alone (level 1) and beside another request (level 2)
    alone, beside = ([r["text"] for r in level["results"] if r["prompt"] == 0] for level in data["levels"])
    assert alone == beside and alone[0]
    assert "aggregate tok/s" in printed


def test_unreachable_server_is_one_line(capsys):
    assert concurrency.main(["--url", "http://127.0.0.1:1/v1", "--clients", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("concurrency.py: error: cannot reach http://127.0.0.1:1/v1") and "\n" not in err


def test_bad_input_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert concurrency.main(["--url", "http://127.0.0.1:1/v1", "--prompts", str(empty)]) == 1
    assert capsys.readouterr().err.strip() == f"concurrency.py: error: --prompts {empty}: no prompts (one per " \
                                              "line, or JSONL with 'prompt' or 'messages')"
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    assert concurrency.main(["--url", "http://127.0.0.1:1/v1", "--prompts", str(broken)]) == 1
    assert capsys.readouterr().err.strip() == f"concurrency.py: error: --prompts {broken}:2: 'prompt' must be a " \
                                              "non-empty string"
    talk = tmp_path / "talk.jsonl"
    talk.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    png = tmp_path / "p.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    assert concurrency.main(["--url", "http://127.0.0.1:1/v1", "--prompts", str(talk), "--image", str(png)]) == 1
    assert capsys.readouterr().err.strip() == f"concurrency.py: error: --image with --prompts {talk}: a picture " \
                                              "goes before one prompt's text, not into a conversation ('messages')"
    for flag, value, minimum in (("--requests-per-client", "0", 1), ("--warmup", "-1", 0)):
        with pytest.raises(SystemExit) as exit_info:
            concurrency.main([flag, value])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip() == f"concurrency.py: error: argument {flag}: expected at least " \
                                                  f"{minimum}, got {value}"
    with pytest.raises(SystemExit) as exit_info:
        concurrency.main(["--clients", "1,x"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "concurrency.py: error: argument --clients: expected comma-separated " \
                                              "integers, got '1,x'"


# -- bench/gpu/concurrency_summary.py (no server) -------------------------------------------------------------


def _report(aggregate: dict[int, float], per_request: float = 50.0) -> dict:
    levels = [{"clients": n, "requests": 2 * n, "errors": 0, "completion_tokens": 512 * n, "aggregate_tps": tps,
               "per_request_tps_median": per_request, "per_request_tps_min": per_request / 2,
               "ttft_s_median": 0.1, "acceptance": 0.8} for n, tps in aggregate.items()]
    settings = {"requests_per_client": 2, "max_tokens": 256, "n_prompts": 16, "prompts": "built-in", "seed": 42,
                "top_k": 40, "top_p": 0.9, "min_p": 0.0}
    return {"settings": settings, "token_count": "usage", "levels": levels}


def test_summary_finds_the_crossover(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "gpu"))
    import concurrency_summary

    folder = tmp_path / "s8e-5"
    folder.mkdir()
    reports = {
        "k0-t0": {1: 100.0, 4: 350.0, 8: 600.0, 16: 1000.0},
        "spec-t0": {1: 180.0, 4: 400.0, 8: 580.0, 16: 900.0},
        "llama-t0": {1: 170.0, 4: 420.0, 8: 500.0, 16: 800.0},
        "spec-t0.7": {1: 150.0},  # no k0 at T = 0.7: nothing to compare
    }
    for name, agg in reports.items():
        (folder / f"{name}.json").write_text(json.dumps(_report(agg)))
    (folder / "k0-t0.json.tmp").write_text("{")  # an unfinished write is not a result
    out = tmp_path / "summary.json"
    assert concurrency_summary.main([str(tmp_path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "crossover: speculative falls below k = 0 between 4 and 8 clients; below at 8, 16" in printed
    assert "localspec spec below llama-server's best at: 4 clients" in printed
    assert "| 1 | 100.0 | 180.0 | 170.0 | 50.0 | 50.0 | 50.0 | 1.80 | 1.06 | 80.0% | 80.0% | greedy draft |" in printed
    assert "crossover: not measured" in printed
    summary = json.loads(out.read_text())
    assert summary["8e-5"]["0"]["spec_below_k0"] == [8, 16]
    assert summary["8e-5"]["0.7"]["compared_with_k0"] == []


def test_summary_compares_with_llama_servers_best_configuration_at_each_concurrency(tmp_path, capsys):
    """llama-server runs three ways (greedy draft, probabilistic draft, no draft); at each concurrency localspec is
    compared with whichever ran fastest there, and the table names it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "gpu"))
    import concurrency_summary

    folder = tmp_path / "card-n0.013"
    folder.mkdir()
    reports = {
        "k0-t0.7": {1: 70.0, 16: 900.0},
        "spec-t0.7": {1: 180.0, 16: 850.0},
        "llama-t0.7": {1: 110.0, 16: 700.0},
        "llamaprob-t0.7": {1: 150.0, 16: 720.0},
        "llamaplain-t0.7": {1: 75.0, 16: 950.0},
    }
    for name, agg in reports.items():
        (folder / f"{name}.json").write_text(json.dumps(_report(agg)))
    out = tmp_path / "summary.json"
    assert concurrency_summary.main([str(tmp_path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 1 | 70.0 | 180.0 | 150.0 | 50.0 | 50.0 | 50.0 | 2.57 | 1.20 | 80.0% | 80.0% | probabilistic draft |" \
        in printed
    assert "| 16 | 900.0 | 850.0 | 950.0 |" in printed and printed.count("| no draft |") == 1
    assert "localspec spec below llama-server's best at: 16 clients" in printed
    rows = json.loads(out.read_text())["card-n0.013"]["0.7"]["rows"]
    assert [r["llama_best"] for r in rows] == ["llamaprob", "llamaplain"]
    assert rows[1]["spec_over_llama"] == pytest.approx(850.0 / 950.0)


def test_summary_reads_the_card_pairs_folders_first(tmp_path, capsys):
    """concurrency.sh's PAIRS: card-n<noise> folders beside the old stand-in's s<scale> ones."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "gpu"))
    import concurrency_summary

    for name, spec in (("s8e-5", 300.0), ("card-n0.013", 180.0), ("card-n0.03", 150.0)):
        (tmp_path / name).mkdir()
        for config, agg in (("k0", 100.0), ("spec", spec), ("llama", 140.0)):
            (tmp_path / name / f"{config}-t0.json").write_text(json.dumps(_report({1: agg})))
    out = tmp_path / "summary.json"
    assert concurrency_summary.main([str(tmp_path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    heads = [line for line in printed.splitlines() if line.startswith("## ") and ", T = " in line]
    assert heads == ["## pair card-n0.013, T = 0", "## pair card-n0.03, T = 0", "## scale 8e-5, T = 0"]
    assert "| 1 | 100.0 | 180.0 | 140.0 |" in printed
    assert set(json.loads(out.read_text())) == {"card-n0.013", "card-n0.03", "8e-5"}


def _with_requests(report: dict, acceptances: dict[int, list[float]]) -> dict:
    """`report` whose levels carry requests with these acceptances (draft_n 100 each)."""
    for level in report["levels"]:
        level["results"] = [{"error": None, "text": "x",
                             "timings": {"draft_n": 100, "draft_n_accepted": round(100 * a)}}
                            for a in acceptances[level["clients"]]]
    return report


def test_summary_puts_each_requests_acceptance_against_the_solo_median(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "gpu"))
    import concurrency_summary

    folder = tmp_path / "s8e-5"
    folder.mkdir()
    agg = {1: 100.0, 4: 300.0}
    # T = 0: solo median 0.85, the furthest below it 0.78 (a 7-point spread from the prompts alone)
    zero = _with_requests(_report(agg), {1: [0.9, 0.8], 4: [0.85, 0.78, 0.9, 0.82]})
    # T = 0.7: solo median 0.85; at 4 clients one request collapses to 0.30, one sits at 0.81 (within the spread)
    hot = _with_requests(_report(agg), {1: [0.9, 0.8], 4: [0.85, 0.3, 0.81, 0.9]})
    (folder / "spec-t0.json").write_text(json.dumps(zero))
    (folder / "spec-t0.7.json").write_text(json.dumps(hot))
    out = tmp_path / "summary.json"
    assert concurrency_summary.main([str(tmp_path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "localspec spec, T = 0.7: solo median 85.0%, T = 0 spread 7.0%" in printed
    assert "| 4 | 4 | 30.0% | 83.0% | 90.0% | 55.0% | 1 |" in printed
    found = json.loads(out.read_text())["8e-5"]["0.7"]["acceptance_by_request"]["spec"]
    assert [r["below_by_more_than_spread"] for r in found["levels"]] == [0, 1]
    assert found["levels"][1]["each"] == [0.85, 0.3, 0.81, 0.9]


def test_summary_writes_the_raw_csv_from_the_client_reports(tmp_path, capsys):
    """--csv: bench/results/README.md's format, written by the script (a `# written-by:` line), one row per
    configuration and concurrency, the spec rows' ratios against k = 0 and llama-server's best, the machine from
    env.txt, llama-server's build from versions.txt, whether localspec's target slots shared batches."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "gpu"))
    import concurrency_summary

    results = tmp_path / "2026-12-06-h100-card-concurrency"
    folder = results / "card-n0.013"
    folder.mkdir(parents=True)
    for name, agg in {"k0-t0.7": {1: 70.0, 16: 60.0}, "spec-t0.7": {1: 150.0, 16: 140.0},
                      "llamaprob-t0.7": {1: 100.0, 16: 90.0}, "llamaplain-t0.7": {1: 65.0, 16: 400.0}}.items():
        (folder / f"{name}.json").write_text(json.dumps(_report(agg)))
    (folder / "spec.health.json").write_text(json.dumps({"slot_batches": {"target": {"shared": False}}}))
    out = tmp_path / "x.csv"
    args = [str(results), "--csv", str(out), "--what", "w", "--code", "main abc"]
    assert concurrency_summary.main(args) == 1  # --command missing
    assert "--csv needs --command" in capsys.readouterr().err
    args += ["--command", "bash bench/gpu/concurrency.sh"]
    with pytest.raises(SystemExit, match="env.txt"):  # no machine recorded: no file
        concurrency_summary.main(args)
    assert not out.exists()
    (results / "env.txt").write_text("2026-12-06T10:37:13Z\nLinux vm\n16\nindex, name, memory.total [MiB]\n"
                                     "0, NVIDIA H100 80GB HBM3, 81559 MiB, 0 MiB, 580.159.04, 1980 MHz\n")
    (results / "versions.txt").write_text("llama-server: /w/llama-server (newest)\nversion: 0.6.0-dev (build 11549)\n")
    assert concurrency_summary.main(args) == 0
    head = [line for line in out.read_text().splitlines() if line.startswith("#")]
    assert "# date: 2026-12-06" in head and "# machine: NVIDIA H100 80GB HBM3 (81559 MiB), 16 CPU cores" in head
    assert head[-1].startswith("# written-by: bench/gpu/concurrency_summary.py ")
    assert "build 11549" in next(h for h in head if h.startswith("# code: main abc"))
    with out.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert [(r["config"], r["clients"]) for r in rows] == [
        ("k0", "1"), ("k0", "16"), ("spec", "1"), ("spec", "16"), ("llamaprob", "1"), ("llamaprob", "16"),
        ("llamaplain", "1"), ("llamaplain", "16")]
    spec16 = rows[3]
    assert spec16["llama_best_config"] == "llamaplain" and spec16["spec_over_llama_best"] == "0.35"
    assert spec16["spec_over_k0"] == "2.33" and spec16["target_slots_shared"] == "False"
    assert rows[0]["target_slots_shared"] == "" and rows[4]["spec_over_llama_best"] == ""
    assert spec16["report"] == "2026-12-06-h100-card-concurrency/card-n0.013/spec-t0.7.json"
