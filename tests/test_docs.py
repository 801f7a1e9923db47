"""The user docs stay short, true and working: the README and the performance page keep their size; every command
they show runs as shown (the command exists, every option it names is in its --help, every pair it names is
known); every link resolves; every figure of the README and the performance, server, GPU, lossless, models and
drafters pages is the raw row and column it names (a ratio only from a file of one machine), or says where it is
quoted from; every raw result was written by the script that measured it, or is one of the pinned transcribed
files; no user doc talks about issue numbers or the machines the project borrows."""

from __future__ import annotations

import csv
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from localspec.cli.app import app
from localspec.models import registry

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


# -- every figure is found in the raw result it names, or says where it is quoted from ------------------------------
#
# The notation the docs use (HTML comments: GitHub shows none of it):
#   The line above a performance table ends with `<!-- raw columns: DOC COLUMN := REFS | ... -->`, every
#   column but "made by" and "raw" named (`:= -` for a label column that holds no figure); each row's raw cell
#   links its file and names its raw row(s) after the link, `<!-- key=value; key=value -->`, and may replace a
#   column's REFS for that row (`; DOC COLUMN := REFS`). A cell's numbers, in order, must be REFS's values.
#   REFS: words read left to right: `NAME.csv` picks a file of bench/results/, `[key=value; ...]` picks the rows
#   whose cells equal those values (added to the row's key, or to the last such bracket; all matching rows, in
#   file order; a new file starts with no key), any other word is a column, read from every picked row.
#   In prose, `<!-- raw NAME.csv [key=value] column ... -->` vouches for the figures written since the block's
#   previous marker, in order; `<!-- quoted SOURCE ... -->` says they are quoted from SOURCE (a lab note or other
#   page of this repository, where each must be found, or an outside address); `<!-- quoted section: SOURCE
#   ... -->` on the line after a heading does so for every figure of the section that no other marker covers.
#   The SOURCE `unrecorded` (figures measured before raw files were kept, whose only record is the page itself)
#   is allowed where the page's opening says which of its figures have no raw file.
#   A figure: a number with a decimal point, or one followed by ×, %, tok/s, ms, µs or s (a range's first end
#   too); not a number inside a name (Qwen3.5, card-n0.013, 0.6B), after `=` (T = 0.7, k = 6), after `~` (an
#   approximate label: ~85%), or in code, link targets and comments.

RESULTS = ROOT / "bench" / "results"
FIGURE_DOCS = [README, *(ROOT / "docs" / name for name in (
    "server.md", "gpu.md", "lossless.md", "performance.md", "models.md", "drafters.md"))]
NUMBER = re.compile(r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
UNIT = re.compile(r"(?:[–-]\d+(?:\.\d+)?)?\s?(?:×|%|tok/s|ms\b|µs|s\b)")
REF_WORD = re.compile(r"\[([^\]]*)\]|(\S+)")
MARKER = re.compile(r"<!--\s*(raw|quoted)\b(.*?)-->", re.S)
MULTI_MACHINE = re.compile(r"(?i)\banother\b|\ba (?:second|third|fourth)\b|\bdifferent\b")
RATIO_COLUMN = re.compile(r"over|speedup|ratio")


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    found, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            found.append((rows[0], rows[2:]))
            rows = []
    return found


@cache
def raw_file(name: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    lines = (RESULTS / name).read_text().splitlines()
    meta = dict(line[2:].split(": ", 1) for line in lines if line.startswith("# ") and ": " in line)
    return meta, list(csv.DictReader(line for line in lines if not line.startswith("#")))


def selection(text: str) -> dict[str, str]:
    pairs = [part.split("=", 1) for part in re.split(r";(?![^\[]*\])", text) if part.strip()]
    assert all(len(pair) == 2 for pair in pairs), f"a row key that is not key=value: {text!r}"
    return {key.strip(): value.strip() for key, value in pairs}


def resolve(refs: str, file: str | None = None, rows: dict[str, str] | None = None) -> list[tuple[str, float]]:
    """The values REFS names (see the notation above), each with where it was read."""
    values: list[tuple[str, float]] = []
    picked_by = dict(rows or {})
    for match in REF_WORD.finditer(refs):
        if match.group(1) is not None:
            picked_by |= selection(match.group(1))
            continue
        word = match.group(2)
        if word.endswith(".csv"):
            assert (RESULTS / word).is_file(), f"no raw file {word}"
            file, picked_by = word, {}
            continue
        assert file, f"{word}: no raw file named before it"
        meta, table = raw_file(file)
        assert table and word in table[0], f"{file} has no column {word!r}"
        picked = [row for row in table if all(row.get(k) == v for k, v in picked_by.items())]
        assert picked, f"{file} has no row {picked_by}"
        if RATIO_COLUMN.search(word):
            assert not MULTI_MACHINE.search(meta.get("machine", "")), \
                f"{file}: {word} is a ratio and the file's runs were on several machines: {meta['machine']}"
        for row in picked:
            try:
                values.append((f"{file} {word} {picked_by}", float(row[word].removeprefix("~"))))
            except ValueError:
                raise AssertionError(f"{file} {picked_by}: {word} holds {row[word]!r}, not a number") from None
    return values


def same(shown: str, value: float) -> bool:
    """`shown` is `value` as printed: equal within the last printed digit's rounding."""
    decimals = len(shown.partition(".")[2])
    return abs(float(shown.replace(",", "")) - value) <= 0.5 * 10 ** -decimals + 1e-9


def compare(where: str, shown: list[str], expected: list[tuple[str, float]]) -> list[str]:
    if len(shown) != len(expected):
        return [f"{where}: {len(shown)} figures {shown} against {len(expected)} named "
                f"{[f'{v:g}' for _, v in expected]}"]
    return [f"{where}: {figure} is not {source} = {value:g}"
            for figure, (source, value) in zip(shown, expected, strict=True) if not same(figure, value)]


def signed(text: str, match: re.Match[str]) -> str:
    """The number `match` found, with its minus sign where one stands before it (not a hyphen inside a name)."""
    minus = re.search(r"(?:^|[\s(/+])[−-]$", text[:match.start()]) is not None
    return ("-" if minus else "") + match.group()


def cell_numbers(cell: str) -> list[str]:
    text = re.sub(r"`[^`]*`|<!--.*?-->|\*\*|\]\([^)]*\)", "", cell)
    return [signed(text, m) for m in NUMBER.finditer(text)]


def check_table(header: list[str], rows: list[list[str]], mapping: str) -> list[str]:
    """Every figure of a performance table against the raw row and column it claims."""
    columns: dict[str, str] = {}
    for part in mapping.split(" | "):
        name, sep, refs = part.partition(":=")
        assert sep, f"a column mapping without :=: {part!r}"
        columns[name.strip()] = refs.strip()
    problems = [f"{header}: column {name!r} is not mapped to a raw column"
                for name in header[:-2] if name not in columns]
    for row in rows:
        link = re.search(r"\]\(\.\./bench/results/([^)]+\.csv)\)\s*(?:<!--(.*?)-->)?", row[-1])
        if link is None:
            problems.append(f"{row[0]}: its raw cell names no file of bench/results/")
            continue
        key: dict[str, str] = {}
        overrides: dict[str, str] = {}
        for part in re.split(r";(?![^\[]*\])", link.group(2) or ""):
            if ":=" in part:
                name, _, refs = part.partition(":=")
                overrides[name.strip()] = refs.strip()
            elif part.strip():
                key.update(selection(part))
        if not key:
            problems.append(f"{row[0]}: its raw cell names no raw row (<!-- key=value -->)")
            continue
        for name, cell in zip(header[:-2], row[:-2], strict=True):
            refs = overrides.get(name, columns.get(name, "-"))
            shown = cell_numbers(cell)
            if refs == "-" or not shown:
                continue
            try:
                expected = resolve(refs, link.group(1), key)
            except AssertionError as error:
                problems.append(f"{row[0]} / {name}: {error}")
                continue
            problems += compare(f"{row[0]} / {name}", shown, expected)
    return problems


def prose_figures(text: str) -> list[tuple[int, str]]:
    """(position, figure) for every figure in `text` (see the notation above)."""
    found = []
    for m in NUMBER.finditer(text):
        before, after = text[:m.start()], text[m.end():]
        setting = re.search(r"(?:[=≥~]\s?|/|[\w.]-|[\w.]−|(?:CUDA|Python|driver|temperature) )$", before)
        if setting or re.match(r"[A-Za-z]|\.\d", after):
            continue
        if "." in m.group() or UNIT.match(after):
            found.append((m.start(), signed(text, m)))
    return found


def blanked(text: str, pattern: str, flags: int = 0) -> str:
    """`text` with what `pattern` matches blanked out, positions kept."""
    return re.sub(pattern, lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=flags)


def quoted_numbers(doc: Path, sources: list[str]) -> set[float] | None:
    """The numbers of the local sources a quoted marker names; None when one is an outside address or
    `unrecorded` (measured before raw files were kept: the page itself is the record, and says so)."""
    numbers: set[float] = set()
    for source in sources:
        if re.match(r"https?://", source) or source == "unrecorded":
            return None
        path = (doc.parent / source.split("#")[0]).resolve()
        assert path.is_file(), f"{rel(doc)} quotes {source}: no such file"
        found = {float(m.group().replace(",", "")) for m in NUMBER.finditer(path.read_text())}
        numbers |= found | {n / unit for n in found if n >= 1e8 for unit in (1e9, 2**30)}  # bytes, read in GB or GiB
    return numbers


def not_in(figure: str, numbers: set[float] | None) -> bool:
    """Whether a quoted figure is missing from its sources' numbers (as printed: within its last digit)."""
    return numbers is not None and not any(same(figure.lstrip("-").replace(",", ""), n) for n in numbers)


def check_prose(doc: Path, text: str) -> list[str]:
    """Every figure outside the raw-column tables is vouched for by the marker after it, or by its section's."""
    problems: list[str] = []
    if re.search(r"<!--\s*quoted\b[^>]*\bunrecorded\b", text) and "no raw file" not in text.split("\n## ")[0]:
        problems.append(f"{rel(doc)} marks figures unrecorded but its opening does not say they have no raw file")
    text = blanked(text, r"```.*?```", re.S)
    text = blanked(text, r"<!--\s*raw columns:.*?-->\s*\n(?:\|.*(?:\n|$))+")  # check_tables reads these
    section_sources: list[str] = []
    for block in re.split(r"\n\s*\n|\n(?=- |#)", text):
        heading = re.match(r"#+ .*", block)
        if heading:
            section = re.match(r"#+ .*\n<!--\s*quoted section:(.*?)-->", block, re.S)
            section_sources = section.group(1).split() if section else []
        plain = blanked(block, r"`[^`]*`|\]\([^)]*\)|<https?://[^>]*>")
        covered_to = 0
        for marker in MARKER.finditer(plain):
            if "section:" in marker.group(2):
                covered_to = marker.end()
                continue
            figures = [f for p, f in prose_figures(blanked(plain[covered_to:marker.start()], r"<!--.*?-->", re.S))]
            where = f"{rel(doc)}: {' '.join(block[covered_to:marker.start()].split())[-90:]!r}"
            try:
                if marker.group(1) == "raw":
                    problems += compare(where, figures, resolve(marker.group(2)))
                else:
                    numbers = quoted_numbers(doc, marker.group(2).split())
                    problems += [f"{where}: {f} is not in {marker.group(2).strip()}"
                                 for f in figures if not_in(f, numbers)]
            except AssertionError as error:
                problems.append(f"{where}: {error}")
            covered_to = marker.end()
        rest = [f for _, f in prose_figures(blanked(plain[covered_to:], r"<!--.*?-->", re.S))]
        if rest and section_sources:
            numbers = quoted_numbers(doc, section_sources)
            rest = [f for f in rest if not_in(f, numbers)]
            problems += [f"{rel(doc)}: {f} is not in the section's sources {section_sources}" for f in rest]
        elif rest:
            problems.append(f"{rel(doc)}: {rest} with no raw or quoted marker after them: "
                            f"{' '.join(block[covered_to:].split())[:120]!r}")
    return problems


def check_tables(text: str) -> list[str]:
    problems, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        above = lines[i - 1].strip() if i else ""
        if line.startswith("|") and not above.startswith("|"):
            mapping = re.search(r"<!--\s*raw columns:(.*)-->$", above)
            header, body = tables("\n".join(lines[i:]))[0]
            if header[-2:] != ["made by", "raw"]:
                problems.append(f"a performance table without made by / raw columns: {header}")
            elif mapping is None:
                problems.append(f"no <!-- raw columns: ... --> ends the line above a performance table: {header}")
            else:
                problems += check_table(header, body, mapping.group(1))
    return problems


def test_every_performance_table_figure_is_its_raw_row_and_column() -> None:
    text = PERFORMANCE.read_text()
    assert not check_tables(text), "\n".join(check_tables(text))
    pictures = (ROOT / "docs" / "images.md").read_text()  # (its table of a projector's memory)
    assert "<!-- raw columns:" in pictures and not check_tables(pictures), "\n".join(check_tables(pictures))
    # (the hybrid's rollback-cost table moved to docs/lab/ on 2026-12-06; the grammar mask's and the longer drafts'
    # became sentences with raw markers on 2026-12-07, their figures checked as prose)
    assert text.count("<!-- raw columns:") >= 12


@pytest.mark.parametrize("doc", FIGURE_DOCS, ids=rel)
def test_every_figure_in_prose_is_found_where_it_says(doc: Path) -> None:
    problems = check_prose(doc, doc.read_text())
    assert not problems, "\n".join(problems)


CARD_PAIR = "[x](../bench/results/2026-12-02-h200-card-pair.csv)"
GOOD_TABLE = (
    "<!-- raw columns: T := temperature | plain := plain_tps | speculative (acc.) := spec_tps acceptance_pct"
    " | vs plain := spec_over_plain -->\n"
    "| T | plain | speculative (acc.) | vs plain | made by | raw |\n|---|---|---|---|---|---|\n"
    f"| 0 | 76.4 | **174.5** (84.5%) | **2.28×** | run.sh | {CARD_PAIR} <!-- pair=card-n0.013; temperature=0 --> |\n"
    f"| 0.7 | 77.2 | 138.6 (70.5%) | 1.79× | run.sh | {CARD_PAIR} <!-- pair=card-n0.03; temperature=0.7 --> |\n"
)


@pytest.mark.parametrize(("wrong", "caught"), [
    ("| 0 | 76.4 | **174.5** (84.5%) | **2.28×** |", ""),  # the good table: nothing caught
    ("| 0 | 76.4 | **175.5** (84.5%) | **2.28×** |", "175.5 is not"),  # a wrong figure
    ("| 0 | 76.4 | **174.5** (84.5%) | **2.16×** |", "2.16 is not"),  # the figure of another row
    ("| 0 | 76.4 | **174.5** (84.5%) | **1.28×** |", "1.28 is not"),  # the figure of another column
    ("| 0 | 76.4 | **174.5** | **2.28×** |", "1 figures"),  # a figure left out
])
def test_the_table_check_catches_a_wrong_figure_row_or_column(wrong: str, caught: str) -> None:
    text = GOOD_TABLE.replace("| 0 | 76.4 | **174.5** (84.5%) | **2.28×** |", wrong)
    problems = check_tables(text)
    assert (caught in "\n".join(problems) and problems) if caught else not problems, problems


def test_the_table_check_catches_a_wrong_row_key_or_column_name() -> None:
    assert "no row" in "\n".join(check_tables(GOOD_TABLE.replace("pair=card-n0.03;", "pair=card-n0.3;")))
    assert "no column" in "\n".join(check_tables(GOOD_TABLE.replace(":= spec_over_plain", ":= spec_over_plan")))
    assert "not mapped" in "\n".join(check_tables(GOOD_TABLE.replace(" | vs plain := spec_over_plain", "")))
    assert "no <!-- raw columns" in "\n".join(check_tables(GOOD_TABLE.split("\n", 1)[1]))


PROSE = ("On one H200, 174.5 tok/s against 76.4 plain (2.28×) <!-- raw 2026-12-02-h200-card-pair.csv "
         "[pair=card-n0.013; temperature=0] spec_tps plain_tps spec_over_plain -->, 87% in a lab note "
         "<!-- quoted lab/2026-12-04-h200-fifth-window.md -->.")


@pytest.mark.parametrize(("wrong", "caught"), [
    (PROSE, ""),
    (PROSE.replace("174.5", "175.5"), "175.5 is not"),  # a wrong figure
    (PROSE.replace("temperature=0]", "temperature=0.7]"), "is not"),  # another row
    (PROSE.replace("plain_tps spec_over", "spec_tps spec_over"), "76.4 is not"),  # another column
    (PROSE.replace("87%", "86.5%"), "86.5 is not in"),  # a quoted figure its source does not hold
    (PROSE + " And 1.5× more.", "no raw or quoted marker"),  # a figure nothing vouches for
])
def test_the_prose_check_catches_a_wrong_figure_row_or_column(wrong: str, caught: str) -> None:
    problems = check_prose(PERFORMANCE, wrong)
    assert (caught in "\n".join(problems) and problems) if caught else not problems, problems


def test_the_prose_check_refuses_a_ratio_from_a_file_of_several_machines() -> None:
    text = ("3.17× <!-- raw 2026-12-04-h200-card-concurrency-4.csv [code=dfa00dd; temperature=0; clients=16] "
            "over_llama_server -->")
    assert "several machines" in "\n".join(check_prose(PERFORMANCE, text))


def test_the_figure_finder_takes_figures_and_leaves_names_and_settings() -> None:
    text = ("Qwen3.5 card-n0.013 0.6B at T = 0.7, k = 6, ~85%, 8e-5, 0.3.36: 1.28–1.55× plain, 87–92%, "
            "511 tok/s, 16 clients, 34.42 ms, −0.0033, 2.1 s")
    assert [f for _, f in prose_figures(text)] == ["1.28", "1.55", "87", "92", "511", "34.42", "-0.0033", "2.1"]


# -- raw results: what made them, and from now on written by the script that measured ---------------------------

# Every raw file of the runs before this rule: their figures were transcribed from the run's printed summary or
# JSON, not written by the measuring script. The list is closed: a new file is written by its script.
TRANSCRIBED = {
    "2026-11-30-cpu-demo-chat.csv", "2026-11-30-cpu-rpc-and-serve.csv", "2026-11-30-h200x2-two-gpus.csv",
    "2026-12-01-cpu-structured.csv", "2026-12-01-cpu-threads.csv", "2026-12-01-h200-adaptive.csv",
    "2026-12-01-h200-concurrency-acceptance.csv", "2026-12-01-h200-concurrency.csv",
    "2026-12-01-h200-draft-ahead.csv", "2026-12-01-h200-drafters-card.csv", "2026-12-01-h200-structured.csv",
    "2026-12-02-cpu-demo-drafters.csv", "2026-12-02-cpu-main-command.csv", "2026-12-02-h200-ahead-variants.csv",
    "2026-12-02-h200-card-pair-fifth-run.csv", "2026-12-02-h200-card-pair.csv",
    "2026-12-02-h200-drafters-embedded.csv", "2026-12-04-cpu-grammar-mask.csv", "2026-12-04-cpu-main-command.csv",
    "2026-12-04-h200-agent-loop.csv", "2026-12-04-h200-card-concurrency-2.csv",
    "2026-12-04-h200-card-concurrency-3.csv", "2026-12-04-h200-card-concurrency-4.csv",
    "2026-12-04-h200-card-concurrency.csv", "2026-12-04-h200-card-pair-2.csv", "2026-12-04-h200-card-pair-3.csv",
    "2026-12-04-h200-card-pair.csv", "2026-12-04-h200-hybrid-mtp.csv", "2026-12-04-h200-hybrid-rollback.csv",
    "2026-12-04-h200-slot-rounds-shared.csv", "2026-12-04-h200-slot-rounds-turns.csv",
    "2026-12-04-h200-speaks-widths.csv", "2026-12-04-h200-structured-2.csv", "2026-12-04-h200-structured.csv",
    "2026-12-04-h200-verify-widths.csv",
}
TRANSCRIBED_MARK = re.compile(r"transcribed from the run's .+ \(not written by the measuring script\)")


def raw_result_problems(name: str, text: str) -> list[str]:
    """What is wrong with a raw result file: its `#` lines, its table, and who wrote it."""
    meta = dict(line[2:].split(": ", 1) for line in text.splitlines() if line.startswith("# ") and ": " in line)
    problems = [f"{name}: no # {key}: line" for key in ("what", "machine", "command", "source") if key not in meta]
    rows = list(csv.reader(line for line in text.splitlines() if not line.startswith("#")))
    if not (len(rows) > 1 and all(len(r) == len(rows[0]) for r in rows)):
        problems.append(f"{name}: not one table with a header")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.csv", name):
        problems.append(f"{name}: not named DATE-MACHINE-TOPIC.csv")
    if name in TRANSCRIBED:
        if not TRANSCRIBED_MARK.match(meta.get("source", "")):
            problems.append(f"{name}: its # source: line does not say it was transcribed")
    elif TRANSCRIBED_MARK.search(text):
        problems.append(f"{name}: a new transcribed file: a raw result is written by the script that measured it")
    else:
        writer = meta.get("written-by", "").split()
        if not writer or not ((ROOT / writer[0]).is_file() or writer[:2] == ["localspec", "bench"]):
            problems.append(f"{name}: no # written-by: line naming the script (in this repository) that wrote it")
    return problems


def test_every_raw_result_says_what_made_it_and_who_wrote_it() -> None:
    problems = [p for path in sorted(RESULTS.glob("*.csv")) for p in raw_result_problems(path.name, path.read_text())]
    assert not problems, "\n".join(problems)
    assert {path.name for path in RESULTS.glob("*.csv")} >= TRANSCRIBED, "a transcribed file went: drop it here too"


def test_the_raw_result_check_refuses_a_new_transcribed_or_unwritten_file() -> None:
    head = "# what: x\n# machine: one H200\n# command: c\n"
    table = "a,b\n1,2\n"
    good = head + "# written-by: bench/concurrency.py\n# source: its --csv output\n" + table
    assert not raw_result_problems("2026-12-06-h200-x.csv", good)
    retyped = head + "# source: transcribed from the run's printed summary (not written by the measuring script)\n"
    assert "a new transcribed file" in "\n".join(raw_result_problems("2026-12-06-h200-x.csv", retyped + table))
    unwritten = head + "# source: the run's summary\n" + table
    assert "no # written-by" in "\n".join(raw_result_problems("2026-12-06-h200-x.csv", unwritten))
    old = (RESULTS / "2026-12-02-h200-card-pair.csv").read_text()
    unmarked = re.sub(r"# source: .*", "# source: the run's summary", old)
    problems = raw_result_problems("2026-12-02-h200-card-pair.csv", unmarked)
    assert "does not say it was transcribed" in "\n".join(problems)
