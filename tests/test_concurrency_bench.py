"""bench/concurrency.py, the client of issue #14's concurrency table: against a live `localspec serve` on the demo
pair, and its one-line failures."""

from __future__ import annotations

import json

import concurrency  # bench/concurrency.py (conftest puts bench/ on the path)
import pytest

from tests.test_serve import Server


@pytest.mark.slow
def test_levels_against_serve(demo_home, tmp_path, capsys):
    server = Server(demo_home, tmp_path, "--threads", "1")
    try:
        out = tmp_path / "conc.json"
        rc = concurrency.main(["--url", server.url, "--clients", "1,2", "--requests-per-client", "1",
                               "--max-tokens", "6", "--json", str(out), "--label", "demo test"])
        printed = capsys.readouterr().out
    finally:
        assert server.stop() == 0
    assert rc == 0, printed
    data = json.loads(out.read_text())
    assert data["label"] == "demo test" and data["model"] == "demo"
    assert [m["id"] for m in data["models_response"]["data"]] == ["demo"]
    assert data["argv"][1:3] == ["--url", server.url]
    assert data["token_count"] == "usage"
    assert [lv["clients"] for lv in data["levels"]] == [1, 2]
    for level in data["levels"]:
        assert level["requests"] == level["clients"] and level["errors"] == 0
        assert level["tokens_from_usage"] == level["requests"]
        assert 0 < level["completion_tokens"] <= 6 * level["requests"]
        assert level["aggregate_tps"] > 0 and level["ttft_s_median"] > 0
        # the two clients of level 2 send different prompts
        assert len({r["prompt"] for r in level["results"]}) == level["clients"]
        for r in level["results"]:
            assert r["error"] is None and r["tokens"] == r["usage_tokens"] > 0
            assert r["sent"] <= r["first_token"] <= r["last_token"] <= r["end"] <= level["wall_s"]
            assert r["timings"]["predicted_n"] == r["tokens"]  # localspec's own count agrees with the usage chunk
    assert "aggregate tok/s" in printed


def test_unreachable_server_is_one_line(capsys):
    assert concurrency.main(["--url", "http://127.0.0.1:1/v1", "--clients", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("concurrency.py: error: cannot reach http://127.0.0.1:1/v1") and "\n" not in err


def test_bad_input_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert concurrency.main(["--url", "http://127.0.0.1:1/v1", "--prompts", str(empty)]) == 1
    assert capsys.readouterr().err.strip() == f"concurrency.py: error: --prompts {empty}: no prompts (one per line)"
    with pytest.raises(SystemExit) as exit_info:
        concurrency.main(["--clients", "1,x"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "concurrency.py: error: argument --clients: expected comma-separated " \
                                              "integers, got '1,x'"
