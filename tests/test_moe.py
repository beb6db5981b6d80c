"""The mixture-of-experts MLP: per-op bytes and FLOPs by hand, routing, parameters, states."""

import pytest
from small_specs import SMALL_MOE

from ckplan.model import flops, memory
from ckplan.model.expert_layout import expert_layout
from ckplan.model.layers import LayerKind
from ckplan.model.moe import EXPERTS, MOE, routed_rows
from ckplan.model.op import LayerShapes
from ckplan.model.ops import layer_ops
from ckplan.model.spec import SpecError, spec_from_mapping
from ckplan.plan import evaluate, parse_strategy

MOE_LAYER = LayerKind(moe=True)

SMALL = SMALL_MOE


def small(**changes):
    return spec_from_mapping({**SMALL, **changes})


def by_op(spec):
    return {op.name: op for op in layer_ops(spec, MOE_LAYER)}


def test_saved_bytes_by_hand():
    """T = 64, k = 2, E = 4, R = T·k = 128 rows: router input B·T·h; top-k indices 8·T·k,
    their fp32 softmax 4·T·k and the fp32 aux-loss softmax 4·T·E; permute's int64 indices
    8·T·k, the 1-byte routing map T·E and masked_select's input, the transposed probabilities
    B·T·E; fc1 input B·R·h; fused SwiGLU input B·R·2F plus the R weights; fc2 input B·R·F;
    unpermute reuses permute's indices."""
    ops = by_op(small())
    assert ops["router"].saved_bytes == 2 * 64 * 64
    assert ops["router_probs"].saved_bytes == 8 * 128 + 4 * 128 + 4 * 256
    assert ops["permute"].saved_bytes == 8 * 128 + 256 + 2 * 256
    assert ops["expert_fc1"].saved_bytes == 2 * 128 * 64
    assert ops["expert_act"].saved_bytes == 2 * 128 * (2 * 32 + 1)
    assert ops["expert_fc2"].saved_bytes == 2 * 128 * 32
    assert ops["unpermute"].saved_bytes == 0
    assert "fc1" not in ops  # the dense MLP is replaced


def test_flops_count_the_routed_experts_only():
    """Router 2·T·h·E; experts: every token through k experts of 6·h·F_e (SwiGLU) FLOPs."""
    spec = small()
    ops = by_op(spec)
    assert ops["router"].forward_flops == 2 * 64 * 64 * 4
    experts = sum(ops[name].forward_flops for name in ("expert_fc1", "expert_fc2"))
    assert experts == 64 * 2 * 6 * 64 * 32
    dense_of_all_experts = 64 * 4 * 6 * 64 * 32
    assert experts * 2 == dense_of_all_experts  # k/E of the experts' weights, 2 of 4
    # The group FLOPs: the whole block, and the experts alone.
    assert flops.group_forward_flops(spec, EXPERTS, MOE_LAYER) == experts
    assert flops.group_forward_flops(spec, MOE, MOE_LAYER) == experts + 2 * 64 * 64 * 4


def test_routed_rows_average_worst_imbalance_capacity():
    """Average T·k; worst T·ep·min(k, E/ep); a factor f·T·k capped there; capacity c pads
    every expert to ceil(c·T·k/E) from each source rank: E·ceil(c·T·k/E) rows; etp gathers."""
    shapes = LayerShapes.of(small())
    assert routed_rows(small(), shapes) == 128
    ep2 = {"ep": 2, "dp": 2}
    assert routed_rows(small(**ep2, moe_imbalance="worst"), shapes) == 64 * 2 * 2
    assert routed_rows(small(**ep2, moe_imbalance=1.5), shapes) == 192
    assert routed_rows(small(**ep2, moe_imbalance=3), shapes) == 256  # capped at the worst
    assert routed_rows(small(capacity_factor=1.25), shapes) == 4 * 40  # ceil(64·2·1.25/4) = 40
    assert routed_rows(small(ep=2, etp=2, dp=4), shapes) == 128 * 2


def test_expert_tensor_parallel_widths():
    """etp = 2: R = 2·T·k gathered rows, each rank computing F_e/etp of every expert; the
    FLOPs per rank stay T·k·6·h·F_e."""
    ops = by_op(small(ep=1, etp=2, dp=2))
    rows = 256
    assert ops["expert_fc1"].saved_bytes == 2 * rows * 64
    assert ops["expert_act"].saved_bytes == 2 * rows * (2 * 16 + 1)
    assert ops["expert_fc2"].saved_bytes == 2 * rows * 16
    assert ops["expert_fc1"].forward_flops + ops["expert_fc2"].forward_flops == (
        64 * 2 * 6 * 64 * 32
    )


def test_shared_experts_and_gate():
    """Shared experts read the router's input (no second copy): a fused SwiGLU of
    shared_ffn_hidden over the T tokens; the Qwen2-MoE gate saves the shared output and the
    sigmoid (T·h + T values)."""
    ops = by_op(small(shared_experts=1, shared_expert_gate=True))
    assert ops["shared_fc1"].saved_bytes == 0
    assert ops["shared_act"].saved_bytes == 2 * 64 * 2 * 32
    assert ops["shared_fc2"].saved_bytes == 2 * 64 * 32
    assert ops["shared_gate"].saved_bytes == 2 * 64 * (64 + 1)
    assert ops["shared_fc1"].forward_flops == 2 * 64 * 64 * 64


def test_backward_walk_is_consistent_for_every_variant():
    """Every gradient an op allocates is read by another, every saved tensor freed (the walk
    asserts both), with and without recomputed groups."""
    variants = [
        {},
        {"shared_experts": 1},
        {"shared_experts": 1, "shared_expert_gate": True},
        {"dropout": 0.1, "attention": "standard"},
        {"capacity_factor": 1.0},
        {"tp": 2, "sp": True, "ep": 2, "etp": 1},
        {"mlp": "gelu", "bias": True, "shared_experts": 2},
    ]
    for changes in variants:
        spec = small(**changes)
        for groups in (None, MOE, EXPERTS, ("attention_core", MOE)):
            points = memory.layer_backward_walk(spec, groups, MOE_LAYER)
            assert points and all(p.live_bytes > 0 for p in points)


def test_recompute_groups_keep_their_inputs():
    """moe: the block's saved bytes dropped, norm2's output (X) kept; experts: the expert
    MLPs' dropped, their R dispatched rows and R probabilities kept."""
    spec = small()
    full = memory.activation_bytes_per_layer(spec, MOE_LAYER)
    ops = by_op(spec)
    block = sum(op.saved_bytes for op in ops.values() if op.group in (MOE, EXPERTS))
    X = 2 * 64 * 64
    assert memory.selective_activation_bytes_per_layer(spec, MOE, MOE_LAYER) == full - block + X
    experts = sum(ops[n].saved_bytes for n in ("expert_fc1", "expert_act", "expert_fc2"))
    kept = 2 * 128 * (64 + 1)
    assert (
        memory.selective_activation_bytes_per_layer(spec, EXPERTS, MOE_LAYER)
        == full - experts + kept
    )


def test_moe_strategy_recomputes_the_block():
    """`moe` stores the reduced tape and re-runs the block's forward in every MoE layer."""
    spec = small()
    none = evaluate(spec, parse_strategy("none", spec))
    moe = evaluate(spec, parse_strategy("moe", spec))
    assert moe.activation_bytes < none.activation_bytes
    assert moe.flops.recompute == 4 * flops.group_forward_flops(spec, MOE, MOE_LAYER)
    both = evaluate(spec, parse_strategy("selective+experts", spec))
    core = flops.group_forward_flops(spec, "attention_core", MOE_LAYER)
    assert both.flops.recompute == 4 * (core + flops.group_forward_flops(spec, EXPERTS, MOE_LAYER))


def test_parameters_mixtral_exact(spec_of):
    """Mixtral-8x7B: 46,702,792,704 (HF safetensors total); 12.9B active per token."""
    counts = memory.parameter_count(spec_of("mixtral-8x7b"))
    assert counts.total == 46_702_792_704
    assert round(counts.active / 1e8) == 129


def test_parameters_and_states_per_gpu_with_experts(spec_of):
    """Experts split over ep·etp, their optimizer states over expert-DP = tp·cp·dp/(ep·etp)
    with ZeRO-1; the rest over tp and dp."""
    spec = spec_of("mixtral-8x7b", tp=2, sp=True, ep=4, etp=1, dp=8, zero=1)
    assert spec.expert_data_parallel == 2 * 8 // 4
    dense, experts = memory.stage_parameters(spec)
    assert experts == 32 * 8 * 3 * 4096 * 14336 // 4
    states = memory.model_state_bytes(spec)
    assert states.expert_weights == 2 * experts
    assert states.expert_optimizer == -(-12 * experts // 4)
    assert states.optimizer == -(-12 * dense // 8) + states.expert_optimizer
    layout = expert_layout(spec)
    assert (layout.experts_per_gpu, layout.expert_data_parallel) == (2, 4)
    assert layout.routed_rows_per_gpu == 4096 // 2 * 2


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ep": 3}, "'ep' (3) must divide experts"),
        ({"top_k": 5}, "'top_k' (5) must be in 1..experts"),
        ({"tp": 2}, "needs sequence parallelism"),
        ({"ep": 2}, "ep·etp (2·1) must divide tp·cp·dp (1)"),
        ({"moe_layers": "none"}, "selects no layer"),
        ({"moe_layers": "2-9"}, "the model has layers 0..3"),
        ({"moe_imbalance": 0.5}, "average, worst or a factor >= 1"),
        ({"experts": 0, "ep": 2}, "'ep' needs a mixture of experts"),
        ({"experts": 0, "moe_imbalance": "worst"}, "'moe_imbalance' needs a mixture of experts"),
        ({"sliding_window_layers": "0-:2"}, "needs a sliding_window > 0"),
    ],
)
def test_moe_keys_are_validated(changes, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        small(**changes)


def test_moe_strategy_needs_experts(spec_of):
    from ckplan.plan import StrategyError

    with pytest.raises(StrategyError, match="has none"):
        parse_strategy("moe", spec_of("gpt2"))


def test_model_flops_count_the_routed_experts(spec_of):
    """Model FLOPs per iteration: 3 x every layer's forward and the logits, at any layout; an
    MoE layer's expert FLOPs are T·k·6·h·F_e (the k routed experts of every token)."""
    from ckplan.model.flops import layer_forward_flops, model_flops_per_iteration

    spec = spec_of("deepseek-v3", pp=16, first_stage_layers=1, ep=8, dp=8)
    whole = spec_of("deepseek-v3", seq=spec.seq, micro_batch=1)
    dense, moe = LayerKind(), MOE_LAYER
    layers = 3 * layer_forward_flops(whole, dense) + 58 * layer_forward_flops(whole, moe)
    logits = 2 * whole.seq * whole.hidden * whole.vocab
    assert model_flops_per_iteration(spec, 2) == 3 * (layers + logits) * 2
    experts = sum(op.forward_flops for op in layer_ops(whole, moe) if op.name.startswith("expert_"))
    assert experts == whole.seq * 8 * 6 * 7168 * 2048
