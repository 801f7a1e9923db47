"""bench/lab/ahead_variants.py (the GPU run's drafting-ahead variants, one loaded pair) on the tiny pair on the CPU:
one `localspec bench` report per temperature and variant, each with its own settings, drafting ahead or not as
the variant says, and the greedy check passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "lab" / "ahead_variants.py"


def test_each_variant_writes_its_own_bench_report(tiny_pair_high, tmp_path: Path) -> None:
    target, draft = tiny_pair_high
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--target", str(target), "--draft", str(draft), "--temps", "0 0.7",
         "--out-prefix", str(tmp_path / "cell"), "--variants", "off on fit+adaptive", "--max-tokens", "24",
         "--repeat", "1", "--warmup", "1"],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    for temp in ("0", "0.7"):
        off = json.loads((tmp_path / f"cell-t{temp}-off.json").read_text())
        fit = json.loads((tmp_path / f"cell-t{temp}-fit+adaptive.json").read_text())
        for report in (off, fit):
            assert report["preset"]["sampling"]["temperature"] == float(temp)
            assert report["greedy_check"]["passed"]
        assert (fit["preset"]["draft"]["draft_ahead_length"], fit["preset"]["draft"]["adaptive"]) == ("fit", True)
        on = json.loads((tmp_path / f"cell-t{temp}-on.json").read_text())
        assert on["preset"]["draft"]["draft_ahead_length"] == "full"  # whole rounds, whatever the default
        spec = [r for r in off["runs"] if r["mode"] == "speculative"]
        assert spec and all(r["ahead_made"] == 0 for r in spec)
        assert any(r["ahead_made"] > 0 for r in fit["runs"] if r["mode"] == "speculative")
    # A report that exists is not measured again (a budget cut the call: the next one goes on); a bad name is
    # refused before anything loads.
    before = (tmp_path / "cell-t0-off.json").stat().st_mtime_ns
    for variants, rc in (("off", 0), ("off bogus", 2)):
        again = subprocess.run(
            [sys.executable, str(SCRIPT), "--target", str(target), "--draft", str(draft), "--temps", "0",
             "--out-prefix", str(tmp_path / "cell"), "--variants", variants], capture_output=True, text=True,
            env=env, timeout=600, check=False)
        assert again.returncode == rc, again.stderr[-2000:]
    assert "unknown variant(s) bogus" in again.stderr
    assert (tmp_path / "cell-t0-off.json").stat().st_mtime_ns == before
