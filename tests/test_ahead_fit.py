"""`draft_ahead_length = "fit"`: the draft-ahead stops when the verify ends, and a draft-ahead that held with fewer
drafts than the round asks for goes on where it stopped. On the scripted fakes (tests/helpers_fake.py) with the verify's
end in lockstep with the draft's decodes (`Gate`: no timing), so each draft-ahead holds exactly as many drafts as fit:
the output is the sequential loop's token for token when the round drafts the rest, plain greedy whatever the cost model
decides, and at T > 0 the emitted tokens follow the target's exact distribution."""

from __future__ import annotations

import dataclasses
import threading
import time
import types
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from helpers_fake import FakeModel
from helpers_stats import chi_square, joint_probs

from localspec.config import load_preset
from localspec.drafters import model as model_drafter
from localspec.drafters.model import ModelCost
from localspec.rounds.engine import Engine
from localspec.rounds.events import collect
from localspec.rounds.scores import Scores

GREEDY = load_preset("greedy")
HOT = dataclasses.replace(GREEDY.sampling, temperature=0.8, top_k=0, top_p=1.0)
AHEAD_THREAD = "localspec-draft-ahead"


def drafting(n: int, draft_ahead_length: str = "fit"):
    return dataclasses.replace(GREEDY.draft, n_draft=n, draft_ahead_length=draft_ahead_length,
                               # (a fixed drafting pattern, token for token: standing aside follows the clock;
                               # tests/test_stand_aside.py checks it)
                               stand_aside=False)


class Gate:
    """The verify's end, in lockstep with the draft-ahead beside it: the ahead's first `fits` decodes (the guess's
    included) end before the verify does, the next is in flight when it ends and returns only after the loop said
    so (the drafter's `verified` event, recorded as it is made); the verify ends when that decode has started, or
    when the draft-ahead ended before it."""

    def __init__(self, fits: int) -> None:
        self.fits = fits
        self.events: list[threading.Event] = []
        self.decodes: dict[int, int] = {}  # per draft-ahead (its event): the decodes it made
        self.in_flight: threading.Event | None = None
        self.cond = threading.Condition()

    def Event(self) -> threading.Event:  # noqa: N802 (stands in for threading.Event in the drafter)
        event = threading.Event()
        self.events.append(event)
        return event

    def draft_decode(self) -> None:
        """Called by the draft before each decode in the draft-ahead thread."""
        event = self.events[-1]
        n = self.decodes[id(event)] = self.decodes.get(id(event), 0) + 1
        if n == self.fits + 1:
            with self.cond:
                self.in_flight = event
                self.cond.notify_all()
            assert event.wait(5), "the verify never ended"

    def verify(self, pending: Sequence) -> None:
        """Called by the target before a verify beside a draft-ahead (`pending`: its future)."""
        deadline = time.monotonic() + 5
        with self.cond:
            while self.in_flight is not self.events[-1] and not all(job.done() for job in pending):
                assert time.monotonic() < deadline, "the draft-ahead neither ended nor reached the verify's end"
                self.cond.wait(0.001)


class GatedDraft(FakeModel):
    gate: Gate

    def decode_many(self, items: Sequence[tuple[int, Sequence[int], int, bool]]) -> list[Scores | None]:
        if threading.current_thread().name.startswith(AHEAD_THREAD):
            self.gate.draft_decode()
        return super().decode_many(items)


class GatedTarget(FakeModel):
    gate: Gate
    engine: Engine

    def decode_many(self, items: Sequence[tuple[int, Sequence[int], int, bool]]) -> list[Scores | None]:
        pending = list(self.engine.drafters["model"]._pending.values())  # type: ignore[attr-defined]
        if pending:
            self.gate.verify(pending)
        return super().decode_many(items)


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch):
    """A factory of (engine, target, gate): the drafter's events are the gate's."""
    made: list[Engine] = []

    def make(fits: int, vocab: int = 8, noise: float = 0.5, seed: int = 3) -> tuple[Engine, GatedTarget, Gate]:
        gate = Gate(fits)
        monkeypatch.setattr(model_drafter, "threading", types.SimpleNamespace(Event=gate.Event))
        target, draft = GatedTarget(vocab, seed=seed), GatedDraft(vocab, seed=seed, noise=noise)
        target.gate = draft.gate = gate
        engine = Engine(target, draft, draft_ahead=True)
        target.engine = engine
        made.append(engine)
        return engine, target, gate

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def the_rest(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """A draft-ahead drafts until the verify ends (no limit from the cost model) and the round of a draft-ahead that
    held drafts every token it lacks (the sequential loop's proposal); the calls, recorded."""
    calls: list[tuple[int, int]] = []

    def continuation(self: ModelCost, ready: int, k: int, padded: bool) -> int:
        calls.append((ready, k))
        return k - ready
    monkeypatch.setattr(ModelCost, "continuation", continuation)
    monkeypatch.setattr(ModelCost, "draft_ahead_length", lambda self, k: k)
    return calls


@pytest.mark.parametrize("fits", [1, 2, 3])
@pytest.mark.parametrize("sampling", [GREEDY.sampling, HOT], ids=["greedy", "hot"])
def test_a_draft_ahead_cut_at_the_verify_and_drafted_on_is_the_sequential_loop(gated, the_rest, fits: int,
                                                                       sampling) -> None:
    """Each draft-ahead holds exactly the drafts that fit (the decode in flight at the verify's end included, none
    after it), its kept rounds draft the rest where it stopped, and the output, the accepted drafts and the rounds
    are the sequential loop's (same seed: the same random stream, drawn in the same order)."""
    prompt = list(range(8))
    sequential = Engine(FakeModel(seed=3), FakeModel(seed=3, noise=0.5), draft_ahead=False)
    reference = collect(sequential.generate(prompt, sampling, drafting(5), 200))
    engine, _, gate = gated(fits)
    ahead = collect(engine.generate(prompt, sampling, drafting(5), 200))
    assert ahead.tokens == reference.tokens
    assert (ahead.stats.rounds, ahead.stats.drafted, ahead.stats.accepted) == (
        reference.stats.rounds, reference.stats.drafted, reference.stats.accepted)
    assert ahead.stats.ahead_kept >= 10
    made = list(gate.decodes.values())
    assert max(made) == fits + 1 and all(n <= fits + 1 for n in made), made  # (the guess, then the drafts)
    assert the_rest and all(ready == fits for ready, _ in the_rest), the_rest
    if sampling.greedy:
        assert ahead.tokens == FakeModel(seed=3).greedy(prompt, 200)


@pytest.mark.parametrize("fits", [1, 3])
def test_fitted_draft_aheads_stay_plain_greedy_whatever_the_cost_model_drafts_on(gated, fits: int) -> None:
    """Without the stand-in: the cost model decides how many more a draft-ahead that held drafts (measured on the fakes'
    timings, whatever they are); greedy output is plain greedy, and the draft's cells stay a prefix of the
    committed tokens."""
    kept = 0
    for seed in range(4):
        engine, target, gate = gated(fits, noise=0.25, seed=seed)
        prompt = np.random.default_rng(seed).integers(0, 8, 10).tolist()
        gen = collect(engine.generate(prompt, GREEDY.sampling, drafting(6), 80))
        assert gen.tokens == target.greedy(prompt, 80)
        assert max(gate.decodes.values()) <= fits + 1
        kept += gen.stats.ahead_kept
        committed = engine.slots[0].tokens
        draft_cells = engine.drafters["model"].model.cells[0]  # type: ignore[attr-defined]
        assert committed[: len(draft_cells)] == draft_cells
    assert kept > 0


def test_fitted_draft_aheads_keep_the_targets_distribution(gated, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first four tokens over many seeds, with draft-aheads of 2 cut at the verify after one draft and kept rounds
    that alternately verify the one draft and draft the other: their joint frequency fits the target's own
    p(t1) p(t2 | t1) ... (vocabulary 3: 81 outcomes)."""
    turns = {"n": 0}

    def alternate(self: ModelCost, ready: int, k: int, padded: bool) -> int:
        turns["n"] += 1
        return (k - ready) * (turns["n"] % 2)
    monkeypatch.setattr(ModelCost, "continuation", alternate)
    monkeypatch.setattr(ModelCost, "draft_ahead_length", lambda self, k: k)
    engine, target, _ = gated(1, vocab=3, noise=3.0, seed=5)
    prompt = [0, 1, 2, 1]
    counts: Counter = Counter()
    kept = 0
    for seed in range(2000):
        gen = collect(engine.generate(prompt, dataclasses.replace(HOT, seed=seed), drafting(2), 6))
        counts[tuple(gen.tokens[:4])] += 1
        kept += gen.stats.ahead_kept
    joint = joint_probs(lambda context: target.next_probs(context, HOT), prompt, 4)
    assert kept > 200 and turns["n"] > 200
    assert chi_square(counts, joint) < 124.8  # 80 degrees of freedom, the 99.9th percentile


class SlowDraft(FakeModel):
    """A draft whose every decode takes at least `seconds` (a sleep): a draft-ahead outlasts the fake's verify."""

    def __init__(self, seconds: float, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.seconds = seconds

    def decode_many(self, items: Sequence[tuple[int, Sequence[int], int, bool]]) -> list[Scores | None]:
        time.sleep(self.seconds)
        return super().decode_many(items)


@pytest.mark.parametrize("draft_ahead_length", ["full", "fit"])
def test_the_loop_tells_the_cost_model_what_draft_aheads_cost(draft_ahead_length: str) -> None:
    """What the cost model's draft-ahead terms are measured from reaches it through the real loop: each draft-ahead's
    decodes and seconds (a decode beside the verify: at least the draft's 4 ms), the wait after the verify (the fake's
    verify takes microseconds, so the loop waits and the thread's lag is measured), and the draft-aheads that could come
    true and did (the lag needs one round in which the loop waited, which a draft decode of 4 ms beside a verify of
    microseconds makes every round). Bounds only from below: a busy machine makes a sleep longer."""
    target, draft = FakeModel(seed=3), SlowDraft(0.004, seed=3, noise=0.3)
    engine = Engine(target, draft, draft_ahead=True)
    gen = collect(engine.generate(list(range(8)), GREEDY.sampling, drafting(4, draft_ahead_length), 40))
    engine.close()
    assert gen.tokens == target.greedy(list(range(8)), 40)
    model = next(iter(engine.slots[0].policies.values())).rule(ModelCost)
    assert model.draft_ahead_fit is (draft_ahead_length == "fit")
    assert model.draft_ahead_step_s is not None and model.draft_ahead_step_s >= 0.004
    assert model.draft_ahead_lag_s is not None and model.draft_ahead_lag_s >= 0.0
    assert gen.stats.ahead_kept > 0 and model.guesses >= gen.stats.ahead_kept and model.guesses_right >= 1


class _NumpyUses:
    """Stands in for numpy inside the cost model (`localspec.rounds.policies`, the model drafter's `ModelCost`): records
    each reach for it (the thread, the name)."""

    def __init__(self) -> None:
        self.uses: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> object:
        self.uses.append((threading.current_thread().name, name))
        return getattr(np, name)


def test_the_cost_models_questions_each_round_stay_off_numpy_and_off_the_loops_path(
        gated, monkeypatch: pytest.MonkeyPatch) -> None:
    """With fitted draft-aheads the cost model answers two questions a round: how many drafts fit beside the verify
    (`best_draft_ahead`) and how many more a draft-ahead that held cut short drafts now (`best_continuation`). Asked
    through numpy arrays they cost ~0.5 ms of host time a round inside the loop on the 2-core CPU (docs/lab, "T > 0 host
    share"). Counted, not timed: `best_draft_ahead` is asked on the draft-ahead thread (beside the verify, off the
    loop's path) once a draft-ahead, the survival and verify tables are built at most once per observation, and nothing
    a fixed-length round asks or tells the cost model reaches for numpy."""
    from localspec.drafters import model as model_drafter
    from localspec.rounds import policies

    asked: dict[str, list[str]] = {"best_draft_ahead": [], "best_continuation": []}

    def recorded(method, calls: list[str]):  # type: ignore[no-untyped-def]
        def question(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(threading.current_thread().name)
            return method(self, *args, **kwargs)
        return question
    for name, calls in asked.items():
        monkeypatch.setattr(ModelCost, name, recorded(getattr(ModelCost, name), calls))
    built, tables = [], policies._Tables

    def counted(*args: object) -> object:
        built.append(threading.current_thread().name)
        return tables(*args)
    monkeypatch.setattr(policies, "_Tables", counted)
    engine, _, _ = gated(2, noise=0.5, seed=3)
    stream = engine.start(list(range(8)), HOT, drafting(5), 150)
    numpy = _NumpyUses()
    monkeypatch.setattr(policies, "np", numpy)  # (after start: a stream's cost model is made with numpy arrays)
    monkeypatch.setattr(model_drafter, "np", numpy)
    while not stream.finished:
        engine.step([stream])
        list(stream.events())
    stats = stream.stats
    assert stats.ahead_kept >= 5 and stats.rounds >= 20
    assert numpy.uses == []
    assert len(asked["best_draft_ahead"]) == stats.ahead_made
    assert set(asked["best_draft_ahead"]) == {f"{AHEAD_THREAD}_0"}
    assert asked["best_continuation"] and set(asked["best_continuation"]) == {threading.main_thread().name}
    assert len(built) <= stats.rounds + 1
