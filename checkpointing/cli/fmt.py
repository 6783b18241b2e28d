"""How the CLI writes for people: sizes, seconds, rates, percentages, and a command's failure (layer: cli).

Every command formats its numbers with these, and fails one way: `fail` prints ``error: MESSAGE``
(the message as it is, never read as rich markup) and gives the exit code; a helper deep inside a
command raises `CommandFailed` instead, and cli/app.py's `main` hands it to `fail`.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

USAGE = 2  # the exit code for bad usage, an unreachable tier, or nothing to show


def size(n: float | None) -> str:
    """Bytes for people, in powers of 1000: ``"512 B"``, ``"37.8 MB"``; ``""`` for None."""
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def seconds(x: float | None) -> str:
    """Seconds for people: ``"4.0 ms"`` below one second, ``"2.50 s"`` above, ``""`` for None."""
    if x is None:
        return ""
    return f"{x * 1e3:.1f} ms" if abs(x) < 1 else f"{x:.2f} s"


def mb_per_s(x: float | None) -> str:
    """A throughput in bytes per second as MB/s (1 MB = 1e6 B), without the unit; ``""`` for None."""
    return "" if x is None else f"{x / 1e6:.1f}"


def percent(x: float | None) -> str:
    """A percentage: ``"12.15%"``; ``""`` for None."""
    return "" if x is None else f"{x:.2f}%"


class CommandFailed(Exception):
    """A command cannot go on: `main` prints the message as an error and exits with `code`."""

    def __init__(self, message: str, code: int = USAGE) -> None:
        super().__init__(message)
        self.code = code


def fail(console: Console, message: str, code: int = USAGE) -> int:
    """Print ``error: MESSAGE`` on `console` and return the exit code."""
    console.print(f"[red]error:[/red] {escape(message)}")
    return code
