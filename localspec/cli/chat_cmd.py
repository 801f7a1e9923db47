"""`localspec chat` (a streaming multi-turn chat) and `localspec generate` (one completion, pipeable).

Both share bench's model, preset and `--draft` options. Without model arguments and without a default pair,
`chat` runs the offline instruct demo (`demo-chat`). `chat` draws with rich: tokens that came from accepted
draft tokens in their own colour, a thinking model's thinking dimmed and apart from its answer, one stats line
per reply. Ctrl-C never ends the conversation: from the first prompt to the last, a SIGINT handler of the chat's
own only sets a flag (`CtrlC`). During a reply the loop checks it after each event and then closes the stream, so
the engine is only ever stopped between rounds (where its cache bookkeeping is consistent), never inside a
llama_decode; at the prompt it clears the line, however early or late it came.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from localspec.cli import options
from localspec.config import DRAFTER_TABLE
from localspec.errors import DecodeError, LocalspecError, UsageError
from localspec.fsutil import not_utf8
from localspec.llama import vision
from localspec.models import registry
from localspec.rounds.constraints import Constraint
from localspec.rounds.events import (
    STOP_CONTEXT_FULL,
    STOP_MAX_TOKENS,
    DoneEvent,
    GenerationStats,
    TokenEvent,
    drafting_note,
)
from localspec.sessions.chat import (
    COMMANDS,
    STOP_INTERRUPTED,
    ChatSession,
    ChatTemplate,
    TrimEvent,
    TurnRecord,
    encode_chat,
    parse_command,
    split_thinking,
    starts_in_thinking,
)
from localspec.sessions.session import ModelFiles, Session, open_session

EXIT_CONTEXT_FULL = 3  # generate: the completion stopped short because the context filled (message on stderr)
DRAFT_STYLE = "cyan"  # accepted draft tokens; the target's own tokens keep the terminal's colour
THINK_STYLE = "dim italic"  # a thinking model's thinking, shown before (and apart from) its answer

SystemOpt = Annotated[str | None, typer.Option("--system", help="System prompt for the conversation.")]
DropOldestOpt = Annotated[
    bool, typer.Option("--drop-oldest", metavar="", help="When the context is full, drop the oldest turns (not stop).")
]
NoThinkFlag = Annotated[
    bool, typer.Option("--no-think", metavar="", help="A thinking model (Qwen3) answers without thinking first.")
]
PromptArg = Annotated[str, typer.Argument(help="The prompt; '-' reads it from stdin.", show_default=False)]
ChatFlag = Annotated[bool, typer.Option("--chat", metavar="", help="Wrap the prompt in the model's chat template.")]
JsonFlag = Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object: text, stop reason, stats.")]
ImageOpt = Annotated[
    list[Path] | None,
    typer.Option("--image", metavar="PATH", help="A picture (PNG, JPEG, GIF, BMP, WebP) for the prompt, read by the "
                 "target's projector (--mmproj); it goes where the prompt says <__media__>, else before the text. "
                 "Repeatable.", show_default=False, readable=False),
]
JsonSchemaFile = Annotated[Path | None, typer.Option(
    "--json-schema", metavar="FILE", help="Hold the output to this JSON schema (a JSON file).", show_default=False)]
GrammarFile = Annotated[Path | None, typer.Option(
    "--grammar", metavar="FILE", help="Hold the output to this GBNF grammar (llama.cpp's format, a `root` rule).",
    show_default=False)]


def _model_info(files: ModelFiles, session: Session) -> dict[str, Any]:
    return {"pair": files.name, "target": str(files.target),
            "draft": str(files.draft) if files.draft else None, "n_ctx": session.engine.n_ctx}


# -- chat ----------------------------------------------------------------------------------------------------


class CtrlC:
    """Owns SIGINT while the conversation runs: Ctrl-C sets `hit`, and `read_line` answers it at the prompt.

    The chat's own handler replaces whatever SIGINT disposition the process inherited: started from a background
    job or a script (`cmd &`), a process begins with SIGINT ignored, yet a user typing in this chat still expects
    Ctrl-C to act, at the prompt as during a reply. Not input(): a SIGINT whose C-level handler runs just before
    input()'s blocking read begins (or on another thread) does not interrupt that read, so Python's handler waits
    for the next Enter and the Ctrl-C goes unanswered. The handler also writes to a wakeup pipe
    (`signal.set_wakeup_fd`) that the prompt waits on beside stdin, so no arrival time is missed (the self-pipe
    trick; hand-written, as neither input() nor readline has a way in).

    The pipe's SIGINT byte is itself the news of a Ctrl-C (`take`), not only a reason to look at `hit`: the Python
    handler runs when the main thread's eval loop next checks for pending calls, and a SIGINT taken on another
    thread can leave that check unrequested while the main thread goes back to sleep in its poll (the staged test
    in tests/test_chat_signals.py failed so once, on a loaded CI box)."""

    def __init__(self) -> None:
        self.hit = False
        self._old_handler: Any = None
        self._old_wakeup = -1
        self._wake_r = self._wake_w = -1
        self._pending = b""  # stdin bytes read but not yet returned: a pipe can deliver several lines at once

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.hit = True

    def take(self) -> bool:
        """Whether a Ctrl-C came since the last answered one; True answers it (forgets it).

        Reads the wakeup pipe, so a SIGINT whose Python handler has not run yet still counts, then lets that handler
        run now: `signal.signal` runs pending handlers before it installs one (CPython's signalmodule.c), so a late
        handler cannot set `hit` again after this answer and have the same Ctrl-C answered twice."""
        woken = False
        while chunk := _read_available(self._wake_r):
            woken = woken or signal.SIGINT in chunk
        signal.signal(signal.SIGINT, self._handler)
        arrived = self.hit or woken
        self.hit = False
        return arrived

    def __enter__(self) -> CtrlC:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._old_handler = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._old_handler)
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def read_line(self, stdin: int) -> str:
        """The next line from the file descriptor `stdin`, without its newline. EOFError at its end (Ctrl-D at an
        empty prompt); KeyboardInterrupt for a Ctrl-C not yet answered, which may have come before this call."""
        waiting = select.poll()  # poll, not select: no limit on the descriptors' numbers
        waiting.register(stdin, select.POLLIN)
        waiting.register(self._wake_r, select.POLLIN)
        while True:
            if self.take():  # checked on every pass: also a Ctrl-C that came before this call
                self._pending = b""  # what was typed and not yet answered goes, as the terminal drops its own
                raise KeyboardInterrupt
            line, newline, rest = self._pending.partition(b"\n")
            if newline:
                self._pending = rest
                return self._decode(line)
            ready = {fd for fd, _ in waiting.poll()}  # readable, or its writer gone (the end)
            if stdin in ready:
                data = os.read(stdin, 65536)
                if not data:  # the end: a last line without its newline still counts, as with input()
                    line, self._pending = self._pending, b""
                    if not line:
                        raise EOFError
                    return self._decode(line)
                self._pending += data

    @staticmethod
    def _decode(line: bytes) -> str:
        try:
            return line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(not_utf8("the chat input", exc)) from None


def _read_available(fd: int) -> bytes:
    """Read what a non-blocking pipe holds; b"" once it is empty."""
    try:
        return os.read(fd, 512)
    except BlockingIOError:
        return b""


class ChatView:
    """Draws one ChatSession in a terminal and runs its commands."""

    def __init__(self, console: Console, chat: ChatSession) -> None:
        self.console = console
        self.chat = chat
        self.color = True
        self.ctrl_c = CtrlC()

    def run(self) -> None:
        """Prompt, reply, repeat until /exit or Ctrl-D."""
        stdin = sys.stdin.fileno()
        with self.ctrl_c:
            while True:
                try:
                    self.console.print("[bold green]you›[/] ", end="")
                    line = self.ctrl_c.read_line(stdin)
                except EOFError:  # Ctrl-D
                    self.console.print()
                    return
                except KeyboardInterrupt:  # at the prompt, Ctrl-C only clears the line
                    self.console.print("\n[dim](Ctrl-D or /exit quits)[/]")
                    continue
                except LocalspecError as exc:  # a line that is not UTF-8
                    self.console.print(f"[red]{escape(str(exc))}[/]")
                    continue
                try:
                    if not line.strip():
                        continue
                    command = parse_command(line)
                    if command is None:
                        self.reply(line)
                    elif not self.run_command(command.name, command.arg):
                        return
                except LocalspecError as exc:
                    self.console.print(f"[red]{escape(str(exc))}[/]")

    def run_command(self, name: str, arg: Any) -> bool:
        """Run one slash command; False means leave."""
        chat, out = self.chat, self.console.print
        if name == "exit":
            return False
        if name == "help":
            for cmd, (wanted, text) in COMMANDS.items():
                out(f"  /{cmd}{' ' + wanted if wanted else ''}".ljust(16) + f" {text}", markup=False)
        elif name == "reset":
            chat.reset()
            out("[dim]conversation cleared (history and KV caches)[/]")
        elif name == "stats":
            out(self._totals_text(), markup=False)
        elif name == "preset":
            chat.set_preset(str(arg))
            out(f"[dim]{escape(self._settings_text())}[/]")
        elif name == "draft":
            chat.set_draft(int(arg))
            out(f"[dim]{escape(self._settings_text())}[/]")
        elif name == "temp":
            chat.set_temperature(float(arg))
            out(f"[dim]{escape(self._settings_text())}[/]")
        elif name == "save":
            saved = chat.save(Path(str(arg)))
            out(f"[dim]saved {len(chat.turns)} turns to {escape(str(saved.transcript))} and the KV cells "
                f"({saved.tokens} tokens, {saved.kv_bytes / 2**20:.1f} MiB) to {escape(saved.kv.name)}[/]")
        elif name == "load":
            loaded = chat.load(Path(str(arg)))
            out(f"[dim]loaded {len(chat.messages)} messages from {escape(str(loaded.transcript))}; "
                f"{loaded.tokens} tokens of KV cells restored (not read again)[/]")
        elif name == "image":
            picture = chat.attach(Path(str(arg)))
            out(f"[dim]picture {escape(str(arg))} ({picture.width} x {picture.height}) goes with your next message "
                f"({len(chat.attached)} attached)[/]")
        elif name == "color":
            self.color = not self.color
            out(f"[dim]draft-token colour {'on' if self.color else 'off'}[/]")
        elif name in ("think", "nothink"):
            chat.set_thinking(name == "think")
            hint = "" if name == "think" else " (Qwen recommends /preset qwen3-instruct for answers without thinking)"
            out(f"[dim]thinking {'on' if chat.thinking else 'off'} from the next message{escape(hint)}[/]")
        return True

    def reply(self, text: str) -> None:
        console = self.console
        splitter = self.chat.splitter()
        stream: Iterator[Any] = self.chat.send(text)
        done: DoneEvent | None = None
        shown = _Shown()
        # Reading a long prompt on a slow or busy CPU takes seconds: a spinner says it is working, and makes way
        # for the reply's label at the first event (a pipe gets the label at once, without the spinner).
        waiting = console.status("[dim]reading the prompt, waiting for the first token…[/]") \
            if console.is_terminal else None
        if waiting is not None:
            waiting.start()
        else:
            console.print("[bold magenta]model›[/] ", end="")
        try:
            for event in stream:
                if waiting is not None:
                    waiting.stop()
                    waiting = None
                    console.print("[bold magenta]model›[/] ", end="")
                if isinstance(event, TokenEvent):
                    style = DRAFT_STYLE if (self.color and event.from_draft) else ""
                    for thinking, piece in splitter.feed(event.text):
                        self._show(piece, thinking, style, shown)
                elif isinstance(event, TrimEvent):
                    console.print(f"[dim](dropped the {event.dropped_turns} oldest turn(s) to fit the "
                                  "context)[/]\n[bold magenta]model›[/] ", end="")
                elif isinstance(event, DoneEvent):
                    done = event
                if self.ctrl_c.take():  # Ctrl-C stops the reply here, between rounds
                    break
        except LocalspecError:
            if waiting is None:
                console.print()  # the error goes on its own line, not after the label
            raise
        finally:
            if waiting is not None:  # no event came (an error, or Ctrl-C before the first token)
                waiting.stop()
            stream.close()  # records the (partial) turn in the session
            for thinking, piece in splitter.flush():
                self._show(piece, thinking, "", shown)
        console.print()
        turn = self.chat.turns[-1]
        if turn.stop_reason == STOP_INTERRUPTED or done is None:
            console.print(f"[yellow]stopped after {turn.tokens} tokens[/] [dim](Ctrl-C)[/]")
            return
        console.print(f"[dim]{escape(stats_line(turn))}[/]")
        if done.stop_reason == STOP_MAX_TOKENS:
            console.print(f"[yellow]reply cut at the limit of {turn.max_tokens} tokens[/] [dim](--max-tokens, or "
                          "max_tokens under \\[chat] in a preset, raises it)[/]")
        if done.stop_reason == STOP_CONTEXT_FULL:
            hint = ("the oldest turns will be dropped next turn" if self.chat.drops_turns
                    else "/reset starts a new conversation")
            console.print(f"[yellow]context full ({self.chat.n_ctx} tokens): {hint}[/]")

    def _show(self, piece: str, thinking: bool, style: str, shown: _Shown) -> None:
        """Thinking dimmed under its own label; the answer after it on a fresh line."""
        console = self.console
        if thinking and not shown.thinking:
            console.print(Text("(thinking) ", style=THINK_STYLE), end="")
            shown.thinking = True
        if not thinking and shown.thinking and not shown.answer:
            console.print()
            console.print("[bold magenta]      ›[/] ", end="")
        if not thinking:
            shown.answer = True
        console.print(Text(piece, style=THINK_STYLE if thinking else style), end="", soft_wrap=True)

    def _settings_text(self) -> str:
        p = self.chat.preset
        draft = (f"draft length {p.draft.n_draft} ({DRAFTER_TABLE[p.draft.drafter].title})"
                 if p.draft.drafter in self.chat.engine.drafters else "no draft model")
        thinking = "" if self.chat.thinking is None else f", thinking {'on' if self.chat.thinking else 'off'}"
        return (f"preset {p.name}: temperature {p.sampling.temperature}, {draft}, "
                f"reply limit {self.chat.reply_limit}{thinking}")

    def _totals_text(self) -> str:
        t = self.chat.totals()
        reused = t["prompt_tokens_reused"] / t["prompt_tokens"] if t["prompt_tokens"] else 0.0
        return (
            f"turns {t['turns']} · tokens {t['tokens']} ({t['from_draft']} from the draft) · "
            f"{t['decode_tps']:.1f} tok/s · acceptance {t['acceptance_rate']:.0%} · "
            f"mean accepted {t['mean_accepted']:.2f}\n"
            f"prompt tokens processed {t['prompt_tokens_processed']} of {t['prompt_tokens']} "
            f"({reused:.0%} reused from the KV cache, {t['prompt_tokens_reread']} re-read where the template "
            f"rewrote the history) · context {t['context_tokens']}/{t['n_ctx']} tokens\n"
            f"{self._settings_text()} · template: {self.chat.template.source}"
        )


def stats_line(turn: TurnRecord) -> str:
    """The one line after each reply."""
    s = turn.stats or GenerationStats()
    acceptance = drafting_note(s, turn.aside)
    reread = f" ({turn.reread} re-read: the template rewrote the history)" if turn.reread else ""
    return (
        f"{turn.tokens} tokens · {s.decode_tps:.1f} tok/s · {acceptance} · "
        f"mean accepted {s.mean_accepted:.2f} · "
        f"prompt tokens processed {turn.prompt_tokens_processed}/{turn.prompt_tokens}{reread}"
    )


class _Shown:
    """What one reply has drawn so far (thinking, answer)."""

    def __init__(self) -> None:
        self.thinking = False
        self.answer = False


@options.with_run_options
@options.with_shift_options
def chat(
    run: options.RunOptions,
    shift: dict[str, Any],
    system: SystemOpt = None,
    max_tokens: options.chat_max_tokens = None,
    drop_oldest: DropOldestOpt = False,
    no_think: NoThinkFlag = False,
) -> None:
    """Chat with the target, sped up by the draft; accepted draft tokens are coloured. /help: commands."""
    # --max-tokens goes to the session, not the preset: /preset switches keep the user's limit.
    files, chosen = options.resolve_run(run, "chat", fallback_pair=registry.DEMO_CHAT.name, **shift)
    chosen.with_overrides(prefer="chat", flags=options.FLAGS, max_tokens=max_tokens)  # its range, checked now
    console = Console(highlight=False)
    with open_session(files, chosen) as session:
        template = ChatTemplate.for_model(session.target)
        session_chat = ChatSession(session.engine, session.target, chosen, system=system, template=template,
                                   max_tokens=max_tokens, drop_oldest=drop_oldest,
                                   info=_model_info(files, session), thinking=not no_think)
        view = ChatView(console, session_chat)
        draft_name = files.draft.name if files.draft else "none"
        console.print(
            f"[bold]localspec chat[/] · pair [cyan]{escape(files.name)}[/]: "
            f"target {escape(files.target.name)}, draft {escape(draft_name)} · "
            f"context {session.engine.n_ctx} tokens\n"
            f"[dim]{escape(view._settings_text())} · template: {escape(template.source)}[/]\n"
            f"[dim]tokens from accepted drafts are[/] [{DRAFT_STYLE}]coloured like this[/] "
            "[dim](/color toggles) · /help lists commands · Ctrl-C stops a reply · Ctrl-D quits[/]"
        )
        view.run()


# -- generate ------------------------------------------------------------------------------------------------


@options.with_run_options
@options.with_shift_options
def generate(
    run: options.RunOptions,
    shift: dict[str, Any],
    prompt: PromptArg,
    max_tokens: options.generate_max_tokens = None,
    chat_template: ChatFlag = False,
    no_think: NoThinkFlag = False,
    json_out: JsonFlag = False,
    json_schema: JsonSchemaFile = None,
    grammar_file: GrammarFile = None,
    image: ImageOpt = None,
) -> None:
    """Print the completion of PROMPT to stdout, and nothing else (pipeable). Exit 3: the context filled first."""
    constraint = Constraint.from_files(json_schema, grammar_file)  # a bad file fails before any model loads
    text = _read_stdin() if prompt == "-" else _argument_text(prompt)
    if not text.strip():
        raise UsageError("the prompt is empty" + (" (stdin gave nothing)" if prompt == "-" else ""))
    if no_think and not chat_template:
        raise UsageError("--no-think switches the chat template's thinking off: use it with --chat")
    # A chat-templated prompt wants the instruct demo (a base model continues the text instead of answering);
    # plain completion keeps the base demo, which continues text well.
    fallback = registry.DEMO_CHAT.name if chat_template else None
    files, chosen = options.resolve_run(run, "generate", fallback_pair=fallback, max_tokens=max_tokens, **shift)
    limit = chosen.generate.max_tokens
    # Pictures are read and checked before any model loads: a bad one costs nothing.
    pictures = [vision.read_picture(path, chosen.images) for path in image or ()]
    if pictures and files.mmproj is None:
        raise UsageError("--image needs the target's projector: --mmproj PATH")
    if pictures:
        text = vision.with_markers(text, len(pictures))
    with open_session(files, chosen) as session:
        model = session.target
        opens_thinking = False
        if chat_template:
            template = ChatTemplate.for_model(model)
            if no_think and not template.thinking_switch:
                raise UsageError(f"--no-think: this model's chat template has no thinking switch "
                                 f"(enable_thinking) ({template.source})")
            variables = {"enable_thinking": False} if no_think else {}
            rendered = template.render([{"role": "user", "content": text}], **variables)
            opens_thinking = starts_in_thinking(rendered)
            tokens = encode_chat(model, rendered, pictures=pictures)
        elif pictures:
            assert model.projector is not None
            tokens = model.projector.tokenize(text, pictures, add_special=True, parse_special=False)
        else:
            tokens = model.tokenize(text, add_special=True, parse_special=False)
        out: list[int] = []
        done: DoneEvent | None = None
        try:
            grammar = constraint.grammar(model) if constraint is not None else None
            events = session.engine.generate(tokens, chosen.sampling, chosen.draft, limit, grammar=grammar,
                                             context=chosen.context)
            for event in events:
                if isinstance(event, TokenEvent):
                    out.append(event.token)
                    if not json_out:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
                else:
                    done = event
        except BrokenPipeError:  # `| head`: the reader left; that is not an error
            _silence_stdout()
            return
        if done is None:  # the engine always ends with a DoneEvent; without one there is no result to report
            raise DecodeError("generation ended without its final stats")
        if json_out:
            completion = model.detokenize(out)
            thinking, answer = split_thinking(completion, thinking=opens_thinking)
            result = {"text": completion, "thinking": thinking, "answer": answer, "tokens": len(out),
                      "stop_reason": done.stop_reason, "max_tokens": limit,
                      "stats": done.stats.as_dict(), "model": _model_info(files, session),
                      "preset": chosen.name,
                      "n_draft": chosen.draft.n_draft if chosen.draft.drafter in session.engine.drafters else 0,
                      "drafter": chosen.draft.drafter,
                      "temperature": chosen.sampling.temperature, "chat": chat_template}
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
        elif sys.stdout.isatty():
            sys.stdout.write("\n")  # keep the shell prompt off the last line; pipes get the exact text
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _silence_stdout()
            return
    if done.stop_reason == STOP_MAX_TOKENS and not json_out:
        # On stderr, so a pipe still gets exactly the completion.
        print(f"localspec: stopped at the limit of {limit} tokens (--max-tokens, or max_tokens under "
              "[generate] in a preset, raises it)", file=sys.stderr)
    if done.stop_reason == STOP_CONTEXT_FULL:
        # The text stops short of what was asked: say so where a pipe does not swallow it, and exit non-zero.
        print(f"localspec: stopped: context full ({session.engine.n_ctx} tokens)", file=sys.stderr)
        raise typer.Exit(EXIT_CONTEXT_FULL)


def _read_stdin() -> str:
    """The prompt from stdin, strictly UTF-8: a wrong encoding is named, not silently replaced."""
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(not_utf8("stdin", exc)) from None


def _argument_text(arg: str) -> str:
    """The prompt argument, strictly UTF-8 as stdin is: Python keeps undecodable argv bytes as lone surrogates,
    which the tokenizer cannot encode."""
    try:
        return os.fsencode(arg).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(not_utf8("the prompt argument", exc)) from None


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at devnull so the interpreter's final flush does not complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def register(app: typer.Typer) -> None:
    app.command()(chat)
    app.command()(generate)
