"""Transformer Engine's FP8 scaling recipes (`fp8_recipe`): what each cast, gather and amax
reduction moves, by hand, and the key's rules."""

import pytest
from small_specs import (
    H100_ALL_REDUCE_LATENCY_2_RANKS,
    H100_GATHER_LATENCY_2_RANKS,
    H100_NVLINK_BANDWIDTH,
    SMALL_DENSE_TP2,
    SMALL_MOE,
    ops_by_name,
    spec_from,
)

from ckplan.errors import InputError
from ckplan.hardware import communication as comm
from ckplan.hardware.code_path import (
    current_scaling_amax_reductions,
    fp8_amax_pass_bytes,
    fp8_block_gathered_bytes,
    fp8_gathered_bytes,
    fp8_quantize_bytes,
    spec_code_path,
)
from ckplan.hardware.roofline import memory_seconds
from ckplan.hardware.step_time import tensor_parallel_comm
from ckplan.inputs.gpus import load_gpu

SMALL = {**SMALL_DENSE_TP2, "precision": "fp8"}
BANDWIDTH = H100_NVLINK_BANDWIDTH
GATHER_LATENCY = H100_GATHER_LATENCY_2_RANKS
REDUCE_LATENCY = H100_ALL_REDUCE_LATENCY_2_RANKS


def small(**changes):
    return spec_from(SMALL, **changes)


ops_of = ops_by_name


@pytest.fixture
def h100():
    """The H100's rates, its MXFP8 flag set so that one GPU times all three recipes."""
    return load_gpu("h100-sxm").replace(mxfp8=True)


def test_mxfp8_needs_a_gpu_with_mxfp8_tensor_cores():
    with pytest.raises(InputError, match="fp8_recipe mxfp8 needs MXFP8 tensor cores"):
        spec_code_path(small(fp8_recipe="mxfp8"), load_gpu("h100-sxm"))
    assert load_gpu("b200").mxfp8 and load_gpu("gb200").mxfp8
    assert not load_gpu("rtx-5090").mxfp8  # compute capability 12.0: not yet (TE v2.9)


def test_quantize_bytes_by_hand():
    # (64, 96): read 2, write the row-wise and column-wise copies, 1 + 1 -> 4 · 6144
    assert fp8_quantize_bytes("delayed", 64, 96) == fp8_quantize_bytes("current", 64, 96) == 24576
    assert fp8_quantize_bytes(None, 64, 96) == 24576  # torchao's float8
    # MXFP8 adds the scales: row-wise 64 · ceil(96/32) = 192, column-wise ceil(64/32) · 96 = 192
    assert fp8_quantize_bytes("mxfp8", 64, 96) == 24576 + 192 + 192
    # a width that is no multiple of 32 still has a scale for its last, short block
    assert fp8_quantize_bytes("mxfp8", 33, 40) == 4 * 33 * 40 + 33 * 2 + 2 * 40


def test_amax_pass_reads_the_input_once_more_under_current_scaling_alone():
    assert fp8_amax_pass_bytes("current", 6144, 2) == 12288
    assert fp8_amax_pass_bytes("delayed", 6144, 2) == 0
    assert fp8_amax_pass_bytes("mxfp8", 6144, 2) == 0


def test_gathered_bytes_by_hand():
    assert fp8_gathered_bytes("delayed", 4096) == fp8_gathered_bytes("current", 4096) == 4096
    assert fp8_gathered_bytes("mxfp8", 4096) == 4096 + 128
    assert fp8_gathered_bytes("mxfp8", 4097) == 4097 + 129


def test_amax_reductions_only_under_current_scaling_with_sequence_parallelism():
    assert current_scaling_amax_reductions("current", True, 2) == 1
    assert current_scaling_amax_reductions("current", False, 2) == 0
    assert current_scaling_amax_reductions("current", True, 1) == 0
    assert current_scaling_amax_reductions("delayed", True, 8) == 0
    assert current_scaling_amax_reductions("mxfp8", True, 8) == 0


def test_default_is_delayed_and_the_key_needs_transformer_engine_fp8():
    assert small().fp8_recipe == "delayed"
    assert small(precision="bf16").fp8_recipe is None
    with pytest.raises(InputError, match=r"key 'fp8_recipe'.*needs precision fp8, got 'float8'"):
        small(precision="float8", fp8_recipe="current")
    with pytest.raises(InputError, match="key 'fp8_recipe' must be one of delayed, current"):
        small(fp8_recipe="tensorwise")
    assert small(fp8_recipe="blockwise").fp8_recipe == "blockwise"


def test_cast_time_per_recipe_by_hand(h100):
    """The forward and backward memory time of out_proj (64 tokens, 64 -> 64 on each of 2
    ranks: input (64, 32), output gradient (64, 64)) and of qkv (norm-fused input)."""
    per_recipe = {r: ops_of(small(fp8_recipe=r)) for r in ("delayed", "current", "mxfp8")}
    paths = {r: spec_code_path(small(fp8_recipe=r), h100) for r in per_recipe}
    out = per_recipe["delayed"]["out_proj"]
    mm = out.matmul
    rows, k, n = mm.batch * mm.m, mm.k, mm.n
    delayed_f = paths["delayed"].forward(out, 2).memory
    delayed_b = paths["delayed"].backward(out, 2).memory
    # current: + 2 bytes per element of the input (no norm before it) and of the gradient
    assert paths["current"].forward(out, 2).memory - delayed_f == pytest.approx(
        memory_seconds(h100, 2 * rows * k)
    )
    assert paths["current"].backward(out, 2).memory - delayed_b == pytest.approx(
        memory_seconds(h100, 2 * rows * n)
    )
    # mxfp8: + the scales, one byte per 32 values per copy
    scales_f = rows * -(-k // 32) + -(-rows // 32) * k
    assert paths["mxfp8"].forward(out, 2).memory - delayed_f == pytest.approx(
        memory_seconds(h100, scales_f)
    )
    # qkv's input comes from the fused norm, which finds the amax: no extra read forward
    qkv = per_recipe["delayed"]["qkv_proj"]
    assert paths["current"].forward(qkv, 2).memory == pytest.approx(
        paths["delayed"].forward(qkv, 2).memory
    )
    assert paths["current"].backward(qkv, 2).memory > paths["delayed"].backward(qkv, 2).memory


def test_sequence_parallel_collectives_per_recipe_by_hand(h100):
    amax = 0.5 * 2 * 4 / BANDWIDTH + REDUCE_LATENCY  # all-reduce of 4 bytes over 2 ranks
    assert comm.all_reduce_latency(h100, 2) == pytest.approx(REDUCE_LATENCY)
    gather = 0.5 * 4096 / BANDWIDTH + GATHER_LATENCY  # (64, 64) in FP8
    for recipe, extra_f in (("delayed", 0.0), ("current", amax)):
        spec = small(fp8_recipe=recipe)
        qkv = ops_of(spec)["qkv_proj"]
        assert tensor_parallel_comm(spec, h100, (qkv,))[0] == pytest.approx(gather + extra_f)
        out = ops_of(spec)["out_proj"]
        assert tensor_parallel_comm(spec, h100, (out,))[1] == pytest.approx(gather + extra_f)
    # mxfp8 gathers the scales too: 4096 / 32 = 128 bytes more
    spec = small(fp8_recipe="mxfp8")
    qkv = ops_of(spec)["qkv_proj"]
    assert tensor_parallel_comm(spec, h100, (qkv,))[0] == pytest.approx(
        0.5 * (4096 + 128) / BANDWIDTH + GATHER_LATENCY
    )


# ---- block scaling (fp8_recipe blockwise, Transformer Engine's Float8BlockScaling) ----------


def test_blockwise_needs_hopper_block_scaled_gemms():
    """Native on compute capability 9.x alone; Blackwell emulates it with MXFP8 (TE v2.9),
    Ada has no block-scaled FP8 GEMM: refused, naming the key."""
    for name in ("h100-sxm", "h100-nvl", "h100-pcie", "h200", "h800"):
        assert load_gpu(name).fp8_block_gemm_rate == 0.814
        spec_code_path(small(fp8_recipe="blockwise"), load_gpu(name))
    for name in ("b200", "gb200", "rtx-5090", "l40s", "rtx-4090"):
        assert load_gpu(name).fp8_block_gemm_rate == 0.0
        with pytest.raises(InputError, match=r"fp8_recipe blockwise needs block-scaled FP8 GEMMs"):
            spec_code_path(small(fp8_recipe="blockwise"), load_gpu(name))


def test_the_hopper_rate_is_the_derivation_from_transformer_engines_benchmark():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "validation"))
    from te_fp8_block_gemm_rate import block_gemm_rate

    assert round(block_gemm_rate(), 3) == load_gpu("h800").fp8_block_gemm_rate


def test_blockwise_quantize_bytes_by_hand():
    """Both copies' fp32 scales, one per 128 values, in the GEMM-ready shapes: (64, 96) has
    a row-wise scale tensor (ceil(96/128), roundup4(64)) = (1, 64) and a column-wise one
    (ceil(64/128), roundup4(96)) = (1, 96), 4 bytes each."""
    assert fp8_quantize_bytes("blockwise", 64, 96) == 24576 + 4 * 64 + 4 * 96
    # rows padded to 4 in the row-wise scales: (1, 36); the column-wise (1, 40)
    assert fp8_quantize_bytes("blockwise", 33, 40) == 4 * 33 * 40 + 4 * 36 + 4 * 40
    # 300 columns: 3 blocks of a row
    assert fp8_quantize_bytes("blockwise", 8, 300) == 4 * 8 * 300 + 4 * 3 * 8 + 4 * 1 * 300
    # two groups of 128 rows (a grouped GEMM's experts), each cast on its own
    assert fp8_quantize_bytes("blockwise", 256, 96, 2) == 4 * 256 * 96 + 2 * (4 * 128 + 4 * 96)
    assert fp8_amax_pass_bytes("blockwise", 6144, 2) == 0
    assert current_scaling_amax_reductions("blockwise", True, 8) == 0


def test_blockwise_gathered_bytes_by_hand():
    """(64, 64) over 2 ranks, each (32, 64): the compact scales, row-wise (32, ceil(64/128))
    and column-wise (ceil(32/128), 64) per rank, unpadded."""
    assert fp8_block_gathered_bytes(64, 64, 2, "rowwise") == 4096 + 2 * 4 * 32
    assert fp8_block_gathered_bytes(64, 64, 2, "columnwise") == 4096 + 2 * 4 * 64
    assert fp8_block_gathered_bytes(64, 64, 2, "both") == 2 * 4096 + 2 * 4 * 32 + 2 * 4 * 64


def test_blockwise_saves_the_column_wise_copy_with_its_scales():
    """SMALL at tp 2 with sp: qkv and fc1 save their (32, 64) sequence shard in the compact
    format, scales (ceil(32/128), 64); out_proj its (64, 32) input, fc2 its (64, 64), in the
    GEMM-ready one, (1, roundup4(32)) and (1, 64); 4 bytes a scale."""
    delayed, blockwise = ops_of(small()), ops_of(small(fp8_recipe="blockwise"))
    assert delayed["qkv_proj"].saved_bytes == 2048
    expected = {"qkv_proj": 4 * 64, "fc1": 4 * 64, "out_proj": 4 * 32, "fc2": 4 * 64}
    for name, scales in expected.items():
        assert blockwise[name].saved_bytes == delayed[name].saved_bytes + scales, name
    assert blockwise["act"].saved_bytes == delayed["act"].saved_bytes
    # without sequence parallelism the column-parallel inputs are GEMM-ready: (1, 64) too
    plain = ops_of(small(fp8_recipe="blockwise", sp=False))
    assert plain["qkv_proj"].saved_bytes == ops_of(small(sp=False))["qkv_proj"].saved_bytes + 256


def test_blockwise_experts_scale_each_experts_rows():
    """SMALL_MOE: 4 local experts, 64 tokens x top-2 = 128 routed rows, 32 an expert; each
    expert's input is its own block-scaled tensor (TE's GroupedLinear), so fc1's (32, 64)
    inputs keep 4 x (ceil(32/128), 64) scales and fc2's (32, 32) ones 4 x (1, 32), 4 bytes
    each."""
    from ckplan.model.ops import layer_ops

    def experts(recipe):
        spec = spec_from(SMALL_MOE, precision="fp8", fp8_recipe=recipe)
        return {op.name: op for op in layer_ops(spec)}

    delayed, blockwise = experts("delayed"), experts("blockwise")
    assert delayed["expert_fc1"].saved_bytes == 128 * 64
    assert blockwise["expert_fc1"].saved_bytes == 128 * 64 + 4 * 4 * 64
    assert blockwise["expert_fc2"].saved_bytes == 128 * 32 + 4 * 4 * 32


def test_blockwise_time_by_hand(h100):
    """out_proj: the casts write both copies' scales beside delayed's bytes, and the GEMM runs
    at the block-scaled rate, 0.814 of the FP8 one."""
    spec = small(fp8_recipe="blockwise")
    out = ops_of(spec)["out_proj"]
    blockwise, delayed = spec_code_path(spec, h100), spec_code_path(small(), h100)
    rows, k, n = 64, 32, 64
    scales_f = 4 * 64 + 4 * 32  # (1, 64) row-wise, (1, 32) column-wise
    scales_b = 4 * 64 + 4 * 64
    assert blockwise.forward(out, 2).memory - delayed.forward(out, 2).memory == pytest.approx(
        memory_seconds(h100, scales_f)
    )
    assert blockwise.backward(out, 2).memory - delayed.backward(out, 2).memory == pytest.approx(
        memory_seconds(h100, scales_b)
    )
    assert (rows, k, n) == (out.matmul.m, out.matmul.k, out.matmul.n)
    assert blockwise.forward(out, 2).matmul == pytest.approx(delayed.forward(out, 2).matmul / 0.814)


def test_blockwise_sequence_parallel_collectives_by_hand(h100):
    """qkv's forward gather: its (64, 64) input row-wise with the compact scales; out_proj's
    backward gather: the output gradient's two copies with theirs; no amax all-reduce."""
    spec = small(fp8_recipe="blockwise")
    qkv, out = ops_of(spec)["qkv_proj"], ops_of(spec)["out_proj"]
    rowwise = 4096 + 2 * 4 * 32
    assert tensor_parallel_comm(spec, h100, (qkv,))[0] == pytest.approx(
        0.5 * rowwise / BANDWIDTH + GATHER_LATENCY
    )
    both = 2 * 4096 + 2 * 4 * 32 + 2 * 4 * 64
    delayed_out = ops_of(small())["out_proj"]
    extra = tensor_parallel_comm(spec, h100, (out,))[1]
    extra -= tensor_parallel_comm(small(), h100, (delayed_out,))[1]
    assert extra == pytest.approx(0.5 * (both - 4096) / BANDWIDTH)
