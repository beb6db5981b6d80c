"""`ckplan verify`: the NumPy MLP's executor against the planner's predictions.

Tolerances (the ones `ckplan verify` states): peak memory within 5 % of the prediction (here also
never below it and at most a few KiB of Python object headers above it), layer forwards per layer
and FLOPs exact, gradients bit-identical to the plain, un-checkpointed step.
"""

import json
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from ckplan.plan import StrategyError, evaluate, parse_strategy
from ckplan.simple import mlp as numpy_mlp
from ckplan.simple.verify import (
    _Counts,
    compare_gradients,
    gradient_buffers,
    init_network,
    layer_backward,
    layer_forward,
    mlp_spec,
    reference_step,
    run_schedule,
    verify,
)

# Python's own objects (ndarray headers, dict entries) on top of the arrays the plan counts.
OBJECT_SLACK = 16 * 1024

STRATEGIES = (
    "none",
    "full",
    "uniform:1",
    "uniform:3",
    "uniform:8",
    "sequential:3",
    "sqrt",
    "block:0",
    "block:3",
    "selective",
    "revolve:1",
    "revolve:2",
    "revolve:3",
    "optimal",
)


@pytest.fixture(scope="module")
def report():
    """Every strategy on an 8-layer network (arrays of 16-32 KiB), one timed repeat."""
    return verify(mlp_spec(8, 64, 128, 32), STRATEGIES, repeats=1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_matches_the_planner(report, strategy):
    run = next(r for r in report.runs if r.strategy == strategy)
    assert run.gradients_identical and run.max_abs_grad_diff == 0.0
    assert run.measured.layer_forwards == run.predicted.layer_forwards
    assert run.measured.flops == run.predicted.flops
    assert abs(run.peak_error) <= 0.05
    # Sharper than 5 %: the arrays alive are exactly the predicted ones, plus object headers.
    assert 0 <= run.measured.peak_bytes - run.predicted.peak_bytes <= OBJECT_SLACK
    assert run.ok


def test_report_shape(report):
    assert report.ok
    assert report.runs[0].strategy == "none"
    assert [r.strategy for r in report.runs] == list(STRATEGIES)
    assert (
        report.budget_bytes
        == evaluate(report.spec, parse_strategy("sqrt", report.spec)).activation_bytes
    )
    spec = report.spec
    per_layer = spec.hidden * spec.ffn_hidden * 2 + spec.hidden + spec.ffn_hidden
    assert report.parameter_bytes == report.gradient_bytes == 8 * spec.layers * per_layer
    none = report.baseline
    assert report.overhead(none)[0] == 0.0
    full = next(r for r in report.runs if r.strategy == "full")
    # Seed MLP: forward 4·bdf, backward 10·bdf (fc1 re-run), full recompute one more forward.
    assert report.overhead(full)[0] == pytest.approx(4 / 14)
    # Recompute counts: full re-runs every layer once, revolve:1 the triangle L(L-1)/2.
    assert full.recomputed_layers == 8
    revolve1 = next(r for r in report.runs if r.strategy == "revolve:1")
    assert revolve1.recomputed_layers == 8 * 7 // 2


def test_narrow_hidden_and_explicit_budget():
    """f < d takes the other branch of the backward workspace, max(2f - d, f) = f; optimal is
    solved for a tight budget (revolve:2's peak + 5 %: the DP rounds sizes up to its memory
    slots, so at exactly that peak it can miss revolve's schedule) and runs as predicted."""
    spec = mlp_spec(7, 96, 64, 48)
    budget = evaluate(spec, parse_strategy("revolve:2", spec)).activation_bytes * 105 // 100
    result = verify(spec, ["uniform:2", "revolve:2", "optimal"], budget=budget, repeats=1)
    assert result.ok
    optimal = result.runs[-1]
    assert optimal.predicted.peak_bytes <= budget
    revolve = result.runs[-2]
    assert optimal.predicted.flops <= revolve.predicted.flops
    for run in result.runs:
        assert 0 <= run.measured.peak_bytes - run.predicted.peak_bytes <= OBJECT_SLACK


def _traced_peak(fn):
    """(result, peak traced bytes above the start) of one call."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = fn()
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(("d", "f"), [(64, 256), (128, 64)])
def test_layer_workspaces_are_exact(d, f):
    """One layer forward holds its output plus forward_workspace_bytes; one backward holds
    δ_i plus backward_workspace_bytes (the formulas the chain uses), up to object headers."""
    spec = mlp_spec(1, d, f, 32)
    params, x, g = init_network(spec)
    grads = gradient_buffers(params)
    counts = _Counts(1)
    act = 8 * 32 * d
    y, peak = _traced_peak(lambda: layer_forward(x, *params[0], counts))
    assert y.shape == (32, d)
    assert 0 <= peak - (act + numpy_mlp.forward_workspace_bytes(spec)) <= 2048
    _, peak = _traced_peak(lambda: layer_backward(x, g, *params[0], grads[0], counts))
    assert 0 <= peak - (act + numpy_mlp.backward_workspace_bytes(spec)) <= 2048
    assert counts.flops == 4 * 32 * d * f + 10 * 32 * d * f  # the ops table's figures


def test_reference_step_matches_a_float_reference():
    """The reference step against an independent check: central finite differences of the
    loss Σ x_L ⊙ grad_output along a random direction agree with the analytic gradient."""
    spec = mlp_spec(3, 8, 16, 4)
    params, x, g = init_network(spec, seed=3)
    dx, _ = reference_step(params, x, g)

    def loss(inp):
        for w1, b1, w2, b2 in params:
            inp = np.maximum(inp @ w1 + b1, 0) @ w2 + b2
        return float(np.sum(inp * g))

    direction = np.random.default_rng(1).standard_normal(x.shape)
    eps = 1e-6
    numeric = (loss(x + eps * direction) - loss(x - eps * direction)) / (2 * eps)
    assert numeric == pytest.approx(float(np.sum(dx * direction)), rel=1e-6)


def test_gradient_comparison_sees_the_last_bit():
    a = np.ones((2, 2))
    b = a.copy()
    b[0, 0] = np.nextafter(1.0, 2.0)
    identical, diff = compare_gradients(a, [(a,)], b, [(a,)])
    assert not identical and diff == pytest.approx(2.220446049250313e-16)
    zero = np.zeros(1)
    assert compare_gradients(zero, [], -zero, [])[0] is False  # -0.0 is another bit pattern


def test_a_missing_backward_fails_the_gradient_check():
    """Buffers start as NaN, so a layer the schedule never backpropagates cannot pass."""
    spec = mlp_spec(3, 16, 32, 8)
    params, x, g = init_network(spec)
    grads = gradient_buffers(params)
    for layer in grads:
        for buffer in layer:
            buffer.fill(np.nan)
    steps = evaluate(spec, parse_strategy("none", spec)).steps[:-1]  # drop backward(0)
    dx, _ = run_schedule(steps, params, grads, [x.copy(), g.copy()])
    ref_dx, ref_grads = reference_step(params, x, g)
    identical, diff = compare_gradients(dx, grads, ref_dx, ref_grads)
    assert not identical and diff == float("inf")


def test_verify_rejects_bad_input():
    with pytest.raises(StrategyError):
        verify(mlp_spec(4, 16, 16, 4), ["bogus"], repeats=1)
    with pytest.raises(StrategyError):  # no schedule fits 1 byte
        verify(mlp_spec(4, 16, 16, 4), ["optimal"], budget=1, repeats=1)


SMALL = ("verify", "--layers", "4", "--hidden", "64", "--ffn-hidden", "128", "--batch", "32")


def test_cli_json_schema(cli):
    code, out, err = cli(*SMALL, "-s", "full,revolve:2", "--repeats", "1", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["ok"] is True
    assert [r["strategy"] for r in data["runs"]] == ["none", "full", "revolve:2"]
    for r in data["runs"]:
        assert isinstance(r["gradients_identical"], bool) and r["gradients_identical"]
        assert isinstance(r["max_abs_grad_diff"], float)
        assert set(r["predicted"]) == {"peak_bytes", "layer_forwards", "flops", "seconds"}
        assert r["predicted"]["seconds"] > 0
        assert set(r["measured"]) == {"peak_bytes", "layer_forwards", "flops", "seconds"}
        for key in ("peak_bytes", "layer_forwards", "flops"):
            assert isinstance(r["predicted"][key], int) and isinstance(r["measured"][key], int)
        assert r["predicted"]["layer_forwards"] == r["measured"]["layer_forwards"]
        assert isinstance(r["measured"]["seconds"], float) and r["ok"] is True
    assert data["runs"][1]["predicted"]["layer_forwards"] == 8
    assert set(data["cpu_profile"]) == {
        "flops_per_s",
        "bytes_per_s",
        "call_seconds",
        "mask_seconds_per_value",
        "probe_spread",
    }


def test_cli_table(cli):
    code, out, err = cli(*SMALL, "--strategy", "uniform:2", "--repeats", "1")
    assert code == 0, err
    assert "uniform:2" in out and "identical" in out and "Verified" in out


def test_cli_mismatch_exits_1(cli):
    """A tolerance below the few bytes of Python objects the measurement includes must fail."""
    code, out, _ = cli(*SMALL, "-s", "full", "--repeats", "1", "--tolerance", "1e-9")
    assert code == 1
    assert "MISMATCH" in out


@pytest.mark.parametrize(
    "extra",
    [
        ("--strategy", "bogus"),
        ("--strategy", "uniform:9"),
        ("--repeats", "0"),
        ("--tolerance", "2"),
        ("--budget", "lots"),
        ("--layers", "0"),
    ],
)
def test_cli_bad_input_exits_2(cli, extra):
    code, out, err = cli(*SMALL, *extra)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1


def test_cli_imports_numpy_only_for_verify(cli):
    code = "import sys, ckplan.cli; assert 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_predicted_seconds_compose_the_time_model():
    """The cpu prediction is the roofline of the ops each schedule runs plus the executor's
    NumPy calls: more forwards, more predicted time, by exactly the layer forward's share."""
    from ckplan.hardware.cpu import CPUProfile
    from ckplan.hardware.step_time import layer_time
    from ckplan.simple import verify as executor

    spec = mlp_spec(4, 16, 32, 8)
    profile = CPUProfile(flops_per_s=1e10, bytes_per_s=1e10, call_seconds=1e-6, probe_spread=0)
    none = evaluate(spec, parse_strategy("none", spec))
    full = evaluate(spec, parse_strategy("full", spec))
    layer = layer_time(spec, profile.as_gpu())
    extra = layer.forward.total + executor.forward_calls(8) * 1e-6
    difference = executor.predicted_seconds(spec, full, profile) - executor.predicted_seconds(
        spec, none, profile
    )
    assert difference == pytest.approx(4 * extra)
