"""`localspec models`, `pull`, `check`, `doctor`: pairs, downloads, tokenizer verdicts, the checklist."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from localspec import config
from localspec.cli import options
from localspec.errors import LocalspecError, UsageError
from localspec.llama.layer_features import (
    EAGLE3_ARCH,
    FEATURE_DRAFTER_ARCHS,
    check_block_drafter,
    check_eagle3_drafter,
)
from localspec.models import compat, demo, doctor, hub, memory, placement, registry
from localspec.models.gguf_header import read_header
from localspec.sessions.session import ModelFiles, resolve_files
from localspec.status import Status
from localspec.ui.marks import MARK

console = Console()
GB = 1e9

DefaultOpt = Annotated[
    str | None,
    typer.Option("--default", help="Make this pair the default for commands without model arguments."),
]
SpecOpt = Annotated[
    str | None,
    typer.Option(help="A file on the hub as REPO:FILE (instead of a pair name).", show_default=False),
]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", metavar="",
                                      help="Make the pulled pair the default without asking.")]
PairArg = Annotated[str | None, typer.Argument(help="A pair from `localspec models`.", show_default=False)]
PathArg = Annotated[Path | None, typer.Argument(help="A GGUF file.", show_default=False, readable=False)]


def _size(n: int | None, approx: bool = False) -> str:
    return "?" if n is None else f"{'~' if approx else ''}{n / GB:.1f} GB"


def _fits(pair: registry.Pair, devices: memory.Devices, preset: config.Preset) -> str:
    """Does the pair fit this machine? From the cached headers when downloaded, else from the listed sizes."""
    files = _cached_files(pair)
    if files is not None:
        t = read_header(files[0])
        d = read_header(files[1]) if len(files) > 1 else None
        s = memory.settings_from_preset(preset.with_overrides(kv_type=pair.kv_type, drafter=pair.drafter),
                                        n_ctx=pair.n_ctx)
        try:
            est = memory.estimate(t, d, s, devices)
        except LocalspecError as exc:  # the preset names a device this machine does not have
            return f"[red]?[/] ({escape(str(exc))})"
        if not est.fits:
            return f"[red]no[/] ({escape(est.suggestions[0])})"
        on_cpu = not (devices.gpus or devices.rpc) and not pair.builtin
        return "[yellow]RAM only[/]" if on_cpu else "[green]yes[/]"
    need = pair.expected_bytes
    if need is None:
        return "?"
    # Weights alone (KV comes on top) against every GPU (and RPC server) together: a quick answer before anything
    # is downloaded. Without a GPU the answer is about RAM, and says so: such a pair loads, but it was chosen for
    # a GPU, and "likely" would promise more than loading.
    if devices.gpus or devices.rpc:
        room = sum(g.free for g in devices.gpus + devices.rpc)
        return "[green]likely[/]" if need < room * 0.9 else "[red]no[/]"
    return "[yellow]RAM only[/]" if need < devices.ram_available * 0.9 else "[red]no[/] (RAM)"


def _models_text(pair: registry.Pair) -> str:
    """The pair's two files, one a line."""
    if pair.builtin:
        return demo.DEMOS[pair.name].models_text
    assert pair.target is not None
    second = pair.draft.file if pair.draft is not None else f"its own {pair.drafter} drafter"
    return f"{pair.target.file}\n+ {second}"


def _cached_files(pair: registry.Pair) -> tuple[Path, ...] | None:
    if pair.builtin:
        return demo.DEMOS[pair.name].cached()
    assert pair.target is not None
    found = tuple(hub.cached_path(m) for m in (pair.target, pair.draft) if m is not None)
    return found if None not in found else None  # type: ignore[return-value]


def models(default: DefaultOpt = None, preset: options.PresetOpt = None) -> None:
    """List the model pairs: size, whether downloaded, whether they fit this machine."""
    if default is not None:
        path = registry.set_default_pair(default)
        console.print(f"default pair: [cyan]{default}[/] (saved in {path})")
        return
    pairs = registry.load_pairs()
    current = registry.default_pair_name()
    chosen = config.load_preset(preset or "default")
    devices = memory.probe_devices(placement.rpc_servers(chosen.load), strict=False)
    # Each pair's files go under its name, not in a column of their own: beside the other columns the longest
    # file name (38 characters) leaves no room in 80 columns, and rich would cut it mid-word.
    texts = {p.name: _models_text(p) for p in pairs.values()}
    widest = max(len(line) for text in texts.values() for line in text.splitlines())
    table = Table(title="localspec model pairs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1), leading=1)
    table.add_column("pair: target + draft", overflow="fold", min_width=min(widest + 2, 44))
    for col in ("size", "fits", "ctx, k"):
        table.add_column(col, no_wrap=col != "fits")
    unreadable: list[str] = []
    for pair in pairs.values():
        built = _cached_files(pair)
        if pair.builtin:
            size = _size(sum(p.stat().st_size for p in built)) if built else "-"
            downloaded = "[green]built in[/]"
        else:
            exact = all(m.size is not None for m in (pair.target, pair.draft) if m is not None)
            size = _size(pair.expected_bytes, approx=not exact)
            downloaded = "[green]downloaded[/]" if built else "[dim]not pulled[/]"
        name = Text(("* " if pair.name == current else "  ") + pair.name, style="bold")
        if pair.recommended:
            name.append("  recommended", style="green")
        name.append("\n" + "\n".join(f"  {line}" for line in texts[pair.name].splitlines()), style="dim")
        ctx = "preset" if pair.n_ctx is None else f"{pair.n_ctx}" + (f" {pair.kv_type}" if pair.kv_type else "")
        k = "" if pair.n_draft is None else f"\nk = {pair.n_draft}"
        try:
            fits = _fits(pair, devices, chosen)
        except LocalspecError as exc:  # one corrupt cached file: this row says so, the others still list
            fits = "[red]unreadable[/]"
            unreadable.append(str(exc))
        table.add_row(name, f"{size}\n{downloaded}", fits, ctx + k)
    console.print(table)
    for problem in unreadable:
        console.print(f"[red]✗[/] {escape(problem)}")
    fallback = "" if registry.default_file().is_file() else f"; chat without a default: {registry.DEMO_CHAT.name}"
    console.print(f"* default ({current}){fallback}")
    console.print(f"user pairs: {registry.user_path()}")
    if not devices.gpus:
        console.print("[dim]no usable GPU found: 'fits' is judged against available RAM ('RAM only': the pair "
                      "loads on the CPU, but all except the demos are made for a GPU)[/]")
    elif len(devices.gpus) > 1:
        console.print(f"[dim]'fits' counts all {len(devices.gpus)} GPUs together (the target split by layer)[/]")


def pull(
    pair: PairArg = None,
    target: SpecOpt = None,
    draft: SpecOpt = None,
    yes: YesOpt = False,
) -> None:
    """Download a pair (or --target/--draft REPO:FILE) into the Hugging Face cache, verified and resumable."""
    if pair is not None and (target or draft):
        raise LocalspecError("give a pair name or --target/--draft REPO:FILE, not both")
    if pair is None and not (target or draft):
        raise LocalspecError(
            "name a pair to pull (see `localspec models`) or give --target/--draft REPO:FILE"
        )
    if pair is not None:
        chosen = registry.get_pair(pair)
        if chosen.builtin:
            console.print(f"[cyan]{chosen.name}[/] is built in: nothing to download")
            return
        assert chosen.target is not None
        specs = chosen.files
    else:
        specs = [registry.parse_spec(s) for s in (target, draft) if s]
    for spec in specs:
        console.print(f"pulling [cyan]{spec.label}[/] into {hub.cache_dir()}")
    paths = hub.pull(specs, on_wait=_say_waiting)
    for path in paths:
        console.print(f"[green]✓[/] {path}")
    if pair is not None and registry.default_pair_name() != pair:
        make_default = yes or (
            console.is_terminal and typer.confirm(f"Make {pair} your default pair?", default=True)
        )
        if make_default:
            registry.set_default_pair(pair)
            console.print(f"default pair: [cyan]{pair}[/]")


def _say_waiting(spec: registry.ModelSpec, pid: int | None) -> None:
    who = f"process {pid}" if pid is not None else "another process"
    console.print(f"[yellow]{escape(spec.file)} is already downloading in {who}: waiting for it to finish…[/]")


def check(
    target_path: PathArg = None,
    draft_path: PathArg = None,
    pair: options.PairOpt = None,
) -> None:
    """What can draft for a target (its MTP head, recurrent state) and the draft's tokenizer match, from headers.

    Exit 1 when DRAFT cannot draft for TARGET."""
    if target_path is None and draft_path is not None:
        raise LocalspecError("give TARGET (and DRAFT), or a --pair")
    files = resolve_files(pair, target_path, draft_path)
    target = read_header(files.target)
    console.print(f"target [cyan]{files.target}[/]" + (f"\ndraft  [cyan]{files.draft}[/]" if files.draft else ""))
    for status, line in doctor.drafting_facts(target):
        console.print(f"{MARK[status]} {escape(line)}")
    if files.draft is None:
        return
    draft = read_header(files.draft)
    if draft.arch in FEATURE_DRAFTER_ARCHS:  # DFlash / DSpark / EAGLE-3: its kind and the target layers it reads
        try:
            if draft.arch == EAGLE3_ARCH:
                line = f"drafter: {check_eagle3_drafter(target, draft).title} (--drafter eagle3)"
            else:
                facts = check_block_drafter(target, draft, verify_width=config.load_preset().load.n_batch)
                line = f"block drafter: {facts.title} (--drafter {facts.kind})"
        except UsageError as exc:
            console.print(f"{MARK[Status.FAIL]} {escape(str(exc))}")
            console.print("verdict: [bold red]incompatible[/]")
            raise typer.Exit(1) from None
        console.print(f"{MARK[Status.OK]} {escape(line)}")
    for status, line in doctor.drafting_facts(draft, role="draft"):
        if status != Status.INFO:
            console.print(f"{MARK[status]} {escape(line)}")
    verdict = compat.compare(target, draft)
    if verdict.tokens_match:
        console.print(f"{MARK[Status.OK]} same tokenizer ({escape(target.arch)} / {escape(draft.arch)}): every token "
                      "id means the same text in both models")
    for f in verdict.findings:
        console.print(f"{MARK[f.level]} {escape(f.message)}\n    [dim]{escape(f.why)}[/]")
    color = {"compatible": "green", "compatible with warnings": "yellow", "incompatible": "red"}[
        verdict.label
    ]
    console.print(f"verdict: [bold {color}]{verdict.label}[/]")
    if not verdict.compatible:
        raise typer.Exit(1)


@options.with_run_options
def doctor_cmd(run: options.RunOptions, parallel: options.parallel = None) -> None:
    """The pre-tuning checklist: tokenizer, quantization, settings, GPU build, VRAM, threads, fit; no weights read.

    With --parallel N it checks that N of `serve`'s slots fit."""
    missing = ""
    files: ModelFiles | None
    try:
        files = run.files()
    except LocalspecError as exc:  # e.g. a pair not pulled yet: the checklist still runs and says so
        files, missing = None, str(exc)
    chosen = run.settle(files, "doctor", parallel=parallel)
    checks = doctor.run_checks(files.target if files else None, files.draft if files else None, chosen,
                               n_ctx=chosen.load.n_ctx, missing=missing, parallel=chosen.server.parallel,
                               demo=files is not None and files.name in registry.BUILTIN,
                               mmproj=files.mmproj if files else None)
    console.print(
        f"[bold]localspec doctor[/] pair [cyan]{files.name if files else run.pair or '?'}[/], "
        f"preset {chosen.name}"
    )
    for c in checks:
        console.print(f"{MARK[c.status]} [bold]{c.name}[/]: {escape(c.detail)}")
        if c.fix and c.status != Status.OK:
            console.print(f"    [dim]fix: {escape(c.fix)}[/]")
    if any(c.status == Status.FAIL for c in checks):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(models)
    app.command()(pull)
    app.command()(check)
    app.command(name="doctor")(doctor_cmd)
