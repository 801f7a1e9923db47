"""The chained drafter's cost decisions through the real llama.cpp (tiny generated pairs): whether the draft model
extends lookup or sits out, greedy output is plain decoding's, token for token. The decodes' seconds come from a
fake clock (each decode advances it by what that machine would take), so both decisions are certain to run."""

from __future__ import annotations

import dataclasses

import pytest

from localspec.drafters.model import ModelCost
from localspec.rounds.events import collect
from localspec.rounds.policies import DraftCost, DraftLength
from tests.test_chain_cost import Clock
from tests.test_engine import GREEDY, open_pair, prompts

pytestmark = pytest.mark.slow


def timed(clock: Clock, model: object, base: float, per_token: float) -> None:
    """Make this model's decodes advance the fake clock (an instance attribute over the class's method)."""
    decode_many = model.decode_many  # type: ignore[attr-defined]

    def decode_many_timed(items):
        clock.now += base + per_token * sum(len(tokens) for _, tokens, _, _ in items)
        return decode_many(items)
    model.decode_many = decode_many_timed  # type: ignore[attr-defined]


# The CPU demo pair's step (a loss), a GPU-like one (pays); and that one with the model's rounds drafting ahead
# beside their verify (`ChainDrafter.draft_ahead`: draft-aheads kept and thrown through the real contexts).
@pytest.mark.parametrize(("draft_step", "ahead"), [(0.017, False), (0.0005, False), (0.0005, True)])
def test_chained_greedy_equals_plain_with_the_cost_decisions_active(tiny_pair, monkeypatch, draft_step: float,
                                                                    ahead: bool):
    clock = Clock().install(monkeypatch)
    chain = dataclasses.replace(GREEDY.draft, n_draft=6, drafter="chain", lookup_min=2)
    with open_pair(*tiny_pair) as s:
        timed(clock, s.target, 0.011, 0.006)
        assert s.draft is not None
        timed(clock, s.draft, draft_step, 0.0)
        decodes = {"n": 0}
        inner = s.draft.decode_many

        def counted(items):
            decodes["n"] += 1
            return inner(items)
        s.draft.decode_many = counted
        rounds = steps = made = 0
        s.engine.draft_ahead = ahead
        for i, head in enumerate(prompts(3, seed=13, length=10)):
            prompt = [*head, *head[:6], *head]  # lookup has matches to find; between them the model may draft
            s.engine.reset()
            plain = collect(s.engine.generate(prompt, GREEDY.sampling, dataclasses.replace(chain, n_draft=0), 40))
            s.engine.reset()
            before = decodes["n"]
            spec = collect(s.engine.generate(prompt, GREEDY.sampling, chain, 40))
            assert spec.tokens == plain.tokens, (draft_step, i)
            rounds += spec.stats.rounds
            made += spec.stats.ahead_made
            steps += decodes["n"] - before - 1  # its prompt was one decode
    assert (made > 0) is ahead
    if draft_step > 0.01:  # a loss: its warm-up, then probes at most (one per interval, or a generation's start)
        assert steps <= (DraftLength.WARMUP + rounds // DraftCost.PROBE_FIRST + 3) * ModelCost.PROBE
    else:  # drafting in (nearly) every round, several steps where lookup found nothing; but not in a request's
        # first WARMUP lookup rounds, whose whole matches are measured before judged (`DraftCost.begin_generation`)
        assert steps >= rounds - 3 * DraftLength.WARMUP
