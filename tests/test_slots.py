"""Several generations in one engine (slots): each request's output is what it would be alone, on the CPU bit for
bit at T = 0, and the target's distribution at T > 0, whatever else runs beside it and whenever it arrives."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from localspec.config import Drafting, load_preset
from localspec.llama.grammar import Grammar
from localspec.rounds.events import STOP_MAX_TOKENS, TokenEvent, collect
from localspec.rounds.policies import LoadPolicy
from localspec.rounds.sampling import candidates
from localspec.sessions.session import ModelFiles, open_session
from tests.helpers_rounds import each_alone, run_together
from tests.helpers_stats import chi_square

pytestmark = pytest.mark.slow

# One thread: a load skips the automatic choice's 0.2 s CPU sample, and two test workers never split a core.
# (drafts every round: these tests look at drafts; standing aside: tests/test_stand_aside.py)
GREEDY = load_preset("greedy").with_overrides(threads=1, stand_aside=False)


def drafting(n_draft: int, p_min: float, adaptive: bool) -> Drafting:
    return dataclasses.replace(GREEDY.draft, n_draft=n_draft, p_min=p_min, adaptive=adaptive)


def prompts(n: int, seed: int, length: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40_000, size=length + i).tolist() for i in range(n)]


def open_slots(pair, parallel: int, **load):
    preset = GREEDY.with_overrides(**load) if load else GREEDY
    return open_session(ModelFiles(target=pair[0], draft=pair[1], name="test"), preset, parallel=parallel)


def outputs_alone(pair, requests: list[dict], **load) -> list[list[int]]:
    """Each request's tokens generated alone, from empty caches, in a one-slot engine: the reference."""
    with open_slots(pair, 1, **load) as alone:
        return each_alone(alone.engine, requests)


@pytest.mark.parametrize("device_top_k", [0, 64])
@pytest.mark.parametrize("pair", ["tiny_pair", "tiny_pair_high"])
def test_greedy_requests_together_are_token_identical_to_each_alone(request, pair, device_top_k):
    """Four requests with different prompts, lengths, draft lengths (k = 0 too) and penalties, arriving at
    different rounds: each gets exactly the tokens it gets alone in a one-slot engine."""
    files = request.getfixturevalue(pair)
    penalized = dataclasses.replace(GREEDY.sampling, repeat_penalty=1.3)
    ps = prompts(4, seed=3)
    requests = [
        dict(prompt=ps[0], sampling=GREEDY.sampling, drafting=drafting(6, 0.0, False), max_tokens=40),
        dict(prompt=ps[1], sampling=GREEDY.sampling, drafting=drafting(3, 0.0, False), max_tokens=25),
        dict(prompt=ps[2], sampling=penalized, drafting=drafting(5, 0.3, False), max_tokens=33),
        dict(prompt=ps[3], sampling=GREEDY.sampling, drafting=drafting(0, 0.0, False), max_tokens=18),
    ]
    expected = outputs_alone(files, requests, device_top_k=device_top_k)
    with open_slots(files, 4, device_top_k=device_top_k) as s:
        assert len(s.engine.slots) == 4
        together = run_together(s.engine, requests, arrivals=[0, 0, 3, 7])
        assert together == expected
        # Again, in slots that now hold other requests' cells, arriving in another order.
        together = run_together(s.engine, requests[::-1], arrivals=[0, 2, 2, 5])
        assert together == expected[::-1]
        assert all(not slot.busy for slot in s.engine.slots)


def test_the_target_distribution_holds_with_requests_running_together(tiny_pair):
    """At T > 0 each request's first token follows the target's p exactly, drawn while three other requests
    (other prompts, other settings) share every round."""
    preset = GREEDY.with_overrides(temperature=1.5, top_k=6, top_p=1.0)
    others = prompts(3, seed=8)
    with open_slots(tiny_pair, 4) as s:
        prompt = prompts(1, seed=21)[0]
        s.target.use_device_sampler(None)  # the reference p comes from the full logits
        logits = s.target.decode(prompt, 0).logits
        p = candidates(logits, preset.sampling)
        s.engine.reset()
        n = 1200
        firsts: Counter[int] = Counter()
        accepted = 0
        for seed in range(n):
            measured = dict(prompt=prompt, sampling=dataclasses.replace(preset.sampling, seed=seed),
                            drafting=drafting(1, 0.0, False), max_tokens=2)
            noise = [dict(prompt=q, sampling=dataclasses.replace(preset.sampling, temperature=0.8, seed=seed + i),
                          drafting=drafting(4, 0.0, False), max_tokens=2) for i, q in enumerate(others)]
            streams = []
            for r in (measured, *noise):
                streams.append(s.engine.start(**r, slot=s.engine.free_slot(r["prompt"])))
            tokens, live = [], list(streams)
            while live:
                s.engine.step(live)
                for stream in list(live):
                    for event in stream.events():
                        if stream is streams[0] and isinstance(event, TokenEvent):
                            tokens.append(event.token)
                    if stream.finished:
                        live.remove(stream)
            firsts[tokens[0]] += 1
            accepted += streams[0].stats.accepted
    assert 0 < accepted < n  # both branches (accept and resample) were taken
    p_first = dict(zip(p.ids[0].tolist(), p.probs[0].tolist(), strict=True))
    assert chi_square(firsts, p_first) < 20.5  # chi-square with 5 degrees of freedom at p = 0.001


def test_a_returning_conversation_goes_back_to_its_slot(tiny_pair):
    """A prompt that extends what a free slot holds goes to that slot and only its new tokens are processed."""
    ps = prompts(3, seed=5)
    with open_slots(tiny_pair, 3) as s:
        first = {}
        for i, prompt in enumerate(ps):
            slot = s.engine.free_slot(prompt)
            gen = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(4, 0.0, False), 10, slot=slot))
            first[i] = (slot, prompt + gen.tokens)
        assert sorted(slot for slot, _ in first.values()) == [0, 1, 2]  # each took a fresh slot (least recently used)
        slot, history = first[1]
        follow_up = history + [123, 456]
        assert s.engine.free_slot(follow_up) == slot
        gen = collect(s.engine.generate(follow_up, GREEDY.sampling, drafting(4, 0.0, False), 5, slot=slot))
        assert gen.stats.prompt_tokens_processed <= 3  # the two new tokens (and the last reply token)


def test_a_stopped_request_frees_its_slot_and_the_others_go_on(tiny_pair):
    ps = prompts(2, seed=9)
    stop = {"now": False}
    with open_slots(tiny_pair, 2) as s:
        a = s.engine.start(ps[0], GREEDY.sampling, drafting(4, 0.0, False), 30, lambda: stop["now"], slot=0)
        b = s.engine.start(ps[1], GREEDY.sampling, drafting(4, 0.0, False), 30, slot=1)
        assert s.engine.free_slot(ps[0]) is None
        s.engine.step([a, b])
        list(a.events()), list(b.events())
        stop["now"] = True
        s.engine.step([a, b])
        events_a = list(a.events())
        assert [type(e) for e in b.events()] and not b.finished  # b's round went on
        assert a.finished and events_a == [a.done] and a.done.stop_reason == "requested"
        assert s.engine.free_slot(ps[0]) == 0
        while not b.finished:
            s.engine.step([b])
            list(b.events())
        assert b.done.stop_reason == STOP_MAX_TOKENS and b.stats.tokens == 30


def _drive(policy: LoadPolicy, n: int, speed: dict[float, float], rounds: int) -> list[tuple[int, float]]:
    """`rounds` rounds at batch size n, each share running at its `speed` (tok/s): (epoch, share) per round."""
    out = []
    for _ in range(rounds):
        epoch, share = policy.epochs.get(n, 0), policy.share(n)
        out.append((epoch, share))
        policy.observe(n, share, tokens=int(speed[share]), seconds=1.0)
    return out


def test_load_policy_measures_each_share_and_keeps_the_fastest():
    policy = LoadPolicy()
    assert policy.share(1) == 1.0  # one request alone always drafts all of its length
    speed = {1.0: 50.0, 0.0: 80.0, 0.5: 65.0}  # tok/s: plain batched decoding is fastest at 4 slots here
    e, early = policy.EPOCH, policy.EARLY
    chosen = [share for _, share in _drive(policy, 4, speed, 2 * e + early + e)]
    # Each measured for an epoch, in turn: all of k trails plain decoding by more than DEFER, so only EARLY rounds.
    assert chosen == [0.0] * e + [0.5] * e + [1.0] * early + [0.0] * e  # then the fastest
    assert policy.summary()[4] == {"k×0": 80.0, "k×0.5": 65.0, "k×1": 50.0}
    assert policy.order.get(9) is None and policy.share(9) == 0.0
    assert policy.order[9] == (0.0, 0.5)  # (9 is not near 4, but all of k lost at a smaller size)


def test_re_measuring_backs_off_while_the_best_stays_best_and_starts_over_when_it_falls() -> None:
    """The first re-measuring epoch comes REPROBE epochs in, each next one twice as far while the share it
    measures loses again (up to REPROBE_MAX), the others in turn; one whose share wins makes it the best and the
    gap REPROBE again."""
    policy = LoadPolicy()
    speed = {1.0: 50.0, 0.0: 80.0, 0.5: 65.0}
    rounds = _drive(policy, 4, speed, 200 * policy.EPOCH)
    probes = sorted({(epoch, share) for epoch, share in rounds if epoch >= 3 and share != 0.0})
    r, top = policy.REPROBE, policy.REPROBE_MAX
    assert [epoch for epoch, _ in probes] == [r, 3 * r, 7 * r, 7 * r + top, 7 * r + 2 * top]
    assert [share for _, share in probes] == [0.5, 1.0, 0.5, 1.0, 0.5]
    assert all(share == 0.0 for epoch, share in rounds if epoch >= 3 and (epoch, share) not in probes)
    # Half of k is now the fastest: the next re-measuring epoch that measures it (all of k comes first) finds it,
    # and the gap starts over.
    speed[0.5] = 120.0
    rounds = _drive(policy, 4, speed, (2 * top + 4 * r) * policy.EPOCH)
    found = min(epoch for epoch, share in rounds if share == 0.5)
    assert found == 7 * r + 4 * top and {share for epoch, share in rounds if epoch < found} == {0.0, 1.0}
    later = sorted({epoch for epoch, share in rounds if epoch > found and share != 0.5})
    assert later[:2] == [found + r, found + 3 * r] and policy.share(4) == 0.5


def test_a_share_that_trails_by_far_leaves_the_longer_ones_to_re_measuring_and_larger_batches() -> None:
    """Half of k trails plain decoding by more than DEFER at 8 slots: all of k is not measured first there, nor at
    any larger batch size (nearer compute-bound); a smaller one measures everything."""
    policy = LoadPolicy()
    e, early = policy.EPOCH, policy.EARLY
    speed = {0.0: 80.0, 0.5: 55.0, 1.0: 40.0}
    assert [share for _, share in _drive(policy, 8, speed, e + early + e)] == [0.0] * e + [0.5] * early + [0.0] * e
    assert policy.order[8] == (0.0, 0.5) and policy.lost(8) == {0.5}
    assert policy.share(16) == 0.0 and policy.order[16] == (0.0,)  # (16 is not near 8: what lost there loses here)
    assert policy.share(2) == 0.0 and policy.order[2] == policy.SHARES


def test_a_batch_size_next_to_a_measured_one_measures_in_its_order_and_leaves_its_clear_loser() -> None:
    """At 4 slots plain decoding was fastest, half the length within DEFER of it, all of it far behind: 5 slots
    measure plain first, then half, and all of it only in a re-measuring epoch; so does 9, not near 4 but larger."""
    policy = LoadPolicy()
    e = policy.EPOCH
    speed = {1.0: 50.0, 0.0: 80.0, 0.5: 65.0}
    _drive(policy, 4, speed, 3 * e)
    chosen = [share for _, share in _drive(policy, 5, speed, policy.REPROBE * e + 1)]
    assert chosen[: 2 * e] == [0.0] * e + [0.5] * e
    assert set(chosen[2 * e : policy.REPROBE * e]) == {0.0}  # the fastest; all of k was never drafted at 5
    assert chosen[-1] in (1.0, 0.5)  # the re-measuring epoch
    assert policy.order[5] == (0.0, 0.5) and policy.share(9) == 0.0 and policy.order[9] == (0.0, 0.5)
    assert policy.share(3) == 0.0 and policy.order[3] == (0.0, 0.5)  # (4 and 5 are near 3: 4 is nearest)


def test_with_several_streams_the_policy_shortens_drafts_and_output_stays_exact(tiny_pair, monkeypatch):
    """Driven through the engine: at 2 streams the policy's epochs draft none, all and half of k, and the
    greedy output of each request is still its output alone. (The streams may stand aside, which puts them under
    the load policy; the draft model's own rule for standing aside is set aside here: this is the policy's test.)"""
    from localspec.drafters.base import DrafterBase

    monkeypatch.setattr(DrafterBase, "stand_aside", lambda self, req, k, rule, lag=1: k)
    ps = prompts(2, seed=12)
    may_stand_aside = dataclasses.replace(drafting(6, 0.0, False), stand_aside=True)  # (the load policy's subject)
    requests = [dict(prompt=p, sampling=GREEDY.sampling, drafting=may_stand_aside, max_tokens=90) for p in ps]
    expected = outputs_alone(tiny_pair, requests)
    with open_slots(tiny_pair, 2) as s:
        streams = [s.engine.start(**r, slot=i) for i, r in enumerate(requests)]
        got: list[list[int]] = [[], []]
        lengths: list[set[int]] = []
        while not all(x.finished for x in streams):
            live = [x for x in streams if not x.finished]
            s.engine.step(live)
            lengths.append({x.stats.draft_lengths[-1] for x in live})
            for i, x in enumerate(streams):
                if x in live:
                    got[i] += [e.token for e in x.events() if isinstance(e, TokenEvent)]
        assert got == expected
        load = s.engine.load
        e = load.EPOCH
        assert lengths[:e] == [{0}] * e  # the plain epoch first
        half = next(i for i, n in enumerate(lengths[e:]) if n != {3})  # half of k = 6: an epoch, or EARLY rounds
        assert load.EARLY <= half <= e
        after = lengths[e + half : e + half + load.EARLY]
        if 0.5 in load.lost(2):  # it trailed plain decoding by more than DEFER: all of k is left to re-measuring
            assert after == [{0}] * load.EARLY
        else:  # then all of k
            assert after[0] == {6} and set(load.summary()[2]) == {"k×1", "k×0", "k×0.5"}


def test_streams_that_always_draft_keep_their_length_under_load(tiny_pair):
    """`[draft] stand_aside` off (--always-draft) drafts every round at its length: the load policy cuts the share
    of a stream beside it that may stand aside, never its own, and rounds it alone drafts in do not count as the
    policy's measurements."""
    ps = prompts(2, seed=13)
    always = drafting(6, 0.0, False)  # (GREEDY: stand_aside off)
    may_stand_aside = dataclasses.replace(always, stand_aside=True)
    with open_slots(tiny_pair, 2) as s:
        load = s.engine.load
        load.order[2] = (0.0,)  # (the policy's first epoch at 2 streams: plain decoding)
        streams = [s.engine.start(prompt=ps[0], sampling=GREEDY.sampling, drafting=always, max_tokens=40, slot=0),
                   s.engine.start(prompt=ps[1], sampling=GREEDY.sampling, drafting=may_stand_aside,
                                  max_tokens=40, slot=1)]
        lengths = []
        for _ in range(3):
            s.engine.step(streams)
            lengths.append([x.stats.draft_lengths[-1] for x in streams])
            for x in streams:
                list(x.events())
        assert lengths == [[6, 0]] * 3 and load.rounds[2] == 3  # the other stream's share cut, and measured
    with open_slots(tiny_pair, 2) as s:
        both = [s.engine.start(prompt=p, sampling=GREEDY.sampling, drafting=always, max_tokens=40, slot=i)
                for i, p in enumerate(ps)]
        s.engine.load.order[2] = (0.0,)
        for _ in range(3):
            s.engine.step(both)
            assert [x.stats.draft_lengths[-1] for x in both] == [6, 6]
            for x in both:
                list(x.events())
        assert not s.engine.load.rounds  # rounds nobody could be cut in are no measurement


def test_parallel_sizes_each_slot_at_the_context(tiny_pair):
    with open_slots(tiny_pair, 3, n_ctx=128) as s:
        assert s.target.n_seq == s.draft.n_seq == 3
        assert s.engine.n_ctx == 128
        long = prompts(1, seed=1, length=100)[0]
        outs = []
        for slot in range(3):
            outs.append(collect(s.engine.generate(long, GREEDY.sampling, drafting(6, 0.0, False), 200, slot=slot)))
        assert all(o.done.stop_reason == "context_full" for o in outs)
        assert len({tuple(o.tokens) for o in outs}) == 1  # each slot holds a whole context of its own


def test_a_model_whose_sequence_batches_differ_takes_turns_and_stays_exact(use_demo_home):
    """Gemma 3's multi-sequence batches are not the single-sequence graph in llama.cpp (measured at load): its
    slots decode one after another inside each round, and every request still gets its output alone."""
    from localspec.models import demo

    pair = (demo.target_path(), demo.draft_path())
    requests = [dict(prompt=p, sampling=GREEDY.sampling, drafting=drafting(k, 0.0, False), max_tokens=24)
                for p, k in zip(prompts(3, seed=2), (6, 2, 0), strict=True)]
    expected = outputs_alone(pair, requests)
    with open_slots(pair, 3) as s:
        assert s.target.sequence_batch_error > 0.5 and not s.engine.batches_slots
        # llama.cpp 0.3.36 on the CPU, after a context: sharing a batch moves Gemma 3's rows 4.7 logits against
        # each sequence alone, while one sequence alone at two widths matches bit for bit (from position 0 it
        # does not: 4.7 logits between 5 and 9 tokens), as Llama-style models do anywhere (test_llama_load)
        assert s.target.width_noise == 0.0
        s.target.on_gpu = True  # the GPU's comparison, at the same width, sees the wrong graph too
        same_width_error, _ = s.target._sequence_batch_error()
        s.target.on_gpu = False
        assert same_width_error > 0.5
        assert run_together(s.engine, requests, arrivals=[0, 1, 1]) == expected
        # Its rows come whole (no device chains): a turn's graph would differ from the last in where the chains
        # run, and llama.cpp would plan its graphs afresh before every verify.
        assert s.target.replans == 0 and s.target.device_top_k == 64
        assert all(s.target.device_sampler(seq) is None for seq in range(3))
        # With the draft model working beside the verify (as on a GPU), each round drafts the next stream's
        # proposal beside the verify before it, on llama.cpp's threads: the same tokens, in other slots too.
        s.engine.draft_ahead = True
        assert run_together(s.engine, requests[::-1], arrivals=[0, 0, 2], slots=[1, 2, 0]) == expected[::-1]
        assert s.engine._beside is not None


def test_a_target_taking_turns_beside_a_draft_that_shares_batches_stays_exact(tiny_pair):
    """The GPU's case for a target whose shared batches are wrong: its slots take turns, full rows, while the draft
    model (which shares batches, device chains on) drafts every other stream together beside the first verify of
    each round, on llama.cpp's threads. Every request still gets its output alone, in any slots and order."""
    requests = [dict(prompt=p, sampling=GREEDY.sampling, drafting=drafting(k, 0.0, False), max_tokens=30)
                for p, k in zip(prompts(4, seed=5), (6, 3, 0, 4), strict=True)]
    expected = outputs_alone(tiny_pair, requests)
    with open_slots(tiny_pair, 4) as s:
        s.target.batches_sequences = False  # as the load probe decides for such a target
        s.engine.draft_ahead = True
        assert s.draft is not None and s.draft.batches_sequences
        assert run_together(s.engine, requests, arrivals=[0, 0, 1, 3]) == expected
        assert run_together(s.engine, requests[::-1], arrivals=[0, 2, 2, 2], slots=[3, 0, 2, 1]) == expected[::-1]
        assert s.engine._beside is not None and s.target.replans == 0
        assert all(s.target.device_sampler(seq) is None for seq in range(4))
        # A constrained request among them (its drafts masked by the drafter's copy of its grammar, drafted beside
        # another stream's verify) gets what it gets alone in the same engine.
        letters = 'root ::= [a-z]+ "."'
        constrained = dict(requests[1], max_tokens=20)
        s.engine.reset()
        alone = collect(s.engine.generate(**constrained, grammar=Grammar(s.target, letters, "letters"))).tokens
        streams = [s.engine.start(**r, slot=i) for i, r in enumerate(requests[2:])]
        streams.insert(1, s.engine.start(**constrained, slot=3, grammar=Grammar(s.target, letters, "letters")))
        got: list[int] = []
        while not all(x.finished for x in streams):
            s.engine.step([x for x in streams if not x.finished])
            for x in streams:
                events = list(x.events())
                if x is streams[1]:
                    got += [e.token for e in events if isinstance(e, TokenEvent)]
        assert got == alone and len(got) > 1


def test_a_long_prompt_goes_in_batch_by_batch_while_the_others_keep_generating(tiny_pair):
    """With `prefill_in_rounds` a joining request's prompt is decoded one n_batch a round: the running request
    emits tokens in the meantime, and both outputs are still what each gets alone."""
    short, long = prompts(1, seed=4)[0], prompts(1, seed=6, length=700)[0]
    requests = [dict(prompt=short, sampling=GREEDY.sampling, drafting=drafting(4, 0.0, False), max_tokens=40),
                dict(prompt=long, sampling=GREEDY.sampling, drafting=drafting(4, 0.0, False), max_tokens=20)]
    expected = outputs_alone(tiny_pair, requests, n_ctx=1024, n_batch=256)
    with open_slots(tiny_pair, 2, n_ctx=1024, n_batch=256) as s:
        first = s.engine.start(**requests[0], slot=0)
        s.engine.step([first])
        got = [[e.token for e in first.events() if isinstance(e, TokenEvent)], []]
        second = s.engine.start(**requests[1], slot=1, prefill_in_rounds=True)
        assert second.stats.prompt_tokens_processed == len(long) - 1 and second.prefill
        rounds_prefilling = 0
        while not (first.finished and second.finished):
            prefilling = bool(second.prefill)
            live = [x for x in (first, second) if not x.finished]
            s.engine.step(live)
            for i, stream in enumerate((first, second)):
                if stream in live:
                    tokens = [e.token for e in stream.events() if isinstance(e, TokenEvent)]
                    got[i] += tokens
                    if prefilling and i == 0 and tokens:
                        rounds_prefilling += 1
        assert got == expected
        assert rounds_prefilling >= 2  # 699 prompt tokens in batches of 256: two rounds before it joins
        assert second.stats.prefill_s > 0 and second.stats.decode_s > 0
