"""Terminal output: rich progress bars during a run, and the table of checks after it."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from certification.certificate import Certificate

STYLE = {
    "certified": "bold green",
    "pass": "green",
    "provisional": "bold yellow",
    "failed": "bold red",
    "fail": "bold red",
    "drift": "bold red",
    "n/a": "dim",
    "info": "dim",
}


class RichProgress:
    """`certification.runner.Progress` on rich bars (safe from the reference thread: rich
    serializes updates with its own lock)."""

    def __init__(self, console: Console) -> None:
        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> RichProgress:
        self.bars.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:  # the with-statement's (type, value, traceback)
        self.bars.__exit__(*exc)

    def start(self, key: str, description: str, total: int) -> None:
        if key in self._tasks:
            self.bars.update(self._tasks[key], description=description, total=total, completed=0)
        else:
            self._tasks[key] = self.bars.add_task(description, total=total)

    def advance(self, key: str, n: int = 1) -> None:
        if key in self._tasks:
            self.bars.advance(self._tasks[key], n)


def print_certificate(console: Console, cert: Certificate) -> None:
    k = cert.key
    console.print(
        f"[bold]{escape(k.model)}[/] on the [bold]{escape(k.lane)}[/] lane "
        f"({escape(k.precision)}, {escape(k.engine)} {escape(k.engine_version)}): "
        f"[{STYLE[cert.status]}]{cert.status.upper()}[/]  certificate {cert.id}"
    )
    if cert.provenance is not None:
        console.print(f"  [dim]model files:[/] {escape(cert.provenance.label())}")
    # Narrow terminals: details go below the table rather than into a 2-character column.
    wide = console.width >= 110
    table = Table()
    for name in ("check", "status", "value", "threshold"):
        table.add_column(name, no_wrap=True)
    if wide:
        table.add_column("detail")
    for c in cert.checks:
        row = [
            c.name,
            f"[{STYLE.get(c.status, '')}]{c.status}[/]",
            _fmt(c.value),
            f"{c.op} {_fmt(c.threshold)}".strip(),
        ]
        table.add_row(*row, *([escape(c.detail)] if wide else []))
    console.print(table)
    if not wide:
        for c in cert.checks:
            if c.detail:
                console.print(f"  [dim]{c.name}:[/] {escape(c.detail)}")
    for o in cert.outputs:
        if o.status == "not served":  # neither pass nor fail; its detail says why
            said = f"[bold magenta]{escape(o.detail or o.status)}[/]"
        else:
            detail = f" [dim]{escape(o.detail)}[/]" if o.detail else ""
            said = f"[{STYLE[o.status]}]{o.status}[/]{detail}"
        console.print(f"  output [bold]{escape(o.output)}[/]: {said}")
    if cert.failing:
        console.print(f"[bold red]failing:[/] {', '.join(cert.failing)}")
    notes = [
        f"quality gate {cert.quality}",
        f"placement gate {cert.placement}",
        f"fingerprint {cert.fingerprint.short}",
    ]
    if cert.corpus.sample_stride > 1:
        notes.append(
            f"SAMPLED: every {cert.corpus.sample_stride}th corpus item "
            f"({cert.corpus.n_items}/{cert.corpus.n_total})"
        )
    if cert.overrides:
        notes.append(f"overrides {cert.overrides}")
    console.print("; ".join(notes))
    console.print(
        f"[dim]judged by[/] {escape(cert.reference)}"
        + (f" [dim]on[/] {escape(cert.reference_dir)}" if cert.reference_dir else "")
    )


def print_list(console: Console, certs: list[Certificate]) -> None:
    table = Table("id", "model", "lane", "status", "failing", "shapes", "engine", "created")
    for c in certs:
        table.add_row(
            c.id,
            c.key.model,
            c.key.lane,
            f"[{STYLE[c.status]}]{c.status}[/]",
            ", ".join(c.failing),
            ",".join(c.key.shapes),
            f"{c.key.engine} {c.key.engine_version}",
            c.created_at,
        )
    console.print(table)


def _fmt(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.7g}"
    return str(value)
