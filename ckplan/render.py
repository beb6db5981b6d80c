"""Turn results into Rich tables (for people) and JSON-ready dicts (for machines).

The only module that knows how things look. Byte and FLOP counts stay exact ints in JSON;
tables print GiB (2^30) and say so, with GB (10^9) beside totals.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ckplan import __version__
from ckplan.ops import layer_ops
from ckplan.plans import Plan
from ckplan.search import Candidate, SweepResult
from ckplan.spec import ModelSpec
from ckplan.units import format_bytes, format_bytes_auto, format_flops, size_unit

GIB = "GiB"


# ---- JSON --------------------------------------------------------------------------------


def plan_dict(plan: Plan) -> dict[str, Any]:
    """A plan in DESIGN.md's `estimate --json` shape (plus `per_op` and `model_states`)."""
    states = plan.model_states
    return {
        "strategy": plan.strategy,
        "formula": plan.formula,
        "memory": {
            "per_layer_activation_bytes": plan.per_layer_activation_bytes,
            "breakdown": dict(plan.breakdown),
            "per_op": {op.name: op.saved_bytes for op in layer_ops(plan.spec)},
            "activation_bytes": plan.activation_bytes,
            "model_state_bytes": states.total,
            "model_states": {
                "weights": states.weights,
                "gradients": states.gradients,
                "optimizer": states.optimizer,
            },
            "total_bytes": plan.total_bytes,
        },
        "parameters": {"total": plan.parameters_total, "per_gpu": plan.parameters_per_gpu},
        "flops": {
            "forward": plan.flops.forward,
            "backward": plan.flops.backward,
            "recompute": plan.flops.recompute,
            "total": plan.flops.total,
        },
        "overhead": plan.overhead,
        "notes": list(plan.notes),
    }


def estimate_dict(plan: Plan, candidate: Candidate | None = None) -> dict[str, Any]:
    data = {"ckplan_version": __version__, "model": plan.spec.to_dict(), **plan_dict(plan)}
    if candidate is not None:
        data |= {
            "usable_bytes": candidate.budget_bytes,
            "fits": candidate.fits,
            "headroom_bytes": candidate.headroom_bytes,
        }
    return data


# ---- tables ------------------------------------------------------------------------------


def _gib(value: int) -> str:
    """Bytes for people: GiB for GPU-sized figures, smaller binary units below 1 GiB."""
    return format_bytes_auto(value)


def _both(value: int) -> str:
    return f"{format_bytes_auto(value)}  ({format_bytes_auto(value, binary=False)})"


MODEL_GROUPS = {
    "shape": (
        "kind",
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "ffn_hidden",
        "vocab",
        "seq",
        "micro_batch",
        "dtype_bytes",
    ),
    "architecture": (
        "norm",
        "mlp",
        "attention",
        "positions",
        "bias",
        "dropout",
        "tied_embeddings",
        "fused_swiglu",
    ),
    "parallel": ("tp", "pp", "sp", "cp", "dp", "zero", "virtual_stages", "microbatches"),
    "bytes/param": ("weight_bytes", "grad_bytes", "master_bytes", "optimizer_bytes"),
}


def model_table(spec: ModelSpec, title: str | None = None) -> Table:
    """Every resolved key, grouped; the source as the caption."""
    table = Table(
        title=title or f"Model {spec.name}",
        show_header=False,
        title_justify="left",
        caption=f"source: {spec.source}" if spec.source else None,
        caption_justify="left",
    )
    table.add_column("group", style="bold")
    table.add_column("values")
    values = spec.to_dict()
    for group, keys in MODEL_GROUPS.items():
        table.add_row(group, "  ".join(f"{key}={values[key]}" for key in keys))
    return table


def _sbh_coefficient(spec: ModelSpec, saved: int) -> str:
    """Bytes as a multiple of s·b·h, the unit of Korthikanti Table 2."""
    if spec.kind == "mlp":
        unit = spec.micro_batch * spec.hidden
    else:
        unit = spec.seq * spec.micro_batch * spec.hidden
    ratio = Fraction(saved, unit)
    return str(ratio) if ratio.denominator == 1 else f"{float(ratio):,.3f}"


def per_op_table(spec: ModelSpec) -> Table:
    unit = "b·d" if spec.kind == "mlp" else "s·b·h"
    table = Table(title="One layer, one micro-batch, one GPU, no recompute", title_justify="left")
    table.add_column("op")
    table.add_column("component")
    table.add_column("saved", justify="right")
    table.add_column(f"x {unit}", justify="right")
    table.add_column("recompute group")
    table.add_column("forward FLOPs", justify="right")
    for op in layer_ops(spec):
        table.add_row(
            op.name,
            op.component,
            _gib(op.saved_bytes),
            _sbh_coefficient(spec, op.saved_bytes),
            op.group or "",
            format_flops(op.forward_flops),
        )
    total = sum(op.saved_bytes for op in layer_ops(spec))
    table.add_row("total", "", _gib(total), _sbh_coefficient(spec, total), "", "", style="bold")
    return table


def plan_summary_table(plan: Plan) -> Table:
    spec = plan.spec
    table = Table(
        title=f"Plan: strategy {plan.strategy}, formula {plan.formula}",
        show_header=False,
        title_justify="left",
    )
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    table.add_column("note", style="dim")
    table.add_row(
        "activations, one layer",
        _gib(plan.per_layer_activation_bytes),
        "no recompute, one micro-batch",
    )
    for component, value in plan.breakdown.items():
        table.add_row(f"  {component}", _gib(value), "")
    table.add_row("activations, step peak", _both(plan.activation_bytes), _peak_note(spec))
    states = plan.model_states
    table.add_row("model states", _both(states.total), _state_note(spec))
    table.add_row("  weights", _gib(states.weights), f"{spec.weight_bytes} B/param")
    table.add_row("  gradients", _gib(states.gradients), f"{spec.grad_bytes} B/param")
    table.add_row(
        "  optimizer",
        _gib(states.optimizer),
        f"{spec.master_bytes + spec.optimizer_bytes} B/param (master + Adam)",
    )
    table.add_row(
        "total per GPU", _both(plan.total_bytes), "activations + model states", style="bold"
    )
    table.add_row(
        "parameters",
        f"{plan.parameters_total:,}",
        f"{plan.parameters_per_gpu:,} on the busiest GPU",
    )
    flops = plan.flops
    table.add_row("forward", format_flops(flops.forward), "per iteration, one GPU")
    table.add_row("backward", format_flops(flops.backward), "")
    table.add_row("recompute", format_flops(flops.recompute), "")
    table.add_row(
        "overhead", f"{plan.overhead:.2%}", "recompute / (forward + backward)", style="bold"
    )
    for note in plan.notes:
        table.add_row("note", "", note)
    return table


def _peak_note(spec: ModelSpec) -> str:
    if spec.pp > 1:
        return f"busiest pipeline stage, {spec.layers_per_stage} layers, micro-batches in flight"
    return "live at the peak of one training step"


def _state_note(spec: ModelSpec) -> str:
    per_param = spec.weight_bytes + spec.grad_bytes + spec.master_bytes + spec.optimizer_bytes
    zero = f", ZeRO-{spec.zero} over dp={spec.dp}" if spec.zero else ""
    return f"{per_param} B/param{zero}"


def estimate_view(plan: Plan, candidate: Candidate | None = None) -> Group:
    parts: list[Any] = [model_table(plan.spec), per_op_table(plan.spec), plan_summary_table(plan)]
    if candidate is not None:
        verdict = "fits" if candidate.fits else "does not fit"
        parts.append(
            Text(
                f"{verdict}: {_gib(plan.total_bytes)} of {_gib(candidate.budget_bytes)} usable "
                f"(budget less reserve), headroom {_gib(candidate.headroom_bytes)}",
                style="bold green" if candidate.fits else "bold red",
            )
        )
    return Group(*parts)


def presets_table(rows: list[tuple[str, ModelSpec, int]]) -> Table:
    table = Table(title="Presets", title_justify="left")
    for column in (
        "name",
        "params",
        "layers",
        "hidden",
        "heads/kv",
        "ffn",
        "seq",
        "vocab",
        "arch",
        "tp/pp",
    ):
        table.add_column(column, justify="left" if column in ("name", "arch") else "right")
    for name, spec, params in rows:
        arch = f"{spec.norm}, {spec.mlp}, {spec.attention}"
        table.add_row(
            name,
            f"{params / 1e9:,.2f} B" if params >= 10**9 else f"{params / 1e6:,.1f} M",
            str(spec.layers),
            str(spec.hidden),
            f"{spec.heads}/{spec.kv_heads}",
            str(spec.ffn_hidden),
            str(spec.seq),
            str(spec.vocab),
            arch,
            f"{spec.tp}/{spec.pp}",
        )
    return table


def error_text(message: str) -> Text:
    return Text(f"error: {message}", style="red")


# ---- sweep, check, schedule --------------------------------------------------------------

FRONTIER_ROWS = 30  # the table shows at most this many frontier plans (JSON has them all)


def candidate_dict(candidate: Candidate) -> dict[str, Any]:
    return {
        **plan_dict(candidate.plan),
        "fits": candidate.fits,
        "headroom_bytes": candidate.headroom_bytes,
    }


def sweep_dict(result: SweepResult, micro_batches: dict[str, int] | None = None) -> dict[str, Any]:
    data = {
        "budget_bytes": result.budget_bytes,
        "reserve_bytes": result.reserve_bytes,
        "usable_bytes": result.usable_bytes,
        "model": result.spec.to_dict(),
        "plans": [candidate_dict(c) for c in result.candidates],
        "pareto": [candidate_dict(c) for c in result.pareto],
        "best": candidate_dict(result.best) if result.best else None,
        "smallest_total_bytes": result.smallest.plan.total_bytes,
        "min_memory_segment": result.min_memory_segment,
        "notes": list(result.notes),
    }
    if micro_batches is not None:
        data["max_micro_batch"] = micro_batches
    return data


def budget_line(budget_text: str, budget: int, reserve: int) -> Text:
    unit = size_unit(budget_text)
    given = budget_text if unit == "B" else format_bytes(budget, unit)
    return Text(
        f"Budget {given} = {_gib(budget)} per GPU; reserve {_gib(reserve)} "
        f"(CUDA context, workspaces, allocator slack); usable {_gib(budget - reserve)}."
    )


def _fits_mark(candidate: Candidate) -> Text:
    return Text("yes", style="green") if candidate.fits else Text("no", style="red")


def candidates_table(rows: Sequence[Candidate], title: str, best: Candidate | None) -> Table:
    table = Table(title=title, title_justify="left")
    for column in (
        "strategy",
        "activations",
        "model states",
        "total",
        "headroom",
        "recompute",
        "overhead",
        "fits",
    ):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for candidate in rows:
        plan = candidate.plan
        is_best = best is not None and candidate.plan.strategy == best.plan.strategy
        table.add_row(
            ("* " if is_best else "") + plan.strategy,
            _gib(plan.activation_bytes),
            _gib(plan.model_states.total),
            _gib(plan.total_bytes),
            _gib(candidate.headroom_bytes),
            format_flops(plan.flops.recompute),
            f"{plan.overhead:.2%}",
            _fits_mark(candidate),
            style="bold" if is_best else None,
        )
    return table


def _thin(rows: Sequence[Candidate], limit: int) -> list[Candidate]:
    """At most `limit` rows spread evenly over the frontier, its two ends always kept."""
    if len(rows) <= limit:
        return list(rows)
    picks = sorted({round(i * (len(rows) - 1) / (limit - 1)) for i in range(limit)})
    return [rows[i] for i in picks]


def sweep_view(
    result: SweepResult, budget_text: str, show_all: bool, micro_batches: dict[str, int] | None
) -> Group:
    spec = result.spec
    parts: list[Any] = [budget_line(budget_text, result.budget_bytes, result.reserve_bytes)]
    states = result.candidates[0].plan.model_states.total
    parts.append(
        Text(
            f"Model {spec.name}: {spec.layers_per_stage} layers per GPU, model states "
            f"{format_bytes(states, GIB)}; {len(result.candidates)} plans evaluated, "
            f"{sum(c.fits for c in result.candidates)} fit."
        )
    )
    if show_all:
        rows = sorted(result.candidates, key=lambda c: c.plan.total_bytes)
        parts.append(candidates_table(rows, "Every plan, by peak memory", result.best))
    else:
        shown = _thin(result.pareto, FRONTIER_ROWS)
        title = "Pareto frontier: no other plan has both less memory and less compute"
        if len(shown) < len(result.pareto):
            title += (
                f" ({len(shown)} of {len(result.pareto)} shown; --all or --json for every plan)"
            )
        parts.append(candidates_table(shown, title, result.best))
    parts.append(_verdict(result))
    parts += [Text(note, style="dim") for note in result.notes]
    if result.min_memory_segment is not None:
        sqrt_k = round(spec.layers_per_stage**0.5)
        parts.append(
            Text(
                f"Least-memory segment size: uniform:{result.min_memory_segment} (sqrt(L) would be "
                f"{sqrt_k}): a layer stores {_ratio(spec)}x its input, so rebuilding a long "
                "segment's "
                "tapes costs more than storing more segment inputs.",
                style="dim",
            )
        )
    if micro_batches:
        table = Table(title="Largest micro-batch that fits", title_justify="left")
        table.add_column("strategy")
        table.add_column("micro_batch", justify="right")
        for name, size in micro_batches.items():
            table.add_row(name, str(size) if size else Text("none fits", style="red"))
        parts.append(table)
    return Group(*parts)


def _ratio(spec: ModelSpec) -> str:
    from ckplan.memory import activation_bytes_per_layer, layer_input_bytes

    return f"{activation_bytes_per_layer(spec) / layer_input_bytes(spec):.1f}"


def _verdict(result: SweepResult) -> Text:
    best = result.best
    if best is not None:
        plan = best.plan
        return Text(
            f"Best plan that fits: {plan.strategy} — total {format_bytes(plan.total_bytes, GIB)}, "
            f"headroom {_gib(best.headroom_bytes)}, recompute overhead {plan.overhead:.2%}.",
            style="bold green",
        )
    smallest = result.smallest
    text = (
        f"Nothing fits: the smallest any plan reaches is {_gib(smallest.plan.total_bytes)} "
        f"({smallest.plan.strategy}), {_gib(-smallest.headroom_bytes)} over the usable budget."
    )
    states = smallest.plan.model_states.total
    if states > result.usable_bytes:
        needed = -(-states // max(1, result.usable_bytes))
        text += (
            f" Model states alone need {_gib(states)}: shard them over at least {needed} GPUs "
            "(e.g. --set tp=8 --set pp=N, or --set zero=3 --set dp=N)."
        )
    return Text(text, style="bold red")


def check_dict(budget: int, rows: list[tuple[str, Candidate | None]]) -> dict[str, Any]:
    return {
        "budget_bytes": budget,
        "results": [
            {"model": model, "fits": bool(c and c.fits), "plan": candidate_dict(c) if c else None}
            for model, c in rows
        ],
    }


def check_table(
    budget_text: str, budget: int, reserve: int, rows: list[tuple[str, Candidate | None]]
) -> Group:
    table = Table(title="Capacity check", title_justify="left")
    for column in ("model", "fits", "plan", "total", "headroom", "overhead", "why not"):
        table.add_column(
            column, justify="left" if column in ("model", "plan", "why not") else "right"
        )
    for model, candidate in rows:
        if candidate is None:
            table.add_row(model, Text("no", style="red"), "no schedule fits", "", "", "", "")
            continue
        plan = candidate.plan
        table.add_row(
            model,
            _fits_mark(candidate),
            plan.strategy if candidate.fits else f"(smallest: {plan.strategy})",
            _gib(plan.total_bytes),
            _gib(candidate.headroom_bytes),
            f"{plan.overhead:.2%}",
            "" if candidate.fits else _why_not(candidate),
        )
    fitting = sum(1 for _, c in rows if c and c.fits)
    summary = Text(
        f"{fitting} of {len(rows)} fit.", style="bold green" if fitting == len(rows) else "bold red"
    )
    return Group(budget_line(budget_text, budget, reserve), table, summary)


def _why_not(candidate: Candidate) -> str:
    states = candidate.plan.model_states.total
    if states > candidate.budget_bytes:
        return f"model states alone {format_bytes(states, GIB)}"
    return (
        f"least activations {format_bytes(candidate.plan.activation_bytes, GIB)} on top of states"
    )


STEP_LABELS = {
    "forward_drop": "forward, save nothing",
    "forward_keep_input": "forward, keep input",
    "forward_keep_all": "forward, keep all",
    "backward": "backward",
}


def schedule_rows(plan: Plan) -> list[tuple[str, str, int]]:
    """Consecutive steps of one kind over consecutive stages, merged: (label, stages, count)."""
    rows: list[tuple[str, list[int]]] = []
    for step in plan.steps:
        if rows and rows[-1][0] == step.kind and abs(rows[-1][1][-1] - step.stage) == 1:
            rows[-1][1].append(step.stage)
        else:
            rows.append((step.kind, [step.stage]))
    names = plan.stage_names
    result = []
    for kind, stages in rows:
        first, last = names[stages[0]], names[stages[-1]]
        span = first if len(stages) == 1 else f"{first} .. {last}"
        result.append((STEP_LABELS[kind], span, len(stages)))
    return result


def schedule_dict(plan: Plan, activation_budget: int | None) -> dict[str, Any]:
    return {
        **plan_dict(plan),
        "activation_budget_bytes": activation_budget,
        "stages": list(plan.stage_names),
        "steps": [
            {"kind": step.kind, "stage": step.stage, "name": plan.stage_names[step.stage]}
            for step in plan.steps
        ],
    }


def schedule_view(plan: Plan, activation_budget: int | None) -> Group:
    table = Table(
        title=f"Schedule: {plan.strategy} ({len(plan.steps)} steps)", title_justify="left"
    )
    table.add_column("#", justify="right")
    table.add_column("step")
    table.add_column("stages")
    table.add_column("count", justify="right")
    for index, (label, span, count) in enumerate(schedule_rows(plan), 1):
        table.add_row(str(index), label, span, str(count))
    forwards = sum(1 for step in plan.steps if step.kind != "backward")
    budget = (
        f" of {format_bytes(activation_budget, GIB)} available"
        if activation_budget is not None
        else ""
    )
    summary = Text(
        f"Peak activations {_gib(plan.activation_bytes)}{budget}; {forwards} stage forwards "
        f"for {len(plan.stage_names)} stages; recompute {format_flops(plan.flops.recompute)} "
        "per iteration, "
        f"overhead {plan.overhead:.2%}.",
        style="bold",
    )
    return Group(table, summary)


# ---- verify ------------------------------------------------------------------------------
# `report` is a ckplan.verify.VerifyReport (not imported: verify.py imports NumPy).


def verify_run_dict(report: Any, run: Any) -> dict[str, Any]:
    """One run in DESIGN.md's `verify --json` shape, plus per-layer counts and the overhead."""
    overhead = report.overhead(run)
    return {
        "strategy": run.strategy,
        "gradients_identical": run.gradients_identical,
        "max_abs_grad_diff": run.max_abs_grad_diff,
        "predicted": {
            "peak_bytes": run.predicted.peak_bytes,
            "layer_forwards": sum(run.predicted.layer_forwards),
            "flops": run.predicted.flops,
        },
        "measured": {
            "peak_bytes": run.measured.peak_bytes,
            "layer_forwards": sum(run.measured.layer_forwards),
            "flops": run.measured.flops,
            "seconds": run.measured.seconds,
        },
        "ok": run.ok,
        "peak_error": run.peak_error,
        "layer_forwards_per_layer": {
            "predicted": list(run.predicted.layer_forwards),
            "measured": list(run.measured.layer_forwards),
        },
        "all_seconds": list(run.measured.all_seconds),
        "time_overhead": None
        if overhead is None
        else {"predicted": overhead[0], "measured": overhead[1]},
    }


def verify_dict(report: Any) -> dict[str, Any]:
    """`ckplan verify --json`: {"runs": [...]} (DESIGN.md) with the setup beside it."""
    return {
        "ckplan_version": __version__,
        "model": report.spec.to_dict(),
        "ok": report.ok,
        "tolerance": {
            "peak_relative": report.tolerance,
            "layer_forwards": "exact",
            "flops": "exact",
            "gradients": "bit-identical to the seed's plain step",
        },
        "parameter_bytes": report.parameter_bytes,
        "gradient_bytes": report.gradient_bytes,
        "optimal_budget_bytes": report.budget_bytes,
        "repeats": report.repeats,
        "seed": report.seed,
        "runs": [verify_run_dict(report, run) for run in report.runs],
    }


def _mark(ok: bool) -> Text:
    return Text("yes", style="green") if ok else Text("NO", style="bold red")


def _forwards(counts: Sequence[int]) -> str:
    total = sum(counts)
    return f"{total} (+{total - len(counts)})"


def _only_headers_over(run: Any) -> bool:
    """The run failed on peak memory alone, by a few KiB of Python objects on top."""
    excess = run.measured.peak_bytes - run.predicted.peak_bytes
    return run.gradients_identical and run.counts_ok and run.flops_ok and 0 < excess < 16384


def verify_view(report: Any) -> Group:
    spec = report.spec
    title = (
        f"Verify: the seed's NumPy MLP, L={spec.layers} d={spec.hidden} f={spec.ffn_hidden} "
        f"b={spec.micro_batch}, float64"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("strategy")
    table.add_column("peak pred\n(MiB)", justify="right")
    table.add_column("peak meas\n(MiB)", justify="right")
    table.add_column("peak\nerror", justify="right")
    table.add_column("layer forwards\npred / meas", justify="right")
    table.add_column("GFLOP\npred / meas", justify="right")
    table.add_column("time\n(s)", justify="right")
    table.add_column("overhead vs none\npred / meas", justify="right")
    table.add_column("gradients")
    table.add_column("ok", justify="center")
    mib = 2**20
    for run in report.runs:
        overhead = report.overhead(run)
        grads = (
            Text("identical", style="green")
            if run.gradients_identical
            else Text(f"diff {run.max_abs_grad_diff:.2g}", style="bold red")
        )
        forwards = f"{_forwards(run.predicted.layer_forwards)} / {sum(run.measured.layer_forwards)}"
        flops = f"{run.predicted.flops / 1e9:,.2f} / {run.measured.flops / 1e9:,.2f}"
        table.add_row(
            run.strategy,
            f"{run.predicted.peak_bytes / mib:,.3f}",
            f"{run.measured.peak_bytes / mib:,.3f}",
            Text(f"{run.peak_error:+.2%}", style=None if run.peak_ok else "bold red"),
            Text(forwards, style=None if run.counts_ok else "bold red"),
            Text(flops, style=None if run.flops_ok else "bold red"),
            f"{run.measured.seconds:.3f}",
            "" if overhead is None else f"{overhead[0]:+.1%} / {overhead[1]:+.1%}",
            grads,
            _mark(run.ok),
        )
    budget = (
        f"; optimal solved for an activation budget of {format_bytes(report.budget_bytes, 'MiB')}"
        if report.budget_bytes is not None
        else ""
    )
    notes = Text(
        "MiB = 2^20 bytes. Peak: activations and activation gradients of one step (tracemalloc), "
        f"parameters ({format_bytes(report.parameter_bytes, 'MiB')}) and their preallocated "
        f"gradients ({format_bytes(report.gradient_bytes, 'MiB')}) excluded{budget}.\n"
        "Layer forwards: total (+ recomputed). FLOPs: matmuls, 2·m·n·k. Time: median of "
        f"{report.repeats} runs; overhead against none, predicted = FLOP ratio, measured = time "
        "ratio (reported, not checked).\n"
        f"Tolerances: peak within ±{report.tolerance:.0%} of predicted; layer forwards per layer "
        "and FLOPs exact; gradients bit-identical to the seed's plain step "
        "(model_forward + model_backward).",
        style="dim",
    )
    failed = [run.strategy for run in report.runs if not run.ok]
    if failed:
        verdict = Text(f"MISMATCH: {', '.join(failed)} outside tolerance.", style="bold red")
        if all(_only_headers_over(run) for run in report.runs if not run.ok):
            verdict.append(
                " Each measured peak is over by less than 16 KiB: Python's object headers, "
                "which matter only for tiny arrays (try a larger --hidden or --batch).",
                style="red",
            )
    else:
        verdict = Text(
            f"Verified: all {len(report.runs)} runs match the planner within tolerance.",
            style="bold green",
        )
    return Group(table, notes, verdict)
