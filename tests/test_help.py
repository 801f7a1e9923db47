"""Every command's --help at 80 columns, as a newcomer's terminal shows it: options grouped in panels, defaults
from the shipped preset, on/off switches as switches, one style for ranges, no word split across lines."""

from __future__ import annotations

import re

import click
import pytest
import typer.main
from rich.text import Text
from typer.testing import CliRunner

from localspec import config
from localspec.cli import options
from localspec.cli.app import app

runner = CliRunner()
COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
RUNS_MODELS = {"bench", "chat", "generate", "serve", "doctor"}
BOX = re.compile(r"[│╭╮╰╯─]")


def render(command: str) -> str:
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def words(text: str) -> set[str]:
    return set(BOX.sub(" ", text).split())


def flat(text: str) -> str:
    return " ".join(BOX.sub(" ", text).split())


def test_every_command_is_covered() -> None:
    assert set(COMMANDS) >= {"bench", "chat", "generate", "serve", "doctor", "models", "pull", "check",
                             "rpc-server"}


@pytest.mark.parametrize("command", COMMANDS)
def test_help_fits_80_columns_and_never_splits_a_word(command: str) -> None:
    text = render(command)
    assert max(len(line) for line in text.splitlines()) <= 80
    shown = words(text)
    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    # The summary and every option's help, word by word: a word cut by a line break would not be found whole.
    sources = [click_command.help or ""] + [getattr(p, "help", None) or "" for p in click_command.params]
    for source in sources:
        for word in Text.from_markup(source).plain.split():  # as rich shows it
            assert word in shown, f"{command} --help: {word!r} is not shown whole"
    # The summary is one paragraph, wrapped only by the terminal: its first sentence reads straight through.
    first = " ".join((click_command.help or "").split("\n\n")[0].split())
    assert first[:60] in flat(text), f"{command}: summary broken up"


@pytest.mark.parametrize("command", sorted(RUNS_MODELS))
def test_shared_options_are_grouped_in_panels(command: str) -> None:
    text = render(command)
    panels = re.findall(r"╭─ (.+?) ─", text)
    for panel in (options.MODELS, options.SAMPLING, options.DRAFTING, options.LOADING, options.PLACEMENT,
                  options.RPC):
        assert panel in panels, f"{command}: no {panel} panel in {panels}"
    assert [p for p in panels if p != "Arguments"][0] == "Options"  # the command's own options come first
    sampling = text[text.index(f"╭─ {options.SAMPLING}"):]
    sampling = sampling[: sampling.index("╰")]
    assert "--temp" in sampling and "--seed" in sampling and "--ngl" not in sampling


def test_defaults_are_shown_from_the_preset() -> None:
    preset = config.load_preset()
    bench = flat(render("bench"))
    assert f"Measured runs of each mode (median). Allowed: 1..1000. [default: {preset.bench.repeat}]" in bench
    assert f"[default: {preset.sampling.temperature}]" in bench and "[default: 0]" in bench  # --temp, --threads
    assert "--raw --no-raw" in bench and "--raw BOOLEAN" not in bench  # a switch, not a value
    serve = flat(render("serve"))
    assert f"[default: {preset.server.port}]" in serve and f"[default: {preset.server.host}]" in serve
    assert "--model-alias NAME" in serve
    assert f"[default: {preset.generate.max_tokens}]" in flat(render("generate"))
    assert f"[default: {preset.chat.max_tokens}]" in flat(render("chat"))
    assert f"[default: {preset.rpc_server.port}]" in flat(render("rpc-server"))


def test_ranges_are_written_one_way() -> None:
    for command in COMMANDS:
        text = flat(render(command))
        assert not re.search(r"\[x?[<>]=?|\[\d+<=x", text), f"{command}: click's range style beside ours"
        assert not re.search(r"\d\s*-\s*\d+\)", text) or command == "pull"
    assert "Allowed: 1..1000000." in flat(render("serve"))  # --max-tokens, in the same words as the preset keys


def test_switches_are_switches() -> None:
    for command in COMMANDS:
        click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
        text = render(command)
        for param in click_command.params:
            if not isinstance(param, click.Option) or param.type is not click.BOOL:
                continue
            assert param.is_flag, f"{command} {param.opts[0]} takes a value: make it a switch"
            line = next(line for line in text.splitlines() if f"│ {param.opts[0]} " in line)
            assert "<bool>" not in line, f"{command}: {param.opts[0]} is shown as taking a value"


def test_command_summaries_have_no_stray_line_breaks() -> None:
    """In the command list each summary is wrapped by the terminal only: a line ends early only where the next
    word would not have fitted."""
    text = render_root()
    panel = text[text.index("╭─ Commands"):]
    rows = [line for line in panel.splitlines()[1:] if line.startswith("│")]
    start = rows[0].index(rows[0].split()[2])  # where the summaries' column begins
    width = len(rows[0].rstrip()) - 2 - start  # up to the panel's right edge
    cells: list[list[str]] = []
    for row in rows:
        (cells.append([]) if row[2:start].strip() else None)
        cells[-1].append(row[start:].rstrip(" │"))
    assert len(cells) == len(COMMANDS)
    for cell in cells:
        for line, following in zip(cell, cell[1:], strict=False):
            assert len(line) + 1 + len(following.split()[0]) > width, f"stray line break after {line!r}"
    for command in COMMANDS:
        summary = typer.main.get_command(app).commands[command].help.split("\n\n")[0]  # type: ignore[attr-defined]
        assert "\n" not in summary.strip(), f"{command}: its summary is split over source lines"


def render_root() -> str:
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    return result.output
