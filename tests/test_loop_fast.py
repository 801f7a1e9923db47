"""The loop's fast lane: a scripted target and draft (tests/helpers_fake.py) drive the real engine and the real
drafters in milliseconds, no llama.cpp. Greedy output equals plain decoding computed straight from the fake's table;
at T > 0 the emitted tokens follow the target's exact distribution (chi-square), with a draft model's q and with
prompt lookup's point mass; a missed rewind fails inside the fake (a decode must start where the cells end)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import NamedTuple

import numpy as np
import pytest
from helpers_fake import Clock, FakeModel, TimedFake, draft_policy
from helpers_stats import chi_square, joint_probs

from localspec import drafters
from localspec.config import DRAFTERS, load_preset
from localspec.drafters.chain import ChainCost, ChainDrafter
from localspec.drafters.lookup import continuation
from localspec.rounds.engine import Engine
from localspec.rounds.events import TokenEvent, collect
from localspec.rounds.policies import DraftCost, DraftLength, Observation
from localspec.rounds.sampling import accept_or_resample, candidates, point_mass

GREEDY = load_preset("greedy")
HOT = dataclasses.replace(GREEDY.sampling, temperature=0.8, top_k=0, top_p=1.0)
CHI2_99_9 = {15: 37.7}  # chi-square 99.9th percentile by degrees of freedom


def drafting(n: int = 6, drafter: str = "model", **more: object):
    # (a fixed drafting pattern, token for token: standing aside follows the clock;
    # tests/test_stand_aside.py checks it)
    return dataclasses.replace(GREEDY.draft, n_draft=n, drafter=drafter, **{"stand_aside": False, **more})


def pair(**draft: object) -> tuple[FakeModel, FakeModel]:
    return FakeModel(seed=3), FakeModel(seed=3, noise=draft.pop("noise", 1.0), **draft)  # type: ignore[arg-type]


def repetitive(seed: int, n: int = 24) -> list[int]:
    """A prompt that states a phrase twice: prompt lookup has something to match."""
    phrase = np.random.default_rng(seed).integers(0, 8, size=n // 2).tolist()
    return phrase + phrase


def test_the_registry_and_the_preset_name_the_same_drafters() -> None:
    assert tuple(drafters.REGISTRY) == tuple(sorted(DRAFTERS, key=list(drafters.REGISTRY).index))
    assert set(drafters.REGISTRY) == set(DRAFTERS)
    target, draft = pair()
    # (a fake has no MTP layers, and its draft is no block drafter or EAGLE-3 head)
    assert set(drafters.build(target, draft)) == set(DRAFTERS) - {"mtp", "chain-mtp", "dflash", "dspark", "eagle3"}
    assert set(drafters.build(target, None)) == {"lookup", "suffix"}  # the chain would be lookup alone: not offered


def test_lookup_takes_the_longest_match_and_the_latest_on_a_tie() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    assert continuation(tokens, 1, 4, 3) == [9, 5, 2]  # "1 2 3" at 0..2 beats "2 3" at 5..6
    assert continuation(tokens, 1, 2, 3) == [7, 8, 1]  # at most 2 long: "2 3" ties, the latest wins
    assert continuation(tokens, 4, 6, 3) == []  # nothing 4 long
    assert continuation(tokens, 1, 4, 0) == []
    assert continuation([4, 4, 4], 1, 3, 5) == [4] * 5  # a run repeats
    assert continuation([1, 2, 3, 1, 2, 3, 1], 1, 3, 5) == [2, 3, 1, 2, 3]  # so does a period past the end
    assert continuation([5], 1, 3, 2) == []


@pytest.mark.parametrize("drafter", ["model", "lookup", "chain"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_output_is_plain_greedy_for_every_drafter(drafter: str, k: int) -> None:
    for seed in range(4):
        target, draft = pair()
        engine = Engine(target, draft)
        prompt = repetitive(seed)
        gen = collect(engine.generate(prompt, GREEDY.sampling, drafting(k, drafter), 40))
        assert gen.tokens == target.greedy(prompt, 40)
        assert gen.stats.drafted > 0 or drafter == "lookup"
        # Rewound exactly: the target holds the committed tokens but the last, the draft a prefix of them.
        committed = engine.slots[0].tokens
        assert target.cells[0] == committed[:-1]
        assert committed[: len(draft.cells.get(0, []))] == draft.cells.get(0, [])


def test_lookup_drafts_a_repeated_reply_and_needs_no_draft_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lookup's length is chosen by measured costs: on the wall clock a verify of microseconds that hit a busy
    # moment (CI, about 1 run in 100) judged lookup a loss and backed it off; the fake clock is a machine's.
    target = TimedFake(Clock().install(monkeypatch), 0.011, 0.006, seed=3)
    prompt = repetitive(1, 16)
    reference = target.greedy(prompt, 60)
    engine = Engine(target, None)  # one model: lookup drafts; "model" and "chain" cannot run (test_promises.py)
    lookup = collect(engine.generate(prompt, GREEDY.sampling, drafting(6, "lookup", lookup_min=2), 60))
    plain_decodes = target.decodes
    assert lookup.tokens == reference
    # A greedy Markov chain over 8 tokens soon cycles: lookup then drafts it whole.
    assert lookup.stats.accepted > 30 and lookup.stats.rounds < 30
    model = collect(engine.generate(prompt, GREEDY.sampling, drafting(0, "model"), 60))  # plain decoding
    assert model.tokens == reference and model.stats.drafted == 0
    assert target.decodes - plain_decodes > lookup.stats.rounds + 20


def test_chain_falls_back_to_the_model_where_lookup_finds_nothing() -> None:
    target, draft = pair(noise=0.3)
    engine = Engine(target, draft)
    prompt = list(range(8))  # no repeated n-gram: every round's first drafts come from the model
    gen = collect(engine.generate(prompt, GREEDY.sampling, drafting(4, "chain", lookup_min=3), 12))
    assert gen.tokens == target.greedy(prompt, 12)
    assert gen.stats.drafted > 0 and draft.decodes > 0


def _first_two(engine: Engine, prompt: list[int], drafting_, seeds: range) -> tuple[Counter, int, int]:
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in seeds:
        sampling = dataclasses.replace(HOT, seed=seed)
        gen = collect(engine.generate(prompt, sampling, drafting_, 2))
        counts[tuple(gen.tokens)] += 1
        drafted, accepted = drafted + gen.stats.drafted, accepted + gen.stats.accepted
    return counts, drafted, accepted


@pytest.mark.parametrize("drafter", ["lookup", "model", "chain"])
def test_sampled_pairs_follow_the_targets_distribution(drafter: str) -> None:
    """Two tokens after a prompt whose lookup match predicts them (point-mass q) or a noisy draft's q: the joint
    frequency of (first, second) over many seeds fits p(first) p(second | first) of the target alone."""
    target, draft = FakeModel(4, seed=5), FakeModel(4, seed=5, noise=1.5)
    engine = Engine(target, draft)
    likely = int(np.argmax(target.logits_after([1, 2])))
    prompt = [0, 1, 2, likely, 0, 1, 2]  # lookup proposes the target's likeliest token after "1 2", then 0
    counts, drafted, accepted = _first_two(engine, prompt, drafting(2, drafter, lookup_min=2), range(3000))
    first = target.next_probs(prompt, HOT)
    joint = {(a, b): pa * pb for a, pa in first.items() for b, pb in target.next_probs([*prompt, a], HOT).items()}
    assert chi_square(counts, joint) < CHI2_99_9[15]
    assert 0.1 * drafted < accepted < 0.9 * drafted  # drafts were both accepted and rejected


def test_rejection_against_a_point_mass_is_exact() -> None:
    """accept_or_resample with q = a point mass on x: accepted with p(x), else a draw from p without x, so the
    emitted token follows p exactly."""
    logits = np.array([[1.0, 0.2, -0.5, 0.7, 2.0, -1.0, 0.0, 0.3]], dtype=np.float32)
    p = candidates(logits, HOT)
    probs = dict(zip(p.ids[0].tolist(), p.probs[0].tolist(), strict=True))
    rng = np.random.default_rng(0)
    for x in (4, 5):  # the likeliest token and an unlikely one
        counts = Counter(accept_or_resample(x, p, 0, point_mass(x), rng)[1] for _ in range(20_000))
        assert chi_square(counts, probs) < 26.1  # 7 degrees of freedom, 99.9th percentile


@pytest.mark.parametrize("draft_ahead_length", ["full", "fit"])
def test_draft_ahead_is_token_identical_to_the_sequential_loop(draft_ahead_length: str) -> None:
    """Whole draft-aheads draft what the sequential loop drafts: the same tokens and the same acceptance, greedy or
    sampled. Fitted draft-aheads (the default) stop with the verify, so how many drafts a round holds follows the clock:
    the same greedy tokens (sampled, the draws follow the proposals' lengths: tests/test_ahead_fit.py checks the
    distribution and, in lockstep with the verify, the tokens)."""
    for sampling in (GREEDY.sampling, HOT) if draft_ahead_length == "full" else (GREEDY.sampling,):
        outs = []
        for ahead in (False, True):
            target, draft = pair(noise=0.5)
            engine = Engine(target, draft, draft_ahead=ahead)
            gen = collect(engine.generate(list(range(8)), sampling,
                                          drafting(4, draft_ahead_length=draft_ahead_length), 50))
            engine.close()
            outs.append((gen.tokens, gen.stats.accepted, gen.stats.ahead_made > 0))
        same = 2 if draft_ahead_length == "full" else 1
        assert outs[0][:same] == outs[1][:same] and outs[1][2]


class _EveryRound:
    """A chain's chooser that decides without the clock: every match whole, the model all the rest of k (two
    runs of a loop then draft the same, whatever their timings). It stands in for every drafter rule too."""

    padded = False
    aside = None  # (it never stands aside: every round drafts k)
    cost = DraftCost(6)  # (the stream reads its verdict: never hopeless)

    def __init__(self, k: int) -> None:
        self.k = k

    def next(self) -> int:
        return self.k

    def stand_aside(self, k: int, policy: object, lag: int = 1) -> int:  # the model's rule
        return k

    def rule(self, kind: type) -> _EveryRound:
        return self

    def wanted(self) -> bool:  # lookup's rule
        return True

    def length(self, found: int, k: int, policy: object, extension: object = None) -> int:
        return found

    def extension(self, looked_up: int, k: int, policy: object, lag: int = 1) -> int:  # the chain's
        return k - looked_up

    def prefer_draft_ahead(self, looked_up: int, k: int, ready: int, room: int, policy: object) -> bool:
        return False  # (every match whole: a held draft-ahead is thrown)

    def draft_ahead_length(self, k: int) -> int:  # the model's
        return k

    def continuation(self, ready: int, k: int, padded: bool) -> int:
        return k - ready

    def observe(self, *measured: object) -> None:
        pass

    def observe_draft_ahead(self, *measured: object) -> None:
        pass


@pytest.mark.parametrize("sampling", [GREEDY.sampling, HOT], ids=["greedy", "hot"])
def test_the_chain_drafts_ahead_on_the_models_rounds_token_for_token(monkeypatch: pytest.MonkeyPatch,
                                                                     sampling) -> None:
    """The chain drafts the next round beside a verify of the model's drafts alone: a draft-ahead kept when the next
    round is again the model's alone (lookup found nothing), thrown when lookup's tokens come first or the length
    differs (its draws given back). The output, at T = 0 and T > 0, is the sequential loop's token for token, and
    the same draft and accept counts."""
    monkeypatch.setattr(Engine, "_draft_length", lambda self, drafting, *rest: _EveryRound(drafting.n_draft))
    outs, prompt = [], [*range(0, 32, 3), *range(0, 32, 3)]  # lookup matches at first
    for ahead in (False, True):
        # (32 tokens: the reply runs a while before it cycles and lookup takes over)
        target, draft = FakeModel(32, seed=3), FakeModel(32, seed=3, noise=0.5)
        engine = Engine(target, draft, draft_ahead=ahead)
        gen = collect(engine.generate(prompt, sampling, drafting(4, "chain", lookup_min=3), 80))
        engine.close()
        outs.append((gen.tokens, gen.stats.drafted, gen.stats.accepted, gen.stats.rounds, gen.stats.ahead_made,
                     gen.stats.ahead_kept))
    (tokens, drafted, accepted, rounds, _, _), (*same, made, kept) = outs
    assert [tokens, drafted, accepted, rounds] == same
    assert 0 < kept < made < rounds  # draft-aheads kept and thrown; none beside a lookup round
    if sampling.greedy:
        assert tokens == target.greedy(prompt, 80)


class _Weighing(_EveryRound):
    """`_EveryRound`, but a held draft-ahead is weighed against lookup's match by the real cost model
    (`ChainCost.prefer_draft_ahead`), on figures scripted once (the rounds do not move them)."""

    def __init__(self, k: int, length: DraftLength) -> None:
        super().__init__(k)
        self.scripted = length

    def prefer_draft_ahead(self, looked_up: int, k: int, ready: int, room: int, policy: object) -> bool:
        return self.scripted.rule(ChainCost).prefer_draft_ahead(looked_up, k, ready, room, self.scripted)


def scripted_costs(k: int, lookup_right: bool) -> DraftLength:
    """The H200's costs (a padded verify 27.1 ms, a one-token one 12.7, a draft step 1.9), the model's drafts right
    but the last of k, lookup's matches right in full or wrong from their first token."""
    length = draft_policy(drafting(k, "chain"), DraftCost(k, graphs=True), padded=True)
    for _ in range(12):
        length.cost.observe(Observation(k, k - 1, k * 0.0019, 0.0271, k + 1, first_s=0.0019))
        length.cost.observe(Observation(k, k if lookup_right else 0, 0.0, 0.0271, k + 1, lead=k))
        length.cost.observe(Observation(0, 0, 0.0, 0.0127, 1))
    return length


class _Weighed(NamedTuple):
    """A proposal, and how many of its tokens were drafted beside the last verify (`Spent.drafted_ahead`)."""

    tokens: list[int]
    lead: int
    ahead: int


def weighing(monkeypatch: pytest.MonkeyPatch, lookup_right: bool) -> list[_Weighed]:
    """Chains drafted from now on weigh held draft-aheads on `scripted_costs`; the list fills with the proposals of the
    rounds that held a draft-ahead and found a lookup match."""
    monkeypatch.setattr(Engine, "_draft_length",
                        lambda self, drafting, *rest: _Weighing(drafting.n_draft,
                                                                scripted_costs(drafting.n_draft, lookup_right)))
    weighed: list[_Weighed] = []
    chain_draft = ChainDrafter.draft

    def recording(self: ChainDrafter, jobs):  # type: ignore[no-untyped-def]
        [(req, n)] = jobs
        held = self.model.drafted_ahead(req) is not None
        match = continuation(req.tokens, req.drafting.lookup_min, req.drafting.lookup_max, n)
        out = chain_draft(self, jobs)
        if held and match:
            weighed.append(_Weighed(out[0].tokens, out[0].lead, self.spent(req).drafted_ahead))
        return out
    monkeypatch.setattr(ChainDrafter, "draft", recording)
    return weighed


@pytest.mark.parametrize("lookup_right", [False, True], ids=["lookup-poor", "lookup-pays"])
def test_the_chain_weighs_a_held_draft_ahead_against_lookups_match(monkeypatch: pytest.MonkeyPatch,
                                                           lookup_right: bool) -> None:
    """A draft-ahead that came true (drafted beside the last verify: no draft steps on the path) against a lookup match
    in the same round: where lookup's tokens are rarely right (the H200's shipped prompts) the round proposes the
    draft-ahead's drafts, not lookup's (which used to throw the draft-ahead); where they pay more (right in full: a
    round of k sure tokens against the model's) lookup's. The output is plain greedy either way."""
    weighed = weighing(monkeypatch, lookup_right)
    target, draft = FakeModel(12, seed=3), FakeModel(12, seed=3, noise=0.2)
    prompt = [0, 3, 6, 9, 0, 3, 6, 9]  # (12 tokens: the reply soon repeats itself, and lookup matches)
    engine = Engine(target, draft, draft_ahead=True)
    gen = collect(engine.generate(prompt, GREEDY.sampling,
                                  drafting(4, "chain", lookup_min=3, draft_ahead_length="full"), 80))
    engine.close()
    assert gen.tokens == target.greedy(prompt, 80)
    # (Lookup's rounds draft nothing ahead: where lookup wins, a match meets a held draft-ahead only after a model
    # round.)
    assert len(weighed) >= (1 if lookup_right else 3), weighed
    for proposal in weighed:
        if lookup_right:
            assert proposal.lead > 0 and proposal.ahead == 0, proposal
        else:
            assert proposal.lead == 0 and proposal.ahead == len(proposal.tokens) > 0, proposal


def test_a_draft_ahead_taken_over_lookups_match_keeps_the_targets_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """At T > 0 the chain takes held draft-aheads over lookup's poor matches (its point masses dropped, no draws to give
    back; the draft-ahead's draws are the draft's own stream): the first four tokens over many seeds fit the target's
    own p(t1) p(t2 | t1) ... (vocabulary 3: 81 outcomes)."""
    weighed = weighing(monkeypatch, lookup_right=False)
    target, draft = FakeModel(3, seed=5), FakeModel(3, seed=5, noise=1.0)
    engine = Engine(target, draft, draft_ahead=True)
    prompt = [0, 1, 2, 2, 1, 0]
    counts: Counter = Counter()
    for seed in range(2000):
        gen = collect(engine.generate(prompt, dataclasses.replace(HOT, seed=seed),
                                      drafting(2, "chain", lookup_min=2, draft_ahead_length="full"), 6))
        counts[tuple(gen.tokens[:4])] += 1
    engine.close()
    joint = joint_probs(lambda context: target.next_probs(context, HOT), prompt, 4)
    taken = [p for p in weighed if p.lead == 0]
    assert len(taken) > 200 and len(taken) == len(weighed), (len(taken), len(weighed))
    assert chi_square(counts, joint) < 124.8  # 80 degrees of freedom, the 99.9th percentile


class SlowFake(FakeModel):
    """A draft whose every decode takes at least `seconds`: a draft-ahead then outlasts the (instant) verify."""

    def __init__(self, seconds: float, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.seconds = seconds

    def decode_many(self, items):  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)
        return super().decode_many(items)


def test_the_wait_for_a_draft_ahead_is_counted_apart_from_host_work() -> None:
    # Each round's draft-ahead makes 1 + 4 decodes of >= 4 ms beside a verify of microseconds: the loop waits
    # >= 20 ms a round for it, which is neither a decode of its own nor host work (bookkeeping of microseconds).
    target, draft = FakeModel(seed=3), SlowFake(0.004, seed=3, noise=0.5)
    engine = Engine(target, draft, draft_ahead=True)  # (whole draft-aheads: a fitted one stops with the verify)
    stats = collect(engine.generate(list(range(8)), GREEDY.sampling, drafting(4, draft_ahead_length="full"), 40)).stats
    engine.close()
    assert stats.ahead_made > 0
    assert stats.ahead_wait_s >= 0.004 * stats.ahead_made
    assert stats.host_s < stats.ahead_wait_s / 4
    assert stats.host_s == pytest.approx(stats.decode_s - stats.draft_s - stats.verify_s - stats.ahead_wait_s)
    assert stats.as_dict()["ahead_wait_s"] == stats.ahead_wait_s
    sequential = Engine(FakeModel(seed=3), FakeModel(seed=3, noise=0.5), draft_ahead=False)
    assert collect(sequential.generate(list(range(8)), GREEDY.sampling, drafting(4), 40)).stats.ahead_wait_s == 0.0


def test_streams_with_different_drafters_share_a_round_and_match_their_output_alone() -> None:
    requests = [(repetitive(s), drafting(5, d)) for s, d in ((1, "model"), (2, "lookup"), (3, "chain"), (4, "model"))]
    alone = []
    for prompt, d in requests:
        target, draft = pair()
        alone.append(collect(Engine(target, draft).generate(prompt, GREEDY.sampling, d, 30)).tokens)
    target, draft = FakeModel(seed=3, n_seq=4), FakeModel(seed=3, noise=1.0, n_seq=4)
    engine = Engine(target, draft)
    streams = [engine.start(p, GREEDY.sampling, d, 30, slot=i) for i, (p, d) in enumerate(requests)]
    got: list[list[int]] = [[] for _ in streams]
    while not all(s.finished for s in streams):
        live = [s for s in streams if not s.finished]
        engine.step(live)
        for i, s in enumerate(streams):
            if s in live:
                got[i] += [e.token for e in s.events() if isinstance(e, TokenEvent)]
    assert got == alone


def test_device_sampler_shapes_give_the_same_greedy_output() -> None:
    """The one scores type: full logits, the device's argmax, its top candidates (trace) all drive one loop."""
    prompt = repetitive(5)
    for top_k, trace in ((0, False), (4, False), (4, True)):
        target = FakeModel(seed=3, device_top_k=top_k)
        draft = FakeModel(seed=3, noise=1.0, device_top_k=top_k)
        gen = collect(Engine(target, draft).generate(prompt, GREEDY.sampling, drafting(4, "chain"), 30, trace=trace))
        assert gen.tokens == target.greedy(prompt, 30)
        assert [t for t, _ in gen.trace] == (gen.tokens if trace else [])


def test_a_tokens_text_is_asked_of_the_model_once_per_token_id() -> None:
    """Each emitted token's text and end-of-generation flag come from the model once per token id (each is a
    llama.cpp call on the round's path), over generations in turn and in one engine; the text is the model's."""
    target, draft = pair()
    asked: Counter[tuple[str, int]] = Counter()
    for name in ("piece", "is_eog"):
        real = getattr(target, name)
        setattr(target, name, lambda token, _real=real, _name=name: asked.update([(_name, token)]) or _real(token))
    engine = Engine(target, draft)
    emitted: Counter[int] = Counter()
    for seed in range(3):
        for event in engine.generate(repetitive(seed), GREEDY.sampling, drafting(4), 30):
            if isinstance(event, TokenEvent):
                assert event.text == f"<{event.token}>"
                emitted[event.token] += 1
    assert sum(emitted.values()) == 90 and max(emitted.values()) > 1  # (tokens repeat: a cache has work to do)
    assert {token for name, token in asked if name == "piece"} == set(emitted)
    assert max(asked.values()) == 1
