"""Prompt lookup across the requests of one slot through the real llama.cpp (SmolLM2-135M-Instruct, the demo-chat
pair's target, alone): a request's lookup acceptance is its own text's. The decodes' seconds come from a fake clock
(the CPU demo pair's verify seconds by width), so the cost rule's decisions are the same on any machine; greedy output
is plain decoding's, token for token."""

from __future__ import annotations

import dataclasses

import pytest
from helpers_fake import Clock
from test_chain_cost import CPU_VERIFY

from localspec.config import Drafting, load_preset
from localspec.rounds.events import Generation, collect
from localspec.sessions import bench
from localspec.sessions.session import ModelFiles, Session, open_session

pytestmark = pytest.mark.slow

TOKENS = 64


def charged(clock: Clock, session: Session) -> Session:
    """The target's decodes advance the fake clock by the CPU demo pair's verify seconds at their width."""
    decode_many = session.target.decode_many

    def timed(items):
        width = sum(len(tokens) for _, tokens, _, _ in items)
        clock.now += CPU_VERIFY.get(width, width * CPU_VERIFY[8] / 8)
        return decode_many(items)
    session.target.decode_many = timed  # type: ignore[method-assign]
    return session


def test_a_reply_that_copies_its_prompt_drafts_after_one_whose_matches_were_wrong(monkeypatch) -> None:
    """One slot runs a story (lookup's matches in it all wrong) and then a code edit whose reply copies its prompt:
    the code edit drafts from lookup as it does as a fresh engine's first request. On the old code the story's
    rejections, kept with the slot's cost model, cut the code edit's matches to nothing (2 tokens drafted in 64
    against 51 alone), as the CPU demo pair's code edit at T = 0.7 drafted 5 tokens in 395 rounds after a reply
    whose matches were wrong (docs/lab/2026-12-07-cpu-seeds-probes.md)."""
    from localspec.models.demo import smollm2_source_path

    clock = Clock().install(monkeypatch)
    # Bigrams count as matches: the story's reply repeats some of its prompt's, each followed by other words.
    preset = load_preset("greedy").with_overrides(n_ctx=1024, threads=1, drafter="lookup", n_draft=6, lookup_min=2)
    lookup, plain = preset.draft, dataclasses.replace(preset.draft, n_draft=0)
    files = ModelFiles(target=smollm2_source_path(), draft=None, name="smollm2")
    texts = {**dict(bench.PROMPTS), **dict(bench.LOOKUP_PROMPTS)}

    def chosen(s: Session) -> dict[str, list[int]]:
        return dict(bench.tokenize_prompts(s, [bench.BenchPrompt(n, text=texts[n]) for n in ("prose", "code-edit")]))

    def run(s: Session, name: str, drafting: Drafting = lookup) -> Generation:
        return collect(s.engine.generate(prompts[name], preset.sampling, drafting, TOKENS))

    # (Each checked against plain decoding from the same cells: a prompt decoded after another request's reuses the
    # cells of their common beginning, and SmolLM2's logits there need not match a whole prompt's bit for bit.)
    with charged(clock, open_session(files, preset)) as s:
        prompts = chosen(s)
        story, after = run(s, "prose"), run(s, "code-edit")
        s.engine.reset()
        assert story.tokens == run(s, "prose", plain).tokens and after.tokens == run(s, "code-edit", plain).tokens
    with charged(clock, open_session(files, preset)) as s:
        alone = run(s, "code-edit")  # a fresh engine's first request
        s.engine.reset()
        assert alone.tokens == run(s, "code-edit", plain).tokens
    assert story.stats.drafted >= 6 and story.stats.accepted <= story.stats.drafted // 4  # (the premise: wrong)
    assert alone.stats.drafted >= 20 and alone.stats.accepted >= 10  # (the premise: the code edit copies)
    assert after.stats.drafted >= 0.8 * alone.stats.drafted, (after.stats.drafted, alone.stats.drafted)
    assert after.stats.draft_lengths[:4] == alone.stats.draft_lengths[:4]  # its early rounds draft as a fresh one's
