"""The `ckplan` command line: parse, dispatch to the library, hand results to `render`.

Exit codes (DESIGN.md): 0 success / fits / verified; 1 does not fit / mismatch; 2 bad input;
3 an unexpected error inside ckplan (a bug: never 1, which CI reads as "does not fit").
Every error is one line on stderr, never a traceback, and nothing is written.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import glob
import json
import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml
from rich.console import Console

from ckplan import __version__, render
from ckplan.errors import InputError
from ckplan.io import safe_yaml
from ckplan.io.gpus import gpu_names, load_gpu
from ckplan.io.presets import load_spec, preset_names
from ckplan.model.spec import ModelSpec
from ckplan.plan import (
    DEFAULT_SLOTS,
    FORMULAS,
    STRATEGY_HELP,
    evaluate,
    limits,
    parse_strategy,
    search,
    stage_names,
)
from ckplan.plan.search import DEFAULT_RESERVE
from ckplan.quoting import abbreviate, one_line, quote, shorten
from ckplan.render.progress import progress
from ckplan.units import format_bytes, parse_size

if TYPE_CHECKING:
    from ckplan.hardware.gpus import GPU

app = typer.Typer(
    name="ckplan",
    help="Plan activation checkpointing and recomputation for large-model training.",
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
# Wide enough for the tables when piped (Rich falls back to 80 columns without a terminal).
PIPED_WIDTH = 140
MAX_COLUMNS = 10_000


def _isatty(stream) -> bool:
    """A closed stream (`ckplan ... >&-` leaves sys.stdout None) is no terminal."""
    try:
        return bool(stream is not None and stream.isatty())
    except (ValueError, OSError, AttributeError):
        return False


def _console_environ() -> dict[str, str]:
    """The environment Rich sizes its consoles from, without a COLUMNS or LINES it would
    choke on: Rich reads '²' as a digit (then int() fails) and takes 0 as a width."""
    environ = dict(os.environ)
    for key in ("COLUMNS", "LINES"):
        value = environ.get(key)
        if value is not None and not (
            value.isascii() and value.isdigit() and 1 <= int(value) <= MAX_COLUMNS
        ):
            del environ[key]
    return environ


stdout = Console(width=None if _isatty(sys.stdout) else PIPED_WIDTH, _environ=_console_environ())
stderr = Console(stderr=True, soft_wrap=True, _environ=_console_environ())


class ReaderGone(Exception):
    """The reader of stdout went away (`ckplan presets | head -1`): exit 141, not 1."""


def _on_broken_pipe() -> None:
    """Rich's own answer to a broken pipe is SystemExit(1), the "does not fit" code."""
    _silence_stdout()
    raise ReaderGone


stdout.on_broken_pipe = _on_broken_pipe

EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
EXIT_BROKEN_PIPE = 141  # the reader of stdout went away, as a shell reports SIGPIPE


class UserError(Exception):
    """Bad input found by the CLI itself (not by the spec or units parsers)."""


def _step_time(plan, gpu):
    """The time model, imported when a command is given --gpu (start-up time)."""
    from ckplan.hardware.step_time import step_time

    return step_time(plan, gpu)


def _plots():
    """The plot renderer, imported when a command is given --plot."""
    from ckplan.render import plot

    return plot


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn every bad-input error into one line on stderr and exit code 2."""
    try:
        yield
    except (InputError, UserError) as error:
        print_error(str(error))
        raise typer.Exit(EXIT_BAD_INPUT) from None


def print_error(message: str) -> None:
    """`error: <message>` as one printable line on stderr, however long or odd the message."""
    # stderr full or closed: nowhere to say it, the exit code still tells
    with contextlib.suppress(OSError, ValueError):
        stderr.print(render.error_text(one_line(message)), highlight=False)


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"ckplan {__version__}\n")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """Plan activation checkpointing and recomputation for large-model training."""


# ---- shared options ----------------------------------------------------------------------


def complete_model(incomplete: str) -> list[str]:
    """Shell completion of MODEL: preset names, then .yaml/.yml/.json files and folders."""
    names = [name for name in preset_names() if name.startswith(incomplete)]
    for path in sorted(glob.glob(incomplete + "*")):
        if Path(path).is_dir():
            names.append(path + "/")
        elif path.endswith((".yaml", ".yml", ".json")):
            names.append(path)
    return names


ModelArg = Annotated[
    str,
    typer.Argument(
        help="Preset name, a .yaml file, or a HF config.json.", autocompletion=complete_model
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override any model key: --set key=value (repeatable); a GPU key with the gpu. "
        "prefix: --set gpu.matmul_efficiency=0.7.",
    ),
]
GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        help="GPU preset (see `ckplan gpus`) or .yaml file: sets the budget (unless --budget) "
        "and adds step time, MFU and the time overhead.",
    ),
]
GPU_PREFIX = "gpu."
SeqOpt = Annotated[int | None, typer.Option("--seq", help="Shortcut for --set seq=N.")]
BatchOpt = Annotated[int | None, typer.Option("--batch", help="Shortcut for --set micro_batch=N.")]
LayersOpt = Annotated[int | None, typer.Option("--layers", help="Shortcut for --set layers=N.")]
MoeImbalanceOpt = Annotated[
    str | None,
    typer.Option(
        "--moe-imbalance",
        help="MoE routing on the busiest expert rank: average (default), worst, or a factor "
        ">= 1 (shortcut for --set moe_imbalance=...).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        help="Kernel profile: fused (default), torch-eager, torch-sdpa or a .yaml file "
        "(ckplan calibrate writes one). Shortcut for --set profile=NAME.",
    ),
]
FORMATS = ("table", "json", "csv", "markdown")
FormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format", "-f", help="table (default), json, csv, or markdown (e.g. a PR comment)."
    ),
]
PlotOpt = Annotated[
    str | None,
    typer.Option("--plot", help="Also draw it to FILE.png or FILE.svg (needs ckplan[plot])."),
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress bar and no notes on stderr.")
]
FormulaOpt = Annotated[
    str, typer.Option("--formula", help="derived (from the architecture) or seed (the seed's).")
]


def parse_overrides(
    settings: list[str] | None,
    seq: int | None,
    batch: int | None,
    layers: int | None,
    moe_imbalance: str | None = None,
    profile: str | None = None,
) -> dict[str, Any]:
    overrides = {
        key: value for key, value in _settings(settings).items() if not key.startswith(GPU_PREFIX)
    }
    shortcuts = (
        ("seq", seq),
        ("micro_batch", batch),
        ("layers", layers),
        ("moe_imbalance", moe_imbalance),
        ("profile", profile),
    )
    for key, value in shortcuts:
        if value is not None:
            overrides[key] = value
    return overrides


def _settings(settings: list[str] | None) -> dict[str, Any]:
    """Every --set key=value, values parsed as YAML scalars."""
    parsed: dict[str, Any] = {}
    for setting in settings or []:
        key, sep, raw = setting.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {quote(setting)}: expected key=value, e.g. --set seq=4096")
        try:
            value = safe_yaml.load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw  # not a YAML scalar: the spec says what the key expects
        parsed[key.strip()] = value
    return parsed


def resolve_model(
    model: str, settings, seq, batch, layers, moe_imbalance=None, profile=None
) -> ModelSpec:
    return load_spec(model, parse_overrides(settings, seq, batch, layers, moe_imbalance, profile))


def no_gpu_keys(settings: list[str] | None, command: str) -> None:
    """Commands without --gpu refuse `--set gpu.KEY=...` rather than ignore it."""
    for key in _settings(settings):
        if key.startswith(GPU_PREFIX):
            raise UserError(f"--set {quote(key)}: {command} takes no GPU, so GPU keys do not apply")


def resolve_gpu(gpu: str | None, settings: list[str] | None) -> GPU | None:
    """The --gpu preset or file with the --set gpu.KEY=VALUE overrides applied."""
    overrides = {
        key.removeprefix(GPU_PREFIX): value
        for key, value in _settings(settings).items()
        if key.startswith(GPU_PREFIX)
    }
    if gpu is None:
        if overrides:
            key = next(iter(overrides))
            raise UserError(f"--set gpu.{shorten(key)}: GPU keys need --gpu NAME|FILE")
        return None
    return load_gpu(gpu, overrides)


def resolve_budget(
    budget: str | None, reserve: str | None, gpu: GPU | None
) -> tuple[str, int, int] | None:
    """(budget as the user reads it, total bytes, reserve bytes): --budget, else the GPU's
    memory; None when neither is given."""
    if budget is not None:
        return (budget, *parse_budget(budget, reserve))
    if gpu is None:
        return None
    # Exact decimal GB: `:g` wrote a tiny memory_bytes as '1e-07GB', which parse_size refuses.
    text = f"{Decimal(gpu.memory_bytes) / 10**9:f}GB"
    total, kept = parse_budget(text, reserve)
    return text, total, kept


def check_formula(formula: str) -> str:
    if formula not in FORMULAS:
        raise UserError(f"--formula {quote(formula)}: expected one of {', '.join(FORMULAS)}")
    return formula


def no_schedule_fits(
    strategy: str,
    activation_budget: int,
    as_json: bool = False,
    json_data=None,
    advice: tuple[ModelSpec, int] | None = None,
) -> None:
    """A budget too small for any schedule: a does-not-fit answer (exit 1), not bad input.
    With --json, `json_data(reason)` is printed too, so that --json always prints JSON.
    `advice` (the model, usable bytes): what to raise from its layout (`plan.advice`)."""
    left = format_bytes(max(activation_budget, 0), "GiB")
    message = f"no {strategy} schedule fits the {left} that model states and reserve leave"
    if advice is not None:
        from ckplan.plan.advice import advice_lines

        lines = advice_lines(*advice, limit=2)
        if lines:
            message += "; from this layout: " + "; or ".join(lines)
    if as_json and json_data is not None:
        print_json(json_data(message))
    print_error(message)
    raise typer.Exit(EXIT_DOES_NOT_FIT)


def print_json(data: Any) -> None:
    try:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        raise ReaderGone from None


def output_format(fmt: str | None, as_json: bool) -> str:
    """--format, with --json as its alias for json."""
    if fmt is not None and fmt not in FORMATS:
        raise UserError(f"--format {quote(fmt)}: expected one of {', '.join(FORMATS)}")
    if as_json and fmt not in (None, "json"):
        raise UserError(f"--json and --format {shorten(fmt)} disagree: give one of them")
    return "json" if as_json else fmt or "table"


def print_rows(table, fmt: str) -> None:
    """csv or markdown through the one writer of each (render.rows)."""
    from ckplan.render import rows

    sys.stdout.write(rows.to_csv(table) if fmt == "csv" else rows.to_markdown(table))


# ---- commands ----------------------------------------------------------------------------


@app.command()
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
    settings: SetOpt = None,
    seq: SeqOpt = None,
    batch: BatchOpt = None,
    layers: LayersOpt = None,
    moe_imbalance: MoeImbalanceOpt = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    fmt: FormatOpt = None,
    plot: PlotOpt = None,
) -> None:
    """One plan with its full breakdown: per-op activations, model states, FLOPs, overhead
    (and with --gpu: step time, MFU, the time overhead and its breakdown)."""
    with user_errors():
        fmt = output_format(fmt, as_json)
        if plot is not None:
            _plots().check_plot(plot)
        spec = resolve_model(model, settings, seq, batch, layers, moe_imbalance, profile)
        device = resolve_gpu(gpu, settings)
        parsed = parse_strategy(strategy, spec)
        candidate = None
        budgets = resolve_budget(budget, reserve, device)
        if budgets is None:
            plan = evaluate(spec, parsed, check_formula(formula))
        else:
            _, total, kept = budgets
            activation_budget = search.activation_budget(spec, total - kept)
            plan = None
            if parsed.kind != "optimal" or activation_budget > 0:
                plan = evaluate(spec, parsed, check_formula(formula), budget=activation_budget)
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
            candidate = search.Candidate(plan, total - kept)
        time = None if device is None else _step_time(plan, device)
        if plot is not None:
            _estimate_plot(plan, candidate, plot)
    if fmt == "json":
        print_json(render.estimate_dict(plan, candidate, time))
    elif fmt in ("csv", "markdown"):
        from ckplan.render.row_models import estimate_rows

        print_rows(estimate_rows(plan, candidate, time), fmt)
    else:
        stdout.print(render.estimate_view(plan, candidate, time, device))
    if candidate is not None and not candidate.fits:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


def _estimate_plot(plan, candidate, path: str) -> None:
    from ckplan.plan.timeline import memory_timeline

    timeline = memory_timeline(plan)
    if timeline is None:
        raise UserError(f"--plot: formula {plan.formula!r} has no schedule to draw")
    budget = None
    if candidate is not None:
        budget = candidate.budget_bytes - plan.model_states.total
    _plots().timeline_plot(plan, timeline, path, budget)


@app.command()
def presets(
    name: Annotated[str | None, typer.Argument(help="Show one preset fully resolved.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the shipped presets, or show one resolved."""
    from ckplan.model.memory import parameter_count

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


@app.command()
def gpus(
    name: Annotated[str | None, typer.Argument(help="Show one GPU, every key resolved.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the shipped GPU presets (datasheet figures and efficiencies), or show one."""
    with user_errors():
        devices = [load_gpu(name)] if name is not None else [load_gpu(n) for n in gpu_names()]
    if as_json:
        data = {device.name: device.to_dict() for device in devices}
        print_json(devices[0].to_dict() if name is not None else data)
    elif name is not None:
        stdout.print(render.gpu_table(devices[0]))
    else:
        stdout.print(render.gpus_table(devices))


BudgetOpt = Annotated[
    str | None,
    typer.Option("--budget", "-b", help="Per-GPU memory: 40GB, 40GiB, 80e9, ... (or --gpu)"),
]
ReserveOpt = Annotated[
    str | None,
    typer.Option(
        "--reserve",
        help="Taken off the budget for CUDA context and allocator slack (default 2GiB).",
    ),
]
SlotsOpt = Annotated[int, typer.Option("--slots", help="Memory slots of the optimal-schedule DP.")]


def parse_budget(budget: str, reserve: str | None) -> tuple[int, int]:
    total = parse_size(budget)
    kept = DEFAULT_RESERVE if reserve is None else parse_size_or_zero(reserve)
    if kept >= total:
        raise UserError(
            f"--reserve ({shorten(reserve or '2GiB')}) must be smaller than --budget "
            f"({shorten(budget)})"
        )
    return total, kept


def require_budget(budget: str | None, reserve: str | None, gpu: GPU | None):
    budgets = resolve_budget(budget, reserve, gpu)
    if budgets is None:
        raise UserError("--budget SIZE (or --gpu NAME, which sets it) is required")
    return budgets


def parse_size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else parse_size(text)


def check_slots(slots: int) -> int:
    return limits.check_slots(slots)


@app.command()
def sweep(
    model: ModelArg,
    budget: BudgetOpt = None,
    reserve: ReserveOpt = None,
    gpu: GpuOpt = None,
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
    """Every candidate plan against a budget: which fit, the Pareto frontier, the best (the
    fastest with --gpu)."""
    with user_errors():
        fmt = output_format(fmt, as_json)
        if plot is not None:
            _plots().check_plot(plot)
        spec = resolve_model(model, settings, seq, batch, layers, moe_imbalance, profile)
        device = resolve_gpu(gpu, settings)
        budget_text, total, kept = require_budget(budget, reserve, device)
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
        micro_batches = _micro_batches(spec, result) if micro_batch == "auto" else None
        if plot is not None:
            _plots().sweep_plot(result, budget_text, plot)
    if fmt == "json":
        print_json(render.sweep_dict(result, micro_batches))
    elif fmt in ("csv", "markdown"):
        from ckplan.render.row_models import sweep_rows

        print_rows(sweep_rows(result, budget_text, show_all), fmt)
    else:
        stdout.print(render.sweep_view(result, budget_text, show_all, micro_batches))
    raise typer.Exit(EXIT_OK if result.best else EXIT_DOES_NOT_FIT)


def _micro_batches(spec: ModelSpec, result: search.SweepResult) -> dict[str, int]:
    names = ["none", "selective", "full", "sqrt", f"uniform:{result.min_memory_segment}"]
    if result.best and not result.best.plan.strategy.startswith("optimal"):
        names.append(result.best.plan.strategy)
    return {
        name: search.largest_micro_batch(spec, parse_strategy(name, spec), result.usable_bytes)
        for name in dict.fromkeys(names)
    }


MAX_GPUS = 1_048_576  # --gpus: the documented range of `ckplan plan`
MAX_GLOBAL_BATCH = 2**24  # --global-batch: sequences per step (the search factors it)


@app.command()
def plan(
    model: ModelArg,
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs to lay the model out on.")],
    gpu: Annotated[
        str, typer.Option("--gpu", help="GPU preset (see `ckplan gpus`) or .yaml file.")
    ],
    global_batch: Annotated[
        int | None,
        typer.Option("--global-batch", help="Sequences per step (default: one per GPU)."),
    ] = None,
    top: Annotated[int, typer.Option("--top", help="How many layouts to show.")] = 10,
    budget: BudgetOpt = None,
    reserve: ReserveOpt = None,
    slots: SlotsOpt = DEFAULT_SLOTS,
    settings: SetOpt = None,
    seq: SeqOpt = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    fmt: FormatOpt = None,
) -> None:
    """The fastest layouts (tp, sp, pp and its split, virtual stages, cp, dp, ZeRO,
    micro-batches) of --gpus GPUs, each with its best recomputation plan; --set tp=8 (any
    layout key) fixes a key."""
    from ckplan.plan.layout import search as layout_search
    from ckplan.plan.layout.space import constraints_from
    from ckplan.render import layouts as layout_view

    with user_errors():
        fmt = output_format(fmt, as_json)
        if not 1 <= gpus <= MAX_GPUS:
            raise UserError(f"--gpus must be in 1..{MAX_GPUS:,}, got {gpus}")
        global_batch = gpus if global_batch is None else global_batch
        if global_batch < 1:
            raise UserError(f"--global-batch must be at least 1, got {global_batch}")
        if global_batch > MAX_GLOBAL_BATCH:
            raise UserError(
                f"--global-batch must be in 1..{MAX_GLOBAL_BATCH:,} sequences, "
                f"got {quote(global_batch)}"
            )
        if top < 1:
            raise UserError(f"--top must be at least 1, got {top}")
        overrides = parse_overrides(settings, seq, None, None, None, profile)
        constraints = constraints_from(overrides)
        # the search sets the layout keys; the model is read without them
        spec = load_spec(model, {k: v for k, v in overrides.items() if k not in constraints})
        device = resolve_gpu(gpu, settings)
        budget_text, total, kept = require_budget(budget, reserve, device)
        slots = check_slots(slots)
        extra = "".join(
            f" --set {shlex.quote(setting)}"
            for setting in settings or []
            if setting.partition("=")[0].strip() not in constraints
        )
        extra += f" --profile {shlex.quote(profile)}" if profile else ""
        layout_search.check_search(spec, gpus, device.gpus_per_node, global_batch, constraints)
        result = layout_search.search_layouts(
            spec, gpus, device, global_batch, total, kept, top, constraints, slots
        )
    if fmt == "json":
        print_json(layout_view.plan_dict(result))
    elif fmt in ("csv", "markdown"):
        print_rows(layout_view.plan_rows(result), fmt)
    else:
        stdout.print(layout_view.plan_view(result, budget_text, model, extra), soft_wrap=True)
    if not result.layouts:
        print_error(layout_view.no_fit_line(result))
        raise typer.Exit(EXIT_DOES_NOT_FIT)


@app.command()
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
    slots: SlotsOpt = DEFAULT_SLOTS,
    settings: SetOpt = None,
    seq: SeqOpt = None,
    batch: BatchOpt = None,
    layers: LayersOpt = None,
    moe_imbalance: MoeImbalanceOpt = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    fmt: FormatOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """CI capacity check: exit 0 when every model fits the budget, 1 when any does not."""
    with user_errors():
        fmt = output_format(fmt, as_json)
        device = resolve_gpu(gpu, settings)
        budget_text, total, kept = require_budget(budget, reserve, device)
        specs = [
            (name, resolve_model(name, settings, seq, batch, layers, moe_imbalance, profile))
            for name in expand_models(models)
        ]
        rows = []
        with progress("check: models", quiet) as report:
            for done, (name, spec) in enumerate(specs):
                report(done, len(specs))
                best = search.best_plan(spec, total, strategy, kept, check_slots(slots), device)
                rows.append((name, best))
            report(len(specs), len(specs))
    if fmt == "json":
        print_json(render.check_dict(total, rows))
    elif fmt in ("csv", "markdown"):
        from ckplan.render.row_models import check_rows

        print_rows(check_rows(budget_text, total, kept, rows), fmt)
    else:
        stdout.print(render.check_table(budget_text, total, kept, rows))
    raise typer.Exit(EXIT_OK if all(c and c.fits for _, c in rows) else EXIT_DOES_NOT_FIT)


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


@app.command()
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
    time = None if device is None else _step_time(plan, device)
    if as_json:
        print_json(render.schedule_dict(plan, activation_budget, time))
    else:
        stdout.print(render.schedule_view(plan, activation_budget, time))


@app.command()
def calibrate(
    model: ModelArg,
    out: Annotated[
        str | None, typer.Option("--out", "-o", help="Write the fitted profile to this .yaml.")
    ] = None,
    hf: Annotated[
        bool,
        typer.Option("--hf", help="Measure the real Hugging Face decoder layer (transformers)."),
    ] = False,
    device: Annotated[
        str, typer.Option("--device", help="cpu, or cuda: also checks peak memory on the GPU.")
    ] = "cpu",
    name: Annotated[str | None, typer.Option("--name", help="The profile's name.")] = None,
    settings: SetOpt = None,
    seq: SeqOpt = None,
    batch: BatchOpt = None,
    layers: LayersOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Measure what autograd saves per op for one layer of MODEL (PyTorch, small shapes), fit
    a kernel profile exactly, check it on a shape left out, and compare it with fused."""
    from ckplan.calibrate import missing_extra

    with user_errors():
        no_gpu_keys(settings, "calibrate")
        spec = resolve_model(model, settings, seq, batch, layers)
        if device != "cpu" and not device.startswith("cuda"):
            raise UserError(f"--device {quote(device)}: expected cpu or cuda")
        if out is not None and not out.endswith((".yaml", ".yml")):
            raise UserError(f"--out {quote(out)}: expected a .yaml file")
        if out is not None:
            from ckplan.io.paths import check_output

            check_output(out, "--out")
        missing = missing_extra(hf)
        if missing:
            raise UserError(missing)
        from ckplan.calibrate import run

        hf_config = _hf_config(model) if hf else None
        try:
            result = run.calibrate(spec, hf, device, name, hf_config)
            if device.startswith("cuda"):
                from ckplan.calibrate.cuda import peak_memory_check

                result.cuda = peak_memory_check(spec, result, device, hf, hf_config)
            comparison = run.compare_with_fused(result)
        except run.CalibrationError as error:
            raise UserError(str(error)) from None
        if out is not None:
            _write_profile(out, result.profile)
    if as_json:
        print_json(render.calibrate_dict(result, comparison, out))
    else:
        stdout.print(render.calibrate_view(result, comparison, out))


def _hf_config(model: str) -> dict | None:
    """A config.json MODEL's own keys (its model_type picks the layer), else None."""
    if not model.endswith(".json"):
        return None
    return json.loads(Path(model).read_text(encoding="utf-8"))


def _write_profile(path: str, profile: dict) -> None:
    header = "# A kernel profile written by `ckplan calibrate` (terms: ckplan/model/profiles.py)\n"
    text = header + yaml.safe_dump(profile, sort_keys=False, allow_unicode=True, width=100)
    from ckplan.io.paths import write_atomic

    write_atomic(path, "--out", lambda temporary: temporary.write_text(text, encoding="utf-8"))


@app.command()
def verify(
    layers: Annotated[int, typer.Option("--layers", help="Layers L of the seed's MLP.")] = 16,
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
    """Run plans on the seed's NumPy MLP (float64) and compare with the planner's predictions:
    peak memory, layer forwards, FLOPs, time, gradients. Exit 1 on any mismatch."""
    with user_errors():
        from ckplan import verify as verifier  # NumPy only for this command

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
        stdout.print(render.verify_view(report))
    raise typer.Exit(EXIT_OK if report.ok else EXIT_DOES_NOT_FIT)


@app.command()
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
            help="megatron, torch, deepspeed, torchtitan or yaml.",
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
    settings: SetOpt = None,
    seq: SeqOpt = None,
    batch: BatchOpt = None,
    layers: LayersOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Write a plan for a launcher: Megatron-LM flags, a PyTorch snippet, a DeepSpeed config
    block, torchtitan's [activation_checkpoint] TOML, or the model and plan as YAML. A plan the
    target cannot express is an error that names the nearest one it can."""
    from ckplan.io import exports

    with user_errors():
        exports.check_target(to)
        no_gpu_keys(settings, "export")
        spec = resolve_model(model, settings, seq, batch, layers)
        chosen = _export_plan(spec, plan, to, budget, reserve, check_slots(slots))
        result = exports.export(chosen, to, recompute_modules)
    sys.stdout.write(result.text)
    if not quiet:
        for note in result.notes:
            stderr.print(render.note_text(note), highlight=False)


def _export_plan(spec: ModelSpec, plan: str, target: str, budget, reserve, slots: int):
    """The plan to export: `auto` picks the cheapest fitting plan that `target` can express."""
    from ckplan.io import exports

    activation_budget = None
    if budget is not None:
        total, kept = parse_budget(budget, reserve)
        activation_budget = search.activation_budget(spec, total - kept)
    if plan == "auto":
        if budget is None:
            raise UserError("--plan auto picks the cheapest plan that fits: it needs --budget")
        result = search.sweep(spec, total, kept, slots=slots)
        best = exports.best_expressible(spec, result.candidates, target)
        if best is None:
            message = f"no plan that {target} can express fits {shorten(budget)}"
            stderr.print(render.error_text(message), highlight=False)
            raise typer.Exit(EXIT_DOES_NOT_FIT)
        return best.plan
    parsed = parse_strategy(plan, spec)
    if parsed.kind == "optimal":
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


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: usage errors become one line and exit 2, like every bad input;
    anything unexpected becomes one line and exit 3, never a traceback and never exit 1."""
    # Deep models keep large lists of per-stage figures alive; the collector's full passes over
    # them cost a quarter of a 100,000-layer sweep. Collect young objects less often.
    gc.set_threshold(100_000, 50, 100)
    _tolerant_streams()
    if sys.stderr is None:  # `2>&-`: errors go nowhere, the exit code still tells
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (open for the process's life)
    if sys.stdout is None:  # `>&-`
        print_error("standard output is closed: nowhere to print the answer")
        code = EXIT_BAD_INPUT
        if argv is None:
            sys.exit(code)
        return code
    try:
        code = _click_command().main(args=argv, prog_name="ckplan", standalone_mode=False)
    except typer.Abort:  # end of input at a prompt (a typer.Exit: caught first)
        print_error("interrupted")
        code = EXIT_INTERRUPTED
    except typer.Exit as exit_:  # Ctrl-C arrives as typer.Exit(130)
        code = exit_.exit_code
    except ReaderGone:
        code = EXIT_BROKEN_PIPE
    except SystemExit as exit_:
        # Typer answers a broken pipe it meets itself with sys.exit(1), the "does not fit"
        # code, after wrapping stdout so that the exit flush stays quiet.
        if type(sys.stdout).__name__ != "PacifyFlushWrapper":
            raise
        code = EXIT_BROKEN_PIPE if exit_.code == 1 else exit_.code
    except Exception as error:
        code = _report_exception(error)
    code = code if isinstance(code, int) else EXIT_OK
    if code != EXIT_BROKEN_PIPE:
        code = _flush_stdout(code)
    if argv is None:
        sys.exit(code)
    return code


@functools.cache
def _click_command():
    """Typer builds the Click command from the signatures (~15 ms): once per process, so that
    in-process callers (the tests run the CLI hundreds of times) pay it once."""
    return typer.main.get_command(app)


def _report_exception(error: Exception) -> int:
    """Click's usage errors (typer vendors click; both expose format_message + exit_code) are
    bad input, exit 2; anything else is a bug in ckplan, exit 3, said in one line."""
    if hasattr(error, "format_message") and hasattr(error, "exit_code"):
        if type(error).__name__ == "NoArgsIsHelpError":
            try:
                stdout.print(error.format_message(), highlight=False)
            except OSError as output_error:
                return _output_failed(output_error)
        else:
            print_error(error.format_message())
        return EXIT_BAD_INPUT
    if isinstance(error, OSError) and error.errno in OUTPUT_ERRNOS:
        return _output_failed(error)
    if isinstance(error, MemoryError):
        print_error("out of memory (MemoryError): please report this input as a ckplan bug")
    else:
        detail = f": {quote(error.args[0])}" if error.args else ""
        print_error(
            f"internal error ({type(error).__name__}{detail}); please report it as a ckplan bug"
        )
    return EXIT_INTERNAL


# What writing the answer to stdout raises when it cannot (`> /dev/full`, a closed or lost
# descriptor); reading input files turns its own OSErrors into bad input before this.
OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF}


def _flush_stdout(code: int) -> int:
    """Flush the answer now, so that a full disk is one line and exit 2 here rather than
    Python's 'Exception ignored' at exit (exit 120)."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as error:
        return _output_failed(error)
    except ValueError:  # closed by the command's caller
        pass
    return code


def _output_failed(error: OSError) -> int:
    print_error(f"cannot write to standard output ({error.strerror or type(error).__name__})")
    _silence_stdout()
    return EXIT_BAD_INPUT


def _tolerant_streams() -> None:
    """Characters the terminal's encoding cannot show (a lone surrogate from a non-UTF-8
    argument, a '·' on an ASCII console) print as escapes instead of raising."""
    for stream in (sys.stdout, sys.stderr):
        # not a text file, or already closed: nothing to do
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")


def _silence_stdout() -> None:
    """After a broken pipe, send what Python flushes at exit to /dev/null instead."""
    import os

    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
