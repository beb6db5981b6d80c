"""What a plan recomputes, layer by layer: the segments every launcher is written from.

A launcher cannot run a schedule step by step; it wraps ranges of transformer layers in a
checkpoint. So each export starts from the plan's own replayed schedule (`Plan.steps`) and
recovers the layer segments it is made of: ranges whose input is kept and that are re-run once
in backward, and ranges stored whole. Recovery is exact or refused: the segments are accepted
only when `schedules.segment_schedule` rebuilds the very same steps from them
(`schedules.schedule_segments`, through `plan.export_limits.layer_ranges`, which also gives the
plan its note when an export refuses it), so an export can
never describe a schedule other than the one ckplan measured (a binomial or optimal schedule
that re-runs a range more than once has no segments, and says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.model.op import DENSE_MLP
from ckplan.model.op_policy import is_policy
from ckplan.plan import Plan
from ckplan.plan.export_limits import is_layer, layer_ranges, pipeline_reason
from ckplan.plan.strategies import MODULES


@dataclass(frozen=True)
class LayerSegments:
    """The layers of one pipeline stage as half-open `(start, end, recompute)` ranges over
    0..layers-1 (indices within the stage), whether the attention core is recomputed on top
    (selective), whether the dense MLP is (`mlp`), and which MoE group is (`moe`: the whole MoE
    block, `experts`: the routed expert MLPs; None), and the stored layers whose tapes go to host
    memory (`offloaded`, indices within the stage: ckplan.schedules.offload)."""

    layers: int
    segments: tuple[tuple[int, int, bool], ...]
    selective: bool
    moe: str | None = None
    mlp: bool = False
    policy: str | None = None  # a per-op policy (`sac:...`) in every stored layer
    offloaded: tuple[int, ...] = ()
    # Megatron-Core's other --recompute-modules (layernorm, moe_act, mla_up_proj,
    # shared_experts: strategies.MODULES), in its order
    extra: tuple[str, ...] = ()
    # `POLICY+mixed` (plan.policy_mix): the stored layers that store the policy's tape, the
    # others their full tape; None: the policy in every stored layer
    policy_layers: tuple[int, ...] | None = None

    @property
    def modules(self) -> bool:
        """Whether a module of the layer (attention core, MLP, MoE) is recomputed on top, or a
        per-op policy decides what the layer keeps."""
        return (
            self.selective
            or self.mlp
            or self.moe is not None
            or self.policy is not None
            or bool(self.extra)
        )

    @property
    def recomputed(self) -> tuple[tuple[int, int], ...]:
        return tuple((start, end) for start, end, recompute in self.segments if recompute)

    @property
    def stores_all(self) -> bool:
        return not self.recomputed

    def uniform_size(self) -> int | None:
        """K when every layer is recomputed in segments of K from the stage's first layer, the
        last one possibly shorter (Megatron `uniform`, Chen et al.'s segments)."""
        sizes = [end - start for start, end, recompute in self.segments]
        if not self.segments or not all(recompute for *_, recompute in self.segments):
            return None
        size = sizes[0]
        return size if all(s == size for s in sizes[:-1]) and sizes[-1] <= size else None

    def block_count(self) -> int | None:
        """N when the first N layers are each recomputed alone and the rest stored (Megatron
        `block`); 0 when nothing is recomputed."""
        count = 0
        for start, end, recompute in self.segments:
            if not recompute:
                break
            if end - start != 1:
                return None
            count += 1
        stored = self.segments[count:]
        return count if len(stored) <= 1 and not any(r for *_, r in stored) else None

    def every_nth(self) -> int | None:
        """N when exactly the layers N-1, 2N-1, ... are each recomputed alone and every other
        layer is stored (torchtitan's `selective_ac_option = N`)."""
        recomputed = {start for start, end in self.recomputed if end - start == 1}
        if len(recomputed) != len(self.recomputed) or not recomputed:
            return None
        step = min(recomputed) + 1
        return step if recomputed == set(range(step - 1, self.layers, step)) else None


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


def layer_segments(plan: Plan) -> LayerSegments | str:
    """The plan's layer segments, or the reason (one phrase) why it has none."""
    spec = plan.spec
    selective = plan.strategy.startswith("selective")
    moe = {"moe": "moe", "moe/experts": "experts"}
    moe_group = next((moe[g] for g in plan.recompute_groups if g in moe), None)
    names = plan.stage_names
    if not plan.steps:
        return "it has no schedule (the simple formula set)"
    flags = None  # per layer of the stage: whether it stores the policy's tape (sac+mixed)
    for _, mask in plan.stage_policy:
        flags = [on for on, name in zip(mask, names, strict=True) if is_layer(name)]
    if why := pipeline_reason(spec.pp, plan.strategy, bool(plan.stage_offloads)):
        return why
    result = layer_ranges(plan.steps, names)
    if isinstance(result, str):
        return result
    layers = sum(1 for name in names if is_layer(name))
    first_layer = next(i for i, name in enumerate(names) if is_layer(name))
    merged: list[tuple[int, int, bool]] = []
    for start, end, recompute in result:
        if merged and not recompute and not merged[-1][2]:
            merged[-1] = (merged[-1][0], end, False)
        else:
            merged.append((start, end, recompute))
    policy = next((group for group in plan.recompute_groups if is_policy(group)), None)
    policy_layers = None
    if flags is not None and not all(flags):
        if any(flags[i] for start, end, again in merged if again for i in range(start, end)):
            # measured on torch 2.13 (tests/test_export_torch.py): the caches of a selective
            # checkpoint inside an enclosing checkpoint stay alive through the forward
            return (
                "a recomputed layer stores the per-op policy's tape when it re-runs, and a "
                "selective checkpoint inside an enclosing checkpoint keeps its caches alive "
                "through the forward"
            )
        policy_layers = tuple(i for i, on in enumerate(flags) if on)
    offloaded = dict(plan.stage_offloads).get(plan.peak_stage, ())
    return LayerSegments(
        layers,
        tuple(merged),
        selective,
        moe_group,
        DENSE_MLP in plan.recompute_groups,
        policy,
        tuple(i - first_layer for i, _ in offloaded if is_layer(names[i])),
        tuple(word for word, group in MODULES.items() if group in plan.recompute_groups),
        policy_layers,
    )
