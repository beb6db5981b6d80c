"""Strategies: peak memory from the replayed schedule, against hand-derived live sets."""

from fractions import Fraction

import pytest

from ckplan.model.flops import group_forward_flops, layer_backward_flops, layer_forward_flops
from ckplan.model.memory import (
    activation_bytes_per_layer,
    embedding_saved_bytes,
    layer_input_bytes,
    selective_activation_bytes_per_layer,
)
from ckplan.model.op import ATTENTION_CORE
from ckplan.model.spec import spec_from_mapping
from ckplan.plan import StrategyError, evaluate, in_flight_microbatches, parse_strategy

SMALL = {
    "name": "small",
    "layers": 8,
    "hidden": 64,
    "heads": 4,
    "seq": 32,
    "micro_batch": 2,
    "vocab": 0,
    "dropout": 0.1,
}


@pytest.fixture
def small():
    return spec_from_mapping(SMALL)


def workspace(spec):
    """W, what a layer's backward holds beyond the chain's tape + δ_out + δ_in, by hand for
    SMALL's layer: Korthikanti's (B = 2, F = 4h, dropout, standard attention), as/h = 2.

    In sbh units, tape T = 34 + 5as/h. fc2's backward holds T - 1 (mlp_dropout's mask freed)
    + 2 (δ_out) + 2 (mlp_dropout's input gradient) + 8 (fc2's input gradient, (s, b, 4h)) =
    T + 11. The attention part peaks at attn_values' backward, T - 24 (the MLP, norm2,
    out_dropout, out_proj freed) + 2 + 2 (δ_out, mid-layer residual gradient) + 2 (context
    gradient) + 2as/h + 2 (dP, dV) = T - 16 + 2as/h = T - 12 here. The chain counts T + 4, so
    W = 7sbh. Selective (T = 34, the attention core re-forwarded from its kept Q, K, V, 6sbh,
    before its backward): fc2 again T + 11; attn_values 34 - 24 + 6 + 5as/h (rebuilt) + 8 +
    2as/h = 38 here: W = 7sbh too.
    """
    assert spec.hidden * 2 == spec.heads * spec.seq  # as/h = 2
    return 7 * spec.seq * spec.micro_batch * spec.hidden


def plan(spec, strategy, **kwargs):
    return evaluate(spec, parse_strategy(strategy, spec), **kwargs)


def test_none_holds_every_tape(small):
    """Backward of the last layer: L tapes + δ_L + δ_{L-1} (the two gradients of that step)
    + W (its gradients in flight)."""
    T, X, W = activation_bytes_per_layer(small), layer_input_bytes(small), workspace(small)
    result = plan(small, "none")
    assert result.activation_bytes == small.layers * T + 2 * X + W
    assert result.flops.recompute == 0 and result.overhead == 0


def test_full_recompute(small):
    """L layer inputs kept; at the peak one layer's tape is rebuilt: T + (L + 1)·X + W."""
    T, X, W = activation_bytes_per_layer(small), layer_input_bytes(small), workspace(small)
    result = plan(small, "full")
    assert result.activation_bytes == T + (small.layers + 1) * X + W
    assert result.flops.recompute == small.layers * layer_forward_flops(small)
    forward, backward = layer_forward_flops(small), layer_backward_flops(small)
    assert result.overhead == pytest.approx(forward / (forward + backward))


@pytest.mark.parametrize("K", [1, 2, 4, 8])
def test_uniform_segments(small, K):
    """n = L/K stored segment inputs; backward of a segment re-forwards K tapes:
    (n + 1)·X + K·T + W, not the simple formulas' (n + K)·X (a layer stores far more than its
    input)."""
    T, X, W = activation_bytes_per_layer(small), layer_input_bytes(small), workspace(small)
    n = small.layers // K
    assert plan(small, f"uniform:{K}").activation_bytes == (n + 1) * X + K * T + W


def test_sequential_keeps_last_segment(small):
    """torch checkpoint_sequential: the last of n segments is stored; its tapes stay alive
    while the others' inputs are stored: (n - 1)·X + K·T + 2X + W, with one forward less."""
    T, X, W = activation_bytes_per_layer(small), layer_input_bytes(small), workspace(small)
    K, n = 2, 4
    result = plan(small, f"sequential:{K}")
    assert result.activation_bytes == (n - 1) * X + K * T + 2 * X + W
    assert result.flops.recompute == (small.layers - K) * layer_forward_flops(small)


def test_block_recomputes_first_layers(small):
    T, X, W = activation_bytes_per_layer(small), layer_input_bytes(small), workspace(small)
    N = 3
    result = plan(small, f"block:{N}")
    assert result.activation_bytes == N * X + (small.layers - N) * T + 2 * X + W
    assert result.flops.recompute == N * layer_forward_flops(small)
    assert plan(small, "block:0").activation_bytes == plan(small, "none").activation_bytes


@pytest.mark.parametrize("K", [2, 4])
def test_every_kth_layer_recomputed(small, K):
    """torchtitan's per-layer selective checkpointing: layers K, 2K, ... (1-based) keep only
    their input, the others their tape. The peak is the last layer's re-run: its rebuilt tape
    beside the L - L/K stored tapes and the other L/K - 1 inputs, + 2X + W."""
    T, X, W = activation_bytes_per_layer(small), layer_input_bytes(small), workspace(small)
    L = small.layers
    result = plan(small, f"every:{K}")
    assert result.activation_bytes == (L - L // K + 1) * T + (L // K - 1) * X + 2 * X + W
    assert result.flops.recompute == (L // K) * layer_forward_flops(small)


def test_every_layer_is_full_and_a_remainder_is_stored(small):
    full = plan(small, "full")
    every = plan(small, "every:1")
    assert (every.activation_bytes, every.flops) == (full.activation_bytes, full.flops)
    # 8 layers, K = 3: layers 3 and 6 re-run, 7 and 8 stored
    assert plan(small, "every:3").flops.recompute == 2 * layer_forward_flops(small)


@pytest.mark.parametrize("name", ["llama3-8b", "gpt2"])
@pytest.mark.parametrize("K", [1, 2, 3, 5, 7])
def test_every_kth_layer_runs_replay_as_the_simulated_schedule(spec_of, name, K):
    """The closed-form replay of every:K's runs peaks where the step-by-step simulation of its
    segments does (the embedding and the output stage included)."""
    import importlib

    from ckplan.plan.layer_chain import layer_chain
    from ckplan.schedules import segment_schedule, simulate

    evaluation = importlib.import_module("ckplan.plan.evaluate")
    spec = spec_of(name)
    strategy = parse_strategy(f"every:{K}", spec)
    chain = layer_chain(spec, False)
    runs = evaluation._segment_runs(spec, chain, strategy, 0)
    segments = evaluation.run_segments(runs)
    # the embedding is stage 0: the K-th, 2K-th, ... layers re-run alone
    again = [(start, end) for start, end, recompute in segments if recompute]
    assert again == [(k, k + 1) for k in range(K, spec.layers + 1, K)]
    simulated = simulate(chain, segment_schedule(chain, segments))
    assert evaluation._replay_runs(chain, runs).peak_bytes == simulated.peak_bytes


def test_selective(small):
    S = selective_activation_bytes_per_layer(small, ATTENTION_CORE)
    X, W = layer_input_bytes(small), workspace(small)
    result = plan(small, "selective")
    assert result.activation_bytes == small.layers * S + 2 * X + W
    assert result.flops.recompute == small.layers * group_forward_flops(small, ATTENTION_CORE)
    assert result.flops.backward == small.layers * layer_backward_flops(small)


def test_sqrt_is_round_sqrt_layers(small):
    assert plan(small, "sqrt").activation_bytes == plan(small, "uniform:3").activation_bytes


def test_pipeline_first_stage_holds_p_microbatches(spec_of):
    """1F1B: the first stage keeps p micro-batches of its L/p layers = L layers' worth
    (Korthikanti §4.2.3), plus the embedding's tape per micro-batch.

    The backward of its last layer adds W: as/h = 96·2048/12288 = 16 > 13.5, so that layer
    peaks at attn_values' backward, T - 16sbh/t + 2as²b/t (see `workspace`; every term /t
    under TP + SP), W = (2as²b - 20sbh)/t beyond the chain's T + 4sbh/t."""
    spec = spec_of("megatron-175b", virtual_stages=1)  # the preset interleaves 3 (Table 3)
    assert in_flight_microbatches(spec) == spec.pp
    T, X = activation_bytes_per_layer(spec), layer_input_bytes(spec)
    s, b, h, a, t = spec.seq, spec.micro_batch, spec.hidden, spec.heads, spec.tp
    W = (2 * a * s * s * b - 20 * s * b * h) // t
    one_microbatch = spec.layers_per_stage * T + embedding_saved_bytes(spec)
    result = plan(spec, "none")
    # peak of the last micro-batch's backward + (p - 1) held micro-batches
    assert result.activation_bytes == one_microbatch + 2 * X + W + (spec.pp - 1) * one_microbatch
    interleaved = spec.replace(virtual_stages=2)
    assert in_flight_microbatches(interleaved) == spec.pp * (1 + Fraction(spec.pp - 1, 2 * spec.pp))


def test_few_microbatches_hold_fewer(spec_of):
    spec = spec_of("megatron-175b", microbatches=3, virtual_stages=1)
    assert in_flight_microbatches(spec) == 3


@pytest.mark.parametrize(
    "text",
    [
        "uniform",
        "uniform:0",
        "uniform:99",
        "block:-1",
        "revolve:0",
        "bogus",
        "none:3",
        "selective+selective",
        "uniform:two",
        "every:0",
        "every:9",
    ],
)
def test_bad_strategies(small, text):
    with pytest.raises(StrategyError):
        parse_strategy(text, small)


def test_strategy_names_round_trip(small):
    for text in [
        "none",
        "full",
        "uniform:2",
        "sequential:4",
        "sqrt",
        "selective",
        "block:3",
        "revolve:2",
        "optimal",
        "selective+uniform:2",
        "selective+block:1",
        "every:2",
        "selective+every:2",
    ]:
        assert parse_strategy(text, small).name == text


def test_optimal_needs_budget(small):
    with pytest.raises(StrategyError, match="needs a memory budget"):
        plan(small, "optimal")


def test_pipeline_full_recompute_holds_only_inputs(spec_of):
    """Under full recompute the p - 1 micro-batches waiting for their backward hold only their
    layer inputs (and the embedding's tape), not a rebuilt tape (Korthikanti Table 2, full
    recompute: 2sbh/t per layer with SP)."""
    spec = spec_of("megatron-1t")
    X = layer_input_bytes(spec)
    waiting = embedding_saved_bytes(spec) + spec.layers_per_stage * X
    one = plan(spec.replace(microbatches=1), "full").activation_bytes
    assert plan(spec, "full").activation_bytes == one + (spec.pp - 1) * waiting
    assert plan(spec, "full").activation_bytes < plan(spec, "selective").activation_bytes


# ---- the dense MLP module (Megatron-Core's --recompute-modules mlp) ------------------------


def test_mlp_module_keeps_fc1_input_and_rebuilds_the_rest(spec_of):
    """`mlp` stores each layer but re-runs fc1, the activation and fc2 in its backward: the
    layer keeps fc1's input (norm2's output) instead of the MLP's tapes, and the recompute is
    exactly the MLP's forward FLOPs of every layer and micro-batch."""
    from ckplan.model.op import DENSE_MLP, in_group
    from ckplan.model.ops import group_input_bytes, layer_ops

    spec = spec_of("llama3-8b", layers=4)
    none = evaluate(spec, parse_strategy("none", spec))
    mlp = evaluate(spec, parse_strategy("mlp", spec))
    members = [op for op in layer_ops(spec) if in_group(op, DENSE_MLP)]
    assert [op.name for op in members] == ["fc1", "act", "fc2"]
    assert group_input_bytes(spec.chain, DENSE_MLP) == members[0].saved_bytes
    assert mlp.flops.recompute == spec.layers * sum(op.forward_flops for op in members)
    assert mlp.activation_bytes < none.activation_bytes
    both = evaluate(spec, parse_strategy("mlp+selective", spec))
    assert both.strategy == "selective+mlp"
    assert both.flops.recompute > mlp.flops.recompute


def test_mlp_module_needs_dense_layers(spec_of):
    with pytest.raises(StrategyError, match="every layer of this model is MoE"):
        parse_strategy("mlp", spec_of("mixtral-8x7b"))
    parse_strategy("mlp", spec_of("deepseek-v3"))  # its three dense layers
