"""`ckplan plan`: the fastest layouts of a model on N GPUs."""

from __future__ import annotations

import shlex
from typing import Annotated

import typer

from ckplan.cli.auto import MicroBatchAutoOpt, SeqAutoOpt, read_auto
from ckplan.cli.errors import EXIT_DOES_NOT_FIT, UserError, print_error, user_errors
from ckplan.cli.lazy import layouts_in_convention
from ckplan.cli.options import (
    BudgetOpt,
    FormatOpt,
    JsonOpt,
    MfuConventionOpt,
    ModelArg,
    ProfileOpt,
    QuietOpt,
    ReserveOpt,
    SetOpt,
    SlotsOpt,
)
from ckplan.cli.output import print_json, print_rows, print_view
from ckplan.cli.resolve import (
    check_slots,
    output_options,
    parse_overrides,
    require_budget,
    resolve_gpu,
)
from ckplan.inputs.presets import load_spec
from ckplan.plan import DEFAULT_SLOTS, search
from ckplan.quoting import quote
from ckplan.render.progress import progress

MAX_GPUS = 1_048_576  # --gpus: the documented range of `ckplan plan`
# the layout search does not keep to the combined 1F1B's rules (ep > 1, interleaving when pp > 1)
A2A_OVERLAP_IN_PLAN = (
    "key 'overlap_moe_expert_parallel_comm': plan's layout search does not lay out Megatron-Core's "
    "combined 1F1B; evaluate such a layout with estimate"
)
# torchao's float8 all-gather holds where FSDP shards (zero 2-3, dp > 1): the search varies both
FLOAT8_ALL_GATHER_IN_PLAN = (
    "key 'fsdp_float8_all_gather': plan's layout search varies ZeRO and dp, where the float8 "
    "all-gather needs FSDP's sharding (zero 2 or 3, dp > 1); evaluate such a layout with estimate"
)
MAX_GLOBAL_BATCH = 2**24  # --global-batch: sequences per step (the search factors it)


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
    seq: SeqAutoOpt = None,
    micro_batch: MicroBatchAutoOpt = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    fmt: FormatOpt = None,
    quiet: QuietOpt = False,
    mfu_convention: MfuConventionOpt = "full",
) -> None:
    """The fastest layouts (tp, sp, pp and its split, virtual stages, cp, dp, ZeRO,
    micro-batches) of --gpus GPUs, each with its best recomputation plan; --set tp=8 (any
    layout key) fixes a key; --seq auto: at the longest sequence some layout fits;
    --micro-batch auto: at the largest micro-batch (a divisor of --global-batch) some layout
    fits."""
    from ckplan.plan.layout import search as layout_search
    from ckplan.plan.layout.space import constraints_from
    from ckplan.render import layouts as layout_view

    with user_errors():
        fmt, mfu_convention = output_options(fmt, as_json, mfu_convention)
        seq, auto_key = read_auto(seq, micro_batch)
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
        if overrides.get("pipeline_layout") is not None:
            raise UserError(
                "key 'pipeline_layout': plan lays out its own pipeline splits (even, the "
                "embedding and loss counted, or first/last stage layers); set it on estimate"
            )
        if "microbatch_group_size" in overrides:
            raise UserError(
                "key 'microbatch_group_size': plan lays out every pipeline with Megatron's "
                "default, pp (the fewest forwards in flight it allows); set it on estimate"
            )
        if overrides.get("overlap_moe_expert_parallel_comm") is True:
            raise UserError(A2A_OVERLAP_IN_PLAN)
        if overrides.get("fsdp_float8_all_gather") is True:
            raise UserError(FLOAT8_ALL_GATHER_IN_PLAN)
        constraints = constraints_from(overrides)
        # the search sets the layout keys; the model is read without them (with model states
        # on the host, at a ZeRO stage that offloads them; with FP8 primary weights at zero 1:
        # every layout sets its own)
        base = {k: v for k, v in overrides.items() if k not in constraints}
        if any(base.get(key, "none") != "none" for key in ("optimizer_offload", "param_offload")):
            base["zero"] = 3
        elif base.get("fp8_param_gather") is True:  # the distributed optimizer's, every layout's
            base["zero"] = 1
        spec = load_spec(model, base)
        if spec.pipeline_schedule == "dualpipe":
            raise UserError(
                "key 'pipeline_schedule' (dualpipe): plan lays out 1F1B and interleaved "
                "pipelines only; evaluate a DualPipe layout with estimate"
            )
        if spec.overlap_moe_expert_parallel_comm:
            raise UserError(A2A_OVERLAP_IN_PLAN)
        if spec.fsdp_float8_all_gather:
            raise UserError(FLOAT8_ALL_GATHER_IN_PLAN)
        device = resolve_gpu(gpu, settings)
        budget_text, total, kept = require_budget(budget, reserve, device)
        slots = check_slots(slots)
        extra = "".join(
            f" --set {shlex.quote(setting)}"
            for setting in settings or []
            if setting.partition("=")[0].strip() not in constraints
        )
        extra += f" --profile {shlex.quote(profile)}" if profile else ""
        if auto_key == "micro_batch" and "micro_batch" in constraints:
            raise UserError(
                f"--micro-batch auto and --set micro_batch={constraints['micro_batch']} "
                "disagree: give one of them"
            )
        layout_search.check_search(spec, gpus, device.gpus_per_node, global_batch, constraints)
        longest = None
        if auto_key == "seq":
            with progress(f"plan {spec.name}: the longest seq", quiet):
                longest = layout_search.longest_seq_layouts(
                    spec, gpus, device, global_batch, total, kept, constraints, slots
                )
            spec = spec.replace(seq=longest or search.auto_step(spec, "seq"))
        if auto_key == "micro_batch":
            with progress(f"plan {spec.name}: the largest micro-batch", quiet):
                longest = layout_search.largest_micro_batch_layouts(
                    spec, gpus, device, global_batch, total, kept, constraints, slots
                )
            # the layouts at that micro-batch (at 1, the smallest, when none fits)
            constraints = {**constraints, "micro_batch": longest or 1}
        result = layout_search.search_layouts(
            spec, gpus, device, global_batch, total, kept, top, constraints, slots
        )
        result = layouts_in_convention(result, mfu_convention)
    if fmt == "json":
        data = layout_view.plan_dict(result)
        if auto_key is not None:
            data["max_seq" if auto_key == "seq" else "max_micro_batch"] = longest
        print_json(data)
    elif fmt in ("csv", "markdown"):
        print_rows(layout_view.plan_rows(result), fmt)
    else:
        view = layout_view.plan_view(result, budget_text, model, extra)
        if auto_key is not None:
            from rich.console import Group

            from ckplan import render

            step = search.auto_step(spec, auto_key)
            at = (
                f"global batch {global_batch}, multiples of {step}"
                if auto_key == "seq"
                else f"seq {spec.seq:,}, global batch {global_batch}, its divisors"
            )
            line = render.largest_line(spec, auto_key, longest, f"{gpus} GPUs", step, at)
            view = Group(line, view)
        print_view(view, soft_wrap=True)
    if not result.layouts:
        print_error(layout_view.no_fit_line(result))
        raise typer.Exit(EXIT_DOES_NOT_FIT)
