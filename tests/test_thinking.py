"""Thinking models in chat: the template's `enable_thinking` switch, thinking apart from the answer, and a
template that rewrites the history (Qwen3 drops earlier turns' thinking), so the KV cache is reused only up to
the longest common prefix and the rest is re-read.

The engine-level tests run a tiny generated pair whose GGUFs carry such a template (`tokenizer.chat_template`),
so ChatTemplate.for_model finds it exactly as it would in a real Qwen3 file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localspec.config import load_preset
from localspec.errors import LocalspecError
from localspec.rounds.events import STOP_MAX_TOKENS
from localspec.sessions.chat import (
    ChatSession,
    ChatTemplate,
    Command,
    ThinkSplitter,
    parse_command,
    split_thinking,
    starts_in_thinking,
)
from localspec.sessions.session import ModelFiles, open_session
from tests.helpers_chat import reply

# Written for these tests in the manner of Qwen3's template: earlier assistant turns lose their thinking (a closed
# block is cut, an unclosed one, from a reply stopped mid-thought, is dropped), and `enable_thinking = false`
# writes an empty block so the model answers at once. Like QwQ's and Qwen3-Thinking-2507's, the generation prompt
# opens the block itself.
QWEN3_LIKE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- elif content.startswith('<think>') %}{%- set content = '' %}{%- endif %}"
    "{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}"
)


# -- no model ------------------------------------------------------------------------------------------------


def test_splitter_separates_thinking_from_the_answer_across_split_tags() -> None:
    pieces = ["<th", "ink>\n", "Two and two", " make four.</", "think>\n\n", "4", "<", " is the answer."]
    splitter = ThinkSplitter()
    out = [p for text in pieces for p in splitter.feed(text)] + splitter.flush()
    thinking = "".join(t for is_thinking, t in out if is_thinking)
    answer = "".join(t for is_thinking, t in out if not is_thinking)
    assert thinking == "Two and two make four." and answer == "4< is the answer."
    assert split_thinking("".join(pieces)) == ("Two and two make four.", "4< is the answer.")
    # A template that opened the block itself: the stream starts inside it.
    assert split_thinking("hmm</think>\n\nyes", thinking=True) == ("hmm", "yes")
    assert split_thinking("just an answer") == ("", "just an answer")


def test_template_thinking_switch_and_history_rewrite() -> None:
    t = ChatTemplate.from_jinja(QWEN3_LIKE, bos_token="", eos_token="<|im_end|>")
    assert t.thinking_switch and not ChatTemplate.from_jinja("{{ messages[0].content }}", "", "").thinking_switch
    history = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
               {"role": "user", "content": "and 3+3?"}]
    on = t.render(history)
    off = t.render(history, enable_thinking=False)
    assert "add them" not in on and "<|im_start|>assistant\n4<|im_end|>" in on  # earlier thinking dropped
    assert on.endswith("<|im_start|>assistant\n<think>\n") and starts_in_thinking(on)
    assert off.endswith("<think>\n\n</think>\n\n") and not starts_in_thinking(off)


def test_think_commands_parse() -> None:
    assert parse_command("/think") == Command("think")
    assert parse_command("/nothink") == Command("nothink")
    with pytest.raises(LocalspecError, match="/think takes no argument"):
        parse_command("/think hard")


# -- a tiny GGUF pair carrying the template ------------------------------------------------------------------


def _vocab_with_template(src: Path, out: Path, template: str) -> Path:
    """A tokenizer-only GGUF: the source's tokenizer keys with another chat template."""
    import gguf
    from synthetic import read_vocab_kv

    kvs, _ = read_vocab_kv(src)
    w = gguf.GGUFWriter(out, arch="llama")
    for kv in kvs:
        value = template.encode() if kv.key == "tokenizer.chat_template" else kv.value
        w.add_key_value(kv.key, value, kv.vtype, sub_type=kv.sub_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def thinking_pair(tmp_path_factory, smollm2_path: Path) -> tuple[Path, Path]:
    import dataclasses

    from synthetic import TINY, write_pair

    folder = tmp_path_factory.mktemp("thinking")
    vocab = _vocab_with_template(smollm2_path, folder / "vocab.gguf", QWEN3_LIKE)
    target, draft = folder / "target.gguf", folder / "draft.gguf"
    write_pair(target, draft, dataclasses.replace(TINY, wtype="q4_0"), vocab_source=vocab)
    return target, draft


@pytest.fixture(scope="module")
def thinking_session(thinking_pair: tuple[Path, Path]):
    target, draft = thinking_pair
    preset = load_preset("greedy").with_overrides(n_ctx=512, n_batch=64)
    with open_session(ModelFiles(target=target, draft=draft, name="tiny-thinking"), preset) as session:
        yield session


@pytest.mark.slow
def test_rewritten_history_is_reread_from_the_common_prefix_and_stays_lossless(thinking_session) -> None:
    chat = ChatSession(thinking_session.engine, thinking_session.target, thinking_session.preset, max_tokens=12)
    assert chat.template.source.endswith("tokenizer.chat_template") and chat.thinking is True
    assert chat.splitter().thinking  # this template opens the thinking block itself
    reply(chat, "hello there")
    first = chat.turns[0]
    assert first.reread == 0 and first.prompt_tokens_processed == first.prompt_tokens - 1
    assert first.thinking and not first.answer  # 12 tokens, never closed: all of it was thinking
    assert chat.messages[-1]["content"].startswith("<think>\n")  # history keeps the block the template opened
    cached_before = len(thinking_session.engine.cached_tokens)

    warm, done = reply(chat, "and now?")
    second = chat.turns[1]
    assert done is not None and done.stop_reason == STOP_MAX_TOKENS
    # The template dropped turn 1's thinking, so its positions were decoded again: counted as re-read.
    assert second.reread > 0
    assert second.prompt_tokens_processed == second.prompt_tokens - 1 - (cached_before - second.reread)
    assert 0 < second.prompt_tokens_processed < second.prompt_tokens - 1  # the common prefix was kept
    assert chat.totals()["prompt_tokens_reread"] == second.reread

    cold_chat = ChatSession(thinking_session.engine, thinking_session.target, thinking_session.preset,
                            max_tokens=12)
    cold_chat.messages = list(chat.messages[:2])
    cold, _ = reply(cold_chat, "and now?")
    assert warm == cold  # reusing a prefix of a rewritten history gives the tokens a cold start gives


@pytest.mark.slow
def test_nothink_writes_the_empty_block_and_templates_without_a_switch_refuse(
    thinking_session, tiny_pair: tuple[Path, Path]
) -> None:
    chat = ChatSession(thinking_session.engine, thinking_session.target, thinking_session.preset, max_tokens=4,
                       thinking=False)
    assert chat.thinking is False and not chat.splitter().thinking
    assert chat.prompt_text([{"role": "user", "content": "x"}]).endswith("<think>\n\n</think>\n\n")
    chat.set_thinking(True)
    assert chat.prompt_text([{"role": "user", "content": "x"}]).endswith("<think>\n")

    target, draft = tiny_pair  # SmolLM2's own template: no enable_thinking
    with open_session(ModelFiles(target=target, draft=draft, name="tiny"),
                      load_preset("greedy").with_overrides(n_ctx=256, n_batch=64)) as session:
        plain = ChatSession(session.engine, session.target, session.preset)
        assert plain.thinking is None
        with pytest.raises(LocalspecError, match=r"/nothink: this model's chat template has no thinking switch"):
            plain.set_thinking(False)


@pytest.mark.slow
def test_the_reply_limit_comes_from_the_preset_and_is_recorded(thinking_session) -> None:
    preset = thinking_session.preset.with_overrides(prefer="chat", max_tokens=5)
    chat = ChatSession(thinking_session.engine, thinking_session.target, preset)
    assert chat.reply_limit == 5
    _, done = reply(chat, "hello")
    assert done is not None and done.stop_reason == STOP_MAX_TOKENS
    assert chat.turns[0].tokens == 5 and chat.turns[0].max_tokens == 5
    chat.max_tokens = 3  # --max-tokens wins over the preset
    reply(chat, "again")
    assert chat.turns[1].tokens == 3 and chat.transcript()["settings"]["max_tokens"] == 3


def _generate(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    env.pop("LOCALSPEC_DEBUG", None)
    return subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", "generate", *args],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_generate_chat_no_think_and_the_limit_note(thinking_pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = thinking_pair
    model = ["--target", str(target), "--draft", str(draft), "--ctx", "256", "--temp", "0"]
    thinking = _generate(tmp_path, "hi", "--chat", "--json", "--max-tokens", "6", *model)
    assert thinking.returncode == 0, thinking.stderr
    data = json.loads(thinking.stdout)  # the template opened <think>: all 6 tokens are thinking
    assert data["tokens"] == 6 and data["thinking"] == data["text"].strip() and data["answer"] == ""
    assert data["stop_reason"] == "max_tokens" and data["max_tokens"] == 6
    answer = _generate(tmp_path, "hi", "--chat", "--no-think", "--json", "--max-tokens", "6", *model)
    data = json.loads(answer.stdout)
    assert data["thinking"] == "" and data["answer"] == data["text"].strip()

    # The limit comes from the preset's [generate] section, and a cut completion says so on stderr only.
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "short.toml").write_text("[generate]\nmax_tokens = 3\n")
    cut = _generate(tmp_path, "hi", "--preset", "short", *model)
    assert cut.returncode == 0, cut.stderr
    assert cut.stderr == ("localspec: stopped at the limit of 3 tokens (--max-tokens, or max_tokens under "
                          "[generate] in a preset, raises it)\n")
    assert cut.stdout  # the completion itself, nothing else

    wrong = _generate(tmp_path, "hi", "--no-think", *model)
    assert wrong.returncode == 2 and "--no-think switches the chat template's thinking off: use it with --chat" \
        in wrong.stderr
