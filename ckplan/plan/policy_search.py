"""The best per-op policy: which unit outputs a layer should keep for the least re-run cost.

A per-op policy (`ckplan.model.op_policy`) keeps a set of unit outputs; the layer's stored tape
is its input plus their bytes (and internal tensors), and its backward re-runs the units whose
outputs (or internal tensors) a backward reads and that it does not keep, with whatever not kept
those read (`op_policy.rerun_mask`). A unit whose output no backward reads (a projection before
RoPE or a residual add, a reduce-scatter, a permutation before its all-to-all) matters only
through the units that read it: it joins their group, and the units split into groups whose
re-runs do not depend on each other (every unit a group's re-run reads outside the group is one
a backward reads, rebuilt or kept whatever the group does). So the choice is a multiple-choice
knapsack: each group's subsets are evaluated exactly (`rerun_mask`), and `policy_frontier` gives
every policy that no other beats on both stored bytes and re-run cost (the Pareto frontier, by
dynamic programming over the groups, Kellerer, Pferschy & Pisinger 2004 §11), `best_policy`
the cheapest within a per-layer byte budget. The cost is the re-forward's time on a GPU exactly
as the step-time model charges a stored layer under the policy (`step_time.rerun_time`: the
re-run units' roofline times and the collectives they repeat), or its forward FLOPs without
one. That time is a sum of one term per unit and one per shared collective; the GEMMs split from
one table op, which share its tensor-parallel collectives, are put in one group, so the sum over
groups is the policy's time and the bytes the sum of its kept units' (`policy_tape_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from ckplan.hardware.gpus import GPU
from ckplan.hardware.step_time import rerun_time
from ckplan.model.layers import LayerKind
from ckplan.model.op_policy import (
    POLICY_PREFIX,
    SUBMODULE_REGIONS,
    UNIT_NAMES,
    OpPolicy,
    Unit,
    part_of,
    policy_tape_bytes,
    policy_text,
    region_keepable,
    region_spans,
    replays,
    rerun_mask,
    rerun_units,
    scope_model_reason,
    scoped_tape_bytes,
    unit_ops,
)
from ckplan.model.ops import layer_ops
from ckplan.model.spec import ModelSpec

# A frontier never holds more points than this (real frontiers hold a few dozen to a few hundred).
MAX_FRONTIER = 4096
# The most units one group may hold (its subsets are enumerated: 2**MAX_GROUP).
MAX_GROUP = 12


@dataclass(frozen=True)
class PolicyPoint:
    """A policy on the frontier: the units it keeps, the layer's stored bytes, the re-run cost
    (seconds on a GPU, FLOPs without one)."""

    kept: tuple[str, ...]
    tape_bytes: int
    cost: float
    # a scoped policy's regions, each with the units it keeps; empty: the whole layer
    scopes: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def strategy(self) -> str:
        """The policy as a strategy word: `sac:UNIT,...`, a scoped `sac@REGION=UNIT,...`, or
        `full` when it keeps nothing but the layer input."""
        if self.scopes:
            return policy_text(
                OpPolicy(scopes=tuple((name, frozenset(kept)) for name, kept in self.scopes))
            )
        return POLICY_PREFIX + ",".join(self.kept) if self.kept else "full"


def rerun_cost(
    spec: ModelSpec, again: tuple[Unit, ...], gpu: GPU | None, kind: LayerKind | None = None
) -> float:
    """What re-running the units `again` of one layer costs: on a GPU the seconds the step-time
    model charges the re-forward (`step_time.rerun_time`: the units' forward time and the
    collectives it repeats, each table op's and each all-to-all's once), else their forward
    FLOPs."""
    if gpu is None:
        return float(sum(unit.op.forward_flops for unit in again))
    forward, collectives, _ = rerun_time(spec, gpu, kind, again)
    return forward.total + collectives


def unit_cost(spec: ModelSpec, unit: Unit, gpu: GPU | None, kind: LayerKind | None = None) -> float:
    """What re-running `unit` alone costs (`rerun_cost`)."""
    return rerun_cost(spec, (unit,), gpu, kind)


def policy_groups(spec: ModelSpec, kind: LayerKind | None = None) -> tuple[tuple[str, ...], ...]:
    """The unit names in groups whose re-runs are independent (module docstring): a name whose
    output no backward reads joins the names that read it; in forward order."""
    units = unit_ops(spec, kind)
    names = list(dict.fromkeys(unit.name for unit in units))
    parent = {name: name for name in names}

    def root(name: str) -> str:
        while parent[name] != name:
            name = parent[name]
        return name

    def join(first: str, second: str) -> None:
        if root(first) != root(second):
            parent[root(first)] = root(second)

    read_by_backward = {units[j].name for unit in units for j in unit.saves}
    read_by_backward |= {unit.name for unit in units if unit.internal}
    for unit in units:
        for j in unit.reads:
            if units[j].name not in read_by_backward:
                join(units[j].name, unit.name)
    # the GEMMs split from one column-parallel table op share its forward all-gather (sequence
    # parallelism), which a re-forward repeats once whichever of them re-run
    # (`step_time.rerun_time`)
    gathered = spec.tp > 1 and spec.sp
    for op in layer_ops(spec, kind):
        if not (gathered and op.tp_comm == "column"):
            continue
        parts = [unit.name for unit in units if part_of(unit, op)]
        for first, second in pairwise(parts):
            join(first, second)
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(root(name), []).append(name)
    return tuple(tuple(group) for group in groups.values())


def _options(
    spec: ModelSpec, group: tuple[str, ...], gpu: GPU | None, kind: LayerKind | None
) -> list[tuple[int, float, tuple[str, ...]]]:
    """Every subset of `group` kept, with the bytes it adds to the layer's stored tape
    (`policy_tape_bytes`, the rest of the layer kept nothing) and the cost of the group's
    re-runs (`rerun_cost`, the rest of the layer kept: the group's re-runs do not depend on it,
    and the cost is a sum over groups, `policy_groups`)."""
    if len(group) > MAX_GROUP:
        raise ValueError(f"a policy group of {len(group)} units: {', '.join(group)}")
    units = unit_ops(spec, kind)
    members = [i for i, unit in enumerate(units) if unit.name in group]
    base = policy_tape_bytes(spec, OpPolicy(), kind)
    found = []
    for bits in range(1 << len(group)):
        chosen = frozenset(name for b, name in enumerate(group) if bits >> b & 1)
        kept = tuple(unit.name not in group or unit.name in chosen for unit in units)
        again = rerun_mask(units, kept, replays(spec))
        size = policy_tape_bytes(spec, OpPolicy(chosen), kind) - base
        cost = rerun_cost(spec, tuple(units[i] for i in members if again[i]), gpu, kind)
        found.append((size, cost, tuple(sorted(chosen))))
    return found


def policy_frontier(
    spec: ModelSpec, gpu: GPU | None = None, kind: LayerKind | None = None
) -> tuple[PolicyPoint, ...]:
    """Every policy that no other beats on both the layer's stored bytes and its re-run cost,
    by increasing bytes (ties on both: the one keeping fewer units)."""
    base = policy_tape_bytes(spec, OpPolicy(), kind)  # the layer input
    points: list[tuple[int, float, tuple[str, ...]]] = [(base, 0.0, ())]
    for group in policy_groups(spec, kind):
        options = _pareto([(b, -c, k) for b, c, k in _options(spec, group, gpu, kind)])
        grown = [(b + ob, c + oc, (*k, *ok)) for b, c, k in points for ob, oc, ok in options]
        points = _pareto(grown)
    order = {name: i for i, name in enumerate(UNIT_NAMES)}
    return tuple(
        PolicyPoint(tuple(sorted(kept, key=order.__getitem__)), size, -saved)
        for size, saved, kept in points
    )


def region_layouts(spec: ModelSpec, kind: LayerKind | None = None):
    """Every non-empty set of pairwise disjoint regions a layer of `kind` has
    (`op_policy.region_spans`), each as (name, (start, end)) pairs in layer order."""
    spans = sorted(region_spans(spec, kind).items(), key=lambda item: item[1])
    layouts: list[tuple[tuple[str, tuple[int, int]], ...]] = [()]
    for name, span in spans:
        layouts += [
            (*layout, (name, span))
            for layout in layouts
            if all(span[0] >= end or span[1] <= start for _, (start, end) in layout)
        ]
    return [tuple(sorted(layout, key=lambda item: item[1])) for layout in layouts if layout]


def scoped_frontier(
    spec: ModelSpec, gpu: GPU | None = None, kind: LayerKind | None = None, wrapped: bool = False
) -> tuple[PolicyPoint, ...]:
    """The frontier of scoped policies (`op_policy.OpPolicy.scopes`): for every layout of
    regions (`region_layouts`), what the regions and the un-checkpointed units hold whatever
    they keep (`op_policy.stored_tensors`), then each unit of a region that its replay re-runs
    when not kept, kept or not (the GEMMs of one column-parallel projection together under
    sequence parallelism, which share its all-gather): a knapsack over independent choices,
    since an eager region re-runs a unit it does not keep by a rule that does not depend on
    what else it keeps (`op_policy.rerun_mask`: to the region's end, or to the last tensor its
    backward reads),
    and keeping a unit adds its output (unless held already) and its internal tensors. Empty
    where scoped policies are not modelled (`op_policy.scope_model_reason`: under
    torch.compile, post-norm or parallel-residual layers). With `wrapped`, among the policies a
    checkpoint around each region's submodule runs (`op_policy.scope_wrap_reason`): regions
    that are submodules, kept units a policy_fn recognises."""
    if scope_model_reason(spec):
        return ()
    layouts = region_layouts(spec, kind)
    keep = None
    if wrapped:
        layouts = [layout for layout in layouts if all(n in SUBMODULE_REGIONS for n, _ in layout)]
        keep = frozenset(u.name for u in unit_ops(spec, kind) if region_keepable(spec, u.name))
    points = []
    for layout in layouts:
        points += [
            (p.tape_bytes, -p.cost, p.scopes)
            for p in layout_frontier(spec, layout, gpu, kind, keep)
        ]
    return tuple(PolicyPoint((), size, -score, scopes) for size, score, scopes in _pareto(points))


def layout_frontier(
    spec: ModelSpec,
    layout: tuple[tuple[str, tuple[int, int]], ...],
    gpu: GPU | None = None,
    kind: LayerKind | None = None,
    keep: frozenset[str] | None = None,
) -> tuple[PolicyPoint, ...]:
    """The frontier of the scoped policies whose regions are `layout` (`scoped_frontier`);
    with `keep`, keeping only units of those names."""
    mode = replays(spec, scoped=True)
    units = unit_ops(spec, kind)
    order = {name: i for i, name in enumerate(UNIT_NAMES)}
    spans = tuple(span for _, span in layout)
    nothing = (False,) * len(units)
    base = scoped_tape_bytes(spec, units, spans, nothing)
    again = rerun_mask(units, nothing, mode, spans)
    frontier: list[tuple[int, float, tuple]] = [(base, 0.0, ())]
    for name, (start, end) in layout:
        for members in _decisions(spec, units, [i for i in range(start, end) if again[i]], kind):
            # units not re-run when not kept are left out: keeping them only adds bytes
            keepable = [i for i in members if keep is None or units[i].name in keep]
            options = []
            for bits in range(1 << len(keepable)):
                kept = [i for b, i in enumerate(keepable) if bits >> b & 1]
                rerun = tuple(units[i] for i in members if i not in kept)
                # what keeping a unit adds, whatever else is kept: its private tensors, its
                # output unless held already, its internal tensors
                size = sum(_alone_bytes(spec, units, spans, i) - base for i in kept)
                names = tuple((name, units[i].name) for i in kept)
                options.append((size, rerun_cost(spec, rerun, gpu, kind), names))
            frontier = _pareto(
                [(b + ob, c - oc, (*k, *ok)) for ob, oc, ok in options for b, c, k in frontier]
            )
    found = []
    for size, _, kept in frontier:
        scopes = tuple(
            (name, tuple(sorted({u for r, u in kept if r == name}, key=order.__getitem__)))
            for name, _ in layout
        )
        policy = OpPolicy(scopes=tuple((name, frozenset(names)) for name, names in scopes))
        # the point's cost is its re-run as the step-time model charges it (the sum above
        # equals it but where two units of one name share a collective: an upper bound there)
        cost = rerun_cost(spec, rerun_units(spec, policy, kind), gpu, kind)
        found.append((size, -cost, scopes))
    return tuple(PolicyPoint((), size, -score, scopes) for size, score, scopes in _pareto(found))


def _decisions(spec: ModelSpec, units: tuple[Unit, ...], indices: list[int], kind):
    """`indices` in the groups whose re-runs a scoped policy decides together: the GEMMs of one
    column-parallel table op under sequence parallelism (they share its forward all-gather,
    `step_time.rerun_time`), every other unit alone."""
    gathered = spec.tp > 1 and spec.sp
    columns = [op for op in layer_ops(spec, kind) if op.tp_comm == "column"] if gathered else []
    groups: dict[object, list[int]] = {}
    for i in indices:
        op = next((op.name for op in columns if part_of(units[i], op)), None)
        groups.setdefault(op or i, []).append(i)
    return list(groups.values())


def _alone_bytes(spec: ModelSpec, units: tuple[Unit, ...], spans, i: int) -> int:
    """What a scoped policy whose regions are `spans` holds keeping unit `i` alone."""
    alone = tuple(j == i for j in range(len(units)))
    return scoped_tape_bytes(spec, units, spans, alone)


def _pareto(points: list[tuple[int, float, tuple[str, ...]]]):
    """The points no other has fewer-or-equal bytes and more-or-equal score (minus the cost)
    than."""
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
    spec: ModelSpec,
    tape_budget: int,
    gpu: GPU | None = None,
    kind: LayerKind | None = None,
    scoped: bool = False,
) -> PolicyPoint | None:
    """The cheapest policy whose stored tape fits `tape_budget` bytes per layer, or None; with
    `scoped`, among scoped policies too (`scoped_frontier`)."""
    points = policy_frontier(spec, gpu, kind)
    if scoped:
        points = (*points, *scoped_frontier(spec, gpu, kind))
    fitting = [p for p in points if p.tape_bytes <= tape_budget]
    return min(fitting, key=lambda p: (p.cost, p.tape_bytes)) if fitting else None
