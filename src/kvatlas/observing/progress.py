"""A progress bar with an estimate of the time left, for long CLI work (`simulate` over a long
trace, `compare` over many engines). It draws on stderr, and only when stderr is a terminal:
piped, logged or `--json` output stays exactly what it was. It is transient (gone when the work
ends) and updates at most a few times a second, so a fast run pays nothing visible."""

from __future__ import annotations

import sys
import time


def wanted(quiet: bool = False) -> bool:
    """Draw a bar only on a terminal, and never when the output is machine-read (--json)."""
    try:
        return not quiet and sys.stderr.isatty()
    except (AttributeError, ValueError):   # a replaced or closed stderr
        return False


class Bar:
    """`with Bar(total, "simulate", enabled) as bar: ... bar.update(done)`; disabled: no-ops."""

    def __init__(self, total: float, label: str, enabled: bool, unit: str = "") -> None:
        self.total, self.label, self.unit = max(float(total), 1.0), label, unit
        self.enabled = enabled
        self._progress = self._task = None
        self._last = 0.0

    def __enter__(self) -> "Bar":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn(self.unit), TextColumn("time left"), TimeRemainingColumn(),
                                      console=Console(file=sys.stderr), transient=True, refresh_per_second=4)
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=self.total)
        return self

    def update(self, done: float, force: bool = False) -> None:
        if self._progress is None:
            return
        now = time.monotonic()
        if force or now - self._last >= 0.1:   # rich's own refresh is 4/s: more updates buy nothing
            self._last = now
            self._progress.update(self._task, completed=min(done, self.total))

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
