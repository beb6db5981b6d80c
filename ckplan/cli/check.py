"""`ckplan check`: the CI capacity check of several models against one budget."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Annotated

import typer

from ckplan import render
from ckplan.cli.auto import MicroBatchAutoOpt, SeqAutoOpt, read_auto
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
    SetOpt,
    SlotsOpt,
)
from ckplan.cli.output import print_json, print_rows, print_view
from ckplan.cli.resolve import check_slots, output_options, resolve
from ckplan.plan import DEFAULT_SLOTS, parse_strategy, search
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
    seq: SeqAutoOpt = None,
    batch: BatchOpt = None,
    micro_batch: MicroBatchAutoOpt = None,
    layers: LayersOpt = None,
    moe_imbalance: MoeImbalanceOpt = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    fmt: FormatOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """CI capacity check: exit 0 when every model fits the budget, 1 when any does not; --seq
    auto or --micro-batch auto: each model at the largest value that fits."""
    with user_errors():
        fmt, mfu_convention = output_options(fmt, as_json, mfu_convention)
        tokens, auto_key = read_auto(seq, micro_batch, batch)
        runs = [
            (
                name,
                resolve(
                    name,
                    settings=settings,
                    seq=tokens,
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
        rows, values, references = [], [], []
        slots = check_slots(slots)
        with progress("check: models", quiet) as report:
            for done, (name, spec) in enumerate(specs):
                report(done, len(specs))
                if auto_key is not None:
                    value = _largest(spec, strategy, total, kept, auto_key, device, slots)
                    spec = spec.replace(**{auto_key: value or search.auto_step(spec, auto_key)})
                    values.append(value)
                checked = search.check_plan(spec, total, strategy, kept, slots, device)
                rows.append((name, candidate_in_convention(checked.candidate, mfu_convention)))
                references.append(candidate_in_convention(checked.reference, mfu_convention))
            report(len(specs), len(specs))
        largest = None if auto_key is None else (auto_key, values)
    if fmt == "json":
        print_json(render.check_dict(total, rows, largest, references))
    elif fmt in ("csv", "markdown"):
        from ckplan.render.row_models import check_rows

        print_rows(check_rows(budget_text, total, kept, rows, references), fmt)
    else:
        print_view(render.check_table(budget_text, total, kept, rows, largest, references))
    raise typer.Exit(EXIT_OK if all(c and c.fits for _, c in rows) else EXIT_DOES_NOT_FIT)


def _largest(spec, strategy: str, total: int, kept: int, key: str, device, slots: int) -> int:
    """The largest `key` at which `strategy` fits (`auto`: any plan an export writes that
    `check_plan` weighs)."""
    if strategy == "auto":
        return search.largest_fitting_any(spec, total, kept, key, device, slots)
    parsed = parse_strategy(strategy, spec)
    return search.largest_fitting(spec, parsed, total - kept, key, device, slots=slots)


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
