"""The row model of each view (estimate, sweep, check) for the CSV and Markdown writers.

Columns that every plan row shares come from `plan_columns`, so a new per-plan figure (the time
model's step seconds, say) is one more Column there and appears in every view and format.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckplan.plan import Plan
from ckplan.plan.search import Candidate, SweepResult
from ckplan.render.common import gib, memory_bar
from ckplan.render.rows import Column, RowTable
from ckplan.render.sweep import (
    budget_line,
    reference_lines,
    sweep_reference_line,
    sweep_verdict,
    unrunnable_lines,
    why_not_fitting,
)
from ckplan.units import format_flops


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def plan_columns(plan_of) -> list[Column]:
    """The columns of one plan; `plan_of(row)` finds the Plan in a row (None: empty cells)."""

    def field(get, text=None):
        def value(row):
            plan = plan_of(row)
            return None if plan is None else get(plan)

        def shown(row):
            plan = plan_of(row)
            return "" if plan is None else (text or str)(get(plan))

        return value, shown

    specs = [
        ("strategy", "plan", lambda p: p.strategy, None, False),
        ("activation_bytes", "activations", lambda p: p.activation_bytes, gib, True),
        ("model_state_bytes", "model states", lambda p: p.model_states.total, gib, True),
        ("total_bytes", "total", lambda p: p.total_bytes, gib, True),
        ("recompute_flops", "recompute", lambda p: p.flops.recompute, format_flops, True),
        ("total_flops", "FLOPs", lambda p: p.flops.total, format_flops, True),
        ("overhead", "overhead", lambda p: p.overhead, lambda v: f"{v:.2%}", True),
    ]
    columns = []
    for key, title, get, text, right in specs:
        value, shown = field(get, text)
        columns.append(Column(key, title, value, shown, right))
    return columns


def time_columns(time_of) -> list[Column]:
    """Step time, its recompute overhead, MFU and tokens/s of a row (`time_of(row)`: a
    hardware.StepTime, or None for rows without one: empty cells)."""

    def column(key, title, get, text):
        return Column(
            key,
            title,
            lambda row: None if time_of(row) is None else get(time_of(row)),
            lambda row: "" if time_of(row) is None else text(get(time_of(row))),
        )

    return [
        column("step_seconds", "step", lambda t: t.step_seconds, lambda v: f"{v:.4g} s"),
        column("time_overhead", "time overhead", lambda t: t.overhead, lambda v: f"{v:+.2%}"),
        column("mfu", "MFU", lambda t: t.mfu, lambda v: f"{v:.1%}"),
        column(
            "tokens_per_second_per_gpu",
            "tokens/s/GPU",
            lambda t: t.tokens_per_second_per_gpu,
            lambda v: f"{v:,.0f}",
        ),
    ]


def budget_columns(candidate_of) -> list[Column]:
    """Fits, headroom and share of the usable budget of a Candidate row."""

    def get(fn, text):
        return (
            lambda row: None if candidate_of(row) is None else fn(candidate_of(row)),
            lambda row: "" if candidate_of(row) is None else text(candidate_of(row)),
        )

    def share(c: Candidate) -> float:
        return c.plan.total_bytes / c.budget_bytes

    def bar(c: Candidate) -> str:
        return memory_bar(c.plan.total_bytes, c.budget_bytes).plain

    fits = get(lambda c: c.fits, lambda c: _yes(c.fits))
    headroom = get(lambda c: c.headroom_bytes, lambda c: gib(c.headroom_bytes))
    usable = get(lambda c: c.budget_bytes, lambda c: gib(c.budget_bytes))
    of_usable = get(share, bar)
    return [
        Column("fits", "fits", *fits),
        Column("headroom_bytes", "headroom", *headroom),
        Column("usable_bytes", "usable", *usable),
        Column("of_usable", "of usable budget", *of_usable, right=False),
    ]


def estimate_rows(plan: Plan, candidate: Candidate | None = None, time=None) -> RowTable:
    """One row: the plan's figures (and the budget's when given, the step time's with a
    GPU)."""
    spec = plan.spec
    columns = [
        Column("model", "model", lambda _: spec.name, right=False),
        Column("formula", "formula", lambda _: plan.formula, right=False),
        Column(
            "per_layer_activation_bytes",
            "one layer",
            lambda _: plan.per_layer_activation_bytes,
            lambda _: gib(plan.per_layer_activation_bytes),
        ),
        *plan_columns(lambda _: plan),
    ]
    if time is not None:
        columns += time_columns(lambda _: time)
    if candidate is not None:
        columns += budget_columns(lambda _: candidate)
    return RowTable(columns, [plan], title=f"{spec.name}: plan {plan.strategy}")


def sweep_rows(result: SweepResult, budget_text: str, show_all: bool) -> RowTable:
    """The Pareto frontier (every plan with --all), by memory; `best` marks the chosen plan."""
    rows = result.candidates if show_all else result.pareto
    rows = sorted(rows, key=lambda c: (c.plan.total_bytes, c.plan.flops.total))
    best = result.best.plan.strategy if result.best else None
    timed = result.gpu is not None
    columns = [
        *plan_columns(lambda c: c.plan),
        *(time_columns(lambda c: c.time) if timed else []),
        *budget_columns(lambda c: c),
        Column(
            "best",
            "best",
            lambda c: c.plan.strategy == best,
            lambda c: "**best**" if c.plan.strategy == best else "",
            right=False,
        ),
    ]
    which = "every plan" if show_all else "Pareto frontier"
    notes = [budget_line(budget_text, result.budget_bytes, result.reserve_bytes).plain]
    notes += [sweep_verdict(result).plain]
    notes += [line for line in [sweep_reference_line(result)] if line]
    notes += list(result.notes)
    return RowTable(columns, rows, title=f"{result.spec.name}: {which}", notes=notes)


def check_rows(
    budget_text: str,
    budget: int,
    reserve: int,
    rows: list[tuple[str, Candidate | None]],
    references: Sequence[Candidate | None] | None = None,
) -> RowTable:
    """One row per model: fits, the plan (the smallest when none fits), why not; the step
    time's columns when the plans were timed (--gpu); `references` as `check_table`'s."""
    timed = any(c is not None and c.time is not None for _, c in rows)
    columns = [
        Column("model", "model", lambda r: r[0], right=False),
        Column(
            "fits",
            "fits",
            lambda r: bool(r[1] and r[1].fits),
            lambda r: _yes(bool(r[1] and r[1].fits)),
        ),
        *plan_columns(lambda r: r[1].plan if r[1] else None),
        *(time_columns(lambda r: r[1].time if r[1] else None) if timed else []),
        *[c for c in budget_columns(lambda r: r[1]) if c.key != "fits"],
        Column(
            "why_not",
            "why not",
            lambda r: _reason(r[1]),
            right=False,
        ),
    ]
    fitting = sum(1 for _, c in rows if c and c.fits)
    notes = [
        budget_line(budget_text, budget, reserve).plain,
        f"{fitting} of {len(rows)} fit.",
    ]
    notes += unrunnable_lines(rows) + reference_lines(rows, references)
    return RowTable(columns, rows, title="Capacity check", notes=notes)


def _reason(candidate: Candidate | None) -> str:
    if candidate is None:
        return "no schedule fits"
    return "" if candidate.fits else why_not_fitting(candidate)


def schedule_row_table(plan: Plan) -> RowTable:
    """A plan's schedule for -f csv/markdown: each run of steps (`sweep.schedule_rows`)."""
    from ckplan.render.sweep import schedule_rows

    rows = [(index, *row) for index, row in enumerate(schedule_rows(plan), 1)]
    columns = [
        Column("index", "#", lambda r: r[0]),
        Column("step", "step", lambda r: r[1], right=False),
        Column("stages", "stages", lambda r: r[2], right=False),
        Column("count", "count", lambda r: r[3]),
    ]
    return RowTable(columns, rows, title=f"{plan.spec.name}: schedule of {plan.strategy}")


def validate_row_table(predictions: list) -> RowTable:
    """The published runs beside ckplan's figures, for -f csv/markdown."""
    columns = [
        Column("name", "run", lambda p: p.run.name, right=False),
        Column("gpu", "GPU", lambda p: p.run.gpu, right=False),
        Column("gpus", "GPUs", lambda p: p.run.gpus),
        Column("framework", "framework", lambda p: p.run.framework, right=False),
        Column("split", "split", lambda p: p.run.split, right=False),
        Column("metric", "metric", lambda p: p.run.published.metric, right=False),
        Column("published", "published", lambda p: p.run.published.value),
        Column("predicted", "ckplan", lambda p: p.predicted),
        Column(
            "error",
            "step error",
            lambda p: p.error,
            lambda p: "" if p.error is None else f"{p.error:+.1%}",
        ),
        Column("status", "status", lambda p: p.status, right=False),
    ]
    return RowTable(columns, predictions, title="Published runs")
