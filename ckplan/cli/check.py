"""`ckplan check`: the CI capacity check of several models against one budget."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Annotated

import typer

from ckplan import render
from ckplan.cli.errors import EXIT_DOES_NOT_FIT, EXIT_OK, UserError, user_errors
from ckplan.cli.lazy import candidate_in_convention
from ckplan.cli.options import (
    BatchOpt,
    BudgetOpt,
    FormatOpt,
    GpuOpt,
    JsonOpt,
    LayersOpt,
    MfuConventionOpt,
    MoeImbalanceOpt,
    ProfileOpt,
    QuietOpt,
    ReserveOpt,
    SeqOpt,
    SetOpt,
    SlotsOpt,
)
from ckplan.cli.output import print_json, print_rows, print_view
from ckplan.cli.resolve import check_slots, output_options, resolve
from ckplan.plan import DEFAULT_SLOTS, search
from ckplan.quoting import abbreviate
from ckplan.render.progress import progress


def check(
    models: Annotated[
        list[str], typer.Argument(help="Presets, YAML files, config.json files or globs.")
    ],
    budget: BudgetOpt = None,
    strategy: Annotated[
        str,
        typer.Option(
            "--strategy", "-s", help="auto (cheapest that fits; fastest with --gpu) or any."
        ),
    ] = "auto",
    reserve: ReserveOpt = None,
    gpu: GpuOpt = None,
    mfu_convention: MfuConventionOpt = "full",
    slots: SlotsOpt = DEFAULT_SLOTS,
    settings: SetOpt = None,
    seq: SeqOpt = None,
    batch: BatchOpt = None,
    layers: LayersOpt = None,
    moe_imbalance: MoeImbalanceOpt = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    fmt: FormatOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """CI capacity check: exit 0 when every model fits the budget, 1 when any does not."""
    with user_errors():
        fmt, mfu_convention = output_options(fmt, as_json, mfu_convention)
        runs = [
            (
                name,
                resolve(
                    name,
                    settings=settings,
                    seq=seq,
                    batch=batch,
                    layers=layers,
                    moe_imbalance=moe_imbalance,
                    profile=profile,
                    gpu=gpu,
                    budget=budget,
                    reserve=reserve,
                    need_budget=True,
                ),
            )
            for name in expand_models(models)
        ]
        specs = [(name, run.spec) for name, run in runs]
        first = runs[0][1]
        device, budget_text = first.gpu, first.budget_text
        total, kept = first.budget_bytes, first.reserve_bytes
        rows = []
        with progress("check: models", quiet) as report:
            for done, (name, spec) in enumerate(specs):
                report(done, len(specs))
                best = search.best_plan(spec, total, strategy, kept, check_slots(slots), device)
                rows.append((name, candidate_in_convention(best, mfu_convention)))
            report(len(specs), len(specs))
    if fmt == "json":
        print_json(render.check_dict(total, rows))
    elif fmt in ("csv", "markdown"):
        from ckplan.render.row_models import check_rows

        print_rows(check_rows(budget_text, total, kept, rows), fmt)
    else:
        print_view(render.check_table(budget_text, total, kept, rows))
    raise typer.Exit(EXIT_OK if all(c and c.fits for _, c in rows) else EXIT_DOES_NOT_FIT)


def expand_models(models: list[str]) -> list[str]:
    """Expand globs the shell left alone (quoted, or run from CI without a shell)."""
    expanded: list[str] = []
    for model in models:
        if any(char in model for char in "*?[") and not _exists(model):
            matches = sorted(glob.glob(model))
            if not matches:
                raise UserError(f"{abbreviate(model)}: the pattern matches no file")
            expanded += matches
        else:
            expanded.append(model)
    return expanded


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except (OSError, ValueError):  # a name too long for the file system, a NUL character
        return False
