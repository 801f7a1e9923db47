"""The speculative engine through the real llama.cpp, on tiny generated pairs and the PyPI-shipped models."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from localspec.config import Drafting, load_preset
from localspec.drafters.base import device_mode
from localspec.errors import ContextFullError, IncompatiblePairError, UsageError
from localspec.llama.model import LlamaModel
from localspec.rounds.events import STOP_CONTEXT_FULL, STOP_EOG, STOP_MAX_TOKENS, DoneEvent, TokenEvent
from localspec.rounds.sampling import candidates
from localspec.rounds.scores import DeviceDist
from localspec.sessions.session import ModelFiles, open_session
from tests.helpers_stats import chi_square

pytestmark = pytest.mark.slow

# One thread: a load skips the automatic choice's 0.2 s CPU sample, and two test workers never split a core.
# (drafts every round: these tests look at drafts; standing aside: tests/test_stand_aside.py)
GREEDY = load_preset("greedy").with_overrides(threads=1, stand_aside=False)


def drafting(k: int, adaptive: bool = False, p_min: float = 0.0) -> Drafting:
    return dataclasses.replace(GREEDY.draft, n_draft=k, p_min=p_min, adaptive=adaptive)


def run(engine, prompt, sampling, draft: Drafting, max_tokens: int):
    tokens, events, done = [], [], None
    for event in engine.generate(prompt, sampling, draft, max_tokens):
        if isinstance(event, TokenEvent):
            tokens.append(event.token)
            events.append(event)
        else:
            assert isinstance(event, DoneEvent)
            done = event
    return tokens, events, done


def open_pair(target, draft, preset=GREEDY, **load):
    if load:
        preset = preset.with_overrides(**load)
    return open_session(ModelFiles(target=target, draft=draft, name="test"), preset)


def prompts(n: int, seed: int = 7, length: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40_000, size=length).tolist() for _ in range(n)]


def test_one_token_and_batch_give_identical_logits(tiny_pair, use_demo_home):
    """Greedy losslessness rests on this: a verify batch must score a position exactly as plain decoding."""
    from localspec.models import demo

    for path in (tiny_pair[0], demo.target_path()):
        with LlamaModel(path, n_ctx=256, device_top_k=0) as model:
            prompt = model.tokenize("The quick brown fox jumps over the lazy dog because")
            n = len(prompt)
            model.decode(prompt[:-1], 0)
            follow = [prompt[-1], 11, 12, 13, 14, 15]
            single = [model.decode([tok], n - 1 + i, all_logits=True).logits[0].copy() for i, tok in enumerate(follow)]
            model.truncate(n - 1)
            batch = model.decode(follow, n - 1, all_logits=True).logits
            assert np.array_equal(np.stack(single), batch), path.name


@pytest.mark.parametrize("device_top_k", [0, 64])
def test_greedy_is_token_identical_to_plain_decoding(tiny_pair, device_top_k):
    with open_pair(*tiny_pair, device_top_k=device_top_k) as s:
        total_drafted = total_accepted = 0
        for prompt in prompts(8):
            plain, _, _ = run(s.engine, prompt, GREEDY.sampling, drafting(0), 40)
            for draft in (drafting(1), drafting(3), drafting(6), drafting(8, adaptive=True),
                          drafting(6, p_min=0.3)):
                spec, _, done = run(s.engine, prompt, GREEDY.sampling, draft, 40)
                assert spec == plain, (prompt, draft)
                total_drafted += done.stats.drafted
                total_accepted += done.stats.accepted
        # The pair must actually exercise both paths: rejections and acceptances.
        assert 0.2 < total_accepted / total_drafted < 0.98


def test_greedy_lossless_on_demo_pair(use_demo_home):
    from localspec.models import demo
    from localspec.sessions.bench import PROMPTS

    with open_pair(demo.target_path(), demo.draft_path()) as s:
        for _, text in PROMPTS:
            prompt = s.target.tokenize(text)
            plain, _, _ = run(s.engine, prompt, GREEDY.sampling, drafting(0), 48)
            spec, _, done = run(s.engine, prompt, GREEDY.sampling, drafting(6), 48)
            assert spec == plain
            assert done.stats.accepted > 0


@pytest.mark.parametrize(("temperature", "repeat_penalty"), [(0.0, 1.0), (0.9, 1.0), (0.9, 1.3)])
def test_kv_caches_consistent_after_rejections(tiny_pair, temperature, repeat_penalty):
    """Continuing after rounds with rejections must equal a fresh run on the same text (both caches rewound)."""
    preset = GREEDY.with_overrides(temperature=temperature, repeat_penalty=repeat_penalty, seed=3)
    with open_pair(*tiny_pair) as s:
        prompt = prompts(1, seed=11)[0]
        first, _, done = run(s.engine, prompt, preset.sampling, drafting(5), 30)
        assert done.stats.accepted < done.stats.drafted  # there were rejections
        cont_prompt = prompt + first
        continued, _, done2 = run(s.engine, cont_prompt, preset.sampling, drafting(5), 20)
        assert done2.stats.prompt_tokens_processed < len(first)  # the caches were reused, not rebuilt
        s.engine.reset()
        fresh, _, done3 = run(s.engine, cont_prompt, preset.sampling, drafting(5), 20)
        assert done3.stats.prompt_tokens_processed == len(cont_prompt) - 1
        assert continued == fresh


def test_greedy_with_penalties_is_lossless_and_applies_them(use_demo_home):
    """At temperature 0 the penalties pick the argmax of the penalised logits (llama.cpp's order), for the draft
    and the target alike, so speculation stays token-identical to an independent penalised greedy loop. The demo
    model repeats itself on this prompt, so the penalties must change its reply."""
    from localspec.models import demo
    from localspec.rounds.sampling import apply_penalties

    penalised = GREEDY.with_overrides(frequency_penalty=1.0, presence_penalty=0.5, repeat_penalty=1.1).sampling
    n = 32
    with open_pair(demo.target_path(), demo.draft_path()) as s:
        prompt = s.target.tokenize("The three primary colours are")
        spec, _, done = run(s.engine, prompt, penalised, drafting(6), n)
        plain, _, _ = run(s.engine, prompt, penalised, drafting(0), n)
        unpenalised, _, _ = run(s.engine, prompt, GREEDY.sampling, drafting(0), n)
        s.engine.reset()
        s.target.use_device_sampler(None)
        reference: list[int] = []
        logits = s.target.decode(prompt, 0).logits
        while len(reference) < n:
            token = int(np.argmax(apply_penalties(logits[0], prompt + reference, penalised)))
            if s.target.is_eog(token):
                break
            reference.append(token)
            logits = s.target.decode([token], len(prompt) + len(reference) - 1).logits
        s.engine.reset()
    assert spec == plain == reference
    assert done.stats.accepted > 0
    assert reference != unpenalised
    assert max(Counter(reference).values()) < max(Counter(unpenalised).values())


def test_all_accepted_rounds_keep_the_draft_in_step(tiny_pair_high):
    """Near-100% acceptance: the draft never saw the last drafted token and must catch up next round."""
    with open_pair(*tiny_pair_high) as s:
        for prompt in prompts(3, seed=5):
            plain, _, _ = run(s.engine, prompt, GREEDY.sampling, drafting(0), 50)
            spec, _, done = run(s.engine, prompt, GREEDY.sampling, drafting(4), 50)
            assert spec == plain
            assert done.stats.acceptance_rate > 0.9


def test_sampling_is_seeded_and_reproducible(tiny_pair):
    preset = GREEDY.with_overrides(temperature=0.8, top_k=20, top_p=0.95, seed=9)
    with open_pair(*tiny_pair) as s:
        prompt = prompts(1)[0]
        a, _, _ = run(s.engine, prompt, preset.sampling, drafting(4), 30)
        b, _, _ = run(s.engine, prompt, preset.sampling, drafting(4), 30)
        c, _, _ = run(s.engine, prompt, dataclasses.replace(preset.sampling, seed=10), drafting(4), 30)
    assert a == b
    assert a != c


@pytest.mark.parametrize("device_top_k", [0, 64])
def test_rejection_sampling_preserves_the_target_distribution(tiny_pair, device_top_k):
    """The first emitted token of a speculative round must follow the target's own distribution p exactly."""
    preset = GREEDY.with_overrides(temperature=1.5, top_k=6, top_p=1.0)
    with open_pair(*tiny_pair, device_top_k=device_top_k) as s:
        prompt = prompts(1, seed=21)[0]
        s.engine.reset()
        s.target.use_device_sampler(None)  # the reference p comes from the full logits
        logits = s.target.decode(prompt, 0).logits
        p = candidates(logits, preset.sampling)
        s.engine.reset()
        n = 1500
        firsts = Counter()
        accepted = 0
        for seed in range(n):
            sampling = dataclasses.replace(preset.sampling, seed=seed)
            tokens, _, done = run(s.engine, prompt, sampling, drafting(1), 2)
            firsts[tokens[0]] += 1
            accepted += done.stats.accepted
    assert 0 < accepted < n  # both branches (accept and resample) were taken
    p_first = dict(zip(p.ids[0].tolist(), p.probs[0].tolist(), strict=True))
    assert chi_square(firsts, p_first) < 20.5  # chi-square with 5 degrees of freedom at p = 0.001


@pytest.mark.parametrize("drafter", ["lookup", "chain"])
def test_lookup_and_chained_sampling_preserve_the_target_distribution(tiny_pair, drafter):
    """Prompt lookup proposes a point mass: the first emitted token must still follow p exactly. The prompt ends
    with an n-gram seen before, followed there by p's likeliest token, so lookup drafts a token that p often
    accepts and sometimes rejects."""
    preset = GREEDY.with_overrides(temperature=1.5, top_k=6, top_p=1.0)
    with open_pair(*tiny_pair, device_top_k=64) as s:
        head = prompts(1, seed=31, length=6)[0]
        likely = head[0]
        for _ in range(4):  # settle on the token p likes after a prompt that ends as it did before that token
            prompt = [*head, likely, *head]
            s.engine.reset()
            s.target.use_device_sampler(None)
            p = candidates(s.target.decode(prompt, 0).logits, preset.sampling)
            likely = int(p.ids[0][0])
        prompt = [*head, likely, *head]
        s.engine.reset()
        p = candidates(s.target.decode(prompt, 0).logits, preset.sampling)
        s.engine.reset()
        n = 1500
        firsts = Counter()
        accepted = drafted = 0
        for seed in range(n):
            sampling = dataclasses.replace(preset.sampling, seed=seed)
            for slot in s.engine.slots:  # a fresh cost model: lookup proposes before it measured (not by timing)
                slot.policies.clear()
            tokens, _, done = run(s.engine, prompt, sampling,
                                  dataclasses.replace(drafting(1), drafter=drafter, lookup_min=3), 2)
            firsts[tokens[0]] += 1
            accepted, drafted = accepted + done.stats.accepted, drafted + done.stats.drafted
    assert drafted >= n and 0 < accepted < drafted  # lookup drafted; both branches (accept, resample) taken
    p_first = dict(zip(p.ids[0].tolist(), p.probs[0].tolist(), strict=True))
    assert chi_square(firsts, p_first) < 20.5  # chi-square with 5 degrees of freedom at p = 0.001


def test_stops_exactly_at_max_tokens(tiny_pair):
    with open_pair(*tiny_pair) as s:
        prompt = prompts(1)[0]
        for k in (0, 3, 6):
            tokens, events, done = run(s.engine, prompt, GREEDY.sampling, drafting(k), 17)
            assert len(tokens) == 17 and done.stop_reason == STOP_MAX_TOKENS


def test_context_full_stops_cleanly(tiny_pair):
    with open_pair(*tiny_pair, n_ctx=64) as s:
        prompt = prompts(1, length=20)[0]
        plain, _, done_plain = run(s.engine, prompt, GREEDY.sampling, drafting(0), 500)
        spec, _, done_spec = run(s.engine, prompt, GREEDY.sampling, drafting(6), 500)
        assert done_plain.stop_reason == done_spec.stop_reason == STOP_CONTEXT_FULL
        assert "context full" in done_spec.message
        assert spec == plain
        n_ctx = s.engine.n_ctx  # what was asked for; llama.cpp pads its own context to 256, unused beyond 64
        assert n_ctx == 64
        assert len(plain) == n_ctx - len(prompt)  # prompt + reply fill the context, never one past (test_promises)
        too_long = n_ctx + 6
        with pytest.raises(ContextFullError, match=f"the prompt has {too_long} tokens; the context holds {n_ctx}"):
            run(s.engine, prompts(1, length=too_long)[0], GREEDY.sampling, drafting(6), 5)
        with pytest.raises(UsageError, match="the prompt must hold at least one token"):
            run(s.engine, [], GREEDY.sampling, drafting(6), 5)


def test_end_of_generation_stops_a_real_chat_reply(smollm2_path):
    """SmolLM2-Instruct drafting for itself: every draft is accepted, and <|im_end|> ends the reply."""
    with open_pair(smollm2_path, smollm2_path) as s:
        prompt = s.target.tokenize(
            "<|im_start|>user\nSay hello in three words.<|im_end|>\n<|im_start|>assistant\n", parse_special=True
        )
        plain, _, done_plain = run(s.engine, prompt, GREEDY.sampling, drafting(0), 200)
        spec, events, done = run(s.engine, prompt, GREEDY.sampling, drafting(6), 200)
    assert done.stop_reason == done_plain.stop_reason == STOP_EOG
    assert spec == plain and 0 < len(spec) < 200
    assert done.stats.acceptance_rate == 1.0
    assert any(e.from_draft for e in events)
    assert "im_end" not in "".join(e.text for e in events)


def test_stats_arithmetic(tiny_pair):
    with open_pair(*tiny_pair) as s:
        prompt = prompts(1, seed=3)[0]
        tokens, events, done = run(s.engine, prompt, GREEDY.sampling, drafting(4), 33)
        st = done.stats
        assert st.tokens == len(tokens) == 33
        assert st.prompt_tokens == len(prompt) and st.prompt_tokens_processed == len(prompt) - 1
        assert st.drafted == sum(st.draft_lengths) and len(st.draft_lengths) == st.rounds
        assert st.acceptance_rate == pytest.approx(st.accepted / st.drafted)
        assert st.mean_accepted == pytest.approx(st.accepted / st.rounds)
        assert sum(e.from_draft for e in events) == st.accepted - (st.accepted + st.rounds - st.tokens)
        assert st.decode_tps == pytest.approx(st.tokens / st.decode_s)
        assert st.host_s == pytest.approx(st.decode_s - st.draft_s - st.verify_s)
        assert st.draft_s > 0 and st.verify_s > 0
        # Same prompt again: the caches already hold it, nothing is re-read.
        _, _, again = run(s.engine, prompt, GREEDY.sampling, drafting(0), 5)
        assert again.stats.prompt_tokens_processed == 0
        assert again.stats.drafted == 0 and again.stats.rounds == 5


def test_incompatible_pair_is_refused(use_demo_home, smollm2_path):
    from localspec.models import demo

    with pytest.raises(IncompatiblePairError):
        open_pair(demo.target_path(), smollm2_path)


def test_greedy_draft_length_is_not_capped(tiny_pair_high):
    """No cap at T = 0: a wider verify batch is not less exact than a narrow one on a GPU (docs/gpu.md)."""
    with open_pair(*tiny_pair_high) as s:
        prompt = prompts(1)[0]
        plain, _, _ = run(s.engine, prompt, GREEDY.sampling, drafting(0), 40)
        spec, _, greedy = run(s.engine, prompt, GREEDY.sampling, drafting(12), 40)
    assert max(greedy.stats.draft_lengths) == 12
    assert spec == plain


def test_constant_width_pads_short_drafts_and_stays_exact(tiny_pair):
    """GPU mode (forced here): early stops below p_min and the last round are padded to the generation's width;
    the padding never changes what is emitted, on the CPU to the bit."""
    from localspec.rounds.engine import Engine

    with open_pair(*tiny_pair) as s:
        padded = Engine(s.target, s.draft, constant_width=True)
        widths = []
        real_decode_many = s.target.decode_many

        def spy(items):
            widths.extend(len(tokens) for _, tokens, _, all_logits in items if all_logits)
            return real_decode_many(items)

        s.target.decode_many = spy
        try:
            for prompt in prompts(3, seed=4):
                for sampling in (GREEDY.sampling, GREEDY.with_overrides(temperature=0.8, seed=5).sampling):
                    s.engine.reset()
                    widths.clear()
                    ref, _, done_ref = run(s.engine, prompt, sampling, drafting(5, p_min=0.4), 23)
                    # Without constant width a verify is exactly as wide as its drafts (no wasted positions).
                    assert widths == [d + 1 for d in done_ref.stats.draft_lengths]
                    widths.clear()
                    out, _, done = run(padded, prompt, sampling, drafting(5, p_min=0.4), 23)
                    assert out == ref
                    assert set(widths) == {6}, widths
                    assert min(done.stats.draft_lengths) < 5  # some drafts really were short
                    padded.reset()
        finally:
            del s.target.decode_many


def test_trace_reports_each_tokens_row_argmax_and_margin(tiny_pair):
    """At T = 0 every emitted token is its verify row's argmax; the trace reads it from the row, with the margin."""
    with open_pair(*tiny_pair) as s:
        prompt = prompts(1, seed=8)[0]
        plain, _, _ = run(s.engine, prompt, GREEDY.sampling, drafting(0), 30)
        s.engine.reset()
        s.target.use_device_sampler(None)
        full = s.target.decode(prompt + plain[:-1], 0, all_logits=True).logits[len(prompt) - 1 :].copy()
        s.engine.reset()
        for k in (0, 4):
            events = []
            for event in s.engine.generate(prompt, GREEDY.sampling, drafting(k), 30, trace=True):
                if isinstance(event, TokenEvent):
                    events.append(event)
            assert [e.token for e in events] == plain
            assert all(e.row_argmax == e.token for e in events)
            ordered = np.sort(full, axis=1)
            assert np.allclose([e.margin for e in events], ordered[:, -1] - ordered[:, -2])
        sampled = GREEDY.with_overrides(temperature=0.7).sampling
        _, events, _ = run(s.engine, prompt, sampled, drafting(4), 10)
        assert all(e.margin is None and e.row_argmax is None for e in events)


def test_plain_sampling_on_the_device_follows_the_target_distribution(smollm2_path):
    """k = 0 at T > 0 draws on the device (DeviceDist). Each token's randomized PIT value under the host
    pipeline's distribution p (from full logits of the same sequence) must be uniform: a wrong pipeline, or one
    uniform number reused for every draw, fails this."""
    preset = GREEDY.with_overrides(temperature=0.9, top_k=40, top_p=0.95, seed=13)
    with open_pair(smollm2_path, None, n_draft=0) as s:  # (no draft model: plain decoding, asked for)
        prompt = s.target.tokenize("Once upon a time, in a small village by the sea,")
        assert _device_scores(s, prompt, preset).drawn is not None
        s.engine.reset()
        tokens, _, _ = run(s.engine, prompt, preset.sampling, drafting(0), 400)
        s.engine.reset()
        s.target.use_device_sampler(None)
        logits = s.target.decode(prompt + tokens[:-1], 0, all_logits=True).logits[len(prompt) - 1 :]
        p = candidates(np.array(logits), preset.sampling)
    rng = np.random.default_rng(0)
    pit = []
    for row, token in enumerate(tokens):
        ids, probs = p.ids[row], p.probs[row]
        hit = np.flatnonzero(ids == token)
        assert hit.size, f"token {row} ({token}) is outside the pipeline's support"
        below = probs[: hit[0]].sum()  # candidates are sorted by probability: a fixed order per row
        pit.append(below + rng.random() * probs[hit[0]])
    pit = np.sort(np.array(pit))
    ks = np.max(np.abs(pit - np.arange(1, len(pit) + 1) / len(pit)))
    assert ks < 1.63 / np.sqrt(len(pit))  # Kolmogorov-Smirnov at p = 0.01
    assert len(set(tokens)) > 40  # really sampled, not a near-greedy walk


def _device_scores(s, prompt, preset):
    s.engine.reset()
    s.target.use_device_sampler(device_mode(s.target, preset.sampling, 0.0, plain=True))
    return s.target.decode(prompt, 0)


@pytest.mark.parametrize("n_seq", [1, 3])
def test_a_verifys_device_candidates_are_each_rows_top_k(tiny_pair, n_seq):
    """A verify's rows of device candidates (read as one strided copy) hold each row's top 64 with its logits, as
    the same tokens' full logits say, alone and beside other sequences' rows in one decode."""
    k = 64
    with LlamaModel(tiny_pair[0], n_ctx=256, device_top_k=k, n_seq=n_seq) as model:
        batches = [(seq, prompts(1, seed=50 + seq, length=9 - seq)[0]) for seq in range(n_seq)]
        for seq, _ in batches:
            assert model.use_device_sampler("top_k", seq)
        got = model.decode_many([(seq, tokens, 0, True) for seq, tokens in batches])
        for seq, _ in batches:
            model.use_device_sampler(None, seq)
            model.clear(seq)
        full = [model.decode(tokens, 0, all_logits=True, seq=seq).logits.copy() for seq, tokens in batches]
    for (seq, tokens), scores, logits in zip(batches, got, full, strict=True):
        assert scores is not None and scores.ids.shape == (len(tokens), k)
        for row in range(len(tokens)):
            order = np.argsort(scores.ids[row])
            top = np.sort(np.argpartition(-logits[row], k)[:k])
            assert np.array_equal(scores.ids[row][order], top), (seq, row)
            assert np.array_equal(scores.logits[row][order], logits[row][top]), (seq, row)


def test_device_sampler_modes(tiny_pair):
    """Greedy asks the device for the argmax only; a covered top-k pipeline for candidates; else full logits."""

    with open_pair(*tiny_pair, device_top_k=64) as s:
        t = s.target
        # A CPU-only llama.cpp (with the RPC backend, which makes llama_supports_gpu_offload() true): no GPU, so
        # exact greedy and no padded verify batches.
        assert not t.on_gpu and not s.engine.constant_width
        base = GREEDY.sampling
        assert device_mode(t, base, p_min=0.0) == "greedy"
        assert device_mode(t, base, p_min=0.5) == "top_k"  # p_min needs probabilities
        hot = dataclasses.replace(base, temperature=0.7, top_k=40)
        assert device_mode(t, hot, 0.0) == "top_k"
        assert device_mode(t, dataclasses.replace(hot, top_k=100), 0.0) is None  # more than the device keeps
        assert device_mode(t, dataclasses.replace(hot, top_k=0), 0.0) is None
        assert device_mode(t, dataclasses.replace(hot, repeat_penalty=1.1), 0.0) is None
        assert device_mode(t, base, 0.0, trace=True) == "top_k"  # the trace needs the runner-up's logit
        plain = device_mode(t, dataclasses.replace(hot, top_k=0), 0.0, plain=True)
        assert plain == DeviceDist(top_k=0, top_p=base.top_p, min_p=base.min_p, temperature=0.7, seed=base.seed)
        assert device_mode(t, dataclasses.replace(hot, repeat_penalty=1.1), 0.0, plain=True) is None
        # A grammar reads full rows by default; with "device" rows it masks candidates: never the device's own
        # choice or draw; every logit where top_k = 0 or a penalty needs them.
        for sampling, plain in ((base, False), (hot, True), (hot, False)):
            assert device_mode(t, sampling, 0.0, plain=plain, grammar_rows="full") is None
        assert device_mode(t, base, 0.0, grammar_rows="device") == "top_k"
        assert device_mode(t, hot, 0.0, plain=True, grammar_rows="device") == "top_k"
        assert device_mode(t, dataclasses.replace(hot, top_k=0), 0.0, plain=True, grammar_rows="device") is None
        assert device_mode(t, dataclasses.replace(base, repeat_penalty=1.1), 0.0, grammar_rows="device") is None

        prompt = prompts(1)[0]
        t.use_device_sampler(None)
        full = t.decode(prompt, 0, all_logits=True).logits.copy()
        for mode, width in (("greedy", 1), ("top_k", 64)):
            t.clear()
            assert t.use_device_sampler(mode)
            scores = t.decode(prompt, 0, all_logits=True)
            assert scores.ids is not None and scores.ids.shape == (len(prompt), width)
            assert scores.argmax().tolist() == full.argmax(axis=1).tolist()
        assert set(scores.ids[-1].tolist()) == set(np.argsort(-full[-1])[:64].tolist())


def test_adaptive_drafting_keeps_what_it_measured_across_generations(tiny_pair):
    """Adaptive drafting's chooser survives to the next prompt (no new probing); a fixed length starts fresh."""
    with open_pair(*tiny_pair) as s:
        adaptive, fixed = drafting(6, adaptive=True), drafting(6)
        slot, model = s.engine.slots[0], s.engine.drafters["model"]
        first = s.engine._draft_length(adaptive, GREEDY.sampling, slot, model)
        assert first.adaptive and s.engine._draft_length(adaptive, GREEDY.sampling, slot, model) is first
        assert s.engine._draft_length(drafting(5, adaptive=True), GREEDY.sampling, slot, model) is not first
        assert (s.engine._draft_length(fixed, GREEDY.sampling, slot, model)
                is not s.engine._draft_length(fixed, GREEDY.sampling, slot, model))
        run(s.engine, prompts(1)[0], GREEDY.sampling, adaptive, 20)
        assert s.engine._draft_length(adaptive, GREEDY.sampling, slot, model).rounds > 0


def test_a_constrained_round_counts_an_accepted_draft_on_a_row_decoded_again(tiny_pair, monkeypatch):
    """With `constrained_rows = "device"` a row whose device candidates hold no legal token is decoded again in full
    and ends the round with its token; where that token is the draft's, it is an accepted draft: counted in the
    stats and flagged `from_draft` (the round then emits no token of the target's own). Each round's verdict, read
    at `_rewind`, against its proposal: the drafts it calls accepted are the proposal's, and the next emitted one
    (if any) is the target's correction, never the draft itself; the events' flags follow the verdicts."""
    from localspec.rounds.constraints import Constraint
    from localspec.rounds.engine import Engine

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    rounds: list[tuple[list[int], list[int], int]] = []
    rewind = Engine._rewind

    def spy(self, s, proposal, verdict):
        rounds.append((list(proposal.tokens), list(verdict.emitted), verdict.accepted))
        return rewind(self, s, proposal, verdict)

    monkeypatch.setattr(Engine, "_rewind", spy)
    with open_pair(*tiny_pair, constrained_rows="device") as s:
        totals = [0, 0]
        for seed, k in ((1, 4), (2, 1), (3, 6), (4, 3)):
            prompt = np.random.default_rng(seed).integers(100, 40_000, size=12).tolist()
            rounds.clear()
            grammar = Constraint.json_schema(schema, "schema").grammar(s.target)
            events = list(s.engine.generate(prompt, GREEDY.sampling, drafting(k), 40, grammar=grammar))
            done = events[-1]
            assert isinstance(done, DoneEvent)
            for drafts, emitted, accepted in rounds:
                assert emitted[:accepted] == drafts[:accepted]
                if accepted < min(len(drafts), len(emitted)):
                    assert emitted[accepted] != drafts[accepted], (drafts, emitted, accepted)
            flagged = [e.from_draft for e in events if isinstance(e, TokenEvent)]
            assert flagged == [i < a for _, em, a in rounds for i in range(len(em))][: len(flagged)]
            totals[0] += done.stats.full_rows
            totals[1] += sum(1 for d, em, a in rounds if a == len(em) and em)
        assert totals[0] > 0 and totals[1] > 0  # rows decoded again, and rounds that ended on an accepted draft
