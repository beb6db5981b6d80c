"""The Typer app and `main`, the console-script entry: usage errors, crashes, Ctrl-C, a closed or
full stdout and a broken pipe each become one line on stderr and an exit code (errors.py)."""

from __future__ import annotations

import errno
import functools
import gc
import os
import sys
from typing import Annotated

import typer

from ckplan import __version__
from ckplan.cli import coercion
from ckplan.cli.errors import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    print_error,
)
from ckplan.cli.output import ReaderGone, print_view, silence_stdout, tolerant_streams
from ckplan.quoting import quote

# Typer's per-option pydantic adapters, built only for values that need them (start-up time)
coercion.install()

app = typer.Typer(
    name="ckplan",
    help="Plan activation checkpointing and recomputation for large-model training.",
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"ckplan {__version__}\n")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """Plan activation checkpointing and recomputation for large-model training."""


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: usage errors become one line and exit 2, like every bad input;
    anything unexpected becomes one line and exit 3, never a traceback and never exit 1."""
    # Deep models keep large lists of per-stage figures alive; the collector's full passes over
    # them cost a quarter of a 100,000-layer sweep. Collect young objects less often.
    gc.set_threshold(100_000, 50, 100)
    tolerant_streams()
    if sys.stderr is None:  # `2>&-`: errors go nowhere, the exit code still tells
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (open for the process's life)
    if sys.stdout is None:  # `>&-`
        print_error("standard output is closed: nowhere to print the answer")
        code = EXIT_BAD_INPUT
        if argv is None:
            sys.exit(code)
        return code
    try:
        code = click_command().main(args=argv, prog_name="ckplan", standalone_mode=False)
    except typer.Abort:  # end of input at a prompt (a typer.Exit: caught first)
        print_error("interrupted")
        code = EXIT_INTERRUPTED
    except typer.Exit as exit_:  # Ctrl-C arrives as typer.Exit(130)
        code = exit_.exit_code
    except ReaderGone:
        code = EXIT_BROKEN_PIPE
    except SystemExit as exit_:
        # Typer answers a broken pipe it meets itself with sys.exit(1), the "does not fit"
        # code, after wrapping stdout so that the exit flush stays quiet.
        if type(sys.stdout).__name__ != "PacifyFlushWrapper":
            raise
        code = EXIT_BROKEN_PIPE if exit_.code == 1 else exit_.code
    except Exception as error:
        code = _report_exception(error)
    code = code if isinstance(code, int) else EXIT_OK
    if code != EXIT_BROKEN_PIPE:
        code = _flush_stdout(code)
    if argv is None:
        sys.exit(code)
    return code


@functools.cache
def click_command():
    """Typer builds the Click command from the signatures (~15 ms): once per process, so that
    in-process callers (the tests run the CLI hundreds of times) pay it once."""
    return typer.main.get_command(app)


def _report_exception(error: Exception) -> int:
    """Click's usage errors (typer vendors click; both expose format_message + exit_code) are
    bad input, exit 2; anything else is a bug in ckplan, exit 3, said in one line."""
    if hasattr(error, "format_message") and hasattr(error, "exit_code"):
        if type(error).__name__ == "NoArgsIsHelpError":
            try:
                print_view(error.format_message(), highlight=False)
            except OSError as output_error:
                return _output_failed(output_error)
        else:
            print_error(error.format_message())
        return EXIT_BAD_INPUT
    if isinstance(error, OSError) and error.errno in OUTPUT_ERRNOS:
        return _output_failed(error)
    if isinstance(error, MemoryError):
        print_error("out of memory (MemoryError): please report this input as a ckplan bug")
    else:
        detail = f": {quote(error.args[0])}" if error.args else ""
        print_error(
            f"internal error ({type(error).__name__}{detail}); please report it as a ckplan bug"
        )
    return EXIT_INTERNAL


# What writing the answer to stdout raises when it cannot (`> /dev/full`, a closed or lost
# descriptor); reading input files turns its own OSErrors into bad input before this.
OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF}


def _flush_stdout(code: int) -> int:
    """Flush the answer now, so that a full disk is one line and exit 2 here rather than
    Python's 'Exception ignored' at exit (exit 120)."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as error:
        return _output_failed(error)
    except ValueError:  # closed by the command's caller
        pass
    return code


def _output_failed(error: OSError) -> int:
    print_error(f"cannot write to standard output ({error.strerror or type(error).__name__})")
    silence_stdout()
    return EXIT_BAD_INPUT
