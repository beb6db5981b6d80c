"""The layout search: the fastest layouts of N GPUs for a model, each with its best plan.

Every layout (`space.layouts`) gets two lower bounds from cached parts (`bounds.Bounds`): the
least per-GPU memory any of its plans needs, and the least step time (that of a plan without
recomputation). A layout whose memory bound exceeds the usable budget is rejected there.
The others are evaluated in order of their time bound (branch and bound): each with the
layer-level plans of the existing search (`none`; `selective`; the dense MLP module, `mlp` and
`selective+mlp`; the fewest layers of Megatron's
`block:N`, alone and with selective recomputation, found by bisection since memory falls as N
grows; with experts `moe`, `experts` and their selective forms; on Megatron-LM the model's
Megatron-Core modules together, with selective and with `selective+mlp`,
`search.layout_module_candidates`), timed by
`hardware.step_time`. The search stops when the next bound exceeds the K-th best time found.

The optimal DP (`plan.search.optimal_plan`: `optimal` and its selective and MoE forms, the
cheapest persistent schedules within the activation budget) runs only where the layer-level
plans cannot decide and the answer could change the top K: on layouts where none of them fits
(the DP then says whether any schedule does) or whose fastest recomputes, while the least time
of any plan that fits (`bounds.Bounds.recompute_time`) is below the K-th best time, in order of
that bound, until no layout can enter. Layouts where no layer-level plan fits and the DP did
not run are reported over memory by their least layer-level plan.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter
from dataclasses import dataclass, field

from ckplan.errors import InputError
from ckplan.hardware.gpus import GPU
from ckplan.hardware.host_link import host_memory_per_gpu
from ckplan.hardware.step_time import step_time
from ckplan.model import allocator
from ckplan.model.frameworks import joint_offload, offload_strategies
from ckplan.model.op_policy import (
    POLICY_PREFIX,
    check_policy_model,
    layerwise_export_reason,
    parse_policy,
)
from ckplan.model.spec import ModelSpec, SpecError
from ckplan.plan.evaluate import DEFAULT_SLOTS, Plan, evaluate, in_flight_microbatches
from ckplan.plan.layout.bounds import Bounds, MemoryBound, TimeBound, layout_keys_cleared
from ckplan.plan.layout.space import (
    Layout,
    SearchSpace,
    divisors,
    layouts,
    tensor_parallel_sizes,
)
from ckplan.plan.search import (
    DEFAULT_RESERVE,
    Candidate,
    activation_budget,
    auto_limit,
    best_policy_plan,
    choose,
    largest_value,
    layout_module_candidates,
    offload_optimal_plan,
    optimal_plan,
    policy_word,
    sweep_policy,
)
from ckplan.plan.strategies import (
    MODULE_FRAMEWORKS,
    StrategyError,
    has_dense_layers,
    parse_strategy,
)
from ckplan.quoting import shorten
from ckplan.units import format_bytes_auto

DEFAULT_TOP = 10


def _time_key(candidate: Candidate) -> tuple:
    """A layout's order of its timed plans: the shortest step; at equal time the plan that pins
    no host memory for its tapes, then the least memory."""
    plan = candidate.plan
    return (candidate.time.step_seconds, bool(plan.stage_offloads), plan.total_bytes)


SCREEN_SLOTS = 25  # the fewest memory slots of a screening DP
MAX_REJECTED = 3  # rejected layouts explained, per kind of reason
# Frameworks whose layers `plan` tries POLICY+mixed on (`plan.search.policy_word`): the torch
# export wraps each layer (DeepSpeed's and Megatron-LM's exports refuse a mixed plan)
MIXED_FRAMEWORKS = ("torchtitan", "hf")


@dataclass(frozen=True)
class Evaluated:
    """A layout evaluated: its model, its best plan found (or the smallest, if none fits)."""

    layout: Layout
    spec: ModelSpec
    candidate: Candidate
    time_bound: TimeBound
    memory_bound: MemoryBound
    optimal: bool = False  # the DP ran on it (its plan is the faster of its and the DP's)
    # the least time of any plan that fits (`Bounds.recompute_time`; the time bound if `none`
    # fits)
    fit_bound: float = 0.0
    # no layer-level plan fits and the DP has not run: whether any schedule fits is open
    undecided: bool = False
    # the fastest fitting plans found without offloading (recomputation, or `none`) and with it
    # (model.frameworks.offload_strategies), timed; None where none fits or none was tried
    recompute: Candidate | None = None
    offload: Candidate | None = None
    # a plan no export writes, tried on the layout, that does better than `candidate`
    # (`search.choose`); reported beside it, never as the layout's plan
    reference: Candidate | None = None

    @property
    def fits(self) -> bool:
        return self.candidate.fits

    @property
    def reference_beside(self) -> Candidate | None:
        """`reference` where it still does better than the layout's plan (`search.choose`),
        which the DP, the mixed DP or the joint offload DP may have replaced; else None."""
        if self.reference is None:
            return None
        return choose((self.candidate, self.reference), _time_key).reference

    @property
    def seconds(self) -> float:
        time = self.candidate.time
        return float("inf") if time is None else time.step_seconds

    @property
    def plan(self) -> Plan:
        return self.candidate.plan


@dataclass(frozen=True)
class Rejected:
    """A layout not shown, and why: over memory (`model_states`: its states alone exceed the
    usable memory; `memory`: its least plan, or its memory bound, does), or slower than the K
    shown (`slower`)."""

    layout: Layout
    reason: str
    time_bound: TimeBound
    memory_bound: MemoryBound
    usable_bytes: int
    evaluated: Evaluated | None = None  # when it was evaluated in full

    @property
    def over_bytes(self) -> int | None:
        """How far its least-memory plan (evaluated), else its memory bound, is over the usable
        budget; None for a layout that fits."""
        if self.reason == "slower":
            return None
        if self.evaluated is not None:
            return -self.evaluated.candidate.headroom_bytes
        return self.memory_bound.bytes - self.usable_bytes

    @property
    def seconds(self) -> float:
        """Its step time when evaluated, else its bound."""
        if self.evaluated is not None and self.evaluated.fits:
            return self.evaluated.seconds
        return self.time_bound.seconds


@dataclass(frozen=True)
class LayoutResult:
    spec: ModelSpec
    gpu: GPU
    gpus: int
    global_batch: int
    budget_bytes: int
    reserve_bytes: int
    layouts: tuple[Evaluated, ...]  # the fastest that fit, fastest first, at most `top`
    rejected: tuple[Rejected, ...]  # the best rejected, explained
    counts: dict[str, int] = field(default_factory=dict)
    least_memory: Rejected | None = None  # when nothing fits: the layout nearest to fitting
    advice: tuple[str, ...] = ()  # when nothing fits: how many GPUs, laid out how, would do
    # where the fastest layout offloads: the fastest layout and plan without offloading (a
    # second search that tries no offload plan), None when none fits
    without_offload: Evaluated | None = None

    @property
    def usable_bytes(self) -> int:
        return self.budget_bytes - self.reserve_bytes


class LayoutError(InputError):
    """No layout can exist: the GPU count, global batch and fixed keys contradict."""


def _check_product_divides(constraints, keys, gpus: int, rule: str) -> None:
    """The fixed sizes among `keys`, multiplied in order, must divide the GPUs at every step;
    the first that breaks it is named."""
    product = 1
    for key in keys:
        value = constraints.get(key)
        if value is None:
            continue
        product *= value
        if gpus % product:
            raise LayoutError(
                f"--set {key}={value}: {rule} --gpus {gpus:,}, and {product:,} does not"
            )


def check_search(
    spec: ModelSpec, gpus: int, gpus_per_node: int, global_batch: int, constraints: dict
) -> None:
    """Refuse, naming the option, a search with no layout at all (bad input, not "does not
    fit"): a fixed key that does not divide what it must, or a global batch no dp divides."""
    for key, value in constraints.items():
        if key == "sp":
            if not isinstance(value, bool):
                raise LayoutError(f"--set sp={shorten(value)}: expected true or false")
            continue
        low = 0 if key == "zero" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            expected = "0, 1, 2 or 3" if key == "zero" else "a positive integer"
            raise LayoutError(f"--set {key}={shorten(value)}: expected {expected}")
        if key == "zero" and value > 3:
            raise LayoutError(f"--set zero={shorten(value)}: expected 0, 1, 2 or 3")
    for key in ("ep", "etp"):
        if key in constraints and not spec.experts:
            raise LayoutError(f"--set {key}={constraints[key]}: {spec.name} has no experts")
    _check_product_divides(
        constraints, ("ep", "etp"), gpus, "ep·etp must divide tp·cp·dp, a divisor of"
    )
    ep = constraints.get("ep")
    if ep is not None and spec.experts % ep:
        raise LayoutError(
            f"--set ep={ep}: ep must divide the {spec.experts:,} experts of {spec.name}"
        )
    _check_product_divides(constraints, ("tp", "pp", "cp", "dp"), gpus, "tp·pp·cp·dp must divide")
    dp = constraints.get("dp")
    if dp is not None and global_batch % dp:
        raise LayoutError(f"--global-batch {global_batch:,} is not divisible by --set dp={dp}")
    micro_batch = constraints.get("micro_batch")
    if isinstance(micro_batch, int) and micro_batch >= 1 and global_batch % micro_batch:
        raise LayoutError(
            f"--global-batch {global_batch:,} is not divisible by --set micro_batch={micro_batch}"
        )
    space = SearchSpace(spec, gpus, gpus_per_node, global_batch, constraints)
    if not tensor_parallel_sizes(space):
        raise LayoutError(
            f"no tensor-parallel size for {spec.name}: tp must divide --gpus {gpus:,}, the "
            f"{spec.heads} heads and the FFN width, and stay within a node of {gpus_per_node}"
        )
    check_layer_shapes(space)
    if next(layouts(space), None) is None:
        raise LayoutError(
            f"no layout of {gpus:,} GPUs runs global batch {global_batch:,} of {spec.name}: "
            "dp = gpus / (tp·pp·cp) must divide the global batch, cp the sequence, pp at most "
            "the layers (and every key --set fixes must agree)"
        )


# Distinct (tp, sp, cp and its exchange, micro-batch, ep, etp) of one search: each costs a
# few ms of per-layer work (`bounds.Bounds.layer`); dense models on 16,384 GPUs have about 1,000.
MAX_LAYER_SHAPES = 4000


def check_layer_shapes(space: SearchSpace) -> None:
    """Refuse a search whose layouts have more than MAX_LAYER_SHAPES distinct per-layer shapes
    (it would take minutes, not seconds), naming the keys with the most values to fix."""
    shapes: set[tuple] = set()
    for layout in layouts(space):
        exchange, experts = layout.cp_attention, (layout.ep, layout.etp)
        shapes.add((layout.tp, layout.sp, layout.cp, exchange, layout.micro_batch, *experts))
        # a2a+p2p's groups' size follows from (tp, cp): no further shape
        if len(shapes) > MAX_LAYER_SHAPES:
            break
    else:
        return
    names = ("tp", "sp", "cp", "cp_attention", "micro_batch", "ep", "etp")
    spread = sorted(
        ((len({shape[i] for shape in shapes}), name) for i, name in enumerate(names)),
        reverse=True,
    )
    keys = ", ".join(f"{name} ({count}+ values)" for count, name in spread[:3] if count > 1)
    raise LayoutError(
        f"more than {MAX_LAYER_SHAPES:,} layer shapes to evaluate, more than ckplan searches in "
        f"seconds; fix some layout keys with --set (most values: {keys}) or give a smaller "
        "--global-batch"
    )


def search_layouts(
    spec: ModelSpec,
    gpus: int,
    gpu: GPU,
    global_batch: int,
    budget_bytes: int,
    reserve_bytes: int = DEFAULT_RESERVE,
    top: int = DEFAULT_TOP,
    constraints: dict | None = None,
    slots: int = DEFAULT_SLOTS,
    cutoff: float = math.inf,
    offload: bool = True,
) -> LayoutResult:
    """The `top` fastest layouts of `gpus` GPUs that fit, and the best rejected (module
    docstring); with `cutoff`, only layouts faster than `cutoff` seconds (every one of them
    with a large `top`: how a given layout ranks)."""
    usable = budget_bytes - reserve_bytes
    space = SearchSpace(spec, gpus, gpu.gpus_per_node, global_batch, dict(constraints or {}))
    bounds = Bounds(spec, gpu)
    counts: Counter[str] = Counter()
    queue: list[tuple[float, Layout, TimeBound, MemoryBound]] = []
    over: list[Rejected] = []
    failed: dict[tuple, int] = {}  # layouts but for the micro-batch -> least one over memory
    for layout in layouts(space):
        counts["layouts"] += 1
        family = (*layout.arrangement()[:-2], layout.cp_attention, layout.cp_a2a_size, layout.zero)
        if layout.micro_batch >= failed.get(family, layout.micro_batch + 1):
            counts["memory"] += 1  # activations grow with the micro-batch: over too
            continue
        memory_bound = bounds.layout_memory(layout, usable)
        time_bound = bounds.time(layout)
        if allocator.budgeted_bytes(memory_bound.bytes) > usable:
            failed[family] = layout.micro_batch
            reason = "model_states" if memory_bound.states > usable else "memory"
            counts[reason] += 1
            over.append(Rejected(layout, reason, time_bound, memory_bound, usable))
            continue
        queue.append((time_bound.seconds, layout, time_bound, memory_bound))
    queue.sort(key=lambda item: (item[0], item[1]))

    run = _Run(spec, gpu, bounds, usable, budget_bytes, reserve_bytes, slots, top, cutoff)
    run.offload = offload
    for position, (seconds, layout, time_bound, memory_bound) in enumerate(queue):
        if seconds > run.kth_time():
            counts["pruned"] += len(queue) - position
            break
        held = run.best.get(layout.arrangement())
        if held is not None and seconds > held.seconds:
            # its arrangement is listed once, with its fastest: another ZeRO stage or exchange
            # already beats this one's lower bound
            counts["pruned"] += 1
            continue
        run.add(layout, time_bound, memory_bound)
    run.refine()
    # the joint DP may speed an offloading layout up: ranked again after it
    shown = sorted(
        (run.compared(e) for e in run.ranked()[:top]),
        key=lambda e: (e.seconds, e.layout.zero, e.layout),
    )
    counts |= {
        "evaluated": run.evaluations,
        "optimal": run.optimal_runs,
        "mixed": run.mixed_runs,
        "over_memory_evaluated": sum(not e.fits for e in run.evaluated),
    }
    rejected = _rejected(run, over, queue, shown, usable)
    least = None if shown else _least_memory(run, over, usable)
    advice = () if least is None else _more_gpus(spec, gpus, gpu, least, usable)
    without = None
    if offload and shown and shown[0].plan.stage_offloads:
        alone = search_layouts(
            spec, gpus, gpu, global_batch, budget_bytes, reserve_bytes, 1, constraints, slots,
            offload=False,
        )  # fmt: skip
        without = alone.layouts[0] if alone.layouts else None
    return LayoutResult(
        spec,
        gpu,
        gpus,
        global_batch,
        budget_bytes,
        reserve_bytes,
        tuple(shown),
        tuple(rejected),
        dict(counts),
        least,
        advice,
        without,
    )


def longest_seq_layouts(
    spec: ModelSpec,
    gpus: int,
    gpu: GPU,
    global_batch: int,
    budget_bytes: int,
    reserve_bytes: int = DEFAULT_RESERVE,
    constraints: dict | None = None,
    slots: int = DEFAULT_SLOTS,
) -> int:
    """The longest sequence (a multiple of `search.auto_step`) at which some layout of `gpus`
    GPUs fits (`search_layouts` finds one); 0 when none does at the smallest. Derived: every
    layout's fitting is true up to its own edge (memory grows with s), so "some layout fits"
    is too, and doubling then bisection finds the largest edge."""
    return largest_value(
        spec,
        "seq",
        lambda candidate: any_layout_fits(
            candidate, gpus, gpu, global_batch, budget_bytes, reserve_bytes, constraints, slots
        ),
    )


def largest_micro_batch_layouts(
    spec: ModelSpec,
    gpus: int,
    gpu: GPU,
    global_batch: int,
    budget_bytes: int,
    reserve_bytes: int = DEFAULT_RESERVE,
    constraints: dict | None = None,
    slots: int = DEFAULT_SLOTS,
) -> int:
    """The largest micro-batch at which some layout of `gpus` GPUs fits with its micro-batch
    fixed there (`any_layout_fits`); 0 when none does at any. The candidates are the divisors
    of `global_batch` (micro_batch·microbatches·dp is the global batch) up to
    `search.auto_limit`, tried from the largest down. Derived: "some layout fits" is not
    monotone over them (a layout that fits at micro-batch N with dp ranks has no counterpart at
    a smaller N' that does not divide global/dp), so no bisection."""
    limit = auto_limit(spec, "micro_batch")
    for candidate in sorted((d for d in divisors(global_batch) if d <= limit), reverse=True):
        fixed = {**(constraints or {}), "micro_batch": candidate}
        if any_layout_fits(
            spec, gpus, gpu, global_batch, budget_bytes, reserve_bytes, fixed, slots
        ):
            return candidate
    return 0


def any_layout_fits(
    spec: ModelSpec,
    gpus: int,
    gpu: GPU,
    global_batch: int,
    budget_bytes: int,
    reserve_bytes: int = DEFAULT_RESERVE,
    constraints: dict | None = None,
    slots: int = DEFAULT_SLOTS,
) -> bool:
    """Whether `search_layouts` would find a layout that fits, without ranking them: the
    layouts whose memory lower bound fits, least bound first, each with its layer-level plans
    and then the DP, coarse and fine (as `search_layouts` evaluates and refines them), until one
    fits. Derived:
    the search keeps every layout that fits until it holds `top` of them, so it finds one
    exactly when one of these does."""
    usable = budget_bytes - reserve_bytes
    space = SearchSpace(spec, gpus, gpu.gpus_per_node, global_batch, dict(constraints or {}))
    bounds = Bounds(spec, gpu)
    under = []
    for layout in layouts(space):
        memory_bound = bounds.layout_memory(layout, usable)
        if allocator.budgeted_bytes(memory_bound.bytes) <= usable:
            under.append((memory_bound.bytes, layout))
    run = _Run(spec, gpu, bounds, usable, budget_bytes, reserve_bytes, slots, 1, math.inf)
    for _, layout in sorted(under):
        try:
            model = spec.replace(**layout_keys_cleared(layout, spec.experts > 0))
        except SpecError:  # not a layout (as `_Run.add`)
            continue
        if run._layer_level(model)[0] is not None:
            return True
        # the coarse DP first and then the fine one, as `refine` runs them: either may find a
        # schedule an export writes where the other's nests
        for screen in (True, False):
            optimal = run._optimal(model, screen=screen)
            if optimal is not None and optimal.fits:
                return True
    return False


def _more_gpus(spec: ModelSpec, gpus: int, gpu: GPU, nearest: Rejected, usable: int):
    """From the nearest layout, the levers that take more GPUs (`plan.advice`): the search
    already tried every layout of these GPUs."""
    from ckplan.plan.advice import advise, over_pcie

    model = spec.replace(**layout_keys_cleared(nearest.layout, spec.experts > 0))
    return tuple(
        f"--gpus {round(gpus * a.gpus_factor):,} laid out with {a.settings}: "
        f"{format_bytes_auto(a.total_bytes)} per GPU with full recomputation"
        for a in advise(model, usable, gpu.gpus_per_node, over_pcie(gpu))
        if a.gpus_factor > 1 and a.fits
    )[:3]


class _Run:
    """The evaluated layouts of one search, the fastest per layout-but-for-ZeRO."""

    def __init__(self, spec, gpu, bounds, usable, budget, reserve, slots, top, cutoff) -> None:
        self.spec, self.gpu, self.bounds, self.usable = spec, gpu, bounds, usable
        self.budget, self.reserve, self.slots, self.top = budget, reserve, slots, top
        self.cutoff = cutoff
        self.offload = True  # try the framework's offload plans (frameworks.offload_strategies)
        self.evaluated: list[Evaluated] = []
        self.best: dict[tuple, Evaluated] = {}  # fitting, per layout.arrangement()
        self.evaluations = self.optimal_runs = self.mixed_runs = 0
        self.unwritten: Candidate | None = None  # the last DP schedule no export writes
        self._kth: float | None = None  # kth_time, until `best` changes

    def kth_time(self) -> float:
        if self._kth is None:  # computed again only after `best` changed
            if len(self.best) < self.top:
                self._kth = self.cutoff
            else:
                seconds = (e.seconds for e in self.best.values())
                self._kth = min(self.cutoff, heapq.nsmallest(self.top, seconds)[-1])
        return self._kth

    def add(self, layout: Layout, time_bound: TimeBound, memory_bound: MemoryBound) -> None:
        self.evaluations += 1
        try:
            spec = self.spec.replace(**layout_keys_cleared(layout, self.spec.experts > 0))
        except SpecError:  # a rule of the spec the enumeration does not know: not a layout
            return
        candidate, smallest, none, recompute, offload = self._layer_level(spec, True)
        reference = self._reference
        undecided = candidate is None  # no layer-level plan fits: the DP decides (`refine`)
        candidate = candidate or smallest
        fit_bound = time_bound.seconds
        if not none.fits:
            stage = none.plan.peak_stage
            fit_bound = self.bounds.recompute_time(
                layout,
                time_bound,
                stage,
                -none.headroom_bytes,
                float(in_flight_microbatches(spec, stage)),
            )
        evaluated = Evaluated(
            layout,
            spec,
            candidate,
            time_bound,
            memory_bound,
            False,
            fit_bound,
            undecided,
            recompute,
            offload,
            reference,
        )
        self.evaluated.append(evaluated)
        self._keep(evaluated)

    def _keep(self, evaluated: Evaluated) -> None:
        """Hold `evaluated` where it is the fastest of its arrangement (the layout but for ZeRO
        and the context-parallel exchange); where it is the
        held layout evaluated again and no faster (`refine`), the held one with its reference
        (the DP's schedule that no export of the framework writes, reported beside it)."""
        if not evaluated.fits:
            return
        key = evaluated.layout.arrangement()
        held = self.best.get(key)
        if held is None or (evaluated.seconds, evaluated.layout.zero) < (
            held.seconds,
            held.layout.zero,
        ):
            self.best[key] = evaluated
            self._kth = None
        elif evaluated.layout == held.layout and evaluated.reference is not held.reference:
            self.best[key] = dataclasses.replace(held, reference=evaluated.reference)

    def _candidate(self, spec: ModelSpec, name: str) -> Candidate:
        plan = evaluate(spec, parse_strategy(name, spec))
        return Candidate(plan, self.usable, None)

    def _timed(self, candidate: Candidate) -> Candidate:
        return dataclasses.replace(candidate, time=step_time(candidate.plan, self.gpu))

    def _layer_level(self, spec: ModelSpec, split: bool = False) -> tuple:
        """(the fastest fitting layer-level plan or None, the least-memory one evaluated,
        `none`); with `split` also the fastest fitting without offloading and with it (or
        None). The offload plans are those the framework runs
        (`frameworks.offload_strategies`), within the GPU's host memory."""
        none = self._candidate(spec, "none")
        self._reference: Candidate | None = None
        if none.fits:
            timed = self._timed(none)
            return (timed, timed, none, timed, None) if split else (timed, timed, none)
        tried = []
        names = ["selective"]
        if spec.framework in MODULE_FRAMEWORKS:
            # Megatron-Core's --recompute-modules, which only Megatron-LM runs
            # (strategies.module_framework_reason; elsewhere the scoped policies cover them):
            # the dense MLP, the MoE block, the others all together, each
            # with the attention core (and the dense MLP)
            if has_dense_layers(spec):
                names += ["mlp", "selective+mlp"]
            if spec.experts:  # no experts-only module (strategies.module_framework_reason)
                names += ["moe", "selective+moe"]
            names += layout_module_candidates(spec)
        # PyTorch's selective checkpointing runs where the layers are PyTorch modules: the
        # framework's policy (`sac`, or `sac-fused` under torchtitan 0.3.0)
        word = policy_word(spec)
        if word is not None:
            names.append(word)
        tried += [self._candidate(spec, name) for name in names]
        prefixes = ("block:", "selective+block:")
        # the policy beside fully recomputed layers where an export writes that, as the sweep
        # offers it (`search.candidate_strategies`): not torchtitan 0.3.0's sac-fused
        if word and not layerwise_export_reason(parse_policy(sweep_policy(spec)), "block:N"):
            prefixes += (f"{word}+block:",)
        blocks = [self._fewest_blocks(spec, prefix) for prefix in prefixes]
        tried += blocks
        if not any(c.exported for c in blocks):
            # Megatron-LM's block method with virtual stages or MTP layers is not ckplan's
            # block:N (exports.megatron.reason): its flags write full recomputation
            tried.append(self._candidate(spec, "full"))
        if check_policy_model(spec) is None:  # the cheapest per-op policy that fits
            best = best_policy_plan(spec, self.usable, self.gpu)
            if best is not None:
                tried.append(Candidate(best, self.usable, None))
        tried += [
            self._offload_candidate(spec, name)
            for name in (offload_strategies(spec.framework, spec.pp) if self.offload else ())
        ]
        tried = [self._timed(c) if c.fits else c for c in tried]
        fitting = [c for c in tried if c.fits]

        def fastest_of(candidates):
            # the fastest an export writes (`search.choose`); an offload plan only where it is
            # faster: at equal time no host memory is pinned
            return choose(candidates, _time_key).best if candidates else None

        chosen = choose(tried, _time_key)
        fastest, smallest = chosen.best, chosen.least
        # a plan no export writes that does better, timed where it fits
        self._reference = chosen.reference
        if fastest is None:
            smallest = self._timed(smallest)
        if not split:
            return fastest, smallest, none
        recompute = fastest_of([c for c in fitting if not c.plan.stage_offloads])
        offload = fastest_of([c for c in fitting if c.plan.stage_offloads])
        return fastest, smallest, none, recompute, offload

    def _offload_candidate(self, spec: ModelSpec, name: str) -> Candidate:
        """An offload plan, its host bytes checked against the GPU's share of host memory."""
        plan = evaluate(spec, parse_strategy(name, spec))
        return Candidate(plan, self.usable, None, host_memory_per_gpu(self.gpu))

    def _fewest_blocks(self, spec: ModelSpec, prefix: str) -> Candidate:
        """block:N with the fewest recomputed layers per stage that fits (memory falls as N
        grows; bisection), or block over every layer when none fits."""
        high = spec.layers_per_stage
        best = self._candidate(spec, f"{prefix}{high}")
        if not best.fits:
            return best
        low = 0  # block:0 is `none` (or `selective`), known not to fit
        while high - low > 1:
            middle = (low + high) // 2
            candidate = self._candidate(spec, f"{prefix}{middle}")
            if candidate.fits:
                high, best = middle, candidate
            else:
                low = middle
        return best

    def _optimal(self, spec: ModelSpec, screen: bool = False) -> Candidate | None:
        """The DP's fastest schedule within the activation budget, None if none fits. With
        `screen`, at about `slots` memory slots in all instead of `slots` per micro-batch in
        flight (`evaluate._stage_schedule`): coarser, so it may recompute more, but always a
        plan that fits, in a fraction of the time."""
        self.optimal_runs += 1
        budget = activation_budget(spec, self.usable)
        slots = self.slots
        if screen:
            slots = max(SCREEN_SLOTS, slots // math.ceil(in_flight_microbatches(spec, 0)) // 4)
        plan = optimal_plan(spec, budget, slots, self.gpu)
        # a schedule no export writes (one that nests) is no layout's plan (`search.choose`):
        # kept as the reference `refine` reports beside it
        found = None if plan is None else self._timed(Candidate(plan, self.usable))
        if found is not None and not found.exported:
            self.unwritten, found = found, None
        return found

    def _mixed(self, spec: ModelSpec, current: str | None = None) -> Candidate | None:
        """The faster of `POLICY+mixed` of the framework's policy (`plan.search.policy_word`)
        and, where the layout's plan is a per-op policy of its
        own (`sac:...`, the frontier's best), `POLICY+mixed` (plan.policy_mix: each layer's full
        tape, the policy's tape or its recomputation) within the activation budget, on the
        layouts of the frameworks whose layers the torch export wraps one by one
        (`MIXED_FRAMEWORKS`) where the policy applies; None elsewhere, with a pipeline (the
        mixed DP plans one micro-batch in flight) or when none fits."""
        word = policy_word(spec)
        if spec.framework not in MIXED_FRAMEWORKS or spec.pp > 1 or word is None:
            return None
        # where an export writes it (not torchtitan 0.3.0's sac-fused beside full-tape layers)
        policy = parse_policy(sweep_policy(spec))
        names = [] if layerwise_export_reason(policy, "mixed") else [f"{word}+mixed"]
        if current is not None and current.startswith(POLICY_PREFIX) and "+" not in current:
            names.append(f"{current}+mixed")
        found = []
        for name in names:
            self.mixed_runs += 1
            try:
                plan = evaluate(
                    spec,
                    parse_strategy(name, spec),
                    budget=activation_budget(spec, self.usable),
                    slots=self.slots,
                    gpu=self.gpu,
                )
            except StrategyError:  # a chain beyond the mixed DP's stages
                return None
            if plan is not None:
                found.append(self._timed(Candidate(plan, self.usable)))
        fitting = [c for c in found if c.fits]
        return choose(fitting, _time_key).best if fitting else None

    def refine(self) -> None:
        """Run the DP, in order of their fit bound (the least time of any plan that fits), on
        the layouts where no layer-level plan fits and on those whose layer-level plan
        recomputes, while that bound is below the K-th best time (updated after each; it only
        falls) and below the plan's own time; keep the faster plan. A layout left undecided
        could not enter the top K whatever the DP found."""
        order = sorted(
            (e.fit_bound, index)
            for index, e in enumerate(self.evaluated)
            if e.undecided or (e.fits and not e.optimal and e.plan.strategy != "none")
        )
        for seconds, index in order:
            e = self.evaluated[index]
            current = math.inf if e.undecided else e.seconds  # an undecided plan does not fit
            if seconds >= min(self.kth_time(), current):
                continue
            self.unwritten = None
            best = self._optimal(e.spec, screen=True)
            if best is None and e.undecided:  # the coarse DP may miss a tight fit
                best = self._optimal(e.spec)
            mixed = self._mixed(e.spec, e.candidate.plan.strategy if not e.undecided else None)
            if (
                mixed is not None
                and mixed.fits
                and (
                    best is None
                    or not best.fits
                    or mixed.time.step_seconds < best.time.step_seconds
                )
            ):
                best = mixed  # kept only where faster than the DP's plan
            candidate, recompute = e.candidate, e.recompute
            if best is not None and best.fits and best.time.step_seconds < current:
                candidate = best
            if (
                best is not None
                and best.fits
                and (recompute is None or best.time.step_seconds < recompute.time.step_seconds)
            ):
                recompute = best
            refined = dataclasses.replace(
                e,
                candidate=candidate,
                optimal=True,
                undecided=False,
                recompute=recompute,
                reference=_nearer(e.reference, self.unwritten),
            )
            self.evaluated[index] = refined
            self._keep(refined)

    def compared(self, e: Evaluated) -> Evaluated:
        """`e` with the fastest recomputation plan found, the DP's included, where an offload
        plan is its best and the DP has not run on it: what `plan` weighs the offload plan
        against, and its plan instead where that is as fast."""
        if not e.plan.stage_offloads or e.optimal:
            return e
        e = self._joint(e)
        best = self._optimal(e.spec)
        recompute = e.recompute
        if (
            best is not None
            and best.fits
            and (recompute is None or best.time.step_seconds < recompute.time.step_seconds)
        ):
            recompute = best
        if recompute is not None and recompute.time.step_seconds <= e.seconds:
            # as fast without offloading: the plan that pins no host memory for its tapes
            return dataclasses.replace(e, candidate=recompute, recompute=recompute, optimal=True)
        return dataclasses.replace(e, recompute=recompute)

    def _joint(self, e: Evaluated) -> Evaluated:
        """`e` with the joint keep/offload/recompute DP's plan (`offload+optimal`) where that is
        faster than its offload plan: on the layouts shown whose best plan offloads, for the
        frameworks whose save_on_cpu hooks place per layer (frameworks.joint_offload)."""
        if not joint_offload(e.spec.framework):
            return e
        budget = activation_budget(e.spec, self.usable)
        plan = offload_optimal_plan(e.spec, budget, self.gpu, self.slots)
        if plan is None:
            return e
        joint = self._timed(Candidate(plan, self.usable, None, host_memory_per_gpu(self.gpu)))
        if not joint.exported or not joint.fits or joint.time.step_seconds >= e.seconds:
            return e
        return dataclasses.replace(e, candidate=joint, offload=joint)

    def ranked(self) -> list[Evaluated]:
        return sorted(self.best.values(), key=lambda e: (e.seconds, e.layout.zero, e.layout))


def _nearer(*references: Candidate | None) -> Candidate | None:
    """Of a layout's plans no export writes, the one that goes furthest: the fastest that
    fits, else the least memory (`search.Choice.reference`); None where there are none."""
    found = [c for c in references if c is not None]
    fitting = [c for c in found if c.fits]
    if fitting:
        return min(fitting, key=_time_key)
    return min(found, key=lambda c: c.plan.total_bytes, default=None)


def _rejected(
    run: _Run, over: list[Rejected], queue, shown: list[Evaluated], usable: int
) -> list[Rejected]:
    """The best rejected layouts: those over memory that would have been faster than the
    fastest shown (by their bound, fastest first), then the fastest ones evaluated or bounded
    that fit but did not make the top K."""
    fastest = shown[0].seconds if shown else float("inf")
    evaluated_over = [
        Rejected(e.layout, "memory", e.time_bound, e.memory_bound, usable, e)
        for e in run.evaluated
        if not e.fits
    ]
    memory = sorted(
        (r for r in over + evaluated_over if r.time_bound.seconds < fastest),
        key=lambda r: (r.time_bound.seconds, r.layout),
    )
    listed = {e.layout.arrangement() for e in shown}
    slower = []
    for e in sorted(run.evaluated, key=lambda e: (e.seconds, e.layout)):
        if e.fits and e.layout.arrangement() not in listed:
            slower.append(Rejected(e.layout, "slower", e.time_bound, e.memory_bound, usable, e))
            listed.add(e.layout.arrangement())
    for seconds, layout, time_bound, memory_bound in queue:
        if len(slower) >= MAX_REJECTED:
            break
        if layout.arrangement() not in listed and seconds >= fastest:
            slower.append(Rejected(layout, "slower", time_bound, memory_bound, usable))
            listed.add(layout.arrangement())
    slower.sort(key=lambda r: (r.seconds, r.layout))
    memory = _distinct(memory)
    states = [r for r in memory if r.reason == "model_states"][:MAX_REJECTED]
    activations = [r for r in memory if r.reason != "model_states"][:MAX_REJECTED]
    return states + activations + slower[:MAX_REJECTED]


def _distinct(rejected: list[Rejected]) -> list[Rejected]:
    """One per arrangement (the layout but for ZeRO and the exchange; the first listed)."""
    seen, kept = set(), []
    for r in rejected:
        key = r.layout.arrangement()
        if key not in seen:
            seen.add(key)
            kept.append(r)
    return kept


def _least_memory(run: _Run, over: list[Rejected], usable: int) -> Rejected | None:
    """When nothing fits: the layout that comes nearest, by its evaluated smallest plan or by
    its memory bound."""
    choices = [
        Rejected(e.layout, "memory", e.time_bound, e.memory_bound, usable, e)
        for e in run.evaluated
        if not e.fits
    ] + over
    return min(choices, key=lambda r: (r.over_bytes, r.time_bound.seconds), default=None)
