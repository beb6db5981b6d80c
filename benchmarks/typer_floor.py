"""The start-up floor `make bench` compares `ckplan estimate` with: a Typer app with the same
command and options as `ckplan estimate` that parses them and prints one line, nothing else."""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", is_eager=True)] = False) -> None:
    """Root callback, as ckplan has one (it makes `estimate` a sub-command)."""


@app.command()
def estimate(
    model: Annotated[str, typer.Argument(help="Preset name, a .yaml file, or a HF config.json.")],
    strategy: Annotated[str, typer.Option("--strategy", "-s", help="strategy")] = "none",
    formula: Annotated[str, typer.Option("--formula", help="formula set")] = "derived",
    budget: Annotated[str | None, typer.Option("--budget", "-b", help="memory")] = None,
    reserve: Annotated[str | None, typer.Option("--reserve", help="reserve")] = None,
    settings: Annotated[list[str] | None, typer.Option("--set", help="key=value")] = None,
    seq: Annotated[int | None, typer.Option("--seq", help="seq")] = None,
    batch: Annotated[int | None, typer.Option("--batch", help="micro-batch")] = None,
    layers: Annotated[int | None, typer.Option("--layers", help="layers")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON")] = False,
) -> None:
    """Parse the options of `ckplan estimate` and print one line."""
    print(model, strategy, formula, budget, reserve, settings, seq, batch, layers, as_json)


if __name__ == "__main__":
    app()
