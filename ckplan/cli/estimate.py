"""`ckplan estimate`: one plan with its full breakdown."""

from __future__ import annotations

from typing import Annotated

import typer

from ckplan import render
from ckplan.cli.auto import MicroBatchAutoOpt, SeqAutoOpt, need_budget, read_auto
from ckplan.cli.errors import EXIT_DOES_NOT_FIT, UserError, no_schedule_fits, user_errors
from ckplan.cli.lazy import plots, step_time
from ckplan.cli.options import (
    BatchOpt,
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
    SetOpt,
)
from ckplan.cli.output import print_json, print_rows, print_view
from ckplan.cli.resolve import check_formula, output_options, resolve
from ckplan.plan import STRATEGY_HELP, evaluate, parse_strategy, search


def estimate(
    model: ModelArg,
    strategy: Annotated[str, typer.Option("--strategy", "-s", help=STRATEGY_HELP)] = "none",
    formula: FormulaOpt = "derived",
    budget: Annotated[
        str | None,
        typer.Option(
            "--budget", "-b", help="Per-GPU memory: adds fits/headroom; optimal needs it."
        ),
    ] = None,
    reserve: Annotated[
        str | None, typer.Option("--reserve", help="Taken off --budget first (default 2GiB).")
    ] = None,
    gpu: GpuOpt = None,
    mfu_convention: MfuConventionOpt = "full",
    settings: SetOpt = None,
    seq: SeqAutoOpt = None,
    batch: BatchOpt = None,
    micro_batch: MicroBatchAutoOpt = None,
    layers: LayersOpt = None,
    moe_imbalance: MoeImbalanceOpt = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    fmt: FormatOpt = None,
    plot: PlotOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """One plan with its full breakdown: per-op activations, model states, FLOPs, overhead
    (and with --gpu: step time, MFU, the time overhead and its breakdown); --seq auto or
    --micro-batch auto: at the largest value that fits."""
    with user_errors():
        fmt, mfu_convention = output_options(fmt, as_json, mfu_convention, plot)
        tokens, auto_key = read_auto(seq, micro_batch, batch)
        run = resolve(
            model, settings=settings, seq=tokens, batch=batch, layers=layers,
            moe_imbalance=moe_imbalance, profile=profile, gpu=gpu, budget=budget,
            reserve=reserve,
        )  # fmt: skip
        spec, device = run.spec, run.gpu
        parsed = parse_strategy(strategy, spec)
        need_budget(auto_key, run.usable_bytes)
        largest = None
        if auto_key is not None:
            formula = check_formula(formula)
            largest = search.largest_fitting(
                spec, parsed, run.usable_bytes, auto_key, device, formula
            )
            step = search.auto_step(spec, auto_key)
            spec = spec.replace(**{auto_key: largest or step})
        candidate = None
        if run.budget_bytes is None:
            plan = evaluate(spec, parsed, check_formula(formula), gpu=device)
        else:
            total, kept = run.budget_bytes, run.reserve_bytes
            activation_budget = search.activation_budget(spec, total - kept)
            plan = None
            if parsed.kind != "optimal" or activation_budget > 0:
                plan = evaluate(
                    spec, parsed, check_formula(formula), budget=activation_budget, gpu=device
                )
            if plan is None:
                no_schedule_fits(
                    parsed.name,
                    activation_budget,
                    fmt == "json",
                    lambda reason: render.estimate_no_fit_dict(
                        spec, parsed.name, total - kept, activation_budget, reason
                    ),
                    advice=(spec, total - kept),
                )
            candidate = search.Candidate(plan, total - kept, None, _host_budget(plan, device))
        time = None if device is None else step_time(plan, device, mfu_convention)
        if plot is not None:
            _estimate_plot(plan, candidate, plot)
    if fmt == "json":
        data = render.estimate_dict(plan, candidate, time, device)
        if auto_key is not None:
            data[f"max_{auto_key}"] = largest
        print_json(data)
    elif fmt in ("csv", "markdown"):
        from ckplan.render.row_models import estimate_rows

        print_rows(estimate_rows(plan, candidate, time), fmt)
    else:
        view = render.estimate_view(plan, candidate, time, device)
        if auto_key is not None:
            from rich.console import Group

            line = render.largest_line(spec, auto_key, largest, parsed.name, step)
            view = Group(view, line)
        print_view(view)
    if candidate is not None and not candidate.fits:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


def _host_budget(plan, device) -> int | None:
    """The host memory an offload plan's pinned tapes and offloaded model states must fit,
    with a GPU."""
    if device is None or not (plan.stage_offloads or plan.model_states.host):
        return None
    from ckplan.hardware.host_link import host_memory_per_gpu

    return host_memory_per_gpu(device)


def _estimate_plot(plan, candidate, path: str) -> None:
    from ckplan.plan.timeline import memory_timeline

    timeline = memory_timeline(plan)
    if timeline is None:
        raise UserError(f"--plot: formula {plan.formula!r} has no schedule to draw")
    budget = None
    if candidate is not None:
        budget = candidate.budget_bytes - plan.model_states.total
    plots().timeline_plot(plan, timeline, path, budget)
