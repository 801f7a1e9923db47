"""The bench's greedy verdict: exact identity on a CPU; off it, every emitted token against the target alone decoding
its prefix one token at a time, where only a near-tie may differ. The verdict's rules with made-up figures, then the
GPU's check run for real on a tiny pair on the CPU: it passes a correct run and a near-tie flip, and fails (✗, exit
1) a token the target alone would not have chosen."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from localspec.config import load_preset
from localspec.rounds.engine import Engine
from localspec.rounds.events import TokenEvent
from localspec.sessions import bench
from localspec.sessions.bench import Divergence, GreedyCheck, PromptCheck

NEAR_TIE = 1.0


def prompt(name: str, first: int | None = None, divergences: tuple[Divergence, ...] = ()) -> PromptCheck:
    return PromptCheck(name=name, tokens=20, first_divergence=first, plain_margin=None if first is None else 0.01,
                       spec_margin=None, redecoded=0 if first is None else 20 - first, divergences=list(divergences),
                       plain_tokens=[], plain_text="", plain_token_ends=[], plain_margins=[])


def divergence(position: int, margin: float, runner_up: bool = True) -> Divergence:
    return Divergence(position=position, emitted=5, single=6, margin=margin, runner_up=runner_up)


def test_cpu_needs_identical_output():
    assert GreedyCheck(exact=True, prompts=[prompt("a"), prompt("b")], near_tie=NEAR_TIE).passed
    failed = GreedyCheck(exact=True, prompts=[prompt("a"), prompt("b", first=7)], near_tie=NEAR_TIE)
    assert not failed.passed
    assert failed.describe() == "diverged from plain decoding on 1 of 2 prompts: 'b' at token 7 (top-2 margin 0.010)"


def test_gpu_fails_only_a_divergence_from_single_token_decoding_that_is_no_near_tie():
    # Leaving plain decoding's text at a near-tie is what a GPU's kernels do: reported, passed.
    tie = GreedyCheck(exact=False, prompts=[prompt("a", first=3, divergences=(divergence(3, 0.4),)), prompt("b")],
                      near_tie=NEAR_TIE)
    assert tie.passed and len(tie.diverged) == 1 and not tie.broken
    assert tie.as_dict()["diverged"] == 1 and tie.as_dict()["passed"] and tie.as_dict()["broken"] == 0
    assert tie.describe_single() == ("1 of 40 speculative tokens are the single-token runner-up at a near-tie "
                                     "(within 1 logits): 'a' at token 3 (margin 0.400)")
    # A wide margin, or a token that was not even the runner-up, is not kernel noise: the promise broke.
    for bad in (divergence(9, 1.5), divergence(9, 0.2, runner_up=False)):
        broken = GreedyCheck(exact=False, prompts=[prompt("a", first=3, divergences=(divergence(3, 0.4), bad))],
                             near_tie=NEAR_TIE)
        assert not broken.passed and broken.broken == [("a", bad)] and not broken.as_dict()["invariant_holds"]
        assert broken.describe_single().startswith("1 of 20 speculative tokens are not the target's single-token")
    clean = GreedyCheck(exact=False, prompts=[prompt("a")], near_tie=NEAR_TIE)
    assert clean.passed and clean.describe_single() == (
        "every one of 20 speculative tokens is the target's single-token argmax")


# -- the GPU's check on a real tiny pair, run on the CPU -------------------------------------------------------

Choose = Callable[[list[tuple[int, float]]], int]  # the top candidates (best first) -> the token to emit instead


def flipped_at(position: int, choose: Choose, real: Callable[..., Iterator]) -> Callable[..., Iterator]:
    """Engine.generate whose traced speculative runs (the greedy check's) emit `choose`'s token at `position`
    instead of the target's and then go on as speculative decoding of that prefix does: a verify batch that picked
    another token there, as a GPU's may at a near-tie."""

    def generate(engine: Engine, prompt, sampling, drafting, max_tokens, *args, **kwargs) -> Iterator:
        if drafting.n_draft == 0 or not kwargs.get("trace"):
            yield from real(engine, prompt, sampling, drafting, max_tokens, *args, **kwargs)
            return
        head = [e.token for e in real(engine, prompt, sampling, drafting, position, *args, **kwargs)
                if isinstance(e, TokenEvent)]
        assert len(head) == position
        alone = [e for e in real(engine, [*prompt, *head], sampling, dataclasses.replace(drafting, n_draft=0), 1,
                                 logprobs=8) if isinstance(e, TokenEvent)][0]
        assert alone.top_logprobs is not None
        token = choose(list(alone.top_logprobs))
        for t in head:
            yield TokenEvent(t, "", False, t, 1.0)
        yield TokenEvent(token, "", False, token, 0.0)
        yield from real(engine, [*prompt, *head, token], sampling, drafting, max_tokens - position - 1, *args,
                        **kwargs)

    return generate


def runner_up(top: list[tuple[int, float]]) -> int:
    return top[1][0]


def far_down(top: list[tuple[int, float]]) -> int:
    return top[-1][0]  # the 8th most likely: neither the choice nor the runner-up


@pytest.fixture(scope="module")
def tiny_session(tiny_pair) -> Iterator:
    from localspec.sessions.session import ModelFiles, open_session

    target, draft = tiny_pair
    preset = load_preset("greedy").with_overrides(n_ctx=256, threads=1, n_draft=4)
    with open_session(ModelFiles(target=target, draft=draft, name="tiny"), preset) as session:
        yield session


@pytest.mark.slow
def test_the_gpu_check_passes_a_correct_run_and_a_near_tie_and_fails_a_wrong_token(tiny_session, monkeypatch):
    session = tiny_session
    preset = load_preset("greedy").with_overrides(n_ctx=256, threads=1, n_draft=4, prefer="bench", max_tokens=24)
    prompts = bench.tokenize_prompts(session, raw=True)[:2]
    real = Engine.generate

    honest = bench.greedy_check(session, prompts, preset, 24, exact=False)
    assert honest.passed and not honest.diverged and all(p.divergences == [] for p in honest.prompts)
    plain = honest.prompts[0]
    # The near-tie: where plain decoding's top two lie closest, the speculative run takes the runner-up.
    at = min(range(4, 20), key=lambda i: plain.plain_margins[i])
    near_tie = plain.plain_margins[at] + 1e-3
    monkeypatch.setattr(Engine, "generate", flipped_at(at, runner_up, real))
    tie = bench.greedy_check(session, prompts[:1], preset.with_overrides(near_tie=near_tie), 24, exact=False)
    (check,) = tie.prompts
    assert check.first_divergence == at and check.redecoded == check.tokens - at
    assert [(d.position, d.runner_up) for d in check.divergences] == [(at, True)]
    assert check.divergences[0].margin == pytest.approx(plain.plain_margins[at], abs=1e-4)
    assert tie.passed
    # Narrower than that margin, the same flip is no longer a near-tie.
    assert not bench.greedy_check(session, prompts[:1], preset.with_overrides(near_tie=near_tie / 2), 24,
                                  exact=False).passed
    # A token the target alone ranks far down is reported, whatever the threshold.
    monkeypatch.setattr(Engine, "generate", flipped_at(6, far_down, real))
    wrong = bench.greedy_check(session, prompts[:1], preset.with_overrides(near_tie=1000.0), 24, exact=False)
    assert not wrong.passed
    assert [(name, d.position, d.runner_up) for name, d in wrong.broken] == [(prompts[0][0], 6, False)]


@pytest.mark.slow
def test_bench_exits_1_when_a_gpu_check_finds_a_wrong_token(tiny_pair: tuple[Path, Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole command: bench's GPU check (forced here on the CPU) prints ✗ and exits 1 on a corrupted token,
    and passes (exit 0) on the same run uncorrupted."""
    from typer.testing import CliRunner

    from localspec.cli.app import app

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(bench, "greedy_check", functools.partial(bench.greedy_check, exact=False))
    target, draft = tiny_pair
    common = ["bench", "--target", str(target), "--draft", str(draft), "--repeat", "1", "--warmup", "0",
              "--max-tokens", "12", "--preset", "greedy", "--ctx", "256", "--threads", "1", "--raw"]
    out = tmp_path / "r.json"
    ok = CliRunner().invoke(app, [*common, "--json", str(out)], env={"COLUMNS": "300"})
    assert ok.exit_code == 0, ok.output
    assert "✓ greedy: every one of 36 speculative tokens is the target's single-token argmax" in ok.output
    real = Engine.generate
    monkeypatch.setattr(Engine, "generate", flipped_at(5, far_down, real))
    bad = CliRunner().invoke(app, [*common, "--json", str(out)], env={"COLUMNS": "300"})
    assert bad.exit_code == 1, bad.output
    assert "✗ greedy: 3 of 36 speculative tokens are not the target's single-token choice nor a near-tie" in bad.output
    check = json.loads(out.read_text())["greedy_check"]
    assert not check["passed"] and check["broken"] == 3
    assert all(p["divergences"][0]["position"] == 5 and not p["divergences"][0]["runner_up"]
               for p in check["prompts"])
