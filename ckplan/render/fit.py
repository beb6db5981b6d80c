"""Tables that fit the width they are printed at: columns dropped in a declared order, never a
model name, a strategy or a number cut.

Rich shrinks a table that is wider than the console by folding or cutting cells (`…`). A cell
folded between its words stays readable; one cut inside a word does not. So each table is
brought down to the width at which every cell's longest word still fits (Rich's minimum
measure), by dropping its least important columns first (`table.drop_order`, set by the view
that builds it; by default the rightmost columns but the first), and then folds between words
only. What was dropped is said under the table: -f csv or --json have every column.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Rich is imported when a table is fitted: --json needs none
    from rich.console import Console
    from rich.table import Table


def fit(renderable, console: Console):
    """`renderable` with every table in it fitted to `console`'s width."""
    from rich.console import Group
    from rich.table import Table

    if isinstance(renderable, Table):
        return fit_table(renderable, console)
    if isinstance(renderable, Group):
        return Group(*(fit(item, console) for item in renderable.renderables))
    return renderable


def column_minimum(column) -> int:
    """The narrowest a column may be without cutting a word: its longest word (header and
    cells); a right-justified (number) column keeps each cell whole ("691.59 TFLOP")."""
    cells = [str(column.header), *(str(getattr(cell, "plain", cell)) for cell in column._cells)]
    if column.justify == "right":
        return max((len(line) for cell in cells for line in cell.splitlines() or [""]), default=1)
    return max((len(word) for cell in cells for word in cell.split()), default=1)


def minimum_width(table: Table) -> int:
    """The table's width with each column at its minimum: the columns, their padding (one
    each side) and the box's vertical lines."""
    columns = table.columns
    return sum(column_minimum(c) for c in columns) + 2 * len(columns) + len(columns) + 1


def fit_table(table: Table, console: Console) -> Table:
    width = console.width
    order = list(getattr(table, "drop_order", None) or _default_order(table))
    dropped = []
    while minimum_width(table) > width and order:
        header = order.pop(0)
        index = next((i for i, c in enumerate(table.columns) if _header(c) == header), None)
        if index is None:
            continue
        del table.columns[index]
        dropped.append(header)
    for column in table.columns:
        column.overflow = "fold"
        column.no_wrap = False
        column.min_width = column_minimum(column)
    _narrow(table, width)
    if dropped:
        note = (
            f"{len(dropped)} column{'s' * (len(dropped) > 1)} left out to fit {width} columns: "
            f"{', '.join(dropped)} (a wider terminal, COLUMNS, -f csv or --json show them)"
        )
        table.caption = f"{table.caption}\n{note}" if table.caption else note
    return table


def _natural_width(column) -> int:
    cells = [str(column.header), *(str(getattr(cell, "plain", cell)) for cell in column._cells)]
    return max((len(line) for cell in cells for line in cell.splitlines() or [""]), default=1)


def _narrow(table: Table, width: int) -> None:
    """Give each column its width when the table is too wide: the text columns with the most
    room above their minimum fold first. Rich's own collapse keeps a short header such as
    "why not" whole and crops the table's right edge instead."""
    columns = table.columns
    widths = [_natural_width(c) for c in columns]
    excess = sum(widths) + 3 * len(columns) + 1 - width
    if excess <= 0:
        return
    for _ in range(excess):
        room = [
            (widths[i] - c.min_width, i)
            for i, c in enumerate(columns)
            if c.justify != "right" and widths[i] > c.min_width
        ]
        if not room:
            break
        widths[max(room)[1]] -= 1
    for column, column_width in zip(columns, widths, strict=True):
        column.width = column_width


def _header(column) -> str:
    return str(column.header).replace("\n", " ").strip()


def _default_order(table: Table) -> list[str]:
    """The rightmost columns first, never the first (the row's name)."""
    return [_header(column) for column in reversed(table.columns[1:])]


def declare(table: Table, *headers: str) -> Table:
    """Set the order `fit_table` drops `table`'s columns in, least important first."""
    table.drop_order = headers  # type: ignore[attr-defined]
    return table
