"""The user docs stay short, true and working: the README and the performance page keep their size; every command
they show runs as shown (the command exists, every option it names is in its --help, every pair it names is
known); every link resolves; each performance figure names its raw result and is found there; no user doc talks
about issue numbers or the machines the project borrows."""

from __future__ import annotations

import csv
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from localspec import registry
from localspec.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
USER_DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]  # docs/lab/ is history, not user docs
ALL_DOCS = [*USER_DOCS, *sorted((ROOT / "docs" / "lab").glob("*.md")), *sorted((ROOT / "bench").rglob("README.md"))]
COMMANDS = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- size -------------------------------------------------------------------------------------------------------


def test_the_readme_and_the_performance_page_stay_short() -> None:
    assert len(README.read_text().splitlines()) < 250
    assert len(PERFORMANCE.read_text().splitlines()) < 300


def test_the_readme_opens_with_the_gpu_quick_start_then_the_cpu() -> None:
    headings = re.findall(r"^## (.+)$", README.read_text(), flags=re.M)
    assert headings[0].startswith("Quick start with an NVIDIA GPU") and "3090/4090" in headings[0]
    assert headings[1].startswith("Quick start on a CPU")


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = README.read_text()
    for page in USER_DOCS[1:]:
        assert f"](docs/{page.name})" in readme, f"README links no docs/{page.name}"


# -- what user docs may not say ------------------------------------------------------------------------------------

FORBIDDEN = {
    "an issue number": re.compile(r"(?i)\bissues?\s*#?\d+|(?<![\w/&#-])#\d+\b"),
    "a lent machine": re.compile(r"(?i)\blent\b|\blending the\b|\bdevice time\b"),
}


@pytest.mark.parametrize("page", USER_DOCS, ids=rel)
def test_user_docs_name_no_issue_numbers_and_no_lent_machines(page: Path) -> None:
    for number, line in enumerate(page.read_text().splitlines(), 1):
        text = re.sub(r"\]\([^)]*\)", "]()", line)  # link targets are addresses, not text
        for what, pattern in FORBIDDEN.items():
            assert not pattern.search(text), f"{rel(page)}:{number} names {what}: {line.strip()}"


def test_the_forbidden_patterns_catch_what_they_are_for() -> None:
    for line in ("(issue #21)", "issue 18", "the fix (#19)", "on the lent GPU", "no device time was left"):
        assert any(p.search(line) for p in FORBIDDEN.values()), line
    for line in ("[x](#several-gpus)", "&#123;", "a lending machine's devices", "card-n0.013", "`#` lines"):
        assert not any(p.search(line) for p in FORBIDDEN.values()), line


# -- links -------------------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces
    to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", ALL_DOCS, ids=rel)
def test_every_link_resolves(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        assert dest.exists(), f"{rel(page)} links {target}: no such file"
        if anchor and dest.suffix == ".md" and page in USER_DOCS:
            assert anchor in anchors(dest), f"{rel(page)} links {target}: no such heading in {dest.name}"


# -- every command shown works as shown ---------------------------------------------------------------------------


@cache
def help_text(command: str) -> str:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def shown_commands(page: Path) -> list[str]:
    """Every `localspec ...` invocation in the page's code blocks and inline code."""
    text = page.read_text()
    found = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            found += [part for part in re.split(r"&&|;|\|", line) if re.search(r"(^|/|\s)localspec\s", part)]
    found += re.findall(r"`((?:\.venv/bin/)?localspec [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return found


@pytest.mark.parametrize("page", USER_DOCS, ids=rel)
def test_every_command_shown_exists_with_the_options_and_pairs_it_names(page: Path) -> None:
    pairs = set(registry.load_pairs())
    for shown in shown_commands(page):
        words = shlex.split(shown, comments=True)
        start = next(i for i, w in enumerate(words) if w.endswith("localspec"))
        command, *args = words[start + 1:] or [""]
        assert command in COMMANDS, f"{rel(page)} shows `{shown.strip()}`: no command {command!r}"
        for i, arg in enumerate(args):
            flag = arg.split("=", 1)[0]
            if flag.startswith("--") and flag != "--help":
                assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text(command)), \
                    f"{rel(page)} shows `{shown.strip()}`: {command} has no {flag}"
            named = args[i + 1] if arg == "--pair" and i + 1 < len(args) else None
            if command == "pull" and i == 0 and not arg.startswith("-"):
                named = arg
            if named and not named.isupper():  # NAME, PAIR: placeholders
                assert named in pairs, f"{rel(page)} shows `{shown.strip()}`: no pair {named!r}"


def test_the_readme_shows_the_gpu_and_cpu_commands() -> None:
    shown = " ".join(shown_commands(README))
    for command in ("localspec pull qwen3-32b --yes", "localspec bench --pair qwen3-32b --repeat 5",
                    "localspec doctor", "localspec bench --repeat 5", "localspec chat"):
        assert command in shown, command


# -- every performance figure names its raw result and is found there ----------------------------------------------


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    found, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            found.append((rows[0], rows[2:]))
            rows = []
    return found


def decimals(text: str) -> set[float]:
    return {float(x) for x in re.findall(r"(?<![\w.])\d+\.\d+", re.sub(r"`[^`]*`", "", text))}


def raw_values(path: Path) -> set[float]:
    data = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    return {value for row in csv.reader(data) for cell in row for value in decimals(cell)}


def test_every_performance_row_names_its_command_and_raw_result_and_its_figures_are_in_it() -> None:
    checked = 0
    for header, rows in tables(PERFORMANCE.read_text()):
        assert header[-2:] == ["made by", "raw"], f"a performance table without made by / raw columns: {header}"
        for row in rows:
            assert len(row) == len(header), row
            assert row[-2], f"a row that names nothing that made it: {row}"
            link = re.search(r"\]\(\.\./(bench/results/[^)]+\.csv)\)", row[-1])
            if link is None:
                assert "not kept" in row[-1], f"a row without its raw result: {row}"
                continue
            raw = ROOT / link.group(1)
            assert raw.is_file(), f"{link.group(1)} does not exist"
            missing = decimals(" | ".join(row[1:-2])) - raw_values(raw)
            assert not missing, f"{row[0]}: {sorted(missing)} are not in {link.group(1)}"
            checked += 1
    assert checked >= 30


def test_every_raw_result_says_what_made_it() -> None:
    for path in sorted((ROOT / "bench" / "results").glob("*.csv")):
        meta = dict(line[2:].split(": ", 1) for line in path.read_text().splitlines() if line.startswith("# "))
        assert {"what", "machine", "command", "source"} <= meta.keys(), path.name
        rows = list(csv.reader(line for line in path.read_text().splitlines() if not line.startswith("#")))
        assert len(rows) > 1 and all(len(r) == len(rows[0]) for r in rows), path.name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.csv", path.name), path.name
