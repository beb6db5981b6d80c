"""What every view shares: byte formatting and the one-line error."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckplan.units import format_bytes_auto

if TYPE_CHECKING:  # Rich is imported where a table is built: --json needs none
    from rich.table import Table
    from rich.text import Text

GIB = "GiB"


def gib(value: int) -> str:
    """Bytes for people: GiB for GPU-sized figures, smaller binary units below 1 GiB."""
    return format_bytes_auto(value)


def both_units(value: int) -> str:
    return f"{format_bytes_auto(value)}  ({format_bytes_auto(value, binary=False)})"


def facts_table(title: str) -> Table:
    """A table of facts under `title`, without a header: what (bold), its value (right-aligned)
    and a note (dim)."""
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    table.add_column("note", style="dim")
    return table


def error_text(message: str) -> Text:
    from rich.text import Text

    return Text(f"error: {message}", style="red")


def note_text(message: str) -> Text:
    from rich.text import Text

    return Text(f"note: {message}", style="dim")


BAR_WIDTH = 10


def memory_bar(used: int, budget: int, width: int = BAR_WIDTH) -> Text:
    """`used` against `budget` as a bar with its percentage: green up to 90 %, yellow up to
    the budget, red beyond it (the bar full, the percentage saying by how much)."""
    from rich.text import Text

    fraction = used / budget if budget > 0 else float("inf")
    filled = width if fraction >= 1 else round(fraction * width)
    style = "green" if fraction <= 0.9 else "yellow" if fraction <= 1 else "red"
    percent = f"{fraction:>4.0%}" if fraction < 10 else ">999%"
    return Text("█" * filled + "░" * (width - filled) + " " + percent, style=style)
