"""bench/agent_replay.py, the coding-agent replay: its sessions are the seed's alone and have the shapes agents send
(a file read, test output, a diff, a rewrite asked for, the file read again, a search's JSON); and two turns against a
live `localspec serve` (SmolLM2's demo-chat pair, the prompt cache on) with the suffix drafter asked for by request."""

from __future__ import annotations

import json

import agent_replay  # bench/agent_replay.py (conftest puts bench/ on the path)
import pytest

from tests.test_serve import Server


def test_sessions_are_the_seeds_and_have_an_agents_shapes() -> None:
    turns = agent_replay.session_turns(42, 0, 12, 6)
    assert turns == agent_replay.session_turns(42, 0, 12, 6) != agent_replay.session_turns(43, 0, 12, 6)
    assert turns != agent_replay.session_turns(42, 1, 12, 6)  # sessions differ from each other
    kinds = [t.split("]")[0] if t.startswith("[") else t.split(":")[0].split(" ")[0] for t in turns]
    assert kinds[:7] == ["Task", "[run_tests", "[apply_diff", "Rewrite", "[read_file " + turns[4].split()[1][:-1],
                         "[search", "[run_tests"], kinds
    diff = turns[2].splitlines()
    added = next(line[1:] for line in diff if line.startswith("+") and not line.startswith("+++"))
    removed = next(line[1:] for line in diff if line.startswith("-") and not line.startswith("---"))
    assert added in turns[4] and removed in turns[0] and removed not in turns[4]  # the file read again is the edit's
    found = json.loads(turns[5].split("\n", 1)[1])
    assert found["tool"] == "search" and all(set(m) == {"path", "line", "text"} for m in found["matches"])


@pytest.mark.slow
def test_two_turns_against_serve(demo_home, tmp_path, capsys) -> None:
    server = Server(demo_home, tmp_path, "--pair", "demo-chat", "--threads", "1", "--ctx", "4096", "--cache-ram", "64")
    try:
        out = tmp_path / "replay.json"
        rc = agent_replay.main(["--url", server.url, "--sessions", "1", "--turns", "2", "--functions", "3",
                                "--max-tokens", "24", "--drafter", "suffix", "--json", str(out), "--label", "suffix"])
    finally:
        assert server.stop() == 0
    assert rc == 0, capsys.readouterr()
    run = json.loads(out.read_text())
    rows = run["requests"]
    assert [(r["session"], r["turn"]) for r in rows] == [(0, 1), (0, 2)]
    assert all(r["error"] is None and r["ttft_s"] > 0 and r["tokens"] > 0 and r["draft_n"] is not None for r in rows)
    assert rows[1]["cache_n"] > rows[0]["prompt_n"] // 2  # the second turn reused the first's prompt
    assert run["settings"]["drafter"] == "suffix" and run["summary"]["requests"] == 2
    printed = capsys.readouterr().out
    assert "acceptance" in printed and "decode median" in printed


@pytest.mark.slow
def test_serve_mode_replays_each_drafter_on_a_fresh_server_into_one_csv(demo_home, tmp_path, monkeypatch) -> None:
    """`--serve ARGS --drafters a,b --csv F`: a server per drafter (started, replayed, stopped), one CSV row each read
    from that drafter's replay JSON, the ratio against the first drafter, the `#` lines of a raw result."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(demo_home))
    out = tmp_path / "replay.csv"
    rc = agent_replay.main(["--serve", "--pair demo-chat --preset agent --threads 1 --ctx 4096 --cache-ram 64",
                            "--drafters", "model,chain", "--sessions", "1", "--turns", "2", "--functions", "3",
                            "--max-tokens", "16", "--csv", str(out)])
    assert rc == 0
    heads, rows = _read_csv(out)
    assert heads["written-by"].startswith("bench/agent_replay.py --serve '--pair demo-chat --preset agent")
    assert [r["drafter"] for r in rows] == ["model", "chain"] and rows[0]["over_first"] == "1.0"
    for row in rows:
        run = json.loads((tmp_path / row["json"]).read_text())
        assert run["settings"]["drafter"] == row["drafter"] and run["summary"]["errors"] == 0
        assert float(row["decode_tps_total"]) == run["summary"]["decode_tps_total"] > 0
    logs = sorted(p.name for p in (tmp_path / "replay").glob("*-serve.log"))
    assert logs == ["chain-serve.log", "model-serve.log"]  # a server of its own each


def _read_csv(path) -> tuple[dict[str, str], list[dict[str, str]]]:
    import csv

    lines = path.read_text().splitlines()
    heads = dict(line[2:].split(": ", 1) for line in lines if line.startswith("# "))
    return heads, list(csv.DictReader(line for line in lines if not line.startswith("#")))


def test_the_kept_replay_csv_is_its_jsons_summaries() -> None:
    """The raw CSV of the CPU replay (bench/results) holds what its drafters' replay JSONs say, and its ratio column
    is their decode rates' ratio: no figure typed in."""
    from pathlib import Path

    csv_path = Path(__file__).resolve().parent.parent / "bench" / "results" / "2026-12-06-cpu-agent-replay.csv"
    heads, rows = _read_csv(csv_path)
    assert heads["written-by"].startswith("bench/agent_replay.py --serve")
    first = None
    for row in rows:
        summary = json.loads((csv_path.parent / row["json"]).read_text())["summary"]
        for key in ("decode_tps_total", "acceptance", "ttft_s_median", "draft_n", "completion_tokens"):
            assert float(row[key]) == float(summary[key]), (row["drafter"], key)
        first = first or summary["decode_tps_total"]
        assert float(row["over_first"]) == round(summary["decode_tps_total"] / first, 3)


def test_serve_mode_needs_its_drafters_and_a_csv(tmp_path, capsys) -> None:
    assert agent_replay.main(["--serve", "--pair demo-chat", "--csv", str(tmp_path / "r.csv")]) == 1
    assert "agent_replay.py: error: --serve needs --drafters and --csv" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
