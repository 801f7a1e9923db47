"""The bench's seeds at T > 0: each measured repetition samples with a seed of its own (the preset's + the
repetition), the same for every mode, so a mode's median is one over as many sampled texts, not one text timed
again and again (`Sampling.repetition`). Checked against the reference of each run's own generation with that seed,
made apart from the bench, through the real llama.cpp on the tiny pair."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from localspec import config
from localspec.rounds.events import collect
from localspec.sessions import bench
from localspec.sessions.bench import PLAIN, SPEC, RunDone
from localspec.sessions.session import ModelFiles, open_session

pytestmark = pytest.mark.slow

PROMPT = bench.BenchPrompt("p", text="the cat sat on the")


def _preset(**overrides: object) -> config.Preset:
    # A fixed draft length that always drafts (no stand-aside): a speculative run's text is then a function of its
    # seed alone, which the reference can make again.
    settings: dict[str, object] = {"n_ctx": 256, "repeat": 3, "warmup": 1, "max_tokens": 12, "threads": 1,
                                   "temperature": 0.9, "seed": 11, "n_draft": 3, "stand_aside": False, **overrides}
    return config.load_preset("default").with_overrides(**settings)


def _reference(session, prompt: list[int], preset: config.Preset, mode: str, rep: int) -> list[int]:
    drafting = preset.draft if mode == SPEC else dataclasses.replace(preset.draft, n_draft=0)
    sampling = dataclasses.replace(preset.sampling, seed=preset.sampling.seed + rep)
    return collect(session.engine.generate(prompt, sampling, drafting, preset.bench.max_tokens)).tokens


def test_each_repetition_samples_with_its_own_seed_in_every_mode(tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    preset = _preset()
    with open_session(ModelFiles(target=target, draft=draft, name="custom"), preset) as session:
        runs = [e.result for e in bench.run_bench(session, preset, [PROMPT], raw=True) if isinstance(e, RunDone)]
        (_, prompt), = bench.tokenize_prompts(session, [PROMPT], raw=True)
        assert sorted((r.mode, r.index) for r in runs) == sorted((m, i) for m in (PLAIN, SPEC) for i in range(3))
        for run in runs:
            assert run.outputs["p"] == _reference(session, prompt, preset, run.mode, run.index), (run.mode, run.index)
    plain = [tuple(r.outputs["p"]) for r in runs if r.mode == PLAIN]
    assert len(set(plain)) > 1  # (the premise: other seeds, other texts; one seed gave three alike)


def test_a_sweeps_draft_lengths_sample_each_repetitions_seed(tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    preset = _preset(repeat=2)
    with open_session(ModelFiles(target=target, draft=draft, name="custom"), preset, longest_draft=4) as session:
        runs = [e.result for e in bench.run_sweep(session, preset, [2, 4], [PROMPT], raw=True)
                if isinstance(e, RunDone)]
        (_, prompt), = bench.tokenize_prompts(session, [PROMPT], raw=True)
        for run in runs:
            if run.mode == PLAIN:
                assert run.outputs["p"] == _reference(session, prompt, preset, PLAIN, run.index), run.index
        assert sorted(r.index for r in runs if r.mode == PLAIN) == [0, 1]


def test_a_run_that_decoded_nothing_has_no_rate_in_the_median() -> None:
    """At T > 0 a seed may draw the end of generation first: that run decodes no token and has no decode rate. It
    is counted apart, not as 0 tok/s (which dragged a mode's median to whichever seeds drew the end in it)."""
    from localspec.rounds.events import GenerationStats

    def run(tokens: int, seconds: float) -> bench.RunResult:
        return bench.RunResult(PLAIN, 0, GenerationStats(tokens=tokens, decode_s=seconds), 0.0, {})

    summary = bench.ModeSummary.of(PLAIN, [run(40, 1.0), run(0, 0.0), run(0, 0.001), run(60, 1.0), run(50, 1.0)])
    assert (summary.median_tps, summary.min_tps, summary.max_tps) == (50.0, 40.0, 60.0)
    assert summary.runs == 5 and summary.empty_runs == 2
    nothing = bench.ModeSummary.of(PLAIN, [run(0, 0.0)])
    assert nothing.median_tps == 0.0 and nothing.empty_runs == 1
