"""The best-policy search's objective is the evaluated re-run: the policy `best_policy` picks
within a byte budget re-runs, as the step-time model charges a stored layer under it
(`layer_time(...).core_forward + core_comm`; forward FLOPs without a GPU), no longer than any
policy a brute-force enumeration finds within that budget (stored bytes by `policy_tape_bytes`),
in each replay mode: compiled graph, eager with early stop, eager replayed to the layer's end."""

import random

import pytest
from test_op_policy import small
from test_op_policy_moe_mla import LAYOUTS

from ckplan.hardware.step_time import layer_time, rerun_time
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.layers import distinct_kinds
from ckplan.model.op_policy import (
    OpPolicy,
    policy_tape_bytes,
    policy_text,
    recomputed_forward_flops,
    replays,
    rerun_mask,
    rerun_units,
    unit_ops,
)
from ckplan.plan.policy_search import best_policy, policy_frontier

# (kernels, framework) of each replay mode (`op_policy.replays`)
MODES = {
    "graph": ("compiled", "torchtitan"),
    "early_stop": ("eager", "deepspeed"),
    "whole": ("eager", "torchtitan"),
}
# Enumerate every subset of the units a policy can spare from re-running up to this many;
# beyond, every subset of `AROUND` of them with the others fixed.
FULL_ENUMERATION = 14
AROUND = 10


def evaluated(spec, gpu, kind, names: frozenset[str]) -> float:
    """The re-run of a stored layer keeping `names`, as a plan is timed (`layer_time`'s core
    under the policy; forward FLOPs without a GPU). No policy word keeps nothing: that one's
    units are timed by `rerun_time`, which `layer_time` calls."""
    policy = OpPolicy(names)
    if gpu is None:
        return float(recomputed_forward_flops(spec, policy, kind))
    if not names:
        forward, collectives, _ = rerun_time(spec, gpu, kind, rerun_units(spec, policy, kind))
        return forward.total + collectives
    time = layer_time(spec, gpu, kind, (policy_text(policy),))
    return time.core_forward.total + time.core_comm


def spared_units(spec, kind) -> list[str]:
    """The unit names a policy can spare from re-running: those re-run when nothing is kept. A
    unit not among them never re-runs (keeping a unit never makes another re-run, in each mode
    of `rerun_mask`), so keeping it only adds bytes: the fastest policy within a budget is found
    among subsets of these."""
    units = unit_ops(spec, kind)
    again = rerun_mask(units, (False,) * len(units), replays(spec))
    return list(dict.fromkeys(u.name for u, a in zip(units, again, strict=True) if a))


def enumerated(spec, gpu, kind, free: list[str], fixed: frozenset[str]):
    """(stored bytes, evaluated re-run, kept) of every subset of `free` kept with `fixed`."""
    for bits in range(1 << len(free)):
        names = fixed | {name for b, name in enumerate(free) if bits >> b & 1}
        yield (
            policy_tape_bytes(spec, OpPolicy(names), kind),
            evaluated(spec, gpu, kind, names),
            names,
        )


def budgets(spec, gpu, kind) -> list[int]:
    """Per-layer byte budgets across the frontier: at a few of its points, just below its
    middle one, at its last."""
    frontier = policy_frontier(spec, gpu, kind)
    picks = {frontier[i].tape_bytes for i in range(1, len(frontier), max(1, len(frontier) // 3))}
    picks |= {frontier[-1].tape_bytes, frontier[len(frontier) // 2].tape_bytes - 1}
    return sorted(b for b in picks if b >= frontier[0].tape_bytes)


def check_against_enumeration(spec, gpu, kind, seed: int = 0) -> int:
    """Every budget: the chosen policy's evaluated re-run equals the frontier's cost and is the
    least among the enumerated policies within the budget (equal to it where the enumeration is
    complete, and where it holds the chosen policy). Returns how many policies it evaluated."""
    rng = random.Random(seed)
    spared = spared_units(spec, kind)
    complete = len(spared) <= FULL_ENUMERATION
    everything = list(enumerated(spec, gpu, kind, spared, frozenset())) if complete else []
    count = len(everything)
    for budget in budgets(spec, gpu, kind):
        best = best_policy(spec, budget, gpu, kind)
        chosen = frozenset(best.kept)
        time = evaluated(spec, gpu, kind, chosen)
        assert policy_tape_bytes(spec, OpPolicy(chosen), kind) == best.tape_bytes <= budget
        assert time == pytest.approx(best.cost, rel=1e-12, abs=1e-15)
        if complete:
            least = min(t for size, t, _ in everything if size <= budget)
            assert time == pytest.approx(least, rel=1e-12, abs=1e-15), (budget, sorted(chosen))
            continue
        # around the chosen policy, which holds it, and around a random one
        free = rng.sample(spared, AROUND)
        other = [name for name in spared if name not in free]
        for fixed in (chosen - set(free), frozenset(n for n in other if rng.random() < 0.5)):
            found = list(enumerated(spec, gpu, kind, free, fixed))
            count += len(found)
            fitting = [t for size, t, _ in found if size <= budget]
            if not fitting:
                continue
            assert time <= min(fitting) * (1 + 1e-12) + 1e-15, (budget, sorted(chosen))
            if fixed == chosen - set(free):
                assert time == pytest.approx(min(fitting), rel=1e-12, abs=1e-15)
    return count


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("changes", [{"mlp": "gelu"}, {"tp": 2, "sp": True, "mlp": "gelu"}])
@pytest.mark.parametrize("on_gpu", [False, True])
def test_small_tables_every_policy(mode, changes, on_gpu):
    """A small dense layer (every subset of the units it can spare enumerated): by re-run time
    on an H100, with tensor parallelism and sequence parallelism too (the column projections'
    all-gathers, the reduce-scatter), and by FLOPs."""
    kernels, framework = MODES[mode]
    spec = small(kernels=kernels, framework=framework, **changes)
    assert replays(spec) == mode
    gpu = load_gpu("h100-sxm") if on_gpu else None
    assert len(spared_units(spec, None)) <= FULL_ENUMERATION
    assert check_against_enumeration(spec, gpu, None) > 0


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("model", sorted(LAYOUTS))
def test_real_layer_kinds(model, mode):
    """Llama-3-8B, Mixtral-8x7B and DeepSeek-V3 (its dense and MoE layers) at their usual
    layouts on H100s (tensor, expert and context parallelism): every budget's pick against
    enumerations of the units it can spare (all of them, or 10 at a time around the pick and
    around a random policy)."""
    kernels, framework = MODES[mode]
    layout = dict(LAYOUTS[model])
    if framework == "deepspeed":  # ZeRO 1 beside pipeline parallelism
        layout["zero"] = 1 if layout.get("pp", 1) > 1 else layout["zero"]
    spec = load_spec(model, {"framework": framework, "kernels": kernels, **layout})
    assert replays(spec) == mode
    gpu = load_gpu("h100-sxm")
    for kind in distinct_kinds(spec):
        assert check_against_enumeration(spec, gpu, kind, seed=len(model)) > 0


@pytest.mark.parametrize("model", ["small", "mixtral-8x7b"])
def test_scoped_frontier_costs_are_evaluated_times(model):
    """Every point of the scoped frontier (eager, early stop within each region) costs what a
    stored layer under it re-runs as a plan is timed, with tensor and sequence parallelism
    (the attention's q, k and v share one all-gather)."""
    from ckplan.plan.policy_search import scoped_frontier

    if model == "small":
        spec = small(framework="deepspeed", tp=2, sp=True)
    else:
        spec = load_spec(model, {"framework": "deepspeed", **LAYOUTS[model], "zero": 1})
    gpu = load_gpu("h100-sxm")
    for kind in distinct_kinds(spec):
        points = scoped_frontier(spec, gpu, kind)
        assert points
        for point in points:
            time = layer_time(spec, gpu, kind, (point.strategy,))
            assert point.cost == pytest.approx(
                time.core_forward.total + time.core_comm, rel=1e-12, abs=1e-15
            )
