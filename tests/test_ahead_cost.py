"""The draft-length cost model with drafting ahead on one GPU, replaying the H200's round profile on a fake clock
(docs/lab/2026-12-01-h200-draft-ahead-one-gpu.md: the card pair, T = 0, k = 6). No model, no clock: each round's
timeline is computed from the measured costs and fed to the policy as the loop would (`observe_draft_ahead`, then
`observe`), so what the policy chooses is deterministic and can be checked against brute force over the choices.

The profile: a verify of 7 tokens costs 27.09 ms alone and 29.17 beside the draft (the contention, 2.08 ms); a draft
step alone 1.9 ms, beside the verify 4.15 (29.03 ms for the guess and 6 drafts); the loop waited 2.2 ms a round after
the verify for the draft-ahead, so the thread lags ~2.35 ms behind a verify that starts with it (thread start, the GIL);
host work 0.4 ms. ~85% acceptance is each position accepted with 0.948 (6.00 tokens a round, draft-aheads kept ~70%);
~70% is 0.877 (4.89 tokens a round).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers_fake import draft_policy

from localspec.config import load_preset
from localspec.drafters.lookup import LookupCost
from localspec.drafters.model import ModelCost
from localspec.rounds.policies import DraftCost, DraftLength, Observation

GREEDY = load_preset("greedy")
STEP, AHEAD_STEP, LAG, CONTENTION, HOST = 0.0019, 0.00415, 0.00235, 0.00208, 0.0004


def verify_alone(width: int) -> float:
    """The Q4_K_M target's verify on the H200: 27.09 ms at 7 tokens, ~2.2 ms less a token narrower; a plain step
    12.8 ms."""
    return 0.0128 if width == 1 else 0.02709 - 0.0022 * (7 - width)


@dataclasses.dataclass
class Timeline:
    """One stream's rounds on the H200's costs, drafting ahead beside each verify."""

    length: DraftLength | None  # told what each round measured (None: fixed k, full draft-aheads, told nothing)
    acceptance: float
    k: int = 6
    fixed_ahead: int | None = None  # draft-aheads of exactly this many drafts (else the policy's `draft_ahead_length`)
    stop_at_verify: bool = False  # the draft-ahead starts no decode after the verify ended ("fit")
    seed: int = 0
    tokens: int = 0
    seconds: float = 0.0
    waits: float = 0.0
    kept_rounds: int = 0
    ahead_drafts: list[int] = dataclasses.field(default_factory=list)

    def run(self, rounds: int) -> float:
        """Tokens per second over `rounds` rounds."""
        rng = np.random.default_rng(self.seed)
        kept: int | None = None  # the drafts of a draft-ahead that held, for this round
        for _ in range(rounds):
            k = self.length.next() if self.length is not None else self.k
            if kept is not None and k > 0:
                self.kept_rounds += 1
                more = (self.length.rule(ModelCost).continuation(kept, k, self.length.padded)
                        if self.length is not None and kept < k else k - kept)
                drafted, on_path, ahead = kept + more, more, kept
            else:
                drafted, on_path, ahead = k, k, 0
            draft_s = on_path * STEP
            width = k + 1
            beside = drafted > 0 and k > 0
            verify_s = verify_alone(width) + (CONTENTION if beside else 0.0)
            right = rng.random(drafted + 1) < self.acceptance  # the drafts, then the draft-ahead's guess
            accepted = int(np.argmin(np.append(right[:drafted], False)))
            wait, kept = None, None
            if beside:
                limit = self.fixed_ahead if self.fixed_ahead is not None else (
                    self.length.rule(ModelCost).draft_ahead_length(k) if self.length is not None else k)
                limit = min(limit, k)
                decodes = 1  # the guess
                while decodes < 1 + limit and not (self.stop_at_verify and LAG + decodes * AHEAD_STEP >= verify_s):
                    decodes += 1
                self.ahead_drafts.append(decodes - 1)
                wait = max(0.0, LAG + decodes * AHEAD_STEP - verify_s)
                self.waits += wait
                could_keep = accepted == drafted
                came_true = could_keep and bool(right[drafted])
                if self.length is not None:
                    rule = self.length.rule(ModelCost)
                    rule.observe_draft_ahead(decodes * AHEAD_STEP, decodes, could_keep, came_true)
                kept = decodes - 1 if came_true else None
            if self.length is not None:
                self.length.observe(Observation(drafted, accepted, draft_s, verify_s, width, 0,
                                                STEP if on_path else 0.0, ahead, wait))
            self.tokens += accepted + 1
            self.seconds += draft_s + verify_s + (wait or 0.0) + HOST
        return self.tokens / self.seconds


def policy(k: int = 6, adaptive: bool = False, fit: bool = False) -> DraftLength:
    drafting = dataclasses.replace(GREEDY.draft, n_draft=k, adaptive=adaptive,
                                   draft_ahead_length="fit" if fit else "full")
    return draft_policy(drafting, DraftCost(k, graphs=False), padded=True)


def test_the_profile_replays_and_the_cost_model_learns_its_numbers() -> None:
    """Fixed k = 6, whole draft-aheads: the timeline is the H200's round (34-35 ms: verify 29.17 + the wait 2.2 + thrown
    draft-aheads' drafts + host), and the cost model measures the contended step, the thread's lag and the guess
    rate."""
    length = policy()
    line = Timeline(length, 0.948)
    speed = line.run(600)
    rounds = 600
    assert line.waits / rounds == pytest.approx(0.0022, abs=0.0002)
    assert 0.0335 < line.seconds / rounds < 0.0355
    assert 0.62 < line.kept_rounds / rounds < 0.76
    assert 168 < speed < 180  # (measured: 176.2 tok/s)
    model = length.rule(ModelCost)
    assert model.draft_ahead_step_s == pytest.approx(AHEAD_STEP)
    assert model.draft_ahead_lag_s == pytest.approx(LAG, abs=1e-4)
    assert model.guess_rate == pytest.approx(0.948, abs=0.06)
    assert length.cost.step_s == pytest.approx(STEP)


@pytest.mark.parametrize("acceptance", [0.948, 0.877])
def test_fit_drafts_ahead_what_fits_beside_the_verify(acceptance: float) -> None:
    """What the numbers say: 6 decodes (the guess and 5 drafts) end 2 ms before the verify, a 7th overruns it by 2.2 ms,
    and the 6th draft costs 1.9 ms alone only in rounds whose draft-ahead is kept. So a draft-ahead of 5 drafts, and the
    policy's choice is the best of every fixed draft-ahead length on the same timeline (brute force), ~2% above whole
    draft-aheads."""
    length = policy(fit=True)
    fitted = Timeline(length, acceptance, stop_at_verify=True)
    fit_speed = fitted.run(800)
    assert length.rule(ModelCost).draft_ahead_length(6) == 5
    assert fitted.ahead_drafts[-100:] == [5] * 100
    by_draft_ahead = {j: Timeline(policy(), acceptance, fixed_ahead=j).run(800) for j in range(7)}
    best = max(by_draft_ahead, key=by_draft_ahead.__getitem__)
    assert best == 5, by_draft_ahead
    assert fit_speed >= 0.995 * by_draft_ahead[best]
    assert fit_speed > 1.01 * by_draft_ahead[6]  # whole draft-aheads (today's default)
    assert fitted.waits / 800 < 0.0003  # the wait is gone (a draft-ahead cut short of 5 now and then by a slow verify)


@pytest.mark.parametrize(("acceptance", "k_max"), [(0.948, 6), (0.877, 6), (0.948, 8), (0.877, 8)])
def test_adaptive_with_draft_ahead_picks_the_fastest_draft_length(acceptance: float, k_max: int) -> None:
    """--adaptive on the draft-ahead timeline: the k it settles on makes the round within 2% of the best fixed k
    (brute force over 1..k_max on the same timeline, draft-aheads fitted). What the numbers say: at ~85% k = 5 and 6 tie
    (174.8 tok/s) and k = 7 is best (178.1); at ~70% k = 4 (137.8, k = 6: 132.0)."""
    length = policy(k_max, adaptive=True, fit=True)
    adaptive = Timeline(length, acceptance, k=k_max, stop_at_verify=True)
    adaptive.run(40 * DraftLength.EPOCH)
    settled = length.k
    by_k = {k: Timeline(policy(k, fit=True), acceptance, k=k, stop_at_verify=True).run(800)
            for k in range(1, k_max + 1)}
    best = max(by_k, key=by_k.__getitem__)
    assert by_k[settled] >= 0.98 * by_k[best], (settled, by_k)


def test_the_draft_ahead_model_charges_long_drafts_for_the_wait() -> None:
    """The model's round time grows with the wait a longer draft-ahead causes: with the thread's lag measured, a round
    of k = 6 whole draft-aheads is dearer than the same without the lag by the expected wait, 2.2 ms."""
    cost = DraftCost(6)
    model = ModelCost.of(cost)
    for _ in range(40):
        model.observe_draft_ahead(7 * AHEAD_STEP, 7, True, True)
        cost.observe(Observation(6, 6, 0.0, 0.02917, 7, 0, 0.0, 6, 0.0022))
    cost.observe(Observation(6, 6, 6 * STEP, 0.02917, 7, 0, STEP, 0, None))  # (a step measured)
    cost.observe(Observation(6, 6, 6 * STEP, 0.02917, 7, 0, STEP, 0, None))
    with_lag = 1 / model.speed(0, 6, 7) * cost.survival("model", 6).sum()
    model.draft_ahead_lag_s = 0.0
    cost.changed()
    without = 1 / model.speed(0, 6, 7) * cost.survival("model", 6).sum()
    assert with_lag - without == pytest.approx(0.0022, abs=2e-4)


# -- the per-round questions on Python floats against the numpy formulas they replaced ---------------------------

def numpy_verify_costs(cost: DraftCost, widths: np.ndarray) -> np.ndarray:
    """The verify estimate as arrays (prior slope from the narrowest width; a least-squares line through the
    measured ones, floored; measured widths as measured)."""
    narrowest = min(cost.verify_s)
    prior = cost.verify_s[narrowest] * (1 + cost.VERIFY_SLOPE * (widths - 1)) / (
        1 + cost.VERIFY_SLOPE * (narrowest - 1))
    if len(cost.verify_s) == 1:
        estimate = prior
    else:
        tried = sorted(cost.verify_s)
        mean_w = sum(tried) / len(tried)
        mean_s = sum(cost.verify_s[w] for w in tried) / len(tried)
        slope = (sum((w - mean_w) * (cost.verify_s[w] - mean_s) for w in tried)
                 / sum((w - mean_w) ** 2 for w in tried))
        line = mean_s + slope * (widths - mean_w)
        estimate = np.where(widths < narrowest, np.maximum(line, prior), np.maximum(line, cost.verify_s[narrowest]))
    measured = np.array([cost.verify_s.get(int(w), np.nan) for w in widths.ravel()]).reshape(widths.shape)
    return np.where(np.isnan(measured), estimate, measured)


def numpy_survival(cost: DraftCost, source: str) -> np.ndarray:
    rates = np.empty(cost.k_max + 1)
    rate = cost.prior[source]
    for i in range(1, cost.k_max + 1):
        rate = (cost.ok[source][i] + cost.PRIOR_WEIGHT * rate) / (cost.tried[source][i] + cost.PRIOR_WEIGHT)
        rates[i] = rate
    rates[0] = 1.0
    return np.cumprod(rates)


def numpy_best_ahead(model: ModelCost, k: int) -> int:
    cost = model.cost
    if k <= 0 or model.draft_ahead_step_s is None or model.draft_ahead_lag_s is None or cost.step_s is None:
        return k
    verify_s = float(numpy_verify_costs(cost, np.array([k + 1]))[0])
    j = np.arange(k + 1)
    kept = float(numpy_survival(cost, "model")[k]) * model.guess_rate
    wait = np.maximum(0.0, model.draft_ahead_lag_s + (1 + j) * model.draft_ahead_step_s - verify_s)
    return int(k - np.argmin((wait + kept * (k - j) * cost.step_s)[::-1]))


def numpy_best_continuation(cost: DraftCost, ready: int, room: int, width: int) -> int:
    if room <= 0:
        return 0
    if cost.step_s is None or not cost.verify_s:
        return room
    n = np.arange(room + 1)
    expected = np.cumsum(numpy_survival(cost, "model"))[ready + n]
    widths = np.maximum(width, ready + n + 1)
    return int(np.argmax(expected / (numpy_verify_costs(cost, widths) + n * cost.step_s)))


@pytest.mark.parametrize("seed", [0, 1, *(pytest.param(s, marks=pytest.mark.slow) for s in (2, 3))])
def test_the_per_round_questions_answer_as_the_numpy_formulas(seed: int) -> None:
    """`best_draft_ahead`, `best_continuation` and the verify estimates run on Python floats (a round asks them on the
    loop's path; numpy's calls cost more than their arithmetic there): over random histories of rounds (k_max 3 to
    8, one to several verify widths, draft-aheads kept and thrown, lookup and model tokens), every answer is the numpy
    formulas' (written here as arrays), the verify costs and survivals to the last bit."""
    rng = np.random.default_rng(seed)
    k_max = int(rng.integers(3, 9))
    cost = DraftCost(k_max, graphs=bool(seed % 2))
    LookupCost.of(cost)
    model = ModelCost.of(cost)
    model.draft_ahead_fit = True
    checked = 0
    for r in range(100):
        if rng.random() < 0.8:
            decodes = int(rng.integers(1, k_max + 2))
            could_keep = bool(rng.random() < 0.6)
            model.observe_draft_ahead(decodes * float(rng.uniform(0.002, 0.005)), decodes, could_keep,
                                could_keep and bool(rng.random() < 0.8))
        drafted = int(rng.integers(0, k_max + 1))
        looked_up = int(rng.integers(0, drafted + 1)) if rng.random() < 0.3 else 0
        width = int(rng.choice([drafted + 1, k_max + 1])) if r % 7 else int(rng.integers(1, k_max + 2))
        cost.observe(Observation(drafted, int(rng.integers(0, drafted + 1)),
                                 drafted * float(rng.uniform(0.0015, 0.0025)),
                                 float(rng.uniform(0.02, 0.03)) * (1 + 0.1 * width), width, looked_up,
                                 float(rng.uniform(0.0015, 0.004)), int(rng.integers(0, drafted + 1)),
                                 float(rng.uniform(0.0, 0.003)) if rng.random() < 0.8 else None))
        widths = np.arange(k_max + 5)
        assert cost.verify_costs(widths).tolist() == numpy_verify_costs(cost, widths).tolist()
        for source in cost.prior:
            assert cost.survival(source, k_max).tolist() == numpy_survival(cost, source).tolist()
        for k in range(k_max + 1):
            assert model.best_draft_ahead(k) == numpy_best_ahead(model, k), (r, k)
            for ready in range(k + 1):
                for padded in (0, k + 1, k_max + 3):
                    got = model.best_continuation(ready, k - ready, padded)
                    assert got == numpy_best_continuation(cost, ready, k - ready, padded), (r, k, ready, padded)
                    checked += 1
    assert model.draft_ahead_step_s is not None and model.draft_ahead_lag_s is not None and cost.step_s is not None
    assert checked > 1000


def test_a_slow_draft_ahead_never_makes_the_model_hopeless() -> None:
    """The chain's lock-out (tests/test_chain_replay.py): the stream's first draft-ahead is cold (300 ms: the thread's
    start, a first call on the GPU). Taken whole as the contended step, it made a model worth ~2x plain a loss even if
    every draft were accepted; judged hopeless, it was probed only every 256 rounds, no draft-ahead ran again to correct
    the figure. Now the cold draft-ahead measures nothing, the contended step is the least of two draft-aheads at least,
    `could_pay` judges drafts on the path (the draft-ahead's figures are measured only while the model drafts), and a
    draft-ahead after a pause replaces the old figures."""
    cost = DraftCost(6, graphs=False)
    model = ModelCost.of(cost)
    cost.observe(Observation(0, 0, 0.0, 0.0127, 1))  # a plain round
    model.observe_draft_ahead(0.3, 2, could_keep=False, kept=False)  # cold
    cost.observe(Observation(6, 6, 6 * STEP, 0.02713, 7, first_s=STEP, wait_s=0.3 + LAG - 0.02713))
    assert model.draft_ahead_step_s is None and model.draft_ahead_lag_s is None
    assert model.could_pay(0, 6, 7)
    model.draft_ahead_step_s, model.draft_ahead_lag_s = 0.05, 0.3  # wrong figures, however they came
    assert model.could_pay(0, 6, 7)
    for _ in range(DraftCost.DECAY + 1):  # the model sits out
        cost.observe(Observation(0, 0, 0.0, 0.0127, 1))
    model.observe_draft_ahead(0.1, 2, could_keep=False, kept=False)  # a probe's: they replace the old figures
    cost.observe(Observation(6, 0, 6 * STEP, 0.02713, 7, first_s=STEP, wait_s=LAG + 0.1 - 0.02713))
    assert model.draft_ahead_step_s is None  # (one draft-ahead's figure is not yet a step: it might be the slow one)
    model.observe_draft_ahead(7 * AHEAD_STEP, 7, could_keep=True, kept=True)
    cost.observe(Observation(6, 6, 0.0, 0.02713, 7, drafted_ahead=6, wait_s=LAG + 7 * AHEAD_STEP - 0.02713))
    assert model.draft_ahead_step_s == pytest.approx(AHEAD_STEP)
    assert model.draft_ahead_lag_s == pytest.approx(LAG, abs=1e-6)
