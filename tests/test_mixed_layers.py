"""Mixed layers: layer sets, which kinds a pipeline stage holds, chains of mixed layers (checked
against brute force), uneven stages, and the uniform case unchanged."""

import pytest
from oracles.brute_force import brute_force_optimal

from ckplan.model import memory
from ckplan.model.layers import (
    LayerKind,
    LayerSetError,
    format_layer_set,
    layer_kinds,
    parse_layer_set,
    stage_kinds,
    stage_layer_indices,
)
from ckplan.model.spec import SpecError, spec_from_mapping
from ckplan.plan import evaluate, layer_chain, parse_strategy
from ckplan.render import estimate_dict
from ckplan.schedules import simulate

DENSE, MOE = LayerKind(), LayerKind(moe=True)


@pytest.mark.parametrize(
    ("text", "layers", "expected"),
    [
        ("all", 4, {0, 1, 2, 3}),
        ("none", 4, set()),
        ("3-", 6, {3, 4, 5}),
        ("0-:2", 7, {0, 2, 4, 6}),
        ("1-:2", 8, {1, 3, 5, 7}),
        ("0,2-3", 5, {0, 2, 3}),
        ("1-5:2", 8, {1, 3, 5}),
    ],
)
def test_layer_sets(text, layers, expected):
    assert parse_layer_set(text, layers) == expected
    assert parse_layer_set(format_layer_set(expected, layers), layers) == expected


@pytest.mark.parametrize("text", ["x", "3-1", "0-9", "1:0", "-2"])
def test_bad_layer_sets(text):
    with pytest.raises(LayerSetError):
        parse_layer_set(text, 6)


def test_layer_set_as_a_list_and_its_error():
    spec = spec_from_mapping(
        {
            "name": "m",
            "layers": 4,
            "hidden": 64,
            "heads": 4,
            "seq": 8,
            "micro_batch": 1,
            "experts": 4,
            "moe_layers": [1, 3],
        }
    )
    assert [k.moe for k in layer_kinds(spec)] == [False, True, False, True]
    with pytest.raises(SpecError, match=r"key 'moe_layers'.*the model has layers 0\.\.3"):
        spec.replace(moe_layers="2-7")


def test_deepseek_v3_first_three_dense(spec_of):
    spec = spec_of("deepseek-v3")
    kinds = layer_kinds(spec)
    assert kinds[:3] == (DENSE,) * 3 and set(kinds[3:]) == {MOE}
    # Parameters: the 61 main layers (MTP module excluded), embedding and head untied.
    assert memory.parameter_count(spec).total == 671_026_419_200


def test_pipeline_stages_hold_their_layers(spec_of):
    """Uneven stages: 1 layer on the first (the embedding's stage), 4 on each of the other 15.
    The first stage holds dense layer 0; stage 1 holds dense layers 1, 2 and MoE 3, 4."""
    spec = spec_of("deepseek-v3", pp=16, first_stage_layers=1, tp=2, sp=True, etp=1, ep=2)
    assert spec.stage_layer_counts == (1,) + (4,) * 15
    assert stage_layer_indices(spec, 0) == (0,)
    assert stage_layer_indices(spec, 1) == (1, 2, 3, 4)
    assert stage_kinds(spec, 1) == (DENSE, DENSE, MOE, MOE)
    assert stage_layer_indices(spec, 15) == (57, 58, 59, 60)
    # Model states: the stage with the most parameters (an all-MoE one), not the first.
    assert memory.busiest_stage(spec) > 0
    plan = evaluate(spec, parse_strategy("none", spec))
    assert plan.parameters_per_gpu == max(sum(memory.stage_parameters(spec, k)) for k in range(16))


def test_interleaved_stages_hold_chunks():
    spec = spec_from_mapping(
        {
            "name": "m",
            "layers": 8,
            "hidden": 64,
            "heads": 4,
            "seq": 8,
            "micro_batch": 1,
            "pp": 2,
            "virtual_stages": 2,
        }
    )
    assert stage_layer_indices(spec, 0) == (0, 1, 4, 5)
    assert stage_layer_indices(spec, 1) == (2, 3, 6, 7)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"first_stage_layers": 3}, "leave 5 of 8 layers, which the other 3"),
        ({"first_stage_layers": 2, "pp": 1}, "needs pipeline parallelism"),
        ({"pp": 3}, "must divide layers \\(8\\), or give first_stage_layers"),
        ({"first_stage_layers": 2, "virtual_stages": 2}, "need virtual_stages: 1"),
    ],
)
def test_uneven_stage_keys_are_validated(changes, message):
    with pytest.raises(SpecError, match=message):
        spec_from_mapping(
            {
                "name": "m",
                "layers": 8,
                "hidden": 64,
                "heads": 4,
                "seq": 8,
                "micro_batch": 1,
                "pp": 4,
                **changes,
            }
        )


SMALL_MIXED = {
    "name": "mixed",
    "layers": 5,
    "hidden": 32,
    "heads": 4,
    "seq": 16,
    "micro_batch": 1,
    "vocab": 64,
    "norm": "rmsnorm",
    "mlp": "swiglu",
    "attention": "flash",
    "bias": False,
    "experts": 4,
    "top_k": 2,
    "moe_ffn_hidden": 16,
    "moe_layers": "1-:2",
    "sliding_window": 8,
    "sliding_window_layers": "0-:2",
}


def test_chain_of_mixed_layers_takes_each_kind_s_costs():
    spec = spec_from_mapping(SMALL_MIXED)
    kinds = layer_kinds(spec)
    assert kinds == (
        LayerKind(False, 8), LayerKind(True, 0), LayerKind(False, 8), LayerKind(True, 0),
        LayerKind(False, 8),
    )  # fmt: skip
    chain = layer_chain(spec, selective=False)
    for index, kind in enumerate(kinds, start=1):  # after the embedding stage
        assert chain.tape_bytes[index] == memory.activation_bytes_per_layer(spec, kind)
    assert chain.tape_bytes[1] != chain.tape_bytes[2]
    groups = ("attention_core", "moe")
    selective = layer_chain(spec, groups)
    for index, kind in enumerate(kinds, start=1):
        assert selective.tape_bytes[index] == memory.selective_activation_bytes_per_layer(
            spec, groups, kind
        )


@pytest.mark.parametrize("strategy", ["optimal", "selective+moe+optimal"])
def test_optimal_on_a_mixed_chain_matches_brute_force(strategy):
    """The DP over a chain of mixed layers finds the cheapest schedule brute force finds."""
    spec = spec_from_mapping(SMALL_MIXED)
    parsed = parse_strategy(strategy, spec)
    chain = layer_chain(spec, parsed.groups)
    store_all = simulate(chain, evaluate(spec, parse_strategy("none", spec)).steps).peak_bytes
    for fraction in (1.0, 0.8, 0.6):
        budget = int(store_all * fraction)
        exact = brute_force_optimal(chain, budget)
        plan = evaluate(spec, parsed, budget=budget, slots=2000)
        if exact is None:
            assert plan is None
            continue
        assert plan is not None and plan.activation_bytes <= budget
        # The DP rounds sizes up to slots: never cheaper than brute force, equal here.
        assert plan.flops.total >= exact.total_flops
        replay_flops = simulate(chain, plan.steps).total_flops
        assert replay_flops == exact.total_flops


def test_block_recomputes_the_first_layers_of_a_mixed_stage():
    spec = spec_from_mapping(SMALL_MIXED)
    plan = evaluate(spec, parse_strategy("block:2", spec))
    forwards = [step.stage for step in plan.steps if step.kind != "backward"]
    assert forwards.count(1) == 2 and forwards.count(2) == 2 and forwards.count(3) == 1


def test_json_lists_the_layer_kinds():
    spec = spec_from_mapping(SMALL_MIXED)
    data = estimate_dict(evaluate(spec, parse_strategy("none", spec)))
    kinds = {row["kind"]: row for row in data["memory"]["layer_kinds"]}
    assert kinds["moe"]["layers"] == "1,3" and kinds["dense, window 8"]["layers"] == "0-:2"
    assert data["memory"]["expert_parallel"]["routed_rows_per_gpu"] == 16 * 2
    assert data["parameters"]["active"] < data["parameters"]["total"]


def test_uniform_models_report_no_layer_kinds(spec_of):
    spec = spec_of("llama3-8b")
    data = estimate_dict(evaluate(spec, parse_strategy("none", spec)))
    assert "layer_kinds" not in data["memory"] and "expert_parallel" not in data["memory"]
    assert "active" not in data["parameters"]
