"""Tables that fit the terminal: which columns a view shows, and how it gives way to a narrow one (layer: cli).

A view (ls, inspect, report) lists its `Column`s and rows of cells; `fit` lays them out for a width:

- the default view shows the columns marked ``default``; ``--wide`` (``wide=True``) shows them all;
- a number column never wraps and is never cut; its unit is said once, on a second header line;
- at most one ``flex`` column (a key, metrics, a message: text, never a bare number) wraps to the
  width left, broken after the characters in its ``breaks``, never narrower than its longest
  unbreakable word when it breaks at spaces only (``loss=0.31`` stays whole);
- while the table is still wider than the console, the column with the highest ``drop`` goes first
  (0: never dropped); the notes under the table name every column --wide adds;
- a column's `note` (what it means) is printed under the table when the column shows;
- a title or note longer than the table is printed as its own line (a long path wraps at the
  console's width instead of squeezing the table's columns).

A table that cannot fit even so (``--wide``, a very narrow console) is printed wider than the
console (`show`) rather than cut: a terminal then wraps it, a pipe gets it whole.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence, Union

from rich.cells import cell_len
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from checkpointing.cli import fmt

Cell = Union[str, Text]  # a str is rich markup (escape what comes from outside); a Text is printed as it is


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a view: its header (and unit), where it shows, and how it may give way."""

    header: str
    unit: str = ""  # said once, on the header's second line ("ms", "MB", "%")
    justify: Literal["left", "right"] = "right"
    default: bool = True  # shown without --wide
    drop: int = 0  # 0: always shown; otherwise dropped (highest first) while the table is too wide
    flex: bool = False  # text that may wrap to fit
    breaks: str = " "  # where a flex cell may break a line ("/." for a key)
    min_width: int = 8  # the narrowest a flex column gets
    note: str = ""  # what the column means, printed under the table when it shows

    @property
    def label(self) -> str:
        """The header on one line: ``"stall ms"``."""
        return f"{self.header} {self.unit}".strip()


@dataclasses.dataclass(frozen=True)
class View:
    """What `fit` made: the renderable, the width it needs, and the columns it left out."""

    renderable: RenderableType
    width: int
    hidden: tuple[str, ...]


def fit(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], *, width: int | None, wide: bool = False,
        title: str = "", notes: Sequence[str] = (), more: str = "--wide") -> View:
    """Lay out `rows` (one cell per column) for `width` (None: no limit); see the module docstring.

    `title` and `notes` are plain text (never markup); `more` is the option that shows every column,
    named in the note that lists the hidden ones (``""``: no such note).
    """
    texts = [[_text(c) for c in row] for row in rows]
    shown = [i for i, c in enumerate(columns) if wide or c.default]
    while True:
        total, flex_width, fits = _layout(columns, texts, shown, None if wide else width)
        droppable = [i for i in shown if columns[i].drop > 0]
        if fits or not droppable:
            break
        shown.remove(max(droppable, key=lambda i: (columns[i].drop, i)))
    table = Table(highlight=False)
    for i in shown:
        c = columns[i]
        header = f"{c.header}\n{c.unit}" if c.unit else c.header
        if c.flex and flex_width is not None:
            table.add_column(header, justify=c.justify, width=flex_width, overflow="fold")
        else:
            table.add_column(header, justify=c.justify, no_wrap=True)
    for row in texts:
        cells = [row[i] for i in shown]
        if flex_width is not None:
            cells = [_wrapped(cell, flex_width, columns[i].breaks) if columns[i].flex else cell for i, cell in zip(shown, cells)]
        table.add_row(*cells)
    parts: list[RenderableType] = []
    if title and cell_len(title) <= total:
        table.title = escape(title)
    elif title:
        parts.append(Text(title, style="italic", overflow="fold"))
    parts.append(table)
    hidden = tuple(c.label for i, c in enumerate(columns) if i not in shown)
    said = "; ".join(columns[i].note for i in shown if columns[i].note)
    lines = ([said] if said else []) + list(notes) + ([f"{more} adds: {', '.join(hidden)}"] if hidden and more else [])
    parts += [Text(line, style="dim", overflow="fold") for line in lines]
    return View(Group(*parts) if len(parts) > 1 else table, total, hidden)


def _layout(columns: Sequence[Column], texts: Sequence[Sequence[Text]], shown: Sequence[int],
            width: int | None) -> tuple[int, int | None, bool]:
    """(table width, the flex column's width or None for its natural one, whether it fits `width`)."""
    natural = {i: _natural(columns[i], [row[i] for row in texts]) for i in shown}
    total = sum(natural.values()) + 3 * len(shown) + 1  # "│ " before each column, " " after it, and the closing "│"
    if width is None or total <= width:
        return total, None, True
    flex = next((i for i in shown if columns[i].flex), None)
    if flex is None:
        return total, None, False
    fixed = total - natural[flex]
    floor = _floor(columns[flex], [row[flex] for row in texts])
    return fixed + max(floor, width - fixed), max(floor, width - fixed), fixed + floor <= width


def show(console: Console, view: View) -> None:
    """Print `view`; one wider than the console (--wide) is printed whole, never cut to the console's width."""
    if view.width <= console.width:
        console.print(view.renderable)
        return
    old = console.width
    console.width = view.width
    try:
        console.print(view.renderable)
    finally:
        console.width = old


def _wrapped(cell: Text, width: int, breaks: str) -> Text:
    """`cell` broken into lines of `width` (fmt.wrap_points), its styles kept."""
    lines = cell.divide(fmt.wrap_points(cell.plain, width, breaks))
    for line in lines:
        line.rstrip()
    return Text("\n").join(lines)


def _text(cell: Cell) -> Text:
    return cell if isinstance(cell, Text) else Text.from_markup(cell)


def _natural(column: Column, cells: Sequence[Text]) -> int:
    """The width the column takes unwrapped: its widest header line or cell line."""
    lines = [column.header, column.unit] + [line for cell in cells for line in cell.plain.split("\n")]
    return max(cell_len(line) for line in lines)


def _floor(column: Column, cells: Sequence[Text]) -> int:
    """The narrowest a flex column may get: `min_width`, its header, and (breaking at spaces only) its longest word."""
    words = [w for cell in cells for w in cell.plain.split()] if column.breaks.strip() == "" else []
    natural = _natural(column, cells)
    return min(natural, max([column.min_width, cell_len(column.header)] + [cell_len(w) for w in words]))
