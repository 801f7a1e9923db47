"""A new drafter is one file plus its row in `config.DRAFTER_TABLE`: with nothing else edited, it is registered, the
preset's `[draft] drafter` choices, `--drafter` and the server's `speculative.type` accept it, its cost rule keeps its
own acceptance in the stream's cost model, it drafts through the real loop (greedy output: plain decoding's), and
its target-rows hook is fed the target's hidden states as a drafting head's would be.

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

TOY = '''"""A toy drafter: k copies of the last committed token, at no draft step. It follows the target's hidden
states through the target-rows hook, as a drafting head (MTP, EAGLE-3) does: the loop hands it the row after every
token the target decodes, and it keeps one per target cell."""

from __future__ import annotations

from localspec.config import Drafting
from localspec.drafters.base import DrafterBase, Proposal
from localspec.rounds.policies import CostRule, DraftCost
from localspec.rounds.sampling import point_mass


class ToyCost(CostRule):
    """Its tokens' acceptance, counted apart from every other drafter's."""

    def __init__(self, cost: DraftCost) -> None:
        super().__init__(cost)
        cost.add_source("toy", 0.5, lead=True)


class ToyDrafter(DrafterBase):
    reads_target = True

    def __init__(self) -> None:
        super().__init__()
        self.rows = {}  # per sequence: the target's hidden state after each token its cells hold, by position

    def pricing(self, cost: DraftCost, drafting: Drafting) -> None:
        ToyCost.of(cost)

    def target_limit(self, req, prompt):
        return len(self.rows.get(req.seq, ()))  # it follows the target's cells as far as it holds their rows

    def target_kept(self, req, kept):
        del self.rows.setdefault(req.seq, [])[kept:]

    def target_rows(self, req, start, hidden):
        rows = self.rows[req.seq]
        if start != len(rows):
            raise ValueError(f"the target's rows from position {start}; the toy holds {len(rows)}")
        rows.extend(hidden)

    def rewind(self, req, proposal, accepted):
        del self.rows[req.seq][len(req.tokens) - 1 :]  # the target's cells hold the committed tokens but cur

    def draft(self, jobs):
        out = []
        for req, k in jobs:
            last = req.tokens[-1]
            out.append(Proposal([last] * k, None if req.sampling.greedy else [point_mass(last)] * k, lead=k))
        return out


def build(target, draft, built):
    return ToyDrafter()
'''

TOY_ROW = '    "toy": DrafterFacts("localspec.drafters.toy", "the toy", needs_draft_model=False, reads_target=True),\n'

CHECKS = '''
import dataclasses, json, sys
from pathlib import Path

import numpy as np

import localspec
from localspec import config, drafters
from localspec.cli.app import app
from localspec.server.schema import ChatRequest
from typer.testing import CliRunner

from helpers_fake import FakeModel
from localspec.rounds.engine import Engine
from localspec.rounds.events import collect

assert Path(localspec.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), localspec.__file__
out = {"choices": list(config.DRAFTERS), "registry": list(drafters.REGISTRY)}
out["preset"] = config.load_preset().with_overrides(drafter="toy").draft.drafter
out["facts"] = dataclasses.asdict(config.DRAFTER_TABLE["toy"])
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


def rows_held():
    """The toy's rows against the target's cells: one per cell, each what the target computed after that token
    (the fake target's hidden state is its row of logits)."""
    slot, rows = engine.slots[0], engine.drafters["toy"].rows[0]
    right = all(np.array_equal(row, target.logits_after(slot.tokens[: p + 1])) for p, row in enumerate(rows))
    return {"held": len(rows), "cells": len(slot.target_kv), "right": right}


out["rows"] = [rows_held()]
follow_up = [*prompt, *gen.tokens[:10], 5, 6]  # shares the first prompt and part of the reply: rows kept, then fed
again = collect(engine.generate(follow_up, greedy.sampling, drafting, 30))
out["rows"].append({**rows_held(), "greedy": again.tokens == target.greedy(follow_up, 30),
                    "reused": again.stats.prompt_tokens - again.stats.prompt_tokens_processed})
print(json.dumps(out))
'''


@pytest.fixture
def with_toy(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the package with localspec/drafters/toy.py added, and the environment that imports it."""
    shutil.copytree(ROOT / "localspec", tmp_path / "localspec", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "presets", tmp_path / "presets")  # (the shipped data lives beside the package)
    shutil.copy(ROOT / "models.toml", tmp_path / "models.toml")
    (tmp_path / "localspec" / "drafters" / "toy.py").write_text(TOY)
    config = tmp_path / "localspec" / "config.py"  # its row: the facts the rest of localspec reads without importing it
    table = "DRAFTER_TABLE: dict[str, DrafterFacts] = {\n"
    assert table in config.read_text()
    config.write_text(config.read_text().replace(table, table + TOY_ROW, 1))
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
    assert out["facts"] == {"module": "localspec.drafters.toy", "title": "the toy", "needs_draft_model": False,
                            "reads_target": True, "target_head": False}
    assert out["model_free"]  # a pair may name it and no draft: declared in its row, nowhere else
    from localspec.config import DRAFTERS  # (the checkout's: the copy's are these and the toy)

    assert ", ".join(sorted([*DRAFTERS, "toy"])) in out["help"]  # --drafter's choices
    loop = out["loop"]
    assert loop["greedy"] and loop["drafted"] > 0
    assert 0 < loop["seen"] <= loop["rounds"], loop  # the rounds that verified its tokens, in its own source
    # Its target-rows hook, fed by the loop with nothing in it naming the toy: the target's row after every token
    # its cells hold, in order, rewound with them; a follow-up reuses the target's cells the toy has rows for.
    first, follow_up = out["rows"]
    assert first == {"held": first["cells"], "cells": first["cells"], "right": True} and first["cells"] > 40, first
    assert follow_up["held"] == follow_up["cells"] and follow_up["right"] and follow_up["greedy"], follow_up
    assert follow_up["reused"] >= 6 + 10, follow_up


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
