"""The best per-op policy: which unit outputs a layer should keep for the least re-run cost.

A per-op policy (`ckplan.model.op_policy`) keeps a set of unit outputs; the layer's stored tape
is its input plus their bytes, and its backward re-runs every other unit. Both sums are over
units, so the choice is a 0/1 knapsack: `policy_frontier` gives every policy that no other
beats on both stored bytes and re-run cost (the Pareto frontier, by dynamic programming over
the units, Kellerer, Pferschy & Pisinger 2004 §2), `best_policy` the cheapest within a per-layer
byte budget. The cost is a unit's forward time on a GPU (its roofline time as the step-time
model runs it), or its forward FLOPs without one; a kept collective (the row-parallel
outputs' reduce-scatters, the expert-parallel all-to-alls) spares its forward time. What every
policy re-runs (the norms, activations, permutations, the column-parallel all-gathers) is the
same whatever it keeps, and is left out of the cost (`layer_time` adds it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ckplan.hardware.code_path import spec_code_path
from ckplan.hardware.gpus import GPU
from ckplan.hardware.step_time import layer_time, tensor_parallel_comm
from ckplan.model.layers import LayerKind
from ckplan.model.op import LayerShapes
from ckplan.model.op_policy import POLICY_PREFIX, Unit, skips_rerun, unit_ops
from ckplan.model.ops import layer_ops
from ckplan.model.spec import ModelSpec

# A frontier never holds more points than this (the largest unit tables have ~18 units; sizes
# and costs are distinct enough that real frontiers hold a few dozen).
MAX_FRONTIER = 4096


@dataclass(frozen=True)
class PolicyPoint:
    """A policy on the frontier: the units it keeps, the layer's stored bytes, the re-run cost
    (seconds on a GPU, FLOPs without one)."""

    kept: tuple[str, ...]
    tape_bytes: int
    cost: float

    @property
    def strategy(self) -> str:
        """The policy as a strategy word: `sac:UNIT,...`, or `full` when it keeps nothing but
        the layer input."""
        return POLICY_PREFIX + ",".join(self.kept) if self.kept else "full"


def unit_cost(spec: ModelSpec, unit: Unit, gpu: GPU | None, kind: LayerKind | None = None) -> float:
    """What re-running `unit` costs: its forward time on `gpu` (the code path the step-time
    model times it on), else its forward FLOPs. The all-to-alls cost the exposed forward share
    of the layer's expert-parallel collectives, which a re-forward repeats unless the policy
    keeps them (`step_time.layer_time`); the reduce-scatters, the forward time of the
    row-parallel outputs' collectives (`step_time.tensor_parallel_comm`); nothing without a
    GPU."""
    if unit.name == "all_to_all":
        return 0.0 if gpu is None else layer_time(spec, gpu, kind).expert_forward_comm
    if unit.name == "reduce_scatter":
        if gpu is None:
            return 0.0
        rows = tuple(op for op in layer_ops(spec, kind) if op.tp_comm == "row")
        return tensor_parallel_comm(spec, spec_code_path(spec, gpu).gpu, rows)[0]
    if gpu is None:
        return float(unit.op.forward_flops)
    return spec_code_path(spec, gpu).forward(unit.op, spec.dtype_bytes).total


def _choosable(spec: ModelSpec, kind: LayerKind | None) -> list[Unit]:
    """The units worth keeping, one entry per name: the matmuls, grouped GEMMs, the attention
    kernel and the collectives (`op_policy.skips_rerun`; keeping a norm's or an activation's
    output costs its bytes and spares no re-run), a name that occurs twice (the reduce-scatters
    of the row-parallel outputs, the dispatch and combine all-to-alls) with the bytes of
    both."""
    seen: dict[str, Unit] = {}
    for unit in unit_ops(spec, kind):
        if not skips_rerun(unit):
            continue
        if unit.name in seen:
            first = seen[unit.name]
            unit = dataclasses.replace(first, output_bytes=first.output_bytes + unit.output_bytes)
        seen[unit.name] = unit
    return list(seen.values())


def policy_frontier(
    spec: ModelSpec, gpu: GPU | None = None, kind: LayerKind | None = None
) -> tuple[PolicyPoint, ...]:
    """Every policy that no other beats on both the layer's stored bytes and its re-run cost,
    by increasing bytes (ties on both: the one keeping fewer units)."""
    units = _choosable(spec, kind)
    total = sum(unit_cost(spec, unit, gpu, kind) for unit in units)
    base = LayerShapes.of(spec).X  # the layer input, kept whatever the policy
    # (bytes, saved cost, kept names); the DP adds one unit at a time and keeps the frontier
    points: list[tuple[int, float, tuple[str, ...]]] = [(base, 0.0, ())]
    for unit in units:
        cost = unit_cost(spec, unit, gpu, kind)
        grown = points + [(b + unit.output_bytes, c + cost, (*k, unit.name)) for b, c, k in points]
        points = _pareto(grown)
    order = {unit.name: i for i, unit in enumerate(units)}
    return tuple(
        PolicyPoint(tuple(sorted(kept, key=order.__getitem__)), size, total - saved)
        for size, saved, kept in points
    )


def _pareto(points: list[tuple[int, float, tuple[str, ...]]]):
    """The points no other has fewer-or-equal bytes and more-or-equal saved cost than."""
    points = sorted(points, key=lambda p: (p[0], -p[1], len(p[2])))
    frontier: list[tuple[int, float, tuple[str, ...]]] = []
    for point in points:
        if not frontier or point[1] > frontier[-1][1]:
            frontier.append(point)
    if len(frontier) > MAX_FRONTIER:  # thin evenly; the ends stay
        step = len(frontier) / MAX_FRONTIER
        frontier = [frontier[int(i * step)] for i in range(MAX_FRONTIER - 1)] + [frontier[-1]]
    return frontier


def best_policy(
    spec: ModelSpec, tape_budget: int, gpu: GPU | None = None, kind: LayerKind | None = None
) -> PolicyPoint | None:
    """The cheapest policy whose stored tape fits `tape_budget` bytes per layer, or None."""
    fitting = [p for p in policy_frontier(spec, gpu, kind) if p.tape_bytes <= tape_budget]
    return min(fitting, key=lambda p: (p.cost, p.tape_bytes)) if fitting else None
