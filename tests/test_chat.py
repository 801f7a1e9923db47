"""localspec.sessions.chat at library level: templates, commands, prefix reuse, reset, interrupt, save, full context.

Templates and commands need no model. The rest runs the real engine: the demo pair (a real Gemma, so replies
re-tokenize like real chat) for prefix reuse and interrupts, and the tiny generated pair (SmolLM2's tokenizer
and its Jinja chat template, random weights) where only speed matters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localspec.config import load_preset
from localspec.errors import ContextFullError, LocalspecError
from localspec.llama.model import LlamaModel
from localspec.models import demo
from localspec.rounds.events import STOP_CONTEXT_FULL, DoneEvent, TokenEvent
from localspec.sessions.chat import (
    STOP_INTERRUPTED,
    ChatSession,
    ChatTemplate,
    Command,
    TrimEvent,
    encode_chat,
    parse_command,
)
from localspec.sessions.session import ModelFiles, open_session
from tests.helpers_chat import reply

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
USER_TURNS = ["Name a large city in France.", "And one in Germany?"]


# -- templates and commands (no model) -----------------------------------------------------------------------


def test_jinja_template_renders_roles_bos_and_generation_prompt() -> None:
    t = ChatTemplate.from_jinja(CHATML, bos_token="<s>", eos_token="</s>")
    text = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == ("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_jinja_template_is_sandboxed() -> None:
    # A template from a downloaded GGUF must not reach Python internals.
    hostile = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(LocalspecError, match="chat template"):
        ChatTemplate.from_jinja(hostile, "", "").render([{"role": "user", "content": "x"}])


def test_jinja_template_errors_name_the_template() -> None:
    with pytest.raises(LocalspecError, match=r"chat template \(bad.gguf\) does not parse"):
        ChatTemplate.from_jinja("{% for %}", bos_token="", eos_token="", source="bad.gguf")
    strict = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
              "{% endif %}")
    with pytest.raises(LocalspecError, match="System role not supported"):
        ChatTemplate.from_jinja(strict, "", "").render([{"role": "system", "content": "s"}])


def test_builtin_gemma_folds_the_system_prompt_into_the_first_user_turn() -> None:
    t = ChatTemplate.builtin("gemma")
    text = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}])
    assert text == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(LocalspecError, match="unknown built-in chat template 'nope'"):
        ChatTemplate.builtin("nope")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("hello /reset", None),
        ("/help", Command("help")),
        ("/reset", Command("reset")),
        ("/stats", Command("stats")),
        ("/color", Command("color")),
        ("/exit", Command("exit")),
        ("/draft 0", Command("draft", 0)),
        ("  /DRAFT 5 ", Command("draft", 5)),
        ("/temp 0.7", Command("temp", 0.7)),
        ("/preset greedy", Command("preset", "greedy")),
        ("/save out dir/chat.json", Command("save", "out dir/chat.json")),
    ],
)
def test_parse_command(line: str, expected: Command | None) -> None:
    assert parse_command(line) == expected


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("/frobnicate", "unknown command /frobnicate"),
        ("/draft", "/draft needs N"),
        ("/draft -1", "whole number"),
        ("/draft two", "whole number"),
        ("/temp warm", "/temp warm: the temperature is a number"),
        ("/save", "/save needs FILE"),
        ("/reset now", "/reset takes no argument"),
    ],
)
def test_parse_command_rejects_bad_input(line: str, message: str) -> None:
    with pytest.raises(LocalspecError, match=message):
        parse_command(line)


# -- on real models ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_session(demo_home: Path):
    files = ModelFiles(target=demo_home / "cache" / "demo" / demo.TARGET_FILE,
                       draft=demo_home / "cache" / "demo" / demo.DRAFT_FILE, name="demo")
    preset = load_preset("greedy").with_overrides(n_ctx=1024)
    with open_session(files, preset) as session:
        yield session


@pytest.fixture(scope="module")
def tiny_session(tiny_pair: tuple[Path, Path]):
    target, draft = tiny_pair
    preset = load_preset("greedy").with_overrides(n_ctx=256, n_batch=64)  # llama.cpp pads to 256
    with open_session(ModelFiles(target=target, draft=draft, name="tiny"), preset) as session:
        yield session


def _chat(session, **kwargs) -> ChatSession:
    return ChatSession(session.engine, session.target, session.preset, **kwargs)


@pytest.mark.slow
def test_demo_model_uses_the_gemma_builtin_and_one_bos(demo_session) -> None:
    chat = _chat(demo_session, system="Be brief.")
    assert chat.template.source == "llama.cpp built-in 'gemma'"  # the demo GGUF carries no template
    tokens = chat.prompt_tokens([*chat.messages, {"role": "user", "content": "Hi"}])
    target: LlamaModel = demo_session.target
    start_of_turn = target.tokenize("<start_of_turn>", add_special=False, parse_special=True)
    assert len(start_of_turn) == 1 and tokens[:2] == [target.bos, start_of_turn[0]]


@pytest.mark.slow
def test_gguf_template_is_used_when_present(tiny_session) -> None:
    chat = _chat(tiny_session)
    assert chat.template.source.endswith("tokenizer.chat_template")
    text = chat.template.render([{"role": "user", "content": "Hi"}])
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    tokens = encode_chat(tiny_session.target, text)
    im_start = tiny_session.target.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1 and im_start[0] in tokens  # special tokens parsed, not spelled out


def test_model_without_template_or_builtin_is_refused(tmp_path: Path) -> None:
    # A GGUF of an architecture llama.cpp has no built-in template for, and no template of its own.
    class NoTemplate:
        path = tmp_path / "odd.gguf"

        def metadata(self, key: str) -> str | None:
            return "mamba" if key == "general.architecture" else None

    with pytest.raises(LocalspecError, match=r"odd.gguf has no chat template .* architecture 'mamba'"):
        ChatTemplate.for_model(NoTemplate())  # type: ignore[arg-type]


@pytest.mark.slow
def test_second_turn_reuses_the_cached_conversation(demo_session) -> None:
    chat = _chat(demo_session, system="You are a helpful assistant.", max_tokens=24)
    reply(chat, USER_TURNS[0])
    first = chat.turns[0]
    assert first.prompt_tokens_processed == first.prompt_tokens - 1  # a fresh cache reads everything
    _, done = reply(chat, USER_TURNS[1])
    second = chat.turns[1]
    assert done is not None and second.prompt_tokens_processed == done.stats.prompt_tokens_processed
    # Only the end of the reply and the new message are new; the full re-read would be prompt_tokens - 1.
    assert second.prompt_tokens > first.prompt_tokens + first.tokens
    assert second.prompt_tokens_processed is not None
    assert second.prompt_tokens_processed <= 20 < second.prompt_tokens // 2
    totals = chat.totals()
    assert totals["turns"] == 2 and totals["prompt_tokens_reused"] > totals["prompt_tokens_processed"] / 2
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.messages[2]["content"] == first.reply and first.reply


@pytest.mark.slow
def test_reply_equals_a_fresh_session_with_the_same_history(demo_session) -> None:
    """Prefix reuse is lossless: turn 2 from the warm cache is token-identical to turn 2 from a cold one."""
    chat = _chat(demo_session, max_tokens=16)
    reply(chat, USER_TURNS[0])
    warm, _ = reply(chat, USER_TURNS[1])
    cold_chat = _chat(demo_session, max_tokens=16)
    cold_chat.messages = chat.messages[:2]
    cold, _ = reply(cold_chat, USER_TURNS[1])
    assert warm == cold and cold_chat.turns[0].prompt_tokens_processed == cold_chat.turns[0].prompt_tokens - 1


@pytest.mark.slow
def test_reset_empties_history_and_cache(demo_session) -> None:
    chat = _chat(demo_session, system="Be brief.", max_tokens=8)
    reply(chat, USER_TURNS[0])
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "Be brief."}] and chat.turns == []
    assert chat.totals()["turns"] == 0
    reply(chat, USER_TURNS[0])
    turn = chat.turns[0]
    assert turn.prompt_tokens_processed == turn.prompt_tokens - 1  # nothing left in the cache to reuse


@pytest.mark.slow
def test_stopping_mid_reply_keeps_the_session_consistent(demo_session) -> None:
    chat = _chat(demo_session, max_tokens=64)
    stream = chat.send("Count from one to fifty in words.")
    seen = []
    for event in stream:
        if isinstance(event, TokenEvent):
            seen.append(event.token)
            if len(seen) == 5:
                break
    stream.close()
    turn = chat.turns[0]
    assert turn.stop_reason == STOP_INTERRUPTED and turn.tokens == 5 and turn.stats is None
    assert turn.reply == demo_session.target.detokenize(seen).strip()
    assert chat.messages[-1] == {"role": "assistant", "content": turn.reply}
    # The next turn works from the warm cache and matches a cold run of the same history exactly.
    warm, done = reply(chat, "Go on.")
    assert done is not None and warm
    cold_chat = _chat(demo_session, max_tokens=64)
    cold_chat.messages = list(chat.messages[:2])
    cold, _ = reply(cold_chat, "Go on.")
    assert warm == cold


@pytest.mark.slow
def test_stopping_after_one_token_or_before_the_start(demo_session) -> None:
    chat = _chat(demo_session, max_tokens=8)
    stream = chat.send("Hello")
    stream.close()  # never started: nothing generated, nothing recorded
    assert chat.turns == [] and chat.messages == []
    stream = chat.send("Hello")
    first = next(stream)
    stream.close()
    assert isinstance(first, TokenEvent) and chat.turns[0].tokens == 1
    assert chat.turns[0].stop_reason == STOP_INTERRUPTED and chat.turns[0].prompt_tokens_processed is None


@pytest.mark.slow
def test_settings_commands(demo_session) -> None:
    chat = _chat(demo_session, max_tokens=8)
    chat.set_draft(0)
    reply(chat, "Hi")
    assert chat.turns[-1].n_draft == 0 and chat.turns[-1].stats.drafted == 0
    chat.set_draft(3)
    chat.set_temperature(0.5)
    assert chat.preset.draft.n_draft == 3 and chat.preset.sampling.temperature == 0.5
    chat.set_preset("default")
    assert chat.preset.name == "default" and chat.preset.sampling.temperature == 0.7
    assert chat.preset.load == demo_session.preset.load  # the loaded models' settings stay
    with pytest.raises(LocalspecError, match="draft.n_draft = 99"):
        chat.set_draft(99)
    with pytest.raises(LocalspecError, match="unknown preset 'nope'"):
        chat.set_preset("nope")
    with pytest.raises(LocalspecError, match="the message is empty"):
        list(chat.send("   "))
    with pytest.raises(LocalspecError, match="max_tokens 0"):
        _chat(demo_session, max_tokens=0)


@pytest.mark.slow
def test_draft_needs_a_draft_model(demo_home: Path) -> None:
    files = ModelFiles(target=demo_home / "cache" / "demo" / demo.TARGET_FILE, draft=None, name="solo")
    # (A preset that drafts with the draft model is refused without one: test_promises.py.)
    with open_session(files, load_preset("greedy").with_overrides(n_ctx=256, n_draft=0)) as session:
        chat = _chat(session, max_tokens=4)
        with pytest.raises(LocalspecError, match="/draft 2: no draft model is loaded"):
            chat.set_draft(2)
        chat.set_draft(0)
        reply(chat, "Hi")
        assert chat.turns[0].n_draft == 0


@pytest.mark.slow
def test_save_writes_transcript_and_stats_atomically(demo_session, tmp_path: Path) -> None:
    chat = _chat(demo_session, system="Be brief.", max_tokens=6, info={"pair": "demo"})
    reply(chat, USER_TURNS[0])
    reply(chat, USER_TURNS[1])
    saved = chat.save(tmp_path / "chat.json")
    path = saved.transcript
    data = json.loads(path.read_text())
    assert [t["user"] for t in data["turns"]] == USER_TURNS
    assert data["system"] == "Be brief." and data["model"] == {"pair": "demo"}
    assert data["messages"][0] == {"role": "system", "content": "Be brief."} and len(data["messages"]) == 5
    assert data["turns"][1]["stats"]["prompt_tokens_processed"] == data["turns"][1]["prompt_tokens_processed"]
    assert data["totals"]["turns"] == 2 and data["settings"]["max_tokens"] == 6
    assert data["kv"]["file"] == "chat.json.kv" and data["kv"]["tokens"] == saved.tokens > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json", "chat.json.kv"]  # no temporary file left
    chat.save(path)  # overwriting is fine
    with pytest.raises(LocalspecError, match="does not exist"):
        chat.save(tmp_path / "missing" / "chat.json")
    with pytest.raises(LocalspecError, match="is a directory"):
        chat.save(tmp_path)


@pytest.mark.slow
def test_context_full_says_so_and_keeps_the_session(tiny_session) -> None:
    chat = _chat(tiny_session)
    long = " ".join(["word"] * 600)
    with pytest.raises(ContextFullError, match=rf"context holds {chat.n_ctx}: /reset starts over"):
        list(chat.send(long))
    assert chat.turns == [] and chat.messages == []  # the refused message is not kept
    _, done = reply(chat, "hello")  # no max_tokens: the reply runs into the end of the context
    assert done is not None and done.stop_reason == STOP_CONTEXT_FULL
    assert chat.turns[0].stop_reason == STOP_CONTEXT_FULL
    with pytest.raises(ContextFullError, match="/reset"):
        list(chat.send("more"))
    chat.reset()
    _, done = reply(chat, "hello again")
    assert done is not None


@pytest.mark.slow
def test_drop_oldest_turns_to_fit(tiny_session) -> None:
    chat = _chat(tiny_session, drop_oldest=True, max_tokens=30, system="sys")
    for i in range(16):
        stream = chat.send(f"message number {i} " + "x " * 10)
        first = next(stream)
        if isinstance(first, TrimEvent):
            break
        for _ in stream:
            pass
    else:
        pytest.fail("the conversation never outgrew the context")
    stream.close()  # stopped before the first token: the reply is empty
    assert first.dropped_turns >= 1 and first.prompt_tokens <= chat.n_ctx - 30
    turn = chat.turns[-1]
    assert turn.dropped_turns == first.dropped_turns and turn.tokens == 0 and turn.reply == ""
    assert len(chat.turns) == i + 1  # the transcript keeps every turn; only the context dropped some
    # The dropped turns are gone from the context, the system prompt stays, roles still alternate, and the
    # message with an empty reply left no trace.
    assert chat.messages[0] == {"role": "system", "content": "sys"}
    roles = [m["role"] for m in chat.messages[1:]]
    assert roles[0] == "user" and roles[-1] == "assistant"
    assert all(a != b for a, b in zip(roles, roles[1:], strict=False))
    assert not any(m["content"].startswith(f"message number {i} ") for m in chat.messages)
    assert not any(m["content"].startswith("message number 0 ") for m in chat.messages)
    assert any(isinstance(e, DoneEvent) for e in chat.send("again " + "x " * 10))
    with pytest.raises(ContextFullError, match="this message needs"):
        list(chat.send(" ".join(["word"] * 600)))
