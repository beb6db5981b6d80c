"""The `ckplan` command line: parse, dispatch to the library, hand results to `render`.

Exit codes (DESIGN.md): 0 success / fits / verified; 1 does not fit / mismatch; 2 bad input.
Every user error is one line on stderr, never a traceback, and nothing is written.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console

from ckplan import render
from ckplan.plans import FORMULAS, STRATEGY_HELP, StrategyError, evaluate, parse_strategy
from ckplan.presets import load_spec, preset_names
from ckplan.spec import ModelSpec, SpecError
from ckplan.units import SizeError

app = typer.Typer(
    name="ckplan",
    help="Plan activation checkpointing and recomputation for large-model training.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
# Wide enough for the tables when piped (Rich falls back to 80 columns without a terminal).
PIPED_WIDTH = 140
stdout = Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
stderr = Console(stderr=True, soft_wrap=True)

EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2


class UserError(Exception):
    """Bad input found by the CLI itself (not by the spec or units parsers)."""


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn every bad-input error into one line on stderr and exit code 2."""
    try:
        yield
    except (SpecError, SizeError, StrategyError, UserError) as error:
        stderr.print(render.error_text(str(error)), highlight=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None


# ---- shared options ----------------------------------------------------------------------

ModelArg = Annotated[str, typer.Argument(help="Preset name, a .yaml file, or a HF config.json.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override any model key: --set key=value (repeatable)."),
]
SeqOpt = Annotated[int | None, typer.Option("--seq", help="Shortcut for --set seq=N.")]
BatchOpt = Annotated[int | None, typer.Option("--batch", help="Shortcut for --set micro_batch=N.")]
LayersOpt = Annotated[int | None, typer.Option("--layers", help="Shortcut for --set layers=N.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
FormulaOpt = Annotated[
    str, typer.Option("--formula", help="derived (from the architecture) or seed (the seed's).")
]


def parse_overrides(
    settings: list[str] | None, seq: int | None, batch: int | None, layers: int | None
) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for setting in settings or []:
        key, sep, raw = setting.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {setting!r}: expected key=value, e.g. --set seq=4096")
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        overrides[key.strip()] = value
    for key, value in (("seq", seq), ("micro_batch", batch), ("layers", layers)):
        if value is not None:
            overrides[key] = value
    return overrides


def resolve_model(model: str, settings, seq, batch, layers) -> ModelSpec:
    return load_spec(model, parse_overrides(settings, seq, batch, layers))


def check_formula(formula: str) -> str:
    if formula not in FORMULAS:
        raise UserError(f"--formula {formula!r}: expected one of {', '.join(FORMULAS)}")
    return formula


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


# ---- commands ----------------------------------------------------------------------------


@app.command()
def estimate(
    model: ModelArg,
    strategy: Annotated[str, typer.Option("--strategy", "-s", help=STRATEGY_HELP)] = "none",
    formula: FormulaOpt = "derived",
    settings: SetOpt = None,
    seq: SeqOpt = None,
    batch: BatchOpt = None,
    layers: LayersOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """One plan with its full breakdown: per-op activations, model states, FLOPs, overhead."""
    with user_errors():
        spec = resolve_model(model, settings, seq, batch, layers)
        plan = evaluate(spec, parse_strategy(strategy, spec), check_formula(formula))
    if as_json:
        print_json(render.estimate_dict(plan))
    else:
        stdout.print(render.estimate_view(plan))


@app.command()
def presets(
    name: Annotated[str | None, typer.Argument(help="Show one preset fully resolved.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the shipped presets, or show one resolved."""
    from ckplan.memory import parameter_count

    with user_errors():
        if name is not None:
            spec = load_spec(name)
            if as_json:
                print_json(spec.to_dict())
            else:
                stdout.print(render.model_table(spec, f"Preset {name}"))
            return
        rows = []
        for preset in preset_names():
            spec = load_spec(preset)
            rows.append((preset, spec, parameter_count(spec).total))
    if as_json:
        print_json({preset: {**spec.to_dict(), "parameters": p} for preset, spec, p in rows})
    else:
        stdout.print(render.presets_table(rows))


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: usage errors become one line and exit 2, like every bad input."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="ckplan", standalone_mode=False)
    except typer.Exit as exit_:
        code = exit_.exit_code
    except typer.Abort:
        code = EXIT_DOES_NOT_FIT
    except Exception as error:
        # Click's usage errors (typer vendors click; both expose format_message + exit_code).
        if not hasattr(error, "format_message") or not hasattr(error, "exit_code"):
            raise
        if type(error).__name__ == "NoArgsIsHelpError":
            stdout.print(error.format_message(), highlight=False)
        else:
            message = " ".join(error.format_message().split())
            stderr.print(render.error_text(message), highlight=False)
        code = EXIT_BAD_INPUT
    code = code if isinstance(code, int) else EXIT_OK
    if argv is None:
        sys.exit(code)
    return code
