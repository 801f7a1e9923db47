"""The draft-length policy and its cost model on synthetic observations: no model, no clock. Each round is fed the
seconds a machine would have measured (`observe`), so the choices are deterministic."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from helpers_fake import draft_policy

from localspec.config import Drafting, load_preset
from localspec.drafters.chain import ChainCost
from localspec.drafters.model import ModelCost
from localspec.rounds.policies import DraftCost, Observation
from localspec.rounds.policies import DraftLength as _DraftLength


def drafting(n_draft: int, p_min: float, adaptive: bool) -> Drafting:
    return dataclasses.replace(load_preset().draft, n_draft=n_draft, p_min=p_min, adaptive=adaptive)


def policy(cfg: Drafting, cost: DraftCost | None = None, padded: bool = False) -> _DraftLength:
    return draft_policy(cfg, cost, padded)


def model_cost(k: int = 6, graphs: bool = False) -> tuple[DraftCost, ModelCost]:
    """Measured facts with the draft model's rule attached (as a stream of the model drafter has them)."""
    cost = DraftCost(k, graphs=graphs)
    return cost, ModelCost.of(cost)


def chained(cfg: Drafting, padded: bool = False) -> tuple[_DraftLength, ChainCost]:
    """A chain stream's policy and the chain's rule."""
    chooser = policy(dataclasses.replace(cfg, drafter="chain"), padded=padded)
    return chooser, chooser.rule(ChainCost)


def verify_line(base: float, per_token: float) -> Callable[[int], float]:
    return lambda width: base + per_token * width


def feed(chooser: _DraftLength, rounds: int, accepted_of, draft_step: float, verify_base: float,
         verify_per_token: float) -> list[int]:
    ks = []
    for _ in range(rounds):
        k = chooser.next()
        ks.append(k)
        accepted = accepted_of(k)
        chooser.observe(Observation(k, accepted, draft_step * k, verify_base + verify_per_token * (k + 1), k + 1))
    return ks


def runs(lengths: list[int]) -> Callable[[int], int]:
    """Accepted drafts per round from a cycle of run lengths (how far the draft stays right): deterministic."""
    state = {"i": 0}

    def accepted_of(k: int) -> int:
        state["i"] += 1
        return min(k, lengths[state["i"] % len(lengths)])
    return accepted_of


def test_fixed_length_is_the_preset_at_any_temperature():
    chooser = policy(drafting(12, 0.0, False))
    assert feed(chooser, 40, lambda k: 0, 0.001, 0.01, 0.001) == [12] * 40


def test_adaptive_changes_length_only_at_epoch_boundaries():
    """Every width change re-captures CUDA graphs: k holds for whole epochs."""
    chooser = policy(drafting(9, 0.0, True))
    ks = feed(chooser, 12 * _DraftLength.EPOCH, lambda k: min(k, 2), 0.0008, 0.010, 0.0014)
    changes = [i for i in range(1, len(ks)) if ks[i] != ks[i - 1]]
    assert changes and all(i % _DraftLength.EPOCH == 0 for i in changes)
    # k_max, k_max / 2, then settled on 2 — but for an epoch re-measuring 3 once what it knew of 3 has decayed.
    assert len(changes) <= 6 and ks.count(2) > len(ks) / 2


def test_adaptive_picks_plain_decoding_when_a_draft_step_costs_a_verify():
    """The 2-core CPU demo pair: a draft step costs what a one-token verify costs, and a wider verify more; at 70%
    acceptance no length pays, so k = 0 (plain steps)."""
    chooser = policy(drafting(6, 0.0, True))
    ks = feed(chooser, 10 * _DraftLength.EPOCH, runs([0, 1, 2, 3, 5, 6, 2, 1, 4, 0]), draft_step=0.017,
              verify_base=0.011, verify_per_token=0.006)
    assert ks[-_DraftLength.EPOCH:].count(0) >= _DraftLength.EPOCH - 1 and chooser.k == 0


def test_adaptive_keeps_the_longest_length_when_drafts_are_always_right_and_cheap():
    chooser = policy(drafting(10, 0.0, True))
    ks = feed(chooser, 8 * _DraftLength.EPOCH, lambda k: k, draft_step=0.0005, verify_base=0.010,
              verify_per_token=0.0002)
    assert ks[-1] == 10


def test_adaptive_shrinks_k_when_drafts_fail_early():
    chooser = policy(drafting(9, 0.0, True))
    ks = feed(chooser, 8 * _DraftLength.EPOCH, lambda k: min(k, 1), draft_step=0.0008, verify_base=0.010,
              verify_per_token=0.0014)
    assert ks[-1] in (1, 2)  # the second draft is always wrong: 1 (2 when its prior has not decayed yet)


def test_adaptive_prefers_the_length_that_covers_the_burst():
    """Drafts right for exactly 6 tokens, then wrong: shorter leaves tokens behind, longer wastes work."""
    chooser = policy(drafting(9, 0.0, True))
    ks = feed(chooser, 8 * _DraftLength.EPOCH, lambda k: min(k, 6), draft_step=0.0008, verify_base=0.010,
              verify_per_token=0.0014)
    assert ks[-1] == 6


def test_adaptive_lands_on_the_true_optimum_between_the_ends():
    """GPU-like costs (the card pair: draft 2.2 ms a step, verify 12.7 ms + 2.2 ms a token) with bursty acceptance:
    the chosen k is the one that maximises the true expected tokens per second, and neither 0 nor k_max."""
    lengths = [0, 1, 1, 2, 2, 3, 3, 4, 5, 8]
    step, base, per = 0.0022, 0.0105, 0.0022
    chooser = policy(drafting(8, 0.0, True))
    feed(chooser, 12 * _DraftLength.EPOCH, runs(lengths), step, base, per)

    def true_speed(k: int) -> float:
        expected = 1 + sum(np.mean([r >= i for r in lengths]) for i in range(1, k + 1))
        return expected / (k * step + base + per * (k + 1))

    speeds = {k: true_speed(k) for k in range(9)}
    best = max(speeds, key=speeds.__getitem__)
    assert 0 < best < 8
    assert speeds[chooser.k] >= 0.97 * speeds[best], (chooser.k, best)


def test_the_chain_skips_the_model_when_it_is_a_loss_and_extends_when_it_pays():
    """`extension`: after lookup's m tokens, the model's share of k by measured cost. Costly steps: 0 (but for the
    warm-up rounds that measure it and the occasional probe); cheap steps: all k - m. (Every draft is right: the
    costly model loses even so.)"""
    for step, want in ((0.017, 0), (0.0005, 4)):
        chooser, chain = chained(drafting(6, 0.0, False))
        got = []
        for _ in range(40):
            n = chain.extension(2, 6, chooser)
            got.append(n)
            chooser.observe(Observation(2 + n, 2 + n, step * n, 0.011 + 0.006 * (3 + n), 3 + n, lead=2))
        # Measure first: a probe's length until the step is known, then all the room where the model could pay
        # (a probe's two positions would judge the deeper ones on a rejection or two).
        assert got[:_DraftLength.WARMUP] == [ModelCost.PROBE, ModelCost.PROBE if want == 0 else 4], got
        tail = got[_DraftLength.WARMUP:]
        assert tail.count(want) >= len(tail) - 2, got


def test_a_padded_verify_makes_model_tokens_cheaper():
    """On a GPU a round with lookup's drafts is padded to k + 1 anyway: the model's tokens after them cost only
    their draft steps there. (A round with nothing drafted is costed narrow: `verify_width` goes narrow.)"""
    cost = policy(dataclasses.replace(drafting(6, 0.0, False), drafter="chain")).cost
    model = ModelCost.of(cost)
    for width, seconds in ((7, 0.027), (2, 0.015)):
        cost.observe(Observation(width - 1, 1, 0.004 * (width - 1), seconds, width))
    assert model.best_extension(2, 4, width=0) == 0  # 4 ms a step at modest acceptance: a loss unpadded
    assert model.best_extension(2, 4, width=7) > 0  # ... but the padded positions are paid for
    # With nothing looked up, drafting nothing is a narrow plain step: the model's first token must pay for the
    # whole padded width, and here it does not (though unpadded it would).
    assert model.best_extension(0, 6, width=7) == 0 < model.best_extension(0, 6, width=0)


def test_the_probe_turns_the_model_back_on_when_its_cost_drops():
    """A draft step that costs more than its tokens could ever save (a loss even if every one were accepted) is
    probed at the longest interval only; the probe finds it cheap again within that interval."""
    chooser, chain = chained(drafting(6, 0.0, False))
    used = []
    for i in range(1200):
        step = 0.017 if i < 200 else 0.0005  # the box was loaded; now it is not
        n = chain.extension(0, 6, chooser)
        used.append(n)
        chooser.observe(Observation(n, min(n, 3), step * n, 0.011 + 0.006 * (n + 1), n + 1))
    # (the warm-up: WARMUP probes, and between them one plain round that prices plain decoding: no padded verify)
    assert used[:_DraftLength.WARMUP + 1] == [ModelCost.PROBE, 0, ModelCost.PROBE]
    off = used[_DraftLength.WARMUP + 1:200]
    assert off == [0] * len(off)  # hopeless at any acceptance: not even probed within the longest interval
    turned_on = next(i for i in range(200, len(used)) if used[i] > ModelCost.PROBE)
    assert turned_on - 200 <= 2 * DraftCost.PROBE_MAX  # found by a probe within the backed-off interval
    assert all(n > 0 for n in used[turned_on:])
    assert chain.model.interval == DraftCost.PROBE_FIRST


def test_a_due_probe_waits_for_the_draft_model_to_be_current_where_catching_up_is_dear():
    """A probe after a long pause makes the draft model read every token since. Unmeasured, the first such probe
    goes when due (it measures the price); measured cheap (a GPU), due probes go out of sync; measured dear (the
    CPU: a fifth of a target step a token), a due probe waits for a round where the model's cells are current."""
    for catch_up_s, lag, due in ((None, 40, True), (0.00005, 40, True), (0.008, 40, False), (0.008, 1, True)):
        cost, model = model_cost()
        cost.observe(Observation(0, 0, 0.0, 0.013, 1))  # a plain step's cost: what the rounds waited are worth
        if catch_up_s is not None:  # measured on a probe 40 tokens out of sync
            cost.catch_ups.append((40, 40 * catch_up_s))
        probes = [model.probe(6, lag=lag) for _ in range(DraftCost.PROBE_FIRST)]
        assert probes == [0] * (DraftCost.PROBE_FIRST - 1) + [ModelCost.PROBE if due else 0], (catch_up_s, lag)


def test_a_catch_up_measured_at_one_lag_prices_a_longer_one_by_a_line_not_per_token():
    """A probe's catch-up costs a part per call (on CUDA: a graph for the new width, ~3 ms) and a part per token.
    Measured at 3 tokens, 3.2 ms is nearly all the call's: priced per token (1.07 ms) a catch-up of 33 tokens came
    to 35 ms and no probe out of sync was ever affordable again (the H200's code edit: the chain's model drafted
    once a generation). Now a longer lag is priced at the measured one's cost until a second lag is measured, then
    by the line through them. Without CUDA graphs (the CPU) a catch-up is all per token, and a dear one still makes
    the probe wait."""
    def due(catch_ups: list[tuple[int, float]], lag: int, idle: int = DraftCost.PROBE_FIRST,
            graphs: bool = True) -> bool:
        cost, model = model_cost(graphs=graphs)
        # A plain step: 13.3 ms; a probe may spend 5% of the rounds it waited
        cost.observe(Observation(0, 0, 0.0, 0.0133, 1))
        cost.catch_ups.extend(catch_ups)
        model.interval = idle
        return [model.probe(6, lag=lag) for _ in range(idle)][-1] > 0

    gpu = [(3, 0.0032)]
    assert due(gpu, 33)  # at most 3.2 ms beyond the 3 tokens' (per token: 35 ms > 16 rounds x 0.67 ms)
    gpu.append((33, 0.0048))  # the longer lag measured: 3.04 ms a call + 0.053 ms a token
    assert due(gpu, 120) and not due(gpu, 400) and due(gpu, 400, idle=64)
    assert not due([(3, 0.0032)], 33, graphs=False)  # (the same catch-up without graphs: per token, 35 ms)
    cpu = [(40, 0.32), (44, 0.30)]  # the 2-core CPU: 8 ms a token, with noise (a line through them would be flat)
    assert not due(cpu, 80, idle=256) and not due(cpu, 20) and due(cpu, 1)


def test_a_probes_uncaptured_steps_are_no_step():
    """A probe's first step reads the tokens the model sat out; on CUDA the two steps after that width change run
    the graph uncaptured (4.5 ms against 1.35). The step is the least of the later ones, not their average (2.6
    ms: a model right 3 tokens in 4 judged a loss on the H200's costs)."""
    cost = DraftCost(6)
    cost.observe(Observation(6, 6, 0.0061 + 2 * 0.0045 + 3 * 0.00135, 0.0265, 7, first_s=0.0061, least_s=0.00135))
    assert cost.step_s == pytest.approx(0.00135)


def test_adaptive_leaves_lookups_length_alone():
    """Adaptive sets the draft model's length; with lookup, alone or chained, k stays the preset's (lookup's tokens
    cost no draft steps; the chain's model share is decided per round by `extension`)."""
    for drafter in ("lookup", "chain"):
        chooser = policy(dataclasses.replace(drafting(6, 0.0, True), drafter=drafter))
        assert not chooser.adaptive and policy(drafting(6, 0.0, True)).adaptive
        assert feed(chooser, 4 * _DraftLength.EPOCH, lambda k: 0, 0.017, 0.011, 0.006) == [6] * 4 * _DraftLength.EPOCH


def widths_for(script: list[int], per_token: float, switch: float) -> list[int]:
    """The verify widths the policy picks on a GPU (k = 6: padded width 7) for a scripted sequence of draft
    lengths; each verify costs 12.7 ms + `per_token` a token beyond the first, and the two calls after a width change
    `switch` more between them (CUDA graphs rebuilt and recaptured)."""
    chooser = policy(dataclasses.replace(drafting(6, 0.0, False), drafter="lookup"), DraftCost(6, graphs=True),
                     padded=True)
    widths: list[int] = []
    since = 0
    for drafted in script:
        width = chooser.verify_width(7, drafted)
        since = since + 1 if widths and width == widths[-1] else 1
        widths.append(width)
        seconds = 0.0127 + per_token * (width - 1) + (switch / 2 if since <= 2 and len(widths) > 1 else 0.0)
        chooser.observe(Observation(drafted, drafted, 0.0, seconds, width, lead=drafted))
    return widths


def test_empty_drafts_go_narrow_where_padding_is_dear_and_stay_padded_where_it_is_cheap():
    """Lookup on a GPU: runs of rounds with no match. On the card's 32B target a padded 7-wide verify costs 13 ms
    more than a 1-wide one and a width change ~16 ms: after a couple of empty rounds it verifies 1 token. Where the
    width costs next to nothing (a launch-bound small model) it keeps the graphs warm and pads."""
    script = [3] * 5 + [0] * 30 + [2] * 3 + [0] * 30
    dear = widths_for(script, per_token=0.0022, switch=0.016)
    cheap = widths_for(script, per_token=0.0001, switch=0.016)
    for widths in (dear, cheap):
        assert all(w == 7 for w, d in zip(widths, script, strict=True) if d)  # drafts always go wide
    second_run = slice(38, 68)
    assert dear[second_run][:3].count(7) <= 3 and dear[second_run][3:] == [1] * 27
    assert cheap[second_run] == [7] * 30  # measured: padding costs less than two changes' worth over the run
    assert set(dear[5:35]) == {7, 1} and dear[34] == 1


def test_the_draft_model_with_a_fixed_length_always_verifies_wide():
    assert widths_for([6, 4, 1, 6, 2] * 10, per_token=0.0022, switch=0.016) == [7] * 50


def test_a_step_is_the_steady_one_and_drafted_ahead_rounds_count_as_free():
    """A round's first draft step (a catch-up after sitting out, a CUDA graph captured) is no measure of a step,
    nor is a round drafted ahead (0 s on the critical path); but the share drafted ahead makes drafts cheaper on
    average, and long drafts pay more for it."""
    cost = DraftCost(6)
    # The H200 chain's probe: 5.5 ms a step on average
    cost.observe(Observation(2, 2, 0.0086 + 0.0024, 0.0273, 7, first_s=0.0086))
    assert cost.step_s == pytest.approx(0.0024)
    (plain, plain_model), (ahead, ahead_model) = model_cost(), model_cost()
    for i in range(40):
        plain.observe(Observation(6, 3, 6 * 0.004, 0.025, 7, first_s=0.004))
        ahead.observe(Observation(6, 3, 0.0 if i % 2 else 6 * 0.004, 0.025, 7, first_s=0.0 if i % 2 else 0.004,
                      drafted_ahead=6 if i % 2 else 0))
    assert plain.step_s == ahead.step_s == pytest.approx(0.004)
    assert 0.3 < ahead_model.drafted_ahead_share < 0.7 and plain_model.drafted_ahead_share == 0.0
    assert ahead_model.speed(0, 6) > plain_model.speed(0, 6)


def test_a_draft_model_is_hopeless_only_where_full_acceptance_would_not_pay():
    """`could_pay`: on the 2-core CPU's measured costs (a 36 ms draft step, the demo target's verify by width) no
    number of model tokens beats a plain step even if all were accepted, so probing its acceptance is pointless;
    on the H200's (a 2.4 ms step against a 13-27 ms padded verify) full acceptance would pay, so it is probed."""
    cpu = {1: 0.0384, 2: 0.0739, 3: 0.1124, 4: 0.0967, 5: 0.1465, 6: 0.1186, 7: 0.1916}
    cost = policy(dataclasses.replace(drafting(6, 0.0, False), drafter="chain")).cost
    cost.observe(Observation(2, 2, 0.072, cpu[3], 3, first_s=0.036))  # a model round: its second step is the steady one
    for width, seconds in cpu.items():
        cost.observe(Observation(width - 1, width - 1, 0.0, seconds, width, lead=width - 1))
    assert not ModelCost.of(cost).could_pay(0, 6)
    gpu, gpu_model = model_cost(graphs=True)
    for _ in range(3):
        gpu.observe(Observation(0, 0, 0.0, 0.01305, 1))
        gpu.observe(Observation(2, 1, 0.0048, 0.02728, 7, first_s=0.0024))
    assert gpu_model.could_pay(0, 6, width=7)


def test_a_model_that_sat_out_is_judged_on_its_probe_not_on_rejections_long_past():
    """The H200 chain's pattern on the code edit (docs/performance.md, the seventh run): the model's warm-up rounds
    had their first drafts rejected, then it sat out while lookup matched. Its counts halved only every DECAY
    rounds *of the model's*, so each probe (every draft right) was weighed against those rejections as if fresh
    and confirmed the loss. Counts age with the stream's rounds, as the class says: after a long pause a probe is
    judged near the prior and by its own verdict, and a model that is right again drafts again. (On the H200 the
    code edit stayed at lookup's pace after this: something else holds it there too.)"""
    chooser, chain = chained(drafting(6, 0.0, False), padded=True)
    cost = chooser.cost
    step, v1, v7 = 0.002, 0.0133, 0.0265  # the chain's figures there: step, verify at widths 1 and 7
    model_rounds, free_rounds, first_probe = 0, 0, None
    for i in range(400):
        if i % 4:  # lookup matched all of k: nothing for the model to do this round
            chooser.observe(Observation(6, 6, 0.0, v7, 7, lead=6))
            continue
        warm = cost.step_rounds < _DraftLength.WARMUP
        n = chain.extension(0, 6, chooser)
        chooser.observe(Observation(n, 0 if warm else n, step * n, v7 if n else v1, 7 if n else 1))
        if n and not warm and first_probe is None:
            first_probe = i
        elif first_probe is not None:
            free_rounds += 1
            model_rounds += n > 0
    assert first_probe is not None and first_probe < 100
    assert chain.model.model_on and model_rounds >= 0.9 * free_rounds, (model_rounds, free_rounds)
