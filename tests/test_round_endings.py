"""However a reply ends inside a speculative round (an end-of-generation token among accepted drafts, max_tokens, a
stop string or a cancel: the caller's stop after a token, the consumer closing the stream, a full context), the
slot then holds exactly what plain decoding's holds for the same request: its token list, the target's bookkeeping
and real cells, a saved state's token count; and no model's cells hold a token that was not committed. Through
the real llama.cpp on the tiny GGUF pairs: SmolLM2-Instruct drafting for itself (every draft accepted, and it ends
its replies with <|im_end|>), the tiny pair, the hybrid pair (a recurrent target rolls back once a decode) and
the server's worker (stop strings, cancel)."""

from __future__ import annotations

import dataclasses
import itertools
import queue

import llama_cpp  # noqa: I001  -- before numpy (docs/gpu.md)
import numpy as np
import pytest

from localspec.config import load_preset
from localspec.rounds.engine import Engine
from localspec.rounds.events import STOP_CONTEXT_FULL, STOP_EOG, STOP_MAX_TOKENS, STOP_REQUESTED, DoneEvent, collect
from localspec.sessions.session import ModelFiles, open_session

pytestmark = pytest.mark.slow

# (drafts every round: these tests look at drafts; standing aside: tests/test_stand_aside.py)
GREEDY = load_preset("greedy").with_overrides(threads=1, stand_aside=False)
CHAT = "<|im_start|>user\nWrite one short sentence about the sea.<|im_end|>\n<|im_start|>assistant\n"


def drafting(k: int, drafter: str = "model"):
    return dataclasses.replace(GREEDY.draft, n_draft=k, drafter=drafter)


def cells(model, seq: int) -> int:
    """The cells llama.cpp holds for the sequence (not the bookkeeping): its highest position + 1."""
    return int(llama_cpp.llama_memory_seq_pos_max(model.memory, seq)) + 1


def held(engine: Engine, slot: int = 0) -> dict[str, object]:
    """What the slot holds after a reply: its tokens, the target's bookkeeping, the target's real cells, and a
    saved state's count (what `/slots` and a slot file report). Every drafter model's cells hold committed tokens
    only (checked here)."""
    s = engine.slots[slot]
    for model, kv in engine.cells.cells(slot)[1:]:
        assert kv == s.tokens[: len(kv)], "a draft model holds tokens that were never committed"
        assert cells(model, slot) == len(kv)
    out = {"tokens": list(s.tokens), "target_kv": list(s.target_kv), "cells": cells(engine.target, slot)}
    out["saved"] = engine.snapshot(slot).models[0].n_tokens
    return out


def run(engine: Engine, prompt: list[int], k: int, max_tokens: int, stop_after: int | None = None,
        close_after: int | None = None, drafter: str = "model") -> tuple[list[int], DoneEvent | None]:
    """A reply in slot 0, which starts empty (its prompt decoded in full): stopped by the caller after `stop_after`
    tokens, or by closing the stream after `close_after`."""
    engine.erase(0)
    tokens: list[int] = []
    stop = (lambda: len(tokens) >= stop_after) if stop_after is not None else None
    events = engine.generate(prompt, GREEDY.sampling, drafting(k, drafter), max_tokens, stop)
    done = None
    for event in events:
        if isinstance(event, DoneEvent):
            done = event
            break
        tokens.append(event.token)
        if close_after is not None and len(tokens) >= close_after:
            events.close()
            break
    return tokens, done


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    with open_session(ModelFiles(target=smollm2_path, draft=smollm2_path, name="self"), GREEDY) as s:
        yield s


def test_an_end_of_generation_among_accepted_drafts_leaves_what_plain_decoding_does(smollm2):
    """The round that accepts <|im_end|> goes on past it (its later drafts accepted, the target's own token after
    them): none of that stays in the slot."""
    engine = smollm2.engine
    prompt = smollm2.target.tokenize(CHAT, parse_special=True)
    plain, done_plain = run(engine, prompt, 0, 200)
    want = held(engine)
    spec, done = run(engine, prompt, 6, 200)
    assert done is not None and done_plain is not None
    assert done.stop_reason == done_plain.stop_reason == STOP_EOG and spec == plain
    assert done.stats.rounds < done.stats.tokens  # drafts were accepted (the round went on past <|im_end|>)
    assert held(engine) == want
    assert want["tokens"][-1] == engine.slots[0].tokens[-1] and smollm2.target.is_eog(want["tokens"][-1])
    assert want["cells"] == want["saved"] == len(prompt) + len(plain)  # the end token itself is never decoded


@pytest.mark.parametrize(("how", "n"), [("stop", 3), ("stop", 5), ("close", 4), ("max_tokens", 5)])
def test_a_reply_stopped_inside_a_round_leaves_what_plain_decoding_does(smollm2, how, n):
    """The caller's stop after a token (a stop string, a cancel), the consumer closing the stream, max_tokens: the
    tokens after that one in the round leave the slot and the target's cells."""
    engine = smollm2.engine
    prompt = smollm2.target.tokenize(CHAT, parse_special=True)
    kw = {"stop_after": n} if how == "stop" else {"close_after": n} if how == "close" else {}
    max_tokens = n if how == "max_tokens" else 200
    plain, done_plain = run(engine, prompt, 0, max_tokens, **kw)
    want = held(engine)
    spec, done = run(engine, prompt, 6, max_tokens, **kw)
    assert spec == plain and len(spec) == n
    if how != "close":
        assert done is not None and done_plain is not None
        assert done.stop_reason == done_plain.stop_reason == (STOP_REQUESTED if how == "stop" else STOP_MAX_TOKENS)
    assert held(engine) == want
    assert len(want["tokens"]) == len(prompt) + n


def test_a_full_context_leaves_what_plain_decoding_does(tiny_pair):
    with open_session(ModelFiles(tiny_pair[0], tiny_pair[1], "test"), GREEDY.with_overrides(n_ctx=64)) as s:
        prompt = np.random.default_rng(1).integers(100, 40_000, size=20).tolist()
        plain, done_plain = run(s.engine, prompt, 0, 500)
        want = held(s.engine)
        spec, done = run(s.engine, prompt, 6, 500)
        assert done is not None and done_plain is not None
        assert done.stop_reason == done_plain.stop_reason == STOP_CONTEXT_FULL and spec == plain
        assert held(s.engine) == want and len(want["tokens"]) == 64


@pytest.mark.parametrize("drafter", ["model", "mtp"])
def test_a_recurrent_target_stopped_inside_a_round_keeps_what_plain_decoding_does(hybrid_pair_high, drafter):
    """A hybrid target rolls its recurrent state back once a decode: the rejected drafts and the round's tokens
    after the stop go in that one rewind, exactly (no fall back to the prompt's checkpoint), and the next turn
    reuses all of it."""
    files = ModelFiles(hybrid_pair_high[0], hybrid_pair_high[1], "hybrid")
    with open_session(files, GREEDY.with_overrides(n_draft=6, n_ctx=512, threads=1)) as s:
        prompt = np.random.default_rng(3).integers(100, 40_000, size=10).tolist()
        for stop_after in (2, 5, 9):
            plain, _ = run(s.engine, prompt, 0, 64, stop_after=stop_after)
            want = held(s.engine)
            spec, done = run(s.engine, prompt, 6, 64, stop_after=stop_after, drafter=drafter)
            assert done is not None and done.stop_reason == STOP_REQUESTED
            assert spec == plain and held(s.engine) == want
            # The next turn reuses every cell: nothing was lost to a checkpoint.
            turn = [*s.engine.slots[0].tokens, 321, 654]
            again = collect(s.engine.generate(turn, GREEDY.sampling, drafting(6, drafter), 4))
            assert again.stats.prompt_tokens_processed == 2


def test_the_worker_leaves_a_slot_as_plain_decoding_does_after_a_stop_string_and_a_cancel(smollm2):
    """Through the server's worker: a stop string that completes inside a run of accepted drafts, and a cancel
    after the first text (the engine's next check), leave `/slots`' n_tokens and the saved slot's count at plain
    decoding's."""
    from localspec.server.worker import Delta, Finished, Job, Worker
    from tests.helpers_serve import find_stop_in_draft_run

    engine = smollm2.engine
    prompt = smollm2.target.tokenize(CHAT, parse_special=True)
    case = find_stop_in_draft_run(engine, prompt, GREEDY.sampling, drafting(6), 60)
    worker = Worker(engine, queue_size=2)
    worker.start()
    try:
        def serve(k: int, stops: tuple[str, ...], cancel_after: int | None) -> tuple[str, dict[str, object], int]:
            done: queue.Queue = queue.Queue()
            texts = itertools.count()

            def sink(item) -> None:
                if isinstance(item, Delta):
                    if cancel_after is not None and next(texts) + 1 >= cancel_after:
                        worker.cancel(job)
                else:
                    done.put(item)

            job = Job(prompt=prompt, sampling=GREEDY.sampling, drafting=drafting(k), max_tokens=60, stops=stops,
                      sink=sink, slot=0)
            worker.in_slot(0, lambda: engine.erase(0)).result(timeout=60)
            worker.submit(job)
            item = done.get(timeout=300)
            assert isinstance(item, Finished), item
            view = worker.slot_views()[0]
            state = worker.in_slot(0, lambda: held(engine)).result(timeout=60)
            assert view.n_tokens == len(state["tokens"])  # type: ignore[arg-type]
            return item.result.text, state, view.n_tokens

        for stops, cancel_after in (((case.stop,), None), ((), 2)):
            plain = serve(0, stops, cancel_after)
            spec = serve(6, stops, cancel_after)
            assert spec == plain, (stops, cancel_after)
        assert serve(6, (case.stop,), None)[0] == case.text[: case.cut]
    finally:
        worker.shutdown(timeout=30)


_CLOSED_UNDER_A_ROUND = """
import gc, sys
from localspec.config import load_preset
from localspec.sessions.session import ModelFiles, open_session
import dataclasses
preset = load_preset("greedy").with_overrides(threads=1)
session = open_session(ModelFiles(target=sys.argv[1], draft=sys.argv[2], name="tiny"), preset)
events = session.engine.generate([1, 2, 3, 4], preset.sampling, dataclasses.replace(preset.draft, n_draft=4), 64)
next(events)  # suspended inside a round's events: its rejected drafts not yet settled
session.close()  # the models are freed (a Ctrl-C between two tokens: the CLI closes the session, then exits)
events.close()  # ... and the garbage collector closes the generation's iterator after that
gc.collect()
print("ok")
"""


def test_a_generation_closed_after_its_models_were_freed_rewinds_nothing(tiny_pair):
    """A generation whose iterator is closed after the session was (the collector may do it at exit) must not
    rewind models that no longer exist: a rewind there read freed memory (a segfault at exit after Ctrl-C)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _CLOSED_UNDER_A_ROUND, str(tiny_pair[0]), str(tiny_pair[1])],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok" and "Exception ignored" not in run.stderr, \
        (run.returncode, run.stderr[-2000:])
