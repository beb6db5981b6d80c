"""torchtitan's tensor parallelism in the step time: its column-parallel linears keep the
gathered input, so the backward gathers nothing again, and torchtitan 2024.12's torchao float8
gathers inputs and output gradients in one byte (ckplan.hardware.step_time
`tensor_parallel_comm`, code_path `sequence_parallel_gather_bytes`)."""

from __future__ import annotations

import pytest

from ckplan.hardware.code_path import sequence_parallel_gather_bytes, sequence_parallel_gather_size
from ckplan.hardware.step_time import tensor_parallel_comm
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.op import saves_gathered_input
from ckplan.model.ops import layer_ops


def titan_70b(**changes):
    """Llama 3 70B under torchtitan at TP 8 with sequence parallelism, FSDP over 32."""
    values = {"framework": "torchtitan", "tp": 8, "sp": True, "dp": 32, "zero": 3}
    values |= {"micro_batch": 2, "kernels": "compiled", "framework_version": "2024.12"}
    return load_spec("llama3-70b", values | changes)


def ops_of(spec):
    return {op.name: op for op in layer_ops(spec.chain)}


def test_which_runs_save_the_gathered_input():
    assert saves_gathered_input(titan_70b())
    assert not saves_gathered_input(titan_70b(kernels="fused"))  # Megatron-like linears
    assert not saves_gathered_input(titan_70b(sp=False))
    assert not saves_gathered_input(load_spec("llama3-70b", {"tp": 8, "sp": True, "dp": 8}))


@pytest.mark.parametrize("precision", ["bf16", "float8"])
def test_the_backward_gathers_nothing_again(precision):
    """The same layer, the same GPU: the forward's collectives are the same, the backward's
    fewer where the linears kept the gathered input."""
    gpu = load_gpu("h100-sxm")
    titan = titan_70b(precision=precision)
    fused = titan_70b(precision=precision, kernels="fused")
    ops = tuple(layer_ops(titan.chain))
    assert tuple(layer_ops(fused.chain)) != ops  # the saved bytes differ ...
    kept = tensor_parallel_comm(titan, gpu, ops)
    regathered = tensor_parallel_comm(fused, gpu, ops)  # ... the collectives are the ops' own
    assert kept[0] == regathered[0]
    assert kept[1] < regathered[1]


def test_torchtitan_2024_12_gathers_float8():
    """One byte a value for the QKV projection's input and fc2's output gradient under
    2024.12's float8 (torchao's Float8ColwiseParallel / Float8RowwiseParallel), two under 0.3
    (row-wise recipes, plain tensor parallelism) and in bf16."""
    spec = titan_70b(precision="float8")
    ops = ops_of(spec)
    rows, hidden = 2 * 8192, 8192
    assert sequence_parallel_gather_bytes("float8", "torchtitan", ops["qkv_proj"], "2024.12") == 1
    assert sequence_parallel_gather_bytes("float8", "torchtitan", ops["fc2"], "2024.12") == 1
    assert sequence_parallel_gather_bytes("float8", "torchtitan", ops["qkv_proj"], "0.3") == 2
    gathered = sequence_parallel_gather_size(spec, ops["qkv_proj"], rows, hidden, "rowwise")
    assert gathered == rows * hidden
    newer = titan_70b(precision="float8", framework_version="0.3")
    qkv = ops_of(newer)["qkv_proj"]
    assert sequence_parallel_gather_size(newer, qkv, rows, hidden, "rowwise") == 2 * rows * hidden
    bf16 = titan_70b()
    qkv = ops_of(bf16)["qkv_proj"]
    assert sequence_parallel_gather_size(bf16, qkv, rows, hidden, "rowwise") == 2 * rows * hidden


def test_the_float8_gathers_take_less_time():
    gpu = load_gpu("h100-sxm")
    spec = titan_70b(precision="float8")
    ops = tuple(layer_ops(spec.chain))
    newer = titan_70b(precision="float8", framework_version="0.3")
    forward, backward = tensor_parallel_comm(spec, gpu, ops)
    plain_forward, plain_backward = tensor_parallel_comm(newer, gpu, ops)
    assert forward < plain_forward and backward < plain_backward
