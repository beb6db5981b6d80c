"""User values in error messages, never printed in full.

A rejected value can be anything a file or an argument holds: a 5,000-digit integer (which
Python refuses to turn into text), a YAML alias bomb (a list that repeats one sub-list 9^9
times at no memory cost, but whose full repr never finishes), a megabyte string, control
characters or lone surrogates that a terminal cannot print. `quote` shows a bounded, printable
sketch of any of them; `one_line` makes a whole message safe to print as one line.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

QUOTE_LIMIT = 60  # characters of a quoted value
LINE_LIMIT = 400  # characters of a whole error line
LONG_INT_BITS = 200  # beyond about 60 digits an integer is described, not printed


def integer_digits(value: int) -> int:
    """Decimal digits of |value| without converting it to text (which Python refuses beyond
    4,300 digits): from the bit length, exact to within one digit."""
    bits = abs(value).bit_length()
    return max(1, math.floor((bits - 1) * math.log10(2)) + 1)


class _Sketch(reprlib.Repr):
    """`reprlib` visits a bounded number of elements, so an alias bomb costs nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = 4
        self.maxdict = 4
        self.maxstring = QUOTE_LIMIT
        self.maxother = QUOTE_LIMIT

    def repr_int(self, value: int, level: int) -> str:
        if value.bit_length() > LONG_INT_BITS:
            return f"<an integer of about {integer_digits(value):,} digits>"
        return repr(value)

    def repr_str(self, value: str, level: int) -> str:
        if len(value) > self.maxstring:
            return repr(value[: self.maxstring]) + f"... ({len(value):,} characters)"
        return repr(value)


_SKETCH = _Sketch()


def quote(value: Any) -> str:
    """A short, printable repr of any value: `'abc'`, `[[1, 1, 1, 1, ...], ...]`,
    `<an integer of about 5,000 digits>`."""
    try:
        return one_line(_SKETCH.repr(value), QUOTE_LIMIT * 2)
    except Exception:  # a repr that fails is no reason to lose the error it was quoting
        return f"<a {type(value).__name__}>"


def abbreviate(text: str, limit: int = QUOTE_LIMIT * 2) -> str:
    """`text` (a path, a name) cut in the middle to at most `limit` characters, so that the
    rest of a message that starts with it still fits on the line."""
    if len(text) <= limit:
        return text
    keep = (limit - 3) // 2
    return f"{text[:keep]}...{text[-keep:]}"


def one_line(text: str, limit: int = LINE_LIMIT) -> str:
    """`text` as one printable line of at most `limit` characters: line breaks become spaces,
    other unprintable characters (control codes, lone surrogates) their escapes."""
    text = " ".join(text[: limit * 2].split()) if len(text) > limit * 2 else " ".join(text.split())
    printable = "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)
    if len(printable) > limit:
        printable = printable[: limit - 3] + "..."
    return printable


def shorten(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """A user value written as the user wrote it (`--set tp=abc`, `--budget 40GB`), not repr'd,
    cut in the middle to at most `limit` characters; non-strings as `quote` shows them."""
    text = value if isinstance(value, str) else quote(value)
    return one_line(abbreviate(text, limit), limit * 2)
