"""bench/lab/interleaved.py on the tiny pair: every mode runs in each repetition, in turn, and the seeds are one a
repetition (the bench's: `Sampling.repetition`) or, with `--seeds fixed`, the preset's one seed for every run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "lab" / "interleaved.py"


@pytest.mark.parametrize(("seeds", "expected"), [("repetition", [42, 43, 44]), ("fixed", [42, 42, 42])])
def test_each_mode_runs_every_repetition_with_the_seeds_asked_for(tiny_pair, tmp_path: Path, seeds: str,
                                                                   expected: list[int]) -> None:
    target, draft = tiny_pair
    out = tmp_path / "cell.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--target", str(target), "--draft", str(draft), "--class", "qa",
         "--max-tokens", "8", "--runs", "3", "--threads", "1", "--drafter", "model", "--fixed", "2",
         "--seeds", seeds, "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"plain", "default", "k=2"}
    for name, runs in report["runs"].items():
        assert [r["seed"] for r in runs] == expected, name
        assert all(0 < r["tokens"] <= 8 for r in runs)
    assert report["summary"]["plain"]["over_plain"] == 1.0
    assert report["summary"]["k=2"]["drafted_a_round"] > 0 and report["summary"]["plain"]["drafted_a_round"] == 0
