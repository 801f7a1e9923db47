"""`localspec bench`: median-of-N plain vs speculative tok/s, live, with a greedy fidelity check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from localspec import config
from localspec.cli import options
from localspec.errors import LocalspecError, WriteError
from localspec.fsutil import atomic_write, check_writable
from localspec.models.gguf_header import read_header
from localspec.models.registry import DEMO
from localspec.sessions import versus
from localspec.sessions.bench import (
    BenchPrompt,
    BenchReport,
    CheckStarted,
    RunDone,
    RunProgress,
    SweepReport,
    WarmupStep,
    load_prompts,
    placement,
    prompt_mode,
    run_bench,
    run_sweep,
    shipped_prompts,
    threads_line,
)
from localspec.sessions.session import check_drafting, open_session
from localspec.ui.bench_view import drafter_choice, live_view, lookup_summary, summary, sweep_table, versus_view

SweepOpt = Annotated[
    str | None,
    typer.Option("--sweep", help="Comma-separated draft lengths to compare instead (e.g. 2,4,6,8).",
                 show_default=False),
]
SavePresetOpt = Annotated[
    str | None,
    typer.Option("--save-preset", help="With --sweep: write the best draft length into this user preset.",
                 show_default=False),
]
JsonOpt = Annotated[
    Path | None, typer.Option("--json", help="Also write the report as JSON to this path.", readable=False)
]
PromptsOpt = Annotated[
    str | None,
    typer.Option("--prompts", help="Your own prompts: one per line, or JSONL with 'prompt' or 'messages'; or a "
                 "shipped set: lookup (code edit, summary, JSON reformat: replies that repeat the prompt; a file "
                 "of that name: ./lookup).", show_default=False),
]
RawFlag = Annotated[
    bool, typer.Option("--raw/--no-raw", metavar="",
                       help="Plain completion: do not send the prompts through the chat template.")
]


@options.with_run_options
def bench(
    run: options.RunOptions,
    repeat: options.repeat = None,
    warmup: options.warmup = None,
    max_tokens: options.max_tokens = None,
    against: options.against = None,
    llama_bin: options.llama_bin = None,
    against_lengths: options.against_lengths = None,
    drafters: options.drafters = None,
    json_path: JsonOpt = None,
    prompts: PromptsOpt = None,
    raw: RawFlag = False,
    sweep: SweepOpt = None,
    save_preset: SavePresetOpt = None,
) -> None:
    """Measure plain vs speculative decoding on a fixed prompt set (code, prose, Q&A) or your own (--prompts)."""
    prompt_set = load_prompts(prompts) if prompts is not None else None  # a bad file fails before any load
    lengths = _parse_sweep(sweep) if sweep is not None else None
    if save_preset is not None and lengths is None:
        raise LocalspecError("--save-preset needs --sweep: it stores the best draft length the sweep finds")
    # Refuse now what could not be saved after minutes of measuring.
    if json_path is not None:
        check_writable(json_path, "bench report")
    if save_preset is not None:
        check_writable(config.user_preset_path(save_preset), "preset", parents=True)
    files, chosen = options.resolve_run(run, "bench", repeat=repeat, warmup=warmup, max_tokens=max_tokens,
                                        against=against, llama_bin=llama_bin, against_lengths=against_lengths,
                                        drafters=drafters)
    names = config.parse_drafter_list(chosen.bench.drafters)
    if names:
        _several(files, chosen, names, options.split_draft_values(run.draft)[0], lengths, json_path, prompt_set,
                 raw)
        return
    if files.draft is None and chosen.draft.drafter not in config.MODEL_FREE_DRAFTERS:
        raise LocalspecError("bench needs a draft model: give --draft PATH (or a --pair), or --drafter lookup "
                             "(or mtp, for a target with MTP layers)")
    if chosen.draft.n_draft == 0:
        raise LocalspecError("--draft 0 turns speculation off; bench compares it with plain decoding, use k >= 1")
    tool = None
    if chosen.bench.against == versus.LLAMA_CPP:  # found and started once before minutes of measuring
        versus.check_comparable(chosen, files.draft is not None, sweep=lengths is not None)
        tool = versus.probe_tool(versus.find_tool(chosen.bench.llama_bin),
                                 versus.SPEC_TYPES[chosen.draft.drafter])

    console = Console()
    console.print(
        f"[bold]localspec bench[/] pair [cyan]{files.name}[/]: target {files.target.name}, "
        f"draft {files.draft.name if files.draft else 'none'} (drafter {chosen.draft.drafter})\n"
        f"{_sampling_line(chosen)}; "
        f"draft length {chosen.draft.n_draft}{' (adaptive)' if chosen.draft.adaptive else ''}; "
        f"{chosen.bench.max_tokens} tokens per prompt"
    )
    if lengths is not None:
        _sweep(console, files, chosen, lengths, json_path, save_preset, prompt_set, raw)
        return
    lookup = _lookup_demo(files, chosen, prompt_set)
    report, lookup_report, llama_plan = _run(console, files, chosen, prompt_set, raw, lookup, tool)
    comparison: versus.Comparison | None = None
    failure: LocalspecError | None = None
    if llama_plan is not None:  # after the session closed: both loops' models need not fit at once
        try:
            comparison = _against(console, llama_plan, report)
        except LocalspecError as exc:  # localspec's own minutes of measuring are kept (printed, and in the JSON)
            failure = exc
    if json_path is not None:
        _write_json(json_path, report, lookup_report,
                    comparison.as_json() if comparison else {"error": str(failure)} if failure else None)
        console.print(f"report written to {json_path}")
    if failure is not None:
        raise failure
    console.line()
    console.print(drafter_choice([report], lookup_report))  # last: the answer to "what do I use here?"
    if not report.greedy_check.passed or (lookup_report is not None and not lookup_report.greedy_check.passed):
        raise typer.Exit(1)


def _several(files, chosen: config.Preset, names: tuple[str, ...], n_draft: int | None, lengths: list[int] | None,
             json_path: Path | None, prompt_set: list[BenchPrompt] | None, raw: bool) -> None:
    """`--drafters A,B`: each drafter against plain in turn, on one session and the same prompts; the last line
    picks from all of them. Every drafter is checked against the models before anything is measured."""
    if lengths is not None or chosen.bench.against == versus.LLAMA_CPP:
        raise LocalspecError("--drafters measures several drafters against plain decoding; --sweep and --against "
                             "take one drafter (--drafter): run them apart")
    # Each drafter's own settings: its length where it has one (the MTP head's), unless --draft named a length.
    parts = [chosen.with_overrides(drafter=name, n_draft=n_draft) for name in names]
    reads_file = [p for p in parts if config.DRAFTER_TABLE[p.draft.drafter].needs_draft_model]
    if files.draft is None and reads_file:
        raise LocalspecError(f"--drafters {chosen.bench.drafters}: {reads_file[0].draft.drafter} needs a draft file "
                             "(--draft PATH or a --pair)")
    target = read_header(files.target)
    draft = read_header(files.draft) if files.draft is not None else None
    for part in parts:  # (a drafter that reads no draft file is checked against the target alone)
        check_drafting(target, draft if part in reads_file else None, part)
    # The session is opened for the drafter that reads the draft file (a block drafter's file fits no other).
    opener = reads_file[0] if reads_file else parts[0]
    console = Console()
    console.print(f"[bold]localspec bench[/] pair [cyan]{files.name}[/]: target {files.target.name}, draft "
                  f"{files.draft.name if files.draft else 'none'}; drafters {', '.join(names)} in turn, each against "
                  f"plain\n{_sampling_line(chosen)}; {chosen.bench.max_tokens} tokens per prompt")
    reports: list[BenchReport] = []
    with open_session(files, opener, longest_draft=max(p.draft.n_draft for p in parts)) as session:
        for part in parts:  # all refused before the first is measured
            session.engine.check_drafter(part.draft)
        _print_placement(console, session)
        _say_prompts(console, session, prompt_set, raw)
        for part in parts:
            title = config.DRAFTER_TABLE[part.draft.drafter].title
            console.line()
            console.print(f"[bold]{title}[/] (drafter {part.draft.drafter}), draft length {part.draft.n_draft}")
            report = _measure(console, session, part, prompt_set, raw,
                              f"decode tok/s, plain vs {title} (prompt processing excluded)")
            console.line()
            console.print(summary(report))
            reports.append(report)
    if json_path is not None:
        _write_json(json_path, reports[0], parts=reports)
        console.print(f"report written to {json_path}")
    console.line()
    console.print(drafter_choice(reports))
    if not all(r.greedy_check.passed for r in reports):
        raise typer.Exit(1)


def _lookup_demo(files, chosen: config.Preset, prompt_set: list[BenchPrompt] | None) -> config.Preset | None:
    """The built-in demo also shows where speculation wins on a CPU: prompt lookup (no draft model, drafting costs
    ~nothing) on replies that repeat their prompt, greedy (a code edit is not sampled). The models are warm by then,
    so two warm-up runs do."""
    if files.name != DEMO.name or prompt_set is not None or chosen.draft.drafter != "model":
        return None
    return chosen.with_overrides(drafter="lookup", temperature=0.0, warmup=min(2, chosen.bench.warmup))


def _run(console: Console, files, chosen: config.Preset, prompt_set: list[BenchPrompt] | None, raw: bool,
         lookup: config.Preset | None = None, tool: versus.Tool | None = None,
         ) -> tuple[BenchReport, BenchReport | None, versus.Plan | None]:
    """The bench on one session; with `lookup`, then the same bench with that preset on the lookup prompt set.
    Each part's verdict is printed under its own table, as soon as the part ends. With `tool`, also what llama.cpp
    must run to decode the same prompt tokens."""
    title = "decode tok/s, plain vs speculative (prompt processing excluded)"
    with open_session(files, chosen) as session:
        _print_placement(console, session)
        _say_prompts(console, session, prompt_set, raw)
        report = _measure(console, session, chosen, prompt_set, raw, title)
        console.line()  # a live display that is not on a terminal ends without a newline
        console.print(summary(report))
        llama_plan = versus.plan(session, chosen, tool, prompt_set, raw) if tool is not None else None
        if lookup is None:
            return report, None, llama_plan
        console.line()
        console.print("[bold]and prompt lookup[/] (drafter lookup: no draft model), greedy, on replies that repeat "
                      "their prompt:")
        lookup_prompts = shipped_prompts("lookup")
        _say_prompts(console, session, lookup_prompts, raw)
        lookup_report = _measure(console, session, lookup, lookup_prompts, raw,
                                 "decode tok/s, plain vs prompt lookup (prompt processing excluded)")
        console.line()
        console.print(lookup_summary(lookup_report))
        return report, lookup_report, llama_plan


def _against(console: Console, plan: versus.Plan, report: BenchReport) -> versus.Comparison:
    """llama.cpp's speculative loop on the same prompts, each run's rate shown as it ends; then the comparison."""
    console.line()
    configs = plan.configs
    lengths = ", ".join(str(n) for n in sorted({c.n_draft for c in configs}))
    search = (f"{len(configs)} configurations (draft lengths {lengths}; "
              f"{', '.join(ds or 'greedy' for ds in plan.draft_samplings)} draft; {', '.join(plan.modes)} sampling) "
              f"once each, then the {versus.FINALISTS} fastest" if len(configs) > versus.FINALISTS
              else ", ".join(c.label for c in configs))
    console.print(f"[bold]against llama.cpp[/]: {plan.tool.path} ({plan.tool.version or 'version unknown'}), "
                  f"{search}: {plan.preset.bench.repeat} runs of {len(plan.prompts)} prompt(s) each (one process "
                  "per prompt: every run loads the models again)")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True) as progress:
        task = None
        for event in versus.run_against(plan, report):
            if isinstance(event, versus.Comparison):
                comparison = event
                break
            task = task if task is not None else progress.add_task("llama.cpp", total=event.total)
            t = event.result.timings
            progress.update(task, completed=event.done, description=f"llama.cpp {event.result.config.label} "
                            f"{event.result.prompt}: {t.tokens / t.seconds if t.seconds else 0:.1f} tok/s")
    console.print(versus_view(comparison))
    return comparison


def _measure(console: Console, session, chosen: config.Preset, prompt_set: list[BenchPrompt] | None, raw: bool,
             title: str) -> BenchReport:
    events = run_bench(session, chosen, prompt_set, raw)
    runs = []
    progress = Progress(TextColumn("warming up"), BarColumn(), MofNCompleteColumn(), console=console,
                        transient=True)
    with progress:
        task = progress.add_task("warm-up", total=chosen.bench.warmup)
        event = next(events)
        while isinstance(event, WarmupStep | RunProgress):
            if isinstance(event, WarmupStep):
                progress.update(task, completed=event.done)
            event = next(events)
    with Live(live_view(runs, chosen.bench.repeat, title), console=console, refresh_per_second=4) as live:
        while not isinstance(event, BenchReport):
            if isinstance(event, RunDone):
                runs.append(event.result)
                live.update(live_view(runs, chosen.bench.repeat, title))
            elif isinstance(event, RunProgress):
                live.update(live_view(runs, chosen.bench.repeat, title, event))
            elif isinstance(event, CheckStarted):
                live.console.print(f"checking greedy fidelity on {event.prompts} prompts…")
            event = next(events)
    return event


def _print_placement(console: Console, session) -> None:
    where = placement(session)
    fitted = where["draft_ahead"] and session.preset.draft.draft_ahead_length == "fit"
    console.print(f"placement: target {where['target']}, draft {where['draft']}; draft-ahead "
                  f"{'on' if where['draft_ahead'] else 'off'}{' (fitted to the verify)' if fitted else ''}")
    console.print(f"threads: {threads_line(session)}")


def _parse_sweep(text: str) -> list[int]:
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise LocalspecError(f"--sweep {text}: expected comma-separated draft lengths, e.g. 2,4,6,8") from None
    if not lengths or lengths[0] < 1 or lengths[-1] > 32:
        raise LocalspecError(f"--sweep {text}: draft lengths must be between 1 and 32")
    return lengths


def _say_prompts(console: Console, session, prompt_set: list[BenchPrompt] | None, raw: bool) -> None:
    count = len(prompt_set) if prompt_set is not None else 3
    where = (("the lookup prompts (code edit, summary, JSON)" if [p.name for p in prompt_set] ==
              [p.name for p in shipped_prompts("lookup")] else "your prompts")
             if prompt_set is not None else "the shipped prompts (code, prose, Q&A)")
    console.print(f"{count} prompt(s): {where}, as {prompt_mode(session, raw)}")


def _sampling_line(chosen: config.Preset) -> str:
    """The preset and the sampling every mode runs with, for the header."""
    s = chosen.sampling
    return (f"preset {chosen.name}: temperature {s.temperature}, top_k {s.top_k}, top_p {s.top_p}, "
            f"{_seeds(s, chosen.bench.repeat)}")


def _seeds(sampling: config.Sampling, repeat: int) -> str:
    """The seeds the measured runs take: one a repetition, the same for every mode (`Sampling.repetition`)."""
    if sampling.greedy or repeat == 1:
        return f"seed {sampling.seed}"
    return f"seeds {sampling.seed}..{sampling.repetition(repeat - 1).seed} (one a repetition, every mode alike)"


def _sweep(console: Console, files, chosen: config.Preset, lengths: list[int], json_path: Path | None,
           save_preset: str | None, prompt_set: list[BenchPrompt] | None, raw: bool) -> None:
    with open_session(files, chosen, longest_draft=max(lengths)) as session:
        _print_placement(console, session)
        _say_prompts(console, session, prompt_set, raw)
        events = run_sweep(session, chosen, lengths, prompt_set, raw)
        total = chosen.bench.warmup + chosen.bench.repeat * (len(lengths) + 1 + chosen.draft.stand_aside)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console,
                      transient=True) as progress:
            task = progress.add_task("sweeping", total=total)
            for event in events:
                if isinstance(event, SweepReport):
                    report = event
                    break
                if isinstance(event, RunProgress):  # a run under way: its rate so far, no step forward
                    progress.update(task, description=f"{event.mode}: {event.tokens}/{event.total} tokens, "
                                    f"{event.tok_s:.1f} tok/s")
                    continue
                label = "warming up" if isinstance(event, WarmupStep) else f"run {event.done}/{event.total}"
                progress.update(task, advance=1, description=label)
    console.print(sweep_table(report))
    best = report.best
    console.print(f"best draft length here: [bold]{best.n_draft}[/] "
                  f"({best.summary.median_tps:.1f} tok/s, {best.summary.median_tps / report.plain_tps:.2f}x plain)")
    default = report.default
    if default is not None:  # the preset's own policy: its length, standing aside where drafting loses
        d = default.summary
        aside = f"; {d.standing_aside}" if d.standing_aside else ""
        console.print(f"the default (draft length {default.n_draft}, standing aside where drafting loses): "
                      f"{d.median_tps:.1f} tok/s, {d.median_tps / report.plain_tps:.2f}x plain, "
                      f"{d.median_tps / best.summary.median_tps:.2f}x the best fixed length{aside}")
    if json_path is not None:
        _write_json(json_path, report)
        console.print(f"report written to {json_path}")
    if save_preset is not None:
        tuned = chosen.with_overrides(n_draft=best.n_draft)
        try:
            path = config.save_user_preset(save_preset, tuned)
        except WriteError as exc:
            # The sweep's result must not be lost: show the preset so it can be saved by hand.
            print(config.preset_text(tuned), end="", flush=True)
            raise WriteError(f"{exc}; the preset is printed above instead") from None
        console.print(f"saved draft length {best.n_draft} to preset {save_preset!r} ({path})")


def _write_json(path: Path, report: BenchReport | SweepReport, lookup: BenchReport | None = None,
                against: dict | None = None, parts: list[BenchReport] | None = None) -> None:
    data = report.as_json()
    if parts is not None:
        data["parts"] = [part.as_json() for part in parts]  # --drafters: every drafter's report (the first above)
    if lookup is not None:
        data["lookup_demo"] = lookup.as_json()  # the built-in demo's second part: prompt lookup, same keys
    if against is not None:
        data["against"] = against  # llama.cpp's loop on the same prompts (or why it could not run)
    text = json.dumps(data, indent=2) + "\n"
    try:
        atomic_write(path, text, what="bench report")
    except WriteError as exc:
        # Checked before the run, yet the disk can fill or the folder vanish meanwhile: keep the result.
        print(text, end="", flush=True)
        raise WriteError(f"{exc}; the report is printed above instead") from None


def register(app: typer.Typer) -> None:
    app.command()(bench)
