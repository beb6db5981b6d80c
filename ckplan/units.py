"""Byte sizes: parse what users type (`40GB`, `40GiB`, `80e9`) and print with explicit units.

Accepted: a number immediately followed by a unit, KB MB GB TB (powers of 10), KiB MiB GiB TiB
(powers of 2) or B, case-insensitive (`40GB`, `1.5TB`, `40gib`); or a plain number of bytes,
written whole (`85899345920`) or in exponent notation (`80e9`). Rejected, with the reason: a
space before the unit (`40 G`), unknown units (`40G`), signs (`-1GB`), fractions of a byte, and a
plain number under 1 MiB (`40`): no real budget is that small, so it is almost surely a missing
unit.
"""

from __future__ import annotations

import re

from ckplan.errors import InputError
from ckplan.quoting import quote

DECIMAL_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
BINARY_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_UNITS = {**DECIMAL_UNITS, **BINARY_UNITS}
_CANONICAL = {"B": "B", "KB": "KB", "MB": "MB", "GB": "GB", "TB": "TB"} | {
    "KIB": "KiB",
    "MIB": "MiB",
    "GIB": "GiB",
    "TIB": "TiB",
}
_SIZE = re.compile(r"^(?P<number>[0-9]+(?:\.[0-9]+)?(?:[eE]\+?[0-9]+)?)(?P<unit>[A-Za-z]+)?$")
MAX_SIZE = 10**21  # a zettabyte: anything larger is a typo, and would overflow float printing


class SizeError(InputError):
    """A size string that is not one of the accepted forms."""


def parse_size(text: str) -> int:
    """Parse `40GB`, `40GiB`, `1.5TB`, `512MB`, `80e9` or `1234` into an exact number of bytes.

    Fractions of a byte are rejected rather than rounded: `1.5B` is an error.
    """
    match = _SIZE.match(text.strip())
    if not match:
        raise SizeError(
            f"cannot parse size {quote(text)}: expected a number with a unit such as 40GB, 40GiB, "
            "512MB, 1.5TB, or a plain number of bytes such as 80e9"
        )
    number, unit = match.group("number"), match.group("unit")
    if len(number) > 40:  # no size needs 40 digits; Python refuses int() beyond 4,300
        raise SizeError(f"cannot parse size {quote(text)}: too many digits")
    if unit is None:
        if "." in number and not re.search(r"[eE]", number):
            raise SizeError(
                f"cannot parse size {quote(text)}: a number without a unit is bytes and must be "
                "whole (did you mean GB?)"
            )
        if not re.search(r"[eE]", number) and int(number) < 2**20:
            raise SizeError(
                f"cannot parse size {quote(text)}: {number} bytes is implausibly small for a "
                "memory size; add a unit such as GB or GiB"
            )
    multiplier = _UNITS.get((unit or "B").upper())
    if multiplier is None:
        raise SizeError(
            f"cannot parse size {quote(text)}: unknown unit {quote(unit)}; use B, KB, MB, GB, TB, "
            "KiB, MiB, GiB or TiB"
        )
    exponent = number.lower().partition("e")[2]
    if int(exponent or 0) > 30:  # refuse before computing 10**exponent
        raise SizeError(f"cannot parse size {quote(text)}: implausibly large")
    value = _exact_product(number, multiplier)
    if value is None:
        raise SizeError(f"cannot parse size {quote(text)}: it is not a whole number of bytes")
    if value > MAX_SIZE:
        raise SizeError(f"cannot parse size {quote(text)}: implausibly large (over 1000 EB)")
    return value


def size_unit(text: str) -> str:
    """The unit the user wrote in a size string (`GB`, `GiB`, ...); `B` for plain numbers."""
    match = _SIZE.match(text.strip())
    unit = match.group("unit") if match else None
    return _CANONICAL.get((unit or "B").upper(), "B")


def _exact_product(number: str, multiplier: int) -> int | None:
    """number * multiplier computed exactly from the decimal text, or None if not whole."""
    mantissa, _, exponent = number.lower().partition("e")
    whole, _, fraction = mantissa.partition(".")
    numerator = int(whole + fraction) * multiplier
    power = int(exponent or 0) - len(fraction)
    if power >= 0:
        return numerator * 10**power
    divisor = 10**-power
    return numerator // divisor if numerator % divisor == 0 else None


def format_bytes(value: int, unit: str = "GiB", digits: int = 2) -> str:
    """Print bytes in a named unit, the unit always written out: `12.50 GiB`."""
    if unit == "B":
        return f"{value:,} B"
    return f"{value / _UNITS[unit.upper()]:,.{digits}f} {unit}"


def format_bytes_auto(value: int, binary: bool = True) -> str:
    """Bytes in the largest unit that keeps the number >= 1 (GiB/MiB/KiB, or GB/MB/KB),
    the unit always written out; negative values (an overshoot) keep their sign."""
    units = ("TiB", "GiB", "MiB", "KiB") if binary else ("TB", "GB", "MB", "KB")
    for unit in units:
        if abs(value) >= _UNITS[unit.upper()]:
            return format_bytes(value, unit)
    return format_bytes(value, "B")


def format_flops(value: int) -> str:
    """Print a FLOP count with an SI prefix: `1.23 PFLOP`."""
    for prefix, scale in (("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9)):
        if abs(value) >= scale:
            return f"{value / scale:,.2f} {prefix}FLOP"
    return f"{value:,} FLOP"
