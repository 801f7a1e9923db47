"""The EAGLE-3 drafter (localspec/drafters/eagle3.py, docs/dflash.md) through the real llama.cpp, on the tiny synthetic
target and an EAGLE-3 drafter written for it in llama.cpp's layout (bench/synthetic.py `write_eagle3_drafter`: an
`fc` over three target layers, one decoder block, the target's embeddings and output head): greedy output bit for bit
plain decoding's (several prompts, a next turn, the prompt cache, several slots each what it is alone), the target's
distribution at T > 0 (chi-square), and the bad files and pairings refused in one line before anything decodes."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from synthetic import TINY, Eagle3Spec, write_eagle3_drafter

from localspec.errors import UsageError
from localspec.rounds.events import collect
from tests.helpers_stats import chi_square, joint_probs
from tests.test_dflash_drafter import (
    GREEDY,
    Pair,
    drafting,
    prompts,
    sampled,
    slot_file_keeps_the_part,
    slots_together_are_each_alone,
    two_conversations_through_the_cache,
)


@pytest.fixture(scope="module")
def eagle3_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eagle3") / "eagle3.gguf"
    write_eagle3_drafter(path, TINY, Eagle3Spec(target_layers=(0, 1, 3)))
    return path


@pytest.fixture(scope="module")
def pair(tiny_pair, eagle3_file):
    made = Pair(tiny_pair[0], eagle3_file)
    yield made
    made.close()


def test_greedy_output_is_plain_decodings(pair) -> None:
    assert "eagle3" in pair.engine.drafters and "model" not in pair.engine.drafters  # (it steps no token alone)
    for i, prompt in enumerate(prompts(3, seed=11)):
        pair.engine.reset()
        plain = collect(pair.engine.generate(prompt, GREEDY.sampling, drafting(0, "eagle3"), 24)).tokens
        pair.engine.reset()
        done = collect(pair.engine.generate(prompt, GREEDY.sampling, drafting(3 + i, "eagle3"), 24))
        assert done.tokens == plain and len(plain) == 24
        assert done.stats.drafted > 0
        # A next turn that shares the prompt: the drafter keeps its cells, the target decodes only the rest.
        follow = [*prompt, *plain, *prompts(1, seed=40 + i, length=4)[0]]
        again = collect(pair.engine.generate(follow, GREEDY.sampling, drafting(4, "eagle3"), 12))
        assert again.stats.prompt_tokens_processed < len(follow) - 1
        pair.engine.reset()
        assert again.tokens == collect(pair.engine.generate(follow, GREEDY.sampling, drafting(0, "eagle3"), 12)).tokens


def test_two_conversations_through_the_prompt_cache_read_only_their_new_text(tiny_pair, eagle3_file) -> None:
    """(The drafter's part: its cells and the fused rows it holds, as an MTP head's.)"""
    two_conversations_through_the_cache(tiny_pair[0], eagle3_file, "eagle3")


def test_greedy_slots_together_are_each_what_it_is_alone(tiny_pair, eagle3_file) -> None:
    slots_together_are_each_alone(tiny_pair[0], eagle3_file, "eagle3")


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(pair) -> None:
    """The joint distribution of the first two emitted tokens (one speculative round: its drafts sampled from the
    drafter's own distribution, rejected and resampled, the rewind) is the target's, by chi-square at p = 0.001."""
    from localspec.rounds.sampling import candidates

    prompt = prompts(1, seed=23, length=6)[0]
    sampling = sampled(0)

    def next_probs(context: list[int]) -> dict[int, float]:
        pair.target.clear(0)
        pair.target.want_hidden(0, False)
        pair.target.use_device_sampler(None)
        p = candidates(pair.target.decode(context, 0).logits, sampling)
        return dict(zip(p.ids[0].tolist(), p.probs[0].tolist(), strict=True))

    joint = joint_probs(next_probs, prompt, 2)
    pair.engine.reset()
    counts: Counter = Counter()
    drafted = 0
    for seed in range(1600):
        done = collect(pair.engine.generate(prompt, dataclasses.replace(sampling, seed=seed),
                                            drafting(3, "eagle3"), 2))
        counts[tuple(done.tokens)] += 1
        drafted += done.stats.drafted
    assert drafted > 0
    assert chi_square(counts, joint) < 37.7  # 15 degrees of freedom at p = 0.001


@pytest.mark.parametrize(("spec", "why"), [
    (Eagle3Spec(target_layers=(0, 1)), r"eagle3.target_layers must be three layer numbers, not \[0, 1\]"),
    (Eagle3Spec(target_layers=(0, 1, 4)), r"names 4, the target's final hidden state: not supported"),
    (Eagle3Spec(target_layers=(0, 1, 9)), r"eagle3.target_layers \[0, 1, 9\] names layer 9; .* has layers 0..3"),
    (Eagle3Spec(hidden_size=32), r"eagle3.target_hidden_size 32 is not .*'s qwen3.embedding_length 64"),
])
def test_a_bad_eagle3_file_is_one_line_before_any_decode(tiny_pair, tmp_path, spec, why) -> None:
    from localspec.llama.layer_features import check_eagle3_drafter
    from localspec.models.gguf_header import read_header

    bad = tmp_path / "bad.gguf"
    write_eagle3_drafter(bad, TINY, spec)
    with pytest.raises(UsageError, match=why) as err:
        check_eagle3_drafter(read_header(tiny_pair[0]), read_header(bad))
    assert "\n" not in str(err.value) and "bad.gguf" in str(err.value)


def test_the_cli_refuses_a_wrong_pairing_with_exit_2_and_check_reports_the_drafter(tiny_pair, eagle3_file,
                                                                                   tmp_path) -> None:
    """`generate` with an EAGLE-3 file as the draft of another drafter, or `--drafter eagle3` with a plain draft
    model: one line, exit 2, no traceback. `localspec check` names the drafter and the layers it reads."""
    env = {**os.environ, "LOCALSPEC_HOME": str(tmp_path), "COLUMNS": "200"}
    env.pop("LOCALSPEC_DEBUG", None)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", *args],
                              capture_output=True, text=True, env=env, timeout=300)

    common = ("--target", str(tiny_pair[0]), "--threads", "1", "--ctx", "256", "--max-tokens", "4")
    r = cli("generate", "hi", *common, "--draft", str(eagle3_file), "--drafter", "model")
    assert r.returncode == 2 and "is an EAGLE-3 drafter (general.architecture eagle3): --drafter eagle3, not model" \
        in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli("generate", "hi", *common, "--draft", str(tiny_pair[1]), "--drafter", "eagle3")
    assert r.returncode == 2 and "general.architecture eagle3" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli("generate", "hi", *common, "--draft", str(eagle3_file), "--drafter", "eagle3", "--temp", "0")
    assert r.returncode == 0, r.stderr
    r = cli("check", str(tiny_pair[0]), str(eagle3_file))
    assert r.returncode == 0 and "drafter: EAGLE-3, reads target layers 0, 1, 3 (--drafter eagle3)" in r.stdout, \
        r.stdout + r.stderr


def test_the_decoders_scored_row_is_its_own_entrys(pair) -> None:
    """Canary: llama.cpp's eagle3 decoder graph selects no output rows, so with one output asked for among several
    entries it hands back the first entry's logits (docs/upstream.md). `Eagle3Head.decode` asks for every entry's:
    the scored row of a three-entry decode is the one a decode of that entry alone (after the others) gives."""
    import numpy as np

    head = pair.engine.drafters["eagle3"].head
    pair.draft.use_device_sampler(None, 0)  # full rows (what the drafter's `begin` sets)
    g = head.encode(np.random.default_rng(0).standard_normal((3, 3 * TINY.n_embd)).astype(np.float32))
    entries = [(0, 100 + p, p, g[p], p == 2) for p in range(3)]
    head.clear(0)
    together = head.decode(entries)[0][0].logits
    head.clear(0)
    head.decode([(*e[:4], False) for e in entries[:2]])
    alone = head.decode(entries[2:])[0][0].logits
    head.clear(0)
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-5)
    raw = super(type(head), head).decode(entries)[0][0].logits  # (MtpHead's: only the scored entry is an output)
    head.clear(0)
    assert np.abs(raw - together).max() > 1e-3  # the first entry's row, as the canary says


def test_a_slot_file_keeps_the_eagle3_part(tiny_pair, eagle3_file, tmp_path) -> None:
    """A slot file holds the drafter's cells and rows (part kind eagle3) beside the target's: restored into another
    engine, the next turn reads only its new text and drafts as a fresh engine does; a part saved with another
    drafter file is refused in one line before any cell changes."""
    from localspec.rounds.prompt_cache import SeqFile

    def bad_parts(part: SeqFile) -> list[tuple[SeqFile, str]]:
        return [(SeqFile(part.kind, {**part.meta, "drafter": "0" * 64}, part.blobs), "another drafter file")]

    part = slot_file_keeps_the_part(tiny_pair[0], eagle3_file, "eagle3", tmp_path / "eagle3.slot", bad_parts)
    assert part.kind == "eagle3" and len(part.blobs) == 5


@pytest.mark.slow
def test_the_server_drafts_with_it_by_either_name(tiny_pair, eagle3_file, tmp_path) -> None:
    """A real `localspec serve` with the EAGLE-3 file as its draft: `speculative.type` "eagle3" and llama-server's
    "draft-eagle3" give plain decoding's text at T = 0; "draft-simple" (the draft model) is a 400 saying why."""
    import openai

    from tests.test_serve import Server

    home = tmp_path / "home"
    home.mkdir()
    s = Server(home, tmp_path, "--target", str(tiny_pair[0]), "--draft", str(eagle3_file), "--drafter", "eagle3",
               "--threads", "1")
    try:
        client = s.client()

        def complete(kind: str) -> str:
            r = client.completions.create(model="target", prompt="Once upon a time", max_tokens=16, temperature=0,
                                          extra_body={"speculative.type": kind})
            return r.choices[0].text

        plain = complete("none")
        assert plain and complete("eagle3") == plain and complete("draft-eagle3") == plain
        with pytest.raises(openai.BadRequestError, match="is an EAGLE-3 drafter"):
            complete("draft-simple")
    finally:
        s.stop()


def test_greedy_around_a_picture_is_plain_decodings(tiny_pair, eagle3_file, tmp_path) -> None:
    """A picture in the prompt: zero features at its positions (the encoder fuses them like any), the filler token
    there, and the text after it drafted as any other; output is plain decoding's with the picture."""
    from synthetic import ProjectorSpec, write_projector

    from localspec.llama.vision import Projector, with_markers
    from tests.test_vision import picture

    mmproj = write_projector(tmp_path / "mmproj.gguf", ProjectorSpec(n_embd_text=TINY.n_embd, projection_std=1.0))
    pair = Pair(tiny_pair[0], eagle3_file)
    try:
        pair.target.projector = Projector(mmproj, pair.target, 1)
        tokens = pair.target.projector.tokenize(with_markers("Describe it, then again:", 1), [picture(1)],
                                                add_special=True, parse_special=False)
        plain = collect(pair.engine.generate(tokens, GREEDY.sampling, drafting(0, "eagle3"), 24)).tokens
        pair.engine.reset()
        done = collect(pair.engine.generate(tokens, GREEDY.sampling, drafting(4, "eagle3"), 24))
        assert done.tokens == plain and done.stats.drafted > 0
    finally:
        pair.close()


def test_the_encoder_fuses_the_three_layers_by_fc(pair, eagle3_file) -> None:
    """The rows the decoder reads are `fc` over the target's three layer inputs, checked against the weight read from
    the GGUF with the gguf package (numpy, no llama.cpp): the ENCODE pass and its read-back, and the layers the target
    returns for the drafter (its `eagle3.target_layers`, in order)."""
    import gguf
    import numpy as np

    fc = next(t for t in gguf.GGUFReader(eagle3_file).tensors if t.name == "fc.weight")
    weight = np.asarray(fc.data, dtype=np.float32).reshape(TINY.n_embd, 3 * TINY.n_embd)
    drafter = pair.engine.drafters["eagle3"]
    assert drafter.facts.layers == (0, 1, 3)
    pair.engine.reset()
    pair.target.use_device_sampler(None, 0)
    pair.target.want_hidden(0, True, drafter.facts.layers)
    features = pair.target.decode(prompts(1, seed=9, length=7)[0], 0, seq=0).hidden
    pair.target.want_hidden(0, False)
    pair.engine.reset()
    assert features.shape == (7, 3 * TINY.n_embd)
    np.testing.assert_allclose(drafter.head.encode(features), features @ weight.T, rtol=1e-4, atol=1e-5)
