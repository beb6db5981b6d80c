"""`ckplan sweep`: every candidate plan against a budget."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from ckplan import render
from ckplan.cli.errors import EXIT_DOES_NOT_FIT, EXIT_OK, UserError, user_errors
from ckplan.cli.lazy import plots, sweep_in_convention
from ckplan.cli.options import (
    BatchOpt,
    BudgetOpt,
    FormatOpt,
    FormulaOpt,
    GpuOpt,
    JsonOpt,
    LayersOpt,
    MfuConventionOpt,
    ModelArg,
    MoeImbalanceOpt,
    PlotOpt,
    ProfileOpt,
    QuietOpt,
    ReserveOpt,
    SetOpt,
    SlotsOpt,
)
from ckplan.cli.output import print_json, print_rows, print_view
from ckplan.cli.resolve import check_formula, check_slots, output_options, resolve
from ckplan.model.spec import ModelSpec
from ckplan.plan import DEFAULT_SLOTS, parse_strategy, search
from ckplan.quoting import quote
from ckplan.render.progress import progress


def sweep(
    model: ModelArg,
    budget: BudgetOpt = None,
    reserve: ReserveOpt = None,
    gpu: GpuOpt = None,
    mfu_convention: MfuConventionOpt = "full",
    rank: Annotated[
        str | None,
        typer.Option(
            "--rank", help="time (the default with --gpu) or flops: what the best plan minimises."
        ),
    ] = None,
    micro_batch: Annotated[
        str | None,
        typer.Option("--micro-batch", help="'auto': the largest micro-batch per strategy."),
    ] = None,
    show_all: Annotated[
        bool, typer.Option("--all", help="List every plan, not only the frontier.")
    ] = False,
    formula: FormulaOpt = "derived",
    slots: SlotsOpt = DEFAULT_SLOTS,
    settings: SetOpt = None,
    seq: Annotated[
        str | None,
        typer.Option(
            "--seq",
            help="Shortcut for --set seq=N; 'auto': also the longest sequence per strategy.",
        ),
    ] = None,
    batch: BatchOpt = None,
    layers: LayersOpt = None,
    moe_imbalance: MoeImbalanceOpt = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    fmt: FormatOpt = None,
    plot: PlotOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Every candidate plan against a budget: which fit, the Pareto frontier, the best (the
    fastest with --gpu)."""
    with user_errors():
        fmt, mfu_convention = output_options(fmt, as_json, mfu_convention, plot)
        seq_auto = seq == "auto"
        tokens = None if seq_auto else seq_tokens(seq)
        run = resolve(
            model, settings=settings, seq=tokens, batch=batch, layers=layers,
            moe_imbalance=moe_imbalance, profile=profile, gpu=gpu, budget=budget,
            reserve=reserve, need_budget=True,
        )  # fmt: skip
        spec, device = run.spec, run.gpu
        budget_text, total, kept = run.budget_text, run.budget_bytes, run.reserve_bytes
        if rank not in (None, *search.RANKS):
            raise UserError(f"--rank {quote(rank)}: expected one of {', '.join(search.RANKS)}")
        if rank == "time" and device is None:
            raise UserError("--rank time needs --gpu NAME|FILE")
        if micro_batch not in (None, "auto"):
            raise UserError(
                f"--micro-batch {quote(micro_batch)}: only 'auto' is accepted (use --batch N "
                "to set one)"
            )
        formula, slots = check_formula(formula), check_slots(slots)
        with progress(f"sweep {spec.name}: plans", quiet) as report:
            result = search.sweep(spec, total, kept, formula, slots, device, rank, progress=report)
        result = sweep_in_convention(result, mfu_convention)
        micro_batches = _micro_batches(spec, result) if micro_batch == "auto" else None
        seqs = _longest_seqs(spec, result) if seq_auto else None
        if plot is not None:
            plots().sweep_plot(result, budget_text, plot)
    if fmt == "json":
        print_json(render.sweep_dict(result, micro_batches, seqs))
    elif fmt in ("csv", "markdown"):
        from ckplan.render.row_models import sweep_rows

        print_rows(sweep_rows(result, budget_text, show_all), fmt)
    else:
        print_view(render.sweep_view(result, budget_text, show_all, micro_batches, seqs))
    raise typer.Exit(EXIT_OK if result.best else EXIT_DOES_NOT_FIT)


def _reported_strategies(spec: ModelSpec, result: search.SweepResult) -> list[str]:
    """The strategies `--micro-batch auto` and `--seq auto` answer for: the classic ones, the
    least-memory segment size and the sweep's best (not an `optimal` one, `offload+optimal`
    included, which is solved for one shape)."""
    names = ["none", "selective", "full", "sqrt", f"uniform:{result.min_memory_segment}"]
    if result.best and "optimal" not in result.best.plan.strategy.split("+"):
        names.append(result.best.plan.strategy)
    return list(dict.fromkeys(names))


def _micro_batches(spec: ModelSpec, result: search.SweepResult) -> dict[str, int]:
    return {
        name: search.largest_micro_batch(spec, parse_strategy(name, spec), result.usable_bytes)
        for name in _reported_strategies(spec, result)
    }


def _longest_seqs(spec: ModelSpec, result: search.SweepResult) -> dict[str, int]:
    return {
        name: search.longest_seq(spec, parse_strategy(name, spec), result.usable_bytes)
        for name in _reported_strategies(spec, result)
    }


def seq_tokens(text: str | None) -> int | None:
    """--seq as a number of tokens (what Typer reads as an integer: digits, a sign, spaces or
    underscores between digits), or None."""
    if text is None:
        return None
    if not re.fullmatch(r"\s*[+-]?[0-9]+(_[0-9]+)*\s*", text):
        raise UserError(
            f"Invalid value for '--seq': expected a whole number of tokens or auto, got "
            f"{quote(text)}"
        )
    return int(text)
