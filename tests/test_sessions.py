"""Long sessions on real llama.cpp (the demo-chat pair: SmolLM2-135M and its requantized draft; the tiny pair whose
draft often disagrees): the host-RAM prompt cache, a slot's state saved to a file and restored, and context shift.

References that cannot share the engine's bugs: a cold run (a fresh engine, empty caches, no prompt cache); the
same generation uninterrupted; and for context shift, plain decoding written here against `LlamaModel` alone,
which after each shift starts a fresh context holding the shifted tokens, with llama-server's arithmetic written
out again. On the CPU every comparison is bit for bit at temperature 0."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from localspec.config import ContextSettings, load_preset
from localspec.llama.model import LlamaModel
from localspec.models import demo
from localspec.rounds import slot_file
from localspec.rounds.events import STOP_EOG, collect
from localspec.sessions.session import ModelFiles, Session, open_session

pytestmark = pytest.mark.slow

GREEDY = load_preset("greedy")


@pytest.fixture(scope="module")
def chat_pair(demo_home) -> tuple[Path, Path]:
    import os

    old = os.environ.get("LOCALSPEC_HOME")
    os.environ["LOCALSPEC_HOME"] = str(demo_home)
    try:
        pair = demo.DEMOS["demo-chat"]
        return pair.target_path(), pair.draft_path()
    finally:
        if old is not None:
            os.environ["LOCALSPEC_HOME"] = old


def open_pair(pair: tuple[Path, Path], parallel: int = 1, cache_mib: int = 0, **load: object) -> Session:
    """The pair loaded as the server loads it: with `cache_mib`, a prompt cache of that budget (server.cache_ram)."""
    preset = GREEDY.with_overrides(threads=1, cache_ram=str(cache_mib), **load)
    return open_session(ModelFiles(target=pair[0], draft=pair[1], name="test"), preset, parallel=parallel,
                        prompt_cache=cache_mib > 0)


def drafting(k: int = 4, drafter: str = "model"):
    # (drafts every round: what the slots and the prompt cache hold must not follow the clock; standing aside:
    # tests/test_stand_aside.py)
    return dataclasses.replace(GREEDY.draft, n_draft=k, drafter=drafter, stand_aside=False)


def words(model: LlamaModel, text: str) -> list[int]:
    return model.tokenize(text, add_special=True)


CONVERSATIONS = [
    "The history of the Roman empire begins with the founding of the city, which",
    "A recipe for bread: mix flour, water, salt and yeast, then",
]


def test_prompt_cache_restores_a_conversation_and_the_output_is_a_cold_runs(chat_pair) -> None:
    """Two conversations take turns on one slot, each turn resending all of its history: with the cache only the
    new text is read (cache_n grows turn by turn), and every reply is bit for bit what a cold engine gives."""
    with open_pair(chat_pair, cache_mib=64, n_ctx=1024) as cached, open_pair(chat_pair, n_ctx=1024) as cold:
        target = cached.target
        history = {i: words(target, text) for i, text in enumerate(CONVERSATIONS)}
        reused = {0: [], 1: []}
        for turn in range(3):
            for who in (0, 1):
                p = history[who]
                got = collect(cached.engine.generate(p, GREEDY.sampling, drafting(), 16))
                cold.engine.reset()
                ref = collect(cold.engine.generate(p, GREEDY.sampling, drafting(), 16))
                assert got.tokens == ref.tokens
                reused[who].append(got.stats.prompt_tokens - got.stats.prompt_tokens_processed - 1)  # cache_n
                more = target.tokenize(f" Then, in part {turn + 2},", add_special=False)
                history[who] = p + got.tokens + more
        for who in (0, 1):
            assert reused[who][0] == 0 and reused[who][1] > 0 and reused[who][2] > reused[who][1]
        counters = cached.engine.prompt_cache.counters()  # type: ignore[union-attr]
        assert counters.hits == 4 and counters.entries == 2


def test_a_prompt_that_diverges_at_token_zero_is_read_whole(chat_pair) -> None:
    with open_pair(chat_pair, cache_mib=64, n_ctx=512) as s:
        a = words(s.target, CONVERSATIONS[0])
        collect(s.engine.generate(a, GREEDY.sampling, drafting(), 8))
        b = [a[1], *a[1:]]  # the first token differs
        out = collect(s.engine.generate(b, GREEDY.sampling, drafting(), 8))
        assert out.stats.prompt_tokens_processed == len(b) - 1
        assert s.engine.prompt_cache.counters().hits == 0  # type: ignore[union-attr]


def test_eviction_at_the_budget_edge_and_replies_stay_a_cold_runs(tiny_pair) -> None:
    """A budget of two and a half conversations: a third one saved evicts the least recently used, which is then
    read in full; a cached one comes back from host RAM; every reply is a cold run's."""
    from localspec.rounds.prompt_cache import PromptCache

    convs = [list(range(300 + 50 * i, 340 + 50 * i)) for i in range(4)]
    with open_pair(tiny_pair, n_ctx=256) as cold, open_pair(tiny_pair, n_ctx=256) as s:
        collect(s.engine.generate(convs[0], GREEDY.sampling, drafting(), 8))
        size = s.engine.snapshot(0).nbytes
        s.engine.prompt_cache = PromptCache(size * 5 // 2)
        s.engine.reset()

        def ask(p: list[int]):
            got = collect(s.engine.generate(p, GREEDY.sampling, drafting(), 8))
            cold.engine.reset()
            assert got.tokens == collect(cold.engine.generate(p, GREEDY.sampling, drafting(), 8)).tokens
            return got

        for p in convs:
            ask(p)  # each one's arrival saves the last: 0, 1, then 2 evicts 0; 3 is in the slot
        c = s.engine.prompt_cache.counters()
        assert c.entries == 2 and c.evicted == 1 and c.nbytes <= size * 5 // 2
        assert ask(convs[0]).stats.prompt_tokens_processed == len(convs[0]) - 1  # evicted: read in full
        # (its arrival saved 3 and evicted 1, the least recently used; 2 and 3 are cached)
        assert ask(convs[3]).stats.prompt_tokens_processed < 3  # restored


@pytest.mark.parametrize("pair_name", ["chat_pair", "tiny_pair"])
def test_save_restore_continue_equals_an_uninterrupted_run(request, pair_name: str, tmp_path: Path) -> None:
    """A slot's state saved to a file after a reply, the engine cleared, the file restored into the other slot:
    the next turn there is what the uninterrupted engine gives in its own slot, reading only the new tokens."""
    pair = request.getfixturevalue(pair_name)
    with open_pair(pair, parallel=2, n_ctx=512) as s:
        e = s.engine
        prompt = words(s.target, CONVERSATIONS[1]) if pair_name == "chat_pair" else list(range(100, 140))
        first = collect(e.generate(prompt, GREEDY.sampling, drafting(), 20, slot=0))
        more = [*prompt, *first.tokens, *prompt[1:6]]
        identities = [slot_file.identity(m) for m in e.state_models()]
        slot_file.write(tmp_path / "s.slot", e.snapshot(0), identities)
        uninterrupted = collect(e.generate(more, GREEDY.sampling, drafting(), 20, slot=0))
        e.reset()
        loaded = slot_file.read(tmp_path / "s.slot", identities, n_vocab=s.target.n_vocab, n_ctx=e.n_ctx)
        assert e.restore(1, loaded.state)
        resumed = collect(e.generate(more, GREEDY.sampling, drafting(), 20, slot=1))
        assert resumed.tokens == uninterrupted.tokens
        assert resumed.stats.prompt_tokens_processed == uninterrupted.stats.prompt_tokens_processed == 5


def test_a_file_of_another_model_is_refused_before_llama_cpp_sees_it(chat_pair, tiny_pair, tmp_path: Path) -> None:
    with open_pair(tiny_pair, n_ctx=256) as tiny:
        collect(tiny.engine.generate(list(range(100, 120)), GREEDY.sampling, drafting(), 4))
        slot_file.write(tmp_path / "tiny.slot", tiny.engine.snapshot(0),
                        [slot_file.identity(m) for m in tiny.engine.state_models()])
    with open_pair(chat_pair, n_ctx=256) as s, pytest.raises(slot_file.SlotFileError, match="saved with the target"):
        slot_file.read(tmp_path / "tiny.slot", [slot_file.identity(m) for m in s.engine.state_models()],
                       n_vocab=s.target.n_vocab, n_ctx=s.engine.n_ctx)


# -- context shift ------------------------------------------------------------------------------------------

COUNTING = "Counting from one: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


def plain_with_shifts(path: Path, prompt: list[int], n: int, n_ctx: int, n_keep: int, n_batch: int) -> list[int]:
    """Greedy plain decoding with llama-server's shift, from LlamaModel alone: one token a step; when the
    sequence holds n_ctx tokens (its cells one short of full), keep n_keep + the BOS, drop half of the rest, and
    start a fresh context holding the shifted tokens."""
    with LlamaModel(path, n_ctx=n_ctx, n_gpu_layers=0, n_batch=n_batch, n_threads=1, device_top_k=0) as model:
        seq, out = list(prompt), []
        model.decode(seq[:-1], 0)
        while len(out) < n:
            if len(seq) >= n_ctx:
                keep = n_keep + (1 if model.add_bos else 0)
                discard = (len(seq) - 1 - keep) // 2
                seq = seq[:keep] + seq[keep + discard :]
                model.clear()
                model.decode(seq[:-1], 0)
            scores = model.decode([seq[-1]], len(seq) - 1)
            assert scores is not None
            token = int(np.argmax(scores.logits[0]))
            out.append(token)
            seq.append(token)
            if model.is_eog(token):
                break
        return out


@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("pair_name", ["chat_pair", "tiny_pair"])
def test_context_shift_keeps_going_and_equals_plain_decoding_of_the_shifted_tokens(request, pair_name: str,
                                                                                    k: int) -> None:
    pair = request.getfixturevalue(pair_name)
    n_ctx, n = 96, 200
    shift = ContextSettings(context_shift=True, n_keep=8, n_discard=0)
    with open_pair(pair, n_ctx=n_ctx, n_batch=64) as s:
        prompt = words(s.target, COUNTING) if pair_name == "chat_pair" else list(range(200, 240))
        out = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(k), n, context=shift))
    expected = plain_with_shifts(pair[0], prompt, n, n_ctx, 8, 64)
    assert out.tokens == expected
    assert out.done.stop_reason == STOP_EOG or len(out.tokens) == n
    assert out.stats.context_shifts >= 2


def test_without_context_shift_it_stops_at_the_full_context(tiny_pair) -> None:
    with open_pair(tiny_pair, n_ctx=96, n_batch=64) as s:
        out = collect(s.engine.generate(list(range(200, 240)), GREEDY.sampling, drafting(), 200))
        assert out.done.stop_reason == "context_full" and len(out.tokens) < 96



# -- the chat's /save and /load --------------------------------------------------------------------------------


def test_chat_save_then_load_in_a_new_session_goes_on_without_reading_again(chat_pair, tmp_path: Path) -> None:
    """Two turns, /save; a new session (another engine) /loads it: the third turn reads only its own message and
    replies as the uninterrupted conversation does."""
    from localspec.sessions.chat import ChatSession

    preset = GREEDY.with_overrides(threads=1, n_ctx=1024)
    files = ModelFiles(target=chat_pair[0], draft=chat_pair[1], name="demo-chat")
    with open_session(files, preset) as first:
        chat = ChatSession(first.engine, first.target, preset, system="Be brief.", max_tokens=12)
        for text in ("Name a planet.", "And a moon?"):
            list(chat.send(text))
        saved = chat.save(tmp_path / "chat.json")
        list(chat.send("And a star?"))
        uninterrupted = chat.turns[-1]
    with open_session(files, preset) as second:
        resumed = ChatSession(second.engine, second.target, preset, system="Something else.", max_tokens=12)
        loaded = resumed.load(saved.transcript)
        assert loaded.tokens == saved.tokens and resumed.system == "Be brief." and len(resumed.messages) == 5
        list(resumed.send("And a star?"))
        turn = resumed.turns[-1]
        assert turn.reply == uninterrupted.reply
        assert turn.prompt_tokens_processed == uninterrupted.prompt_tokens_processed < 20


def test_chat_load_refuses_what_does_not_belong_and_changes_nothing(chat_pair, tmp_path: Path) -> None:
    from localspec.errors import LocalspecError
    from localspec.sessions.chat import ChatSession

    preset = GREEDY.with_overrides(threads=1, n_ctx=512)
    files = ModelFiles(target=chat_pair[0], draft=chat_pair[1], name="demo-chat")
    with open_session(files, preset) as s:
        chat = ChatSession(s.engine, s.target, preset, max_tokens=8)
        list(chat.send("Name a planet."))
        a = chat.save(tmp_path / "a.json")
        list(chat.send("And a moon?"))
        b = chat.save(tmp_path / "b.json")
        data = json.loads(a.transcript.read_text())
        data["kv"]["file"] = b.kv.name  # another save's cells
        (tmp_path / "mixed.json").write_text(json.dumps(data))
        del data["kv"]
        (tmp_path / "old.json").write_text(json.dumps(data))
        (tmp_path / "junk.json").write_text("{not json")
        before = (list(chat.messages), s.engine.cached_tokens)
        for name, why in (("mixed.json", "belongs to another save"), ("old.json", "no KV state was saved"),
                          ("junk.json", "not a transcript"), ("missing.json", "cannot read")):
            with pytest.raises(LocalspecError, match=why):
                chat.load(tmp_path / name)
            assert (list(chat.messages), s.engine.cached_tokens) == before


def test_chat_load_of_a_drafters_part_that_does_not_fit_is_one_line_and_changes_nothing(chat_pair, tmp_path: Path,
                                                                                        monkeypatch) -> None:
    """/load where a drafter refuses its part of the state file (an MTP head's of another width: the engine's
    check, `SlotCells.with_parts`, stands in here for this pair, which has no head): one line naming the .kv file,
    and the chat is as it was."""
    from localspec.errors import LocalspecError
    from localspec.rounds.slot_file import SlotFileError
    from localspec.sessions.chat import ChatSession

    preset = GREEDY.with_overrides(threads=1, n_ctx=512)
    files = ModelFiles(target=chat_pair[0], draft=chat_pair[1], name="demo-chat")
    with open_session(files, preset) as s:
        chat = ChatSession(s.engine, s.target, preset, max_tokens=8)
        list(chat.send("Name a planet."))
        saved = chat.save(tmp_path / "a.json")
        list(chat.send("And a moon?"))
        before = (list(chat.messages), s.engine.cached_tokens)

        def refuse(state, parts):
            raise SlotFileError("its mtp drafter's part does not fit: width is 8; the MTP head here is 16 wide")

        monkeypatch.setattr(s.engine.cells, "with_parts", refuse)
        with pytest.raises(LocalspecError, match=rf"{saved.kv.name}: its mtp drafter's part does not fit"):
            chat.load(saved.transcript)
        assert (list(chat.messages), s.engine.cached_tokens) == before


def test_chat_with_context_shift_keeps_the_system_prompt_and_goes_on(chat_pair) -> None:
    """A reply longer than the context goes on; what stays at the start is the system prompt; the next message
    drops the oldest turns to fit."""
    from localspec.sessions.chat import ChatSession

    preset = GREEDY.with_overrides(threads=1, n_ctx=96, repeat_penalty=1.0, context_shift=True)
    files = ModelFiles(target=chat_pair[0], draft=chat_pair[1], name="demo-chat")
    with open_session(files, preset) as s:
        chat = ChatSession(s.engine, s.target, preset, system="You count.", max_tokens=300)
        list(chat.send("Count from 1 to 200, separated by commas."))
        turn = chat.turns[-1]
        assert turn.stats is not None and turn.stats.context_shifts >= 1
        assert turn.tokens > 96 or turn.stop_reason == STOP_EOG
        system = chat.prompt_tokens([{"role": "system", "content": "You count."}])
        held = s.engine.cached_tokens
        assert held[: len(system) - 4] == tuple(system[: len(system) - 4])  # the system prompt stayed
        events = list(chat.send("Again, from 5."))
        assert chat.turns[-1].dropped_turns >= 1 or chat.turns[-1].prompt_tokens < 96
        assert events


def test_generate_with_context_shift_goes_past_the_context(tiny_pair) -> None:
    from tests.test_serve import run_cli

    base = ["generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--ctx", "96", "--threads",
            "1", "--temp", "0", "--max-tokens", "150", "--json", "Once upon a time"]
    shifted = json.loads(run_cli(Path("/nonexistent-home"), *base, "--context-shift"))
    assert shifted["tokens"] == 150 or shifted["stop_reason"] == "eog"
    assert shifted["stats"]["context_shifts"] >= 1
