"""The suffix drafter (localspec/drafters/suffix.py) through the real loop over the scripted fake
(tests/helpers_fake.py): greedy output is plain decoding's, computed straight from the fake's table; at T > 0 the
emitted pairs follow the target's exact distribution (chi-square) while its proposals come from past samples; a
request never drafts from another owner's text (a planted secret), nor from another pair's; a restart or `reset`
starts empty; the budget holds across many requests; a hostile prompt costs a window. One slow run over SmolLM2
checks greedy = plain through llama.cpp."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers_fake import Clock, FakeModel, TimedFake
from helpers_stats import chi_square
from test_loop_fast import CHI2_99_9, HOT, _first_two

from localspec import drafters
from localspec.config import load_preset
from localspec.drafters.base import DraftRequest
from localspec.drafters.suffix import SuffixCost, SuffixDrafter
from localspec.rounds.engine import Engine
from localspec.rounds.events import GenerationStats, collect

GREEDY = load_preset("greedy")


def drafting(n: int = 6, **more: object):
    return dataclasses.replace(GREEDY.draft, **{"n_draft": n, "drafter": "suffix", **more})


def request(seq: int, tokens: list[int], owner: str = "", **more: object) -> DraftRequest:
    """A request of `owner` (`DraftRequest.owner`: whose text it may draft from)."""
    return DraftRequest(seq, tokens, GREEDY.sampling, drafting(**more), GenerationStats(), owner=owner)


def proposed(drafter: SuffixDrafter, req: DraftRequest, k: int = 6) -> list[int]:
    return drafter.draft([(req, k)])[0].tokens


def finished(drafter: SuffixDrafter, seq: int, tokens: list[int], owner: str) -> None:
    """A request of `owner` that went through `tokens` in slot `seq`; the next request there keeps its text."""
    req = request(seq, list(tokens), owner)
    drafter.start(req, req.tokens, None)
    drafter.rewind(req, drafter.draft([(req, 0)])[0], 0)
    drafter.start(request(seq, [0], owner), [0], None)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_output_is_plain_greedy(k: int) -> None:
    """Repetitive prompts, then follow-ups that draft from the earlier requests' text: plain greedy every time."""
    for seed in range(4):
        target = FakeModel(seed=3)
        engine = Engine(target, None)
        phrase = np.random.default_rng(seed).integers(0, 8, size=12).tolist()
        drafted = 0
        for prompt in (phrase + phrase, phrase[5:] + phrase[:7], phrase[::-1] + phrase):
            gen = collect(engine.generate(prompt, GREEDY.sampling, drafting(k), 40))
            assert gen.tokens == target.greedy(prompt, 40)
            drafted += gen.stats.drafted
            assert target.cells[0] == engine.slots[0].tokens[:-1]
        assert drafted > 0


def _quoting_requests() -> tuple[FakeModel, list[int], list[int], list[int]]:
    """A target, a first request, its greedy reply, and a second request whose prompt ends with that reply's start
    (unseen in its own context)."""
    target = FakeModel(64, seed=4, scale=4.0, n_ctx=1024)
    rng = np.random.default_rng(0)
    first = rng.integers(0, 64, size=10).tolist()
    reply = target.greedy(first, 60)
    second = rng.integers(0, 64, size=10).tolist() + reply[:4]
    return target, first, reply, second


def test_a_later_request_drafts_what_an_earlier_one_wrote() -> None:
    """Request 2's prompt ends with the start of request 1's reply (unseen in its own context): from its first
    round the suffix drafter proposes the rest of that reply, which the target accepts; prompt lookup, searching
    the context alone, accepts fewer."""
    target, first, reply, second = _quoting_requests()
    accepted = {}
    for name in ("suffix", "lookup"):
        engine = Engine(target, None)
        settings = dataclasses.replace(drafting(6), drafter=name)
        collect(engine.generate(first, GREEDY.sampling, settings, 60))
        gen = collect(engine.generate(second, GREEDY.sampling, settings, 30))
        assert gen.tokens == target.greedy(second, 30) == reply[4:34]
        accepted[name] = gen.stats.accepted
    assert accepted["suffix"] >= 20 and accepted["suffix"] > accepted["lookup"], accepted


def test_the_owner_a_generation_is_given_decides_whose_past_it_drafts_from() -> None:
    """`Engine.generate(owner=...)` reaches the drafter: the same second request drafts the first one's reply when
    both are one owner's, and only from its own context when it is another's."""
    target, first, reply, second = _quoting_requests()
    accepted = {}
    for owner in ("a", "b"):
        engine = Engine(target, None)
        collect(engine.generate(first, GREEDY.sampling, drafting(6), 60, owner="a"))
        gen = collect(engine.generate(second, GREEDY.sampling, drafting(6), 30, owner=owner))
        assert gen.tokens == target.greedy(second, 30)
        accepted[owner] = gen.stats.accepted
    assert accepted["a"] >= 20 and accepted["b"] < accepted["a"] // 2, accepted


def test_the_bench_gives_every_generation_an_owner_of_its_own(tiny_pair, monkeypatch) -> None:
    """A bench run of a prompt is a first request: suffix lookup never drafts it from the earlier runs of the same
    prompt (each would look faster than the last), so every generation the bench makes, warm-ups, runs and the
    greedy check, is an owner no other generation was."""
    from localspec import config
    from localspec.sessions import bench
    from localspec.sessions.session import ModelFiles, open_session

    preset = config.load_preset("greedy").with_overrides(n_ctx=256, repeat=2, warmup=1, max_tokens=8, threads=1,
                                                        drafter="suffix")
    owners: list[str] = []
    with open_session(ModelFiles(target=tiny_pair[0], draft=None, name="custom"), preset) as session:
        generate = session.engine.generate

        def recorded(*args: object, owner: str = "", **kwargs: object):
            owners.append(owner)
            return generate(*args, owner=owner, **kwargs)

        monkeypatch.setattr(session.engine, "generate", recorded)
        list(bench.run_bench(session, preset, [bench.BenchPrompt("p", text="one two one two one two")], raw=True))
    drafting_runs = 2 + 1 + 1  # the speculative runs, a warm-up, the greedy check's speculative generation
    assert len(owners) >= drafting_runs and "" not in owners and len(set(owners)) == len(owners), owners


def test_sampled_pairs_follow_the_targets_distribution() -> None:
    """Two tokens at T > 0 after a prompt whose end occurred before (point-mass q), 3000 seeds on one engine: each
    generation's proposal comes from the earlier generations' samples (the most frequent continuation so far), and
    the joint frequency of (first, second) still fits p(first) p(second | first) of the target alone."""
    target = FakeModel(4, seed=5)
    engine = Engine(target, None)
    likely = int(np.argmax(target.logits_after([1, 2])))
    prompt = [0, 1, 2, likely, 0, 1, 2]
    counts, drafted, accepted = _first_two(engine, prompt, drafting(2), range(3000))
    first = target.next_probs(prompt, HOT)
    joint = {(a, b): pa * pb for a, pa in first.items() for b, pb in target.next_probs([*prompt, a], HOT).items()}
    assert chi_square(counts, joint) < CHI2_99_9[15]
    assert 0.1 * drafted < accepted < 0.9 * drafted  # drafts were both accepted and rejected
    assert engine.drafters["suffix"].store.documents("")  # (the premise: past generations were drafted from)


SECRET = [900 + i for i in range(12)]


def test_a_request_never_drafts_from_another_owners_text() -> None:
    """Alice's request carries a secret; Bob's requests end with the secret's first tokens. Alice's next request
    drafts the rest of it; Bob's never propose a token of it that his own text (this request's, his earlier ones')
    does not hold."""
    drafter = SuffixDrafter()
    alice_text = [1, 2, 3, *SECRET, 4, 5]
    finished(drafter, 0, alice_text, "alice")
    assert drafter.store.documents("alice") == [alice_text]
    probe = [7, 7, *SECRET[:6]]
    assert proposed(drafter, request(1, probe, "alice")) == SECRET[6:12]  # (the premise: it is there to find)
    rng = np.random.default_rng(0)
    bobs: set[int] = set()
    for seq in range(2, 40):
        cut = int(rng.integers(3, len(SECRET)))
        bob = [*rng.integers(0, 20, size=int(rng.integers(0, 30))).tolist(), *SECRET[:cut]]
        bobs.update(bob)
        got = proposed(drafter, request(seq % 4, bob, "bob"))
        assert not (set(got) - bobs), (bob, got)
        finished(drafter, seq % 4, bob, "bob")
    # Each request's text went to its own owner's documents when its slot was reused (Alice's probe too).
    assert "bob" in drafter.store.owners() and drafter.store.documents("alice") == [alice_text, probe]
    # The owner's key: a request without one (one caller) sees neither's past text.
    assert proposed(drafter, request(1, probe, "")) == []


def test_another_pair_never_sees_a_pairs_text() -> None:
    """Each engine (a served pair) builds its own drafters: the secret one pair saw is not in another's index."""
    one, other = (drafters.build(FakeModel(), None)["suffix"] for _ in range(2))
    assert isinstance(one, SuffixDrafter) and isinstance(other, SuffixDrafter) and one is not other
    finished(one, 0, [1, 2, 3, *SECRET], "")
    probe = [5, *SECRET[:6]]
    assert proposed(one, request(0, probe)) == SECRET[6:12]
    assert proposed(other, request(0, probe)) == []


def test_a_restart_or_a_reset_starts_empty_and_drafts_on() -> None:
    """The index lives in host memory: a fresh process (a new drafter) and `Engine.reset` (a failed job, a chat's
    reset) hold nothing of the past, and the next generation is still plain greedy."""
    target = FakeModel(seed=3)
    engine = Engine(target, None)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    collect(engine.generate(prompt, GREEDY.sampling, drafting(4), 30))
    collect(engine.generate([0, 0, 1], GREEDY.sampling, drafting(4), 5))
    suffix = engine.drafters["suffix"]
    assert isinstance(suffix, SuffixDrafter) and suffix.store.tokens > 0
    engine.reset()
    assert suffix.store.tokens == 0 and suffix.store.owners() == [] and not suffix._contexts
    gen = collect(engine.generate(prompt, GREEDY.sampling, drafting(4), 30))
    assert gen.tokens == target.greedy(prompt, 30)
    assert drafters.build(target, None)["suffix"].store.tokens == 0  # (a restart builds a new one)


def test_the_budget_holds_across_many_requests() -> None:
    target = FakeModel(16, seed=2, n_ctx=1024)
    engine = Engine(target, None)
    rng = np.random.default_rng(3)
    settings = drafting(4, suffix_budget=300)
    for _ in range(30):
        prompt = rng.integers(0, 16, size=int(rng.integers(20, 120))).tolist()
        gen = collect(engine.generate(prompt, GREEDY.sampling, settings, 20))
        assert gen.tokens == target.greedy(prompt, 20)
        store = engine.drafters["suffix"].store
        assert store.tokens <= 300
        assert all(entries <= 300 + 3 for _, entries in (store.corpus(o).stream.entries() for o in store.owners()))
    collect(engine.generate([1, 2, 3], GREEDY.sampling, drafting(4, suffix_budget=0), 2))
    collect(engine.generate([1, 2, 3], GREEDY.sampling, drafting(4, suffix_budget=0), 2))
    assert engine.drafters["suffix"].store.tokens == 0  # a zero budget keeps no past text


def test_a_hostile_prompt_costs_a_window_and_a_bounded_round() -> None:
    """A 2 Mi-token prompt repeating one phrase: the drafter holds its window, and a round's work is a short
    prompt's."""
    phrase = [11, 12, 13, 14, 15]
    work = []
    for size in (2000, 2 * 2**20):
        drafter = SuffixDrafter(window=1024)
        req = request(0, phrase * (size // len(phrase)))
        drafter.start(req, req.tokens, None)
        stream = drafter._contexts[0].stream
        assert len(stream) <= 1024
        proposed(drafter, req)
        before = stream.work
        for _ in range(10):
            got = proposed(drafter, req, 6)
            assert got == [phrase[(len(req.tokens) + i) % 5] for i in range(6)]
            req.tokens.extend(got)
            drafter.rewind(req, drafter.draft([(req, 0)])[0], 0)
            assert len(stream) <= 2 * 1024
        work.append(stream.work - before)
    assert work[1] == work[0], work


def test_its_acceptance_is_its_own_source_and_is_priced_as_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the loop its tokens are counted under their own source; where they are mostly wrong on a machine that
    makes a wide verify dear, the rule backs them off as lookup's (most rounds verify one token)."""
    clock = Clock()
    import types

    monkeypatch.setattr("localspec.rounds.engine.time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    target = TimedFake(clock, 0.001, 0.004, vocab=64, seed=5, n_ctx=1024)
    prompt = np.random.default_rng(2).integers(0, 64, size=300).tolist()
    engine = Engine(target, None)
    settings = drafting(6, suffix_factor=4.0, suffix_min_prob=0.0)
    gen = collect(engine.generate(prompt, GREEDY.sampling, settings, 100))
    assert gen.tokens == target.greedy(prompt, 100)
    cost = engine.slots[0].policies[(settings, True)].cost
    assert cost.seen["suffix"] > 0 and "lookup" not in cost.seen
    assert SuffixCost.of(cost).off or sum(n > 0 for n in gen.stats.draft_lengths) < 0.3 * gen.stats.rounds


@pytest.mark.slow
def test_greedy_equals_plain_over_smollm2() -> None:
    """Through llama.cpp (SmolLM2-135M-Instruct, one thread): a prompt that repeats code, then a follow-up that
    quotes the first reply: the suffix drafter's greedy text is plain decoding's, token for token, and it drafted."""
    from localspec.models.demo import smollm2_source_path
    from localspec.sessions.session import ModelFiles, open_session

    preset = GREEDY.with_overrides(n_ctx=2048, threads=1, drafter="suffix")
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    texts = [f"Rewrite this code with type hints:\n{code}", f"Here is the code again:\n{code}Rewrite it with hints:\n"]
    with open_session(ModelFiles(target=smollm2_source_path(), draft=None, name="plain"), preset) as s:
        prompts = [s.target.tokenize(t) for t in texts]
        plain = [collect(s.engine.generate(p, preset.sampling, drafting(0), 48))
                 for p in prompts]
        s.engine.reset()
        spec = [collect(s.engine.generate(p, preset.sampling, drafting(6), 48)) for p in prompts]
    assert [g.tokens for g in spec] == [g.tokens for g in plain]
    # It drafted: its first matches are proposed whole, before any measured price could cut them (on a busy machine
    # the prices after them may judge every later match a loss, so how many were kept follows the clock).
    assert sum(g.stats.drafted for g in spec) > 0, [g.stats for g in spec]


@pytest.mark.parametrize("k", [2, 4, 7])
def test_the_chain_led_by_suffix_lookup_is_plain_greedy_and_counts_its_sources_apart(k: int) -> None:
    """`chain_lead = "suffix"`: suffix lookup's tokens first (their own source in the cost model), the draft model's
    where it finds nothing; plain greedy, the draft model's cells a prefix of the committed tokens."""
    for seed in range(3):
        target, draft = FakeModel(seed=3), FakeModel(seed=3, noise=1.0)
        engine = Engine(target, draft)
        settings = drafting(k, drafter="chain", chain_lead="suffix")
        phrase = np.random.default_rng(seed).integers(0, 8, size=12).tolist()
        for prompt in (phrase + phrase, list(range(8)), phrase[3:] + phrase[:5]):
            gen = collect(engine.generate(prompt, GREEDY.sampling, settings, 40))
            assert gen.tokens == target.greedy(prompt, 40)
            committed = engine.slots[0].tokens
            assert committed[: len(draft.cells.get(0, []))] == draft.cells.get(0, [])
        cost = engine.slots[0].policies[(settings, True)].cost
        assert cost.lead_source == "suffix" and "lookup" not in cost.seen and cost.seen["suffix"] > 0
        assert engine.drafters["suffix"].store.documents("")  # (its past requests: the suffix drafter's own index)


def test_the_chain_led_by_suffix_lookup_is_exact_at_t_above_0() -> None:
    target, draft = FakeModel(4, seed=5), FakeModel(4, seed=5, noise=1.5)
    engine = Engine(target, draft)
    likely = int(np.argmax(target.logits_after([1, 2])))
    prompt = [0, 1, 2, likely, 0, 1, 2]
    counts, drafted, accepted = _first_two(engine, prompt, drafting(2, drafter="chain", chain_lead="suffix"),
                                           range(3000))
    first = target.next_probs(prompt, HOT)
    joint = {(a, b): pa * pb for a, pa in first.items() for b, pb in target.next_probs([*prompt, a], HOT).items()}
    assert chi_square(counts, joint) < CHI2_99_9[15]
    assert 0.1 * drafted < accepted < 0.9 * drafted
