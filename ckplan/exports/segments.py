"""What a plan recomputes, layer by layer: the segments every launcher is written from.

A launcher cannot run a schedule step by step; it wraps ranges of transformer layers in a
checkpoint. So each export starts from the plan's own replayed schedule (`Plan.steps`) and
recovers the layer segments it is made of (`plan.export_limits.layer_segments`, where plans are
made, so that the plan layer judges a plan by the very segments an export writes): ranges whose
input is kept and that are re-run once in backward, and ranges stored whole. Recovery is exact
or refused: the segments are accepted only when `schedules.segment_schedule` rebuilds the very
same steps from them (`schedules.schedule_segments`), so an export can never describe a
schedule other than the one ckplan measured (a binomial or optimal schedule that re-runs a
range more than once has no segments, and says so).
"""

from __future__ import annotations

from ckplan.plan.export_limits import LayerSegments, layer_segments

__all__ = ["LayerSegments", "layer_segments", "module_reason"]


def module_reason(layers: LayerSegments, target: str) -> str | None:
    """Why a target without module recomputation (everything but Megatron-LM) cannot run a
    plan that recomputes an MoE group or the dense MLP alone, or None."""
    if layers.policy:
        return f"the per-op policy {layers.policy}: no {target} option for it yet"
    if layers.moe:
        return f"recomputing the {layers.moe} of MoE layers: no {target} option for it yet"
    if layers.mlp:
        return (
            f"recomputing the dense MLP alone (Megatron-Core's mlp module): no {target} option "
            "for it yet"
        )
    if layers.extra:
        return f"Megatron-Core's {layers.extra[0]} module: no {target} option for it yet"
    return None
