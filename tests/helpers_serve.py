"""Shared by the server tests: the demo pair's files, and a stop string that lands inside an accepted draft run."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localspec.cli.serve_cmd import listen, uvicorn_server
from localspec.config import Preset, load_preset
from localspec.errors import TooManyTokens
from localspec.models import demo
from localspec.rounds.engine import Engine
from localspec.rounds.events import DoneEvent, TokenEvent
from localspec.server.handling import Backend
from localspec.sessions.session import ModelFiles
from tests.helpers_fake import FakeModel

PROMPT = "The three primary colours are"
# SmolLM2's `<gh_stars>`, `<issue_start>`, `<issue_comment>`: control tokens the tiny pair names as its FIM
# prefix, suffix and middle markers (SmolLM2 itself has none).
FIM_TOKENS = (7, 8, 9)


def demo_files(home: Path) -> ModelFiles:
    folder = home / "cache" / "demo"
    return ModelFiles(target=folder / demo.TARGET_FILE, draft=folder / demo.DRAFT_FILE, name="demo")


@dataclass(frozen=True)
class StopInRun:
    text: str  # the whole greedy completion
    stop: str  # starts inside one accepted draft token and ends inside a later one of the same run
    cut: int  # where the stop starts in `text`
    tokens_through_stop: int  # tokens generated up to the one that completes the stop
    returned_tokens: int  # tokens whose text starts before the cut
    returned_from_draft: int


def find_stop_in_draft_run(engine: Engine, prompt: list[int], sampling, drafting, n: int) -> StopInRun:
    """Generate once (greedy: the server will generate the same), then pick a stop inside a run of >= 3 accepted
    draft tokens: from the middle of the run's 2nd token to the middle of its 3rd."""
    events = [e for e in engine.generate(prompt, sampling, drafting, n) if not isinstance(e, DoneEvent)]
    assert all(isinstance(e, TokenEvent) for e in events)
    texts = [e.text for e in events]
    starts = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    full = "".join(texts)
    for i in range(len(events) - 2):
        run = events[i : i + 3]
        if not all(e.from_draft for e in run) or any(len(e.text) < 2 for e in run[1:]):
            continue
        second, third = texts[i + 1], texts[i + 2]
        begin = starts[i + 1] + len(second) // 2
        end = starts[i + 2] + len(third) // 2  # exclusive, so the stop ends inside the 3rd token
        stop = full[begin:end]
        if not stop.strip() or full.find(stop) != begin:
            continue
        returned = sum(1 for s in starts if s < begin)
        return StopInRun(text=full, stop=stop, cut=begin, tokens_through_stop=i + 3, returned_tokens=returned,
                         returned_from_draft=sum(e.from_draft for e in events[:returned]))
    raise AssertionError(f"no run of 3 accepted draft tokens in {full!r}")


# -- the server over a scripted model (the fast lane: no llama.cpp model is loaded) ------------------------------

CHATML = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


class FakeTextModel(FakeModel):
    """tests/helpers_fake.FakeModel (scripted scores, checked KV bookkeeping) with the tokenizer surface the server
    reads: each character is one token (its code point modulo the vocabulary), a token's text is `<id>`. `delay`:
    seconds each decode takes (a job that runs long enough to be cancelled)."""

    add_bos = False
    bos = -1
    eos = -1
    control_texts: frozenset[str] = frozenset()
    max_piece_bytes = 4  # a character is one token and at most 4 bytes of UTF-8

    def __init__(self, *, template: str | None = CHATML, delay: float = 0.0, name: str = "fake-target.gguf",
                 **fake: object) -> None:
        super().__init__(**fake)  # type: ignore[arg-type]
        self.template = template
        self.delay = delay
        self.path = Path(name)

    def decode_many(self, items):  # type: ignore[no-untyped-def]
        if self.delay:
            time.sleep(self.delay)
        return super().decode_many(items)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False,
                 limit: int | None = None) -> list[int]:
        if limit is not None and len(text) > limit:
            raise TooManyTokens(f"the text has {len(text)} tokens", len(text))
        return [ord(c) % self.n_vocab for c in text]

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return "".join(self.piece(t).decode() for t in tokens)

    def token_text(self, token: int) -> str:
        return self.piece(token).decode()

    def metadata(self, key: str) -> str | None:
        return self.template if key == "tokenizer.chat_template" else None

    def fim_tokens(self) -> dict[str, int | None]:
        return {"pre": 1, "suf": 2, "mid": 3, "rep": None, "sep": None}


def fake_backend(*, vocab: int = 16, n_ctx: int = 256, slots: int = 1, delay: float = 0.0, queue: int = 4,
                 preset: Preset | None = None, draft: bool = True) -> Backend:
    """A loaded Backend over FakeTextModel target and draft (the real Engine, drafters and Worker). The target
    plays llama.cpp's device sampler too (its own random stream for device draws)."""
    target = FakeTextModel(vocab=vocab, seed=3, n_ctx=n_ctx, n_seq=slots, delay=delay, device_top_k=64)
    helper = FakeTextModel(vocab=vocab, seed=3, noise=1.0, n_ctx=n_ctx, n_seq=slots,
                           name="fake-draft.gguf") if draft else None
    # (a fixed drafting pattern: the fake models' costs would make standing aside follow the clock, and these
    # tests hold seeds and drafts to exact texts; tests/test_stand_aside.py checks standing aside)
    chosen = preset or load_preset("greedy").with_overrides(n_ctx=n_ctx, stand_aside=False)
    return Backend.build(Engine(target, helper), target, chosen, queue)  # type: ignore[arg-type]


@contextmanager
def live_server(app: Any, read_timeout: float = 5.0, send_buffer: int | None = None,
                header_timeout: float | None = None) -> Iterator[str]:
    """`app` behind the server's own uvicorn set-up (the guarded protocol) on a free loopback port, in a thread;
    yields its root URL. `send_buffer`: the accepted sockets' kernel send buffer (Linux copies it from the
    listening socket; small, a client that reads nothing fills it at once). `header_timeout`: as `read_timeout`
    unless given."""
    sock = listen("127.0.0.1", 0)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    server = uvicorn_server(app, lambda: None, header_timeout or read_timeout, read_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> float:
    """Poll `check` until it holds; returns the seconds it took (AssertionError past `timeout`)."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s"
        time.sleep(0.01)
    return time.monotonic() - t0
