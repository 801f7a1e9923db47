"""A new drafter is one file: dropped into localspec/drafters/, with nothing else edited, it is registered, the
preset's `[draft] drafter` choices, `--drafter` and the server's `speculative.type` accept it, its cost rule keeps its
own acceptance in the stream's cost model, and it drafts through the real loop (greedy output: plain decoding's).

The file goes into a copy of the package (the checkout is left alone), which fresh interpreters import first.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

TOY = '''"""A toy drafter: k copies of the last committed token, at no draft step."""

from __future__ import annotations

import contextlib

from localspec.config import Drafting
from localspec.policies import CostRule, DraftCost
from localspec.sampling import point_mass

TITLE = "the toy"  # the facts the rest of localspec reads without importing this file
NEEDS_DRAFT_MODEL = False

class ToyCost(CostRule):
    """Its tokens' acceptance, counted apart from every other drafter's."""

    def __init__(self, cost: DraftCost) -> None:
        super().__init__(cost)
        cost.add_source("toy", 0.5, lead=True)


class ToyDrafter:
    models = ()

    def pricing(self, cost: DraftCost, drafting: Drafting) -> None:
        ToyCost.of(cost)

    def begin(self, req, prompt):
        return []

    def draft(self, jobs):
        from localspec.drafters.base import Proposal

        out = []
        for req, k in jobs:
            last = req.tokens[-1]
            out.append(Proposal([last] * k, None if req.sampling.greedy else [point_mass(last)] * k, lead=k))
        return out

    def overlap(self, req, proposal, k_next):
        return contextlib.nullcontext()

    def accept(self, req, proposal, accepted):
        pass

    def cells(self, seq):
        return []  # no model

    def reset(self):
        pass

    def close(self):
        pass


def build(target, draft, built):
    return ToyDrafter()
'''

CHECKS = '''
import dataclasses, json, sys
from pathlib import Path

import localspec
from localspec import config, drafters
from localspec.cli.app import app
from localspec.server.schema import ChatRequest
from typer.testing import CliRunner

from helpers_fake import FakeModel
from localspec.engine import Engine, collect

assert Path(localspec.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), localspec.__file__
out = {"choices": list(config.DRAFTERS), "registry": list(drafters.REGISTRY)}
out["preset"] = config.load_preset().with_overrides(drafter="toy").draft.drafter
out["facts"] = dataclasses.asdict(config.DRAFTER_FACTS["toy"])
out["model_free"] = "toy" in config.MODEL_FREE_DRAFTERS
out["help"] = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "300"}).output
body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "speculative.type": "toy"}
out["request"] = ChatRequest.model_validate(body).preset_overrides()["drafter"]

target = FakeModel(seed=3)
engine = Engine(target, None)
greedy = config.load_preset("greedy")
drafting = dataclasses.replace(greedy.draft, drafter="toy", n_draft=4)
prompt = [1, 1, 1, 2, 2, 2]
gen = collect(engine.generate(prompt, greedy.sampling, drafting, 40))
cost = next(iter(engine.slots[0].policies.values())).cost
out["loop"] = {"greedy": gen.tokens == target.greedy(prompt, 40), "drafted": gen.stats.drafted,
               "accepted": gen.stats.accepted, "seen": cost.seen.get("toy", 0), "rounds": gen.stats.rounds}
print(json.dumps(out))
'''


@pytest.fixture
def with_toy(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the package with localspec/drafters/toy.py added, and the environment that imports it."""
    shutil.copytree(ROOT / "localspec", tmp_path / "localspec", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "presets", tmp_path / "presets")  # (the shipped data lives beside the package)
    shutil.copy(ROOT / "models.toml", tmp_path / "models.toml")
    (tmp_path / "localspec" / "drafters" / "toy.py").write_text(TOY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "tests"), str(ROOT / "bench")])}
    env.pop("LOCALSPEC_DEBUG", None)
    return tmp_path, env


def test_a_drafter_dropped_into_the_folder_is_registered_chosen_priced_and_run(with_toy) -> None:
    package, env = with_toy
    done = subprocess.run([sys.executable, "-c", CHECKS, str(package)], capture_output=True, text=True, env=env,
                          cwd=package, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert "toy" in out["choices"] and "toy" in out["registry"]
    assert out["preset"] == "toy" and out["request"] == "toy"
    assert out["facts"] == {"title": "the toy", "needs_draft_model": False, "target_head": False}
    assert out["model_free"]  # a pair may name it and no draft: declared in its file, nowhere else
    from localspec.config import DRAFTERS  # (the checkout's: the copy's are these and the toy)

    assert ", ".join(sorted([*DRAFTERS, "toy"])) in out["help"]  # --drafter's choices
    loop = out["loop"]
    assert loop["greedy"] and loop["drafted"] > 0
    assert 0 < loop["seen"] <= loop["rounds"], loop  # the rounds that verified its tokens, in its own source


def test_the_cli_drafts_with_a_dropped_in_drafter_and_prints_plain_decodings_text(with_toy, tiny_pair) -> None:
    package, env = with_toy
    common = [sys.executable, "-c", "from localspec.cli.app import main; main()", "generate", "a b a b a b",
              "--target", str(tiny_pair[0]), "--temp", "0", "--max-tokens", "24", "--json", "--threads", "1"]
    runs = {}
    for name, extra in (("plain", ["--draft", "0"]), ("toy", ["--draft", "none", "--drafter", "toy"])):
        done = subprocess.run([*common, *extra], capture_output=True, text=True, env=env, cwd=package, timeout=300)
        assert done.returncode == 0, (name, done.stderr)
        runs[name] = json.loads(done.stdout)
    assert runs["toy"]["drafter"] == "toy" and runs["toy"]["stats"]["drafted"] > 0
    assert runs["toy"]["text"] == runs["plain"]["text"]
