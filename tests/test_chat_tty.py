"""`localspec chat` in a real terminal (pexpect gives it a pty): what a user sees and types.

The Gemma demo pair runs the main conversation (a real model, so prefix reuse and draft colours are realistic);
the tiny generated pair, named by path, fills its context quickly for the context-full cases; `chat` with no
arguments runs the instruct demo (SmolLM2) from a clean home, as a new user would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

pytestmark = pytest.mark.slow

STATS = re.compile(r"(\d+) tokens · [\d.]+ tok/s · ([^\r\n]*?) · mean accepted [\d.]+ · "
                   r"prompt tokens processed (\d+)/(\d+)")
DRAFT_COLOUR = "\x1b[36m"  # cyan, DRAFT_STYLE in cli/chat_cmd.py
PROMPT = "you›"


# Wide enough that no stats line wraps: one that says why drafting stood aside runs past 200 columns (rich then
# breaks it between words, and STATS, one line, never matches: a CI failure once, after a 240 s wait).
COLUMNS = 1000


def spawn(home: Path, *args: str, timeout: int = 240, preexec_fn: Callable[[], None] | None = None):
    env = {**os.environ, "LOCALSPEC_HOME": str(home), "TERM": "xterm-256color", "COLUMNS": str(COLUMNS)}
    for key in ("NO_COLOR", "FORCE_COLOR", "LOCALSPEC_DEBUG"):
        env.pop(key, None)
    child = pexpect.spawn(sys.executable, ["-c", "from localspec.cli.app import main; main()", "chat", *args],
                          env=env, encoding="utf-8", timeout=timeout, dimensions=(50, COLUMNS), preexec_fn=preexec_fn)
    child.expect("coloured like this")
    child.expect(PROMPT)
    return child


def turn(child, text: str) -> tuple[str, re.Match[str]]:
    """Send a message; return what the reply printed (with its colour codes) and the stats line's match."""
    reply, stats, _ = turn_with_notes(child, text)
    return reply, stats


def turn_with_notes(child, text: str, spinner: bool = False) -> tuple[str, re.Match[str], str]:
    """`turn`, plus what was printed after the stats line (a cut reply, a full context). `spinner`: expect the
    line that shows while the prompt is read, before the reply's label."""
    child.sendline(text)
    if spinner:
        child.expect("waiting for the first token")
    child.expect("model›")
    child.expect(STATS)
    reply, stats = child.before, child.match
    child.expect(PROMPT)
    return reply, stats, child.before


def command(child, line: str, answer: str) -> str:
    child.sendline(line)
    child.expect(answer)
    printed = child.before + child.after
    child.expect(PROMPT)
    return printed


def ctrl_c_at_the_prompt(child) -> None:
    """At the prompt, Ctrl-C only clears the line, and says how to leave."""
    child.sendintr()
    child.expect(r"Ctrl-D or /exit quits", timeout=60)
    child.expect(PROMPT)


def test_conversation_commands_and_save(demo_home: Path, tmp_path: Path) -> None:
    # The Gemma base demo, named: it never ends a turn early, so every reply runs to --max-tokens.
    child = spawn(demo_home, "--pair", "demo", "--max-tokens", "16", "--temp", "0", "--always-draft", "--system",
                  "You are a helpful assistant.")
    try:
        reply1, s1, notes = turn_with_notes(child, "Name a large city in France.")
        assert int(s1[1]) == 16 and int(s1[3]) == int(s1[4]) - 1  # first turn reads the whole prompt
        assert "reply cut at the limit of 16 tokens" in notes  # a reply stopped by the limit says so...
        assert "max_tokens under [chat] in a preset" in notes  # ...and where the limit lives
        assert DRAFT_COLOUR in reply1  # accepted draft tokens are coloured
        reply2, s2 = turn(child, "And one in Germany?")
        processed, prompt = int(s2[3]), int(s2[4])
        assert prompt > int(s1[4]) + 16 and processed <= 20 < prompt // 2  # only the new part is read
        command(child, "/stats", "turns 2 ")

        saved = tmp_path / "chat.json"
        command(child, f"/save {saved}", "saved 2 turns")
        data = json.loads(saved.read_text())
        assert [t["user"] for t in data["turns"]] == ["Name a large city in France.", "And one in Germany?"]
        assert data["system"] == "You are a helpful assistant."
        assert data["turns"][1]["prompt_tokens"] == prompt
        assert data["turns"][1]["prompt_tokens_processed"] == processed
        assert data["settings"]["sampling"]["temperature"] == 0.0 and data["settings"]["max_tokens"] == 16

        command(child, "/color", "draft-token colour off")
        reply3, s3 = turn(child, "And one in Italy?")
        assert "acceptance" in s3[2] and DRAFT_COLOUR not in reply3  # drafting still on, colour off
        command(child, "/draft 0", "draft length 0")
        _, s4 = turn(child, "And one in Spain?")
        assert s4[2] == "no drafting"
        command(child, "/temp 0.5", r"temperature 0\.5")
        command(child, "/preset default", r"preset default: temperature 0\.7, draft length 6 \(the draft model\)")
        command(child, "/help", r"/save FILE +write the transcript")
        command(child, "/bogus", "unknown command /bogus")

        command(child, "/reset", "conversation cleared")
        command(child, "/stats", r"turns 0 · tokens 0 ")
        command(child, f"/save {saved}", "saved 0 turns")
        assert json.loads(saved.read_text())["messages"] == [
            {"role": "system", "content": "You are a helpful assistant."}]
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_reply_and_keeps_the_session(demo_home: Path) -> None:
    child = spawn(demo_home, "--pair", "demo", "--max-tokens", "100", "--temp", "0")
    try:
        child.sendline("Count from one to two hundred, one number per line.")
        child.expect("model›")
        child.expect("[A-Za-z]{3}")  # the reply has started (ANSI codes never hold three letters in a row)
        child.sendintr()
        child.expect(r"stopped after (\d+) tokens")
        assert int(child.match[1]) < 100
        child.expect(PROMPT)
        _, stats = turn(child, "Thanks. Now say hello.")  # the session still works, from the cache
        assert int(stats[3]) < int(stats[4]) // 2
        ctrl_c_at_the_prompt(child)
        child.sendeof()  # Ctrl-D leaves
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_is_answered_in_a_chat_started_with_sigint_ignored(tiny_pair: tuple[Path, Path],
                                                                 demo_home: Path) -> None:
    """A process started from a script or a background job (`cmd &`) begins with SIGINT ignored, and localspec
    keeps it so for its other commands; the chat still answers the Ctrl-C of whoever types in it."""
    target, draft = tiny_pair
    child = spawn(demo_home, "--target", str(target), "--draft", str(draft), "--temp", "0", "--max-tokens", "8",
                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        ctrl_c_at_the_prompt(child)  # before the fix, ignored there (and only there)
        turn(child, "hello")
        ctrl_c_at_the_prompt(child)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_context_full_offers_reset(tiny_pair: tuple[Path, Path], demo_home: Path) -> None:
    target, draft = tiny_pair
    child = spawn(demo_home, "--target", str(target), "--draft", str(draft), "--ctx", "64", "--temp", "0")
    try:
        child.sendline("hello")
        child.expect(r"context full \((\d+) tokens\): /reset starts a new conversation")
        child.expect(PROMPT)
        child.sendline("and now?")
        child.expect(r"the conversation needs \d+ tokens and the context holds \d+: /reset starts over")
        child.expect(PROMPT)
        command(child, "/reset", "conversation cleared")
        child.sendline("hello")
        child.expect("context full")  # a full reply again: the session works after /reset
        child.expect(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_drop_oldest_keeps_chatting(tiny_pair: tuple[Path, Path], demo_home: Path) -> None:
    target, draft = tiny_pair
    child = spawn(demo_home, "--target", str(target), "--draft", str(draft), "--ctx", "64", "--temp", "0",
                  "--max-tokens", "40", "--drop-oldest")
    try:
        for i in range(12):
            child.sendline(f"message {i} " + "x " * 20)
            if child.expect([r"dropped the (\d+) oldest turn", STATS]) == 0:
                break
            child.expect(PROMPT)
        else:
            pytest.fail("no turn was dropped")
        child.expect(STATS)
        child.expect(PROMPT)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_chat_with_no_arguments_talks_offline(tmp_path: Path) -> None:
    """What a new user does first, from a clean LOCALSPEC_HOME: the instruct demo answers and ends its turn."""
    home = tmp_path / "fresh-home"
    child = spawn(home)
    try:
        reply, s1, notes = turn_with_notes(child, "What is two plus two?", spinner=True)
        assert "reply cut at the limit" not in notes  # it ended its turn by itself
        text = re.sub(r"\x1b\[[0-9;]*m", "", reply)  # without colour codes
        # A 135M model is no mathematician; what matters is that it answers the question and ends its turn.
        assert re.search(r"\b(4|four|two)\b", text, re.IGNORECASE), text
        tokens, prompt = int(s1[1]), int(s1[4])
        assert 0 < tokens < 200
        assert int(s1[3]) == prompt - 1  # a fresh cache reads the whole prompt
        _, s2 = turn(child, "And three plus three?")
        # Only the new message is read: "<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n
        # <|im_start|>assistant\n" is 13 tokens; a little slack for a reply that re-tokenizes differently at its end.
        assert int(s2[3]) <= 20 < int(s2[4]) // 2
        child.sendline("Write a very long story about a dragon who learns to bake bread.")
        child.expect("model›")
        child.expect("[A-Za-z]{3}")
        child.sendintr()
        child.expect(r"stopped after (\d+) tokens")
        child.expect(PROMPT)
        command(child, "/reset", "conversation cleared")
        command(child, "/stats", r"turns 0 · tokens 0 ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert (home / "cache" / "demo-chat").is_dir()  # the draft was built on first use


def test_save_and_load_resume_a_conversation(demo_home: Path, tmp_path: Path) -> None:
    """/save, /reset, /load: the next message reads only itself; a file that is not a transcript is one red line
    and the chat goes on."""
    child = spawn(demo_home, "--pair", "demo", "--max-tokens", "8", "--temp", "0")
    try:
        turn(child, "Name a large city in France.")
        saved = tmp_path / "chat.json"
        command(child, f"/save {saved}", r"saved 1 turns to .*chat\.json and the KV cells \(\d+ tokens")
        command(child, "/reset", "conversation cleared")
        command(child, f"/load {saved}", r"loaded 2 messages .*; \d+ tokens of KV cells restored")
        _, stats = turn(child, "And one in Germany?")
        assert int(stats[3]) < 20 < int(stats[4])  # only the new message is read
        (tmp_path / "bad.json").write_text("[]")
        printed = command(child, f"/load {tmp_path / 'bad.json'}", r"not a transcript /save wrote")
        assert "Traceback" not in printed
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
