"""`sweep` and `plan` try the best scoped policy (`sac@REGION=UNIT,...`) the torch export runs,
on eager layers of the frameworks whose per-op plans it exports (`plan.search.SCOPED_FRAMEWORKS`):
where one wins, which it is, that it exports, where it is never offered, and the search against
brute force over every scoped policy a region checkpoint can run."""

from itertools import chain, combinations, product

import pytest
from test_op_policy import small

from ckplan import exports
from ckplan.hardware.step_time import step_time
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model import allocator
from ckplan.model.op_policy import (
    SUBMODULE_REGIONS,
    OpPolicy,
    kept_mask,
    op_recognised,
    parse_policy,
    policy_spans,
    policy_tape_bytes,
    policy_text,
    replays,
    rerun_mask,
    scope_wrap_reason,
    scoped_tape_bytes,
    unit_ops,
)
from ckplan.plan.evaluate import evaluate
from ckplan.plan.layer_chain import layer_chain
from ckplan.plan.layout.search import search_layouts
from ckplan.plan.policy_search import region_layouts, unit_cost
from ckplan.plan.search import DEFAULT_RESERVE, best_policy_plan, policy_points, sweep
from ckplan.plan.strategies import parse_strategy
from ckplan.units import parse_size as parse_bytes

# Llama-3-8B under Hugging Face, eager, 8 GPUs of ZeRO-3 at sequence 8192 on an H100 with 63 GiB
# of budget: the MLP as one region keeping its two input projections (gate_proj, up_proj), the
# rest un-checkpointed, fits where no layer-level policy as fast does.
LLAMA = {"framework": "hf", "kernels": "eager", "seq": 8192, "dp": 8, "zero": 3}
BUDGET = "63GiB"
WINNER = "sac@mlp=gate_proj,up_proj"


def _llama(**changes):
    return load_spec("llama3-8b", {**LLAMA, **changes})


def test_sweep_offers_the_scoped_policy_where_it_beats_the_layer_level_best():
    gpu = load_gpu("h100-sxm")
    spec = _llama()
    result = sweep(spec, parse_bytes(BUDGET), gpu=gpu)
    assert result.best.plan.strategy == WINNER
    usable = parse_bytes(BUDGET) - DEFAULT_RESERVE
    layer_level = best_policy_plan(spec, usable, gpu, scoped=False)
    assert not parse_policy(layer_level.strategy).scopes
    assert step_time(result.best.plan, gpu).step_seconds < step_time(layer_level, gpu).step_seconds
    snippet = exports.export(result.best.plan, "torch").text
    assert "scope_layer" in snippet


def test_plan_offers_the_scoped_policy_and_the_export_runs_it(cli):
    gpu = load_gpu("h100-sxm")
    spec = _llama()
    result = search_layouts(spec, 8, gpu, 8, parse_bytes(BUDGET))
    fastest = result.layouts[0]
    assert fastest.plan.strategy == WINNER
    sets = [arg for key, value in LLAMA.items() for arg in ("--set", f"{key}={value}")]
    code, out, err = cli("export", "llama3-8b", *sets, "-p", WINNER, "--to", "torch")
    assert code == 0, err
    assert "scope_layer" in out


@pytest.mark.parametrize(
    "changes",
    [{"kernels": "compiled"}, {"framework": "torchtitan", "kernels": "compiled"},
     {"framework": "megatron"}],
)  # fmt: skip
def test_never_offered_compiled_or_under_megatron(changes):
    gpu = load_gpu("h100-sxm")
    spec = _llama(**changes)
    result = sweep(spec, parse_bytes(BUDGET), gpu=gpu)
    assert result.candidates
    assert not [c for c in result.candidates if c.plan.strategy.startswith("sac@")]
    assert not [p for p in policy_points(spec, gpu) if p.scopes]
    layouts = search_layouts(spec, 8, gpu, 8, parse_bytes(BUDGET))
    shown = layouts.layouts
    assert shown and not [e for e in shown if e.plan.strategy.startswith("sac@")]


def test_offered_scoped_plans_pass_the_torch_export_rule():
    """Every scoped point searched is one the torch export runs (`scope_wrap_reason`)."""
    gpu = load_gpu("h100-sxm")
    for model in ("llama3-8b", "mixtral-8x7b", "deepseek-v3"):
        spec = load_spec(model, {"framework": "hf", "kernels": "eager"})
        scoped = [p for p in policy_points(spec, gpu) if p.scopes]
        assert scoped
        for point in scoped:
            assert scope_wrap_reason(spec, parse_policy(point.strategy)) is None


def test_offered_scoped_plan_holds_the_scoped_tape_and_fits():
    gpu = load_gpu("h100-sxm")
    spec = _llama()
    usable = parse_bytes(BUDGET) - DEFAULT_RESERVE
    plan = best_policy_plan(spec, usable, gpu)
    policy = parse_policy(plan.strategy)
    assert policy.scopes
    units = unit_ops(spec)
    tape = scoped_tape_bytes(spec, units, policy_spans(spec, policy), kept_mask(spec, policy))
    assert tape == policy_tape_bytes(spec, policy)
    chain = layer_chain(spec, plan.recompute_groups)  # embedding, the layers, output and loss
    assert chain.tape_bytes[1 : spec.layers_per_stage + 1] == (tape,) * spec.layers_per_stage
    assert plan.total_bytes <= allocator.allocatable_bytes(usable)


def _wrapped_policies(spec):
    """Every scoped policy a checkpoint around each region's submodule runs: each layout of
    submodule regions, each subset of each region's recognised units."""
    units = unit_ops(spec)
    for layout in region_layouts(spec):
        if not all(name in SUBMODULE_REGIONS for name, _ in layout):
            continue
        choices = []
        for name, (start, end) in layout:
            names = [u.name for u in units[start:end] if op_recognised(spec, u.name)]
            names = list(dict.fromkeys(names))
            subsets = chain.from_iterable(combinations(names, r) for r in range(len(names) + 1))
            choices.append([(name, frozenset(s)) for s in subsets])
        for scopes in product(*choices):
            yield OpPolicy(scopes=tuple(scopes))


def _cost(spec, policy, gpu):
    units = unit_ops(spec)
    spans = policy_spans(spec, policy)
    again = rerun_mask(units, kept_mask(spec, policy), replays(spec, bool(policy.scopes)), spans)
    return sum(unit_cost(spec, u, gpu) for u, a in zip(units, again, strict=True) if a)


@pytest.mark.parametrize("gpu", [None, "h100-sxm"])
@pytest.mark.parametrize("framework", ["hf", "deepspeed"])
def test_best_policy_plan_is_the_brute_force_cheapest_that_fits(framework, gpu):
    """On the small layer (re-run FLOPs, or time on an H100), for budgets across the range the
    scoped policies span: the plan `best_policy_plan` offers fits, and costs what the cheapest
    fitting policy costs among every wrapped scoped policy (brute force) and the layer-level
    frontier; a scoped one holds its policy's tape."""
    gpu = gpu and load_gpu(gpu)
    spec = small(framework=framework, kernels="eager", layers=4)
    policies = list(_wrapped_policies(spec))
    assert len(policies) > 100
    costs = {policy_text(p): _cost(spec, p, gpu) for p in policies}
    costs |= {p.strategy: p.cost for p in policy_points(spec, gpu, scoped=False)}
    plans = {text: evaluate(spec, parse_strategy(text, spec)) for text in costs}
    totals = sorted({plan.total_bytes for plan in plans.values()})
    kinds = set()
    for total in totals[:: max(1, len(totals) // 16)]:
        usable = total
        while allocator.allocatable_bytes(usable) < total:
            usable += 1 << 10
        fitting = [
            costs[text]
            for text, plan in plans.items()
            if plan.total_bytes <= allocator.allocatable_bytes(usable)
        ]
        offered = best_policy_plan(spec, usable, gpu)
        assert offered is not None and offered.total_bytes <= allocator.allocatable_bytes(usable)
        policy = parse_policy(offered.strategy)
        kinds.add(bool(policy.scopes))
        assert costs[offered.strategy] == pytest.approx(min(fitting), rel=1e-12, abs=1e-12)
        chain = layer_chain(spec, offered.recompute_groups)
        assert chain.tape_bytes[1] == policy_tape_bytes(spec, policy)
    if gpu is not None:  # on time the search offers scoped policies (on FLOPs, none here)
        assert True in kinds


def test_the_export_names_a_module_for_every_submodule_region():
    from ckplan.exports.torch_snippet import REGION_MODULES

    assert tuple(REGION_MODULES) == SUBMODULE_REGIONS


def test_offered_under_torchtitan_eager_through_the_torch_export():
    """Under torchtitan (eager) the search offers scoped policies, which the torch snippet runs
    on its blocks with torchtitan's own checkpointing off; torchtitan's configuration has no
    place for a region and refuses them. On torchtitan 0.3's Llama block no region keeps an
    attention GEMM: q, k and v run as one fused wqkv GEMM there (`op_policy.region_keepable`)."""
    from ckplan.exports import ExportError

    gpu = load_gpu("h100-sxm")
    spec = _llama(framework="torchtitan")
    scoped = [p for p in policy_points(spec, gpu) if p.scopes]
    assert scoped
    fused = {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert not [p for p in scoped if fused & {u for _, kept in p.scopes for u in kept}]
    plan = evaluate(spec, parse_strategy(scoped[0].strategy, spec))
    assert "scope_layer" in exports.export(plan, "torch").text
    with pytest.raises(ExportError):
        exports.export(plan, "torchtitan")
    refused = evaluate(spec, parse_strategy("sac@attention=v_proj", spec))
    with pytest.raises(ExportError, match="fused wqkv"):
        exports.export(refused, "torch")
