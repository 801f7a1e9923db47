"""Standing aside (`[draft] stand_aside`, the default): the draft model (or MTP head) drafts nothing while a round of
k drafts is priced slower than plain decoding, is probed now and then, comes back when it pays, and every report
says so with the measured reason.

The decisions first on scripted costs (no clock: each round is fed what a machine would have measured), then through
the real loop over fake models whose decodes take scripted time (the fake-target harness), then the reports.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from helpers_fake import FakeModel, draft_policy
from helpers_stats import chi_square

from localspec.config import Drafting, load_preset
from localspec.drafters.model import ModelCost
from localspec.rounds.engine import Engine
from localspec.rounds.events import DoneEvent, GenerationStats, collect, drafting_note
from localspec.rounds.policies import DraftCost, DraftLength, Observation, kept_length
from localspec.rounds.scores import Scores

GREEDY = load_preset("greedy")
HOT = dataclasses.replace(GREEDY.sampling, temperature=0.8, top_k=0, top_p=1.0)


def drafting(k: int = 6, stand_aside: bool = True, drafter: str = "model", **more: object) -> Drafting:
    return dataclasses.replace(GREEDY.draft, n_draft=k, drafter=drafter, stand_aside=stand_aside, **more)


# -- the rule on scripted costs -------------------------------------------------------------------------------------


def guarded(padded: bool = False, k: int = 6) -> tuple[DraftLength, ModelCost]:
    cost = DraftCost(k, graphs=padded)
    chooser = draft_policy(drafting(k), cost, padded)
    return chooser, chooser.rule(ModelCost)


def feed(chooser: DraftLength, rule: ModelCost, rounds: int, accepted_of: Callable[[int], int], step: float,
         verify_base: float, verify_per_token: float, lag: int = 1) -> list[int]:
    """Rounds of the draft model with standing aside: what each drafted (its rule's choice), fed back as measured."""
    drafted = []
    for _ in range(rounds):
        n = rule.stand_aside(chooser.next(), chooser, lag)
        drafted.append(n)
        width = n + 1 if not chooser.padded or n else (chooser.k + 1)
        chooser.observe(Observation(n, accepted_of(n), step * n, verify_base + verify_per_token * width, width,
                                    least_s=step if n else None))
    return drafted


def test_a_draft_step_that_costs_about_a_verify_stands_aside_after_two_rounds_and_is_probed_rarely() -> None:
    """A CPU's small draft (a step 0.9 of a one-token verify, a 7-token verify three of them): even six drafts all
    kept would lose, so after one round of a probe's two drafts (pricing a step) and one plain round (pricing plain
    decoding) it stands aside, and probes only at the longest interval, in sync."""
    chooser, rule = guarded()
    drafted = feed(chooser, rule, 600, lambda n: n, step=0.045, verify_base=0.040, verify_per_token=0.010)
    assert drafted[:2] == [ModelCost.PROBE, 0]
    assert sum(1 for n in drafted[2:] if n) <= 600 // DraftCost.PROBE_MAX + 1  # probes only
    assert max(drafted[2:]) <= ModelCost.PROBE  # ... of a probe's length
    assert chooser.aside is not None
    assert "draft step costs 0.9" in chooser.aside and "even if every one" in chooser.aside


def test_a_cheap_draft_that_is_mostly_right_keeps_the_presets_length() -> None:
    chooser, rule = guarded()
    drafted = feed(chooser, rule, 200, lambda n: n - (n > 4), step=0.002, verify_base=0.040, verify_per_token=0.004)
    assert drafted[:2] == [ModelCost.PROBE, 0]  # (a cheap first measure; round 2 prices plain decoding)
    assert all(n == 6 for n in drafted[2:])
    assert chooser.aside is None


def test_on_a_gpu_it_never_spends_a_round_pricing_plain_decoding() -> None:
    """Padded verifies (CUDA graphs): a plain round would change the width twice; the prior prices it instead."""
    chooser, rule = guarded(padded=True)
    drafted = feed(chooser, rule, 100, lambda n: n, step=0.002, verify_base=0.030, verify_per_token=0.001)
    assert drafted == [6] * 100


def test_poor_acceptance_stands_aside_then_a_probe_brings_it_back_when_drafts_come_right() -> None:
    """A draft step 0.2 of a verify: six drafts pay if most are kept and lose if none are. None kept: it stands
    aside (saying how many were kept a round); once they come right, a probe measures it and drafting resumes."""
    right = {"now": False}
    chooser, rule = guarded()
    first = feed(chooser, rule, 40, lambda n: n if right["now"] else 0, step=0.010, verify_base=0.040,
                 verify_per_token=0.008)
    assert first[-1] == 0 and first.count(0) > 20
    assert chooser.aside is not None and "of 6 drafts kept a round" in chooser.aside
    right["now"] = True
    later = feed(chooser, rule, 200, lambda n: n if right["now"] else 0, step=0.010, verify_base=0.040,
                 verify_per_token=0.008)
    back = later.index(6)
    assert back < 2 * DraftCost.PROBE_FIRST * 4 and all(n == 6 for n in later[back + 40:])
    assert chooser.aside is None


def test_drafting_that_paid_is_not_dropped_on_a_price_within_the_hysteresis() -> None:
    """Priced a little above plain decoding it keeps drafting; a loss stops it (and only a clear gain restarts)."""
    chooser, rule = guarded()
    # 6 drafts, about 2.2 kept: (3.2 tokens) / (0.040 + 0.008 x 7 + 6 x 0.0045) = 26.0 tok/s vs plain 1 / 0.048
    drafted = feed(chooser, rule, 120, lambda n: min(n, 2 + (len(str(n)) > 5)), step=0.0045, verify_base=0.040,
                   verify_per_token=0.008)
    assert drafted[-60:].count(6) == 60


# -- through the loop: fake models whose decodes take scripted time --------------------------------------------


class Timed(FakeModel):
    """A fake model whose decodes take `base + per_token x tokens` seconds of wall time (slept)."""

    def __init__(self, base: float, per_token: float, **fake: object) -> None:
        super().__init__(**fake)  # type: ignore[arg-type]
        self.base, self.per_token = base, per_token

    def decode_many(self, items: Sequence[tuple[int, Sequence[int], int, bool]]) -> list[Scores | None]:
        time.sleep(self.base + self.per_token * sum(len(tokens) for _, tokens, _, _ in items))
        return super().decode_many(items)


def timed_pair(draft_step: float, noise: float = 1.0) -> tuple[Timed, Timed]:
    target = Timed(0.004, 0.0012, seed=3)  # a 7-token verify ~ 2.5 one-token ones (a CPU's shape)
    return target, Timed(draft_step, 0.0, seed=3, noise=noise)


def test_a_draft_that_costs_a_verify_stands_aside_with_plain_decodings_output_and_says_why() -> None:
    target, draft = timed_pair(draft_step=0.005)
    engine = Engine(target, draft)
    prompt = [1, 2, 3, 4]
    gen = collect(engine.generate(prompt, GREEDY.sampling, drafting(), 40))
    assert gen.tokens == target.greedy(prompt, 40)  # exact: plain decoding's tokens
    assert gen.stats.stood_aside >= gen.stats.rounds - 4 and gen.stats.drafted <= 6 + ModelCost.PROBE
    assert gen.done.aside is not None and "draft step costs" in gen.done.aside
    assert drafting_note(gen.stats, gen.done.aside).startswith("drafting stood aside: a draft step costs")
    # The verdict is the slot's: the next reply stands aside from its first round.
    again = collect(engine.generate([4, 3, 2, 1], GREEDY.sampling, drafting(), 20))
    assert again.stats.drafted == 0 and again.done.aside is not None
    assert again.done.aside.startswith("a draft step costs")
    assert again.done.aside.endswith("6 drafts would lose even if every one were kept")
    # Off, the same draft drafts every round.
    fixed = collect(Engine(*timed_pair(draft_step=0.005)).generate(prompt, GREEDY.sampling, drafting(stand_aside=False),
                                                                   40))
    assert fixed.tokens == gen.tokens and fixed.stats.stood_aside == 0 and fixed.done.aside is None
    assert all(n for n in fixed.stats.draft_lengths[:-1])


def test_where_drafting_cannot_pay_whole_generations_decode_plainly_and_every_sixteenth_is_judged_again() -> None:
    """Once hopeless, a generation is plain decoding (its tokens drawn on the device as plain decoding's are: no
    per-round host sampling), said as standing aside; every PLAIN_GENERATIONS-th goes through the rule again."""
    # A draft step 1.5x a one-token verify: hopeless by a margin a loaded machine's late sleeps cannot close (at 0.96x
    # a CI run once priced a judged round as payable, and the next generation was judged, not decoded plainly).
    target = Timed(0.004, 0.0012, seed=3, device_top_k=64)
    draft = Timed(0.008, 0.0, seed=3, noise=1.0)
    engine = Engine(target, draft)
    hot = dataclasses.replace(HOT, top_k=8)
    first = collect(engine.generate([1, 2, 3, 4], hot, drafting(), 24))
    assert first.done.aside is not None and "draft step costs" in first.done.aside
    modes: list[str] = []
    use = target.use_device_sampler
    target.use_device_sampler = lambda mode, seq=0: modes.append(type(mode).__name__) or use(mode, seq)  # type: ignore
    for i in range(DraftCost.PLAIN_GENERATIONS):
        gen = collect(engine.generate([4, 3, 2, 1 + i % 3], dataclasses.replace(hot, seed=i), drafting(), 8))
        assert gen.stats.stood_aside >= gen.stats.rounds - 1 and gen.stats.drafted == 0  # (the last: k = 0 anyway)
        assert gen.done.aside is not None and "draft step costs" in gen.done.aside
    # The target's rows: drawn on the device in the plain generations, the top candidates ("top_k") in the judged
    # one, the PLAIN_GENERATIONS-th after the verdict.
    assert modes == ["DeviceDist"] * (DraftCost.PLAIN_GENERATIONS - 1) + ["str"], modes


def test_a_new_slot_inherits_the_verdict_and_its_first_generation_decodes_plainly() -> None:
    """That a draft step costs about a one-token verify is a fact of the models and the machine: once one slot has
    found drafting hopeless, another slot's first generation decodes plainly (no draft model reads its prompt, no
    probe, tokens drawn on the device) instead of judging again, which cost a served CPU pair 23% at 4 clients."""
    target = Timed(0.004, 0.0012, seed=3, device_top_k=64, n_seq=2)
    draft = Timed(0.008, 0.0, seed=3, noise=1.0, n_seq=2)
    engine = Engine(target, draft)
    hot = dataclasses.replace(HOT, top_k=8)
    first = collect(engine.generate([1, 2, 3, 4], hot, drafting(), 24, slot=0))
    assert first.done.aside is not None and "draft step costs" in first.done.aside and first.stats.drafted > 0
    draft_decodes: list[int] = []
    decode_many = draft.decode_many
    draft.decode_many = lambda items: draft_decodes.append(len(items)) or decode_many(items)  # type: ignore
    other = collect(engine.generate([4, 3, 2, 1], hot, drafting(), 12, slot=1))
    assert other.stats.drafted == 0 and other.stats.stood_aside == other.stats.rounds > 0
    assert other.done.aside == first.done.aside and not draft_decodes  # not even the prompt
    # another drafting setting is another verdict: judged afresh
    judged = collect(engine.generate([4, 3, 2, 1], hot, drafting(4), 12, slot=1))
    assert judged.stats.drafted > 0 or draft_decodes


def measured_sibling(rounds: int = 40) -> DraftCost:
    """A slot's cost model after `rounds` rounds of the draft model: steps of 10 ms (the first of each round 15),
    verifies at widths 3 and 7 (width 3 only in the first rounds), a probe out of sync (a catch-up of 40 tokens),
    a plain round at width 1 last."""
    cost = DraftCost(6)
    ModelCost.of(cost)
    for i in range(rounds - 1):
        n = 2 if i < 4 else 6
        cost.probe_lag = 40 if i == 5 else 0
        cost.observe(Observation(n, n - 1, 0.015 + 0.010 * (n - 1), 0.040 + 0.008 * (n + 1), n + 1, first_s=0.015,
                                 least_s=0.010 + 0.0001 * (i % 3)))
    cost.observe(Observation(0, 0, 0.0, 0.048, 1))
    return cost


def test_a_new_cost_model_takes_over_a_siblings_prices_as_copies_but_not_its_acceptance() -> None:
    """The draft step and the verify per width are facts of the models and the machine: a new slot's cost model
    takes them from the slot that measured most; acceptance is the conversation's and starts from the prior. What it
    took is its own copy, and each figure keeps its age (a width the sibling last verified long ago is stale)."""
    sibling, idle = measured_sibling(), DraftCost(6)
    child = DraftCost(6)
    child.inherit([idle, measured_sibling(8), sibling])  # (the one that measured most)
    rule = ModelCost.of(child)  # (the drafter's rules attach after, as `kept_length` does)
    assert child.step_s == sibling.step_s == 0.010 and child.step_rounds == sibling.step_rounds
    assert child.verify_s == sibling.verify_s and child.verify_s.keys() == {1, 3, 7}
    widths = np.arange(1, 9)
    assert np.array_equal(child.verify_costs(widths), sibling.verify_costs(widths))
    assert list(child.catch_ups) == list(sibling.catch_ups) and child.catch_up_cost(40) == pytest.approx(0.005)
    assert child.rounds == 0 and not child.hopeless and not child.model_hopeless
    assert child.tried["model"] == [0.0] * 7 and child.ok["model"] == [0.0] * 7 and child.seen["model"] == 0
    assert np.allclose(child.survival("model", 6), ModelCost.PRIOR ** np.arange(7))
    assert rule.speeds(0, 6) is not None  # priced from the first round
    # Copies: the sibling's later rounds leave the child's figures alone.
    taken = (child.step_s, dict(child.verify_s), list(child._steps), list(child.catch_ups))
    for _ in range(3):
        sibling.probe_lag = 9
        sibling.observe(Observation(6, 6, 0.5, 0.9, 7, first_s=0.2, least_s=0.001))
    sibling.observe(Observation(0, 0, 0.0, 0.9, 2))
    assert sibling.step_s == 0.001 and len(sibling.catch_ups) == 4 and 2 in sibling.verify_s
    assert (child.step_s, dict(child.verify_s), list(child._steps), list(child.catch_ups)) == taken
    # Ages kept: width 7 (verified in the sibling's last rounds) is averaged into; width 3, last verified in its
    # first rounds, is stale and replaced whole by the child's next measure of it.
    child.observe(Observation(6, 6, 0.06, 0.100, 7, least_s=0.010))
    child.observe(Observation(2, 2, 0.02, 0.100, 3, least_s=0.010))
    assert child.verify_s[7] == pytest.approx(0.8 * taken[1][7] + 0.2 * 0.100) and child.verify_s[3] == 0.100
    # Nothing measured by any other slot: a cost model as fresh as a slot alone's.
    fresh = DraftCost(6)
    fresh.inherit([idle, DraftCost(6)])
    assert fresh.step_s is None and fresh.verify_s == {} and fresh.step_rounds == 0 and not fresh.catch_ups


def test_a_new_slot_with_a_siblings_prices_chooses_its_length_from_its_first_round() -> None:
    """The draft model with standing aside: a slot alone measures first (a probe's two drafts, then a plain round
    to price plain decoding) and drafts the preset's 6 from its third round; a new slot given its sibling's prices
    drafts 6 from its first, as the sibling does; without a sibling's prices it measures as before."""
    from localspec import drafters

    cfg = drafting(6)
    drafter = drafters.build(FakeModel(), FakeModel())["model"]

    def pricing(cost: DraftCost) -> object:
        return drafter.pricing(cost, cfg)

    sibling: dict = {}
    chooser = kept_length(sibling, cfg, True, False, pricing)
    cheap = {"accepted_of": lambda n: n - (n > 4), "step": 0.002, "verify_base": 0.040, "verify_per_token": 0.004}
    alone = feed(chooser, chooser.rule(ModelCost), 20, **cheap)  # type: ignore[arg-type]
    assert alone[:2] == [ModelCost.PROBE, 0] and alone[2:] == [6] * 18
    child = kept_length({}, cfg, True, False, pricing, siblings=[{}, sibling])
    assert child.cost is not chooser.cost and child.cost.rounds == 0
    assert feed(child, child.rule(ModelCost), 10, **cheap) == [6] * 10  # type: ignore[arg-type]
    unpriced = kept_length({}, cfg, True, False, pricing, siblings=[{}])
    assert feed(unpriced, unpriced.rule(ModelCost), 3, **cheap)[:2] == [ModelCost.PROBE, 0]  # type: ignore[arg-type]


def test_a_cheap_right_draft_keeps_drafting_through_the_loop() -> None:
    target, draft = timed_pair(draft_step=0.0002, noise=0.0)  # the draft is the target: every draft kept
    gen = collect(Engine(target, draft).generate([1, 2, 3, 4], GREEDY.sampling, drafting(), 60))
    assert gen.tokens == target.greedy([1, 2, 3, 4], 60)
    assert gen.stats.stood_aside <= 1 and gen.done.aside is None and gen.stats.acceptance_rate == 1.0


def test_standing_aside_and_probing_keep_the_targets_distribution() -> None:
    """At T > 0 rounds that stand aside (plain steps drawn on the host), the probes' drafts and the first rounds'
    all follow the target: the joint frequency of the first two tokens over many seeds fits p(a) p(b | a)."""
    # Four tokens (16 outcomes, each likely enough for the statistic); shorter sleeps: many generations.
    target, draft = Timed(0.0015, 0.0004, vocab=4, seed=5), Timed(0.0015, 0.0, vocab=4, seed=5, noise=1.5)
    engine = Engine(target, draft)
    prompt = [0, 1, 2, 3, 0, 1, 2]
    counts: Counter = Counter()
    stood = drafted = 0
    for seed in range(2500):
        gen = collect(engine.generate(prompt, dataclasses.replace(HOT, seed=seed), drafting(2), 2))
        counts[tuple(gen.tokens)] += 1
        stood += gen.stats.stood_aside
        drafted += gen.stats.drafted
    first = target.next_probs(prompt, HOT)
    joint = {(a, b): pa * pb for a, pa in first.items() for b, pb in target.next_probs([*prompt, a], HOT).items()}
    assert chi_square(counts, joint) < 37.7  # 15 degrees of freedom, 99.9th percentile
    assert stood > 100 and drafted > 0  # both kinds of round ran


# -- what reports say ---------------------------------------------------------------------------------------------


def test_the_bench_summary_verdict_and_closing_line_say_it_stood_aside_and_why() -> None:
    from localspec.sessions.bench import BenchReport, ModeSummary, RunResult
    from localspec.ui.bench_view import drafter_choice

    reason = "a draft step costs 0.88 of a one-token verify, so 6 drafts would lose even if every one were kept"
    stats = GenerationStats(tokens=100, rounds=98, drafted=4, accepted=4, decode_s=5.0, stood_aside=96)
    spec = ModeSummary.of("speculative", [RunResult("speculative", 0, stats, 0.0, {}, aside=reason)])
    assert spec.stood_aside == 96 / 98 and spec.aside == reason
    assert spec.standing_aside == f"drafting stood aside in 98% of rounds (plain decoding's steps): {reason}"
    plain = ModeSummary.of("plain", [RunResult("plain", 0, GenerationStats(tokens=100, rounds=100, decode_s=4.9),
                                               0.0, {})])
    assert plain.standing_aside is None

    def report(drafter: str, summary: ModeSummary, plain_tps: float) -> BenchReport:
        preset = GREEDY.with_overrides(drafter=drafter)
        check = type("Check", (), {"passed": True, "exact": True})()
        return BenchReport(preset, 6, 128, dataclasses.replace(plain, median_tps=plain_tps), summary, check, [],
                           {})  # type: ignore[arg-type]

    aside = report("model", dataclasses.replace(spec, median_tps=19.6), 20.0)
    assert aside.plain_spread is None and not aside.decoded_as_plain  # (one plain run: no spread to judge by)
    assert aside.verdict.startswith("the draft model does not pay here, so it stood aside: 0.98x plain decoding;")
    lookup = report("lookup", dataclasses.replace(plain, mode="speculative", median_tps=44.0), 20.0)
    line = drafter_choice([aside], lookup).plain
    assert line.startswith("on this machine: use `--drafter lookup` (the draft model stood aside, 0.98x plain;")
    alone = drafter_choice([aside]).plain
    assert "stands aside by itself" in alone and "the default decodes at about plain speed" in alone

    # Every round stood aside, so the speculative runs decoded as plain decoding does: a gap within plain
    # decoding's own run-to-run spread is said to be the machine's noise; one beyond it, or where some rounds
    # drafted, is not explained away.
    noisy = dataclasses.replace(plain, runs=5, median_tps=20.0, min_tps=17.0, max_tps=21.5)
    all_aside = dataclasses.replace(spec, stood_aside=1.0, median_tps=18.8)

    def spread_report(summary: ModeSummary) -> BenchReport:
        check = type("Check", (), {"passed": True, "exact": True})()
        return BenchReport(GREEDY.with_overrides(drafter="model"), 6, 128, noisy, summary, check, [],
                           {})  # type: ignore[arg-type]

    within = spread_report(all_aside)
    assert within.plain_spread == pytest.approx((0.85, 1.075)) and within.decoded_as_plain
    assert within.verdict.startswith(
        "the draft model does not pay here, so it stood aside and decoded as plain decoding does: 0.94x plain is "
        "this machine's run-to-run noise (plain decoding's own runs: 0.85-1.07x their median); drafting stood aside "
        "in 100% of rounds")
    assert "the draft model stood aside (decoding as plain does, within this machine's noise), 0.94x plain" in \
        drafter_choice([within], lookup).plain
    for beyond in (dataclasses.replace(all_aside, median_tps=16.0),  # slower than plain's slowest run
                   dataclasses.replace(all_aside, stood_aside=0.95)):  # some rounds drafted
        judged = spread_report(beyond)
        assert not judged.decoded_as_plain and "noise" not in judged.verdict
        assert judged.verdict.startswith(f"the draft model does not pay here, so it stood aside: "
                                         f"{judged.speedup:.2f}x plain decoding;")


def test_the_chat_line_and_the_servers_timings_say_it() -> None:
    from localspec.cli.chat_cmd import stats_line
    from localspec.server.worker import timings
    from localspec.sessions.chat import TurnRecord

    stats = GenerationStats(tokens=30, rounds=29, drafted=2, accepted=1, decode_s=1.0, stood_aside=27)
    turn = TurnRecord("hi", "hello", "eog", 30, 1, 10, 9, 6, 0.7, stats=stats, aside="a draft step costs 0.9 …")
    assert "drafting stood aside: a draft step costs 0.9 …" in stats_line(turn)
    assert (timings(stats)["draft_stood_aside"], timings(stats)["rounds"]) == (27, 29)
    drafting_only = GenerationStats(tokens=30, rounds=10, drafted=30, accepted=20, decode_s=1.0)
    assert drafting_note(drafting_only, None) == "acceptance 67%"


def test_the_done_event_carries_no_reason_without_drafting() -> None:
    gen = collect(Engine(FakeModel(seed=3), FakeModel(seed=3)).generate([1, 2], GREEDY.sampling, drafting(0), 5))
    assert isinstance(gen.done, DoneEvent) and gen.done.aside is None and gen.stats.stood_aside == 0
    assert np.array_equal(gen.tokens, FakeModel(seed=3).greedy([1, 2], 5))


class Counted(Timed):
    """A timed fake that counts the tokens it decodes (prompt and drafts)."""

    decoded = 0

    def decode_many(self, items: Sequence[tuple[int, Sequence[int], int, bool]]) -> list[Scores | None]:
        self.decoded += sum(len(tokens) for _, tokens, _, _ in items)
        return super().decode_many(items)


def test_a_chain_whose_draft_model_cannot_pay_leaves_it_behind_but_every_sixteenth_generation() -> None:
    """The chain's draft model judged a loss at any acceptance drafts only in sync, so its generations read none of
    the prompt into it (the lead drafts on), but every PLAIN_GENERATIONS-th, which reads it and may probe; the output
    is plain decoding's throughout."""
    # (a draft step 1.5x a one-token verify: a loss at any acceptance even when a busy machine's sleeps overshoot)
    target, draft = Timed(0.004, 0.0012, seed=3), Counted(0.008, 0.0, seed=3, noise=1.0)
    engine = Engine(target, draft)
    chain = drafting(drafter="chain")
    prompt = [1, 2, 3, 4, 5, 6, 7] * 6
    first = collect(engine.generate(prompt, GREEDY.sampling, chain, 48))  # (rounds enough for the verdict)
    assert first.tokens == target.greedy(prompt, 48)
    reads = []
    for i in range(DraftCost.PLAIN_GENERATIONS + 1):
        asked = [1 + i % 5, 7 - i % 3] + prompt  # (another start each time: nothing of it in the cells)
        before = draft.decoded
        gen = collect(engine.generate(asked, GREEDY.sampling, chain, 12))
        assert gen.tokens == target.greedy(asked, 12)
        reads.append(draft.decoded - before)
    behind = [n for n in reads if n == 0]
    assert len(behind) >= DraftCost.PLAIN_GENERATIONS - 2, reads  # (the verdict may come in the first of them)
    assert any(n >= len(prompt) for n in reads), reads  # a judged generation reads the prompt into the draft


def test_a_new_slot_of_the_chain_takes_the_priced_draft_model_and_neither_reads_the_prompt_nor_probes() -> None:
    """A served chain: once one slot has priced its draft model as a loss at any acceptance, another slot's first
    generation takes the verdict and the prices with it, so its rules judge from the first round: the draft model
    reads none of the prompt and drafts no probe (which, behind, would first read the prompt: the catch-up that kept
    the chain below plain decoding at 4 and 16 clients on the CPU demo pair). The output is plain decoding's."""
    target, draft = Timed(0.004, 0.0012, seed=3, n_seq=2), Counted(0.008, 0.0, seed=3, noise=1.0, n_seq=2)
    engine = Engine(target, draft)
    chain = drafting(drafter="chain")
    prompt = [1, 2, 3, 4, 5, 6, 7] * 6
    first = collect(engine.generate(prompt, GREEDY.sampling, chain, 48, slot=0))
    priced = engine.slots[0].policies[(chain, True)].cost
    assert first.tokens == target.greedy(prompt, 48) and priced.model_hopeless and priced.step_s is not None
    asked = [3, 5, *prompt]
    before = draft.decoded
    other = collect(engine.generate(asked, GREEDY.sampling, chain, 24, slot=1))
    assert other.tokens == target.greedy(asked, 24)
    assert draft.decoded == before  # neither the prompt nor a probe
    cost = engine.slots[1].policies[(chain, True)].cost
    assert cost is not priced and cost.model_hopeless and cost.step_s == priced.step_s
    assert cost.seen["model"] == 0  # (its acceptance is its own: nothing of the model's was verified)
