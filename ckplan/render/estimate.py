"""The estimate and presets views: a plan's per-op, per-component and model-state breakdown."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ckplan import __version__
from ckplan.model.ops import layer_ops
from ckplan.model.spec import ModelSpec
from ckplan.plan import Plan
from ckplan.plan.search import Candidate
from ckplan.render.common import _both, _gib
from ckplan.units import format_flops

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
        "profile",
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
