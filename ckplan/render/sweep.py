"""The sweep, check and schedule views."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckplan.model.expert_layout import expert_layout
from ckplan.model.op_policy import NO_EXPORT
from ckplan.model.spec import ModelSpec
from ckplan.plan import Plan
from ckplan.plan.search import SEQ_GRANULE, Candidate, SweepResult, choose, cost_key
from ckplan.render.common import GIB, gib, memory_bar
from ckplan.render.estimate import (
    expert_layout_line,
    offload_comparison,
    offload_text,
    plan_dict,
)
from ckplan.render.export_target import export_dict
from ckplan.render.fit import declare
from ckplan.render.time import seconds

if TYPE_CHECKING:  # Rich is imported where a table is built: --json needs none
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from ckplan.hardware.step_time import StepTime
from ckplan.units import format_bytes, format_flops, size_unit

# ---- sweep, check, schedule --------------------------------------------------------------

FRONTIER_ROWS = 30  # the table shows at most this many frontier plans (JSON has them all)
SCHEDULE_ROWS = 400  # and at most this many schedule rows, half from each end


def candidate_dict(candidate: Candidate) -> dict[str, Any]:
    """A candidate as JSON: its plan, whether it fits, and among its notes the one that says no
    export of its framework writes it (`Candidate.unwritten`) where its plan's own do not."""
    data = plan_dict(candidate.plan, candidate.time)
    data["notes"] += [note for note in candidate.unwritten if note not in data["notes"]]
    return {
        **data,
        "fits": candidate.fits,
        "headroom_bytes": candidate.headroom_bytes,
    } | (
        {"host_budget_bytes": candidate.host_budget_bytes}
        if (candidate.plan.stage_offloads or candidate.plan.model_states.host)
        and candidate.host_budget_bytes is not None
        else {}
    )


def sweep_dict(
    result: SweepResult,
    micro_batches: dict[str, int] | None = None,
    seqs: dict[str, int] | None = None,
    reach: tuple[str, int, Candidate | None] | None = None,
) -> dict[str, Any]:
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
        "rank": result.rank,
        "gpu": None if result.gpu is None else result.gpu.name,
        "export": export_dict(result.best.plan) if result.best else None,
        "reference": candidate_dict(result.reference) if result.reference else None,
    }
    if micro_batches is not None:
        data["max_micro_batch"] = micro_batches
    if seqs is not None:
        data["max_seq"] = seqs
    if reach is not None:
        key, value, best = reach
        data[f"best_at_max_{key}"] = {key: value, "best": candidate_dict(best) if best else None}
    if result.best is None:
        data["advice"] = sweep_advice(result)
    return data


def budget_line(budget_text: str, budget: int, reserve: int) -> Text:
    from rich.text import Text

    unit = size_unit(budget_text)
    # plain bytes (a GPU's CUDA-reported memory) read as decimal GB, as datasheets print them
    given = f"{budget / 10**9:,.2f} GB" if unit == "B" else format_bytes(budget, unit)
    return Text(
        f"Budget {given} = {gib(budget)} per GPU; reserve {gib(reserve)} "
        f"(CUDA context, workspaces, allocator slack); usable {gib(budget - reserve)}."
    )


def _fits_mark(candidate: Candidate) -> Text:
    from rich.text import Text

    return Text("yes", style="green") if candidate.fits else Text("no", style="red")


def candidates_table(rows: Sequence[Candidate], title: str, best: Candidate | None) -> Table:
    from rich.table import Table

    timed = any(candidate.time is not None for candidate in rows)
    table = Table(title=title, title_justify="left")
    columns = ["strategy", "activations", "model states", "total", "headroom", "recompute"]
    columns += ["overhead"] if not timed else ["FLOP ovh", "step", "time ovh", "MFU"]
    for column in (*columns, "fits", "of usable budget"):
        table.add_column(
            column, justify="left" if column in ("strategy", "of usable budget") else "right"
        )
    for candidate in rows:
        plan = candidate.plan
        is_best = best is not None and candidate.plan.strategy == best.plan.strategy
        cells = [
            ("* " if is_best else "") + plan.strategy,
            gib(plan.activation_bytes),
            gib(plan.model_states.total),
            gib(plan.total_bytes),
            gib(candidate.headroom_bytes),
            format_flops(plan.flops.recompute),
            f"{plan.overhead:.2%}",
        ]
        if timed:
            cells += _time_cells(candidate.time)
        table.add_row(
            *cells,
            _fits_mark(candidate),
            memory_bar(plan.total_bytes, candidate.budget_bytes),
            style="bold" if is_best else None,
        )
    return declare(
        table, "of usable budget", "headroom", "recompute", "model states", "activations",
        "FLOP ovh", "time ovh", "overhead", "total",
    )  # fmt: skip


def _time_cells(time: StepTime | None) -> list[str]:
    if time is None:
        return ["", "", ""]
    return [seconds(time.step_seconds), f"{time.overhead:+.2%}", f"{time.mfu:.1%}"]


def _thin(rows: Sequence[Candidate], limit: int) -> list[Candidate]:
    """At most `limit` rows spread evenly over the frontier, its two ends always kept."""
    if len(rows) <= limit:
        return list(rows)
    picks = sorted({round(i * (len(rows) - 1) / (limit - 1)) for i in range(limit)})
    return [rows[i] for i in picks]


def sweep_view(
    result: SweepResult,
    budget_text: str,
    show_all: bool,
    micro_batches: dict[str, int] | None,
    seqs: dict[str, int] | None = None,
    reach: tuple[str, int, Candidate | None] | None = None,
) -> Group:
    from rich.console import Group
    from rich.text import Text

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
    cost = "a shorter step" if result.rank == "time" else "less compute"
    if result.gpu is not None:
        parts.append(
            Text(
                f"Step time on {result.gpu.name}; the best plan is the "
                + ("fastest" if result.rank == "time" else "cheapest in FLOPs")
                + " that fits (--rank time|flops)."
            )
        )
    layout = expert_layout(spec)
    if layout is not None:
        first = result.candidates[0].plan.model_states
        parts.append(Text(expert_layout_line(layout, first.total, first.expert_total)))
    if show_all:
        rows = sorted(result.candidates, key=lambda c: c.plan.total_bytes)
        parts.append(candidates_table(rows, "Every plan, by peak memory", result.best))
    else:
        shown = _thin(result.pareto, FRONTIER_ROWS)
        title = f"Pareto frontier: no other plan has both less memory and {cost}"
        if len(shown) < len(result.pareto):
            title += (
                f" ({len(shown)} of {len(result.pareto)} shown; --all or --json for every plan)"
            )
        parts.append(candidates_table(shown, title, result.best))
    offloads = [c for c in (result.candidates if show_all else shown) if c.plan.stage_offloads]
    for named in (result.best, result.reference):
        # a plan within the host memory, beaten only by plans beyond it; the reference beside
        # the best, which an export of another framework writes
        if named is not None and named.plan.stage_offloads and named not in offloads:
            offloads.append(named)
    if offloads:
        parts.append(Text("Offload (tapes in pinned host memory, copies beside compute):"))
        parts += [Text("  " + offload_text(c.plan, c.time, c.host_budget_bytes)) for c in offloads]
    if result.candidates and result.candidates[0].plan.model_states.host:
        parts.append(Text(host_states_text(result.best or result.smallest_written)))
    compared = _offload_against_recompute(result)
    if compared:
        parts.append(Text(f"Offload against recomputation: {compared}."))
    parts.append(sweep_verdict(result))
    if line := sweep_reference_line(result):
        parts.append(Text(line, style="yellow"))
    if result.best is not None:  # recompute the busiest stage's FLOPs do not show
        hidden = [note for note in result.best.plan.notes if " recomputes " in note]
        parts += [Text(f"({note})", style="dim") for note in hidden]
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
        parts.append(_largest_table("Largest micro-batch that fits", "micro_batch", micro_batches))
    if seqs:
        parts.append(_largest_table("Longest sequence that fits", "seq", seqs))
        parts.append(
            Text(
                f"(at micro-batch {spec.micro_batch}, in multiples of {SEQ_GRANULE} tokens; "
                "the model's own position limit is not applied)",
                style="dim",
            )
        )
    if reach is not None:
        parts.append(reach_line(*reach, framework=spec.framework))
    return Group(*parts)


def reach_line(key: str, value: int, best: Candidate | None, framework: str) -> Text:
    """The largest value a plan the framework's exports write fits (`--seq auto`,
    `--micro-batch auto`; `search.largest_fitting_any`) and the best plan there."""
    from rich.text import Text

    noun = "sequence" if key == "seq" else "micro-batch"
    written = f"a plan a {framework} export writes"
    if not value or best is None:
        return Text(f"No plan a {framework} export writes fits any {noun}.", style="red")
    timing = f", step {seconds(best.time.step_seconds)}" if best.time is not None else ""
    plan = best.plan
    return Text(
        f"{'Longest' if key == 'seq' else 'Largest'} {noun} {written} fits: {value:,}"
        f"{' tokens' if key == 'seq' else ''}, best there {plan.strategy} (total "
        f"{gib(plan.total_bytes)}, headroom {gib(best.headroom_bytes)}, recompute overhead "
        f"{plan.overhead:.2%}{timing}).",
        style="bold",
    )


def _largest_table(title: str, column: str, values: dict[str, int]) -> Table:
    """One value per strategy (`--micro-batch auto`, `--seq auto`); 0 reads "none fits"."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", min_width=len(title))
    table.add_column("strategy")
    table.add_column(column, justify="right")
    for name, value in values.items():
        table.add_row(name, f"{value:,}" if value else Text("none fits", style="red"))
    return table


def _ratio(spec: ModelSpec) -> str:
    from ckplan.model.memory import activation_bytes_per_layer, layer_input_bytes

    return f"{activation_bytes_per_layer(spec) / layer_input_bytes(spec):.1f}"


def sweep_verdict(result: SweepResult) -> Text:
    from rich.text import Text

    best = result.best
    if best is not None:
        plan = best.plan
        timing = ""
        if best.time is not None:
            timing = (
                f", step {seconds(best.time.step_seconds)} (time overhead "
                f"{best.time.overhead:+.2%}, MFU {best.time.mfu:.1%})"
            )
        return Text(
            f"Best plan that fits: {plan.strategy} — total {format_bytes(plan.total_bytes, GIB)}, "
            f"headroom {gib(best.headroom_bytes)}, recompute overhead {plan.overhead:.2%}"
            f"{timing}.",
            style="bold green",
        )
    smallest = result.smallest_written
    # with a reference beside it (`reference_text`), what is named is what an export of the
    # model's framework writes
    reference = result.reference
    written = f"plan a {result.spec.framework} export writes"  # `search.Candidate.exported`
    nothing = f"No {written} fits" if reference and reference.fits else "Nothing fits"
    least = "the smallest any plan reaches"
    if reference is not None:
        least = f"the smallest {written} reaches"
    host = smallest.host_budget_bytes
    if smallest.headroom_bytes >= 0 and host is not None and smallest.plan.model_states.host:
        return Text(
            f"{nothing}: {smallest.plan.strategy} fits the GPU, but its "
            f"{why_not_fitting(smallest)}.",
            style="bold red",
        )
    text = (
        f"{nothing}: {least} is {gib(smallest.plan.total_bytes)} "
        f"({smallest.plan.strategy}), {gib(-smallest.headroom_bytes)} over the usable budget."
    )
    states = smallest.plan.model_states.total
    if smallest.plan.step_sets_peak:
        text += (
            f" The optimizer step holds {gib(smallest.plan.optimizer_step_bytes)} whatever is "
            "recomputed, its workspace beside the states."
        )
    elif states > result.usable_bytes:
        text += f" Model states alone need {gib(states)}."
    advice = sweep_advice(result)
    if advice:
        text += " From this layout: " + "; or ".join(advice) + "."
    return Text(text, style="bold red")


def sweep_advice(result: SweepResult) -> list[str]:
    """What to raise from the model's layout so that the least plan fits (`plan.advice`);
    none for the simple formula set."""
    if result.smallest.plan.formula != "derived":
        return []
    from ckplan.plan.advice import advice_lines

    return advice_lines(result.spec, result.usable_bytes, gpu=result.gpu)


def check_dict(
    budget: int,
    rows: list[tuple[str, Candidate | None]],
    largest: tuple[str, list[int]] | None = None,
    references: Sequence[Candidate | None] | None = None,
) -> dict[str, Any]:
    """`largest`: (key, the largest value per model) for `--seq auto` / `--micro-batch auto`;
    `references`: per model, the plan no export writes that goes further (`Checked`), or None."""
    references = references or [None] * len(rows)
    results = [
        {
            "model": model,
            "fits": bool(c and c.fits),
            "plan": candidate_dict(c) if c else None,
            "advice": candidate_advice(c),
            "reference": candidate_dict(reference) if reference else None,
        }
        for (model, c), reference in zip(rows, references, strict=True)
    ]
    if largest is not None:
        key, values = largest
        for result, value in zip(results, values, strict=True):
            result[f"max_{key}"] = value
    return {"budget_bytes": budget, "results": results}


def check_table(
    budget_text: str,
    budget: int,
    reserve: int,
    rows: list[tuple[str, Candidate | None]],
    largest: tuple[str, list[int]] | None = None,
    references: Sequence[Candidate | None] | None = None,
) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    timed = any(c is not None and c.time is not None for _, c in rows)
    table = Table(title="Capacity check", title_justify="left")
    declare(table, "of usable", "overhead", "headroom", "time ovh", "step", "MFU", "total")
    label = [] if largest is None else ["max seq" if largest[0] == "seq" else "max mb"]
    columns = ["model", *label, "fits", "plan", "total", "headroom", "overhead"]
    columns += ["step", "time ovh", "MFU"] if timed else []
    for column in (*columns, "of usable", "why not"):
        table.add_column(
            column,
            justify="left" if column in ("model", "plan", "of usable", "why not") else "right",
        )
    values = [[] for _ in rows] if largest is None else [[_largest_cell(v)] for v in largest[1]]
    for (model, candidate), value in zip(rows, values, strict=True):
        if candidate is None:
            blanks = [""] * (len(columns) - 2 - len(value))
            table.add_row(model, *value, Text("no", style="red"), "no schedule fits", *blanks)
            continue
        plan = candidate.plan
        cells = [
            model,
            *value,
            _fits_mark(candidate),
            plan.strategy if candidate.fits else f"(smallest: {plan.strategy})",
            gib(plan.total_bytes),
            gib(candidate.headroom_bytes),
            f"{plan.overhead:.2%}",
        ]
        if timed:
            cells += _time_cells(candidate.time)
        table.add_row(
            *cells,
            memory_bar(plan.total_bytes, candidate.budget_bytes),
            "" if candidate.fits else why_not_fitting(candidate),
        )
    fitting = sum(1 for _, c in rows if c and c.fits)
    summary = Text(
        f"{fitting} of {len(rows)} fit.", style="bold green" if fitting == len(rows) else "bold red"
    )
    advice = [
        Text(f"{model}: from its layout, {lines[0]}", style="yellow")
        for model, candidate in rows
        if (lines := candidate_advice(candidate))
    ]
    return Group(
        budget_line(budget_text, budget, reserve),
        table,
        summary,
        *advice,
        *[Text(line, style="yellow") for line in unrunnable_lines(rows)],
        *[Text(line, style="yellow") for line in reference_lines(rows, references)],
    )


def reference_lines(
    rows: list[tuple[str, Candidate | None]], references: Sequence[Candidate | None] | None
) -> list[str]:
    """One line per model whose checked plan, one an export writes, a plan no export writes
    does better than (`Checked.reference`): `reference_text`."""
    return [
        f"{model}: {reference_text(candidate, reference)}"
        for (model, candidate), reference in zip(
            rows, references or [None] * len(rows), strict=True
        )
        if reference is not None and candidate is not None
    ]


def reference_text(chosen: Candidate, reference: Candidate) -> str:
    """How a plan no export of the job's framework writes (`search.Choice.reference`: the
    sweep's nested `revolve:C`, under Megatron-LM an optimal schedule) does better than
    `chosen`, the plan named, one such an export writes: it fits where `chosen` does not, or
    has a shorter step (fewer FLOPs; as many and less memory), or, with nothing fitting, less
    memory; then the notes that say why none writes it (`search.Candidate.unwritten`). The same
    line under `check`, `sweep` and `plan`."""
    name, total = reference.plan.strategy, gib(reference.plan.total_bytes)
    if reference.fits and not chosen.fits:
        framework = chosen.plan.spec.framework
        reach = f"{name} fits ({total}) where no plan a {framework} export writes does"
    elif reference.fits:
        old, new = chosen.time, reference.time
        if old is not None and new is not None and new.step_seconds < old.step_seconds:
            gain = f"a step of {seconds(new.step_seconds)} against {seconds(old.step_seconds)}"
        elif reference.plan.flops.total < chosen.plan.flops.total:
            gain = (
                f"{format_flops(reference.plan.flops.total)} against "
                f"{format_flops(chosen.plan.flops.total)}"
            )
        else:
            gain = f"{total} against {gib(chosen.plan.total_bytes)}"
        reach = f"{name} does better than {chosen.plan.strategy}, {gain}"
    else:
        less = gib(chosen.plan.total_bytes - reference.plan.total_bytes)
        reach = (
            f"the least memory of any plan is {name}'s {total}, {less} below {chosen.plan.strategy}"
        )
    return f"{reach}; " + "; ".join(reference.unwritten or (f"{NO_EXPORT} it",))


def sweep_reference_line(result: SweepResult) -> str | None:
    """`reference_text` for a sweep's reference beside its best (else least) plan an export
    writes, or None where it has none."""
    if result.reference is None:
        return None
    return "Reference: " + reference_text(result.best or result.smallest_written, result.reference)


def unrunnable_lines(rows: list[tuple[str, Candidate | None]]) -> list[str]:
    """One line per model whose plan no export of its framework writes (a module strategy
    outside Megatron-LM, a nested revolve:C, a fused policy beside other layers, under
    Megatron-LM an optimal schedule): the note that says why (`search.Candidate.unwritten`)."""
    return [
        f"{model}: {note}"
        for model, candidate in rows
        if candidate is not None
        for note in candidate.unwritten
    ]


def _largest_cell(value: int) -> str | Text:
    from rich.text import Text

    return f"{value:,}" if value else Text("none fits", style="red")


def candidate_advice(candidate: Candidate | None) -> list[str]:
    """What to raise from a plan's layout when it does not fit (`plan.advice`)."""
    if candidate is None or candidate.fits or candidate.plan.formula != "derived":
        return []
    from ckplan.plan.advice import advice_lines

    return advice_lines(candidate.plan.spec, candidate.budget_bytes)


def host_states_text(candidate: Candidate) -> str:
    """One line on the model states a plan keeps in host memory: bytes per GPU, the host
    memory they share with offloaded tapes, the CPU step and the copies not hidden."""
    states = candidate.plan.model_states
    host = candidate.host_budget_bytes
    text = f"Model states on the host: {gib(states.host)} per GPU" + (
        f" (of {gib(host)} host memory per GPU)" if host is not None else ""
    )
    time = candidate.time
    if time is not None:
        from ckplan.render.time import seconds

        text += (
            f"; CPU optimizer step {seconds(time.optimizer_seconds)}, state copies exposed "
            f"{seconds(time.state_copy_seconds)} ({candidate.plan.strategy})"
        )
    return text + "."


def why_not_fitting(candidate: Candidate) -> str:
    states = candidate.plan.model_states.total
    host = candidate.host_budget_bytes
    fits_device = candidate.plan.budgeted_bytes <= candidate.budget_bytes
    if fits_device and host is not None and candidate.plan.host_total_bytes > host:
        if candidate.plan.model_states.host:
            return (
                f"host memory {format_bytes(candidate.plan.host_total_bytes, GIB)} (model states "
                f"{format_bytes(candidate.plan.model_states.host, GIB)}) over the "
                f"{format_bytes(host, GIB)} per GPU"
            )
        return (
            f"offloaded tapes {format_bytes(candidate.plan.host_bytes, GIB)} over the "
            f"{format_bytes(host, GIB)} of host memory per GPU"
        )
    if candidate.plan.step_sets_peak:
        return f"the optimizer step {format_bytes(candidate.plan.optimizer_step_bytes, GIB)}"
    if states > candidate.budget_bytes:
        return f"model states alone {format_bytes(states, GIB)}"
    return (
        f"least activations {format_bytes(candidate.plan.activation_bytes, GIB)} on top of states"
    )


def _offload_against_recompute(result) -> str | None:
    """The fastest fitting offload plan against the fastest fitting plan without offloading,
    with a GPU (render.estimate.offload_comparison); None where either is missing."""
    if result.gpu is None:
        return None
    fitting = [c for c in result.candidates if c.fits and c.time is not None]

    def fastest(candidates):  # of the plans an export writes (`search.choose`)
        # ties (recomputations of equal time) broken as the sweep's best plan breaks them, so
        # that the sentence names that plan
        return choose(candidates, cost_key("time")).best if candidates else None

    moves = [c for c in fitting if any(items for _, items in c.plan.stage_offloads)]
    offload = fastest(moves)
    recompute = fastest([c for c in fitting if not c.plan.stage_offloads])
    if offload is None or recompute is None:
        return None
    return offload_comparison(offload, recompute, result.gpu, "that fits")


STEP_LABELS = {
    "forward_drop": "forward, save nothing",
    "forward_keep_input": "forward, keep input",
    "forward_keep_all": "forward, keep all",
    "backward": "backward",
    "forward_keep_all+offload": "forward, keep all, offload",
    "forward_keep_input+offload": "forward, keep input, offload",
}


def offloaded_stages(plan: Plan) -> frozenset[int]:
    """The chain stages whose tapes the plan's peak pipeline stage offloads to host."""
    return frozenset(i for i, _ in dict(plan.stage_offloads).get(plan.peak_stage, ()))


def offload_steps(plan: Plan) -> list[bool]:
    """Per step: whether it is the first-pass forward whose tape (or checkpointed input) the
    plan offloads (the first forward of an offloaded stage, schedules.offload)."""
    offloaded = offloaded_stages(plan)
    seen: set[int] = set()
    marks = []
    for step in plan.steps:
        first = step.kind != "backward" and step.stage not in seen
        if step.kind != "backward":
            seen.add(step.stage)
        marks.append(first and step.stage in offloaded)
    return marks


def schedule_rows(plan: Plan) -> list[tuple[str, str, int]]:
    """Consecutive steps of one kind over consecutive stages, merged: (label, stages, count)."""
    rows: list[tuple[str, list[int]]] = []
    for step, moved in zip(plan.steps, offload_steps(plan), strict=True):
        kind = step.kind
        if moved:
            kind += "+offload"
        if rows and rows[-1][0] == kind and abs(rows[-1][1][-1] - step.stage) == 1:
            rows[-1][1].append(step.stage)
        else:
            rows.append((kind, [step.stage]))
    names = plan.stage_names
    result = []
    for kind, stages in rows:
        first, last = names[stages[0]], names[stages[-1]]
        span = first if len(stages) == 1 else f"{first} .. {last}"
        result.append((STEP_LABELS[kind], span, len(stages)))
    return result


def schedule_dict(
    plan: Plan, activation_budget: int | None, time: StepTime | None = None
) -> dict[str, Any]:
    return {
        **plan_dict(plan, time),
        "activation_budget_bytes": activation_budget,
        "stages": list(plan.stage_names),
        "steps": [
            {"kind": step.kind, "stage": step.stage, "name": plan.stage_names[step.stage]}
            | ({"offload": True} if moved else {})
            for step, moved in zip(plan.steps, offload_steps(plan), strict=True)
        ],
    }


def schedule_view(plan: Plan, activation_budget: int | None, time: StepTime | None = None) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=f"Schedule: {plan.strategy} ({len(plan.steps)} steps)", title_justify="left"
    )
    table.add_column("#", justify="right")
    table.add_column("step")
    table.add_column("stages")
    table.add_column("count", justify="right")
    rows = schedule_rows(plan)
    for index, (label, span, count) in enumerate(rows, 1):
        if SCHEDULE_ROWS // 2 < index <= len(rows) - SCHEDULE_ROWS // 2:
            if index == SCHEDULE_ROWS // 2 + 1:  # a long schedule: its two ends (JSON has all)
                omitted = len(rows) - SCHEDULE_ROWS // 2 * 2
                table.add_row("...", f"{omitted:,} rows omitted (--json lists every step)", "", "")
            continue
        table.add_row(str(index), label, span, str(count))
    forwards = sum(1 for step in plan.steps if step.kind != "backward")
    budget = (
        f" of {format_bytes(activation_budget, GIB)} available"
        if activation_budget is not None
        else ""
    )
    summary = Text(
        f"Peak activations {gib(plan.activation_bytes)}{budget}; {forwards} stage forwards "
        f"for {len(plan.stage_names)} stages; recompute {format_flops(plan.flops.recompute)} "
        "per iteration, "
        f"overhead {plan.overhead:.2%}"
        + (
            ""
            if time is None
            else f"; step {seconds(time.step_seconds)}, time overhead {time.overhead:+.2%}"
        )
        + ".",
        style="bold",
    )
    return Group(table, summary)


def largest_line(
    spec: ModelSpec, key: str, value: int, what: str, step: int, at: str | None = None
) -> Text:
    """What `--seq auto` / `--micro-batch auto` found for `what` (a strategy, a model): the
    largest value that fits, or that not even `step` (the smallest tried) does; `spec` is the
    model at the value shown, `at` what the value was searched at (default: the other key)."""
    from rich.text import Text

    if key == "seq":
        noun, unit = "sequence", " tokens"
        at = at or f"micro-batch {spec.micro_batch}, multiples of {step}"
    else:
        noun, unit = "micro-batch", ""
        at = at or f"seq {spec.seq:,}"
    if not value:
        return Text(
            f"No {noun} fits with {what}: not even {step:,}{unit} (shown at {step:,}).",
            style="red",
        )
    longest = "Longest" if key == "seq" else "Largest"
    return Text(f"{longest} {noun} that fits with {what}: {value:,}{unit} ({at}).", style="bold")
