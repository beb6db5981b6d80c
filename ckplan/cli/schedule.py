"""`ckplan schedule`: a plan's schedule step by step."""

from __future__ import annotations

from typing import Annotated

import typer

from ckplan import render
from ckplan.cli.errors import UserError, no_schedule_fits, user_errors
from ckplan.cli.lazy import step_time
from ckplan.cli.options import (
    BatchOpt,
    GpuOpt,
    JsonOpt,
    LayersOpt,
    ModelArg,
    MoeImbalanceOpt,
    ProfileOpt,
    ReserveOpt,
    SeqOpt,
    SetOpt,
    SlotsOpt,
)
from ckplan.cli.output import print_json, print_view
from ckplan.cli.resolve import check_slots, resolve_budget, resolve_gpu, resolve_model
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
    slots: SlotsOpt = DEFAULT_SLOTS,
    settings: SetOpt = None,
    seq: SeqOpt = None,
    batch: BatchOpt = None,
    layers: LayersOpt = None,
    moe_imbalance: MoeImbalanceOpt = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Print a plan's schedule step by step (default: the optimal schedule under --budget)."""
    with user_errors():
        spec = resolve_model(model, settings, seq, batch, layers, moe_imbalance, profile)
        device = resolve_gpu(gpu, settings)
        parsed = None if strategy == "auto" else parse_strategy(strategy, spec)
        activation_budget = None
        budgets = resolve_budget(budget, reserve, device)
        if budgets is not None:
            _, total, kept = budgets
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
            plan = evaluate(spec, parsed, budget=activation_budget, slots=check_slots(slots))
    if plan is None:
        no_schedule_fits(
            strategy,
            activation_budget,
            as_json,
            lambda reason: render.schedule_no_fit_dict(
                spec, strategy, activation_budget, reason, stage_names(spec)
            ),
            advice=(spec, total - kept),
        )
    time = None if device is None else step_time(plan, device)
    if as_json:
        print_json(render.schedule_dict(plan, activation_budget, time))
    else:
        print_view(render.schedule_view(plan, activation_budget, time))
