"""The simple formula set: its functions by hand, its plans, and `seed`, its old name."""

import pytest

from ckplan.plan import evaluate, parse_strategy
from ckplan.simple import formulas as seed


def test_seed_overheads():
    assert seed.checkpoint_cost(32, 4)["overhead_vs_no_ckpt"] == pytest.approx(1 / 3)
    assert seed.selective_checkpoint_cost(32)["overhead_vs_no_ckpt"] == pytest.approx(0.05)
    assert seed.checkpoint_cost(32, 4) == {
        "fwd": 32.0,
        "recompute": 32.0,
        "bwd": 64.0,
        "total": 128.0,
        "overhead_vs_no_ckpt": pytest.approx(1 / 3),
    }


def test_seed_memory_functions():
    # 12 · 8192 · 8192 · 2 bytes = 1610.612736 MB per layer
    assert seed.activation_memory_mb(1) == pytest.approx(1610.612736)
    assert seed.activation_memory_mb(32) == pytest.approx(32 * 1610.612736)
    # (32 // 4 + 4) inputs of 8192 · 8192 · 2 bytes = 12 · 134.217728 MB
    assert seed.memory_after_checkpoint(32, 4) == pytest.approx(12 * 134.217728)
    assert seed.memory_after_checkpoint(3, 8) == pytest.approx(9 * 134.217728)  # n_seg floors to 1


@pytest.mark.parametrize(
    ("layers", "segment"), [(1, 1), (4, 2), (32, 6), (48, 7), (96, 10), (80, 9), (2, 1)]
)
def test_seed_optimal_segment(layers, segment):
    assert seed.optimal_segment(layers) == segment


def test_seed_should_recompute_thresholds():
    assert seed.should_recompute("attention", 100 * 10**6 + 1, 0.5)
    assert not seed.should_recompute("attention", 100 * 10**6, 0.0)
    assert seed.should_recompute("ffn", 500 * 10**6 + 1, 0.09)
    assert not seed.should_recompute("ffn", 500 * 10**6 + 1, 0.1)
    assert not seed.should_recompute("ffn", 500 * 10**6, 0.0)
    assert not seed.should_recompute("norm", 10**12, 0.0)


def test_formula_seed_plans(spec_of):
    spec = spec_of("example-8192")
    sbhB = spec.seq * spec.micro_batch * spec.hidden * spec.dtype_bytes
    none = evaluate(spec, parse_strategy("none", spec), "seed")
    assert none.activation_bytes == 12 * sbhB * spec.layers
    assert none.per_layer_activation_bytes == 12 * sbhB
    uniform = evaluate(spec, parse_strategy("uniform:4", spec), "seed")
    assert uniform.activation_bytes == (spec.layers // 4 + 4) * sbhB
    assert uniform.overhead == pytest.approx(1 / 3)
    sqrt = evaluate(spec, parse_strategy("sqrt", spec), "seed")
    assert sqrt.strategy == "sqrt" and sqrt.activation_bytes == (32 // 6 + 6) * sbhB
    selective = evaluate(spec, parse_strategy("selective", spec), "seed")
    assert selective.overhead == pytest.approx(0.05)
    assert selective.formula == "simple"  # the old name is read as the new one
    assert evaluate(spec, parse_strategy("none", spec), "simple") == none


def test_derived_selective_overhead_is_not_the_seed_constant(spec_of):
    """With s = h = 8192 the attention core is s/(6h + s) = 1/7 of a layer; its recompute over
    forward + backward is 1/21 ≈ 4.8%, close to but not the simple formulas' 5%."""
    spec = spec_of("example-8192")
    plan = evaluate(spec, parse_strategy("selective", spec))
    assert plan.overhead == pytest.approx(1 / 21)


def test_seed_rule_reported(spec_of):
    """should_recompute on the example-8192 preset: attention (GiBs of s² terms) over 100 MB ->
    recompute; the FFN (over 500 MB) is 16/28 of the layer FLOPs to redo, above the 10% ratio ->
    keep."""
    spec = spec_of("example-8192")
    plan = evaluate(spec, parse_strategy("selective", spec), "seed")
    assert "rule of thumb (should_recompute): attention recompute, ffn keep" in plan.notes


def test_the_old_names_still_work(capsys):
    """`--formula seed` and the preset `seed` are the simple set and example-8192."""
    import json

    from ckplan.cli import main

    assert main(["estimate", "seed", "--formula", "seed", "--json"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert main(["estimate", "example-8192", "--formula", "simple", "--json"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert old == new and new["formula"] == "simple" and new["model"]["name"] == "example-8192"
