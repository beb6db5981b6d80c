"""Block scaling's (`fp8_recipe` blockwise) fp32 weight scales: one per 128x128 block of each
FP8 weight matrix, per copy, in Transformer Engine's padded scale shapes; the FP8 weight
matrices each rank holds; the buffer bytes and amax counts they add. Numbers by hand."""

import pytest

from ckplan.inputs.presets import load_spec
from ckplan.model import memory
from ckplan.model.fp8_blocks import weight_block_amaxes, weight_block_scale_bytes
from ckplan.model.layers import LayerKind

LLAMA3_8B = load_spec("llama3-8b", {"precision": "fp8", "dp": 8, "zero": 1})
BLOCKWISE = LLAMA3_8B.replace(fp8_recipe="blockwise")
DEEPSEEK_V3 = load_spec(
    "deepseek-v3",
    {"precision": "fp8", "fp8_recipe": "blockwise", "dp": 64, "ep": 64, "zero": 1},
)


def test_square_weight_scales():
    """(4096, 4096): 32 x 32 blocks, row-wise scales (32, roundup4(32) = 32), column-wise
    (32, 32), 4 bytes each: 8,192 bytes; 1,024 amaxes, as many as 4096² / 128²."""
    assert weight_block_scale_bytes(4096, 4096) == 4 * (32 * 32 + 32 * 32) == 8192
    assert weight_block_amaxes(4096, 4096) == 1024 == 4096 * 4096 // 128**2


def test_wide_weight_scales_and_the_padding_to_four_blocks():
    """Llama-3-8B's fc2 (4096, 14336): 32 x 112 blocks, row-wise (32, 112), column-wise
    (112, 32): 28,672 bytes. Split over 8 ranks, (4096, 1792): 32 x 14 blocks, the row-wise
    scales padded to (32, 16), the column-wise (14, 32): 3,840 bytes, 512 amaxes where the
    weights over 128² give 448."""
    assert weight_block_scale_bytes(4096, 14336) == 4 * (32 * 112 + 112 * 32) == 28_672
    assert weight_block_amaxes(4096, 14336) == 3584
    assert weight_block_scale_bytes(4096, 1792) == 4 * (32 * 16 + 14 * 32) == 3840
    assert weight_block_amaxes(4096, 1792) == 512 > 4096 * 1792 // 128**2 == 448
    # the transposed shape pads the other copy: (14336, 4096) -> (112, 32) and (32, 112)
    assert weight_block_scale_bytes(14336, 4096) == 28_672


def test_partial_edge_blocks_round_up_per_matrix():
    """DeepSeek-V3's linear_kv_down_proj (512 + 64, 7168): ceil(576/128) = 5 x 56 blocks,
    row-wise (5, 56), column-wise (56, roundup4(5) = 8): 2,912 bytes, 280 amaxes (the
    weights over 128² give 252). A (100, 200) weight: one block row of 2, (1, 4) and (2, 4)."""
    assert weight_block_scale_bytes(576, 7168) == 4 * (5 * 56 + 56 * 8) == 2912
    assert weight_block_amaxes(576, 7168) == 280 > 576 * 7168 // 128**2 == 252
    assert weight_block_scale_bytes(100, 200) == 4 * (1 * 4 + 2 * 4) == 48


def test_llama3_8b_matrices():
    """Llama-3-8B's TE linears, (out_features, in_features): QKV (4096 + 2·1024, 4096),
    out-proj (4096, 4096), fc1 (2·14336, 4096), fc2 (4096, 14336); at tp 8 each split."""
    assert memory.fp8_linear_layer_matrices(LLAMA3_8B, LayerKind()) == (
        ((6144, 4096, 1), (4096, 4096, 1), (28672, 4096, 1), (4096, 14336, 1)),
        (),
    )
    at_tp8 = LLAMA3_8B.replace(tp=8, dp=1)
    assert memory.fp8_linear_layer_matrices(at_tp8, LayerKind()) == (
        ((768, 4096, 1), (4096, 512, 1), (3584, 4096, 1), (4096, 1792, 1)),
        (),
    )


def test_deepseek_v3_moe_layer_matrices():
    """DeepSeek-V3's MoE layer at tp 1, ep 64: MLA's q_down (1536, 7168), q_up (128·192,
    1536), kv_down (576, 7168), kv_up (128·256, 512), linear_proj (7168, 128·128); the
    shared expert's fc1 (2·2048, 7168) and fc2 (7168, 2048); 256 / 64 = 4 routed experts,
    each fc1 (4096, 7168) and fc2 (7168, 2048)."""
    dense, experts = memory.fp8_linear_layer_matrices(DEEPSEEK_V3, LayerKind(moe=True))
    assert dense == (
        (1536, 7168, 1),
        (24576, 1536, 1),
        (576, 7168, 1),
        (32768, 512, 1),
        (7168, 16384, 1),
        (4096, 7168, 1),
        (7168, 2048, 1),
    )
    assert experts == ((4096, 7168, 4), (7168, 2048, 4))


@pytest.mark.parametrize(
    "spec",
    [
        LLAMA3_8B,
        LLAMA3_8B.replace(tp=4, dp=2),
        load_spec("mixtral-8x7b", {"precision": "fp8", "tp": 2, "sp": True, "ep": 4, "dp": 4}),
        load_spec(
            "qwen3-30b-a3b", {"precision": "fp8", "tp": 2, "sp": True, "ep": 8, "etp": 2, "dp": 8}
        ),
        DEEPSEEK_V3,
        DEEPSEEK_V3.replace(tp=4, sp=True, etp=1, dp=16),
    ],
)
def test_matrices_hold_the_fp8_linear_weights(spec):
    """The matrices' elements are the FP8 linear weights `fp8_linear_layer_parameters` counts
    (the layer's parameters less norms, biases and the router), dense and expert apart."""
    for kind in (LayerKind(), LayerKind(moe=True)) if spec.experts else (LayerKind(),):
        matrices = memory.fp8_linear_layer_matrices(spec, kind)
        elements = tuple(sum(r * c * n for r, c, n in part) for part in matrices)
        assert elements == memory.fp8_linear_layer_parameters(spec, kind)


def test_buffers_add_both_copies_scales():
    """Llama-3-8B, tp 1: per layer 1,536 + 1,024 + 7,168 + 3,584 = 13,312 blocks (all
    matrices multiples of 128, no padding), two copies, 4 bytes: 106,496 bytes, 32 layers:
    3,407,872 bytes beside the FP8 copies, with and without FP8 primary weights (the
    parameter's row-wise scales and the transpose's column-wise ones)."""
    per_layer = 2 * 4 * (1536 + 1024 + 7168 + 3584)
    assert per_layer == 106_496
    assert memory.fp8_weight_block_scale_bytes(BLOCKWISE, 0) == (32 * per_layer, 0)
    delayed, blockwise = (memory.stage_buffer_bytes(s, 0) for s in (LLAMA3_8B, BLOCKWISE))
    assert blockwise - delayed == 3_407_872
    gathered = [s.replace(fp8_param_gather=True) for s in (LLAMA3_8B, BLOCKWISE)]
    assert memory.stage_buffer_bytes(gathered[1], 0) - memory.stage_buffer_bytes(
        gathered[0], 0
    ) == (3_407_872)
    assert memory.fp8_weight_block_scale_bytes(LLAMA3_8B, 0) == (0, 0)


def test_deepseek_v3_layer_scale_bytes():
    """DeepSeek-V3 at tp 1, ep 64, blocks per matrix (row-wise + column-wise): q_down 12 x 56,
    2·672; q_up 192 x 12, 2·2,304; kv_down 5 x 56, 280 + 56·8; kv_up 256 x 4, 2·1,024;
    linear_proj 56 x 128, 2·7,168: MLA 23,064 scales. The shared expert's fc1 32 x 56 and
    fc2 56 x 16: 2·(1,792 + 896); each routed expert the same: 5,376 a pair. The dense
    MLP's fc1 288 x 56 and fc2 56 x 144: 2·(16,128 + 8,064). 4 bytes each."""
    mla = 2 * 672 + 2 * 2304 + (280 + 448) + 2 * 1024 + 2 * 7168
    assert mla == 23_064
    pair = 2 * (1792 + 896)
    moe_dense, moe_experts = (
        sum(n * weight_block_scale_bytes(r, c) for r, c, n in part)
        for part in memory.fp8_linear_layer_matrices(DEEPSEEK_V3, LayerKind(moe=True))
    )
    assert (moe_dense, moe_experts) == (4 * (mla + pair), 4 * 4 * pair) == (113_760, 86_016)
    dense_layer = memory.fp8_linear_layer_matrices(DEEPSEEK_V3, LayerKind())[0]
    mlp = 2 * (16128 + 8064)
    assert sum(n * weight_block_scale_bytes(r, c) for r, c, n in dense_layer) == 4 * (mla + mlp)


def test_amaxes_count_each_matrix_padded():
    """With FP8 primary weights the cast reduces the row-wise scale shape's elements of each
    matrix: at tp 1 Llama-3-8B's 13,312 a layer (= weights / 128², no padding); at tp 8,
    QKV (768, 4096) 6 x 32 = 192, out-proj (4096, 512) 32 x 4 = 128, fc1 (3584, 4096)
    28 x 32 = 896, fc2 (4096, 1792) 32 x roundup4(14) = 512: 1,728 a layer, where the weights
    over 128² give 1,664."""
    spec = BLOCKWISE.replace(fp8_param_gather=True)
    assert memory.fp8_weight_amaxes(spec, 0) == (32 * 13_312, 0)
    at_tp8 = spec.replace(tp=8, dp=1)
    assert memory.fp8_weight_amaxes(at_tp8, 0) == (32 * 1728, 0)
    fp8, _ = memory.fp8_linear_parameters(at_tp8, 0)
    assert fp8 // 128**2 == 32 * 1664
