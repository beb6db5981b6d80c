"""The time views: a plan's step time on a GPU, and the GPU presets."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckplan.model.frameworks import optimizer_implementation
from ckplan.render.common import facts_table

if TYPE_CHECKING:  # Rich is imported where a table is built: --json needs none
    from rich.console import Group
    from rich.table import Table

    from ckplan.hardware.gpus import GPU
    from ckplan.hardware.step_time import StepTime
    from ckplan.plan import Plan


def seconds(value: float) -> str:
    """Seconds for people: ms below one second."""
    return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.3f} s"


def _bubble_formula(spec) -> str:
    """The bubble's formula as the time model applies it (`step_time._pipeline`)."""
    if spec.pipeline_schedule == "dualpipe":
        return f"DualPipe (p/2-1)(F&B+B-3W), p/2-1 = {spec.pp // 2 - 1}"
    return f"(p-1)/v = {spec.pp - 1}/{spec.virtual_stages}"


def step_time_table(plan: Plan, time: StepTime, gpu: GPU | None) -> Table:
    """Step time, its parts, MFU/HFU, throughput and the time overhead beside the FLOP one."""
    where = f" on {gpu.name}" if gpu is not None else ""
    table = facts_table(f"Step time{where} (one iteration, busiest GPU)")
    step = time.step_seconds
    spec = plan.spec
    table.add_row("step", seconds(step), f"{spec.microbatches} micro-batches", style="bold")
    parts = (
        ("forward", time.forward_seconds, "compute"),
        ("backward", time.backward_seconds, "compute"),
        ("recompute", time.recompute_seconds, "re-run ops and their collectives"),
        ("communication", time.communication_seconds, "exposed TP/CP/EP/PP/DP"),
        ("pipeline bubble", time.bubble_seconds, _bubble_formula(spec)),
        ("optimizer", time.optimizer_seconds, f"{_optimizer_name(spec)}, memory-bound"),
    )
    if spec.optimizer_offload != "none":
        parts = (
            *parts[:-1],
            ("optimizer", time.optimizer_seconds, "CPU Adam on the host, memory-bound"),
            ("state copies", time.state_copy_seconds, "host copies of model states not hidden"),
        )
    if time.offload_exposed_seconds:
        parts += (("offload copies", time.offload_exposed_seconds, "host copies not hidden"),)
    for name, value, note in parts:
        table.add_row(f"  {name}", seconds(value), f"{value / step:.1%}  {note}")
    table.add_row("by kind", "", "")
    labels = {
        "matmul_seconds": "matmul",
        "memory_bound_seconds": "memory-bound",
        "communication_seconds": "communication",
        "bubble_seconds": "bubble",
        "optimizer_seconds": "optimizer",
    }
    for key, value in time.breakdown.items():
        table.add_row(f"  {labels.get(key, key)}", seconds(value), f"{value / step:.1%}")
    table.add_row(
        "MFU",
        f"{time.mfu:.1%}",
        f"model FLOPs ({time.mfu_convention} count) / (step x GPUs x peak)",
        style="bold",
    )
    table.add_row("HFU", f"{time.hfu:.1%}", "with the recomputed FLOPs")
    table.add_row("tokens/s per GPU", f"{time.tokens_per_second_per_gpu:,.0f}", "")
    table.add_row(
        "recompute overhead",
        f"{time.overhead:+.2%} time",
        f"{plan.overhead:+.2%} FLOPs (recompute / (forward + backward))",
        style="bold",
    )
    return table


def gpus_table(devices: list[GPU]) -> Table:
    from rich.table import Table

    table = Table(title="GPU presets (dense BF16; bandwidths one direction)", title_justify="left")
    columns = (
        "name",
        "memory",
        "BF16 TFLOP/s",
        "FP32 TFLOP/s",
        "HBM TB/s",
        "link GB/s",
        "per node",
        "network GB/s",
        "matmul eff",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "name" else "right")
    for gpu in devices:
        table.add_row(
            gpu.name,
            f"{gpu.memory_bytes / 1e9:g} GB",
            f"{gpu.bf16_flops / 1e12:,.1f}",
            f"{gpu.fp32_flops / 1e12:,.1f}",
            f"{gpu.hbm_bytes_per_s / 1e12:.2f}",
            f"{gpu.link_bytes_per_s / 1e9:,.0f}",
            str(gpu.gpus_per_node),
            f"{gpu.network_bytes_per_s / 1e9:,.1f}",
            f"{gpu.matmul_efficiency:.3f}",
        )
    return table


def gpu_table(gpu: GPU) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"GPU {gpu.name}", show_header=False, title_justify="left")
    table.add_column("key", style="bold")
    table.add_column("value", justify="right")
    for key, value in gpu.to_dict().items():
        if key not in ("name", "source"):
            table.add_row(key, f"{value:g}" if isinstance(value, float) else str(value))
    return Group(table, Text(f"source: {gpu.source}", style="dim")) if gpu.source else Group(table)


def _optimizer_name(spec) -> str:
    """The optimizer as the step-time table names it (Adam for adamw, as before), with its
    foreach path where it steps so (a kernel per operation: `optimizer_implementation`)."""
    name = "Adam" if spec.optimizer == "adamw" else spec.optimizer
    if optimizer_implementation(spec) == "foreach":
        return f"{name} foreach, a kernel per operation"
    return name
