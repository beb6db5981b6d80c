"""The resolved model and the plan as YAML: for review, diffs and records, any plan at all."""

from __future__ import annotations

from typing import Any

import yaml

from ckplan import __version__
from ckplan.exports.segments import LayerSegments
from ckplan.plan import Plan

NAME = "yaml"


def document(plan: Plan, layers: LayerSegments | None) -> dict[str, Any]:
    flops = plan.flops
    data: dict[str, Any] = {
        "ckplan_version": __version__,
        "model": plan.spec.to_dict(),
        "plan": {
            "strategy": plan.strategy,
            "formula": plan.formula,
            "activation_bytes": plan.activation_bytes,
            "model_state_bytes": plan.model_states.total,
            "total_bytes": plan.total_bytes,
            "flops": {
                "forward": flops.forward,
                "backward": flops.backward,
                "recompute": flops.recompute,
                "total": flops.total,
            },
            "overhead": plan.overhead,
        },
    }
    if layers is not None:
        data["plan"]["layer_segments"] = [
            {"first": start, "last": end - 1, "recompute": recompute}
            for start, end, recompute in layers.segments
        ]
        data["plan"]["attention_core_recomputed"] = layers.selective
    return data


def render(plan: Plan, layers: LayerSegments | None) -> str:
    return yaml.safe_dump(document(plan, layers), sort_keys=False)
