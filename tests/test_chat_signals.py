"""Ctrl-C in `localspec chat` under hostile timing: however and whenever SIGINT arrives, the chat answers it and the
conversation goes on.

The two ways a Ctrl-C used to be lost (docs/architecture.md, "Ctrl-C in the chat"): a SIGINT whose C-level handler
ran while the prompt's blocking read was about to start, or on another thread, did not interrupt that read, so the
answer waited for the next Enter; and a Ctrl-C between the end of a reply and the next prompt raised out of the
conversation and ended the chat. (A chat started with SIGINT ignored is in test_chat_tty.py: it needs the CLI.)
"""

from __future__ import annotations

import io
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from localspec.cli.chat_cmd import ChatView, CtrlC
from localspec.config import load_preset
from localspec.errors import UsageError
from localspec.sessions.chat import ChatSession
from localspec.sessions.session import ModelFiles, open_session

pexpect = pytest.importorskip("pexpect")

# The chat's prompt loop alone (no model: a Ctrl-C and a Ctrl-D never reach the conversation), in a terminal.
# A thread of its own takes the SIGINT once the prompt is drawn and the main thread has slept in its read for a
# while: Python's C-level handler then runs on that thread, and the main thread's read is not interrupted. This is
# the state a Ctrl-C arriving just before the read starts leaves too, staged so that it happens every time.
STAGED_PROMPT = """
import signal, sys, threading, time
from rich.console import Console
from localspec.cli.chat_cmd import ChatView

main_thread = threading.get_native_id()
prompt_drawn = threading.Event()


class Screen(Console):
    def print(self, *objects, **kwargs):
        super().print(*objects, **kwargs)
        if any("you›" in str(o) for o in objects):
            prompt_drawn.set()


def main_thread_sleeps():
    with open(f"/proc/self/task/{main_thread}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "S"


def sigint_on_this_thread():
    prompt_drawn.wait()
    asleep = 0
    while asleep < 20:  # 0.2 s in a row: blocked in the read, not waiting a moment for the GIL
        asleep = asleep + 1 if main_thread_sleeps() else 0
        time.sleep(0.01)
    # The marker goes out first: printed after the kill, it could follow the chat's answer (the main thread may
    # take the GIL between the two), and the test would wait for an answer that had already gone by.
    print("[staged SIGINT sent]", flush=True)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


threading.Thread(target=sigint_on_this_thread, daemon=True).start()
ChatView(Screen(highlight=False), None).run()
"""


def test_a_sigint_that_misses_the_prompts_read_is_still_answered() -> None:
    env = {**os.environ, "TERM": "xterm-256color"}
    child = pexpect.spawn(sys.executable, ["-c", STAGED_PROMPT], env=env, encoding="utf-8", timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        child.expect(r"\[staged SIGINT sent\]")
        # Answered without a key pressed; before the fix the hint only came after the next Enter.
        child.expect(r"Ctrl-D or /exit quits", timeout=30)
        child.expect("you›")
        child.sendintr()  # and Ctrl-C from the terminal, as usual
        child.expect(r"Ctrl-D or /exit quits")
        child.expect("you›")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


class _CtrlCAtStats(Console):
    """A console whose user presses Ctrl-C the moment a reply's stats line is drawn: the reply is over, the next
    prompt not yet shown (the first reply's only: /stats prints the same words)."""

    pressed = False

    def print(self, *objects, **kwargs) -> None:
        super().print(*objects, **kwargs)
        if not self.pressed and any("prompt tokens processed" in str(o) for o in objects):
            self.pressed = True
            os.kill(os.getpid(), signal.SIGINT)


def _pipe(data: bytes) -> int:
    read, write = os.pipe()
    os.write(write, data)
    os.close(write)
    return read


def _typed(text: bytes) -> io.TextIOWrapper:
    """What the user types, then the end of input: a pipe holding it, to stand in for the chat's stdin."""
    return open(_pipe(text), encoding="utf-8")


@pytest.mark.slow
def test_ctrl_c_as_a_reply_ends_keeps_the_conversation(tiny_pair: tuple[Path, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = tiny_pair
    preset = load_preset("greedy").with_overrides(n_ctx=256, n_batch=64)
    screen = io.StringIO()
    before = signal.getsignal(signal.SIGINT)
    with open_session(ModelFiles(target=target, draft=draft, name="tiny"), preset) as session:
        chat = ChatSession(session.engine, session.target, session.preset, max_tokens=8)
        view = ChatView(_CtrlCAtStats(file=screen, highlight=False, width=200), chat)
        with _typed(b"hello\n") as stdin:
            monkeypatch.setattr(sys, "stdin", stdin)
            try:
                view.run()  # the reply, the Ctrl-C as its stats line is drawn, the next prompt, the end of input
            except KeyboardInterrupt:
                pytest.fail(f"the Ctrl-C after the reply ended the chat:\n{screen.getvalue()}")
        assert signal.getsignal(signal.SIGINT) is before  # the chat gave SIGINT back as it found it
        with _typed(b"/stats\n/exit\n") as stdin:
            monkeypatch.setattr(sys, "stdin", stdin)
            view.run()  # the same conversation goes on
    shown = screen.getvalue()
    stats = shown.index("prompt tokens processed")
    assert shown.index("(Ctrl-D or /exit quits)", stats) < shown.index("turns 1 ", stats)  # answered, then on


# -- the prompt's reader (no model, no terminal) ---------------------------------------------------------------


def test_the_reader_splits_lines_keeps_a_last_partial_one_and_ends_with_eof() -> None:
    stdin = _pipe("one\nzwei ü\n\nlast without newline".encode())
    with CtrlC() as ctrl_c:
        assert [ctrl_c.read_line(stdin) for _ in range(4)] == ["one", "zwei ü", "", "last without newline"]
        with pytest.raises(EOFError):
            ctrl_c.read_line(stdin)
    os.close(stdin)


def test_a_ctrl_c_before_or_during_the_wait_is_answered_and_drops_what_was_typed() -> None:
    """As the terminal drops its unread input on Ctrl-C, the reader drops what it holds and has not returned."""
    read, write = os.pipe()
    os.write(write, b"one\ntwo\n")

    def ctrl_c_once_read() -> None:
        while select.select([read], [], [], 0)[0]:  # the reader has not taken the bytes yet
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    with CtrlC() as ctrl_c:
        os.kill(os.getpid(), signal.SIGINT)  # before any read; the chat's handler takes it: nothing raises here
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.read_line(read)
        assert ctrl_c.read_line(read) == "one"  # "two" came in the same read, and waits
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.read_line(read)  # "two" dropped
        os.write(write, b"half a li")  # read, then the wait for the rest of the line, which a Ctrl-C ends
        threading.Thread(target=ctrl_c_once_read, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.read_line(read)
        os.write(write, b"three\n")
        assert ctrl_c.read_line(read) == "three"
    os.close(read)
    os.close(write)


def test_the_wakeup_byte_alone_is_a_ctrl_c_answered_once() -> None:
    """The state the staged test above leaves when the main thread's eval loop is never asked to run the Python
    handler: the C-level handler's byte in the wakeup pipe, `hit` not set. The byte alone is a Ctrl-C; and a Ctrl-C
    whose handler did run is answered once, not again for its byte (nor, at a reply's end, again at the prompt)."""
    stdin, typed = os.pipe()
    with CtrlC() as ctrl_c:
        os.write(ctrl_c._wake_w, bytes([signal.SIGINT]))  # as trip_signal writes it; no handler run
        assert not ctrl_c.hit
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.read_line(stdin)
        os.write(ctrl_c._wake_w, bytes([signal.SIGUSR1]))  # another signal's byte wakes the poll, answers nothing
        os.write(typed, b"kept\n")
        assert ctrl_c.read_line(stdin) == "kept"
        os.kill(os.getpid(), signal.SIGINT)  # handler and byte: one Ctrl-C
        assert ctrl_c.take()  # as a reply stops on it
        assert not ctrl_c.take()
        os.write(typed, b"next\n")
        assert ctrl_c.read_line(stdin) == "next"  # the prompt after that reply answers nothing
    os.close(stdin)
    os.close(typed)


def test_a_line_that_is_not_utf8_is_named_and_the_next_one_reads() -> None:
    stdin = _pipe(b"ok\n\xff bad\nfine\n")
    with CtrlC() as ctrl_c:
        assert ctrl_c.read_line(stdin) == "ok"
        with pytest.raises(UsageError, match=r"^the chat input: not UTF-8 text \(byte 0xff at offset 0\)$"):
            ctrl_c.read_line(stdin)
        assert ctrl_c.read_line(stdin) == "fine"
    os.close(stdin)


def test_sigint_and_the_wakeup_fd_are_given_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    with CtrlC():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.set_wakeup_fd(-1) == -1  # none left set
