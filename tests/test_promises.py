"""What the engine promises every caller (CLI and server alike), over the scripted fake of tests/helpers_fake.py
(no llama.cpp model): a drafter the models cannot run is an error, never plain decoding in its place; ... (the
server's side of each promise is in test_serve_fast.py, the real models' in the slow files named there)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from localspec import drafters
from localspec.config import load_preset
from localspec.engine import STOP_CONTEXT_FULL, Engine, collect
from localspec.errors import UsageError
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
    assert list(drafters.build(target, draft)) == list(drafters.REGISTRY)
    assert list(drafters.build(target, None)) == ["lookup"]  # the chain without its model would be lookup alone


def _main(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve", "--port", "0"], ["bench"]])
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

    from localspec import demo

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
