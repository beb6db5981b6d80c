"""FP8 under Transformer Engine: the sequence-parallel all-gathers of FP8 GEMMs in one byte."""

import pytest
from small_specs import (
    H100_GATHER_LATENCY_2_RANKS,
    H100_NVLINK_BANDWIDTH,
    SMALL_DENSE_TP2,
    ops_by_name,
    spec_from,
)

from ckplan.hardware import communication as comm
from ckplan.hardware.code_path import FP8_GATHER_BYTES, sequence_parallel_gather_bytes
from ckplan.hardware.step_time import tensor_parallel_comm
from ckplan.inputs.gpus import load_gpu

SMALL = SMALL_DENSE_TP2
BANDWIDTH = H100_NVLINK_BANDWIDTH
LATENCY = H100_GATHER_LATENCY_2_RANKS


def small(**changes):
    return spec_from(SMALL, **changes)


ops_of = ops_by_name


@pytest.fixture
def h100():
    return load_gpu("h100-sxm")


def test_gather_bytes_one_for_transformer_engine_fp8_gemms_alone():
    fp8 = ops_of(small(precision="fp8"))
    for name in ("qkv_proj", "out_proj", "fc1", "fc2"):
        assert sequence_parallel_gather_bytes("fp8", "megatron", fp8[name]) == FP8_GATHER_BYTES == 1
    # torchao's float8 under torchtitan, and BF16 GEMMs, gather in the GEMM's dtype
    assert sequence_parallel_gather_bytes("fp8", "torchtitan", fp8["fc1"]) == 2
    assert sequence_parallel_gather_bytes("bf16", "megatron", ops_of(small())["fc1"]) == 2


def test_fp8_sequence_parallel_gathers_by_hand(h100):
    fp8, bf16 = small(precision="fp8"), small()
    qkv, out = ops_of(fp8)["qkv_proj"], ops_of(fp8)["out_proj"]
    assert comm.all_gather_latency(h100, 2) == pytest.approx(LATENCY)
    # qkv (column-parallel): the forward gathers its (T, h) = (64, 64) input, 4096 values, one
    # byte each in FP8 and two in BF16: (2 - 1)/2 · bytes / bandwidth + latency.
    forward_fp8 = tensor_parallel_comm(fp8, h100, (qkv,))[0]
    forward_bf16 = tensor_parallel_comm(bf16, h100, (ops_of(bf16)["qkv_proj"],))[0]
    assert forward_fp8 == pytest.approx(0.5 * 4096 / BANDWIDTH + LATENCY)
    assert forward_bf16 == pytest.approx(0.5 * 8192 / BANDWIDTH + LATENCY)
    # out_proj (row-parallel): its forward reduce-scatter of the (64, 64) output stays in BF16
    assert tensor_parallel_comm(fp8, h100, (out,))[0] == pytest.approx(
        0.5 * 8192 / BANDWIDTH + LATENCY
    )
    # ... and its backward gathers the (64, 64) output gradient in FP8, exposed without overlap
    assert tensor_parallel_comm(fp8, h100, (out,))[1] == pytest.approx(
        0.5 * 4096 / BANDWIDTH + LATENCY
    )
