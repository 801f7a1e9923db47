"""`localspec chat` (a streaming multi-turn chat) and `localspec generate` (one completion, pipeable).

Both share bench's model, preset and `--draft` options. `chat` draws with rich: tokens that came from accepted
draft tokens in their own colour, one stats line per reply. Ctrl-C during a reply only stops that reply: a
SIGINT handler sets a flag that the loop checks after each event and then closes the stream, so the engine is
only ever stopped between rounds (where its cache bookkeeping is consistent), never inside a llama_decode.
"""

from __future__ import annotations

import json
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

from localspec.chat import (
    COMMANDS,
    STOP_INTERRUPTED,
    ChatSession,
    ChatTemplate,
    TrimEvent,
    TurnRecord,
    encode_chat,
    parse_command,
)
from localspec.cli import options
from localspec.engine import STOP_CONTEXT_FULL, DoneEvent, GenerationStats, TokenEvent
from localspec.errors import DecodeError, LocalspecError, UsageError
from localspec.fsutil import not_utf8
from localspec.session import ModelFiles, Session, open_session

EXIT_CONTEXT_FULL = 3  # generate: the completion stopped short because the context filled (message on stderr)
DRAFT_STYLE = "cyan"  # accepted draft tokens; the target's own tokens keep the terminal's colour

SystemOpt = Annotated[str | None, typer.Option("--system", help="System prompt for the conversation.")]
DropOldestOpt = Annotated[
    bool, typer.Option("--drop-oldest", help="When the context is full, drop the oldest turns (not stop).")
]
ChatMaxTokensOpt = Annotated[
    int | None, typer.Option("--max-tokens", help="Cap on tokens per reply (default: the turn's end).", min=1)
]
PromptArg = Annotated[str, typer.Argument(help="The prompt; '-' reads it from stdin.", show_default=False)]
ChatFlag = Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object: text, stop reason, stats.")]


def _model_info(files: ModelFiles, session: Session) -> dict[str, Any]:
    return {"pair": files.name, "target": str(files.target),
            "draft": str(files.draft) if files.draft else None, "n_ctx": session.engine.n_ctx}


# -- chat ----------------------------------------------------------------------------------------------------


class _StopOnInterrupt:
    """While active, Ctrl-C sets `hit` instead of raising, so the reply loop can stop at a safe point."""

    def __init__(self) -> None:
        self.hit = False
        self._old: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.hit = True

    def __enter__(self) -> _StopOnInterrupt:
        self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._old)


class ChatView:
    """Draws one ChatSession in a terminal and runs its commands."""

    def __init__(self, console: Console, chat: ChatSession) -> None:
        self.console = console
        self.chat = chat
        self.color = True

    def run(self) -> None:
        while True:
            try:
                line = self.console.input("[bold green]you›[/] ")
            except EOFError:  # Ctrl-D
                self.console.print()
                return
            except KeyboardInterrupt:  # at the prompt, Ctrl-C only clears the line
                self.console.print("\n[dim](Ctrl-D or /exit quits)[/]")
                continue
            if not line.strip():
                continue
            try:
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
            path = chat.save(Path(str(arg)))
            out(f"[dim]saved {len(chat.turns)} turns to {escape(str(path))}[/]")
        elif name == "color":
            self.color = not self.color
            out(f"[dim]draft-token colour {'on' if self.color else 'off'}[/]")
        return True

    def reply(self, text: str) -> None:
        console = self.console
        console.print("[bold magenta]model›[/] ", end="")
        stream: Iterator[Any] = self.chat.send(text)
        done: DoneEvent | None = None
        with _StopOnInterrupt() as stop:
            try:
                for event in stream:
                    if isinstance(event, TokenEvent):
                        style = DRAFT_STYLE if (self.color and event.from_draft) else ""
                        console.print(Text(event.text, style=style), end="", soft_wrap=True)
                    elif isinstance(event, TrimEvent):
                        console.print(f"[dim](dropped the {event.dropped_turns} oldest turn(s) to fit the "
                                      "context)[/]\n[bold magenta]model›[/] ", end="")
                    elif isinstance(event, DoneEvent):
                        done = event
                    if stop.hit:
                        break
            except LocalspecError:
                console.print()  # the error goes on its own line, not after the label
                raise
            finally:
                stream.close()  # records the (partial) turn in the session
        console.print()
        turn = self.chat.turns[-1]
        if turn.stop_reason == STOP_INTERRUPTED or done is None:
            console.print(f"[yellow]stopped after {turn.tokens} tokens[/] [dim](Ctrl-C)[/]")
            return
        console.print(f"[dim]{escape(stats_line(turn))}[/]")
        if done.stop_reason == STOP_CONTEXT_FULL:
            hint = ("the oldest turns will be dropped next turn" if self.chat.drop_oldest
                    else "/reset starts a new conversation")
            console.print(f"[yellow]context full ({self.chat.n_ctx} tokens): {hint}[/]")

    def _settings_text(self) -> str:
        p = self.chat.preset
        draft = f"draft length {p.draft.n_draft}" if self.chat.engine.draft is not None else "no draft model"
        return f"preset {p.name}: temperature {p.sampling.temperature}, {draft}"

    def _totals_text(self) -> str:
        t = self.chat.totals()
        reused = t["prompt_tokens_reused"] / t["prompt_tokens"] if t["prompt_tokens"] else 0.0
        return (
            f"turns {t['turns']} · tokens {t['tokens']} ({t['from_draft']} from the draft) · "
            f"{t['decode_tps']:.1f} tok/s · acceptance {t['acceptance_rate']:.0%} · "
            f"mean accepted {t['mean_accepted']:.2f}\n"
            f"prompt tokens processed {t['prompt_tokens_processed']} of {t['prompt_tokens']} "
            f"({reused:.0%} reused from the KV cache) · context {t['context_tokens']}/{t['n_ctx']} tokens\n"
            f"{self._settings_text()} · template: {self.chat.template.source}"
        )


def stats_line(turn: TurnRecord) -> str:
    """The one line after each reply."""
    s = turn.stats or GenerationStats()
    acceptance = f"acceptance {s.acceptance_rate:.0%}" if s.drafted else "no drafting"
    return (
        f"{turn.tokens} tokens · {s.decode_tps:.1f} tok/s · {acceptance} · "
        f"mean accepted {s.mean_accepted:.2f} · "
        f"prompt tokens processed {turn.prompt_tokens_processed}/{turn.prompt_tokens}"
    )


@options.with_run_options
def chat(
    run: options.RunOptions,
    system: SystemOpt = None,
    max_tokens: ChatMaxTokensOpt = None,
    drop_oldest: DropOldestOpt = False,
) -> None:
    """Chat with the target, sped up by the draft; accepted draft tokens are coloured. /help: commands."""
    files, chosen = options.resolve_run(run, "chat", max_tokens=max_tokens)
    console = Console(highlight=False)
    with open_session(files, chosen) as session:
        template = ChatTemplate.for_model(session.target)
        session_chat = ChatSession(session.engine, session.target, chosen, system=system, template=template,
                                   max_tokens=max_tokens, drop_oldest=drop_oldest,
                                   info=_model_info(files, session))
        view = ChatView(console, session_chat)
        draft_name = files.draft.name if files.draft else "none (plain decoding)"
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
def generate(
    run: options.RunOptions,
    prompt: PromptArg,
    max_tokens: options.max_tokens = None,
    chat_template: ChatFlag = False,
    json_out: JsonFlag = False,
) -> None:
    """Print the completion of PROMPT to stdout, and nothing else (pipeable). Exit 3: the context filled first."""
    text = _read_stdin() if prompt == "-" else prompt
    if not text.strip():
        raise UsageError("the prompt is empty" + (" (stdin gave nothing)" if prompt == "-" else ""))
    files, chosen = options.resolve_run(run, "generate", max_tokens=max_tokens)
    with open_session(files, chosen) as session:
        model = session.target
        if chat_template:
            template = ChatTemplate.for_model(model)
            tokens = encode_chat(model, template.render([{"role": "user", "content": text}]))
        else:
            tokens = model.tokenize(text, add_special=True, parse_special=False)
        out: list[int] = []
        done: DoneEvent | None = None
        try:
            events = session.engine.generate(tokens, chosen.sampling, chosen.draft, chosen.bench.max_tokens)
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
            result = {"text": model.detokenize(out), "tokens": len(out), "stop_reason": done.stop_reason,
                      "stats": done.stats.as_dict(), "model": _model_info(files, session),
                      "preset": chosen.name,
                      "n_draft": chosen.draft.n_draft if files.draft else 0,
                      "temperature": chosen.sampling.temperature, "chat": chat_template}
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
        elif sys.stdout.isatty():
            sys.stdout.write("\n")  # keep the shell prompt off the last line; pipes get the exact text
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _silence_stdout()
            return
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


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at devnull so the interpreter's final flush does not complain."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def register(app: typer.Typer) -> None:
    app.command()(chat)
    app.command()(generate)
