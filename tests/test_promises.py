"""What the engine promises every caller (CLI and server alike), over the scripted fake of tests/helpers_fake.py
(no llama.cpp model): a drafter the models cannot run is an error, never plain decoding in its place, and an
incompatible pair exits 2 like any error; prompt + reply fill the context and never pass it; logprobs are those of
the row each token was chosen from. The server's side of each is in test_serve_fast.py; the real models' in
test_serve.py (logprobs against a second context), test_serve_guard.py (the context) and below (exit codes)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from localspec import drafters
from localspec.config import load_preset
from localspec.errors import UsageError
from localspec.rounds.engine import Engine
from localspec.rounds.events import STOP_CONTEXT_FULL, collect
from tests.helpers_fake import FakeModel
from tests.helpers_vocab import write_vocab

GREEDY = load_preset("greedy")


def drafting(n: int = 6, drafter: str = "model"):
    return dataclasses.replace(GREEDY.draft, n_draft=n, drafter=drafter)


# -- no drafter falls back silently --------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["model", "chain"])
def test_a_drafter_the_models_cannot_run_is_an_error_naming_those_they_can(drafter: str) -> None:
    """Before: without a draft model, `model` decoded plainly and `chain` ran lookup alone, both in silence."""
    engine = Engine(FakeModel(seed=3), None)
    with pytest.raises(UsageError) as info:
        engine.start([1, 2, 3], GREEDY.sampling, drafting(drafter=drafter), 8)
    message = str(info.value)
    assert f"drafter {drafter!r} cannot run with these models (no draft model is loaded)" in message
    assert "they can run: lookup" in message
    assert not any(slot.busy for slot in engine.slots)
    engine.start([1, 2, 3], GREEDY.sampling, drafting(n=0, drafter=drafter), 8)  # plain decoding, as asked


def test_the_available_drafters_are_the_registrys() -> None:
    """A drafter added to the registry is available (and named in the errors) with no other edit."""
    target, draft = FakeModel(seed=3), FakeModel(seed=3, noise=1.0)
    target.mtp_layers = 1  # type: ignore[attr-defined]  # (the MTP drafter makes its head when it first drafts)
    block = {"dflash", "dspark", "eagle3"}  # (they need a block drafter's or an EAGLE-3 GGUF as the draft)
    assert list(drafters.build(target, draft)) == [name for name in drafters.REGISTRY if name not in block]
    # the chain without its model: lookup alone
    assert list(drafters.build(target, None)) == ["lookup", "suffix", "mtp", "chain-mtp"]


def _main(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", [["generate", "hi"], *(pytest.param(c, marks=pytest.mark.slow)
                                                            for c in (["serve", "--port", "0"], ["bench"]))])
def test_an_incompatible_pair_is_an_error_like_any_other_exit_2(command: list[str], tmp_path: Path) -> None:
    """Before: exit 1, where every other error exits 2 (as the README says). `localspec check`'s verdict
    "incompatible" is an answer, not an error: it keeps exit 1."""
    target = write_vocab(tmp_path / "target.gguf", model="llama")
    draft = write_vocab(tmp_path / "draft.gguf")
    done = _main(*command, "--target", str(target), "--draft", str(draft))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("localspec: error: ") and "tokenizer models differ" in done.stderr
    assert done.stderr.count("\n") == 1
    assert _main("check", str(target), str(draft)).returncode == 1


@pytest.mark.slow
def test_generate_with_a_drafter_the_models_cannot_run_exits_2(demo_home: Path) -> None:
    """The real entry point, the real model: `--drafter model` with no draft model is refused once loaded."""
    import os

    from localspec.models import demo

    target = demo_home / "cache" / "demo" / demo.TARGET_FILE
    env = {**os.environ, "LOCALSPEC_HOME": str(demo_home)}
    done = subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", "generate", "hi",
                           "--target", str(target), "--drafter", "model", "--threads", "1", "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr
    assert "drafter 'model' cannot run with these models (no draft model is loaded); they can run: lookup" \
        in done.stderr and done.stdout == ""


# -- never past the context ----------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["model", "lookup", "chain", None])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prompt_and_reply_fill_the_context_and_never_pass_it(drafter: str | None, temperature: float) -> None:
    """Before: a reply that filled the context ended one token past it (`--ctx 512`: prompt 386 + completion 127
    = 513): the last round could emit a token whose cell the context did not have."""
    sampling = dataclasses.replace(GREEDY.sampling, temperature=temperature, top_k=0, top_p=1.0)
    for n_ctx in (24, 31):
        for prompt_len in (1, 5, n_ctx - 8, n_ctx - 1, n_ctx):
            for k in (1, 3, 7):
                target, draft = FakeModel(seed=3, n_ctx=n_ctx), FakeModel(seed=3, noise=0.5, n_ctx=n_ctx)
                engine = Engine(target, draft)
                prompt = ([1, 2, 3, 4] * n_ctx)[:prompt_len]  # repeats: lookup has matches
                settings = drafting(k if drafter else 0, drafter or "model")
                gen = collect(engine.generate(prompt, sampling, settings, 10_000))
                total = prompt_len + len(gen.tokens)
                assert total == n_ctx, (n_ctx, prompt_len, k, drafter, total)  # full, and not one past
                assert gen.done.stop_reason == STOP_CONTEXT_FULL


# -- logprobs: the distribution each token was chosen from -----------------------------------------------------


def reference_logprobs(model: FakeModel, context: list[int], sampling) -> np.ndarray:
    """The target's row after `context`, penalised as llama.cpp's penalties read (written out here, not the
    engine's code), as log-probabilities at temperature 1."""
    logits = model.logits_after(context).astype(np.float64)
    window = context[-sampling.repeat_last_n :]
    for token in set(window):
        value = logits[token]
        value = value / sampling.repeat_penalty if value > 0 else value * sampling.repeat_penalty
        logits[token] = value - window.count(token) * sampling.frequency_penalty - sampling.presence_penalty
    return logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))


@pytest.mark.parametrize("drafter", ["model", "lookup", None])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_distribution_each_token_was_chosen_from(drafter: str | None, temperature: float) -> None:
    """Before: logprobs came from the raw row while a penalised row chose the token, so at temperature 0 the
    chosen token could rank below its own alternatives (demo-chat, "Say a colour.": -2.815 chosen, -2.527 top).
    Checked with and without drafting against each position's row computed straight from the fake's table."""
    sampling = dataclasses.replace(GREEDY.sampling, temperature=temperature, top_k=5, top_p=0.9,
                                   repeat_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.2, seed=11)
    for seed in range(3):
        target = FakeModel(vocab=16, seed=seed)
        engine = Engine(target, FakeModel(vocab=16, seed=seed, noise=0.7))
        prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
        settings = drafting(4 if drafter else 0, drafter or "model")
        events = [e for e in engine.generate(prompt, sampling, settings, 30, logprobs=3) if hasattr(e, "token")]
        assert len(events) == 30 and (drafter != "model" or any(e.from_draft for e in events))
        context = list(prompt)
        for event in events:
            ref = reference_logprobs(target, context, sampling)
            assert event.logprob == pytest.approx(ref[event.token], abs=1e-5)
            best = np.argsort(-ref, kind="stable")[:3]
            assert [t for t, _ in event.top_logprobs] == best.tolist()
            assert [lp for _, lp in event.top_logprobs] == pytest.approx(ref[best].tolist(), abs=1e-5)
            if temperature == 0:
                assert event.top_logprobs[0][0] == event.token  # the greedy token is the first alternative
            context.append(event.token)


def test_logprob_alternatives_break_ties_as_the_greedy_choice_and_leave_out_masked_tokens() -> None:
    from localspec.rounds.sampling import token_logprobs

    row = np.array([1.0, 3.0, 3.0, -np.inf, 3.0, 0.5], dtype=np.float32)
    for _ in range(20):  # (argpartition's pick among ties is arbitrary)
        chosen, top = token_logprobs(row, int(np.argmax(row)), 2)
        assert [t for t, _ in top] == [1, 2] and top[0][1] == chosen
    _, every = token_logprobs(row, 1, 6)
    assert [t for t, _ in every] == [1, 2, 4, 0, 5]  # a token the grammar forbids is no alternative (nor -inf)


def test_chat_refuses_a_preset_whose_drafter_the_models_cannot_run() -> None:
    """Before: `/preset default` in a chat without a draft model went on, decoding plainly."""
    from localspec.sessions.chat import ChatSession
    from tests.helpers_serve import FakeTextModel

    target = FakeTextModel(seed=3)
    chat = ChatSession(Engine(target, None), target, GREEDY.with_overrides(drafter="lookup"))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="drafter 'model' cannot run with these models"):
        chat.set_preset("default")  # it drafts with the draft model
    assert chat.preset.draft.drafter == "lookup"


class NoRepeatGrammar:
    """A toy grammar over the fake's vocabulary: a token may not follow itself, nor be token 0 (the engine's
    grammar surface: clone, legal, legal_everywhere, accept, close)."""

    source = "no-repeat"
    n_vocab = 16  # the test's FakeModel(vocab=16)

    def __init__(self, last: int = -1) -> None:
        self.last = last

    def clone(self) -> NoRepeatGrammar:
        return NoRepeatGrammar(self.last)

    def legal(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids).ravel()
        return (ids != self.last) & (ids != 0)

    def legal_everywhere(self) -> np.ndarray:
        return self.legal(np.arange(self.n_vocab))

    def accept(self, token: int) -> None:
        self.last = token

    def close(self) -> None:
        pass


@pytest.mark.parametrize("drafter", ["model", None])
def test_with_a_grammar_logprobs_are_over_the_tokens_it_allows(drafter: str | None) -> None:
    """The row a constrained token was chosen from is the masked one: its logprob and alternatives are over the
    legal tokens only (a forbidden token is no alternative), and a greedy token is the first of them."""
    sampling = dataclasses.replace(GREEDY.sampling, repeat_penalty=1.3)
    target = FakeModel(vocab=16, seed=4)
    engine = Engine(target, FakeModel(vocab=16, seed=4, noise=0.7))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    settings = drafting(4 if drafter else 0, drafter or "model")
    events = [e for e in engine.generate(prompt, sampling, settings, 20, grammar=NoRepeatGrammar(prompt[-1]),
                                         logprobs=16) if hasattr(e, "token")]
    context = list(prompt)
    for event in events:
        ref = reference_logprobs(target, context, sampling)
        ref[[0, context[-1]]] = -np.inf  # what the grammar forbids here
        ref -= np.log(np.exp(ref[np.isfinite(ref)]).sum())
        assert event.token == int(np.argmax(ref)) == event.top_logprobs[0][0]
        assert event.logprob == pytest.approx(ref[event.token], abs=1e-5)
        assert [t for t, _ in event.top_logprobs] == np.argsort(-ref, kind="stable")[:14].tolist()  # 14 legal
        context.append(event.token)
