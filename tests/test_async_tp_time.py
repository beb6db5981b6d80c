"""torchtitan's async TP in the step time: each micro-pipelined GEMM runs as tp GEMMs on 1/tp of
its rows, and each micro-pipelined reduce-scatter sums the ranks' partial blocks in a kernel of
its own (ckplan.hardware.code_path `micro_pipelined_chunks`, `micro_pipelined_partial_sum_bytes`;
roofline `row_chunk_seconds`)."""

from __future__ import annotations

import pytest

from ckplan.hardware.code_path import (
    micro_pipelined_chunks,
    micro_pipelined_partial_sum_bytes,
    spec_code_path,
)
from ckplan.hardware.roofline import (
    backward_matmuls,
    matmul_seconds,
    memory_seconds,
    row_chunk_seconds,
    shape_efficiency,
)
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.op import Matmul
from ckplan.model.ops import layer_ops


def titan_8b(**changes):
    """Llama 3 8B under torchtitan at TP 8 with sequence parallelism and async TP, compiled."""
    values = {"framework": "torchtitan", "tp": 8, "sp": True, "dp": 8, "zero": 3}
    values |= {"micro_batch": 2, "kernels": "compiled", "tp_comm_overlap": True}
    return load_spec("llama3-8b", values | changes)


def test_which_runs_chunk_their_gemms():
    assert micro_pipelined_chunks(titan_8b()) == 8
    assert micro_pipelined_chunks(titan_8b(tp=4, dp=16)) == 4
    assert micro_pipelined_chunks(titan_8b(tp_comm_overlap=False)) == 1
    # async TP needs compiled blocks; Megatron's overlap is Transformer Engine's userbuffers
    assert micro_pipelined_chunks(titan_8b(kernels="eager")) == 1
    assert micro_pipelined_chunks(titan_8b(framework="megatron", kernels="fused")) == 1


def test_row_chunks_hand_computed():
    """A100 (108 SMs, 256 x 128 tiles): an 8192 x 1024 output is 32 x 8 = 256 tiles in 3 waves
    (256/324 = 0.790 of the SMs' work useful); each of its 8 row chunks, 1024 x 1024, is 32
    tiles in one wave (32/108 = 0.296). Both compute-bound, so the chunked GEMM takes
    0.790/0.296 = 2.67 times as long."""
    a100 = load_gpu("a100-80gb")
    gemm = Matmul(8192, 1024, 4096)
    assert shape_efficiency(a100, 8192, 1024) == pytest.approx(256 / 324)
    assert shape_efficiency(a100, 1024, 1024) == pytest.approx(32 / 108)
    whole = 2 * 8192 * 1024 * 4096 / (312e12 * 0.869 * 256 / 324)
    chunked = 8 * 2 * 1024 * 1024 * 4096 / (312e12 * 0.869 * 32 / 108)
    assert matmul_seconds(a100, gemm) == pytest.approx(whole)
    assert row_chunk_seconds(a100, gemm, 8) == pytest.approx(chunked)
    assert row_chunk_seconds(a100, gemm, 8) / matmul_seconds(a100, gemm) == pytest.approx(
        2.667, rel=1e-3
    )
    assert row_chunk_seconds(a100, gemm, 1) == matmul_seconds(a100, gemm)


def test_partial_sum_bytes_hand_computed():
    """8 partial (1024, 4096) blocks of bf16 read, one written: 8192·4096·2 + 1024·4096·2."""
    assert micro_pipelined_partial_sum_bytes(8192, 4096, 8, 2) == 67_108_864 + 8_388_608


@pytest.mark.parametrize("precision", ["bf16", "float8"])
def test_async_tp_times_the_linears_in_chunks(precision):
    """Against the same layer with plain TP: a column-parallel layer's forward GEMM and
    input-gradient GEMM run in 8 row chunks, its weight gradient whole, and its backward sums
    the input gradient's partial blocks; a row-parallel layer's forward sums its output's; the
    attention core and the norms are timed alike."""
    gpu = load_gpu("h100-sxm")
    asynchronous, plain = (
        titan_8b(precision=precision),
        titan_8b(precision=precision, tp_comm_overlap=False),
    )
    ops = {op.name: op for op in layer_ops(asynchronous.chain)}
    assert ops == {op.name: op for op in layer_ops(plain.chain)}
    chunked, whole = spec_code_path(asynchronous, gpu), spec_code_path(plain, gpu)
    assert chunked.tp_chunks == 8 and whole.tp_chunks == 1
    B = asynchronous.dtype_bytes
    for name in ("attention_core", "norm1", "act"):
        assert chunked.forward(ops[name], B) == whole.forward(ops[name], B)
        assert chunked.backward(ops[name], B) == whole.backward(ops[name], B)
    qkv, fc2 = ops["qkv_proj"], ops["fc2"]
    assert (qkv.tp_comm, fc2.tp_comm) == ("column", "row")
    rows = qkv.matmul.m
    # a column-parallel layer: chunked GEMMs, the backward's partial sum over its input width
    assert chunked.forward(qkv, B).memory == whole.forward(qkv, B).memory
    assert chunked.forward(qkv, B).matmul > whole.forward(qkv, B).matmul
    sums = micro_pipelined_partial_sum_bytes(rows, qkv.matmul.k, 8, B)
    assert chunked.backward(qkv, B).memory == pytest.approx(
        whole.backward(qkv, B).memory + memory_seconds(chunked.gpu, sums)
    )
    # a row-parallel layer: the forward's partial sum over its output width
    sums = micro_pipelined_partial_sum_bytes(rows, fc2.matmul.n, 8, B)
    assert chunked.forward(fc2, B).memory == pytest.approx(
        whole.forward(fc2, B).memory + memory_seconds(chunked.gpu, sums)
    )
    assert chunked.backward(fc2, B).memory == whole.backward(fc2, B).memory
    if precision == "bf16":
        # by hand on the path's GPU: the input gradient in 8 chunks, the weight gradient whole
        input_grad, weight_grad = backward_matmuls(fc2.matmul)
        expected = row_chunk_seconds(chunked.gpu, input_grad, 8) + matmul_seconds(
            chunked.gpu, weight_grad
        )
        assert chunked.backward(fc2, B).matmul == pytest.approx(expected)
        assert chunked.forward(fc2, B).matmul == pytest.approx(
            row_chunk_seconds(chunked.gpu, fc2.matmul, 8)
        )


def test_row_chunks_split_as_torch_chunk_does():
    """torch.chunk cuts 12 rows into 8 chunks as 6 of 2 rows; 4 rows into 4 of 1 (fewer chunks
    than asked); 13 rows into 6 of 2 and one of 1."""
    gpu = load_gpu("h100-sxm")

    def of(m):
        return matmul_seconds(gpu, Matmul(m, 4096, 4096))

    assert row_chunk_seconds(gpu, Matmul(12, 4096, 4096), 8) == pytest.approx(6 * of(2))
    assert row_chunk_seconds(gpu, Matmul(4, 4096, 4096), 8) == pytest.approx(4 * of(1))
    assert row_chunk_seconds(gpu, Matmul(13, 4096, 4096), 8) == pytest.approx(6 * of(2) + of(1))
    assert micro_pipelined_partial_sum_bytes(13, 16, 8, 2) == 13 * 16 * 2 + 2 * 16 * 2
