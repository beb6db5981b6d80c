"""`ckplan schedule`: a plan's schedule step by step."""

from __future__ import annotations

from typing import Annotated

import typer

from ckplan import render
from ckplan.cli.errors import UserError, no_schedule_fits, user_errors
from ckplan.cli.lazy import plots, step_time
from ckplan.cli.options import (
    BatchOpt,
    FormatOpt,
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
    SeqOpt,
    SetOpt,
    SlotsOpt,
)
from ckplan.cli.output import print_json, print_rows, print_view
from ckplan.cli.resolve import check_slots, output_options, resolve
from ckplan.plan import DEFAULT_SLOTS, STRATEGY_HELP, evaluate, parse_strategy, search, stage_names
from ckplan.quoting import quote


def schedule(
    model: ModelArg,
    budget: Annotated[
        str | None, typer.Option("--budget", "-b", help="Per-GPU memory (needed by optimal).")
    ] = None,
    strategy: Annotated[
        str,
        typer.Option(
            "--strategy",
            "-s",
            help="auto: the cheaper of optimal and selective+optimal; or " + STRATEGY_HELP,
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
    plot: PlotOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Print a plan's schedule step by step (default: the optimal schedule under --budget)."""
    with user_errors():
        fmt, mfu_convention = output_options(fmt, as_json, mfu_convention, plot)
        run = resolve(
            model, settings=settings, seq=seq, batch=batch, layers=layers,
            moe_imbalance=moe_imbalance, profile=profile, gpu=gpu, budget=budget,
            reserve=reserve,
        )  # fmt: skip
        spec, device = run.spec, run.gpu
        parsed = None if strategy == "auto" else parse_strategy(strategy, spec)
        activation_budget = None
        if run.budget_bytes is not None:
            total, kept = run.budget_bytes, run.reserve_bytes
            activation_budget = search.activation_budget(spec, total - kept)
        elif parsed is None or parsed.kind == "optimal":
            raise UserError(
                f"strategy {quote(strategy)} builds the optimal schedule and needs --budget"
            )
        if parsed is None:
            plan = search.optimal_plan(spec, activation_budget, check_slots(slots), device)
        elif parsed.kind == "optimal" and activation_budget <= 0:
            plan = None
        else:
            plan = evaluate(
                spec, parsed, budget=activation_budget, slots=check_slots(slots), gpu=device
            )
    if plan is None:
        no_schedule_fits(
            strategy,
            activation_budget,
            fmt == "json",
            lambda reason: render.schedule_no_fit_dict(
                spec, strategy, activation_budget, reason, stage_names(spec)
            ),
            advice=(spec, total - kept),
        )
    time = None if device is None else step_time(plan, device, mfu_convention)
    if plot is not None:
        with user_errors():
            draw_timeline(plan, activation_budget, plot)
    if fmt == "json":
        print_json(render.schedule_dict(plan, activation_budget, time))
    elif fmt in ("csv", "markdown"):
        from ckplan.render.row_models import schedule_row_table

        print_rows(schedule_row_table(plan), fmt)
    else:
        print_view(render.schedule_view(plan, activation_budget, time))


def draw_timeline(plan, activation_budget: int | None, path: str) -> None:
    """--plot: the plan's live activation bytes through its replayed step."""
    from ckplan.plan.timeline import memory_timeline

    timeline = memory_timeline(plan)
    if timeline is None:
        raise UserError(f"--plot: formula {plan.formula!r} has no schedule to draw")
    plots().timeline_plot(plan, timeline, path, activation_budget)
