"""The layout search (ckplan/plan/layout): the enumeration follows Megatron-LM's rules, the
bounds bound, and the search agrees with brute force over a small grid."""

from collections import defaultdict

import pytest

from ckplan.hardware.host_link import host_memory_per_gpu
from ckplan.hardware.step_time import step_time
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.frameworks import offload_strategies
from ckplan.model.spec import spec_from_mapping
from ckplan.plan.evaluate import evaluate
from ckplan.plan.layout.bounds import Bounds, layout_keys_cleared
from ckplan.plan.layout.search import search_layouts
from ckplan.plan.layout.space import SearchSpace, Split, divisors, layouts, pipeline_splits
from ckplan.plan.search import DEFAULT_RESERVE, Candidate, optimal_plan
from ckplan.plan.strategies import parse_strategy

GPU = load_gpu("h100-sxm")
SMALL = load_spec("gpt2", {"seq": 1024, "layers": 4})
GIB = 2**30


def layout_spec(spec, layout):
    return spec.replace(**layout_keys_cleared(layout, spec.experts > 0))


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]
    assert divisors(16) == [1, 2, 4, 8, 16]


def test_llama3_405b_over_pp16_counts_embedding_and_loss():
    """126 layers over 16 stages: Megatron's account_for_embedding/loss split (128 items, 8
    each: 7 layers on the first and last stage, 8 on the 14 others), and explicit first/last
    splits around middle stages of 8 layers (rest 14 = 7 + 7, or 8 + 6, 6 + 8)."""
    splits = pipeline_splits(126, 16)
    assert Split(embedding=True, loss=True) in splits
    assert Split(first=7, last=7) not in splits  # the same stage counts as the embedding/loss
    assert Split(first=8, last=6) in splits and Split(first=6, last=8) in splits
    assert pipeline_splits(80, 16) == [Split()]  # pp divides: the even split only
    assert pipeline_splits(3, 4) == []  # a stage would be empty


def test_every_layout_follows_the_rules():
    spec = load_spec("llama3-8b", {"seq": 4096})
    space = SearchSpace(spec, 32, GPU.gpus_per_node, 64, {})
    found = list(layouts(space))
    assert found
    for layout in found:
        assert layout.tp * layout.pp * layout.cp * layout.dp == 32
        assert layout.micro_batch * layout.microbatches * layout.dp == 64
        assert layout.tp <= GPU.gpus_per_node and spec.heads % layout.tp == 0
        assert spec.kv_heads % layout.tp == 0 or layout.tp % spec.kv_heads == 0
        assert spec.seq % layout.cp == 0
        assert layout.sp is False or layout.tp > 1
        if layout.virtual_stages > 1:
            assert layout.microbatches % layout.pp == 0
        if layout.dp == 1:
            assert layout.zero == 0
        layout_spec(spec, layout)  # the spec accepts it (raises otherwise)
    # tp 16 would leave the node; kv heads 8 replicated under no tp here, so tp <= 8
    assert {layout.tp for layout in found} == {1, 2, 4, 8}


def test_constraints_fix_keys():
    space = SearchSpace(SMALL, 8, 8, 16, {"tp": 2, "zero": 1})
    found = list(layouts(space))
    assert found and all(layout.tp == 2 and layout.zero == 1 for layout in found)


@pytest.mark.parametrize("budget", [GIB, 4 * GIB])
def test_bounds_bound_every_plan(budget):
    """The memory bound is at most the memory of every plan (least: full recomputation); the
    time bound is the time of `none`, exactly as hardware.step_time computes it."""
    space = SearchSpace(SMALL, 8, 8, 16, {})
    bounds = Bounds(SMALL, GPU)
    for layout in list(layouts(space))[::7]:
        spec = layout_spec(SMALL, layout)
        none = evaluate(spec, parse_strategy("none", spec))
        assert bounds.time(layout).seconds == pytest.approx(
            step_time(none, GPU).step_seconds, rel=1e-9
        )
        least = min(
            evaluate(spec, parse_strategy(name, spec)).total_bytes
            for name in ("none", "selective", f"block:{spec.layers_per_stage}", "full")
        )
        assert bounds.memory(layout).bytes <= least


# A small MoE model with a vocabulary: 4 experts, top-2 (the layer's ops depend on ep and etp,
# never on dp: the bounds cache them per (tp, sp, cp, micro-batch, ep, etp)).
MOE = spec_from_mapping(
    {
        "name": "small-moe", "layers": 4, "hidden": 256, "heads": 8, "seq": 512,
        "micro_batch": 1, "vocab": 1000, "norm": "rmsnorm", "mlp": "swiglu",
        "attention": "flash", "bias": False, "experts": 4, "top_k": 2, "moe_ffn_hidden": 128,
    }
)  # fmt: skip


def test_moe_bounds_bound_every_plan():
    space = SearchSpace(MOE, 8, 8, 16, {})
    found = list(layouts(space))
    assert {layout.ep for layout in found} == {1, 2, 4}
    bounds = Bounds(MOE, GPU)
    for layout in found[::5]:
        spec = layout_spec(MOE, layout)
        none = evaluate(spec, parse_strategy("none", spec))
        assert bounds.time(layout).seconds == pytest.approx(
            step_time(none, GPU).step_seconds, rel=1e-9
        )
        least = min(
            evaluate(spec, parse_strategy(name, spec)).total_bytes
            for name in ("none", "selective", "full", "moe", "experts")
        )
        assert bounds.memory(layout).bytes <= least


def test_memory_bound_with_modules_bounds_the_module_plans():
    """On Megatron-LM the layer-level plans try Megatron-Core's module sets: the bound that
    rejects a layout (`layout_memory`, with the module sets where the plain bound is over) is at
    most each of their memories, and never above the plain bound."""
    from ckplan.plan.search import layout_module_candidates

    space = SearchSpace(MOE, 8, 8, 16, {})
    bounds = Bounds(MOE, GPU)
    names = layout_module_candidates(MOE)
    assert names == ["layernorm+moe_act", "selective+layernorm+moe_act"]
    for layout in list(layouts(space))[::5]:
        spec = layout_spec(MOE, layout)
        plain, with_modules = bounds.memory(layout), bounds.memory(layout, modules=True)
        assert with_modules.bytes <= plain.bytes
        assert bounds.layout_memory(layout, 0).bytes == with_modules.bytes  # over any budget
        for name in names:
            assert with_modules.bytes <= evaluate(spec, parse_strategy(name, spec)).total_bytes


def test_plan_tries_megatron_modules():
    """Mixtral-8x7B over 16 H100s at 8,192 tokens: on Megatron-LM a layout whose fastest plan is
    a set of Megatron-Core's modules is among the five fastest; with torchtitan (no
    --recompute-modules) no plan names one."""
    spec = load_spec("mixtral-8x7b", {"seq": 8192})
    modules = ("layernorm", "moe_act")
    result = search_layouts(spec, 16, GPU, 64, GPU.memory_bytes, top=5)
    found = [e for e in result.layouts if any(m in e.plan.strategy for m in modules)]
    assert found
    usable = GPU.memory_bytes - DEFAULT_RESERVE
    for e in found:  # no slower than the plain plans of its layout that fit
        spec_at = layout_spec(spec, e.layout)
        for name in ("selective", "moe", "experts", "selective+experts"):
            plan = evaluate(spec_at, parse_strategy(name, spec_at))
            if Candidate(plan, usable).fits:
                assert e.seconds <= step_time(plan, GPU).step_seconds
    titan = search_layouts(spec.replace(framework="torchtitan", zero=3), 16, GPU, 64,
                           GPU.memory_bytes, top=5)  # fmt: skip
    assert not any(m in e.plan.strategy for e in titan.layouts for m in modules)


def test_memory_bound_holds_for_the_dp_at_its_tightest():
    """The DP's schedules (`optimal`, `selective+optimal`) at the least activation budget any
    of them fits: still at or above the memory bound (one layer's backward on the fullest
    stage)."""
    space = SearchSpace(SMALL, 8, 8, 16, {})
    bounds = Bounds(SMALL, GPU)
    checked = 0
    for layout in list(layouts(space))[::23]:
        spec = layout_spec(SMALL, layout)
        bound = bounds.memory(layout).bytes
        low, high = 1, evaluate(spec, parse_strategy("none", spec)).activation_bytes
        plan = None
        for _ in range(12):  # bisect the activation budget down to the least that fits
            middle = (low + high) // 2
            found = optimal_plan(spec, middle, 100)
            if found is None:
                low = middle
            else:
                high, plan = middle, found
        assert plan is not None  # the DP fits somewhere below `none`'s activations
        assert plan.total_bytes >= bound, layout
        checked += 1
    assert checked >= 10


def brute_force(spec, gpus, batch, usable):
    """Every layout of the grid with every layer-level plan and every offload plan its
    framework runs (within the GPU's host memory): the fastest that fits per layout but for
    its ZeRO stage and context-parallel exchange, the lower ZeRO stage among equals (as the
    search keeps them)."""
    best = {}
    for layout in layouts(SearchSpace(spec, gpus, GPU.gpus_per_node, batch, {})):
        model = layout_spec(spec, layout)
        names = ["none", "selective"]
        names += [f"block:{k}" for k in range(1, model.layers_per_stage + 1)]
        names += [f"selective+block:{k}" for k in range(1, model.layers_per_stage + 1)]
        names += list(offload_strategies(model.framework, model.pp))
        for name in names:
            plan = evaluate(model, parse_strategy(name, model))
            if plan.total_bytes > usable or plan.host_bytes > host_memory_per_gpu(GPU):
                continue
            key = layout.arrangement()
            entry = (step_time(plan, GPU).step_seconds, layout.zero)
            if key not in best or entry < best[key]:
                best[key] = entry
    return best


@pytest.mark.parametrize("budget", [int(1.25 * GIB), 4 * GIB])
def test_search_agrees_with_brute_force(budget):
    """On 4 GPUs: the search's fastest layout is no slower than brute force's fastest over
    the layer-level plans (it may be faster where the DP recomputes less); every layout whose
    layer-level best beats the search's K-th time is listed; with memory to spare (no
    recomputation anywhere) the top K is brute force's, in the same order."""
    top = 5
    result = search_layouts(SMALL, 4, GPU, 8, budget, 0, top=top)
    brute = brute_force(SMALL, 4, 8, budget)
    ranked = sorted(brute.items(), key=lambda item: item[1])
    shown = [e.layout.arrangement() for e in result.layouts]
    assert len(shown) == min(top, len(brute))
    assert result.layouts[0].seconds <= ranked[0][1][0] * (1 + 1e-12)
    kth = result.layouts[-1].seconds
    for key, (seconds, _) in ranked:
        if seconds < kth * (1 - 1e-12):
            assert key in shown
    if budget == 4 * GIB:
        assert shown == [key for key, _ in ranked[:top]]
        times = [e.seconds for e in result.layouts]
        assert times == pytest.approx([seconds for _, (seconds, _) in ranked[:top]], rel=1e-12)


def test_shown_layouts_fit_when_re_evaluated():
    """Every layout shown fits and takes the time shown when its keys are set on the model
    and its plan evaluated again (the DP's plans: fit within the same activation budget)."""
    result = search_layouts(SMALL, 8, GPU, 16, GIB, 0, top=5)
    assert result.layouts
    for e in result.layouts:
        spec = layout_spec(SMALL, e.layout)
        assert spec == e.spec
        if e.plan.strategy.startswith("optimal"):
            assert e.plan.total_bytes <= GIB
            continue
        plan = evaluate(spec, parse_strategy(e.plan.strategy, spec))
        assert plan.total_bytes == e.plan.total_bytes <= GIB
        assert step_time(plan, GPU).step_seconds == pytest.approx(e.seconds, rel=1e-12)


@pytest.mark.parametrize("framework", ["deepspeed", "torchtitan"])
def test_search_tries_the_offload_plans_its_framework_runs(framework):
    """At a budget where storing everything does not fit, the search weighs the framework's
    offload plans against recomputation on each layout: an offload plan is chosen exactly when
    it is the faster, and the layout keeps the fastest of each kind."""
    spec = SMALL.replace(framework=framework, seq=4096)
    result = search_layouts(spec, 4, GPU, 8, 2 * GIB, 0, top=5)
    assert result.layouts
    tried = 0
    for e in result.layouts:
        allowed = offload_strategies(framework, e.spec.pp)
        if e.plan.stage_offloads:
            assert e.plan.strategy in allowed
            assert e.recompute is None or e.seconds <= e.recompute.time.step_seconds * (1 + 1e-12)
        if e.offload is not None:
            tried += 1
            assert e.offload.plan.strategy in allowed and e.offload.fits
            assert e.seconds <= e.offload.time.step_seconds * (1 + 1e-12)
        if e.recompute is not None:
            assert not e.recompute.plan.stage_offloads
            assert e.seconds <= e.recompute.time.step_seconds * (1 + 1e-12)
    assert tried or any(e.plan.stage_offloads for e in result.layouts)


def test_search_tries_no_offload_plan_for_megatron():
    """Megatron-LM core_v0.19.0 offloads at most num_layers - 1 layers and not the embedding,
    not the tapes of ckplan's `offload`: the search weighs recomputation alone (the budget where
    the other frameworks' search above offloads)."""
    assert offload_strategies("megatron", 1) == offload_strategies("megatron", 4) == ()
    spec = SMALL.replace(framework="megatron", seq=4096)
    result = search_layouts(spec, 4, GPU, 8, 2 * GIB, 0, top=5)
    assert result.layouts
    assert all(not e.plan.stage_offloads and e.offload is None for e in result.layouts)


def test_nothing_fits_names_the_nearest_layout():
    result = search_layouts(SMALL, 2, GPU, 2, GIB // 4, 0)
    assert result.layouts == ()
    assert result.least_memory is not None and result.least_memory.over_bytes > 0


def test_rejected_explain_memory_and_speed():
    result = search_layouts(SMALL, 8, GPU, 16, GIB, 0, top=3)
    reasons = defaultdict(list)
    for r in result.rejected:
        reasons[r.reason].append(r)
    for r in reasons["memory"] + reasons["model_states"]:
        assert r.over_bytes > 0
    for r in reasons["slower"]:
        assert r.over_bytes is None and r.seconds >= result.layouts[0].seconds


@pytest.mark.parametrize(
    "preset, gpus, batch, keys",
    [
        ("megatron-22b", 8, 4, {"tp": 8, "pp": 1, "cp": 1, "micro_batch": 4}),
        ("megatron-175b", 64, 64, {"tp": 8, "pp": 8, "cp": 1, "micro_batch": 1}),
        ("megatron-530b", 280, 280, {"tp": 8, "pp": 35, "cp": 1, "micro_batch": 1}),
        ("megatron-1t", 512, 512, {"tp": 8, "pp": 64, "cp": 1, "micro_batch": 1}),
    ],
)
def test_korthikanti_table3_layouts_fit(preset, gpus, batch, keys):
    """Korthikanti et al. (2022), Table 3: given the GPU count and global batch, the published
    layout (TP 8 with SP, PP 1/8/35/64, no DP, their micro-batch and virtual stages) is among
    the layouts that fit on A100 80 GB, with selective recomputation, the paper's plan
    (docs/validation.md has its rank)."""
    spec = load_spec(preset)
    gpu = load_gpu("a100-80gb")
    keys = {**keys, "sp": True, "virtual_stages": spec.virtual_stages}
    result = search_layouts(spec, gpus, gpu, batch, gpu.memory_bytes, constraints=keys, top=1)
    assert result.layouts, result.least_memory
    best = result.layouts[0]
    assert best.fits and best.layout.dp == 1 and best.plan.strategy == "selective"


def _every_plan(spec, usable):
    """Every layer-level plan, its framework's offload plans, the DP's, the best per-op policy
    and POLICY+mixed (one pipeline stage) on one layout, the framework's policy (`sac`, under
    torchtitan 0.3.0's `sac-fused`): name -> step seconds where it fits."""
    from ckplan.model.op_policy import layerwise_export_reason, parse_policy
    from ckplan.plan.layout.search import activation_budget
    from ckplan.plan.search import best_policy_plan, policy_word, sweep_policy

    n = spec.layers_per_stage
    word = policy_word(spec)  # none where the framework's policy does not apply (tp > 1)
    names = ["none", "selective", "mlp", "selective+mlp", *([word] if word else [])]
    # beside other layers only where an export writes it (not torchtitan 0.3.0's sac-fused)
    layerwise = word and not layerwise_export_reason(parse_policy(sweep_policy(spec)), "mixed")
    prefixes = ("", "selective+", *([f"{word}+"] if layerwise else []))
    names += [f"{p}block:{k}" for p in prefixes for k in range(1, n + 1)]
    names += list(offload_strategies(spec.framework, spec.pp))
    plans = [evaluate(spec, parse_strategy(name, spec)) for name in names]
    budget = activation_budget(spec, usable)
    plans += [optimal_plan(spec, budget, gpu=GPU), best_policy_plan(spec, usable, GPU)]
    if spec.pp == 1 and layerwise:
        plans.append(evaluate(spec, parse_strategy(f"{word}+mixed", spec), budget=budget, gpu=GPU))
    return {
        plan.strategy: step_time(plan, GPU).step_seconds
        for plan in plans
        if plan is not None
        and plan.total_bytes <= usable
        and plan.host_bytes <= host_memory_per_gpu(GPU)
    }


def test_plan_keeps_sac_mixed_only_where_it_is_faster():
    """Llama-3-8B cut to 8 layers, 16,384 tokens, 4 H100s with 28 GiB each, torchtitan: 0.3.0's
    `sac-fused+mixed`, which no export writes, is never tried. At the release of December 2024,
    whose policy is `sac`: on every layout shown, the plan is the fastest of brute force over
    every layer-level plan, the offload plans, the DP's, the best per-op policy and `sac+mixed`
    (which `--to torch` writes); `sac+mixed` is shown on a layout exactly where it is that
    fastest, and every plan shown has an export that writes it."""
    spec = load_spec("llama3-8b", {"layers": 8, "seq": 16384, "framework": "torchtitan"})
    usable = 28 * GIB
    # torchtitan 0.3.0's sac-fused+mixed, which no export writes, is never tried
    assert search_layouts(spec, 4, GPU, 8, usable, 0, top=5).counts.get("mixed", 0) == 0
    from ckplan.render.export_target import export_choice

    spec = spec.replace(framework_version="2024.12")
    result = search_layouts(spec, 4, GPU, 8, usable, 0, top=5)
    assert result.counts["mixed"] >= 1
    mixed = 0
    for e in result.layouts:
        times = _every_plan(e.spec, usable)
        name, seconds = min(times.items(), key=lambda item: item[1])
        assert e.seconds == pytest.approx(seconds, rel=1e-9), (e.layout, name)
        assert e.plan.strategy.endswith("+mixed") == name.endswith("+mixed")
        mixed += e.plan.strategy.endswith("+mixed")
    assert mixed >= 1
    for e in result.layouts:  # each shown plan is one an export writes
        assert export_choice(e.plan).target is not None, e.plan.strategy


def test_plan_tries_mixed_only_with_one_pipeline_stage_on_pytorch_frameworks():
    """Megatron-LM has no per-op policies and a pipeline keeps several micro-batches in flight
    (the mixed DP plans one): `plan` runs no mixed DP there."""
    spec = load_spec("llama3-8b", {"layers": 8, "seq": 32768})
    result = search_layouts(spec, 4, GPU, 8, 24 * GIB, 0, top=5)
    assert result.counts.get("mixed", 0) == 0
    piped = load_spec("llama3-8b", {"layers": 8, "seq": 16384, "framework": "torchtitan"})
    # room for the interleaved layouts with their pipeline buffers (each local stage's)
    result = search_layouts(piped, 4, GPU, 8, 32 * GIB, 0, top=5, constraints={"pp": 2})
    assert result.counts["optimal"] >= 1 and result.counts.get("mixed", 0) == 0
    assert result.layouts and all(e.layout.pp == 2 for e in result.layouts)


@pytest.mark.parametrize("framework", ["hf", "deepspeed", "torchtitan"])
@pytest.mark.parametrize("training", ["lora", "qlora"])
def test_fine_tune_time_bounds_bound_every_plan(framework, training):
    """With frozen base weights the time bound reduces and steps only the adapters and gathers
    the frozen weights under ZeRO-3, as step_time does: at most the time of `none` on every
    layout (equal where no framework-specific overlap applies: hf), and every memory bound at
    most full recomputation's, model states on the host included (FSDP's CPU offload)."""
    base = load_spec("llama3-8b", {"seq": 2048, "layers": 4, "training": training})
    offloads = [{}]
    if framework != "deepspeed":
        offloads.append({"optimizer_offload": "cpu", "param_offload": "cpu", "zero": 3, "dp": 8})
    for offload in offloads:
        spec = base.replace(framework=framework, **offload)
        bounds = Bounds(spec, GPU)
        found = list(layouts(SearchSpace(spec, 8, 8, 16, {})))
        assert found
        for layout in found[::3]:
            laid_out = layout_spec(spec, layout)
            none = evaluate(laid_out, parse_strategy("none", laid_out))
            seconds = step_time(none, GPU).step_seconds
            assert bounds.time(layout).seconds <= seconds * (1 + 1e-9)
            if framework == "hf":
                assert bounds.time(layout).seconds == pytest.approx(seconds, rel=1e-9)
            full = evaluate(laid_out, parse_strategy("full", laid_out))
            assert bounds.memory(layout).bytes <= full.total_bytes


@pytest.mark.parametrize("offload", [{}, {"optimizer_offload": "cpu"}])
def test_bounds_read_each_zero_stages_bytes(offload):
    """A DeepSpeed model whose file says ZeRO 3 (fp32 gradient accumulation, 4 bytes) searched
    over every ZeRO stage: each layout's bounds take the bytes of its own stage (2 bytes below
    ZeRO 3), as its spec derives them, so they stay below its plans' time and memory."""
    spec = load_spec(
        "llama3-8b",
        {"seq": 2048, "layers": 4, "framework": "deepspeed", "zero": 3, "dp": 8, **offload},
    )
    assert spec.grad_bytes == 4
    bounds = Bounds(spec, GPU)
    found = list(layouts(SearchSpace(spec, 8, 8, 16, {})))
    assert {layout.zero for layout in found} >= {1, 2, 3}
    for layout in found[::2]:
        laid_out = layout_spec(spec, layout)
        assert bounds.bytes_spec(layout).grad_bytes == laid_out.grad_bytes
        none = evaluate(laid_out, parse_strategy("none", laid_out))
        assert bounds.time(layout).seconds <= step_time(none, GPU).step_seconds * (1 + 1e-9)
        full = evaluate(laid_out, parse_strategy("full", laid_out))
        assert bounds.memory(layout).bytes <= full.total_bytes
