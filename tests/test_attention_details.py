"""QK-norms over all heads (OLMo 2) and attention sinks (gpt-oss): their parameters, their
layout over tensor-parallel ranks, and the router bias that `bias` gives a MoE layer."""

import pytest

from ckplan.model.memory import (
    float8_linear_weights,
    fp8_linear_layer_parameters,
    layer_module_parameters,
    layer_parameter_parts,
    layer_parameters,
    layer_tensors,
    norm_parameters,
    qk_norm_parameters,
    sink_parameters,
)
from ckplan.model.moe import moe_layer_parameters, router_bias_parameters
from ckplan.model.ops import representative_kind
from ckplan.model.spec import spec_from_mapping

BASE = {"name": "t", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 2, "seq": 256,
        "micro_batch": 1, "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "ffn_hidden": 1024,
        "vocab": 1000, "positions": "rope", "attention": "flash"}  # fmt: skip


def spec(**keys):
    return spec_from_mapping(BASE | keys)


def test_qk_norm_gains_by_hand():
    """d = 512 / 8 = 64: per head 64 and 64; over all heads 8·64 and 2·64."""
    assert qk_norm_parameters(spec(qk_norm=True)) == (64, 64)
    assert qk_norm_parameters(spec(qk_norm=True, qk_norm_width="full")) == (512, 128)
    assert qk_norm_parameters(spec()) == (0, 0)
    assert sink_parameters(spec(attention_sinks=True)) == 8 and sink_parameters(spec()) == 0


@pytest.mark.parametrize(
    "keys",
    [
        {"qk_norm": True},
        {"qk_norm": True, "qk_norm_width": "full"},
        {"attention_sinks": True},
        {"qk_norm": True, "qk_norm_width": "full", "attention_sinks": True, "bias": True},
    ],
)
def test_every_view_of_the_layer_sums_to_its_parameters(keys):
    """The tensors by shape, the modules and the Megatron layout hold the same parameters."""
    s = spec(**keys)
    total = layer_parameters(s)
    assert sum(shape[0] * (shape[1] if len(shape) > 1 else 1) * n
               for shape, n in layer_tensors(s).items()) == total  # fmt: skip
    assert sum(layer_module_parameters(s)) == total
    base = layer_parameters(spec(bias=keys.get("bias", False)))
    q_norm, k_norm = qk_norm_parameters(s)
    assert total - base == q_norm + k_norm + sink_parameters(s)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_full_width_norms_and_sinks_split_with_their_heads(tp):
    """Over t ranks the Q-norm's gains and the sinks split as the query heads do, the K-norm's
    as the K heads (replicated once t exceeds g = 2); only the two layer norms are whole on
    every rank."""
    s = spec(qk_norm=True, qk_norm_width="full", attention_sinks=True, tp=tp)
    parts = layer_parameter_parts(s)
    per_rank = parts.dense_per_rank(s)
    h, d, a, g = 512, 64, 8, 2
    kv_heads_here = -(-g // tp)
    q = (h * a * d + a * d + a) // tp + a * d * h // tp
    kv = kv_heads_here * (2 * h * d + d)
    ffn = 3 * h * 1024 // tp
    assert per_rank == q + kv + ffn + 2 * norm_parameters(s)
    # FP8 linears hold the weights without the norms' gains and the sinks
    dense, _ = fp8_linear_layer_parameters(s, representative_kind(s))
    assert dense == float8_linear_weights(s)


def test_a_biased_router():
    """With bias the router's gating linear has a bias per expert (Megatron-Core's TopKRouter
    under add_bias_linear, core_v0.15.0 on; gpt-oss), besides the experts' own biases;
    DeepSeek-V3's routing bias is another E."""
    E, h, F = 8, 512, 256
    moe = {"experts": E, "top_k": 2, "moe_ffn_hidden": F}
    plain, biased = spec(**moe), spec(**moe, bias=True)
    assert router_bias_parameters(plain) == 0 and router_bias_parameters(biased) == E
    assert router_bias_parameters(spec(**moe, bias=True, expert_bias=True)) == 2 * E
    _, plain_replicated, plain_experts = moe_layer_parameters(plain)
    _, biased_replicated, biased_experts = moe_layer_parameters(biased)
    assert biased_replicated - plain_replicated == E
    assert biased_experts - plain_experts == E * (2 * F + h)
