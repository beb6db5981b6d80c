"""A progress bar on stderr for work that takes more than a second (a sweep's candidates, a
check's models): shown only on a terminal, never with --quiet, and only once the work has run
for `DELAY` seconds, so quick answers stay clean.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

DELAY = 1.0  # seconds before the bar appears


class Progress:
    """A callable `progress(done, total)` that draws a Rich bar once `DELAY` has passed."""

    def __init__(self, description: str, enabled: bool):
        self.description = description
        self.enabled = enabled
        self.started = time.monotonic()
        self._bar = None
        self._task = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            if time.monotonic() - self.started < DELAY:
                return
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=total)
        self._bar.update(self._task, completed=done, total=total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextmanager
def progress(description: str, quiet: bool) -> Iterator[Progress]:
    """The bar for one piece of work; disabled when quiet or stderr is not a terminal."""
    bar = Progress(description, enabled=not quiet and sys.stderr.isatty())
    try:
        yield bar
    finally:
        bar.close()
