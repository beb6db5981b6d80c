"""What every view shares: byte formatting and the one-line error."""

from __future__ import annotations

from rich.text import Text

from ckplan.units import format_bytes_auto

GIB = "GiB"


def _gib(value: int) -> str:
    """Bytes for people: GiB for GPU-sized figures, smaller binary units below 1 GiB."""
    return format_bytes_auto(value)


def _both(value: int) -> str:
    return f"{format_bytes_auto(value)}  ({format_bytes_auto(value, binary=False)})"


def error_text(message: str) -> Text:
    return Text(f"error: {message}", style="red")


def note_text(message: str) -> Text:
    return Text(f"note: {message}", style="dim")
