"""How a command ends without its answer: the exit codes (docs/models.md, ckplan/cli/__init__.py),
bad input as one line on stderr and exit 2, and no schedule that fits as exit 1."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from ckplan import render
from ckplan.cli import output
from ckplan.cli.output import print_json
from ckplan.errors import InputError
from ckplan.model.spec import ModelSpec
from ckplan.quoting import one_line
from ckplan.units import format_bytes

EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
EXIT_BROKEN_PIPE = 141  # the reader of stdout went away, as a shell reports SIGPIPE


class UserError(Exception):
    """Bad input found by the CLI itself (not by the spec or units parsers)."""


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn every bad-input error into one line on stderr and exit code 2."""
    try:
        yield
    except (InputError, UserError) as error:
        print_error(str(error))
        raise typer.Exit(EXIT_BAD_INPUT) from None


def print_error(message: str) -> None:
    """`error: <message>` as one printable line on stderr, however long or odd the message."""
    # stderr full or closed: nowhere to say it, the exit code still tells
    with contextlib.suppress(OSError, ValueError):
        output.stderr.print(render.error_text(one_line(message)), highlight=False)


def no_schedule_fits(
    strategy: str,
    activation_budget: int,
    as_json: bool = False,
    json_data=None,
    advice: tuple[ModelSpec, int] | None = None,
) -> None:
    """A budget too small for any schedule: a does-not-fit answer (exit 1), not bad input.
    With --json, `json_data(reason)` is printed too, so that --json always prints JSON.
    `advice` (the model, usable bytes): what to raise from its layout (`plan.advice`)."""
    left = format_bytes(max(activation_budget, 0), "GiB")
    message = f"no {strategy} schedule fits the {left} that model states and reserve leave"
    if advice is not None:
        from ckplan.plan.advice import advice_lines

        lines = advice_lines(*advice, limit=2)
        if lines:
            message += "; from this layout: " + "; or ".join(lines)
    if as_json and json_data is not None:
        print_json(json_data(message))
    print_error(message)
    raise typer.Exit(EXIT_DOES_NOT_FIT)
