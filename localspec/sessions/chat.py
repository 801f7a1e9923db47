"""Multi-turn chat over the engine, as a library: history, chat template, per-turn stats, transcript.
Prints nothing.

Each turn renders the whole conversation with the model's own chat template and hands the tokens to the
engine, which keeps both KV caches between calls and decodes only what differs from the previous call (longest
common prefix). A reply re-tokenizes to (almost always) the tokens that were generated, so turn N processes
little more than the new user message: `TurnRecord.prompt_tokens_processed` shows it.

The template comes from the GGUF (`tokenizer.chat_template`, rendered by llama-cpp-python's sandboxed Jinja
formatter, so a hostile template cannot reach Python). GGUFs converted without one (the demo's Gemma is) fall
back to llama.cpp's built-in template named after the architecture; anything else is refused, file named.

Thinking models (Qwen3) write `<think>…</think>` before the answer. Their template has an `enable_thinking`
switch (`/think`, `/nothink`), passed as an extra template variable (llama-cpp-python's formatter forwards
keyword arguments to the template), and it drops earlier turns' thinking from the history. The rendered prompt
then no longer extends what the KV cache holds: the engine keeps the longest common prefix and decodes the rest,
and `TurnRecord.reread` counts the tokens decoded again where the cache already had (other) tokens.
`ThinkSplitter` separates thinking from answer in the token stream, so the CLI can show them apart.

Commands (`/reset`, `/draft 3`, ...) are parsed here so the rules live next to what they change; the CLI runs
them and draws the results.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localspec import __version__
from localspec.config import ContextSettings, Preset, load_preset
from localspec.errors import ContextFullError, LocalspecError, TooManyTokens, UsageError
from localspec.fsutil import atomic_write, check_writable, read_text
from localspec.llama.model import LlamaModel
from localspec.llama.templates import apply_builtin_template, builtin_chat_templates, jinja_chat_renderer
from localspec.llama.vision import MARKER, Picture, holding, read_picture, with_markers
from localspec.rounds import slot_file
from localspec.rounds.engine import Engine, shared_prefix
from localspec.rounds.events import STOP_CONTEXT_FULL, DoneEvent, Event, GenerationStats, TokenEvent

STOP_INTERRUPTED = "interrupted"  # the caller stopped iterating (Ctrl-C); the engine never says this itself

Message = dict[str, str]

# Architectures whose GGUFs often lack a template → the llama.cpp built-in that matches their training.
_BUILTIN_BY_ARCH = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma"}


# -- chat templates ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatTemplate:
    """Messages → prompt text. `source` says where the template came from (/stats shows it)."""

    source: str
    _render: Callable[..., str] = field(repr=False)
    thinking_switch: bool = False  # the template reads `enable_thinking` (Qwen3): /think and /nothink work
    reads_tools: bool = False  # the template renders a `tools` variable (Qwen2.5/Qwen3): the server passes them

    def render(self, messages: list[Message], **variables: Any) -> str:
        """The prompt text; `variables` reach a Jinja template as extra names (`enable_thinking=False`)."""
        try:
            return self._render(messages, **variables)
        except LocalspecError:
            raise
        except Exception as exc:  # a template may raise on role order, a system message, ...
            raise LocalspecError(f"chat template ({self.source}) refused the conversation: {exc}") from None

    @classmethod
    def from_jinja(cls, template: str, bos_token: str, eos_token: str, source: str = "jinja") -> ChatTemplate:
        """A Jinja chat template (HF style), rendered in llama-cpp-python's sandbox (see llama.templates). Extra
        variables reach the template (`enable_thinking`)."""
        return cls(source=source, _render=jinja_chat_renderer(template, bos_token, eos_token, source),
                   thinking_switch="enable_thinking" in template, reads_tools="tools" in template)

    @classmethod
    def builtin(cls, name: str) -> ChatTemplate:
        """One of llama.cpp's built-in templates (`gemma`, `chatml`, `llama3`, ...)."""
        if name not in builtin_chat_templates():
            raise LocalspecError(f"unknown built-in chat template {name!r}")
        # llama.cpp's built-ins take no variables.
        return cls(source=f"llama.cpp built-in '{name}'",
                   _render=lambda messages, **variables: apply_builtin_template(name, messages))

    @classmethod
    def for_model(cls, model: LlamaModel) -> ChatTemplate:
        """The GGUF's own template, else the built-in for its architecture, else a LocalspecError."""
        template = model.metadata("tokenizer.chat_template")
        if template:
            return cls.from_jinja(template, bos_token=_token_text(model, model.bos),
                                  eos_token=_token_text(model, model.eos),
                                  source=f"{model.path.name}: tokenizer.chat_template")
        arch = model.metadata("general.architecture") or "?"
        name = _BUILTIN_BY_ARCH.get(arch, arch)
        if name in builtin_chat_templates():
            return cls.builtin(name)
        raise LocalspecError(
            f"{model.path.name} has no chat template (tokenizer.chat_template) and llama.cpp has no "
            f"built-in one for architecture {arch!r}: use plain completion "
            "(`localspec generate` without --chat)"
        )


def _token_text(model: LlamaModel, token: int) -> str:
    return model.token_text(token) if token >= 0 else ""


def encode_chat(model: LlamaModel, text: str, limit: int | None = None,
                pictures: Sequence[Picture] = ()) -> list[int]:
    """Tokenize rendered chat text: its special tokens (`<start_of_turn>`, ...) are real tokens. `limit`: raise
    TooManyTokens past that many (see LlamaModel.tokenize). With `pictures`, the target's projector reads them where
    the text holds its markers (llama.vision)."""
    if pictures:
        if model.projector is None:
            raise UsageError("pictures need the target's projector: --mmproj PATH")
        tokens = model.projector.tokenize(text, pictures, add_special=False, parse_special=True)
        if limit is not None and len(tokens) > limit:
            raise TooManyTokens(f"the prompt has {len(tokens)} tokens; at most {limit}")
        return holding(_with_bos(model, tokens), tokens)  # (the prompt keeps its pictures for their decode)
    return _with_bos(model, model.tokenize(text, add_special=False, parse_special=True, limit=limit))


def _with_bos(model: LlamaModel, tokens: list[int]) -> list[int]:
    """Templates differ on whether they write the BOS themselves, so add it only when the model wants one and the
    text did not bring it (a doubled BOS measurably hurts replies)."""
    if model.add_bos and model.bos >= 0 and (not tokens or tokens[0] != model.bos):
        tokens.insert(0, model.bos)
    return tokens


class BuildCancelled(Exception):
    """The caller gave up on the prompt being built (the client left)."""


# Private-use characters: a placeholder no template writes and no message keeps (a message holding one is itself
# replaced by a placeholder).
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


class _ControlFinder:
    """Whether a text holds a control token's text (`<|im_end|>`): one dict lookup per candidate length at each
    character a control text can start with, not one scan per control token (Gemma has thousands)."""

    def __init__(self, texts: frozenset[str]) -> None:
        self.texts = texts | {_MARK_OPEN, _MARK_CLOSE}
        self.lengths = sorted({len(t) for t in self.texts})
        self.starts = re.compile("[" + "".join(re.escape(c) for c in sorted({t[0] for t in self.texts})) + "]")

    def found_in(self, text: str) -> bool:
        for match in self.starts.finditer(text):
            i = match.start()
            if any(text[i : i + n] in self.texts for n in self.lengths):
                return True
        return False


_finders: weakref.WeakKeyDictionary[LlamaModel, _ControlFinder] = weakref.WeakKeyDictionary()


def encode_messages(model: LlamaModel, template: ChatTemplate, messages: list[Message], *,
                    control_tokens: bool = False, limit: int | None = None,
                    cancelled: Callable[[], bool] | None = None,
                    variables: dict[str, Any] | None = None, pictures: Sequence[Picture] = ()) -> list[int]:
    """Render a conversation and tokenize it for a model that serves others' text (the server).

    `pictures`: one for each picture marker in the messages' contents, in order; each goes where its marker is,
    through the target's projector (its own wrapping text, `<start_of_image>`, as special tokens).

    The template's own control tokens (`<|im_start|>`) become special tokens. Unless `control_tokens`, no text in
    a message does: a message whose content holds a control token's text is rendered as a placeholder and its
    content tokenized alone, as plain text, so relayed text cannot forge a turn (llama.cpp's server parses them).
    Other messages go through the template untouched (it may trim or split them as it likes). `limit` as in
    `encode_chat`; `cancelled` is asked between pieces (BuildCancelled);
    `variables` reach the template (`tools`). Tool definitions and native tool calls go through the template as
    structures (it serialises them itself), so they cannot be hidden like content: one that holds a control
    token's text is refused (a LocalspecError naming it) unless `control_tokens`.
    """
    variables = variables or {}
    if pictures and model.projector is None:
        raise UsageError("this model reads no pictures: start the server with the target's projector (--mmproj)")
    if control_tokens:
        return encode_chat(model, template.render(messages, **variables), limit, pictures=pictures)
    finder = _finders.get(model)
    if finder is None:
        finder = _finders[model] = _ControlFinder(model.control_texts)
    structured = [("tools", variables.get("tools"))]
    structured += [(f"messages[{i}].tool_calls", m.get("tool_calls")) for i, m in enumerate(messages)]
    for name, value in structured:
        if value is not None and finder.found_in(json.dumps(value, ensure_ascii=False)):
            raise LocalspecError(f"{name}: holds a control token's text, which would reach the model as a "
                                 "control token (the server's control_tokens option allows it)")
    hidden: list[str] = []

    def hide(content: str) -> str:
        if not finder.found_in(content):
            return content
        hidden.append(content)
        return f"{_MARK_OPEN}{len(hidden) - 1}{_MARK_CLOSE}"

    text = template.render([{**m, "content": hide(m.get("content", ""))} for m in messages], **variables)
    tokens: list[int] = []

    waiting = list(pictures)
    placed: list[list[int]] = []  # each picture's tokens (they hold its chunk until the prompt is decoded)

    def add(piece: str, special: bool) -> None:
        if cancelled is not None and cancelled():
            raise BuildCancelled
        if not piece:
            return
        if pictures and MARKER in piece:
            first, _, rest = piece.partition(MARKER)
            add(first, special)
            if not waiting:
                raise UsageError(f"the prompt holds more picture markers than the {len(pictures)} pictures sent")
            assert model.projector is not None
            placed.append(model.projector.picture_tokens(waiting.pop(0)))
            tokens.extend(placed[-1])
            add(rest, special)
            return
        room = None if limit is None else limit - len(tokens)
        try:
            tokens.extend(model.tokenize(piece, add_special=False, parse_special=special, limit=room))
        except TooManyTokens as exc:
            raise TooManyTokens(f"the prompt has at least {len(tokens) + exc.tokens} tokens",
                                len(tokens) + exc.tokens, exact=False) from None

    at = 0
    for mark in _MARK.finditer(text):
        add(text[at : mark.start()], True)
        add(hidden[int(mark.group(1))], False)
        at = mark.end()
    add(text[at:], True)
    if waiting:  # (a template that drops a message's content: its pictures would be lost silently)
        raise UsageError(f"the chat template kept {len(pictures) - len(waiting)} of the {len(pictures)} pictures")
    if limit is not None and len(tokens) > limit:
        raise TooManyTokens(f"the prompt has {len(tokens)} tokens", len(tokens))
    return holding(_with_bos(model, tokens), *placed)


# -- thinking ------------------------------------------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def starts_in_thinking(prompt_text: str) -> bool:
    """Some templates open the thinking block themselves (the prompt ends inside `<think>`)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


class ThinkSplitter:
    """Streamed reply text → (is_thinking, text) pieces, without the tags.

    A tag may arrive split over several tokens, so text that could be the start of a tag is held back until the
    next piece decides. Whitespace right after a tag is dropped (templates put newlines there).
    """

    def __init__(self, thinking: bool = False) -> None:
        self.thinking = thinking
        self._held = ""
        self._strip = thinking  # drop whitespace at the start of a block

    def feed(self, text: str) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        data = self._held + text
        self._held = ""
        while data:
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            at = data.find(tag)
            if at >= 0:
                self._emit(out, data[:at])
                data = data[at + len(tag):]
                self.thinking = not self.thinking
                self._strip = True
                continue
            keep = _partial_suffix(data, tag)
            self._emit(out, data[: len(data) - keep])
            self._held = data[len(data) - keep:]
            break
        return out

    def flush(self) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        self._emit(out, self._held)
        self._held = ""
        return out

    def _emit(self, out: list[tuple[bool, str]], text: str) -> None:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        if text:
            out.append((self.thinking, text))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_thinking(text: str, thinking: bool = False) -> tuple[str, str]:
    """A whole reply → (thinking, answer)."""
    splitter = ThinkSplitter(thinking)
    parts = splitter.feed(text) + splitter.flush()
    return ("".join(t for is_t, t in parts if is_t).strip(), "".join(t for is_t, t in parts if not is_t).strip())


# -- commands ------------------------------------------------------------------------------------------------

# name → (argument, help). The CLI prints this table for /help; parse_command enforces it.
COMMANDS: dict[str, tuple[str | None, str]] = {
    "help": (None, "list the commands"),
    "reset": (None, "forget the conversation (keeps the system prompt) and clear both KV caches"),
    "stats": (None, "this conversation's totals: tokens, acceptance, prompt tokens reused from the cache"),
    "preset": ("NAME", "switch sampling and drafting to another preset (replaces /draft and /temp)"),
    "draft": ("N", "draft length for the next replies (0 = plain decoding)"),
    "temp": ("X", "sampling temperature (0 = greedy)"),
    "think": (None, "let a thinking model (Qwen3) think before it answers (its template's enable_thinking)"),
    "nothink": (None, "answer without thinking"),
    "save": ("FILE", "write the transcript and per-turn stats as JSON, and both models' KV cells to FILE.kv"),
    "load": ("FILE", "resume a conversation /save wrote: its messages and KV cells (nothing is read again)"),
    "image": ("PATH", "attach a picture (PNG, JPEG, GIF, BMP, WebP) to your next message (needs --mmproj)"),
    "color": (None, "toggle the colour of tokens that came from accepted drafts"),
    "exit": (None, "leave (Ctrl-D does too)"),
}


@dataclass(frozen=True)
class Command:
    name: str
    arg: str | int | float | None = None


def parse_command(line: str) -> Command | None:
    """`/draft 3` → Command('draft', 3); a line not starting with '/' → None; bad input → LocalspecError."""
    text = line.strip()
    if not text.startswith("/"):
        return None
    name, _, rest = text[1:].partition(" ")
    name, rest = name.lower(), rest.strip()
    if name not in COMMANDS:
        raise LocalspecError(f"unknown command /{name}: /help lists the commands")
    wanted = COMMANDS[name][0]
    if wanted is None:
        if rest:
            raise LocalspecError(f"/{name} takes no argument (got {rest!r})")
        return Command(name)
    if not rest:
        raise LocalspecError(f"/{name} needs {wanted}")
    if name == "draft":
        if not rest.isdigit():
            raise LocalspecError(f"/draft {rest}: the draft length is a whole number (0 = off)")
        return Command(name, int(rest))
    if name == "temp":
        try:
            return Command(name, float(rest))
        except ValueError:
            raise LocalspecError(f"/temp {rest}: the temperature is a number (0 = greedy)") from None
    return Command(name, rest)


# -- the session ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrimEvent:
    """Yielded before a reply when the oldest turns were dropped so the conversation fits the context."""

    dropped_turns: int
    prompt_tokens: int


ChatEvent = Event | TrimEvent


@dataclass
class TurnRecord:
    user: str
    reply: str
    stop_reason: str  # the engine's (eog, max_tokens, context_full) or STOP_INTERRUPTED
    tokens: int  # tokens generated (the end-of-turn token not counted)
    from_draft: int  # of which accepted draft tokens
    prompt_tokens: int  # the whole rendered conversation this turn
    prompt_tokens_processed: int | None  # what had to be decoded (None if interrupted: the engine never said)
    n_draft: int
    temperature: float
    dropped_turns: int = 0
    stats: GenerationStats | None = None  # the engine's, when the reply finished
    # Of the prompt tokens processed, those at positions the KV cache already held: the template rewrote the
    # history there (Qwen3 drops earlier thinking), so they were read again instead of reused.
    reread: int = 0
    thinking: str = ""  # the reply's <think> block, if any
    answer: str = ""  # the reply without it (what history shows for earlier turns)
    max_tokens: int = 0  # the reply limit in force
    aside: str | None = None  # why drafting stood aside at the reply's end (`DoneEvent.aside`), None: it drafted
    pictures: int = 0  # pictures attached to the user's message (/image)

    def as_dict(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "stats": self.stats.as_dict() if self.stats else None}


class ChatSession:
    """A conversation with one engine. `send` streams a reply; the rest are the slash commands' effects."""

    def __init__(self, engine: Engine, model: LlamaModel, preset: Preset, *, system: str | None = None,
                 template: ChatTemplate | None = None, max_tokens: int | None = None,
                 drop_oldest: bool = False, info: Mapping[str, Any] | None = None,
                 thinking: bool = True) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise LocalspecError(f"max_tokens {max_tokens}: must be 1 or more")
        self.engine = engine
        self.model = model  # the target: its tokenizer and template (the draft shares the tokenizer)
        self.preset = preset
        self.system = system.strip() if system and system.strip() else None
        self.template = template or ChatTemplate.for_model(model)
        self.max_tokens = max_tokens  # None: the preset's [chat] max_tokens
        self.drop_oldest = drop_oldest
        # None when the template has no switch: the model thinks (or not) as it was trained.
        self.thinking: bool | None = thinking if self.template.thinking_switch else None
        self.info = dict(info or {})
        self.messages: list[Message] = []
        self.turns: list[TurnRecord] = []
        self.attached: list[Picture] = []  # /image: pictures for the next message
        self.reset()

    # -- conversation ---------------------------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def reset(self) -> None:
        """Forget the conversation (not the system prompt) and both KV caches: the next turn starts clean."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.turns = []
        self.attached = []
        self.engine.reset()

    @property
    def reply_limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else self.preset.chat.max_tokens

    def prompt_text(self, messages: list[Message] | None = None) -> str:
        variables = {} if self.thinking is None else {"enable_thinking": self.thinking}
        shown = [{k: v for k, v in m.items() if k != "pictures"} for m in
                 (self.messages if messages is None else messages)]  # (a message's pictures: its markers say where)
        return self.template.render(shown, **variables)

    def prompt_tokens(self, messages: list[Message] | None = None) -> list[int]:
        pictures = [p for m in (self.messages if messages is None else messages) for p in m.get("pictures", ())]
        return encode_chat(self.model, self.prompt_text(messages), pictures=pictures)

    def attach(self, path: Path) -> Picture:
        """/image PATH: a picture for the next message, read and checked now (the preset's [images])."""
        if self.model.projector is None:
            raise UsageError("/image needs the target's projector: start the chat with --mmproj PATH")
        picture = read_picture(Path(path).expanduser(), self.preset.images)
        self.attached.append(picture)
        return picture

    def splitter(self) -> ThinkSplitter:
        """A splitter for the next reply's stream (the template may open the thinking block itself)."""
        return ThinkSplitter(starts_in_thinking(self.prompt_text([*self.messages, {"role": "user", "content": "x"}])))

    def send(self, text: str) -> Iterator[ChatEvent]:
        """Stream the reply to `text`: maybe a TrimEvent, the engine's TokenEvents, then its DoneEvent.

        Closing the iterator early (Ctrl-C) keeps the session usable: the partial reply joins the history and
        the engine, stopped between rounds, keeps consistent caches. Any other exception from the engine
        resets it, since a decode that raised may have left cells its bookkeeping does not know about.
        """
        text = text.strip()
        if not text:
            raise LocalspecError("the message is empty")
        if MARKER in text:
            raise LocalspecError(f"the message holds {MARKER}, the picture marker: attach pictures with /image")
        message: Message = {"role": "user", "content": text}
        if self.attached:  # (kept attached until a reply starts: a message the context refuses keeps them)
            message = {"role": "user", "content": with_markers(text, len(self.attached)),
                       "pictures": list(self.attached)}
        messages, prompt, dropped = self._fit([*self.messages, message])
        self.attached = []
        sampling, drafting = self.preset.sampling, self.preset.draft
        limit = self.reply_limit
        cached = self.engine.cached_tokens
        common = shared_prefix(cached, prompt[:-1])
        opens_thinking = starts_in_thinking(self.prompt_text(messages))
        tokens: list[int] = []
        from_draft = 0
        done: DoneEvent | None = None
        stream = self.engine.generate(prompt, sampling, drafting, limit, context=self._context(prompt))
        try:
            if dropped:
                yield TrimEvent(dropped_turns=dropped, prompt_tokens=len(prompt))
            for event in stream:
                if isinstance(event, TokenEvent):
                    tokens.append(event.token)
                    from_draft += event.from_draft
                else:
                    done = event
                yield event
        except GeneratorExit:
            pass  # the caller stopped reading: record what it saw, below
        except BaseException:
            stream.close()
            self.engine.reset()
            raise
        finally:
            stream.close()
        raw = self.model.detokenize(tokens)
        # A template that opened the thinking block itself gets its tag back, so the history holds the whole
        # block and the template can drop it from later prompts.
        reply = (THINK_OPEN + "\n" + raw if opens_thinking and raw.strip() else raw).strip()
        thinking, answer = split_thinking(raw, thinking=opens_thinking)
        processed = done.stats.prompt_tokens_processed if done else None
        record = TurnRecord(
            user=text, pictures=len(message.get("pictures", ())), reply=reply,
            stop_reason=done.stop_reason if done else STOP_INTERRUPTED,
            tokens=len(tokens), from_draft=from_draft, prompt_tokens=len(prompt),
            prompt_tokens_processed=processed,
            n_draft=drafting.n_draft if drafting.drafter in self.engine.drafters else 0,
            temperature=sampling.temperature, dropped_turns=dropped,
            stats=done.stats if done else None, aside=done.aside if done else None,
            reread=min(processed, len(cached) - common) if processed is not None else 0,
            thinking=thinking, answer=answer, max_tokens=limit,
        )
        self.turns.append(record)
        # An empty reply (stopped before its first token) leaves no trace in the context, so roles keep
        # alternating as templates require.
        self.messages = [*messages, {"role": "assistant", "content": reply}] if reply else messages[:-1]

    def _context(self, prompt: list[int]) -> ContextSettings:
        """The preset's context shift; with n_keep 0 (the default) a chat keeps its system prompt."""
        context = self.preset.context
        if not context.context_shift or context.n_keep != 0 or not self.system:
            return context
        alone = self.prompt_tokens([{"role": "system", "content": self.system}])
        kept = shared_prefix(alone, prompt)
        bos = 1 if self.model.add_bos and prompt and prompt[0] == self.model.bos else 0
        return dataclasses.replace(context, n_keep=max(0, kept - bos))

    @property
    def drops_turns(self) -> bool:
        """Whether a conversation that outgrows the context loses its oldest turns (--drop-oldest, and context
        shift: a reply that shifted leaves a history longer than the context)."""
        return self.drop_oldest or self.preset.context.context_shift

    def _fit(self, messages: list[Message]) -> tuple[list[Message], list[int], int]:
        """The messages to send, their tokens, and how many oldest turns were dropped to make them fit."""
        prompt = self.prompt_tokens(messages)
        if not self.drops_turns:
            if len(prompt) >= self.n_ctx:
                raise ContextFullError(
                    f"the conversation needs {len(prompt)} tokens and the context holds {self.n_ctx}: "
                    "/reset starts over (or chat with --drop-oldest to drop the oldest turns instead)"
                )
            return messages, prompt, 0
        # Leave room for a reply, or each turn would drop again after a few tokens.
        reply_room = min(self.reply_limit, self.n_ctx // 2)
        head = 1 if messages and messages[0]["role"] == "system" else 0
        dropped = 0
        while len(prompt) > self.n_ctx - reply_room and len(messages) - head > 1:
            # Drop a user message with the reply that followed it: templates want roles to alternate.
            cut = 2 if len(messages) - head > 2 and messages[head + 1]["role"] == "assistant" else 1
            messages = messages[:head] + messages[head + cut :]
            dropped += 1
            prompt = self.prompt_tokens(messages)
        if len(prompt) >= self.n_ctx:
            raise ContextFullError(
                f"this message needs {len(prompt)} tokens with the system prompt; "
                f"the context holds {self.n_ctx}"
            )
        return messages, prompt, dropped

    # -- settings (the slash commands) ----------------------------------------------------------------------

    def set_preset(self, name: str) -> None:
        """Sampling and drafting from another preset; the loaded models keep their load and context settings."""
        chosen = load_preset(name)
        self.engine.check_drafter(chosen.draft)  # refused here, not at the next reply (never plain in its place)
        self.preset = dataclasses.replace(chosen, load=self.preset.load, context=self.preset.context)

    def set_draft(self, n_draft: int) -> None:
        if n_draft > 0 and self.preset.draft.drafter not in self.engine.drafters:
            raise LocalspecError(
                f"/draft {n_draft}: no draft model is loaded (start chat with a pair or --draft PATH, or "
                "--drafter lookup)"
            )
        self.preset = self.preset.with_overrides(n_draft=n_draft)

    def set_temperature(self, temperature: float) -> None:
        self.preset = self.preset.with_overrides(temperature=temperature)

    def set_thinking(self, on: bool) -> None:
        if self.thinking is None:
            raise LocalspecError(
                f"/{'think' if on else 'nothink'}: this model's chat template has no thinking switch "
                f"(enable_thinking) ({self.template.source})"
            )
        self.thinking = on

    # -- reporting ------------------------------------------------------------------------------------------

    def totals(self) -> dict[str, Any]:
        """The conversation so far: what /stats shows and /save writes."""
        total = GenerationStats.total(t.stats for t in self.turns if t.stats is not None)
        prompt = sum(t.prompt_tokens for t in self.turns if t.prompt_tokens_processed is not None)
        processed = sum(t.prompt_tokens_processed or 0 for t in self.turns)
        return {
            "prompt_tokens_reread": sum(t.reread for t in self.turns),
            "turns": len(self.turns),
            "tokens": sum(t.tokens for t in self.turns),
            "from_draft": sum(t.from_draft for t in self.turns),
            "prompt_tokens": prompt,
            "prompt_tokens_processed": processed,
            "prompt_tokens_reused": prompt - processed,
            "acceptance_rate": total.acceptance_rate,
            "mean_accepted": total.mean_accepted,
            "decode_tps": total.decode_tps,
            "context_tokens": len(self.prompt_tokens()) if self.messages else 0,
            "n_ctx": self.n_ctx,
        }

    def transcript(self) -> dict[str, Any]:
        return {
            "localspec": __version__,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": self.info,
            "template": self.template.source,
            "preset": self.preset.name,
            "settings": {"sampling": dataclasses.asdict(self.preset.sampling),
                         "draft": dataclasses.asdict(self.preset.draft), "max_tokens": self.reply_limit,
                         "drop_oldest": self.drop_oldest, "thinking": self.thinking},
            "system": self.system,
            "messages": self.messages,
            "turns": [t.as_dict() for t in self.turns],
            "totals": self.totals(),
        }

    def save(self, path: Path) -> SavedChat:
        """Write both models' KV cells to PATH.kv (slot_file.py), then the transcript as JSON to PATH, naming the
        state file and the id both carry; each write atomic (fsutil: a temporary file, then a rename)."""
        path = Path(path).expanduser()
        if any(m.get("pictures") for m in self.messages):
            raise LocalspecError("/save: the conversation holds a picture, which saved chats do not keep yet")
        kv = kv_path(path)
        check_writable(path, what="transcript")
        save_id = uuid.uuid4().hex
        state = self.engine.snapshot(0)
        kv_bytes = slot_file.write(kv, state, self._identities(), {"chat": save_id}, what="KV state")
        transcript = {**self.transcript(), "kv": {"file": kv.name, "id": save_id, "tokens": state.models[0].n_tokens}}
        atomic_write(path, json.dumps(transcript, indent=2, ensure_ascii=False) + "\n", what="transcript")
        return SavedChat(path, kv, state.models[0].n_tokens, kv_bytes)

    def load(self, path: Path) -> SavedChat:
        """Resume a conversation `save` wrote: its system prompt and messages, and both models' KV cells restored
        into the engine, so the next message reads only itself. Every check (the transcript's shape, the state
        file's model, versions, checksum, that it belongs to this transcript) passes before anything changes; a
        LocalspecError names what failed and the session is as it was."""
        path = Path(path).expanduser()
        data = _transcript(path)
        messages, system = data["messages"], data["system"]
        kv = data.get("kv")
        if kv is None:
            raise LocalspecError(f"{path}: no KV state was saved with this transcript (an older /save)")
        if not isinstance(kv, dict) or not isinstance(kv.get("file"), str) or not isinstance(kv.get("id"), str):
            raise LocalspecError(f"{path}: its kv entry is malformed")
        state_path = path.with_name(kv["file"])
        loaded = slot_file.read(state_path, self._identities(), n_vocab=self.model.n_vocab, n_ctx=self.n_ctx)
        if loaded.extra.get("chat") != kv["id"]:
            raise LocalspecError(f"{state_path}: belongs to another save than {path} (saved again since?)")
        try:
            restored = self.engine.restore(0, loaded.state, loaded.parts)
        except slot_file.SlotFileError as exc:  # (a drafter's part that does not fit: nothing changed)
            raise LocalspecError(f"{state_path}: {exc}") from None
        if not restored:
            self.engine.reset()
            raise LocalspecError(f"{state_path}: llama.cpp refused the state (the KV caches are empty now)")
        self.system = system
        self.messages = messages
        self.turns = []
        return SavedChat(path, state_path, loaded.state.models[0].n_tokens, loaded.nbytes)

    def _identities(self) -> list[slot_file.ModelIdentity]:
        return [slot_file.identity(m) for m in self.engine.state_models()]


@dataclass(frozen=True)
class SavedChat:
    """What /save wrote or /load read: the transcript, the state file beside it, the tokens its cells hold."""

    transcript: Path
    kv: Path
    tokens: int
    kv_bytes: int


def kv_path(transcript: Path) -> Path:
    """Where /save puts the KV cells of the transcript at `transcript`: beside it, `.kv` added to its name."""
    return transcript.with_name(transcript.name + ".kv")


def _transcript(path: Path) -> dict[str, Any]:
    """A transcript /save wrote, its messages and system prompt checked."""
    try:
        data = json.loads(read_text(path))
    except ValueError as exc:
        raise LocalspecError(f"{path}: not a transcript /save wrote (not JSON: {exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise LocalspecError(f"{path}: not a transcript /save wrote (no messages)")
    for i, m in enumerate(data["messages"]):
        if (not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str)
                or m["role"] not in ("system", "user", "assistant")):
            raise LocalspecError(f"{path}: messages[{i}] is not a role and its content")
    if data.get("system") is not None and not isinstance(data["system"], str):
        raise LocalspecError(f"{path}: its system prompt is not text")
    return data


def context_full(record: TurnRecord) -> bool:
    return record.stop_reason == STOP_CONTEXT_FULL
