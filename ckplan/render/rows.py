"""Rows for `--format csv` and `--format markdown`: each view describes its table once, as
columns over row objects; one CSV writer and one Markdown writer render any of them.

A column has a machine key and exact value (CSV: bytes and FLOPs as ints, fractions as floats)
and a title and text for people (Markdown: `56.83 GiB`, `0.88%`, a bar). A view that grows
(time columns, the `plan` command's layouts) adds columns; the writers do not change.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Column:
    key: str  # CSV header
    title: str  # Markdown header
    value: Callable[[Any], Any]  # exact value for machines
    text: Callable[[Any], str] | None = None  # for people; default str(value)
    right: bool = True  # Markdown alignment

    def shown(self, row: Any) -> str:
        if self.text is not None:
            return self.text(row)
        value = self.value(row)
        return "" if value is None else str(value)


@dataclass(frozen=True)
class RowTable:
    columns: Sequence[Column]
    rows: Sequence[Any]
    title: str = ""
    notes: Sequence[str] = field(default_factory=tuple)  # lines under the Markdown table


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def to_csv(table: RowTable) -> str:
    """RFC 4180 CSV: a header of column keys, one line per row, exact values."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([column.key for column in table.columns])
    for row in table.rows:
        writer.writerow([_csv_value(column.value(row)) for column in table.columns])
    return out.getvalue()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(table: RowTable) -> str:
    """A GitHub-flavoured Markdown table, the title in bold above it and the notes below."""
    lines = [f"**{_cell(table.title)}**", ""] if table.title else []
    lines.append("| " + " | ".join(_cell(c.title) for c in table.columns) + " |")
    lines.append("| " + " | ".join("---:" if c.right else ":---" for c in table.columns) + " |")
    for row in table.rows:
        lines.append("| " + " | ".join(_cell(c.shown(row)) for c in table.columns) + " |")
    if table.notes:
        lines += ["", *table.notes]
    return "\n".join(lines) + "\n"
