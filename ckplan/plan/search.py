"""Plan search under a per-GPU memory budget: every candidate, the Pareto frontier, the best.

The budget a plan must fit is the GPU's memory less a reserve (CUDA context, communication
buffers, allocator slack); what remains holds model states plus the step's peak activations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ckplan.model import allocator, torchtitan_ac
from ckplan.model.memory import model_state_bytes
from ckplan.model.op_policy import (
    NO_EXPORT,
    POLICY_WORDS,
    TORCHTITAN_POLICY,
    check_policy_model,
    layerwise_export_reason,
    parse_policy,
)
from ckplan.model.parts import cached_by_chain
from ckplan.model.spec import SIZE_RANGES, ModelSpec, SpecError
from ckplan.plan.evaluate import DEFAULT_SLOTS, Plan, evaluate
from ckplan.plan.export_limits import framework_note
from ckplan.plan.strategies import (
    MIXED,
    MODULE_FRAMEWORKS,
    Strategy,
    formula_name,
    has_dense_layers,
    module_framework_reason,
    parse_strategy,
)

if TYPE_CHECKING:
    from ckplan.hardware.gpus import GPU
    from ckplan.hardware.step_time import StepTime

# Taken off every budget unless --reserve says otherwise: the CUDA context and cuBLAS/NCCL
# workspaces (about 0.5-1 GiB on H100-class GPUs) plus caching-allocator fragmentation.
DEFAULT_RESERVE = 2 * 2**30
MICRO_BATCH_LIMIT = 4096  # the largest micro-batch `--micro-batch auto` tries
RANKS = ("time", "flops")  # what "best" minimises: step time on a GPU, or total FLOPs
# With a GPU the sweep also stores every tape on host (ckplan.plan.offload) and runs the joint
# DP (offload_optimal_plan); without one a copy would look free.
OFFLOAD_CANDIDATES = ("offload", "selective+offload", "full+offload")
# The sweep re-evaluates its best plan with TiledMLP and with the step in backward; it says so
# where that makes it fit or shortens the step by at least this share
LEVER_GAIN = 0.01


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    budget_bytes: int  # what the plan must fit: budget less reserve
    time: StepTime | None = None  # on the GPU given, if any
    # host memory the plan's offloaded tapes may pin (hardware.host_link), with a GPU
    host_budget_bytes: int | None = None

    @property
    def fits(self) -> bool:
        host = self.host_budget_bytes
        return self.plan.budgeted_bytes <= self.budget_bytes and (
            host is None or self.plan.host_total_bytes <= host
        )

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.plan.budgeted_bytes

    @cached_property
    def unwritten(self) -> tuple[str, ...]:
        """Why no export of the plan's framework writes it, as notes; empty where one does. The
        plan's own notes say no export at all does (`NO_EXPORT`: the sweep's reference
        `revolve:C` schedules that re-run layers more than once, a Megatron-Core module outside
        Megatron-LM, a fused policy beside other layers); else `export_limits.framework_note`
        says that none of its framework's targets does (under Megatron-LM an optimal schedule
        or sequential:K, whose segments are neither --recompute-method uniform nor block), and
        which other export would."""
        notes = tuple(note for note in self.plan.notes if NO_EXPORT in note)
        if notes:
            return notes
        note = framework_note(self.plan)
        return () if note is None else (note,)

    @property
    def exported(self) -> bool:
        """Whether an export of the plan's framework writes it (`unwritten`): what a command
        names as a job's plan."""
        return not self.unwritten


@dataclass(frozen=True)
class Choice:
    """The one rule every command picks a plan by (`choose`): `best`, the first fitting plan an
    export of the job's framework writes (`Candidate.exported`) by the command's order (None
    when none fits); `least`, the plan of least memory such an export writes; `reference`, a
    plan none of them writes (the sweep's nested `revolve:C`; under Megatron-LM an optimal
    schedule only --to torch writes) that does better than what the command names: it fits
    where no written plan does, or it comes before `best` in the order (a shorter step, fewer
    FLOPs, or as many and less memory), or nothing fits and it has less memory than `least`;
    else None. A command names `best` (or `least`) and reports `reference` beside it, never in
    its place: a plan the job's launcher does not run is no answer for that job."""

    best: Candidate | None
    least: Candidate
    reference: Candidate | None = None


def choose(
    candidates: Sequence[Candidate],
    key: Callable[[Candidate], Any],
    written: Callable[[Candidate], bool] | None = None,
) -> Choice:
    """`Choice` among `candidates` (at least one) by `key` (least first). Derived: the rule
    `ckplan check` has kept since it names only a plan an export writes; the candidates
    `written` holds for (default `Candidate.exported`: an export of the job's framework writes
    it); `least` among all of them where none is."""
    is_written = written or (lambda c: c.exported)
    kept = [c for c in candidates if is_written(c)]
    best = min((c for c in kept if c.fits), key=key, default=None)
    least = min(kept or candidates, key=lambda c: c.plan.total_bytes)
    fastest = min((c for c in candidates if c.fits), key=key, default=None)
    if fastest is not None:
        ahead = best is None or key(fastest) < key(best)
        return Choice(best, least, fastest if ahead and not is_written(fastest) else None)
    smallest = min(candidates, key=lambda c: c.plan.total_bytes)
    below = smallest.plan.total_bytes < least.plan.total_bytes and not is_written(smallest)
    return Choice(best, least, smallest if below else None)


@dataclass(frozen=True)
class SweepResult:
    spec: ModelSpec
    budget_bytes: int
    reserve_bytes: int
    candidates: tuple[Candidate, ...]
    pareto: tuple[Candidate, ...]
    best: Candidate | None  # the best fitting plan an export writes (`choose`)
    min_memory_segment: int | None  # the uniform K with the least peak memory
    notes: tuple[str, ...] = ()
    gpu: GPU | None = None
    rank: str = "flops"  # the best plan has the least step time ("time") or FLOPs ("flops")
    # a plan no export writes that does better than `best` (or `smallest_written`): `choose`
    reference: Candidate | None = None

    @property
    def usable_bytes(self) -> int:
        return self.budget_bytes - self.reserve_bytes

    @property
    def smallest(self) -> Candidate:
        """The plan of least memory of all, a reference no export writes among them."""
        return min(self.candidates, key=lambda c: c.plan.total_bytes)

    @property
    def smallest_written(self) -> Candidate:
        """The plan of least memory an export writes (`Choice.least`): what a command names
        when nothing fits."""
        return choose(self.candidates, cost_key(self.rank)).least


def candidate_strategies(spec: ModelSpec) -> list[Strategy]:
    """Every strategy the sweep evaluates (all but `optimal`, which needs the budget).

    uniform:K and sequential:K for K in 1..L, block:N for N in 0..L (sampled beyond 128 layers
    per stage, see `_sizes`), each also with selective
    recomputation, sqrt, and revolve:C for C up to ceil(sqrt(L)) + 1 checkpoint slots: the
    binomial schedules reach below one stored input per segment (Griewank & Walther 2000);
    the dense MLP module (`mlp`, `selective+mlp`) where the model has dense layers;
    Megatron-Core's other modules the model has (`module_candidates`); the module strategies
    (`mlp`, `moe`, `experts` and the others) under Megatron-LM only, the one framework that runs
    them (`strategies.module_framework_reason`: elsewhere the scoped `sac@REGION` is offered);
    the framework's per-op policy (`sweep_policy`: `sac`, or `sac-fused` under torchtitan),
    alone and, where an export writes it (not `sac-fused`), as `POLICY+block:N`.
    """
    layers = spec.layers_per_stage
    names = ["none", "selective", "full", "sqrt"]
    for size in _sizes(1, layers):
        names += [f"uniform:{size}", f"sequential:{size}"]
        names += [f"selective+uniform:{size}", f"selective+sequential:{size}"]
    for size in _sizes(0, layers):
        names += [f"block:{size}", f"selective+block:{size}"]
    names += [f"revolve:{slots}" for slots in revolve_slots(layers)[0]]
    if spec.kind == "transformer" and has_dense_layers(spec):
        # Megatron-Core's --recompute-modules mlp: the dense MLP re-run, alone and with the core
        names += ["mlp", "selective+mlp"]
    if (word := policy_word(spec)) is not None:
        # the framework's per-op policy in every stored layer, alone and beside fully
        # recomputed layers where an export writes that (`op_policy.layerwise_export_reason`)
        names += [word]
        if layerwise_export_reason(parse_policy(sweep_policy(spec)), "block:N") is None:
            names += [f"{word}+block:{size}" for size in _sizes(1, layers)]
    if spec.experts:
        # Recomputing the MoE block or only its expert MLPs, alone, with the attention core,
        # and on top of Megatron's block recompute.
        names += ["moe", "experts", "selective+moe", "selective+experts"]
        for size in _sizes(1, layers):
            names += [f"moe+block:{size}", f"selective+moe+block:{size}"]
    names += module_candidates(spec)
    strategies = [parse_strategy(name, spec) for name in dict.fromkeys(names)]
    # Megatron-Core's modules only where the framework runs them (`module_framework_reason`)
    return _distinct([s for s in strategies if module_framework_reason(spec, s) is None])


def sweep_policy(spec: ModelSpec) -> str | None:
    """The per-op policy (canonical `sac:...` text) the sweep and `plan` try, or None where
    none applies (`check_policy_model`). Under torchtitan the one its default release runs
    (`torchtitan_ac.release_policy`: `sac-fused` for 0.3.0, where ckplan models what its
    SelectiveAC keeps, `sac` for the release of December 2024; None elsewhere, so that nothing
    offered is a policy that release cannot run); under the other frameworks whose layers take
    a selective-checkpoint policy (Hugging Face, DeepSpeed: the exported torch snippet)
    torchtitan 0.2.x's `sac`."""
    if check_policy_model(spec) is not None:
        return None
    if spec.framework == "torchtitan":
        return torchtitan_ac.release_policy(spec, torchtitan_ac.spec_release(spec))
    return TORCHTITAN_POLICY


def policy_word(spec: ModelSpec) -> str | None:
    """`sweep_policy` as a strategy word (`sac`, `sac-fused`), or None."""
    policy = sweep_policy(spec)
    words = {body: word for word, body in POLICY_WORDS.items()}
    return None if policy is None else words[policy]


def _module_words(spec: ModelSpec) -> list[str]:
    """The Megatron-Core modules (other than core_attn, mlp, moe) a transformer has."""
    words = ["layernorm"]
    if spec.experts:
        words += ["moe_act"] + (["shared_experts"] if spec.shared_ffn_hidden else [])
    if spec.mla:
        words.append("mla_up_proj")
    return words


def module_candidates(spec: ModelSpec) -> list[str]:
    """Megatron-Core's output-discarding and shared-expert modules (layernorm, moe_act,
    mla_up_proj, shared_experts) the model has: each alone and with the attention core, all of
    them together, with the core, and with the core and the dense MLP: at most 11 names, each
    in every stored layer (no layer-level segments: Megatron-LM's selective granularity takes
    no --recompute-method)."""
    if spec.kind != "transformer":
        return []
    words = _module_words(spec)
    names = [name for word in words for name in (word, f"selective+{word}")]
    every = "+".join(words)
    names += [every, f"selective+{every}"]
    if has_dense_layers(spec):
        names.append(f"selective+mlp+{every}")
    return names


def layout_module_candidates(spec: ModelSpec) -> list[str]:
    """The module sets the layout search tries: every module the model has together, with the
    attention core, and with the core and the dense MLP (the last names of
    `module_candidates`; each module alone would cost the search's memory bound more than it
    finds, as a set of them stores less for a few more norms' or activations' re-run)."""
    names = module_candidates(spec)
    return names[-3:] if has_dense_layers(spec) else names[-2:]


REVOLVE_MAX_STEPS = 100_000  # schedule steps the revolve candidates of one sweep replay at most


def revolve_slots(layers: int) -> tuple[list[int], list[int]]:
    """(kept, skipped) revolve:C candidates, C = 1..ceil(sqrt(L)) + 1: the most slots first
    (the shortest schedules), while their steps, 2n + t(n, C) each (revolve_min_forwards),
    add up to at most REVOLVE_MAX_STEPS; every C is kept up to about 350 layers per stage."""
    from ckplan.schedules.revolve import revolve_min_forwards

    stages = layers + 2  # embedding and output at most
    kept, skipped, total = [], [], 0
    for slots in range(math.isqrt(layers) + 2, 0, -1):
        total += 2 * stages + revolve_min_forwards(stages, slots)
        (kept if total <= REVOLVE_MAX_STEPS else skipped).append(slots)
    return sorted(kept), sorted(skipped)


EVERY_SIZE_UP_TO = 128  # beyond this many layers per stage, sizes are sampled


def _sizes(low: int, high: int) -> list[int]:
    """Every size in low..high; for very deep stages every size up to EVERY_SIZE_UP_TO, then
    about 10% steps and every divisor of `high`, so a sweep stays fast."""
    if high <= EVERY_SIZE_UP_TO:
        return list(range(low, high + 1))
    sizes = set(range(low, EVERY_SIZE_UP_TO + 1))
    size = EVERY_SIZE_UP_TO
    while size < high:
        size = max(size + 1, round(size * 1.1))
        sizes.add(min(size, high))
    sizes |= {k for k in range(1, math.isqrt(high) + 1) if high % k == 0}
    sizes |= {high // k for k in range(1, math.isqrt(high) + 1) if high % k == 0}
    return sorted(size for size in sizes if low <= size <= high)


def activation_budget(spec: ModelSpec, usable_bytes: int) -> int:
    """What is left for activations once model states are placed (may be negative): the
    allocated bytes that fit `usable_bytes` (model.allocator), less the states."""
    allocatable = allocator.allocatable_bytes(usable_bytes)
    return allocatable - model_state_bytes(spec).total


def sweep(
    spec: ModelSpec,
    budget_bytes: int,
    reserve_bytes: int = DEFAULT_RESERVE,
    formula: str = "derived",
    slots: int = DEFAULT_SLOTS,
    gpu: GPU | None = None,
    rank: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SweepResult:
    """Evaluate every candidate against `budget_bytes - reserve_bytes` and pick the cheapest
    plan an export writes that fits: the least step time on `gpu` (rank "time", the default
    with a GPU) or the least total FLOPs (rank "flops"); ties go to the smaller peak; a
    reference no export writes that does better is kept beside it (`choose`). With a GPU
    every plan is timed (`hardware.step_time`). `progress(done, total)` is told after each
    candidate (the optimal schedule counts as the last one)."""
    rank = _rank(gpu, rank)
    usable = budget_bytes - reserve_bytes
    formula = formula_name(formula)
    strategies = candidate_strategies(spec) if formula == "derived" else _simple_strategies(spec)
    plans = []
    if formula == "derived" and gpu is not None and spec.pipeline_schedule != "dualpipe":
        # Tapes on host cost copy time only a GPU's host link and stage times can price (not
        # modelled under DualPipe: `evaluate._evaluate_offload`).
        strategies += [parse_strategy(name, spec) for name in OFFLOAD_CANDIDATES]
    for done, strategy in enumerate(strategies, 1):
        plans.append(evaluate(spec, strategy, formula))
        if progress is not None:
            progress(done, len(strategies) + 1)
    notes = []
    skipped = revolve_slots(spec.layers_per_stage)[1] if formula == "derived" else []
    if skipped:
        which = f"{skipped[0]}" if len(skipped) == 1 else f"{skipped[0]}..{skipped[-1]}"
        notes.append(
            f"revolve:{which} not evaluated: too many steps to replay at "
            f"{spec.layers_per_stage} layers per stage"
        )
    if formula == "derived":
        optimal = optimal_plan(spec, activation_budget(spec, usable), slots, gpu)
        if optimal is not None:
            plans.append(optimal)
        # with a GPU only: elementwise re-runs cost time, not FLOPs
        policy = best_policy_plan(spec, usable, gpu) if gpu is not None else None
        if policy is not None and policy.strategy not in {plan.strategy for plan in plans}:
            plans.append(policy)
        if gpu is not None:
            joint = offload_optimal_plan(spec, activation_budget(spec, usable), gpu, slots)
            if joint is not None:
                plans.append(joint)
            mixed = mixed_plan(spec, activation_budget(spec, usable), gpu, slots)
            if mixed is not None:
                plans.append(mixed)
    if progress is not None:
        progress(len(strategies) + 1, len(strategies) + 1)
    candidates = tuple(_candidate(plan, usable, gpu) for plan in plans)
    cost = cost_key(rank)
    chosen = choose(candidates, cost)
    stored = [c for c in candidates if not c.plan.stage_offloads]  # TiledMLP: tapes on GPU
    if formula == "derived" and stored:
        kept = choose(stored, cost)  # the plan the levers re-evaluate: one an export writes
        lever_plan = kept.best or min(
            [c for c in stored if c.exported] or stored, key=lambda c: c.plan.reserved_bytes
        )
        for lever in (tiled_mlp_note, zero_grad_note, in_backward_note):
            if note := lever(lever_plan, usable, gpu, slots):
                notes.append(note)
    uniform = [c for c in candidates if c.plan.strategy.startswith("uniform:")]
    min_segment = (
        int(min(uniform, key=lambda c: c.plan.activation_bytes).plan.strategy.split(":")[1])
        if uniform
        else None
    )
    return SweepResult(
        spec,
        budget_bytes,
        reserve_bytes,
        candidates,
        pareto_frontier(candidates, rank),
        chosen.best,
        min_segment,
        tuple(notes),
        gpu,
        rank,
        chosen.reference,
    )


def _rank(gpu: GPU | None, rank: str | None) -> str:
    if rank is None:
        return "time" if gpu is not None else "flops"
    if rank not in RANKS:
        raise ValueError(f"rank must be one of {', '.join(RANKS)}, got {rank!r}")
    if rank == "time" and gpu is None:
        raise ValueError("ranking by step time needs a GPU")
    return rank


def _candidate(plan: Plan, usable: int, gpu: GPU | None) -> Candidate:
    if gpu is None:
        return Candidate(plan, usable)
    from ckplan.hardware.host_link import host_memory_per_gpu
    from ckplan.hardware.step_time import step_time  # only with a GPU (start-up time)

    return Candidate(plan, usable, step_time(plan, gpu), host_memory_per_gpu(gpu))


def _simple_strategies(spec: ModelSpec) -> list[Strategy]:
    """What the simple formula set can say: none, selective and segments."""
    names = ["none", "selective", "full", "sqrt"] + [
        f"uniform:{k}" for k in _sizes(1, spec.layers_per_stage)
    ]
    return _distinct([parse_strategy(name, spec) for name in dict.fromkeys(names)])


def optimal_plan(
    spec: ModelSpec, budget: int, slots: int = DEFAULT_SLOTS, gpu: GPU | None = None
) -> Plan | None:
    """The cheaper of `optimal` and `selective+optimal` (with dense flash-attention layers also
    `POLICY+optimal` of `sweep_policy` where an export writes it, not `sac-fused`,
    `op_policy.layerwise_export_reason`; with experts under Megatron-LM, which runs the moe
    module, also `moe+optimal` and `selective+moe+optimal`) within
    `budget` activation bytes (in FLOPs, or in step time on `gpu`; ties go to the smaller
    peak); None when none fits. The DP itself minimises recompute FLOPs (rotor's costs are the
    chain's FLOPs)."""
    if budget <= 0:
        return None
    found = []
    strategies = [Strategy("optimal"), Strategy("optimal", selective=True)]
    policy = sweep_policy(spec)
    if policy is not None and layerwise_export_reason(parse_policy(policy), "optimal") is None:
        strategies.append(Strategy("optimal", policy=policy))
    if spec.experts and spec.framework in MODULE_FRAMEWORKS:
        strategies += [Strategy("optimal", moe="moe"), Strategy("optimal", None, True, "moe")]
    for strategy in strategies:
        if (
            gpu is None
            and found
            and _least_flops(spec, strategy) > min(plan.flops.total for plan in found)
        ):
            # Its plan recomputes at least what storing everything does (the same groups), so
            # it costs more FLOPs than a plan already found: the DP need not run.
            continue
        plan = evaluate(spec, strategy, budget=budget, slots=slots)
        if plan is not None:
            found.append(plan)
    if not found:
        return None
    if gpu is not None:
        from ckplan.hardware.step_time import step_time

        return min(found, key=lambda p: (step_time(p, gpu).step_seconds, p.activation_bytes))
    return min(found, key=lambda p: (p.flops.total, p.activation_bytes))


def mixed_plan(spec: ModelSpec, budget: int, gpu: GPU, slots: int = DEFAULT_SLOTS) -> Plan | None:
    """`POLICY+mixed` of `sweep_policy` within `budget` activation bytes, in step time on
    `gpu`, where a policy applies, one micro-batch is in flight (pp = 1) and an export writes
    it (`op_policy.layerwise_export_reason`: not torchtitan 0.3.0's `sac-fused`); else None."""
    from ckplan.schedules.policy_mix import MIX_MAX_STAGES

    policy = sweep_policy(spec)
    if budget <= 0 or spec.pp > 1 or policy is None:
        return None
    if layerwise_export_reason(parse_policy(policy), "mixed") is not None:
        return None  # offered only where an export writes it
    if spec.layers_per_stage + 2 > MIX_MAX_STAGES:
        return None
    strategy = Strategy(kind=MIXED, policy=policy)
    return evaluate(spec, strategy, budget=budget, slots=slots, gpu=gpu)


# Frameworks whose layers `sweep` and `plan` try scoped policies (`sac@REGION=UNIT,...`) on:
# those per-op policies are offered on (`best_policy_plan`), whose per-op plans the torch export
# runs (DeepSpeed's config and torchtitan's have no place for a region; the torch snippet wraps
# the layers' submodules, on torchtitan's blocks with its own activation checkpointing off:
# tests/test_torchtitan_scoped.py).
SCOPED_FRAMEWORKS = ("hf", "deepspeed", "torchtitan")


def best_policy_plan(
    spec: ModelSpec, usable: int, gpu: GPU | None = None, scoped: bool = True
) -> Plan | None:
    """The plan of the cheapest per-op policy (`policy_search.policy_frontier`: re-run time on
    `gpu`, FLOPs without) whose plan fits `usable` bytes; None when the model has no policies
    or none fits. With `scoped`, among the scoped policies the torch export runs too
    (`policy_points`). A plan's peak grows with its policy's stored bytes, so a binary search
    over the frontier (by bytes) finds the last that fits. Under torchtitan only scoped ones
    (`policy_points`): its releases run their own op lists only (`torchtitan_ac.policy_reason`),
    never one the layer-level frontier picks."""
    if spec.kind != "transformer" or check_policy_model(spec) is not None:
        return None
    frontier = policy_points(spec, gpu, scoped)
    allocatable = allocator.allocatable_bytes(usable)

    def plan_of(index: int) -> Plan:
        return evaluate(spec, parse_strategy(frontier[index].strategy, spec))

    low, high, found = 0, len(frontier) - 1, None
    while low <= high:
        middle = (low + high) // 2
        plan = plan_of(middle)
        if plan.total_bytes <= allocatable:
            found, low = plan, middle + 1
        else:
            high = middle - 1
    return found


@cached_by_chain(256)
def policy_points(spec: ModelSpec, gpu: GPU | None = None, scoped: bool = True) -> tuple:
    """The per-op policies `best_policy_plan` searches, by stored bytes, each cheaper than all
    before it: the layer-level frontier's points that keep something and, with `scoped`, on
    eager layers of `SCOPED_FRAMEWORKS` (`op_policy.scope_model_reason`), the scoped frontier
    of the policies a checkpoint around each region's submodule runs
    (`policy_search.scoped_frontier(wrapped=True)`). Cached per GPU and the parts one GPU's
    layers depend on (`parts.cached_by_chain`): the scoped frontier takes about a second on an
    MoE layer, and layouts that differ only in dp, ZeRO or the micro-batch count share it.
    Under torchtitan the scoped ones alone, which the torch snippet runs with torchtitan's
    checkpointing off (its configuration runs its own layer-level op lists only), on layouts
    without tensor parallelism."""
    from ckplan.plan.policy_search import policy_frontier

    points = []
    if spec.framework != "torchtitan":
        points = [point for point in policy_frontier(spec, gpu) if point.kept]
    # on torchtitan's blocks the snippet is checked on one rank's block (tp 1,
    # tests/test_torchtitan_scoped.py); with tensor parallelism the regions run on DTensors
    checked = spec.framework != "torchtitan" or spec.tp == 1
    if scoped and spec.framework in SCOPED_FRAMEWORKS and checked:
        points += _wrapped_frontier(_one_stage(spec), gpu)
    points.sort(key=lambda p: (p.tape_bytes, p.cost, bool(p.scopes)))
    merged: list = []
    for point in points:
        if not merged or point.cost < merged[-1].cost:
            merged.append(point)
    return tuple(merged)


# The pipeline's keys: how the layers are split over stages, not what one layer holds or costs.
_ONE_STAGE = {
    "pp": 1, "virtual_stages": 1, "first_stage_layers": None, "last_stage_layers": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False, "pipeline_layout": None,
    "pipeline_schedule": "1f1b",
}  # fmt: skip


def _one_stage(spec: ModelSpec):
    """The parts one layer's ops, tape and re-run time depend on (`spec.chain`), with the
    pipeline's keys at one stage: the scoped frontier of a layer is the same on every pipeline
    layout (tests/test_op_policy_moe_mla.py), so layouts that differ only there share it."""
    return spec.chain.replace(**_ONE_STAGE)


@cached_by_chain(256)
def _wrapped_frontier(spec, gpu: GPU | None) -> tuple:
    from ckplan.plan.policy_search import scoped_frontier

    return scoped_frontier(spec, gpu, wrapped=True)


def offload_optimal_plan(
    spec: ModelSpec, budget: int, gpu: GPU, slots: int = DEFAULT_SLOTS
) -> Plan | None:
    """The faster on `gpu` of `offload+optimal` and `selective+offload+optimal` within `budget`
    activation bytes and the GPU's host memory (ties go to the smaller peak); None when neither
    fits, with pipeline parallelism (the joint DP plans one micro-batch in flight), beyond
    the joint DP's chain length (`schedules.offload.JOINT_MAX_STAGES`) or its costs."""
    from ckplan.schedules.offload import JOINT_MAX_STAGES

    if budget <= 0 or spec.pp > 1 or spec.layers_per_stage + 2 > JOINT_MAX_STAGES:
        return None
    from ckplan.hardware.step_time import step_time
    from ckplan.plan.strategies import StrategyError

    found = []
    for strategy in (
        Strategy("optimal", offload=True),
        Strategy("optimal", selective=True, offload=True),
    ):
        try:
            plan = evaluate(spec, strategy, budget=budget, slots=slots, gpu=gpu)
        except StrategyError:  # times the exact DP cannot hold (`plan.offload.offload_stage`)
            continue
        if plan is not None:
            found.append(plan)
    if not found:
        return None
    return min(found, key=lambda p: (step_time(p, gpu).step_seconds, p.activation_bytes))


def _least_flops(spec: ModelSpec, strategy: Strategy) -> int:
    """A lower bound on the FLOPs of `strategy`'s plans: its recompute groups with every layer
    stored (a schedule only adds re-forwards to that, on every pipeline stage)."""
    stored = Strategy(
        "none",
        None,
        strategy.selective,
        strategy.moe,
        strategy.mlp,
        strategy.policy,
        modules=strategy.modules,
    )
    return evaluate(spec, stored).flops.total


def _cost(candidate: Candidate, rank: str) -> float:
    if rank == "time" and candidate.time is not None:
        return candidate.time.step_seconds
    return candidate.plan.flops.total


def cost_key(rank: str = "flops"):
    """The best plan's order: least cost, then no offloaded tapes, then least memory. By FLOPs,
    plans of equal FLOPs
    first by how many recompute groups they re-run: a re-run without FLOPs (a norm's, an
    activation's) still takes time that a FLOP count does not see."""
    if rank == "time":
        # at equal step time a plan that pins no host memory for its tapes comes first
        return lambda candidate: (
            _cost(candidate, rank),
            bool(candidate.plan.stage_offloads),
            candidate.plan.total_bytes,
        )
    return lambda candidate: (
        _cost(candidate, rank),
        len(candidate.plan.recompute_groups),
        bool(candidate.plan.stage_offloads),
        candidate.plan.total_bytes,
    )


def pareto_frontier(
    candidates: tuple[Candidate, ...], rank: str = "flops"
) -> tuple[Candidate, ...]:
    """Plans no other plan beats on both peak memory and cost (FLOPs, or step time with rank
    "time"), by increasing memory."""
    frontier: list[Candidate] = []
    for candidate in sorted(candidates, key=lambda c: (c.plan.total_bytes, _cost(c, rank))):
        if not frontier or _cost(candidate, rank) < _cost(frontier[-1], rank):
            frontier.append(candidate)
    return tuple(frontier)


@dataclass(frozen=True)
class Checked:
    """What `ckplan check` names for one model: `candidate`, the plan it checks (None when
    `optimal` finds no schedule within the budget), and `reference`, a plan no export writes
    that does better (`Choice.reference`), reported beside it; None otherwise."""

    candidate: Candidate | None
    reference: Candidate | None = None


def check_plan(
    spec: ModelSpec,
    budget_bytes: int,
    strategy: str = "auto",
    reserve_bytes: int = DEFAULT_RESERVE,
    slots: int = DEFAULT_SLOTS,
    gpu: GPU | None = None,
    rank: str | None = None,
) -> Checked:
    """For `ckplan check`: with `auto`, the sweep's best plan (the cheapest fitting plan an
    export writes, the fastest with a GPU), else the smallest such plan, with the sweep's
    reference beside it (`choose`): a CI job needs a plan it can export and run. Else the
    named strategy's plan."""
    usable = budget_bytes - reserve_bytes
    if strategy == "auto":
        result = sweep(spec, budget_bytes, reserve_bytes, slots=slots, gpu=gpu, rank=rank)
        return Checked(result.best or result.smallest_written, result.reference)
    parsed = parse_strategy(strategy, spec)
    budget = activation_budget(spec, usable) if parsed.kind == "optimal" else None
    if budget is not None and budget <= 0:
        return Checked(None)
    plan = evaluate(spec, parsed, budget=budget, slots=slots, gpu=gpu)
    return Checked(None if plan is None else _candidate(plan, usable, gpu))


SEQ_GRANULE = 256  # `--seq auto` answers in whole multiples of this many tokens
AUTO_KEYS = ("seq", "micro_batch")  # what `--seq auto` and `--micro-batch auto` search


def auto_step(spec: ModelSpec, key: str) -> int:
    """The values `largest_fitting` tries are multiples of this: SEQ_GRANULE tokens (and of
    2·cp, which context parallelism's load-balanced split needs) for seq, 1 for micro_batch."""
    if key == "micro_batch":
        return 1
    return math.lcm(SEQ_GRANULE, 2 * spec.cp) if spec.cp > 1 else SEQ_GRANULE


def auto_limit(spec: ModelSpec, key: str) -> int:
    """The largest multiple of `auto_step` tried: the documented range of seq
    (`SIZE_RANGES`), MICRO_BATCH_LIMIT micro-batches."""
    if key == "micro_batch":
        return MICRO_BATCH_LIMIT
    return SIZE_RANGES["seq"][1] // auto_step(spec, key)


def fitting_plan(
    spec: ModelSpec,
    strategy: Strategy,
    usable_bytes: int,
    gpu: GPU | None = None,
    formula: str = "derived",
    slots: int = DEFAULT_SLOTS,
) -> Plan | None:
    """`strategy`'s plan on `spec` when its reserved peak fits `usable_bytes` (and, with a
    GPU, its offloaded tapes the host memory), else None. An `optimal` strategy is solved for
    the activation budget those bytes leave (`activation_budget`), as `check_plan` does."""
    budget = None
    if strategy.kind == "optimal":
        budget = activation_budget(spec, usable_bytes)
        if budget <= 0:
            return None
    plan = evaluate(spec, strategy, formula, budget=budget, slots=slots, gpu=gpu)
    if plan is None or plan.budgeted_bytes > usable_bytes:
        return None
    if gpu is not None and plan.host_total_bytes:
        from ckplan.hardware.host_link import host_memory_per_gpu

        if plan.host_total_bytes > host_memory_per_gpu(gpu):
            return None
    return plan


def largest_fitting(
    spec: ModelSpec,
    strategy: Strategy,
    usable_bytes: int,
    key: str,
    gpu: GPU | None = None,
    formula: str = "derived",
    slots: int = DEFAULT_SLOTS,
) -> int:
    """The largest `key` ("seq" or "micro_batch"), a multiple of `auto_step` up to
    `auto_limit`, at which `strategy`'s plan fits `usable_bytes` (`fitting_plan`); 0 when not
    even the smallest does. Derived: peak memory grows with s and b for a fixed strategy
    (tests/test_properties.py checks it on a grid), so fitting is true up to some value and
    false beyond, and doubling then bisection (`largest_true`) finds the edge in O(log n) plans.
    A value the model refuses (`SpecError`: a range, a divisibility) counts as not fitting."""
    return largest_value(
        spec,
        key,
        lambda candidate: (
            fitting_plan(candidate, strategy, usable_bytes, gpu, formula, slots) is not None
        ),
    )


def largest_fitting_any(
    spec: ModelSpec,
    budget_bytes: int,
    reserve_bytes: int,
    key: str,
    gpu: GPU | None = None,
    slots: int = DEFAULT_SLOTS,
    formula: str = "derived",
) -> int:
    """The largest `key` (as `largest_fitting`) at which some plan its framework's exports write
    fits (the sweep's `best`, `choose`); 0 when none does at the smallest value. Derived: each
    plan's fitting is true up to its own edge, so "some plan fits" is true up to the largest
    edge, and the same doubling and bisection finds it."""

    def fits(candidate: ModelSpec) -> bool:
        return sweep(candidate, budget_bytes, reserve_bytes, formula, slots, gpu).best is not None

    return largest_value(spec, key, fits)


def longest_seq(spec: ModelSpec, strategy: Strategy, usable_bytes: int) -> int:
    """The longest sequence, a multiple of SEQ_GRANULE (and of 2·cp), whose plan fits (0 if
    not even one granule does): `largest_fitting` over seq."""
    return largest_fitting(spec, strategy, usable_bytes, "seq")


def largest_micro_batch(spec: ModelSpec, strategy: Strategy, usable_bytes: int) -> int:
    """The largest micro-batch whose plan fits (0 if not even 1 does): `largest_fitting` over
    micro_batch."""
    return largest_fitting(spec, strategy, usable_bytes, "micro_batch")


def largest_value(spec: ModelSpec, key: str, fits: Callable[[ModelSpec], bool]) -> int:
    """The largest `key` ("seq" or "micro_batch"), a multiple of `auto_step` up to
    `auto_limit`, at which `fits(spec with that value)` holds, by `largest_true`; 0 when not
    even the smallest does. A value the model refuses (`SpecError`: a range, a divisibility)
    counts as not fitting. `fits` must hold up to some value and fail beyond it."""
    if key not in AUTO_KEYS:
        raise ValueError(f"key must be one of {', '.join(AUTO_KEYS)}, got {key!r}")
    step = auto_step(spec, key)

    def holds(units: int) -> bool:
        try:
            candidate = spec.replace(**{key: units * step})
        except SpecError:
            return False
        return fits(candidate)

    return largest_true(holds, auto_limit(spec, key)) * step


def largest_true(fits, limit: int) -> int:
    """The largest n in 1..limit with fits(n), for a `fits` true up to some n and false beyond
    (memory grows with n); 0 if fits(1) is false. Doubling, then bisection: O(log n) calls."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _distinct(strategies: list[Strategy]) -> list[Strategy]:
    """Each strategy once by name (with mlp_tiles every name gains the mlp word)."""
    return list({strategy.name: strategy for strategy in strategies}.values())


def tiled_mlp_tiles(spec: ModelSpec) -> int | None:
    """The TiledMLP tile count the sweep tries on a long sequence: DeepSpeed's example,
    ceil(seqlen / hidden) (deepspeed/runtime/sequence_parallel/ulysses_sp.py `TiledMLP`,
    v0.19.8), over the tokens of a micro-batch per rank; None where it does not apply (a
    sequence shorter than twice the hidden size, experts, mlp_tiles already set)."""
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    if spec.kind != "transformer" or spec.experts or spec.mlp_tiles > 1:
        return None
    if tokens < 2 * spec.hidden:
        return None
    return -(-tokens // spec.hidden)


def tiled_mlp_note(
    reference: Candidate, usable: int, gpu: GPU | None, slots: int = DEFAULT_SLOTS
) -> str | None:
    """On a long sequence, the sweep's best plan that keeps its tapes on the GPU (or, when none
    fits, its smallest) evaluated again with TiledMLP (`tiled_mlp_tiles`) under the same
    budget: one line when it helps (`lever_note`)."""
    tiles = tiled_mlp_tiles(reference.plan.spec)
    if tiles is None:
        return None
    return lever_note(reference, {"mlp_tiles": tiles}, "TiledMLP", usable, gpu, slots)


def in_backward_note(
    reference: Candidate, usable: int, gpu: GPU | None, slots: int = DEFAULT_SLOTS
) -> str | None:
    """The same plan with the optimizer stepping in backward (`optimizer_in_backward`: one
    layer's gradients held instead of all of them), where the model allows it (one pipeline
    stage, one micro-batch, no experts, model states on the GPU): one line when it helps."""
    spec = reference.plan.spec
    if (
        spec.optimizer_in_backward
        or spec.pp > 1
        or spec.microbatches > 1
        or spec.experts
        or spec.optimizer_offload != "none"
    ):
        return None
    changes = {"optimizer_in_backward": True}
    if spec.zero_grad != "none":  # its hooks free each gradient after its step
        changes["zero_grad"] = "none"
    return lever_note(reference, changes, "Optimizer in backward", usable, gpu, slots)


def zero_grad_note(
    reference: Candidate, usable: int, gpu: GPU | None, slots: int = DEFAULT_SLOTS
) -> str | None:
    """The same plan with the gradients set to None between steps (`zero_grad: none`, PyTorch's
    default since 2.0) where the model keeps them zeroed: one line when it helps."""
    if reference.plan.spec.zero_grad == "none":
        return None
    changes = {"zero_grad": "none"}
    return lever_note(reference, changes, "Gradients set to None", usable, gpu, slots)


def lever_note(
    reference: Candidate,
    changes: dict,
    label: str,
    usable: int,
    gpu: GPU | None,
    slots: int = DEFAULT_SLOTS,
) -> str | None:
    """`reference`'s strategy evaluated again on the model with `changes` under the same
    budget: one line when it helps (it fits where the plan did not, or, timed on a GPU, its
    step is at least LEVER_GAIN shorter), None otherwise."""
    from ckplan.plan.strategies import StrategyError

    try:
        changed = reference.plan.spec.replace(**changes)
        strategy = parse_strategy(reference.plan.strategy, changed)
    except (SpecError, StrategyError):
        return None
    budget = activation_budget(changed, usable)
    plan = evaluate(changed, strategy, "derived", budget=budget, slots=slots, gpu=gpu)
    if plan is None:
        return None
    candidate = _candidate(plan, usable, gpu)
    before, after = reference.plan.total_bytes, plan.total_bytes
    if not candidate.fits:
        return None
    if reference.fits:  # a shorter step, with a GPU to time it
        if gpu is None:
            return None
        if candidate.time.step_seconds >= (1 - LEVER_GAIN) * reference.time.step_seconds:
            return None
    from ckplan.units import format_bytes

    keys = " ".join(f"--set {key}={str(value).lower()}" for key, value in changes.items())
    text = (
        f"{label} ({keys}): {plan.strategy} peaks at {format_bytes(after)} "
        f"(fits; {reference.plan.strategy} without it: {format_bytes(before)})"
    )
    if candidate.time is not None and reference.time is not None:
        text += (
            f", step {candidate.time.step_seconds:.3f} s instead of "
            f"{reference.time.step_seconds:.3f} s"
        )
    return text + "."
