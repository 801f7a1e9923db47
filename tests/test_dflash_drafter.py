"""The DFlash and DSpark drafters (localspec/drafters/dflash.py, docs/dflash.md) through the real llama.cpp, on the
tiny synthetic target and block drafters written for it (bench/synthetic.py `write_block_drafter`): greedy output bit
for bit plain decoding's (several prompts, several slots each what it is alone), the target's distribution at T > 0
(chi-square), the bad pairs refused in one line before anything is decoded, DSpark's confidence cut, and the block's
price (one drafter decode whatever its length)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from synthetic import TINY, BlockDrafterSpec, write_block_drafter

from localspec.config import load_preset
from localspec.drafters.dflash import BlockDrafter, DFlashCost
from localspec.errors import UsageError
from localspec.llama.model import LlamaModel
from localspec.rounds.engine import Engine
from localspec.rounds.events import collect
from localspec.rounds.policies import DraftCost
from localspec.rounds.prompt_cache import SeqFile
from tests.helpers_stats import chi_square, joint_probs

GREEDY = load_preset("greedy").with_overrides(threads=1)
SPECS = {
    "dflash": BlockDrafterSpec(block_size=4),
    "dspark": BlockDrafterSpec(block_size=4, markov_rank=8),
    # The Markov head barely moves the anchor's row, which then reads like the target's next token: drafts accepted
    # now and then at T > 0 (the others' almost never are).
    "dspark-soft": BlockDrafterSpec(block_size=4, markov_rank=8, markov_std=0.01),
}


def drafting(k: int, drafter: str, **changes: object):
    # (a fixed drafting pattern: these tests check the drafts themselves; tests/test_stand_aside.py checks standing
    # aside, which follows the clock)
    return dataclasses.replace(GREEDY.draft, n_draft=k, drafter=drafter, **{"stand_aside": False, **changes})


def sampled(seed: int, temperature: float = 1.5, top_k: int = 4):
    return dataclasses.replace(load_preset("default").sampling, temperature=temperature, top_k=top_k, top_p=1.0,
                               seed=seed)


def prompts(n: int, seed: int = 7, length: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40_000, size=length).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def block_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("block-drafters")
    out = {}
    for name, spec in SPECS.items():
        out[name] = folder / f"{name}.gguf"
        write_block_drafter(out[name], TINY, spec)
    return out


class Pair:
    """The tiny target and a block drafter loaded over it, and an engine over both."""

    def __init__(self, target: Path, drafter: Path, n_seq: int = 1) -> None:
        self.target = LlamaModel(target, load=GREEDY.load, n_ctx=256, n_threads=1, n_seq=n_seq)
        self.draft = LlamaModel(drafter, load=GREEDY.load, n_ctx=256, n_threads=1, n_seq=n_seq, other=self.target)
        self.engine = Engine(self.target, self.draft)

    def close(self) -> None:
        self.engine.close()
        self.draft.close()
        self.target.close()


@pytest.fixture(scope="module")
def pairs(tiny_pair, block_files) -> Iterator[dict[str, Pair]]:
    made = {name: Pair(tiny_pair[0], path) for name, path in block_files.items()}
    yield made
    for pair in made.values():
        pair.close()


def _kind(name: str) -> str:
    return name.split("-")[0]


# -- greedy: bit for bit plain decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_greedy_output_is_plain_decodings(pairs, name) -> None:
    pair = pairs[name]
    assert set(pair.engine.drafters) >= {_kind(name)} and isinstance(pair.engine.drafters[_kind(name)], BlockDrafter)
    for i, prompt in enumerate(prompts(3, seed=11)):
        pair.engine.reset()
        plain = collect(pair.engine.generate(prompt, GREEDY.sampling, drafting(0, name), 24)).tokens
        pair.engine.reset()
        done = collect(pair.engine.generate(prompt, GREEDY.sampling, drafting(3 + i, _kind(name)), 24))
        assert done.tokens == plain and len(plain) == 24
        assert done.stats.drafted > 0  # (it drafted: the block's rows, every round)
        # A next turn that shares the prompt: the drafter keeps its features, the target decodes only the rest.
        follow = [*prompt, *plain, *prompts(1, seed=40 + i, length=4)[0]]
        again = collect(pair.engine.generate(follow, GREEDY.sampling, drafting(4, _kind(name)), 12))
        assert again.stats.prompt_tokens_processed < len(follow) - 1
        pair.engine.reset()
        assert again.tokens == collect(pair.engine.generate(follow, GREEDY.sampling, drafting(0, name), 12)).tokens


def two_conversations_through_the_cache(target: Path, drafter: Path, name: str) -> None:
    """Two conversations take turns on one slot with the prompt cache: each turn restores the target's cells and the
    drafter's part from host RAM, so the target reads only the new text, and every reply is a fresh engine's, drafts
    included (a drafter restored wrong would draft otherwise)."""
    from localspec.rounds.prompt_cache import PromptCache

    cached = Pair(target, drafter)
    fresh = Pair(target, drafter)
    cached.engine.prompt_cache = PromptCache(64 << 20)
    try:
        history = {0: prompts(1, seed=21, length=14)[0], 1: prompts(1, seed=22, length=14)[0]}
        for turn_no in range(2):
            for who in (0, 1):
                p = history[who]
                got = collect(cached.engine.generate(p, GREEDY.sampling, drafting(4, name), 12))
                fresh.engine.reset()
                ref = collect(fresh.engine.generate(p, GREEDY.sampling, drafting(4, name), 12))
                assert got.tokens == ref.tokens and got.stats.drafted > 0
                assert (got.stats.drafted, got.stats.accepted) == (ref.stats.drafted, ref.stats.accepted)
                if turn_no:
                    assert got.stats.prompt_tokens_processed == 3  # restored: only the new text is read
                history[who] = [*p, *got.tokens, *prompts(1, seed=30 + who, length=3)[0]]
        assert cached.engine.prompt_cache.counters().hits == 2
    finally:
        cached.close()
        fresh.close()


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_two_conversations_through_the_prompt_cache_read_only_their_new_text(tiny_pair, block_files, name) -> None:
    """(The drafter's part: its cells and the target features it holds.)"""
    two_conversations_through_the_cache(tiny_pair[0], block_files[name], name)


def slot_file_keeps_the_part(target: Path, drafter: Path, name: str, path: Path, bad_parts) -> SeqFile:
    """A slot file written after one turn with `drafter` (its part beside the target's cells), read into another
    engine: each of `bad_parts(part)` (a damaged part, the words of its refusal) is one line and leaves the slot
    empty; the file's own parts restore it, the next turn reads only its 3 new tokens and drafts as a fresh engine
    does. Returns the drafter's part."""
    from localspec.rounds import slot_file
    from localspec.rounds.slot_file import SlotFileError

    first = prompts(1, seed=51, length=14)[0]
    saver = Pair(target, drafter)
    try:
        reply = collect(saver.engine.generate(first, GREEDY.sampling, drafting(4, name), 12)).tokens
        slot_file.write(path, saver.engine.snapshot(0), [slot_file.identity(m) for m in saver.engine.state_models()])
    finally:
        saver.close()
    follow = [*first, *reply, *prompts(1, seed=52, length=3)[0]]
    pair = Pair(target, drafter)
    try:
        ref = collect(pair.engine.generate(follow, GREEDY.sampling, drafting(4, name), 12))
        pair.engine.reset()
        identities = [slot_file.identity(m) for m in pair.engine.state_models()]
        loaded = slot_file.read(path, identities, n_vocab=pair.target.n_vocab, n_ctx=pair.engine.n_ctx)
        (part,) = loaded.parts
        for bad, message in bad_parts(part):
            with pytest.raises(SlotFileError, match=f"{name} drafter's part does not fit: .*{message}"):
                pair.engine.restore(0, loaded.state, [bad])
        assert pair.engine.slots[0].target_kv == []
        assert pair.engine.restore(0, loaded.state, loaded.parts)
        got = collect(pair.engine.generate(follow, GREEDY.sampling, drafting(4, name), 12))
        assert got.tokens == ref.tokens and got.stats.prompt_tokens_processed == 3
        assert (got.stats.drafted, got.stats.accepted) == (ref.stats.drafted, ref.stats.accepted)
        return part
    finally:
        pair.close()


def test_a_slot_file_keeps_the_block_drafters_part(tiny_pair, block_files, tmp_path) -> None:
    """A slot file holds a DSpark drafter's cells and features beside the target's: restored into another engine,
    the next turn reads only its new text and drafts as a fresh engine does; a part saved with another drafter
    file, or of positions that are not the slot's, is refused in one line before any cell changes."""

    def bad_parts(part: SeqFile) -> list[tuple[SeqFile, str]]:
        other = SeqFile(part.kind, {**part.meta, "drafter": "0" * 64}, part.blobs)
        shifted = SeqFile(part.kind, part.meta, (part.blobs[0], bytearray(len(part.blobs[1])), part.blobs[2]))
        return [(other, "another drafter file"), (shifted, "not the slot's")]

    slot_file_keeps_the_part(tiny_pair[0], block_files["dspark"], "dspark", tmp_path / "block.slot", bad_parts)


def slots_together_are_each_alone(target: Path, drafter: Path, name: str) -> None:
    """Three greedy requests (draft lengths 3, 0, 2) arriving at different rounds in a 3-slot engine over `drafter`
    get what each gets alone."""
    from tests.helpers_rounds import each_alone, run_together

    reqs = [dict(prompt=p, sampling=GREEDY.sampling, drafting=drafting(k, name), max_tokens=16 + 3 * i)
            for i, (p, k) in enumerate(zip(prompts(3, seed=5), (3, 0, 2), strict=True))]
    alone = Pair(target, drafter)
    try:
        expected = each_alone(alone.engine, reqs)
    finally:
        alone.close()
    together = Pair(target, drafter, n_seq=3)
    try:
        assert run_together(together.engine, reqs, [0, 1, 1], slots=[2, 0, 1]) == expected
    finally:
        together.close()


def test_greedy_slots_together_are_each_what_it_is_alone(tiny_pair, block_files) -> None:
    slots_together_are_each_alone(tiny_pair[0], block_files["dspark"], "dspark")


# -- a hybrid target (Qwen3.5/3.6's kind: its layer inputs captured, rejected drafts rolled back) ----------------


@pytest.fixture(scope="module")
def hybrid_block_files(tmp_path_factory) -> dict[str, Path]:
    """A DFlash and a DSpark drafter for the tiny hybrid target (`hybrid_pair`): its width and vocabulary, its
    layers 1 and 3 (a Gated DeltaNet and an attention block)."""
    from synthetic import HYBRID_TINY

    shape = HYBRID_TINY.target
    target = dataclasses.replace(TINY, n_embd=shape.n_embd, n_head=shape.n_head, n_head_kv=shape.n_head_kv,
                                 head_dim=shape.head_dim, n_ff=shape.n_ff, ctx=HYBRID_TINY.ctx,
                                 rope_freq_base=HYBRID_TINY.rope_freq_base)
    folder = tmp_path_factory.mktemp("hybrid-block-drafters")
    out = {}
    for name in ("dflash", "dspark"):
        out[name] = folder / f"{name}.gguf"
        write_block_drafter(out[name], target, SPECS[name])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_greedy_on_a_hybrid_target_is_plain_decodings_alone_and_in_slots(hybrid_pair, hybrid_block_files,
                                                                         name) -> None:
    """On a hybrid target the drafter reads a Gated DeltaNet block's input as well as an attention block's, and
    every rejected draft rolls the recurrent state back through its snapshots: the tokens plain greedy decoding
    gives, alone at several lengths and in three slots at once (each what it is alone)."""
    from localspec.sessions.session import ModelFiles, open_session
    from tests.helpers_rounds import each_alone, run_together

    files = ModelFiles(hybrid_pair[0], hybrid_block_files[name], "hybrid")
    preset = GREEDY.with_overrides(n_draft=6, n_ctx=512, drafter=name)
    reqs = [dict(prompt=p, sampling=GREEDY.sampling, drafting=drafting(k, name), max_tokens=16 + 3 * i)
            for i, (p, k) in enumerate(zip(prompts(3, seed=5), (3, 0, 6), strict=True))]
    with open_session(files, preset) as s:
        drafted = 0
        for prompt in prompts(2, seed=11):
            s.engine.reset()
            plain = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(0, name), 24)).tokens
            for k in (2, 6):
                s.engine.reset()
                done = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(k, name), 24))
                assert done.tokens == plain, k
                drafted += done.stats.drafted
        assert drafted > 0
        expected = each_alone(s.engine, reqs)
    with open_session(files, preset, parallel=3) as together:
        assert run_together(together.engine, reqs, [0, 1, 1], slots=[2, 0, 1]) == expected


# -- the copying drafter and its repeating target (the GPU benchmark's pair, bench/synthetic.py) ------------------


@pytest.fixture(scope="module")
def copy_files(tmp_path_factory) -> dict[str, Path]:
    """The tiny hybrid as a `repeat` target (it repeats with probability 0.8 at the default sampling) and the
    copying DFlash and DSpark drafters written for it."""
    from synthetic import COPY_DRAFTER_TINY, HYBRID_TINY, write_copy_block_drafter, write_hybrid_model

    folder = tmp_path_factory.mktemp("copy")
    spec = dataclasses.replace(HYBRID_TINY, repeat=True, repeat_p=0.8)
    out = {"target": folder / "target.gguf"}
    write_hybrid_model(out["target"], spec, "target")
    for name, rank in (("dflash", 0), ("dspark", 8)):
        out[name] = folder / f"{name}.gguf"
        write_copy_block_drafter(out[name], spec, dataclasses.replace(COPY_DRAFTER_TINY, markov_rank=rank))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_the_copying_drafter_drafts_what_its_target_repeats(copy_files, name) -> None:
    """Greedy, the target repeats its last token and every draft of the copying drafter is kept (plain decoding's
    tokens all the same); at the default sampling it repeats with probability 0.8, so a round of 6 drafts keeps
    about 0.8 + 0.8^2 + ... + 0.8^6 = 2.95 of them (49%): the rate the GPU rows are set by."""
    from localspec.sessions.session import ModelFiles, open_session

    default = load_preset("default")
    files = ModelFiles(copy_files["target"], copy_files[name], "hybrid")
    with open_session(files, GREEDY.with_overrides(n_draft=6, n_ctx=1024, drafter=name)) as s:
        kept = drafted = 0
        for prompt in prompts(2, seed=3):
            s.engine.reset()
            plain = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(0, name), 60)).tokens
            s.engine.reset()
            done = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(6, name), 60))
            assert done.tokens == plain and set(plain) == {prompt[-1]}
            assert done.stats.accepted == done.stats.drafted > 0
        for seed in range(3):
            s.engine.reset()
            sampled_run = collect(s.engine.generate(prompt, dataclasses.replace(default.sampling, seed=seed),
                                                    drafting(6, name), 120))
            kept, drafted = kept + sampled_run.stats.accepted, drafted + sampled_run.stats.drafted
    assert 0.38 < kept / drafted < 0.6, (kept, drafted)


def test_the_copying_drafter_refuses_what_it_cannot_draft(tmp_path) -> None:
    """It needs a repeat target and room for its copy after the two marks, in one line each."""
    from synthetic import COPY_DRAFTER_TINY, HYBRID_TINY, write_copy_block_drafter

    repeat = dataclasses.replace(HYBRID_TINY, repeat=True)
    with pytest.raises(ValueError, match="repeat=True"):
        write_copy_block_drafter(tmp_path / "a.gguf", HYBRID_TINY, COPY_DRAFTER_TINY)
    with pytest.raises(ValueError, match="do not fit a width of 64"):
        write_copy_block_drafter(tmp_path / "b.gguf", repeat, dataclasses.replace(COPY_DRAFTER_TINY, n_head_kv=4))
    with pytest.raises(ValueError, match="rotary pairs"):
        write_copy_block_drafter(tmp_path / "c.gguf", repeat, dataclasses.replace(COPY_DRAFTER_TINY, head_dim=15))
    assert not list(tmp_path.iterdir())


def test_the_repeat_targets_output_norm_sets_its_repeat_probability() -> None:
    """The output norm grows with the probability asked for, and one at or above the default top-p is refused
    (top-p would keep the last token alone: it would always repeat)."""
    from synthetic import HYBRID_27B, repeat_output_norm

    weights = [repeat_output_norm(dataclasses.replace(HYBRID_27B, repeat=True, repeat_p=p), 151_936)
               for p in (0.5, 0.7, 0.85)]
    assert weights == sorted(weights) and weights[0] > 0
    with pytest.raises(ValueError, match="below the default top-p"):
        repeat_output_norm(dataclasses.replace(HYBRID_27B, repeat=True, repeat_p=0.9), 151_936)


# -- T > 0: the target's distribution ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dflash", "dspark-soft"])
def test_sampling_keeps_the_target_distribution(pairs, name) -> None:
    """The joint distribution of the first two emitted tokens (both from one speculative round, through its
    rejections and the rewind) is the target's own, by chi-square at p = 0.001."""
    pair = pairs[name]
    prompt = prompts(1, seed=23, length=6)[0]
    sampling = sampled(0)

    def next_probs(context: list[int]) -> dict[int, float]:
        from localspec.rounds.sampling import candidates

        pair.target.clear(0)
        pair.target.want_hidden(0, False)
        pair.target.use_device_sampler(None)  # the reference p comes from full logits
        p = candidates(pair.target.decode(context, 0).logits, sampling)
        return dict(zip(p.ids[0].tolist(), p.probs[0].tolist(), strict=True))

    joint = joint_probs(next_probs, prompt, 2)
    pair.engine.reset()
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(1600):
        done = collect(pair.engine.generate(prompt, dataclasses.replace(sampling, seed=seed),
                                            drafting(3, _kind(name)), 2))
        counts[tuple(done.tokens)] += 1
        drafted, accepted = drafted + done.stats.drafted, accepted + done.stats.accepted
    assert drafted > 0
    if name == "dspark-soft":
        assert 0 < accepted < drafted  # (both the accepted and the resampled paths ran)
    assert chi_square(counts, joint) < 37.7  # 15 degrees of freedom at p = 0.001


# -- DSpark's confidence head --------------------------------------------------------------------------------------


def test_dspark_confidence_cuts_the_block(pairs) -> None:
    pair = pairs["dspark"]
    drafter = pair.engine.drafters["dspark"]
    assert isinstance(drafter, BlockDrafter) and drafter.facts.confidence
    prompt = prompts(1, seed=31)[0]
    lengths = {}
    for p_cut in (0.0, 0.999):
        pair.engine.reset()
        done = collect(pair.engine.generate(prompt, GREEDY.sampling, drafting(4, "dspark", dspark_p_min=p_cut), 12))
        lengths[p_cut] = done.stats.draft_lengths
    # The whole block (4 drafts) a round (the last rounds fewer, within max_tokens).
    assert lengths[0.0][:4] == [4, 4, 4, 4]
    assert all(n == 0 for n in lengths[0.999])  # a confidence is a sigmoid: never 0.999 on random weights
    assert drafter.confidence_cuts(0) > 0
    # A threshold inside the head's range cuts some blocks and not others: the head chooses the length per round.
    conf = _confidences(drafter, pair, prompt)
    middle = float(np.median(conf))
    pair.engine.reset()
    done = collect(pair.engine.generate(prompt, GREEDY.sampling, drafting(4, "dspark", dspark_p_min=middle), 12))
    assert any(n < 4 for n in done.stats.draft_lengths)


def _confidences(drafter: BlockDrafter, pair: Pair, prompt: list[int]) -> np.ndarray:
    """The confidence rows of the blocks a greedy run over `prompt` decodes (the drafter's own readings)."""
    seen: list[np.ndarray] = []
    original = drafter._decode_blocks

    def spy(reqs):  # type: ignore[no-untyped-def]
        rows, conf = original(reqs)
        assert conf is not None
        seen.extend(conf)
        return rows, conf

    drafter._decode_blocks = spy  # type: ignore[method-assign]
    try:
        pair.engine.reset()
        collect(pair.engine.generate(prompt, GREEDY.sampling, drafting(4, "dspark"), 12))
    finally:
        del drafter._decode_blocks
    values = np.concatenate(seen)
    assert np.all((values > 0) & (values < 1)) and values.std() > 0
    return values


# -- the bad pairs, before anything is decoded -----------------------------------------------------------------


def test_a_draft_that_is_no_block_drafter_is_refused_by_name(tiny_pair) -> None:
    target = LlamaModel(tiny_pair[0], load=GREEDY.load, n_ctx=256, n_threads=1)
    draft = LlamaModel(tiny_pair[1], load=GREEDY.load, n_ctx=256, n_threads=1)
    try:
        engine = Engine(target, draft)
        decodes = target.decodes
        for name in ("dflash", "dspark"):
            with pytest.raises(UsageError) as err:
                engine.start([1, 2, 3], GREEDY.sampling, drafting(4, name), 8)
            line = str(err.value)
            assert "\n" not in line and f"drafter {name!r} cannot run" in line
            assert "general.architecture is 'qwen3', not a block drafter" in line
        assert target.decodes == decodes  # refused before any decode
    finally:
        draft.close()
        target.close()


def test_a_drafter_of_the_other_kind_or_for_other_layers_is_refused(tiny_pair, block_files, tmp_path) -> None:
    pair = Pair(tiny_pair[0], block_files["dspark"])
    try:
        decodes = pair.target.decodes
        with pytest.raises(UsageError, match="is a DSpark with a confidence head, .* drafter: --drafter dspark"):
            pair.engine.start([1, 2, 3], GREEDY.sampling, drafting(4, "dflash"), 8)
        assert pair.target.decodes == decodes  # refused before any decode
    finally:
        pair.close()
    bad = tmp_path / "far-layers.gguf"
    write_block_drafter(bad, TINY, dataclasses.replace(SPECS["dflash"], target_layers=(1, 4)))
    pair = Pair(tiny_pair[0], bad)  # (loading it is safe: llama.cpp aborts only when layer 4's input is asked for)
    try:
        assert "dflash" not in pair.engine.drafters
        with pytest.raises(UsageError) as err:
            pair.engine.start([1, 2, 3], GREEDY.sampling, drafting(4, "dflash"), 8)
        assert "dflash.target_layers [1, 4] names layer 4" in str(err.value) and "\n" not in str(err.value)
    finally:
        pair.close()


def test_the_cli_refuses_dflash_without_a_block_drafter_with_exit_2(tiny_pair, tmp_path) -> None:
    env = {**os.environ, "LOCALSPEC_HOME": str(tmp_path)}
    env.pop("LOCALSPEC_DEBUG", None)
    r = subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", "generate", "hi",
                        "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--drafter", "dflash",
                        "--threads", "1", "--ctx", "256", "--max-tokens", "4"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "not a block drafter" in r.stderr and "Traceback" not in r.stderr


def test_check_reports_the_drafters_kind_and_layers_and_refuses_a_bad_pair(tiny_pair, block_files, tmp_path) -> None:
    """`localspec check TARGET DRAFT` on block drafters: their kind and the target layers they read, from headers;
    a drafter reading a layer the target lacks is one line and exit 1, before the tokenizer comparison."""
    env = {**os.environ, "LOCALSPEC_HOME": str(tmp_path), "COLUMNS": "200"}

    def check(draft: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", "check",
                               str(tiny_pair[0]), str(draft)], capture_output=True, text=True, env=env, timeout=120)

    r = check(block_files["dspark"])
    assert r.returncode == 0, r.stderr
    assert "block drafter: DSpark with a confidence head, block 4, reads target layers 1, 3 (--drafter dspark)" \
        in r.stdout
    bad = tmp_path / "far-layers.gguf"
    write_block_drafter(bad, TINY, dataclasses.replace(SPECS["dflash"], target_layers=(1, 4)))
    r = check(bad)
    assert r.returncode == 1 and "dflash.target_layers [1, 4] names layer 4" in r.stdout
    assert "verdict: incompatible" in r.stdout and "same tokenizer" not in r.stdout


# -- the price -------------------------------------------------------------------------------------------------


def test_a_block_costs_one_decode_whatever_its_length() -> None:
    cost = DraftCost(k_max=8)
    rule = DFlashCost.of(cost)
    rule.max_drafts = 4
    cost.step_s = 0.01
    n = np.arange(9)
    seconds = rule.seconds(np.zeros_like(n), n, np.full(9, 0.02), perfect=False)
    assert seconds[0] == 0.0 and np.all(seconds[1:5] == 0.01) and np.all(np.isinf(seconds[5:]))


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_greedy_around_a_picture_is_plain_decodings(tiny_pair, block_files, name, tmp_path) -> None:
    """A picture in the prompt (a Gemma 3-type projector over the tiny target): the target gives zero features at its
    positions, the drafter's cells take them, and the text after it drafts as any other; output is plain decoding's
    with the picture, and another picture gives other output."""
    from synthetic import ProjectorSpec, write_projector

    from localspec.llama.vision import Projector, with_markers
    from tests.test_vision import picture

    mmproj = write_projector(tmp_path / "mmproj.gguf", ProjectorSpec(n_embd_text=TINY.n_embd, projection_std=1.0))
    pair = Pair(tiny_pair[0], block_files[name])
    try:
        pair.target.projector = Projector(mmproj, pair.target, 1)

        def prompt(seed: int) -> list[int]:
            return pair.target.projector.tokenize(with_markers("Describe it, then again:", 1), [picture(seed)],
                                                  add_special=True, parse_special=False)

        tokens = prompt(1)
        plain = collect(pair.engine.generate(tokens, GREEDY.sampling, drafting(0, name), 24)).tokens
        pair.engine.reset()
        done = collect(pair.engine.generate(tokens, GREEDY.sampling, drafting(4, _kind(name)), 24))
        assert done.tokens == plain and done.stats.drafted > 0
        pair.engine.reset()
        assert collect(pair.engine.generate(prompt(2), GREEDY.sampling, drafting(4, _kind(name)), 24)).tokens != plain
    finally:
        pair.close()


@pytest.mark.slow
def test_bench_measures_several_drafters_in_turn_and_picks_from_them(copy_files, tmp_path, monkeypatch) -> None:
    """`localspec bench --drafters mtp,dflash,lookup` on the repeat target and its copying DFlash drafter: one
    session (opened for the drafter that reads the draft file), each drafter against plain in turn on the same
    prompts, each greedy check passed, the copying drafter keeping every greedy draft, and the closing line naming
    all three with their figures."""
    import json

    from typer.testing import CliRunner

    from localspec.cli.app import app

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "--target", str(copy_files["target"]), "--draft", str(copy_files["dflash"]),
        "--drafters", "mtp,dflash,lookup", "--preset", "greedy", "--repeat", "1", "--warmup", "0",
        "--max-tokens", "12", "--threads", "1", "--raw", "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert [p["preset"]["draft"]["drafter"] for p in parts] == ["mtp", "dflash", "lookup"]
    assert report["preset"]["draft"]["drafter"] == "mtp"  # (the first part, at the top level as one part's is)
    assert all(p["greedy_check"]["passed"] and p["greedy_check"]["exact"] for p in parts)
    dflash = parts[1]["speculative"]
    assert dflash["acceptance_rate"] == 1.0  # the target repeats its last token at T = 0; the drafter copies it
    said = " ".join(result.output.split())
    for title in ("the MTP head", "the DFlash drafter", "prompt lookup"):
        assert f"decode tok/s, plain vs {title}" in said, title
    last = said[said.rindex("on this machine:"):]
    for p, title in zip(parts, ("the MTP head", "the DFlash drafter", "prompt lookup"), strict=True):
        assert title in last and f"{p['speedup']:.2f}x plain" in last, (title, last)
