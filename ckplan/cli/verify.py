"""`ckplan verify`: run plans on the NumPy MLP and compare with the predictions."""

from __future__ import annotations

from typing import Annotated

import typer

from ckplan import render
from ckplan.cli.errors import EXIT_DOES_NOT_FIT, EXIT_OK, UserError, user_errors
from ckplan.cli.options import JsonOpt
from ckplan.cli.output import print_json, print_view
from ckplan.quoting import quote
from ckplan.units import parse_size


def verify(
    layers: Annotated[int, typer.Option("--layers", help="Layers L of the NumPy MLP.")] = 16,
    hidden: Annotated[int, typer.Option("--hidden", help="Width d.")] = 128,
    ffn_hidden: Annotated[int, typer.Option("--ffn-hidden", help="Hidden width f.")] = 512,
    batch: Annotated[int, typer.Option("--batch", help="Rows b of the input.")] = 64,
    strategies: Annotated[
        list[str] | None,
        typer.Option(
            "--strategy",
            "-s",
            help="Repeatable or comma-separated (none always runs, as the baseline). Default: "
            "none, full, uniform:4, sequential:4, sqrt, revolve:4, optimal.",
        ),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option("--budget", "-b", help="Activation budget of optimal (default: sqrt's peak)."),
    ] = None,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed runs per strategy.")] = 3,
    seed: Annotated[int, typer.Option("--seed", help="Random seed of weights and inputs.")] = 0,
    tolerance: Annotated[
        float, typer.Option("--tolerance", help="Allowed relative peak-memory error.")
    ] = 0.05,
    as_json: JsonOpt = False,
) -> None:
    """Run plans on the NumPy MLP (float64) and compare with the planner's predictions:
    peak memory, layer forwards, FLOPs, time, gradients. Exit 1 on any mismatch."""
    with user_errors():
        from ckplan.simple import verify as verifier  # NumPy only for this command

        if not 1 <= repeats <= verifier.MAX_REPEATS:
            raise UserError(f"--repeats must be in 1..{verifier.MAX_REPEATS}, got {quote(repeats)}")
        if not 0 <= seed < 2**63:
            raise UserError(f"--seed must be in 0..2**63-1, got {quote(seed)}")
        if not 0 < tolerance < 1:
            raise UserError(f"--tolerance must be in (0, 1), got {tolerance}")
        spec = verifier.mlp_spec(layers, hidden, ffn_hidden, batch)
        names = [name for text in strategies or [] for name in text.split(",") if name.strip()]
        activation_budget = None if budget is None else parse_size(budget)
        report = verifier.verify(spec, names or None, activation_budget, repeats, seed, tolerance)
    if as_json:
        print_json(render.verify_dict(report))
    else:
        print_view(render.verify_view(report))
    raise typer.Exit(EXIT_OK if report.ok else EXIT_DOES_NOT_FIT)
