"""What sweep and plan offer per framework: the module strategies (mlp, moe,
experts, layernorm, moe_act, mla_up_proj, shared_experts) only under Megatron-LM, the one
framework that runs them; asked for elsewhere they are evaluated with a note naming why and the
scoped policy that checkpoints the same regions. A nested revolve:C says no export writes it.
The fused-QKV policy items (`sac-fused`) are refused outside torchtitan 0.3.0."""

from __future__ import annotations

import json

import pytest

from ckplan import exports
from ckplan.exports.segments import layer_segments
from ckplan.inputs.presets import load_spec
from ckplan.plan.evaluate import evaluate
from ckplan.plan.search import candidate_strategies, revolve_slots
from ckplan.plan.strategies import (
    StrategyError,
    module_framework_reason,
    module_words,
    parse_strategy,
    scoped_equivalent,
)

MODELS = ("llama3-8b", "mixtral-8x7b", "deepseek-v3")
OTHERS = ("torchtitan", "hf", "deepspeed")


def _module_names(spec) -> set[str]:
    return {s.name for s in candidate_strategies(spec) if module_words(s)}


@pytest.mark.parametrize("model", MODELS)
def test_module_strategies_offered_under_megatron_only(model):
    megatron = _module_names(load_spec(model, {"framework": "megatron"}))
    assert megatron, "Megatron-LM keeps its module strategies"
    for framework in OTHERS:
        spec = load_spec(model, {"framework": framework})
        assert _module_names(spec) == set(), framework
        # what is offered is what the framework runs: no candidate carries the reason
        assert all(module_framework_reason(spec, s) is None for s in candidate_strategies(spec))


@pytest.mark.parametrize("framework", OTHERS)
@pytest.mark.parametrize(
    ("model", "name", "scoped"),
    [
        ("llama3-8b", "mlp", "sac@mlp"),
        ("mixtral-8x7b", "moe", "sac@moe"),
        ("mixtral-8x7b", "experts", "sac@experts"),
        ("deepseek-v3", "shared_experts", "sac@shared_experts"),
    ],
)
def test_asked_for_it_is_evaluated_with_the_reason_and_its_scoped_form(
    framework, model, name, scoped
):
    spec = load_spec(model, {"framework": framework})
    plan = evaluate(spec, parse_strategy(name, spec))
    reason = module_framework_reason(spec, parse_strategy(name, spec))
    assert reason in plan.notes
    assert f"framework {framework} cannot run" in reason and scoped in reason
    assert scoped_equivalent(parse_strategy(name, spec)) == scoped
    # the reason holds: the torch snippet refuses the module strategy and writes its scoped form
    assert exports.why_not(plan, "torch") is not None
    if framework != "torchtitan" or spec.tp == 1:
        assert exports.why_not(evaluate(spec, parse_strategy(scoped, spec)), "torch") is None


@pytest.mark.parametrize("name", ["layernorm", "selective+mlp", "mlp+block:4"])
def test_no_scoped_form_the_snippet_writes(name):
    """layernorm discards outputs (no region); the attention core is no region the snippet
    wraps; a scoped policy beside recomputed layers no target writes."""
    spec = load_spec("llama3-8b", {"framework": "hf"})
    strategy = parse_strategy(name, spec)
    assert scoped_equivalent(strategy) is None
    reason = module_framework_reason(spec, strategy)
    assert reason is not None and "scoped policy" not in reason
    plan = evaluate(spec, strategy)
    assert reason in plan.notes
    assert exports.why_not(plan, "torch") is not None


@pytest.mark.parametrize("name", ["experts", "selective+experts", "experts+block:4"])
def test_megatron_has_no_experts_only_module(name):
    """Megatron-Core's --recompute-modules has moe and moe_act, no experts-only module: the
    Megatron export refuses `experts`, so neither sweep nor plan offers it there, and asked for
    it is evaluated with the reason."""
    spec = load_spec("mixtral-8x7b", {"framework": "megatron"})
    assert not any("experts" in module_words(s) for s in candidate_strategies(spec))
    assert "moe" in _module_names(spec)
    strategy = parse_strategy(name, spec)
    reason = module_framework_reason(spec, strategy)
    assert reason is not None and "no experts-only module" in reason
    plan = evaluate(spec, strategy)
    assert reason in plan.notes
    assert exports.why_not(plan, "megatron") is not None


def test_megatron_module_plans_carry_no_note():
    spec = load_spec("llama3-8b", {"framework": "megatron"})
    for name in ("mlp", "selective+mlp", "layernorm"):
        plan = evaluate(spec, parse_strategy(name, spec))
        assert not any("cannot run" in note for note in plan.notes), name


@pytest.mark.parametrize("framework", OTHERS)
def test_sac_at_mlp_stores_what_mlp_stores_and_skips_fc2(framework):
    """derived: the scoped region is a checkpoint with PyTorch's early stop, which ends the
    re-run at up_proj's product, the last tensor fc2's backward reads; Megatron-Core's mlp
    module re-runs fc2 too. Llama's three MLP GEMMs have equal FLOPs, so the scoped form
    re-runs two thirds of them, the activation nothing (FLOPs of element-wise ops are not
    counted)."""
    spec = load_spec("llama3-8b", {"framework": framework})
    module = evaluate(spec, parse_strategy("mlp", spec))
    scoped = evaluate(spec, parse_strategy("sac@mlp", spec))
    assert module.activation_bytes == scoped.activation_bytes
    assert module.total_bytes == scoped.total_bytes
    assert 2 * module.flops.recompute == 3 * scoped.flops.recompute


@pytest.mark.parametrize("framework", ("megatron", "torchtitan"))
def test_revolve_note_iff_no_export_writes_it(framework):
    spec = load_spec("llama3-8b", {"framework": framework})
    for slots in revolve_slots(spec.layers_per_stage)[0]:
        plan = evaluate(spec, parse_strategy(f"revolve:{slots}", spec))
        noted = any("no export writes" in note for note in plan.notes)
        assert noted == isinstance(layer_segments(plan), str), slots
        assert noted, "every offered revolve:C of 32 layers re-runs some layers twice"


def test_check_says_in_one_line_why_the_framework_cannot_run_the_plan(cli):
    argv = ["check", "llama3-8b", "--strategy", "mlp", "--budget", "80GB"]
    argv += ["--set", "zero=3", "--set", "dp=8"]
    code, out, _ = cli(*argv, "--set", "framework=hf")
    assert code == 0
    said = [line for line in out.splitlines() if line.startswith("llama3-8b: framework hf")]
    assert len(said) == 1 and "cannot run mlp" in said[0]
    code, out, _ = cli(*argv, "--set", "framework=megatron", "--set", "zero=1")
    assert code in (0, 1) and "cannot run" not in out


def test_sweep_json_says_no_export_writes_revolve(cli):
    code, out, _ = cli("sweep", "gpt2", "--budget", "8GB", "--json")
    assert code in (0, 1)
    plans = json.loads(out)["plans"]
    revolve = [p for p in plans if p["strategy"].startswith("revolve:")]
    assert revolve
    for plan in revolve:
        nested = any("no export writes" in note for note in plan["notes"])
        assert nested, plan["strategy"]


# Where the attention runs q, k and v as three GEMMs and SDPA: Hugging Face transformers 5.25
# (LlamaAttention), DeepSpeed (its checkpoint takes no policy: the torch snippet runs it), and
# torchtitan's release of December 2024 (wq, wk, wv); fused_qkv and flex_attention model
# torchtitan 0.3.0's block (op_policy.fused_framework_reason).
UNFUSED = (
    {"framework": "hf"},
    {"framework": "deepspeed"},
    {"framework": "torchtitan", "framework_version": "2024.12"},
)


@pytest.mark.parametrize("changes", UNFUSED)
@pytest.mark.parametrize(
    "name", ["sac-fused", "sac-fused+block:2", "sac:fused_qkv,matmuls%2", "sac:flex_attention"]
)
def test_fused_qkv_policies_are_refused_where_the_attention_is_not_fused(changes, name):
    spec = load_spec("llama3-8b", changes)
    key = "framework_version" if "framework_version" in changes else "framework"
    with pytest.raises(StrategyError) as refused:
        parse_strategy(name, spec)
    said = str(refused.value)
    assert "\n" not in said
    assert f"not key '{key}' ({changes[key]})" in said
    assert "expected framework: torchtitan at framework_version 0.3" in said
    # never offered there either: the framework's own policy is sac
    names = {s.name for s in candidate_strategies(spec)}
    assert "sac" in names and not any("fused" in n or "flex" in n for n in names)


def test_sac_fused_stays_torchtitan_03s():
    spec = load_spec("llama3-8b", {"framework": "torchtitan"})
    assert parse_strategy("sac-fused", spec).name == "sac-fused"
    assert "sac-fused" in {s.name for s in candidate_strategies(spec)}


@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "llama3-8b", "--strategy", "sac-fused"],
        ["check", "llama3-8b", "--strategy", "sac-fused", "--budget", "80GB"],
        ["export", "llama3-8b", "--plan", "sac-fused", "--to", "torch"],
    ],
)
@pytest.mark.parametrize("framework", ["hf", "deepspeed"])
def test_cli_refuses_sac_fused_in_one_line(cli, argv, framework):
    code, out, err = cli(*argv, "--set", f"framework={framework}")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "strategy 'sac-fused'" in err and f"not key 'framework' ({framework})" in err
