"""`ckplan sweep`: every candidate plan against a budget."""

from __future__ import annotations

from typing import Annotated

import typer

from ckplan import render
from ckplan.cli.auto import MicroBatchAutoOpt, SeqAutoOpt, read_auto
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
from ckplan.plan.search import Candidate
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
    micro_batch: MicroBatchAutoOpt = None,
    show_all: Annotated[
        bool, typer.Option("--all", help="List every plan, not only the frontier.")
    ] = False,
    formula: FormulaOpt = "derived",
    slots: SlotsOpt = DEFAULT_SLOTS,
    settings: SetOpt = None,
    seq: SeqAutoOpt = None,
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
    fastest with --gpu); --seq auto or --micro-batch auto: also the largest value each
    strategy fits, and the best plan at the largest any plan fits."""
    with user_errors():
        fmt, mfu_convention = output_options(fmt, as_json, mfu_convention, plot)
        tokens, auto_key = read_auto(seq, micro_batch, batch)
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
        formula, slots = check_formula(formula), check_slots(slots)
        with progress(f"sweep {spec.name}: plans", quiet) as report:
            result = search.sweep(spec, total, kept, formula, slots, device, rank, progress=report)
        result = sweep_in_convention(result, mfu_convention)
        micro_batches = seqs = reach = None
        if auto_key is not None:
            with progress(f"sweep {spec.name}: the largest {auto_key}", quiet):
                values = _largest_values(spec, result, auto_key, formula, slots)
                reach = _reach(spec, result, auto_key, formula, slots, mfu_convention)
            micro_batches, seqs = (values, None) if auto_key == "micro_batch" else (None, values)
        if plot is not None:
            plots().sweep_plot(result, budget_text, plot)
    if fmt == "json":
        print_json(render.sweep_dict(result, micro_batches, seqs, reach))
    elif fmt in ("csv", "markdown"):
        from ckplan.render.row_models import sweep_rows

        print_rows(sweep_rows(result, budget_text, show_all), fmt)
    else:
        view = render.sweep_view(result, budget_text, show_all, micro_batches, seqs, reach)
        print_view(view)
    raise typer.Exit(EXIT_OK if result.best else EXIT_DOES_NOT_FIT)


def _reported_strategies(spec: ModelSpec, result: search.SweepResult, formula: str) -> list[str]:
    """The strategies `--micro-batch auto` and `--seq auto` answer for: the classic ones, the
    least-memory segment size, `optimal` (solved at each value for the budget) and the sweep's
    best (not `offload+optimal` nor `selective+offload+optimal`, whose joint DP grows with the
    chain's square)."""
    names = ["none", "selective", "full", "sqrt", f"uniform:{result.min_memory_segment}"]
    names += ["optimal"] if formula == "derived" else []
    if result.best and not {"offload", "optimal"} <= set(result.best.plan.strategy.split("+")):
        names.append(result.best.plan.strategy)
    return list(dict.fromkeys(names))


def _largest_values(
    spec: ModelSpec, result: search.SweepResult, key: str, formula: str, slots: int
) -> dict[str, int]:
    return {
        name: search.largest_fitting(
            spec, parse_strategy(name, spec), result.usable_bytes, key, result.gpu, formula, slots
        )
        for name in _reported_strategies(spec, result, formula)
    }


def _reach(
    spec: ModelSpec,
    result: search.SweepResult,
    key: str,
    formula: str,
    slots: int,
    mfu_convention: str,
) -> tuple[str, int, Candidate | None]:
    """(key, the largest value some plan of the sweep fits, the best plan there)."""
    total, kept = result.budget_bytes, result.reserve_bytes
    value = search.largest_fitting_any(spec, total, kept, key, result.gpu, slots, formula)
    if not value:
        return key, 0, None
    at = search.sweep(
        spec.replace(**{key: value}), total, kept, formula, slots, result.gpu, result.rank
    )
    return key, value, sweep_in_convention(at, mfu_convention).best
