"""The bench table: filled in live while runs finish, then the verdict lines."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from localspec.config import DRAFTER_TABLE
from localspec.sessions.bench import PLAIN, SPEC, BenchReport, ModeSummary, RunProgress, RunResult, SweepReport
from localspec.sessions.versus import TOOL, Comparison

# The table's short headers, said in full once (they must stay short to fit 80 columns).
LEGEND = ("accept: share of drafted tokens the target kept · mean acc: drafted tokens kept per round (plus one "
          "of the target's own) · host: time outside llama.cpp (and outside waits for a draft-ahead)")


def progress_line(progress: RunProgress, done: int, total: int) -> Text:
    """The run under way: which one, its tokens so far and their rate, so a slow machine never looks hung."""
    return Text(f"run {done + 1}/{total} ({progress.mode}): {progress.tokens}/{progress.total} tokens · "
                f"{progress.tok_s:.1f} tok/s so far", style="dim")


def live_view(runs: list[RunResult], repeat: int, title: str, progress: RunProgress | None = None) -> Group:
    """The live table, with the legend under it and the run under way below that."""
    parts: list[Table | Text] = [live_table(runs, repeat, title), Text(LEGEND, style="dim")]
    if progress is not None:
        parts.append(progress_line(progress, len(runs), 2 * repeat))
    return Group(*parts)


def live_table(runs: list[RunResult], repeat: int, title: str) -> Table:
    # Short headers: the table must fit an 80-column terminal without truncating a number.
    table = Table(title=title, title_justify="left")
    table.add_column("mode", no_wrap=True)
    table.add_column("runs", justify="right")
    table.add_column("median", justify="right", style="bold")
    table.add_column("min", justify="right")
    table.add_column("max", justify="right")
    table.add_column("accept", justify="right")
    table.add_column("mean acc", justify="right")
    table.add_column("host", justify="right")
    for mode in (PLAIN, SPEC):
        mine = [r for r in runs if r.mode == mode]
        if not mine:
            table.add_row(mode, f"0/{repeat}", "…", "", "", "", "", "")
            continue
        m = ModeSummary.of(mode, mine)
        table.add_row(
            mode, f"{m.runs}/{repeat}", f"{m.median_tps:.1f}", f"{m.min_tps:.1f}", f"{m.max_tps:.1f}",
            f"{m.acceptance_rate:.1%}" if mode == SPEC else "—", f"{m.mean_accepted:.2f}" if mode == SPEC else "—",
            f"{m.host_fraction:.1%}",
        )
    return table


def summary(report: BenchReport) -> Group:
    """One part's verdict, its greedy check and what to run next, printed under that part's own table."""
    return Group(*_outcome(report), *(Text(line) for line in report.advice))


def lookup_summary(lookup: BenchReport) -> Group:
    """The built-in demo's prompt-lookup part, under its own table: its speedup, its check, what it means."""
    wins = lookup.speedup >= 1
    lines = [Text(f"prompt lookup (no draft model) on replies that repeat their prompt: {lookup.speedup:.2f}x plain "
                  "decoding", style="bold green" if wins else "bold yellow")]
    lines.extend(_outcome(lookup)[2:])  # its checks; the headline is the line above
    lines.append(Text(f"{'there' if wins else 'even there'}, speculation {'wins' if wins else 'does not win'} on "
                      "this machine: drafting by lookup costs ~nothing; try it with `localspec chat --drafter lookup` "
                      "on a code edit"))
    return Group(*lines)


def drafter_choice(reports: list[BenchReport], lookup: BenchReport | None = None) -> Text:
    """The last line: which drafter to use on this machine, from every part measured (a part whose greedy check
    failed is never recommended): each drafter's (`--drafters`: several), the demo's prompt lookup."""
    parts = [(r, "") for r in reports] + ([(lookup, " on replies that repeat their prompt")] if lookup else [])
    measured = "; ".join(f"{DRAFTER_TABLE[r.preset.draft.drafter].title}{_aside_words(r)} {r.speedup:.2f}x "
                         f"plain{where}" for r, where in parts)
    paying = [r for r, _ in parts if r.speedup >= 1 and r.greedy_check.passed and not r.speculative.standing_aside]
    if not paying:
        if all(r.speculative.standing_aside for r, _ in parts):
            return Text(f"on this machine: drafting does not pay here and stands aside by itself ({measured}): "
                        "the default decodes at about plain speed", style="bold yellow")
        return Text(f"on this machine: no drafter measured here beats plain decoding ({measured}); plain decoding "
                    "(`--draft 0`) is the faster choice here", style="bold yellow")
    best = max(paying, key=lambda r: r.speedup)
    return Text(f"on this machine: use `--drafter {best.preset.draft.drafter}` ({measured})", style="bold green")


def _cut_by(drafter: str) -> str:
    """What shortens a round's draft below the length, by drafter."""
    if drafter == "dspark":
        return "its confidence head ends a block at the first position under p_min; the cost rule sets the length"
    if drafter in ("lookup", "suffix", "chain", "chain-mtp"):
        return "a match ends where the text it copies does; the cost rule sets the length"
    return "p_min and the cost rule set each round's length"


def _aside_words(report: BenchReport) -> str:
    """How a part that stood aside ran, before its speedup in the closing line."""
    if not report.speculative.standing_aside:
        return ""
    return " stood aside (decoding as plain does, within this machine's noise)," if report.decoded_as_plain \
        else " stood aside,"


def _outcome(report: BenchReport) -> list[Text]:
    lines = [Text(f"speedup (median speculative / median plain): {report.speedup:.2f}x",
                  style="bold green" if report.speedup >= 1 else "bold yellow")]
    lines.append(Text(report.verdict, style="green" if report.speedup >= 1 else "yellow"))
    drafted = report.speculative.mean_drafted
    if 0 < drafted < report.n_draft - 0.05:  # (a length chosen round by round: say what was chosen)
        lines.append(Text(f"drafts: {drafted:.1f} tokens a round where it drafted, of up to {report.n_draft} "
                          f"({_cut_by(report.preset.draft.drafter)})"))
    if report.speculative.ahead_hit_rate is not None:
        lines.append(Text(f"draft-ahead: {report.speculative.ahead_hit_rate:.0%} of the rounds drafted during the "
                          "previous verify were used"))
    check = report.greedy_check
    if check.exact:  # CPU: batch and single-token logits are bitwise equal, so the outputs must be too
        style = "green" if check.passed else "bold red"
        lines.append(Text(f"{'✓' if check.passed else '✗'} greedy: speculative output is {check.describe()}",
                          style=style))
    else:  # GPU: logits depend on the batch shape; only a near-tie may leave single-token decoding's choice
        mark, style = ("✓", "green") if check.passed else ("✗", "bold red")
        lines.append(Text(f"{mark} greedy: {check.describe_single()}", style=style))
        lines.append(Text(f"  on this GPU, speculative output is {check.describe()} (batch and single-token "
                          "logits differ here; see docs/gpu.md)", style="green" if not check.diverged else "yellow"))
    lines.extend(Text(f"⚠ {warning}", style="yellow") for warning in report.warnings)
    return lines


def sweep_table(report: SweepReport) -> Table:
    """The draft-length table with a bar per row, scaled to the fastest."""
    top = max(r.summary.median_tps for r in report.rows) or 1.0
    best = report.best.n_draft
    table = Table(title="draft length sweep (median decode tok/s)", title_justify="left")
    for name, justify in (("k", "right"), ("tok/s", "right"), ("vs plain", "right"), ("acceptance", "right"),
                          ("mean accepted", "right"), ("", "left")):
        table.add_column(name, justify=justify)
    for row in report.rows:
        s = row.summary
        bar = "█" * max(1, round(30 * s.median_tps / top))
        style = "bold green" if row.n_draft == best and not row.default else ("dim" if row.n_draft == 0 else "")
        label = f"default ({row.n_draft})" if row.default else "plain" if row.n_draft == 0 else str(row.n_draft)
        table.add_row(
            label, f"{s.median_tps:.1f}",
            f"{s.median_tps / report.plain_tps:.2f}x" if report.plain_tps else "",
            f"{s.acceptance_rate:.1%}" if row.n_draft else "—", f"{s.mean_accepted:.2f}" if row.n_draft else "—",
            Text(bar, style=style or "cyan"),
        )
    return table


def versus_view(comparison: Comparison) -> Group:
    """llama.cpp's speculative loop beside localspec's: its modes' medians, the ratio, its greedy text at T = 0."""
    table = Table(title=f"decode tok/s, llama.cpp's {TOOL} on the same files and prompts", title_justify="left")
    for name in ("loop", "runs", "median", "min", "max", "accept"):
        table.add_column(name, justify="left" if name == "loop" else "right", no_wrap=name == "loop")
    best = comparison.best
    for m in comparison.modes:
        table.add_row(f"llama.cpp, {m.mode} sampling", str(m.runs), f"{m.median_tps:.1f}", f"{m.min_tps:.1f}",
                      f"{m.max_tps:.1f}", f"{m.acceptance_rate:.1%}" if m.acceptance_rate is not None else "—",
                      style="bold" if m is best else "")
    table.add_row("localspec speculative", "", f"{comparison.localspec_tps:.1f}", "", "", "", style="bold")
    lines: list[Table | Text] = [table]
    ratio = comparison.ratio
    if ratio is None or best is None:
        lines.append(Text("no complete llama.cpp run to compare with", style="bold yellow"))
    else:
        lines.append(Text(f"localspec / llama.cpp: {ratio:.2f}x (llama.cpp's faster mode: {best.mode} sampling; "
                          f"temperature {comparison.temperature:g})",
                          style="bold green" if ratio >= 1 else "bold yellow"))
    for mode in dict.fromkeys(g.mode for g in comparison.greedy):
        mine = [g for g in comparison.greedy if g.mode == mode]
        off = [g for g in mine if g.first_divergence is not None]
        if not off:
            lines.append(Text(f"llama.cpp's greedy text ({mode} sampling) is plain decoding's on {len(mine)} of "
                              f"{len(mine)} prompts"))
        else:
            where = ", ".join(f"{g.prompt!r} at token {g.first_divergence}"
                              + (f" (top-2 margin {g.plain_margin:.3f})" if g.plain_margin is not None else "")
                              for g in off)
            lines.append(Text(f"llama.cpp's greedy text ({mode} sampling) leaves plain decoding's on {len(off)} of "
                              f"{len(mine)} prompts: {where}", style="yellow"))
    lines.extend(Text(f"⚠ {warning}", style="yellow") for warning in comparison.warnings)
    return Group(*lines)
