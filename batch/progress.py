"""Job progress: a rich bar on a terminal, a log line every few seconds otherwise."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


class JobProgress:
    def __init__(
        self,
        total: int | None,
        rows_before: int = 0,
        tokens_before: int = 0,
        errors_before: int = 0,
        interval_s: float = 5.0,
        stream=None,
    ) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        self.rows, self.tokens, self.errors = rows_before, tokens_before, errors_before
        self._rows0, self._tokens0 = rows_before, tokens_before
        self._start = time.monotonic()
        self._last_log = self._start
        self.interval_s = interval_s
        self._bar: Progress | None = None
        if self.stream.isatty():
            self._bar = Progress(
                TextColumn("[bold]embedding"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} rows"),
                TextColumn("{task.fields[rate]}"),
                TextColumn("{task.fields[errs]}"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=False,
            )
            self._task = self._bar.add_task(
                "rows", total=total, completed=rows_before, rate="", errs=""
            )
            self._bar.start()

    def rates(self) -> tuple[float, float]:
        dt = max(1e-9, time.monotonic() - self._start)
        return (self.rows - self._rows0) / dt, (self.tokens - self._tokens0) / dt

    def update(self, rows: int, tokens: int, errors: int) -> None:
        self.rows += rows
        self.tokens += tokens
        self.errors += errors
        rps, tps = self.rates()
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=self.rows + self.errors,
                rate=f"{rps:,.0f} rows/s {tps:,.0f} tok/s",
                errs=f"{self.errors} errors",
            )
            return
        now = time.monotonic()
        if now - self._last_log >= self.interval_s:
            self._last_log = now
            done = self.rows + self.errors
            eta = ""
            if self.total and rps > 0:
                eta = f", ETA {max(0.0, (self.total - done) / rps):.0f} s"
            total = f"/{self.total}" if self.total else ""
            print(
                f"batch: {done}{total} rows, {rps:,.0f} rows/s, {tps:,.0f} tokens/s, "
                f"{self.errors} errors{eta}",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
