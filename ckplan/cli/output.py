"""Where answers go: the stdout and stderr consoles, JSON and csv/markdown rows on stdout, and a
reader of stdout that goes away (`ckplan presets | head -1`)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the consoles are made on first use: --json needs no Rich
    from rich.console import Console

# The width when piped and COLUMNS does not say (Rich falls back to 80 without a terminal).
PIPED_WIDTH = 140
MAX_COLUMNS = 10_000


def _isatty(stream) -> bool:
    """A closed stream (`ckplan ... >&-` leaves sys.stdout None) is no terminal."""
    try:
        return bool(stream is not None and stream.isatty())
    except (ValueError, OSError, AttributeError):
        return False


def _console_environ() -> dict[str, str]:
    """The environment Rich sizes its consoles from, without a COLUMNS or LINES it would
    choke on: Rich reads '²' as a digit (then int() fails) and takes 0 as a width."""
    environ = dict(os.environ)
    for key in ("COLUMNS", "LINES"):
        value = environ.get(key)
        if value is not None and not (
            value.isascii() and value.isdigit() and 1 <= int(value) <= MAX_COLUMNS
        ):
            del environ[key]
    return environ


def _piped_width(environ: dict[str, str]) -> int:
    """COLUMNS when set (and readable), else PIPED_WIDTH: a CI log or `| less` says its width."""
    return int(environ["COLUMNS"]) if "COLUMNS" in environ else PIPED_WIDTH


def _make_stdout() -> Console:
    from rich.console import Console

    environ = _console_environ()
    console = Console(
        width=None if _isatty(sys.stdout) else _piped_width(environ), _environ=environ
    )
    console.on_broken_pipe = _on_broken_pipe
    return console


def _make_stderr() -> Console:
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, _environ=_console_environ())


_CONSOLES = {"stdout": _make_stdout, "stderr": _make_stderr}


def __getattr__(name: str):
    """`stdout` and `stderr`, the Rich consoles, made on first use."""
    if name not in _CONSOLES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    console = _CONSOLES[name]()
    globals()[name] = console
    return console


class ReaderGone(Exception):
    """The reader of stdout went away (`ckplan presets | head -1`): exit 141, not 1."""


def _on_broken_pipe() -> None:
    """Rich's own answer to a broken pipe is SystemExit(1), the "does not fit" code."""
    silence_stdout()
    raise ReaderGone


def print_view(view, **options) -> None:
    """A view (a table, or tables in a group) fitted to stdout's width (render.fit)."""
    from ckplan.render.fit import fit

    console = globals().get("stdout") or __getattr__("stdout")
    console.print(fit(view, console), **options)


def print_json(data: Any) -> None:
    try:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
        raise ReaderGone from None


def print_rows(table, fmt: str) -> None:
    """csv or markdown through the one writer of each (render.rows)."""
    from ckplan.render import rows

    sys.stdout.write(rows.to_csv(table) if fmt == "csv" else rows.to_markdown(table))


def tolerant_streams() -> None:
    """Characters the terminal's encoding cannot show (a lone surrogate from a non-UTF-8
    argument, a '·' on an ASCII console) print as escapes instead of raising."""
    for stream in (sys.stdout, sys.stderr):
        # not a text file, or already closed: nothing to do
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")


def silence_stdout() -> None:
    """After a broken pipe, send what Python flushes at exit to /dev/null instead."""
    import os

    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
