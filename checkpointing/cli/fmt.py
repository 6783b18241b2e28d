"""How the CLI writes for people: sizes, seconds, rates, percentages, and a command's failure (layer: cli).

Every command formats its numbers with these: a single value with its unit (`size`, `seconds`), a
table column with its unit said once, in the header (`Unit`, `time_unit`, `size_unit`);
`wrap_points` breaks a long key or message into lines (tables.py: text wraps, numbers never). Every
command fails one way: `fail` prints ``error: MESSAGE``
(the message as it is, never read as rich markup) and gives the exit code; a helper deep inside a
command raises `CommandFailed` instead, and cli/app.py's `main` hands it to `fail`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

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


@dataclasses.dataclass(frozen=True)
class Unit:
    """A table column's unit: `name` goes in the header, each cell is the bare number in it.

    ``Unit("ms", 1e-3, 1)(0.0964) == "96.4"``; a value too small for the decimals keeps two
    significant digits (``Unit("MB", 1e6, 1)(4100) == "0.0041"``), so no nonzero number reads 0.
    """

    name: str
    scale: float = 1.0
    decimals: int = 1

    def __call__(self, x: float | None) -> str:
        if x is None:
            return ""
        if x == 0:
            return "0"
        v = x / self.scale
        text = f"{v:.{self.decimals}f}"
        if v != 0 and float(text) == 0:
            text = f"{v:.{min(12, 1 - math.floor(math.log10(abs(v))))}f}"
        return text


PERCENT = Unit("%", 1.0, 2)
MB_PER_S = Unit("MB/s", 1e6, 1)
_SIZE_UNITS = (Unit("B", 1.0, 0), Unit("KB", 1e3), Unit("MB", 1e6), Unit("GB", 1e9), Unit("TB", 1e12))


def time_unit(values: Iterable[float | None]) -> Unit:
    """Milliseconds for a column of times all below one second, else seconds (two decimals)."""
    return Unit("ms", 1e-3, 1) if all(abs(v) < 1 for v in values if v is not None) else Unit("s", 1.0, 2)


def size_unit(values: Iterable[float | None]) -> Unit:
    """The largest of B, KB, MB, GB, TB (powers of 1000) that the column's biggest value fills."""
    top = max((abs(v) for v in values if v is not None), default=0.0)
    return next((u for u in reversed(_SIZE_UNITS) if top >= u.scale), _SIZE_UNITS[0])


def wrap(text: str, width: int, breaks: str = " ") -> str:
    """`text` in lines of at most `width` characters (see `wrap_points`), the spaces at the breaks dropped."""
    edges = [0, *wrap_points(text, width, breaks), len(text)]
    return "\n".join(text[a:b].rstrip(" ") for a, b in zip(edges, edges[1:]))


def wrap_points(text: str, width: int, breaks: str = " ") -> list[int]:
    """Where to break `text` into lines of at most `width` characters (spaces at a line's end not
    counted): after any of `breaks` (a key: after "/" or "."); a piece longer than a line is split
    where it must."""
    width = max(1, width)
    points: list[int] = []
    start = pos = 0  # the line being filled starts at `start`; the pieces placed so far end at `pos`
    for piece in _pieces(text, breaks):
        end = pos + len(piece)
        if len(text[start:end].rstrip(" ")) > width and pos > start:
            points.append(pos)
            start = pos
        while len(text[start:end].rstrip(" ")) > width:
            start += width
            points.append(start)
        pos = end
    return points


def _pieces(text: str, breaks: str) -> list[str]:
    """`text` cut after each break character (the pieces join back to `text`)."""
    out, start = [], 0
    for i, ch in enumerate(text):
        if ch in breaks:
            out.append(text[start : i + 1])
            start = i + 1
    return out + ([text[start:]] if start < len(text) else [])


class CommandFailed(Exception):
    """A command cannot go on: `main` prints the message as an error and exits with `code`."""

    def __init__(self, message: str, code: int = USAGE) -> None:
        super().__init__(message)
        self.code = code


def fail(console: Console, message: str, code: int = USAGE) -> int:
    """Print ``error: MESSAGE`` on `console` and return the exit code."""
    console.print(f"[red]error:[/red] {escape(message)}")
    return code
