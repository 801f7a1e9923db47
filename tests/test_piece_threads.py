"""A token's text is the same whichever other thread asks the model for text meanwhile.

The server's engine thread turns each generated token into text (`LlamaModel.piece`) while the event loop
detokenizes too (a native /completion reply's `prompt` field, /detokenize, /tokenize with pieces). With one
buffer per model shared by both threads, the engine thread read the other thread's text: a two-slot server's
greedy reply said "... New Haven col plagued ..." (" col" from the other request's prompt) where the tokens were
"... New Haven was plagued ..." (docs/lab/2026-12-01-slots-ubatches.md).
"""

from __future__ import annotations

import os
import threading

import llama_cpp
import pytest

from localspec.llama.model import LlamaModel
from tests.test_serve import Server
from tests.test_serve_llama import alone_and_together

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tiny_pair):
    with LlamaModel(tiny_pair[0], n_ctx=64, device_top_k=0, n_gpu_layers=0, devices=[]) as m:
        yield m


def two_tokens_of_distinct_text(model: LlamaModel) -> tuple[int, int]:
    by_text: dict[bytes, int] = {}
    for token in range(model.n_vocab):
        text = model.piece(token)
        if len(text) == 3:
            by_text.setdefault(text, token)
        if len(by_text) == 2:
            break
    a, b = by_text.values()
    return a, b


def test_a_piece_is_its_own_token_text_when_another_thread_asks_in_between(model, monkeypatch):
    """Deterministic: another thread runs a whole `piece` call between llama.cpp writing this call's text and
    this call reading it (the moment ctypes releases the GIL)."""
    a, b = two_tokens_of_distinct_text(model)
    want_a, want_b = model.piece(a), model.piece(b)
    real = llama_cpp.llama_token_to_piece
    meanwhile: list[bytes] = []

    def interleaved(vocab, token, buf, length, lstrip, special):
        n = real(vocab, token, buf, length, lstrip, special)
        if token == a and not meanwhile:
            other = threading.Thread(target=lambda: meanwhile.append(model.piece(b)))
            other.start()
            other.join(timeout=60)
        return n

    monkeypatch.setattr(llama_cpp, "llama_token_to_piece", interleaved)
    assert model.piece(a) == want_a
    assert meanwhile == [want_b]


def test_two_threads_detokenizing_at_once_each_read_their_own_text(model):
    """The same race without staging it: two threads turning different tokens into text as fast as they can."""
    a, b = two_tokens_of_distinct_text(model)
    want = {a: model.piece(a), b: model.piece(b)}
    wrong: list[tuple[int, bytes]] = []
    start = threading.Barrier(2)

    def spin(token: int) -> None:
        start.wait(timeout=60)
        for _ in range(20_000):
            got = model.piece(token)
            if got != want[token]:
                wrong.append((token, got))
                return

    threads = [threading.Thread(target=spin, args=(t,)) for t in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []


# Put in the server's process as sitecustomize: a thread that has just turned a token into text is descheduled
# for a moment before it reads it, as on a loaded box (where the serve test failed 5 of 20 times). Not inside the
# one-off scan of the whole vocabulary for its longest text (`LlamaModel.max_piece_bytes`, on the first request):
# 49,152 pauses there cost 25 s and race nothing, as no other request runs yet.
DESCHEDULED = """
import functools
import threading
import time
import llama_cpp
from localspec.llama.model import LlamaModel
_real = llama_cpp.llama_token_to_piece
_scanning = threading.local()
def _descheduled(*args):
    n = _real(*args)
    if not getattr(_scanning, "on", False):
        time.sleep(0.0005)
    return n
llama_cpp.llama_token_to_piece = _descheduled
_scan = LlamaModel.max_piece_bytes.func
def _scan_undelayed(self):
    _scanning.on = True
    try:
        return _scan(self)
    finally:
        _scanning.on = False
LlamaModel.max_piece_bytes = functools.cached_property(_scan_undelayed)
LlamaModel.max_piece_bytes.__set_name__(LlamaModel, "max_piece_bytes")
"""


def test_a_two_slot_server_descheduled_after_each_piece_still_gives_each_reply_its_own_text(demo_home, tmp_path,
                                                                                           monkeypatch):
    """The serve test's two requests at once, on a server whose threads pause inside every token-to-text call:
    without a buffer per call, each run's replies held the other prompt's words (3 of 3)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DESCHEDULED)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    server = Server(demo_home, tmp_path, "--pair", "demo-chat", "--parallel", "2")
    try:
        got, alone = alone_and_together(server)
    finally:
        server.stop()
    assert got == {0: alone[0], 1: alone[1]}
