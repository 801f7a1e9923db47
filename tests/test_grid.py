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


@pytest.mark.slow
def test_files_in_place_of_a_pair_and_settings_for_every_cell(use_demo_home, tmp_path) -> None:
    """A GPU machine has files, not pairs: --target/--draft reach the bench, and each --bench-arg reaches every cell
    (here the temperature: the cell's report says 0, where the pair's preset says 0.7). A drafter named twice
    repeats its cells (interleaved repeats), each report kept."""
    from localspec.models import demo

    out = tmp_path / "grid.csv"
    run = subprocess.run([sys.executable, str(GRID), "--target", str(demo.target_path()), "--draft",
                          str(demo.draft_path()), "--out", str(out), "--drafters", "model,model", "--classes", "qa",
                          "--lengths", "8", "--sweep", "2", "--repeat", "1", "--warmup", "0", "--threads", "1",
                          "--bench-arg=--temp", "--bench-arg=0"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = out.read_text().splitlines()
    first, row = csv.DictReader(line for line in lines if not line.startswith("#"))
    # A drafter named twice runs its cells twice, each with a report of its own that its row was read from.
    assert (first["report"], row["report"]) == ("grid/model-qa-8.json", "grid/model-qa-8-2.json")
    for each in (first, row):
        default = next(r for r in json.loads((tmp_path / each["report"]).read_text())["rows"]
                       if r["policy"] == "default")
        assert float(each["default_tps"]) == round(default["median_tps"], 2)
    report = json.loads((tmp_path / row["report"]).read_text())
    assert report["preset"]["sampling"]["temperature"] == 0
    home = str(use_demo_home)
    assert report["environment"]["pair"] == "custom"  # the files, not the demo pair by name
    assert report["environment"]["target"]["path"] == str(demo.target_path()).replace(home, "$LOCALSPEC_HOME")
    assert report["environment"]["draft"]["path"] == str(demo.draft_path()).replace(home, "$LOCALSPEC_HOME")
    machine = next(line for line in lines if line.startswith("# machine: "))
    assert "MACHINE" not in machine and "CPUs" in machine


def test_a_draft_without_a_target_is_a_one_line_error(tmp_path) -> None:
    run = subprocess.run([sys.executable, str(GRID), "--draft", "d.gguf", "--out", str(tmp_path / "g.csv")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and run.stderr.strip() == "--draft needs --target"


@pytest.mark.slow
def test_served_cells_are_read_from_each_configurations_runs(use_demo_home, tmp_path) -> None:
    """--clients above 1: per configuration a real `localspec serve` driven by bench/concurrency.py; the row's
    figures are the medians of those runs' aggregate tok/s, plain's server never drafted and the fixed length's
    always did (its flags reached the server), and the stand-aside share is read from the default's timings."""
    out = tmp_path / "grid.csv"
    run = subprocess.run([sys.executable, str(GRID), "--pair", "demo-chat", "--out", str(out), "--drafters", "model",
                          "--classes", "qa", "--lengths", "8", "--sweep", "2", "--repeat", "2", "--warmup", "0",
                          "--threads", "1", "--clients", "2", "--temperature", "0"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    lines = out.read_text().splitlines()
    (row,) = csv.DictReader(line for line in lines if not line.startswith("#"))
    assert (row["drafter"], row["class"], row["max_tokens"], row["clients"], row["best_k"]) == \
        ("model", "qa", "8", "2", "2")
    assert row["report"] == "grid/model-qa-8-served-*.json"

    def runs(config: str) -> list[dict]:
        return [json.loads((tmp_path / "grid" / f"model-qa-8-served-{config}-{r}.json").read_text()) for r in (1, 2)]

    def median(config: str) -> float:
        (a,), (b,) = ([lv["aggregate_tps"] for lv in run["levels"]] for run in runs(config))
        return round((a + b) / 2, 2)

    assert float(row["plain_tps"]) == median("plain") and float(row["default_tps"]) == median("default")
    assert float(row["best_fixed_tps"]) == median("k2")
    timings = {config: [r["timings"] for run in runs(config) for lv in run["levels"] for r in lv["results"]]
               for config in ("plain", "default", "k2")}
    assert all(len(t) == 4 for t in timings.values())  # two runs of two clients, one request each
    assert all(t["draft_n"] == 0 for t in timings["plain"])
    assert all(0 < t["draft_n"] <= 2 * t["rounds"] and t["draft_stood_aside"] == 0 for t in timings["k2"])
    share = sum(t["draft_stood_aside"] for t in timings["default"]) / sum(t["rounds"] for t in timings["default"])
    assert float(row["stood_aside"]) == round(share, 3)
    assert all(run["settings"]["temperature"] == 0 and run["settings"]["clients"] == [2] for run in runs("default"))
    assert "several: aggregate tok/s of `localspec serve`" in next(line for line in lines if line.startswith("# what"))


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--clients", "1,x", "--clients '1,x': comma-separated integers"),
    ("--sweep", "2,y", "--sweep '2,y': comma-separated integers"),
    ("--clients", "0,4", "--clients: 0 (at least 1)"),
])
def test_bad_clients_or_lengths_are_one_line(tmp_path, flag, value, message) -> None:
    run = subprocess.run([sys.executable, str(GRID), "--out", str(tmp_path / "g.csv"), flag, value],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and run.stderr.strip() == message
