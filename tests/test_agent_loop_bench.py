"""bench/agent_loop.py, the client of the long-session benchmark: against a live `localspec serve` (the demo-chat
pair, one slot) with the prompt cache off and on, and `--compare` of the two runs."""

from __future__ import annotations

import json

import agent_loop  # bench/agent_loop.py (conftest puts bench/ on the path)
import pytest

from tests.test_serve import Server


def test_tool_results_are_deterministic_and_sized() -> None:
    a = agent_loop.tool_result(0, 3, 800)
    assert a == agent_loop.tool_result(0, 3, 800) and 800 <= len(a) < 900
    assert a != agent_loop.tool_result(1, 3, 800) and a.startswith("$ cat src/agent0/module_3.py")


@pytest.mark.slow
def test_off_and_on_against_serve(demo_home, tmp_path, capsys):
    runs = {}
    for cache in ("0", "64"):
        (tmp_path / cache).mkdir()
        server = Server(demo_home, tmp_path / cache, "--pair", "demo-chat", "--threads", "1", "--ctx", "2048",
                        "--cache-ram", cache)
        try:
            out = tmp_path / f"run-{cache}.json"
            rc = agent_loop.main(["--url", server.url, "--turns", "3", "--agents", "2", "--turn-chars", "100",
                                  "--max-tokens", "8", "--json", str(out), "--label", f"cache {cache}"])
        finally:
            assert server.stop() == 0
        assert rc == 0, capsys.readouterr()
        runs[cache] = json.loads(out.read_text())
    off, on = runs["0"], runs["64"]
    for run in (off, on):
        assert [(r["agent"], r["turn"]) for r in run["requests"]] == [(a, t) for t in (1, 2, 3) for a in (0, 1)]
        assert all(r["error"] is None and r["ttft_s"] > 0 and r["tokens"] > 0 for r in run["requests"])
    # Both runs send the same prompts (what each request read plus what it found in the slot).
    assert [r["prompt_n"] + r["cache_n"] for r in on["requests"]] == \
        [r["prompt_n"] + r["cache_n"] for r in off["requests"]]
    # The one slot holds the other agent's conversation each time: without the cache every turn is read again, all
    # but the system prompt both conversations start with (agent 1's first turn finds it in the slot).
    shared = off["requests"][1]["cache_n"]
    assert 0 < shared < off["requests"][1]["prompt_n"]
    assert all(r["cache_n"] <= shared for r in off["requests"])
    later = [r for r in on["requests"] if r["turn"] > 1]
    assert all(r["cache_n"] > r["prompt_n"] for r in later)  # with it, only the new tool result (and reply)
    assert on["summary"]["prompt_n_total"] < off["summary"]["prompt_n_total"] / 1.5
    capsys.readouterr()
    assert agent_loop.main(["--compare", str(tmp_path / "run-0.json"), str(tmp_path / "run-64.json")]) == 0
    printed = capsys.readouterr().out
    assert "same replies 6/6" in printed and "TTFT total A" in printed
