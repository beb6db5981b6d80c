"""`ckplan validate`: ckplan against published training runs."""

from __future__ import annotations

from typing import Annotated

import typer

from ckplan.cli.errors import EXIT_OK, UserError, user_errors
from ckplan.cli.options import FormatOpt, JsonOpt, QuietOpt
from ckplan.cli.output import print_json, print_rows, print_view
from ckplan.cli.resolve import output_format
from ckplan.quoting import quote

SPLITS = ("calibration", "test")


def validate(
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            help="Runs whose name, file, GPU, framework or source contains TEXT.",
            metavar="TEXT",
        ),
    ] = None,
    split: Annotated[
        str | None,
        typer.Option("--split", help="calibration or test: the runs of one split only."),
    ] = None,
    as_json: JsonOpt = False,
    fmt: FormatOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Run every published training run of the suite (validation/runs/) through ckplan: the
    published step time, throughput, MFU or peak memory beside ckplan's, the error, and its
    summary per split, GPU and framework."""
    with user_errors():
        fmt = output_format(fmt, as_json)
        if split is not None and split not in SPLITS:
            raise UserError(f"--split expects calibration or test, got {quote(split)}")
        from ckplan.published.suite import run_suite, summarise

        predictions = run_suite(only, split)
        if not predictions:
            raise UserError(f"--only {quote(only)} matches no published run")
        summary = summarise(predictions)
    from ckplan import render

    if fmt == "json":
        print_json(render.validate_dict(predictions, summary))
    elif fmt in ("csv", "markdown"):
        from ckplan.render.row_models import validate_row_table

        print_rows(validate_row_table(predictions), fmt)
    else:
        print_view(render.validate_view(predictions, summary))
    raise typer.Exit(EXIT_OK)
