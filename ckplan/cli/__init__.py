"""The `ckplan` command line: parse, dispatch to the library, hand results to `render`.

Exit codes (docs/models.md): 0 success / fits / verified; 1 does not fit / mismatch; 2 bad input;
3 an unexpected error inside ckplan (a bug: never 1, which CI reads as "does not fit").
Every error is one line on stderr, never a traceback, and nothing is written.

In the order a command runs:
  app.py       the Typer app and main(): usage errors, crashes, broken pipes -> exit codes
  options.py   the options that commands share, and the shell completion of MODEL
  resolve.py   options -> model spec, GPU, budget bytes; the checks of --formula, --slots, --format
  estimate.py, presets.py (presets, gpus), sweep.py, plan.py, check.py, schedule.py,
  calibrate.py, verify.py, export.py: one command (or two) each
  lazy.py      what a command imports only when an option asks for it (start-up time)
  errors.py    exit codes, bad input as one line (exit 2), no schedule that fits (exit 1)
  output.py    the stdout and stderr consoles, JSON and rows on stdout, broken pipes
"""

from __future__ import annotations

from ckplan.cli import (
    calibrate,
    check,
    estimate,
    export,
    plan,
    presets,
    schedule,
    sweep,
    validate,
    verify,
)
from ckplan.cli.app import app, click_command, main
from ckplan.cli.errors import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_DOES_NOT_FIT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
)
from ckplan.cli.options import complete_model

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_BROKEN_PIPE",
    "EXIT_DOES_NOT_FIT",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "app",
    "click_command",
    "complete_model",
    "main",
]

# `ckplan --help` lists the commands in this order.
for _command in (
    estimate.estimate,
    presets.presets,
    presets.gpus,
    sweep.sweep,
    plan.plan,
    check.check,
    schedule.schedule,
    calibrate.calibrate,
    verify.verify,
    validate.validate,
    export.export,
):
    app.command()(_command)
del _command
