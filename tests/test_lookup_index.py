"""Prompt lookup's per-round host work (issue #19): an n-gram index extended by the committed tokens answers as a
rescan of the whole context would, and while the stream's cost model judges lookup's tokens a loss a round does no
search at all. The output stays plain greedy either way (the fast lane's fakes, a fake clock for the costs)."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from helpers_fake import Clock, FakeModel, TimedFake, draft_policy

from localspec import drafters
from localspec.config import load_preset
from localspec.drafters import lookup as lookup_drafter
from localspec.drafters.base import DraftRequest
from localspec.drafters.lookup import LookupCost, LookupDrafter, NgramIndex
from localspec.drafters.model import ModelCost
from localspec.drafters.suffix import SuffixCost
from localspec.rounds.engine import Engine
from localspec.rounds.events import GenerationStats, collect
from localspec.rounds.policies import DraftCost, DraftLength, Observation, kept_length

GREEDY = load_preset("greedy")


def rescan(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The reference: try every n from the longest down and every earlier end position from the latest back,
    comparing token lists (no index, no hashing)."""
    end = len(tokens) - 1
    if k <= 0:
        return []
    for n in range(n_max, n_min - 1, -1):
        for e in range(end - 1, n - 2, -1):
            if list(tokens[e - n + 1 : e + 1]) == list(tokens[end - n + 1 : end + 1]) and end - n + 1 >= 0:
                return [tokens[e + 1 + i % (end - e)] for i in range(k)]
    return []


@pytest.mark.parametrize(("n_min", "n_max", "vocab"), [(3, 8, 4), (1, 4, 3), (2, 2, 6), (1, 12, 2), (5, 9, 3)])
def test_the_index_answers_as_a_rescan_while_the_context_grows(n_min: int, n_max: int, vocab: int) -> None:
    """Tokens arrive in rounds of 1..8 (a round's accepted drafts and the target's token); after each, the index
    extended by them gives what a rescan of the whole context gives, for several k."""
    rng = np.random.default_rng(n_min * 100 + n_max)
    for _ in range(20):
        tokens = rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist()
        index = NgramIndex(n_min, n_max)
        while len(tokens) < 120:
            index.extend(tokens)
            for k in (1, 3, 7):
                assert index.continuation(tokens, k) == rescan(tokens, n_min, n_max, k), (tokens, k)
            tokens += rng.integers(0, vocab, size=int(rng.integers(1, 9))).tolist()


def request(seq: int, tokens: list[int], **drafting: object) -> DraftRequest:
    settings = dataclasses.replace(GREEDY.draft, drafter="lookup", **drafting)  # type: ignore[arg-type]
    return DraftRequest(seq, tokens, GREEDY.sampling, settings, GenerationStats())


def test_a_new_request_in_the_slot_starts_a_fresh_index() -> None:
    """The same sequence id with another context (the next request; another of the same length; other n-gram
    settings): nothing of the last one's index is reused."""
    drafter = LookupDrafter()
    first = request(0, [1, 2, 3, 9, 9, 1, 2, 3])
    assert drafter.propose(first, 2).tokens == [9, 9]
    second = request(0, [1, 2, 3, 7, 7, 1, 2, 3])  # begin not called: a new request still starts afresh
    assert drafter.propose(second, 2).tokens == [7, 7]
    drafter.begin(second, second.tokens)
    second.tokens[3:5] = [5, 5]  # (only the loop's begin replaces the tokens in place: begin forgets the index)
    assert drafter.propose(second, 2).tokens == [5, 5]
    trigrams = request(0, [4, 1, 2, 6, 9, 1, 2, 7, 4, 1, 2], lookup_min=3, lookup_max=3)
    assert drafter.propose(trigrams, 3).tokens == [6, 9, 1]  # "4 1 2"
    bigrams = request(0, trigrams.tokens, lookup_min=2, lookup_max=2)
    assert drafter.propose(bigrams, 3).tokens == [7, 4, 1]  # the latest "1 2"
    assert drafter.propose(request(1, [3, 3, 3, 3]), 2).tokens == [3, 3]  # another slot beside it


def test_lookup_does_not_search_while_its_tokens_are_a_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply whose lookup matches are wrong (a prompt of random tokens: every token has occurred) on a machine
    where a wider verify costs far more than a narrow one: once the cost model judges lookup's tokens a loss, most
    rounds do not search (only probes and a periodic re-judgement do), and the output is plain greedy."""
    clock = Clock()
    monkeypatch.setattr("localspec.rounds.engine.time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    searches: list[int] = []
    original = NgramIndex.continuation

    def counted(self: NgramIndex, tokens: Sequence[int], k: int) -> list[int]:
        searches.append(len(tokens))
        return original(self, tokens, k)

    monkeypatch.setattr(lookup_drafter.NgramIndex, "continuation", counted)
    target = TimedFake(clock, 0.001, 0.004, vocab=64, seed=5, n_ctx=1024)
    prompt = np.random.default_rng(2).integers(0, 64, size=300).tolist()
    engine = Engine(target, None)
    settings = dataclasses.replace(GREEDY.draft, n_draft=6, drafter="lookup", lookup_min=1, lookup_max=2)
    gen = collect(engine.generate(prompt, GREEDY.sampling, settings, 100))
    assert gen.tokens == target.greedy(prompt, 100)
    cost = engine.slots[0].policies[(settings, True)].cost
    assert LookupCost.of(cost).off  # (the premise: judged a loss)
    assert len(searches) < 0.25 * gen.stats.rounds  # (every round searched before), (len(searches), gen.stats.rounds)
    # Backed off, lookup costs no verify width either: most rounds verify one token.
    assert sum(n > 0 for n in gen.stats.draft_lengths) < 0.3 * gen.stats.rounds


def test_a_backed_off_lookup_searches_for_its_probe_and_to_judge_again() -> None:
    """`LookupCost.wanted`: every round while lookup pays; backed off, only when its probe is due (then every round
    until a match is proposed), right after it and every EPOCH rounds."""
    length = lookup_length()
    assert [length.rule(LookupCost).wanted() for _ in range(5)] == [True] * 5  # nothing judged yet
    for _ in range(8):  # lookup's tokens always wrong, a wide verify dear
        length.observe(Observation(6, 0, 0.0, 0.030, 7, lead=6))
        length.observe(Observation(0, 0, 0.0, 0.010, 1))
    assert cut(length, 6, 6) == 0 and length.rule(LookupCost).off
    wanted = [length.rule(LookupCost).wanted() for _ in range(DraftCost.PROBE_FIRST + 4)]
    due = DraftCost.PROBE_FIRST - 2  # the cut match above counted as the first idle round
    assert wanted == [False] * due + [True] * (len(wanted) - due)  # due: it searches until a match probes
    assert cut(length, 6, 6) == 1  # the probe: one token answers whether the first is right again
    interval = 2 * DraftCost.PROBE_FIRST
    later = [length.rule(LookupCost).wanted() for _ in range(interval + 8)]
    # Backed off again: it searches to judge again right after the probe and every EPOCH rounds, and when the next
    # (later) probe is due.
    assert later == [i % DraftLength.EPOCH == 0 for i in range(interval - 1)] + [True] * 9


@pytest.mark.parametrize(("padded", "wide", "probed"), [(False, 0.088, 1), (True, 0.032, 6)])
def test_a_probe_proposes_one_token_where_each_width_costs_its_own(padded: bool, wide: float, probed: int) -> None:
    """Lookup judged a loss because its first token is wrong: a probe asks whether it is right again, which one
    token answers at a two-token verify. On a CPU (widths cost their own) a whole match probed cost 5.5 one-token
    verifies (the demo pair's Q&A, one probe a 32-token reply: 5% of it); a padded verify costs the same at any
    width, so there the probe proposes all of it. An accepted probe turns lookup on again at a priced length."""
    length = lookup_length(padded=padded)
    for _ in range(8):  # lookup's first token always wrong (a CPU's 7-wide verify: 5.5 narrow ones)
        length.observe(Observation(6, 0, 0.0, wide, 7, lead=6))
        length.observe(Observation(0, 0, 0.0, 0.016, 1))
    rule = length.rule(LookupCost)
    assert cut(length, 6, 6) == 0 and rule.off
    lengths = [cut(length, 6, 6) for _ in range(DraftCost.PROBE_FIRST)]
    assert lengths == [0] * (DraftCost.PROBE_FIRST - 2) + [probed, 0]  # (the cut above was the first idle round)
    for _ in range(4):  # its probes right from here on (the text is copied now): each judged again
        length.observe(Observation(probed, probed, 0.0, wide if padded else 0.019, probed + 1, lead=probed))
    assert cut(length, 6, 6) > 0 and not rule.off


def lookup_length(drafter: str = "lookup", padded: bool = False) -> DraftLength:
    return draft_policy(dataclasses.replace(GREEDY.draft, n_draft=6, drafter=drafter), padded=padded)


def cut(length: DraftLength, found: int, k: int) -> int:
    """`LookupCost.length` as the stream's drafter asks it (the chain: its model's share priced in)."""
    extension = length.rule(ModelCost) if ModelCost.SOURCE in length.cost.prior else None
    return length.rule(LookupCost).length(found, k, length, extension)


def measure_narrow_widths(length: DraftLength, seconds: Callable[[int], float], widths: range = range(2, 7)) -> None:
    """Lookup rounds at widths 2..6, every token right: what `LookupCost.length` measures once before it decides
    (`LookupCost.unmeasured`), here at the test's costs."""
    for width in widths:
        length.observe(Observation(width - 1, width - 1, 0.0, seconds(width), width, lead=width - 1))


def test_lookup_is_measured_before_it_is_judged() -> None:
    """The chain's draft model warms up first, and its slow first verify of 3 tokens made a line on which lookup's 6
    tokens, judged at its prior acceptance, looked a loss: backed off for a probe interval on text it copies (the
    CPU demo pair's JSON reformat: 13 rounds). Its first matches are proposed whole, to measure it."""
    length = lookup_length("chain")
    length.observe(Observation(0, 0, 0.0, 0.040, 1))
    length.observe(Observation(2, 0, 0.080, 0.140, 3, first_s=0.040))  # the model's warm-up: cold, slow
    assert length.rule(LookupCost).best(6, 6) == 0  # (the premise: on these costs and its prior, a loss)
    assert [cut(length, 6, 6) for _ in range(DraftLength.WARMUP)] == [6] * DraftLength.WARMUP
    for _ in range(DraftLength.WARMUP):
        length.observe(Observation(6, 6, 0.0, 0.090, 7, lead=6))
    assert cut(length, 6, 6) > 0 and not length.rule(LookupCost).off  # measured right every time: it pays
    measure_narrow_widths(length, lambda width: 0.040 + 0.0083 * (width - 1))  # (on the line to 7's 0.090)
    assert cut(length, 6, 6) == 6  # all of it


def test_a_match_cut_short_is_proposed_whole_every_epoch() -> None:
    """A wide verify measured once in a slow moment is never measured again if lookup is cut short of it: every
    EPOCH rounds in a row that cut it, the whole match is proposed (a fresh measurement of the width)."""
    length = lookup_length()
    length.observe(Observation(0, 0, 0.0, 0.040, 1))
    length.observe(Observation(3, 3, 0.0, 0.100, 4, lead=3))
    length.observe(Observation(6, 6, 0.0, 0.330, 7, lead=6))  # a slow moment
    measure_narrow_widths(length, lambda width: 0.040 + 0.020 * (width - 1))
    lengths = [cut(length, 6, 6) for _ in range(DraftLength.EPOCH)]
    assert lengths[:-1] == [lengths[0]] * (DraftLength.EPOCH - 1) and 0 < lengths[0] < 6 and lengths[-1] == 6
    for _ in range(20):  # (the slow moment's share of the average fades)
        length.observe(Observation(6, 6, 0.0, 0.150, 7, lead=6))  # what a 7-wide verify really costs (v(1) + 3 v(4)'s)
    assert cut(length, 6, 6) == 6


def test_a_round_cut_short_by_max_tokens_does_not_back_lookup_off() -> None:
    """Near max_tokens a round has room for one token, where a wider verify may not pay: that says nothing of the
    next generation's full rounds, which still search."""
    length = lookup_length()
    length.observe(Observation(0, 0, 0.0, 0.040, 1))
    for _ in range(3):
        length.observe(Observation(6, 6, 0.0, 0.110, 7, lead=6))
    measure_narrow_widths(length, lambda width: 0.040 + 0.0117 * (width - 1), range(3, 7))
    length.observe(Observation(1, 1, 0.0, 0.085, 2, lead=1))  # (width 2's measure)
    assert cut(length, 1, 1) == 0 and not length.rule(LookupCost).off
    assert length.rule(LookupCost).wanted() and cut(length, 6, 6) == 6


def test_a_narrower_width_measured_in_a_slow_moment_is_measured_again() -> None:
    """The 2-core CPU under load: a 6-wide verify measured once at 1.7x a 4-wide one held lookup at 3 tokens a round
    for whole generations, though 5 (6-wide) is the cheapest a token there; re-measuring only the whole match (7-wide)
    never fixed it. A match cut short now re-measures the wider width measured longest ago, and lookup finds 5."""
    verify = {1: 0.0384, 2: 0.0739, 3: 0.1124, 4: 0.0967, 5: 0.1465, 6: 0.1186, 7: 0.1916}  # (test_chain_cost)
    length = lookup_length()
    length.observe(Observation(0, 0, 0.0, verify[1], 1))
    for width in (7, 7, 2, 3, 4, 5, 6):
        slow = 1.4 if width == 6 else 1.0  # one slow moment
        length.observe(Observation(width - 1, width - 1, 0.0, slow * verify[width], width, lead=width - 1))
    proposed = []
    for _ in range(4 * DraftLength.EPOCH):
        j = cut(length, 6, 6)
        proposed.append(j)
        length.observe(Observation(j, j, 0.0, verify[j + 1], j + 1, lead=j))
    assert proposed[0] == 3  # (the premise: the slow 6-wide figure cuts lookup to 3)
    assert proposed[-DraftLength.EPOCH:].count(5) >= DraftLength.EPOCH - 1, proposed


@pytest.mark.parametrize(("drafter", "lead"), [("lookup", LookupCost), ("suffix", SuffixCost), ("chain", LookupCost)])
def test_a_new_request_judges_lookup_afresh_on_the_kept_prices(drafter: str, lead: type[LookupCost]) -> None:
    """A slot's cost model outlives its requests (`kept_length`): the machine's prices stay, but whether a reply
    copies its prompt is the text's. After a request whose lookup tokens were all rejected (judged a loss, backed
    off), the next request's first matches are proposed whole again to measure it, as a new slot's (given the same
    prices) would be; the verify's prices, the draft model's acceptance and step (the chain) and the verdict that
    drafting is hopeless are kept. On the old code the second request's matches were cut to nothing (backed off,
    waiting for a probe): the CPU demo pair's code edit drafted 5 tokens in 395 rounds after such a reply."""
    cfg = dataclasses.replace(GREEDY.draft, n_draft=6, drafter=drafter)
    built = drafters.build(FakeModel(), FakeModel())[drafter]

    def pricing(cost: DraftCost) -> object:
        return built.pricing(cost, cfg)

    def proposes(length: DraftLength, found: int) -> int:
        extension = length.rule(ModelCost) if ModelCost.SOURCE in length.cost.prior else None
        return length.rule(lead).length(found, 6, length, extension)

    slot: dict = {}
    first = kept_length(slot, cfg, True, False, pricing)
    first.observe(Observation(0, 0, 0.0, 0.016, 1))
    for _ in range(8):  # every lookup token wrong; a 7-wide verify costs 5.5 one-token ones (the CPU)
        first.observe(Observation(6, 0, 0.0, 0.088, 7, lead=6))
        first.observe(Observation(0, 0, 0.0, 0.016, 1))
    if drafter == "chain":  # the draft model's rounds: its acceptance and step are the model's, kept
        first.observe(Observation(2, 2, 0.030, 0.030, 3, first_s=0.015))
    cost = first.cost
    assert proposes(first, 6) == 0 and first.rule(lead).off  # (the premise: backed off)
    cost.hopeless = cost.model_hopeless = True  # (a verdict of the machine's prices: no request resets it)
    prices = (dict(cost.verify_s), dict(cost.verified), cost.step_s, cost.rounds)
    model = {s: (list(cost.tried[s]), list(cost.ok[s])) for s in cost.prior if s != lead.SOURCE}

    second = kept_length(slot, cfg, True, False, pricing)
    assert second.cost is cost and (cost.verify_s, cost.verified, cost.step_s, cost.rounds) == prices
    assert {s: (cost.tried[s], cost.ok[s]) for s in model} == model and cost.hopeless and cost.model_hopeless
    rule = second.rule(lead)
    assert not rule.off and rule.wanted() and rule.interval == DraftCost.PROBE_FIRST
    fresh = kept_length({}, cfg, True, False, pricing, siblings=[slot])  # a new slot: the prices, no acceptance
    assert fresh.cost.verify_s == cost.verify_s
    for _ in range(DraftLength.WARMUP):  # its first matches, whole (measured before judged), as the new slot's
        assert proposes(second, 6) == proposes(fresh, 6) == 6
        for length in (second, fresh):
            length.observe(Observation(6, 6, 0.0, 0.088, 7, lead=6))  # this reply copies its prompt
    assert proposes(second, 6) == proposes(fresh, 6) > 0 and not rule.off
