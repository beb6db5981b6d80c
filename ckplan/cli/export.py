"""`ckplan export`: a plan written for a launcher (Megatron-LM, PyTorch, DeepSpeed,
torchtitan, YAML)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ckplan import render
from ckplan.cli import output
from ckplan.cli.errors import EXIT_DOES_NOT_FIT, UserError, no_schedule_fits, user_errors
from ckplan.cli.options import (
    BatchOpt,
    LayersOpt,
    ModelArg,
    ModelSetOpt,
    QuietOpt,
    ReserveOpt,
    SeqOpt,
    SlotsOpt,
)
from ckplan.cli.resolve import check_slots, parse_budget, resolve
from ckplan.model.spec import ModelSpec
from ckplan.plan import DEFAULT_SLOTS, STRATEGY_HELP, evaluate, parse_strategy, search
from ckplan.plan.strategies import MIXED
from ckplan.quoting import quote, shorten


def export(
    model: ModelArg,
    plan: Annotated[
        str,
        typer.Option(
            "--plan",
            "-p",
            help="auto (the cheapest the target can express within --budget) or " + STRATEGY_HELP,
        ),
    ],
    to: Annotated[
        str,
        typer.Option(
            "--to",
            "-t",
            help="megatron, torch, deepspeed, torchtitan, yaml, peft or torchtune.",
            autocompletion=lambda incomplete: [
                t
                for t in ("megatron", "torch", "deepspeed", "torchtitan", "yaml")
                if t.startswith(incomplete)
            ],
        ),
    ],
    budget: Annotated[
        str | None,
        typer.Option("--budget", "-b", help="Per-GPU memory (needed by auto and optimal)."),
    ] = None,
    reserve: ReserveOpt = None,
    slots: SlotsOpt = DEFAULT_SLOTS,
    recompute_modules: Annotated[
        bool,
        typer.Option(
            "--recompute-modules/--no-recompute-modules",
            help="megatron: name the selective modules (--recompute-modules core_attn); off for "
            "Megatron-LM versions without that flag.",
        ),
    ] = True,
    torchtitan_version: Annotated[
        str | None,
        typer.Option(
            "--torchtitan-version",
            help="torchtitan: 0.3 (torchtitan 0.3.0's command-line overrides, the default) or "
            "0.2 (the [activation_checkpoint] TOML section of torchtitan 0.2.x).",
        ),
    ] = None,
    settings: ModelSetOpt = None,
    seq: SeqOpt = None,
    batch: BatchOpt = None,
    layers: LayersOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Write a plan for a launcher: Megatron-LM flags, a PyTorch snippet, a DeepSpeed config
    block, torchtitan's command-line overrides (0.3) or [activation_checkpoint] TOML (0.2),
    Hugging Face Trainer and PEFT arguments, or the model and plan as YAML. A plan the target
    cannot express is an error that names the nearest one it can."""
    from ckplan import exports

    with user_errors():
        exports.check_target(to)
        version = exports.check_version(to, torchtitan_version)
        spec = resolve(
            model, settings=settings, seq=seq, batch=batch, layers=layers, gpu_keys="export"
        ).spec
        chosen = _export_plan(spec, plan, to, budget, reserve, check_slots(slots), version)
        result = exports.export(chosen, to, recompute_modules, version)
    sys.stdout.write(result.text)
    if not quiet:
        for note in result.notes:
            output.stderr.print(render.note_text(note), highlight=False)


def _export_plan(
    spec: ModelSpec, plan: str, target: str, budget, reserve, slots: int, version=None
):
    """The plan to export: `auto` picks the cheapest fitting plan that `target` can express."""
    from ckplan import exports

    activation_budget = None
    if budget is not None:
        total, kept = parse_budget(budget, reserve)
        activation_budget = search.activation_budget(spec, total - kept)
    if plan == "auto":
        if budget is None:
            raise UserError("--plan auto picks the cheapest plan that fits: it needs --budget")
        result = search.sweep(spec, total, kept, slots=slots)
        best = exports.best_expressible(spec, result.candidates, target, version)
        if best is None:
            message = f"no plan that {target} can express fits {shorten(budget)}"
            output.stderr.print(render.error_text(message), highlight=False)
            raise typer.Exit(EXIT_DOES_NOT_FIT)
        return best.plan
    parsed = parse_strategy(plan, spec)
    if parsed.offload and parsed.kind == "optimal":
        raise UserError(
            f"--plan {quote(plan)} weighs host copies against a GPU's stage times and export "
            "takes no --gpu; ckplan schedule --gpu GPU --strategy ... --json lists its steps"
        )
    if parsed.kind in ("optimal", MIXED):
        if activation_budget is None:
            raise UserError(f"--plan {quote(plan)} builds the optimal schedule and needs --budget")
        found = (
            evaluate(spec, parsed, budget=activation_budget, slots=slots)
            if activation_budget > 0
            else None
        )
        if found is None:
            no_schedule_fits(plan, activation_budget)
        return found
    return evaluate(spec, parsed)
