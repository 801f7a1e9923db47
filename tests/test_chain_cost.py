"""The chained drafter's cost decisions through the real loop, on the scripted fakes with a fake clock: each decode
advances the clock by what that machine would take (no timed test: the seconds are injected). The chain leaves the
draft model out where a draft step costs a verify and uses it where it pays; the output is plain greedy either
way. (The cost model alone: tests/test_draft_length.py.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
from helpers_fake import Clock, TimedFake, draft_policy

from localspec.config import load_preset
from localspec.drafters.chain import ChainCost
from localspec.drafters.lookup import LookupCost
from localspec.drafters.model import ModelCost
from localspec.rounds.engine import Engine
from localspec.rounds.events import collect
from localspec.rounds.policies import DraftCost, DraftLength, Observation

GREEDY = load_preset("greedy")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock().install(monkeypatch)


def chain(k: int = 6):
    return dataclasses.replace(GREEDY.draft, n_draft=k, drafter="chain", lookup_min=3)


def test_the_chain_uses_the_draft_model_only_where_it_pays(clock: Clock) -> None:
    """The CPU demo pair's costs (a draft step = a one-token verify, 11 ms + 6 ms a token) against the GPU's (a
    draft step a small fraction of it): the model drafts every round where it pays, and after its warm-up only in
    probes where it does not. The output is plain greedy either way."""
    steps = {}
    for draft_step in (0.017, 0.0005):
        target = TimedFake(clock, 0.011, 0.006, vocab=32, seed=3)
        draft = TimedFake(clock, draft_step, 0.0, vocab=32, seed=3, noise=0.3)
        engine = Engine(target, draft)
        prompt = list(range(8))
        gen = collect(engine.generate(prompt, GREEDY.sampling, chain(), 80))
        assert gen.tokens == target.greedy(prompt, 80)
        steps[draft_step] = (draft.decodes - 1, gen.stats.rounds)  # (its prompt was one decode)
    costly, cheap = steps[0.017], steps[0.0005]
    assert cheap[0] >= 4 * cheap[1]  # several draft steps in every round
    probes = costly[1] // DraftCost.PROBE_FIRST + 1
    assert costly[0] <= (DraftLength.WARMUP + probes) * ModelCost.PROBE


def test_lookup_rounds_go_on_while_the_model_sits_out(clock: Clock) -> None:
    """A reply that repeats its prompt, a model that is a loss: the chain drafts by lookup alone, as fast per token
    as lookup does, and the output is plain greedy."""
    target = TimedFake(clock, 0.011, 0.006, seed=3)
    draft = TimedFake(clock, 0.017, 0.0, seed=3, noise=1.0)
    phrase = [5, 1, 7, 2, 2, 6, 0, 3, 4, 1, 6, 5]
    prompt = phrase * 3
    seconds = {}
    for drafter in ("lookup", "chain"):
        engine = Engine(target, draft)
        start = clock.now
        gen = collect(engine.generate(prompt, GREEDY.sampling, dataclasses.replace(chain(), drafter=drafter), 60))
        seconds[drafter] = clock.now - start
        assert gen.tokens == target.greedy(prompt, 60)
    # The chain pays only the model's warm-up (2 rounds of 2 steps: once per slot) and its probes over lookup alone.
    assert seconds["chain"] <= 1.1 * seconds["lookup"]


def test_the_cost_model_outlives_the_generation_in_its_slot(clock: Clock) -> None:
    """The next prompt in the slot starts from what the last one measured — even with a plain generation between
    (bench interleaves them): no warm-up rounds with a model that was judged a loss."""
    target = TimedFake(clock, 0.011, 0.006, seed=3)
    draft = TimedFake(clock, 0.017, 0.0, seed=3, noise=0.3)
    engine = Engine(target, draft)
    collect(engine.generate(list(range(8)), GREEDY.sampling, chain(), 40))
    collect(engine.generate(list(range(8)), GREEDY.sampling, chain(0), 40))
    before = draft.decodes
    collect(engine.generate([7, 6, 5, 4, 3, 2, 1, 0], GREEDY.sampling, chain(), 40))
    assert draft.decodes - before <= 1 + ModelCost.PROBE  # its prompt, and at most one probe


@pytest.mark.parametrize("drafter", ["lookup", "chain"])
def test_narrow_verifies_after_empty_drafts_keep_the_output_exact(clock: Clock, drafter: str) -> None:
    """A GPU-like engine (constant width) where padding is dear: rounds with nothing drafted go narrow, drafts go
    wide again, and the output is plain greedy."""
    target = TimedFake(clock, 0.0127, 0.0022, vocab=32, seed=3)
    draft = TimedFake(clock, 0.017, 0.0, vocab=32, seed=3, noise=0.3)
    seen: list[int] = []
    decode_many = target.decode_many

    def recording(items):
        seen.extend(len(tokens) for _, tokens, _, _ in items)
        return decode_many(items)
    target.decode_many = recording  # type: ignore[method-assign]
    engine = Engine(target, draft, constant_width=True)
    prompt = [*range(12), *range(12)]  # lookup matches at first; the reply soon stops repeating the prompt
    gen = collect(engine.generate(prompt, GREEDY.sampling, dataclasses.replace(chain(), drafter=drafter), 120))
    assert gen.tokens == target.greedy(prompt, 120)
    verifies = seen[1:]  # (the prompt first)
    assert 1 in verifies and 7 in verifies and set(verifies) <= {1, 3, 7}


class Wandering(TimedFake):
    """The fake's Markov chain, but in every other stretch of 60 positions the logits also depend on the position:
    a reply that alternates between text lookup continues (the chain cycles) and text nothing predicts."""

    def __init__(self, clock: Clock, base: float, per_token: float, **fake: object) -> None:
        super().__init__(clock, base, per_token, **fake)
        self.drift = np.random.default_rng(11).normal(0.0, 3.0, size=(1009, self.n_vocab)).astype(np.float32)

    def logits_after(self, context: Sequence[int]) -> np.ndarray:
        own = super().logits_after(context)
        return own + self.drift[len(context) % 1009] if (len(context) // 60) % 2 else own


@pytest.mark.parametrize(("step", "per_token", "gain"), [(0.011, 0.004, 0.97), (0.0024, 0.00005, 1.15)])
def test_the_chain_probes_out_of_sync_only_where_catching_up_is_cheap(clock: Clock, step: float, per_token: float,
                                                                     gain: float) -> None:
    """One long reply where lookup matches half the time. On the CPU's costs (a draft step about a target step,
    reading a token it sat out ~0.4 of one) the model sits out, and a due probe used to catch up on every token
    since it last drafted (the first, forced after 4 intervals, cost 64 rounds' tokens: 0.83x lookup alone). Now
    the first such catch-up measures its price and later probes wait for the model to be current: within 3% of
    lookup alone. On a GPU's costs the model pays and the chain beats lookup as before."""
    seconds = {}
    for drafter in ("lookup", "chain"):
        target = Wandering(clock, 0.011, 0.006, vocab=96, seed=3, n_ctx=4096)
        draft = Wandering(clock, step, per_token, vocab=96, seed=3, noise=0.4, n_ctx=4096)
        quote = target.greedy([11, 17], 30)
        prompt = np.random.default_rng(7).integers(0, 96, 40).tolist() + [11, 17, *quote, 3, 5, 11, 17]
        engine = Engine(target, draft)
        gen = collect(engine.generate(prompt, GREEDY.sampling, dataclasses.replace(chain(), drafter=drafter), 1500))
        assert gen.tokens == target.greedy(prompt, 1500)
        seconds[drafter] = gen.done.stats.decode_s
    assert seconds["lookup"] >= gain * seconds["chain"], seconds


# The H200's measured costs (the card pair: a Qwen3-32B-shaped Q4_K_M target, a Qwen3-0.6B-shaped Q8_0 draft): the
# target's verify seconds at each constant width, and the draft model's steady step.
H200_VERIFY = {1: 0.01305, 2: 0.01377, 3: 0.01664, 4: 0.01990, 5: 0.02160, 6: 0.02448, 7: 0.02728, 8: 0.02989}
H200_STEP = 0.0024


def simulate(choose, rounds: int, acceptance: float, seed: int = 0) -> float:
    """Tokens per second of `rounds` rounds on the H200's costs, with the draft model's one-off slow calls: its first
    three calls capture CUDA graphs (+8 ms each), and a round's first step after sitting out reads the tokens since
    (+6 ms: another width, its graph rebuilt, and 0.05 ms a token). A verify width change costs one extra verify,
    over the two calls after it. `choose(lag) -> (n, width, length)`: the model tokens to
    draft, the verify width, and the chooser to tell (or None). Each position is accepted with `acceptance`."""
    rng = np.random.default_rng(seed)
    calls, lag, width_before, since_change, tokens, seconds = 0, 1, 7, 9, 0, 0.0
    for _ in range(rounds):
        n, width, length = choose(lag)
        draft_s = first_s = 0.0
        for step in range(n):
            catch_up = 0.006 + 0.00005 * lag if step == 0 and lag > 1 else 0.0
            spent = H200_STEP + (0.008 if calls < 3 else 0.0) + catch_up
            calls += 1
            draft_s += spent
            first_s = first_s or spent
        since_change = 0 if width != width_before else since_change + 1
        verify_s = H200_VERIFY[width] * (1.5 if since_change < 2 else 1.0)
        width_before = width
        accepted = int(np.argmin(np.append(rng.random(n) < acceptance, False)))
        emitted = accepted + 1
        lag = 1 if n else lag + emitted
        tokens += emitted
        seconds += draft_s + verify_s
        if length is not None:
            length.observe(Observation(n, accepted, draft_s, verify_s, width, 0, first_s if n else None))
    return tokens / seconds


def test_the_chain_drafts_with_the_model_on_the_h200s_costs() -> None:
    """The H200 bug: the chain judged the model a loss from its warm-up's slow first calls (a catch-up, a CUDA graph
    captured: ~5.5 ms a step against 2.4 steady) and never turned it on again (0.96x plain where the model drafter
    made 1.76x). On those costs, with lookup never matching, it now drafts like `--drafter model`."""
    cost = DraftCost(6, graphs=True)
    for _ in range(8):  # the slot's earlier generations (bench's warm-up runs) verified narrow: plain is known warm
        cost.observe(Observation(0, 0, 0.0, H200_VERIFY[1], 1))
    length = draft_policy(chain(), cost, padded=True)

    def chained(lag: int):
        n = length.rule(ChainCost).extension(0, 6, length, lag=lag)
        return n, length.verify_width(7, n), length

    chain_speed = simulate(chained, 400, 0.85)
    model_speed = simulate(lambda lag: (6, 7, None), 400, 0.85)
    plain_speed = 1 / H200_VERIFY[1]
    assert model_speed > 1.3 * plain_speed  # (the model pays here, as on the H200)
    assert chain_speed >= 0.97 * model_speed, (chain_speed, model_speed)


@pytest.mark.parametrize("acceptance", [0.2, 0.8])
def test_lookup_proposes_only_what_pays(acceptance: float) -> None:
    """SmolLM2-135M on a GPU: a plain step 1.2 ms, a padded verify 1.6 ms, lookup matching every round. Right 20% of
    the time (the shipped prompts: 0.74x plain when it proposed all it found) its tokens are a loss: it proposes
    nothing but a probe now and then, as fast as plain. Right 80% of the time (the lookup prompts) it proposes all
    of them, as fast as always proposing."""
    plain, wide = 0.0012, 0.0016

    def run(length: DraftLength | None) -> tuple[float, list[int]]:
        rng = np.random.default_rng(1)
        tokens, seconds, proposed = 0, 0.0, []
        for _ in range(400):
            j = 6 if length is None else length.rule(LookupCost).length(6, 6, length)
            width = 7 if length is None else length.verify_width(7, j)
            verify_s = plain if width == 1 else wide
            accepted = int(np.argmin(np.append(rng.random(j) < acceptance, False)))
            tokens, seconds = tokens + accepted + 1, seconds + verify_s
            proposed.append(j)
            if length is not None:
                length.observe(Observation(j, accepted, 0.0, verify_s, width, lead=j))
        return tokens / seconds, proposed

    always, _ = run(None)
    speed, proposed = run(draft_policy(dataclasses.replace(chain(), drafter="lookup"), DraftCost(6, graphs=True),
                                       padded=True))
    if acceptance < 0.5:
        assert always < 0.97 / plain  # (a loss when always proposed)
        assert speed >= 0.95 / plain, (speed, 1 / plain)
        # Mostly nothing; some probes (near break-even, 28% here, a lucky probe re-enables it for a while).
        assert 0 < sum(j > 0 for j in proposed[100:]) < 0.25 * 300
    else:
        assert speed >= 0.97 * always
        assert proposed[100:].count(6) > 0.9 * 300


# The 2-core CPU's measured costs (the demo pair, `--threads 1`, idle box: `bench/gpu/verify_widths.py --threads 1
# --widths 1-8 --no-patterns`): the Gemma 3 270M target's verify seconds by width — not a line: 6 tokens cost less
# than 5 and much less than 7 — and the Q2_K draft's step (a one-token verify's cost).
CPU_VERIFY = {1: 0.0384, 2: 0.0739, 3: 0.1124, 4: 0.0967, 5: 0.1465, 6: 0.1186, 7: 0.1916, 8: 0.1847}
CPU_STEP = 0.036


class WidthTimed(TimedFake):
    """A fake target whose decode of w tokens takes `widths[w]` seconds (past the table: its widest rate a token)."""

    def __init__(self, clock: Clock, widths: dict[int, float], **fake: object) -> None:
        super().__init__(clock, 0.0, 0.0, **fake)
        self.widths = widths

    def decode_many(self, items: Sequence[tuple[int, Sequence[int], int, bool]]) -> list:
        width, widest = sum(len(tokens) for _, tokens, _, _ in items), max(self.widths)
        self.clock.now += self.widths.get(width, width * self.widths[widest] / widest)
        return super(TimedFake, self).decode_many(items)


@pytest.mark.parametrize("quotes", [(60, 100, 160), (160, 100, 60)])
def test_the_chain_keeps_up_with_lookup_on_the_cpus_costs(clock: Clock, quotes: tuple[int, ...]) -> None:
    """The CPU bug: on the lookup prompt set the chain ran at 0.84x lookup alone (25.86 vs 30.93 tok/s): lookup alone
    proposed 5 of a 6-token match (a 6-wide verify, 119-140 ms) and the chain all 6 (7-wide, 192-198 ms: 20% more a
    token). Neither had measured the other's width; each estimated it from a line through the widths it had tried,
    so which one it used was luck (the early rounds' rejections and cuts). Now every width a lookup round can choose
    is measured once, both find the 6-wide verify, and the draft model, a loss here even if every token it drafted
    were accepted, is not probed again within the longest interval: the chain keeps lookup's pace.

    Three prompts (replies that quote the prompt for `quotes` tokens), bench-like: 3 passes of 128 tokens each,
    one engine per drafter (its cost model kept across the generations, as in one bench session)."""
    speed, widths, model_steps, rounds = {}, {}, 0, 0
    for drafter in ("lookup", "chain"):
        target = WidthTimed(clock, CPU_VERIFY, vocab=96, seed=3, n_ctx=4096)
        draft = TimedFake(clock, CPU_STEP, 0.0, vocab=96, seed=3, noise=0.4, n_ctx=4096)
        engine = Engine(target, draft)
        tokens, seconds, lengths = 0, 0.0, []
        for _ in range(3):
            for p, quote_length in enumerate(quotes):
                rng = np.random.default_rng(p)
                start = rng.integers(0, 96, 2).tolist()
                prompt = [*rng.integers(0, 96, 30).tolist(), *start, *target.greedy(start, quote_length),
                          *rng.integers(0, 96, 5).tolist(), *start]
                gen = collect(engine.generate(prompt, GREEDY.sampling, dataclasses.replace(chain(), drafter=drafter),
                                              128))
                assert gen.tokens == target.greedy(prompt, 128)
                tokens, seconds = tokens + len(gen.tokens), seconds + gen.done.stats.decode_s
                rounds += gen.done.stats.rounds if drafter == "chain" else 0
                # (a request's first WARMUP lookup rounds propose the whole match, measured before it is judged:
                # `DraftCost.begin_generation`; the widths chosen by price follow)
                lengths += [n for n in gen.done.stats.draft_lengths if n][DraftLength.WARMUP :]
        speed[drafter], widths[drafter] = tokens / seconds, [n + 1 for n in lengths]
        model_steps = draft.decodes - 9  # (each generation's prompt is one decode)
    for drafter, verified in widths.items():  # the cheapest width a token for a whole match: 6
        assert verified.count(6) >= 0.85 * len(verified), (drafter, sorted(verified))
    # Its warm-up, then a probe every PROBE_MAX rounds at most (the first, on the old code: after 16).
    assert model_steps <= (DraftLength.WARMUP + rounds // DraftCost.PROBE_MAX) * ModelCost.PROBE, (model_steps, rounds)
    assert speed["chain"] >= 0.98 * speed["lookup"], speed


class Drifting(WidthTimed):
    """The fake's Markov chain plus a logit drift by position (a reply that never cycles, so lookup matches only
    what the prompt holds), on a table of verify seconds by width (`widths`; none: `base` + `per_token`)."""

    def __init__(self, clock: Clock, widths: dict[int, float] | None, base: float = 0.0, **fake: object) -> None:
        super().__init__(clock, widths or {}, **fake)
        self.base = base
        self.drift = np.random.default_rng(11).normal(0.0, 3.0, size=(1009, self.n_vocab)).astype(np.float32)

    def logits_after(self, context: Sequence[int]) -> np.ndarray:
        return super().logits_after(context) + self.drift[len(context) % 1009]

    def decode_many(self, items: Sequence[tuple[int, Sequence[int], int, bool]]) -> list:
        # (no table: a draft model's steady step, `base` a decode)
        return super().decode_many(items) if self.widths else TimedFake.decode_many(self, items)


@pytest.mark.parametrize("text", ["no match", "lookup-rich but weak"])
def test_the_chain_turns_a_paying_model_on_at_the_h200s_costs(clock: Clock, text: str) -> None:
    """The H200 bug: on the code-edit and lookup sets the chain ran at lookup's pace (1.22x plain) where the model
    drafter made 1.88x: after its two-round warm-up the model was judged on a few positions (a first rejection
    put S(6) at 0.01), then probed only in sync or after 4 intervals (its cells lag after rounds it sits out) and
    then by 2 tokens, which cannot lift the deeper positions. Now a model that could pay warms up and probes with
    all the room, a due probe catches up at once where catching up is cheap, and a model that paid stays on until
    it is a loss by MIN_GAIN: on these simulated costs the chain drafts like the better of its parts (a regression
    check of that bug, not a promise: the real H200 code edit still ran at lookup's pace, docs/performance.md).

    The H200's verify seconds by width (padded to k + 1, narrow after empty rounds), a draft step 1.9 ms, the model
    right ~80% a position. Bench-like: 3 passes over 3 prompts of 128 tokens, one engine per drafter. "no match":
    random prompts (the old code: 0.86x the model). "lookup-rich but weak": the prompt holds 3-grams of the reply,
    each followed by tokens the reply does not say (lookup matches every fifth token, wrongly); each request measures
    lookup afresh, its first two matches whole in the model's place (`DraftCost.begin_generation`), which costs the
    chain here 0.956x the model (0.986x while a request's lookup verdict carried over to the next)."""
    speed = {}
    for drafter in ("lookup", "model", "chain"):
        target = Drifting(clock, H200_VERIFY, vocab=96, seed=3, n_ctx=4096)
        draft = Drifting(clock, None, base=0.0019, vocab=96, seed=3, noise=0.5, n_ctx=4096)
        engine = Engine(target, draft, constant_width=True)
        tokens, seconds = 0, 0.0
        for _ in range(3):
            for p in range(3):
                rng = np.random.default_rng(p)
                if text == "no match":
                    prompt = rng.integers(0, 96, 60).tolist()
                else:
                    start = rng.integers(0, 96, 2).tolist()
                    reply = target.greedy([0] * 240 + start, 200)  # the reply to any 242-token prompt ending so
                    prompt = [t for i in range(0, 200, 5) for t in [*reply[i : i + 3], *rng.integers(0, 96, 3)]]
                    prompt += start
                gen = collect(engine.generate(prompt, GREEDY.sampling, dataclasses.replace(chain(), drafter=drafter),
                                              128))
                assert gen.tokens == target.greedy(prompt, 128)
                tokens, seconds = tokens + len(gen.tokens), seconds + gen.done.stats.decode_s
        speed[drafter] = tokens / seconds
    assert speed["model"] > 1.2 / H200_VERIFY[1]  # (the model pays here, as on the H200)
    assert speed["chain"] >= (0.97 if text == "no match" else 0.95) * max(speed["lookup"], speed["model"]), speed


def test_a_model_judged_a_loss_stays_out_while_only_the_verify_slows() -> None:
    """Served to several clients on a CPU, a slot's verifies run slower than the figures its draft step was priced
    beside (the other slots decode too). With no draft step measured since, the chain's verdict that its model loses
    at any acceptance stands: before, the slowed one-token verify alone priced the model as paying, and a new slot
    drafted with it after catching up on its whole prompt (~0.2 s a slot, 4 clients on the demo pair). A probe that
    measures a step beside the slow verify judges again."""
    cost = DraftCost(6)
    length = draft_policy(chain(), cost)
    rule, model = length.rule(ChainCost), length.rule(ModelCost)
    for _ in range(2):  # plain steps price a one-token verify
        length.observe(Observation(0, 0, 0.0, CPU_VERIFY[1], 1))
    for _ in range(DraftLength.WARMUP):  # the model's warm-up: two drafts a round, a step about a one-token verify
        length.observe(Observation(2, 1, 2 * CPU_STEP, CPU_VERIFY[3], 3, first_s=CPU_STEP))
    assert rule.extension(0, 6, length, lag=1) == 0 and cost.model_hopeless
    for _ in range(8):  # lookup's and plain rounds, each verify three times slower: no draft step among them
        length.observe(Observation(0, 0, 0.0, 3 * CPU_VERIFY[1], 1))
    assert model.could_pay(0, 6)  # the prices alone now say the model could pay: its step is the old one
    assert rule.extension(0, 6, length, lag=30) == 0 and cost.model_hopeless
    # A probe in sync measures a step beside today's verifies: the verdict is judged again from both.
    length.observe(Observation(2, 2, 2 * CPU_STEP, 3 * CPU_VERIFY[3], 3, first_s=CPU_STEP))
    rule.extension(0, 6, length, lag=1)
    assert not cost.model_hopeless


def test_on_a_cpu_the_chain_prices_plain_decoding_before_its_model_drafts_again(clock: Clock) -> None:
    """A CPU's costs (no padded verify), a draft step about a one-token verify: after the first probe prices a step,
    the next round is a plain step that prices plain decoding, and the model is judged a loss from that measured
    figure. Before, judged against the prior slope's guess of a one-token verify, the model looked paying and drafted
    its whole room (on the demo pair, a 32-token reply began with 2, 6 and 1 model drafts)."""
    target = TimedFake(clock, 0.011, 0.006, vocab=32, seed=3)
    draft = TimedFake(clock, 0.017, 0.0, vocab=32, seed=3, noise=0.3)
    engine = Engine(target, draft)
    prompt = list(range(8))
    gen = collect(engine.generate(prompt, GREEDY.sampling, chain(), 32))
    assert gen.tokens == target.greedy(prompt, 32)
    lengths = gen.stats.draft_lengths
    assert lengths[0] == ModelCost.PROBE and lengths[1] == 0  # a probe prices a step, a plain round plain decoding
    # The warm-up's probes only (DraftLength.WARMUP steps priced), then nothing: the model is judged a loss.
    assert sum(lengths) <= DraftLength.WARMUP * ModelCost.PROBE and not any(lengths[4:])
