"""bench/grid.py, the default-policy grid: one real cell on the demo pair through `localspec bench --sweep` (its
report kept beside the CSV, the CSV's row read from it), with the preset every cell runs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

GRID = Path(__file__).resolve().parent.parent / "bench" / "grid.py"


@pytest.mark.slow
def test_one_cell_with_a_preset_is_its_reports_row(use_demo_home, tmp_path) -> None:
    out = tmp_path / "grid.csv"
    run = subprocess.run([sys.executable, str(GRID), "--pair", "demo", "--out", str(out), "--drafters", "chain",
                          "--preset", "agent", "--classes", "qa", "--lengths", "8", "--sweep", "2", "--repeat", "1",
                          "--warmup", "0", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = out.read_text().splitlines()
    assert lines[0] == "# written-by: bench/grid.py " + " ".join(
        ["--pair", "demo", "--out", str(out), "--drafters", "chain", "--preset", "agent", "--classes", "qa",
         "--lengths", "8", "--sweep", "2", "--repeat", "1", "--warmup", "0", "--threads", "1"])
    (row,) = csv.DictReader(line for line in lines if not line.startswith("#"))
    report = json.loads((tmp_path / row["report"]).read_text())
    assert report["preset"]["name"] == "agent" and report["preset"]["draft"]["chain_lead"] == "suffix"
    default = next(r for r in report["rows"] if r["policy"] == "default")
    assert float(row["default_tps"]) == round(default["median_tps"], 2)
    assert (row["drafter"], row["class"], row["max_tokens"]) == ("chain", "qa", "8")
