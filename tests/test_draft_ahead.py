"""Draft-ahead (the next round drafted while the target verifies) changes nothing in the output: the same tokens,
the same accepted ones, with a greedy and a sampled pipeline, on a pair that rejects often and one that rarely
does. Two real contexts on the CPU; on a machine with two GPUs the same code overlaps their work."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from localspec.cli.app import app
from localspec.config import load_preset
from localspec.rounds import engine
from localspec.rounds.events import collect
from localspec.rounds.policies import DraftCost
from localspec.sessions.session import ModelFiles, open_session

pytestmark = pytest.mark.slow

# One thread: a load skips the automatic choice's 0.2 s CPU sample, and two test workers never split a core.
# (drafts every round: these tests look at drafts; standing aside: tests/test_stand_aside.py)
GREEDY = load_preset("greedy").with_overrides(threads=1, stand_aside=False)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40_000, size=12).tolist() for _ in range(n)]


class _Cycle:
    """A draft length that changes every round, the same in every generation."""

    LENGTHS = (5, 3, 4, 4)
    padded = False

    def __init__(self) -> None:
        self.rounds = 0

    def next(self) -> int:
        return self.LENGTHS[self.rounds % len(self.LENGTHS)]

    def observe(self, *measured: object) -> None:
        self.rounds += 1

    aside = None  # (it never stands aside)
    cost = DraftCost(6)  # (the stream reads its verdict: never hopeless)

    def stand_aside(self, k: int, policy: object, lag: int = 1) -> int:  # (as the model's rule: every round drafts)
        return k

    def rule(self, kind: type) -> _Cycle:  # (it stands in for the model drafter's cost rule too)
        return self

    def observe_draft_ahead(self, *measured: object) -> None:
        pass

    def draft_ahead_length(self, k: int) -> int:
        return k  # (with draft_ahead_length = "fit" the draft-ahead still stops when the verify ends)

    def continuation(self, ready: int, k: int, padded: bool) -> int:
        return k - ready  # a draft-ahead that held cut short drafts the rest: the sequential loop's proposal


@pytest.fixture
def changing_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each generation gets a fresh `_Cycle` as its draft-length chooser (adaptive drafting's choice depends on measured
    times, so two runs of it differ anyway): a draft-ahead made for one length is thrown when the next round asks for
    another."""
    monkeypatch.setattr(engine.Engine, "_draft_length", lambda self, *chosen_for: _Cycle())


@pytest.mark.parametrize("pair", ["tiny_pair", "tiny_pair_high"])
@pytest.mark.parametrize(("temperature", "repeat_penalty", "p_min", "lengths"), [
    (0.0, 1.0, 0.0, "fixed"),
    (0.4, 1.0, 0.0, "fixed"),  # (0.4: peaked enough that the argmax draft-ahead on the sampled token often wins)
    (0.4, 1.3, 0.0, "fixed"),  # full logits on the host, the penalty over the drafted-ahead history
    (0.4, 1.0, 0.2, "fixed"),  # drafts that stop early
    (0.0, 1.0, 0.0, "changing"),
    (0.4, 1.0, 0.0, "changing"),
    (0.0, 1.0, 0.0, "fit"),  # draft-aheads stop when the verify ends; a kept one cut short drafts the rest
    (0.4, 1.0, 0.0, "fit"),
])
def test_draft_ahead_is_token_identical_to_the_sequential_loop(request, pair: str, temperature: float,
                                                               repeat_penalty: float, p_min: float,
                                                               lengths: str) -> None:
    target, draft = request.getfixturevalue(pair)
    if lengths in ("changing", "fit"):
        request.getfixturevalue("changing_length")
    preset = GREEDY.with_overrides(temperature=temperature, repeat_penalty=repeat_penalty, seed=11)
    drafting = dataclasses.replace(GREEDY.draft, n_draft=5, p_min=p_min, adaptive=False,
                                   draft_ahead_length="fit" if lengths == "fit" else "full")
    kept = made = 0
    with open_session(ModelFiles(target=target, draft=draft, name="test"), preset) as s:
        assert not s.engine.draft_ahead  # auto: both models on the CPU share one device
        for prompt in prompts(3, seed=5):
            s.engine.draft_ahead = False
            sequential = collect(s.engine.generate(prompt, preset.sampling, drafting, 48))
            s.engine.draft_ahead = True
            ahead = collect(s.engine.generate(prompt, preset.sampling, drafting, 48))
            assert ahead.tokens == sequential.tokens, prompt
            assert ahead.from_draft == sequential.from_draft
            assert (ahead.stats.rounds, ahead.stats.drafted, ahead.stats.accepted) == (
                sequential.stats.rounds, sequential.stats.drafted, sequential.stats.accepted)
            assert sequential.stats.ahead_made == 0 and ahead.stats.ahead_s > 0
            kept += ahead.stats.ahead_kept
            made += ahead.stats.ahead_made
    # The paths this must cover: draft-aheads kept (their drafts used) and draft-aheads thrown (their draws given back);
    # on the pair that agrees almost always, greedy draft-aheads can all come true.
    assert 0 < kept <= made
    if pair == "tiny_pair" or temperature > 0:
        assert kept < made


@pytest.mark.parametrize("pair", ["tiny_pair", "tiny_pair_high"])
@pytest.mark.parametrize("n_draft", [3, 6])
def test_fitted_draft_ahead_is_plain_greedy(request, pair: str, n_draft: int) -> None:
    """`draft_ahead_length = "fit"` through real llama.cpp contexts on the CPU: draft-aheads stop when the verify ends
    and the cost model decides how many more a kept one drafts; the output is plain greedy decoding's, token for
    token."""
    target, draft = request.getfixturevalue(pair)
    preset = GREEDY.with_overrides(draft_ahead="on", draft_ahead_length="fit", n_draft=n_draft, seed=11)
    assert preset.draft.draft_ahead_length == "fit"
    made = 0
    with open_session(ModelFiles(target=target, draft=draft, name="test"), preset) as s:
        assert s.engine.draft_ahead
        for prompt in prompts(3, seed=7):
            plain = collect(s.engine.generate(prompt, preset.sampling, dataclasses.replace(preset.draft, n_draft=0),
                                              48))
            fitted = collect(s.engine.generate(prompt, preset.sampling, preset.draft, 48))
            assert fitted.tokens == plain.tokens, prompt
            made += fitted.stats.ahead_made
    assert made > 0


def test_draft_ahead_setting_reaches_the_engine(tiny_pair) -> None:
    files = ModelFiles(target=tiny_pair[0], draft=tiny_pair[1], name="test")
    for draft_ahead, expected in (("on", True), ("off", False), ("auto", False)):
        with open_session(files, GREEDY.with_overrides(draft_ahead=draft_ahead)) as s:
            assert s.engine.draft_ahead is expected


def test_bench_says_when_draft_ahead_is_fitted(tiny_pair_high, tmp_path) -> None:
    """`localspec bench --draft-ahead on --draft-ahead-length fit` runs fitted draft-aheads (its JSON's preset says
    so) and its header says so."""
    target, draft = tiny_pair_high
    out = tmp_path / "fit.json"
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--draft", str(draft), "--draft-ahead", "on",
                                      "--draft-ahead-length", "fit", "--temp", "0", "--max-tokens", "16",
                                      "--repeat", "1", "--warmup", "0", "--threads", "1", "--raw", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "draft-ahead on (fitted to the verify)" in result.output
    report = json.loads(out.read_text())
    assert report["preset"]["draft"]["draft_ahead_length"] == "fit" and report["greedy_check"]["passed"]
    assert report["speculative"]["ahead_hit_rate"] is not None
