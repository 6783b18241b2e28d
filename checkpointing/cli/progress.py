"""A progress bar for the long commands (verify, gc, export), drawn on a terminal only (layer: cli).

Piped output gets the plain lines only: off a terminal (or with nothing to count) the bar is a no-op.
"""

from __future__ import annotations

from typing import Iterator, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

T = TypeVar("T")


class Bar:
    """A rich progress bar, drawn below the lines printed meanwhile and removed at the end."""

    def __init__(self, console: Console, what: str, total: int) -> None:
        self._progress: Progress | None = None
        if console.is_terminal and total > 0:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), console=console, transient=True)
            self._task = self._progress.add_task(what, total=total)

    def __enter__(self) -> "Bar":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)


def each(console: Console, what: str, items: list[T]) -> Iterator[T]:
    """`items`, advancing a progress bar (on a terminal only) after each."""
    with Bar(console, what, len(items)) as bar:
        for item in items:
            yield item
            bar.advance()

