"""How a Status looks in the terminal: one mark per level, for every check the CLI draws."""

from __future__ import annotations

from localspec.status import Status

MARK: dict[Status, str] = {
    Status.OK: "[green]✓[/]",
    Status.INFO: "[blue]·[/]",
    Status.WARN: "[yellow]⚠[/]",
    Status.FAIL: "[red]✗[/]",
}
