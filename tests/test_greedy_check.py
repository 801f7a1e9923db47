"""The bench's greedy verdict: exact identity on a CPU, the argmax invariant everywhere (no models needed)."""

from __future__ import annotations

from localspec.bench import GreedyCheck, PromptCheck


def prompt(name: str, first: int | None = None, not_argmax: int = 0) -> PromptCheck:
    return PromptCheck(name=name, tokens=20, first_divergence=first, plain_margin=None if first is None else 0.01,
                       spec_margin=None, not_argmax=not_argmax, plain_tokens=[], plain_text="",
                       plain_token_ends=[], plain_margins=[])


def test_cpu_needs_identical_output():
    assert GreedyCheck(exact=True, prompts=[prompt("a"), prompt("b")]).passed
    failed = GreedyCheck(exact=True, prompts=[prompt("a"), prompt("b", first=7)])
    assert not failed.passed and failed.invariant_holds
    assert failed.describe() == "diverged from plain decoding on 1 of 2 prompts: 'b' at token 7 (top-2 margin 0.010)"


def test_gpu_reports_divergence_but_fails_only_a_broken_invariant():
    diverged = GreedyCheck(exact=False, prompts=[prompt("a", first=3), prompt("b")])
    assert diverged.passed and len(diverged.diverged) == 1
    assert diverged.as_dict()["diverged"] == 1 and diverged.as_dict()["passed"]
    broken = GreedyCheck(exact=False, prompts=[prompt("a", not_argmax=1)])
    assert not broken.passed and not broken.invariant_holds
