"""The `plan` view: the fastest layouts of N GPUs, each with its plan, per-GPU memory (and
which pipeline stage peaks), step time and MFU; the best rejected layouts and why."""

from __future__ import annotations

import shlex
from itertools import groupby
from typing import TYPE_CHECKING, Any

from ckplan import __version__
from ckplan.model.layers import stage_layer_indices
from ckplan.plan.evaluate import stage_label
from ckplan.plan.layout.search import Evaluated, LayoutResult, Rejected
from ckplan.plan.layout.space import Layout
from ckplan.plan.search import DEFAULT_RESERVE
from ckplan.published.accuracy import accuracy_note
from ckplan.render.common import gib, memory_bar
from ckplan.render.export_target import export_dict, export_target
from ckplan.render.fit import declare
from ckplan.render.rows import Column, RowTable
from ckplan.render.sweep import budget_line, candidate_dict, reference_text
from ckplan.render.time import seconds

if TYPE_CHECKING:  # Rich is imported where a table is built: --json needs none
    from rich.console import Group
    from rich.text import Text

REASONS = {
    "model_states": "model states over memory",
    "memory": "over memory",
    "slower": "slower",
}


# ---- text for people ---------------------------------------------------------------------


def stage_layers(spec) -> list[int]:
    """Layers on each pipeline stage (all its virtual stages)."""
    return [len(stage_layer_indices(spec, stage)) for stage in range(spec.pp)]


def split_text(spec) -> str:
    """'7, 8x14, 7': each pipeline stage's layers, runs of equal counts merged."""
    runs = [(count, len(list(run))) for count, run in groupby(stage_layers(spec))]
    return ", ".join(str(c) if n == 1 else f"{c}x{n}" for c, n in runs)


def layout_text(layout: Layout, spec=None) -> str:
    """'tp 4 sp · pp 2 (v 5) · cp 2 · dp 4 · ZeRO 2 · mb 1 x 128' ('cp 2 a2a' where the
    context-parallel exchange is not the ring, 'cp 16 a2a 8+p2p 2' with a2a+p2p's groups)."""
    tp = f"tp {layout.tp}" + (" sp" if layout.sp else "")
    pp = f"pp {layout.pp}"
    if layout.virtual_stages > 1:
        pp += f" v{layout.virtual_stages}"
    if not layout.split.even:
        pp += f" [{split_text(spec) if spec is not None else _split_label(layout)}]"
    cp = f"cp {layout.cp}"
    if layout.cp > 1 and layout.cp_attention == "a2a+p2p" and layout.cp_a2a_size:
        a2a = layout.cp_a2a_size
        cp += f" a2a {a2a}+p2p {layout.cp // a2a}"  # the two levels' sizes
    elif layout.cp > 1 and layout.cp_attention not in (None, "ring"):
        cp += f" {layout.cp_attention}"  # the exchange, where not the ring
    parts = [tp, pp, cp, f"dp {layout.dp}"]
    if spec is not None and spec.experts:
        parts.append(f"ep {layout.ep} etp {layout.etp}")
    parts += [f"ZeRO {layout.zero}", f"mb {layout.micro_batch}x{layout.microbatches}"]
    return " · ".join(parts)


def _split_label(layout: Layout) -> str:
    split = layout.split
    if split.first is not None or split.last is not None:
        return f"first {split.first}, last {split.last}"
    return " + ".join(["layers"] + ["embedding"] * split.embedding + ["loss"] * split.loss)


def set_arguments(layout: Layout, experts: bool) -> list[str]:
    """The `--set KEY=VALUE` arguments that give a model this layout (`ckplan estimate`)."""
    return [f"{key}={_yaml(value)}" for key, value in layout.keys(experts).items()]


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def why(rejected: Rejected, best: Evaluated | None) -> str:
    """A short reason: over memory by how much (and where), or slower than the fastest by how
    much and what the time goes to (bubble, exposed communication, recomputation)."""
    if rejected.reason == "model_states":
        bound = rejected.memory_bound
        return (
            f"model states {gib(bound.states)} alone on {_stage(rejected.layout, bound.stage)}, "
            f"{gib(rejected.over_bytes)} over"
        )
    if rejected.reason == "memory":
        e = rejected.evaluated
        if e is not None:
            plan = e.plan
            ran = "no schedule fits (the DP ran); least plan"
            if e.reference_beside is not None:  # the DP's schedule nests: no export writes it
                ran = (
                    f"no schedule a {plan.spec.framework} export writes fits (the DP ran); "
                    "least plan"
                )
            least = ran if e.optimal else "least plan"
            return (
                f"{least} {plan.strategy} {gib(plan.total_bytes)} on "
                f"{stage_label(plan.spec, plan.peak_stage)}, {gib(rejected.over_bytes)} over"
            )
        bound = rejected.memory_bound
        return (
            f"needs at least {gib(bound.bytes)} on {_stage(rejected.layout, bound.stage)} "
            f"(states {gib(bound.states)}), {gib(rejected.over_bytes)} over"
        )
    return _slower(rejected, best)


def _stage(layout: Layout, stage: int) -> str:
    if layout.pp == 1:
        return "each GPU"
    return {0: "the first stage", layout.pp - 1: "the last stage"}.get(stage, f"stage {stage}")


def _parts(step: float, bubble: float, communication: float, recompute: float) -> dict:
    """The step's bubble, exposed communication, recomputation and the rest (compute and the
    optimizer)."""
    rest = step - bubble - communication - recompute
    return {
        "bubble": bubble,
        "communication": communication,
        "recomputation": recompute,
        "compute": rest,
    }


def _time_parts(item) -> tuple[float, dict[str, float]]:
    """(step seconds, its bubble, exposed communication and recomputation) of an evaluated
    layout, else of its bound."""
    e = item.evaluated if isinstance(item, Rejected) else item
    if e is not None and e.fits and e.candidate.time is not None:
        t = e.candidate.time
        return t.step_seconds, _parts(
            t.step_seconds, t.bubble_seconds, t.communication_seconds, t.recompute_seconds
        )
    bound = item.time_bound
    return bound.seconds, _parts(bound.seconds, bound.bubble, bound.communication, 0.0)


def _slower(rejected: Rejected, best: Evaluated | None) -> str:
    step, parts = _time_parts(rejected)
    if best is None:
        return f"step {seconds(step)}"
    best_step, best_parts = _time_parts(best)
    text = f"{step / best_step - 1:+.1%} step"
    grown = {name: parts[name] - best_parts[name] for name in parts}
    name = max(grown, key=grown.get)
    if grown[name] > 0:
        label = {
            "bubble": "pipeline bubble",
            "communication": "communication-bound: exposed communication",
            "recomputation": "recomputation",
            "compute": "compute and optimizer",
        }[name]
        then = seconds(best_parts[name]) if best_parts[name] > 0 else "none"
        text += f": {label} {seconds(parts[name])} ({then} in the fastest)"
    return text


# ---- views -------------------------------------------------------------------------------


def _exchange_fields(layout: Layout) -> dict[str, Any]:
    """The context-parallel exchange of a JSON layout: `cp_attention` (the ring where none is
    given) and a2a+p2p's `cp_a2a_size`, both null at cp 1."""
    if layout.cp == 1:
        return {"cp_attention": None, "cp_a2a_size": None}
    return {"cp_attention": layout.cp_attention or "ring", "cp_a2a_size": layout.cp_a2a_size}


def layout_dict(e: Evaluated) -> dict[str, Any]:
    """One layout of `plan --json`: the documented keys (docs/layouts.md), the split, the
    plan's memory (and the stage that peaks) and its `time` object."""
    layout, plan, experts = e.layout, e.plan, e.spec.experts > 0
    data: dict[str, Any] = {
        "tp": layout.tp,
        "pp": layout.pp,
        "cp": layout.cp,
        **_exchange_fields(layout),
        "dp": layout.dp,
        "ep": layout.ep,
        "etp": layout.etp if experts else None,
        "zero": layout.zero,
        "sp": layout.sp,
        "virtual_stages": layout.virtual_stages,
        "micro_batch": layout.micro_batch,
        "microbatches": layout.microbatches,
        **_split_dict(layout),
        "stage_layers": stage_layers(e.spec),
        "strategy": plan.strategy,
        "fits": e.fits,
        "memory": {
            "total_bytes": plan.total_bytes,
            "reserved_bytes": plan.reserved_bytes,
            "budgeted_bytes": plan.budgeted_bytes,
            "activation_bytes": plan.activation_bytes,
            "model_state_bytes": plan.model_states.total,
            "headroom_bytes": e.candidate.headroom_bytes,
            "peak_stage": plan.peak_stage,
        },
        "time": None if e.candidate.time is None else e.candidate.time.to_dict(),
        "set": set_arguments(layout, experts),
        "offload": _offload_dict(e),
        # a plan no export writes that does better on this layout (`search.choose`), or null
        "reference": candidate_dict(e.reference_beside) if e.reference_beside else None,
    }
    return data


def _offload_dict(e: Evaluated) -> dict[str, Any] | None:
    """The layout's best offload plan beside its best recomputation plan (docs/layouts.md)."""
    offload = e.candidate if e.plan.stage_offloads else e.offload
    if offload is None:
        return None
    recompute = e.recompute
    return {
        "strategy": offload.plan.strategy,
        "step_seconds": offload.time.step_seconds,
        "exposed_seconds": offload.time.offload_exposed_seconds,
        "host_bytes": offload.plan.host_bytes,
        "bytes_moved": offload.plan.bytes_moved,
        "recompute_strategy": None if recompute is None else recompute.plan.strategy,
        "recompute_step_seconds": None if recompute is None else recompute.time.step_seconds,
    }


def _split_dict(layout: Layout) -> dict[str, Any]:
    split = layout.split
    return {
        "first_stage_layers": split.first,
        "last_stage_layers": split.last,
        "account_for_embedding_in_pipeline_split": split.embedding,
        "account_for_loss_in_pipeline_split": split.loss,
    }


def rejected_dict(r: Rejected, best: Evaluated | None) -> dict[str, Any]:
    layout = r.layout
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "cp": layout.cp,
        **_exchange_fields(layout),
        "dp": layout.dp,
        "ep": layout.ep,
        "zero": layout.zero,
        "sp": layout.sp,
        "virtual_stages": layout.virtual_stages,
        "micro_batch": layout.micro_batch,
        "microbatches": layout.microbatches,
        **_split_dict(layout),
        "reason": r.reason,
        "why": why(r, best),
        "over_bytes": r.over_bytes,
        "step_seconds": r.seconds,
        "evaluated": r.evaluated is not None,
        # a plan no export writes that does better on the layout (docs/layouts.md), or null
        "reference": candidate_dict(reference) if (reference := _reference_of(r)) else None,
    }


def _reference_of(r: Rejected):
    """A rejected layout's reference (`Evaluated.reference_beside`) where it was evaluated."""
    return None if r.evaluated is None else r.evaluated.reference_beside


def plan_dict(result: LayoutResult) -> dict[str, Any]:
    """`ckplan plan --json` (docs/layouts.md)."""
    best = result.layouts[0] if result.layouts else None
    least = result.least_memory
    return {
        "ckplan_version": __version__,
        "model": result.spec.name,
        "gpus": result.gpus,
        "gpu": result.gpu.name,
        "global_batch": result.global_batch,
        "seq": result.spec.seq,
        "budget_bytes": result.budget_bytes,
        "reserve_bytes": result.reserve_bytes,
        "usable_bytes": result.usable_bytes,
        "layouts": [layout_dict(e) for e in result.layouts],
        "rejected": {
            "counts": dict(result.counts),
            "layouts": [rejected_dict(r, best) for r in result.rejected],
            "nearest": None if least is None else rejected_dict(least, None),
        },
        "advice": list(result.advice),
        "without_offload": (
            None if result.without_offload is None else layout_dict(result.without_offload)
        ),
        "export": None if best is None else export_dict(best.plan),
    }


def plan_view(
    result: LayoutResult, budget_text: str, model: str | None = None, extra: str = ""
) -> Group:
    """The ranked layouts, the best rejected and a verdict; `extra`: the command line's model
    options that the check command repeats."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [budget_line(budget_text, result.budget_bytes, result.reserve_bytes)]
    title = (
        f"{result.spec.name} on {result.gpus:,} x {result.gpu.name}, global batch "
        f"{result.global_batch:,} x seq {result.spec.seq:,}: the fastest layouts"
    )
    table = declare(Table(title=title, title_justify="left"), "peaks on", "#", "MFU")
    left = ("layout", "plan", "per-GPU memory")  # the memory cell, a figure and a bar, may wrap
    for column in ("#", "layout", "plan", "per-GPU memory", "peaks on", "step", "MFU"):
        table.add_column(column, justify="left" if column in left else "right")
    for rank, e in enumerate(result.layouts, 1):
        plan, time = e.plan, e.candidate.time
        table.add_row(
            str(rank),
            Text(layout_text(e.layout, e.spec)),
            Text(plan.strategy),
            Text.assemble(
                f"{gib(plan.total_bytes)} ", memory_bar(plan.total_bytes, e.candidate.budget_bytes)
            ),
            _stage(e.layout, plan.peak_stage),
            seconds(time.step_seconds) if time else "",
            f"{time.mfu:.1%}" if time else "",
        )
    if result.layouts:
        parts.append(table)
    parts += [Text(line, style="yellow") for line in reference_lines(result.layouts)]
    best = result.layouts[0] if result.layouts else None
    if result.rejected:
        rejected = Table(title="The best rejected layouts", title_justify="left")
        for column in ("layout", "rejected", "why"):
            rejected.add_column(column)
        for r in result.rejected:
            rejected.add_row(Text(layout_text(r.layout)), REASONS[r.reason], Text(why(r, best)))
        parts.append(rejected)
    parts.append(_counts_line(result))
    parts += _verdict(result, best, budget_text, model or result.spec.name, extra)
    parts += [Text(f"Advice: {line}", style="yellow") for line in result.advice]
    return Group(*parts)


def reference_lines(layouts: tuple[Evaluated, ...] | list[Evaluated]) -> list[str]:
    """One line per layout shown whose plan, one an export writes, a plan no export writes
    does better than (`Evaluated.reference_beside`): `render.sweep.reference_text`."""
    return [
        f"#{rank} {layout_text(e.layout, e.spec)}: {reference_text(e.candidate, reference)}"
        for rank, e in enumerate(layouts, 1)
        if (reference := e.reference_beside) is not None
    ]


def _counts_line(result: LayoutResult) -> Text:
    from rich.text import Text

    c = result.counts
    return Text(
        f"{c.get('layouts', 0):,} layouts: {c.get('model_states', 0):,} over memory by their "
        f"model states, {c.get('memory', 0):,} by a lower bound on activations, "
        f"{c.get('pruned', 0):,} slower by a lower bound on time; {c.get('evaluated', 0):,} "
        f"evaluated ({c.get('optimal', 0):,} optimal-schedule DPs).",
        style="dim",
    )


def offload_line(e: Evaluated, gpu) -> str | None:
    """How the layout's best offload plan compares with its best recomputation plan; None
    where no offload plan fits or nothing to compare it with."""
    from ckplan.render.estimate import offload_comparison

    offload = e.candidate if e.plan.stage_offloads else e.offload
    if offload is None or e.recompute is None:
        return None
    return offload_comparison(offload, e.recompute, gpu, "on this layout")


def _verdict(
    result: LayoutResult, best: Evaluated | None, budget_text: str, model: str, extra: str
) -> list[Text]:
    from rich.text import Text

    if best is None:
        lines = [Text(no_fit_line(result), style="bold red")]
        least = result.least_memory
        if least is not None and (reference := _reference_of(least)) is not None:
            text = reference_text(least.evaluated.candidate, reference)
            lines.append(Text(f"nearest {layout_text(least.layout)}: {text}", style="yellow"))
        return lines
    time = best.candidate.time
    timing = f", step {seconds(time.step_seconds)}, MFU {time.mfu:.1%}" if time else ""
    offload = offload_line(best, result.gpu)
    without = result.without_offload
    if without is not None:
        gap = without.seconds - best.seconds
        offload = (offload + "; " if offload else "") + (
            f"without offloading the fastest is {layout_text(without.layout, without.spec)} "
            f"with {without.plan.strategy}, {seconds(without.seconds)}, {seconds(gap)} "
            f"({gap / without.seconds:.1%}) slower"
        )
    return [
        Text(
            f"Fastest: {layout_text(best.layout, best.spec)} with {best.plan.strategy}{timing}.",
            style="bold green",
        ),
        *([Text(f"Offload: {offload}.")] if offload else []),
        *([Text(f"Export: {target}.")] if (target := export_target(best.plan)) else []),
        Text(f"Accuracy: {accuracy_note(result.gpu.name, best.spec.framework)}."),
        Text(
            "Check it: " + check_command(result, best, budget_text, model, extra),
            no_wrap=True,
            overflow="ignore",
        ),
    ]


def check_command(
    result: LayoutResult, e: Evaluated, budget_text: str, model: str, extra: str = ""
) -> str:
    """The `ckplan estimate` command that evaluates layout `e` again."""
    arguments = set_arguments(e.layout, e.spec.experts > 0)
    if result.spec.pipeline_layout is not None:  # the model's own layout, which the search drops
        arguments = [*arguments, "pipeline_layout=null"]
    sets = " ".join(f"--set {arg}" for arg in arguments)
    reserve = (
        "" if result.reserve_bytes == DEFAULT_RESERVE else f" --reserve {result.reserve_bytes}"
    )
    # the GPU's own memory is the budget --gpu sets: no --budget to repeat
    budget = "" if result.budget_bytes == result.gpu.memory_bytes else f" --budget {budget_text}"
    return (
        f"ckplan estimate {shlex.quote(model)} --gpu {result.gpu.name}{budget}"
        f"{reserve} --seq {result.spec.seq}{extra} --strategy {e.plan.strategy} {sets}"
    )


def no_fit_line(result: LayoutResult) -> str:
    """No layout fits: the nearest one and by how much it is over."""
    gpus = f"{result.gpus:,} GPU" + ("s" if result.gpus > 1 else "")
    text = f"no layout of {gpus} fits the {gib(result.usable_bytes)} usable per GPU"
    least = result.least_memory
    if least is not None:
        text += f"; nearest: {layout_text(least.layout)}, {why(least, None)}"
    if result.advice:
        text += f"; try {result.advice[0]}"
    return text


def plan_rows(result: LayoutResult) -> RowTable:
    """The ranked layouts as CSV/Markdown rows."""

    def column(key, title, get, text=None, right=True):
        return Column(key, title, get, None if text is None else (lambda e: text(get(e))), right)

    def time_of(e):
        return e.candidate.time

    columns = [
        column("rank", "#", lambda e: result.layouts.index(e) + 1),
        *(
            column(key, key, lambda e, key=key: getattr(e.layout, key))
            for key in ("tp", "sp", "pp", "virtual_stages", "cp", "dp", "ep", "zero")
        ),
        column("micro_batch", "mb", lambda e: e.layout.micro_batch),
        column("microbatches", "microbatches", lambda e: e.layout.microbatches),
        column("stage_layers", "stage layers", lambda e: split_text(e.spec), right=False),
        column("strategy", "plan", lambda e: e.plan.strategy, right=False),
        column("total_bytes", "per-GPU memory", lambda e: e.plan.total_bytes, gib),
        column("peak_stage", "peaks on", lambda e: e.plan.peak_stage),
        column("step_seconds", "step", lambda e: time_of(e).step_seconds, seconds),
        column("mfu", "MFU", lambda e: time_of(e).mfu, lambda v: f"{v:.1%}"),
        column(
            "tokens_per_second_per_gpu",
            "tokens/s/GPU",
            lambda e: time_of(e).tokens_per_second_per_gpu,
            lambda v: f"{v:,.0f}",
        ),
    ]
    best = result.layouts[0] if result.layouts else None
    notes = [
        f"rejected ({REASONS[r.reason]}): {layout_text(r.layout)}: {why(r, best)}"
        for r in result.rejected
    ]
    notes += reference_lines(result.layouts)
    title = f"{result.spec.name} on {result.gpus} x {result.gpu.name}: the fastest layouts"
    return RowTable(columns, list(result.layouts), title, notes)
