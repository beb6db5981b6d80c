"""Per-GPU parameters as Megatron-LM lays them out, against hand-computed counts.

Megatron-LM's modules (megatron/core/tensor_parallel/layers.py, models/common/embeddings,
models/common/language_module): column-parallel linears split weight and bias over t;
row-parallel linears split the weight but keep the whole bias; the word embedding and output
layer split the vocabulary over t; learned position embeddings, norms and the MoE router are
whole on every rank; with tied embeddings and p > 1 the last stage keeps a copy of the word
embedding as its output layer.
"""

import pytest

from ckplan.model import memory
from ckplan.model.spec import spec_from_mapping

# A small GPT (LayerNorm, GELU, biases, learned positions, tied embeddings).
GPT = {
    "name": "tiny-gpt",
    "layers": 4,
    "hidden": 64,
    "heads": 8,
    "vocab": 1000,
    "seq": 128,
    "micro_batch": 1,
    "norm": "layernorm",
    "mlp": "gelu",
    "positions": "learned",
    "bias": True,
    "tied_embeddings": True,
}


def gpt(**changes):
    return spec_from_mapping({**GPT, **changes})


def test_gpt_layer_per_rank_by_hand():
    """h 64, t 4: Q, K, V weights 3·64·64/4 and biases 3·64/4; out-proj weight 64·64/4 and its
    whole bias 64; fc1 64·256/4 + 256/4; fc2 256·64/4 and its whole bias 64; two LayerNorms
    2·(64 + 64), whole."""
    h, t = 64, 4
    per_rank = (3 * h * h + 3 * h) // t + h * h // t + h + (h * 4 * h + 4 * h) // t
    per_rank += 4 * h * h // t + h + 2 * 2 * h
    assert per_rank == 12_784
    part = memory.layer_parameter_parts(gpt(tp=4))
    assert part.dense_per_rank(gpt(tp=4)) == per_rank
    assert part.total == 12 * h * h + 13 * h  # the whole layer: 12h² + 13h (GPT-2's count)


def test_learned_positions_are_whole_on_every_tp_rank():
    """Stage 0 of t 4, p 2: two layers, the vocab-parallel word embedding 1000·64/4 and the
    position embedding 128·64, whole (not /4)."""
    spec = gpt(tp=4, pp=2)
    layer = memory.layer_parameter_parts(spec).dense_per_rank(spec)
    first = 2 * layer + 1000 * 64 // 4 + 128 * 64
    assert memory.stage_parameters(spec, 0) == (first, 0)


def test_tied_embeddings_keep_a_copy_on_the_last_stage():
    """Last stage of t 4, p 2: two layers, the final LayerNorm (2·64, whole) and the copy of
    the word embedding that is its output layer (1000·64/4); with p 1 the two are one tensor."""
    spec = gpt(tp=4, pp=2)
    layer = memory.layer_parameter_parts(spec).dense_per_rank(spec)
    assert memory.stage_parameters(spec, 1) == (2 * layer + 2 * 64 + 1000 * 64 // 4, 0)
    single = gpt(tp=4)
    assert memory.stage_parameters(single, 0)[0] == (4 * layer + 1000 * 64 // 4 + 128 * 64 + 2 * 64)
    untied = gpt(tp=4, pp=2, tied_embeddings=False)
    assert memory.stage_parameters(untied, 1) == memory.stage_parameters(spec, 1)


def test_busiest_stage_is_the_one_with_most_parameters():
    """Learned positions make the first stage the fuller one; with RoPE the last stage holds
    the final norm on top of the same vocabulary share."""
    assert memory.busiest_stage(gpt(tp=4, pp=2)) == 0
    rope = gpt(tp=4, pp=2, positions="rope")
    assert memory.busiest_stage(rope) == 1
    assert memory.parameters_per_gpu(rope) == sum(memory.stage_parameters(rope, 1))


def test_kv_heads_replicated_beyond_kv_groups(spec_of):
    """Llama-3-8B (h 4096, d 128, g 8) at t 16: each rank keeps one K and one V head,
    2·4096·128, where t 8 keeps one (also 2·4096·128) and t 4 two."""
    h, d = 4096, 128
    for t, kv_heads_per_rank in ((4, 2), (8, 1), (16, 1)):
        spec = spec_of("llama3-8b", tp=t, sp=True)
        part = memory.layer_parameter_parts(spec)
        q_out = h * h // t + h * h // t  # Q and out-proj
        mlp = 3 * h * 14336 // t
        norms = 2 * h
        assert part.dense_per_rank(spec) == q_out + 2 * h * d * kv_heads_per_rank + mlp + norms


def test_megatron_presets_positions_no_longer_divided(spec_of):
    """The busiest GPU of Korthikanti's models holds s·h position parameters whole: 0.4 % more
    than dividing them by t for 22B, 2.2 % for 1T."""
    for name, low, high in (("megatron-22b", 0.003, 0.006), ("megatron-1t", 0.02, 0.025)):
        spec = spec_of(name)
        per_gpu = memory.parameters_per_gpu(spec)
        positions = spec.seq * spec.hidden
        divided = per_gpu - positions + -(-positions // spec.tp)
        assert low < per_gpu / divided - 1 < high


def test_moe_biases_and_router(spec_of):
    """Mixtral-style MoE with biases: each expert's fc2 bias stays whole on its etp ranks, the
    shared expert's fc2 bias (row-parallel) on every TP rank, the router (E·h, and its bias of
    E under add_bias_linear: Megatron-Core's TopKRouter since core_v0.15.0) whole."""
    base = spec_of("mixtral-8x7b", layers=2, tp=2, sp=True, ep=4, etp=2, dp=4)
    spec = base.replace(bias=True, qkv_bias=True, shared_experts=1, shared_ffn_hidden=14336)
    h, E, F = spec.hidden, spec.experts, spec.moe_ffn_hidden
    part = memory.layer_parameter_parts(spec)
    expert_matrices = E * (h * 2 * F + F * h + 2 * F)
    assert part.experts == expert_matrices + E * h
    assert part.experts_per_rank(spec) == expert_matrices // (4 * 2) + E // 4 * h
    shared = h * 2 * F + F * h + 2 * F  # fc1 (gate and up) with bias, fc2 weight
    attention = 2 * h * h // 2 + 2 * h * 1024 // 2 + (h + 2 * 1024) // 2  # 8 kv heads of 128
    # norms, out-proj bias, shared fc2 bias, router weight and bias
    norms_and_row_biases = 2 * h + h + h + E * h + E
    assert part.dense_per_rank(spec) == attention + shared // 2 + norms_and_row_biases


def test_mla_down_projections_whole(spec_of):
    """DeepSeek-V3's MLA at t 8: q_down (7168·1536), kv_down (7168·(512 + 64)) and their norms
    (1536 + 512) whole; q_up, kv_up and out-proj split."""
    spec = spec_of("deepseek-v3", tp=8, sp=True, ep=8, dp=8, layers=4, moe_layers="3-")
    part = memory.layer_parameter_parts(spec, memory.layer_kinds(spec)[0])  # a dense layer
    h, a = 7168, 128
    whole = h * 1536 + 1536 + h * (512 + 64) + 512 + 2 * h
    split = 1536 * a * 192 + 512 * a * (128 + 128) + a * 128 * h + 3 * h * 18432
    assert part.replicated == whole
    assert part.dense_per_rank(spec) == split // 8 + whole


@pytest.mark.parametrize("name", ["llama3-70b", "megatron-175b", "mixtral-8x7b", "gpt2"])
def test_every_parameter_on_some_rank(spec_of, name):
    """Summing every stage's per-rank share over t ranks covers the whole model (more where
    ranks hold replicas)."""
    spec = spec_of(name, pp=2, tp=2, sp=True)
    held = sum(sum(memory.stage_parameters(spec, k)) for k in range(spec.pp))
    total = memory.parameter_count(spec).total
    replicated_experts = 1 if not spec.experts else spec.ep * spec.etp / spec.tp
    assert held * spec.tp >= total / replicated_experts
