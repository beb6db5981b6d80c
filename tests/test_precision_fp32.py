"""precision fp32: full-fp32 training (fp32 weights, gradients and activations, no master
copy). The per-op activation bytes are checked against PyTorch autograd in
tests/test_torch_validation.py (gpt-fp32-dropout-native)."""

import pytest

from ckplan.hardware.roofline import matmul_seconds, memory_seconds
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec, spec_from_values
from ckplan.model.memory import activation_bytes_by_op
from ckplan.model.ops import layer_ops
from ckplan.model.parts import SpecError
from ckplan.plan.evaluate import evaluate
from ckplan.plan.strategies import parse_strategy

BASE = {
    "name": "tiny",
    "layers": 2,
    "hidden": 256,
    "heads": 8,
    "seq": 128,
    "micro_batch": 2,
    "vocab": 1024,
    "dropout": 0.1,
}
DROPOUT_MASKS = ("attn_dropout", "out_dropout", "mlp_dropout")  # 1 byte per element


def spec(**changes):
    return spec_from_values({**BASE, **changes}, origin="tiny")


@pytest.mark.parametrize("framework", ["megatron", "hf", "deepspeed", "torchtitan"])
def test_fp32_sets_four_byte_values_and_no_master_copy(framework):
    fp32 = spec(framework=framework, precision="fp32")
    assert (fp32.dtype_bytes, fp32.weight_bytes, fp32.grad_bytes, fp32.master_bytes) == (4, 4, 4, 0)
    assert fp32.optimizer_bytes == 8  # AdamW's two fp32 moments


def test_model_states_are_16_bytes_per_parameter_with_adamw():
    fp32 = spec(precision="fp32")  # Megatron-LM: gradients held in their buffer all step
    plan = evaluate(fp32, parse_strategy("none", fp32))
    params = plan.parameters_per_gpu
    states = plan.model_states
    assert (states.weights, states.gradients, states.optimizer) == (
        4 * params,
        4 * params,
        8 * params,
    )


def test_every_activation_doubles_but_the_dropout_masks():
    half, full = activation_bytes_by_op(spec()), activation_bytes_by_op(spec(precision="fp32"))
    assert half.keys() == full.keys()
    assert all(half[op] > 0 for op in DROPOUT_MASKS)
    for op in half:
        assert full[op] == (half[op] if op in DROPOUT_MASKS else 2 * half[op]), op


def test_gemms_run_at_the_fp32_rate_and_kernels_move_four_byte_elements():
    gpu = load_gpu("a100-80gb")  # no TF32: PyTorch's allow_tf32 is False by default
    half = {op.name: op for op in layer_ops(spec(hidden=4096, heads=32, seq=2048).chain)}
    full = {
        op.name: op
        for op in layer_ops(spec(hidden=4096, heads=32, seq=2048, precision="fp32").chain)
    }
    fc1_half, fc1_full = half["fc1"].matmul, full["fc1"].matmul
    assert (fc1_half.dtype_bytes, fc1_full.dtype_bytes) == (2, 4)
    ratio = matmul_seconds(gpu, fc1_full) / matmul_seconds(gpu, fc1_half)
    assert ratio == pytest.approx(gpu.bf16_flops / gpu.fp32_flops)
    assert full["act"].forward_bytes == 2 * half["act"].forward_bytes
    assert memory_seconds(gpu, full["act"].forward_bytes) == pytest.approx(
        2 * memory_seconds(gpu, half["act"].forward_bytes)
    )


def test_replace_derives_the_precision_keys_again():
    fp32 = spec(precision="fp32")
    bf16 = fp32.replace(precision="bf16")
    assert (bf16.dtype_bytes, bf16.weight_bytes, bf16.master_bytes) == (2, 2, 4)
    assert bf16.attention_kernel == "flash2"
    again = bf16.replace(precision="fp32")
    assert again == fp32


def test_a_preset_dtype_gives_way_to_set_precision_fp32():
    assert load_spec("llama3-8b").dtype_bytes == 2
    fp32 = load_spec("llama3-8b", {"precision": "fp32"})
    assert (fp32.dtype_bytes, fp32.attention_kernel) == (4, "sdpa")
    with pytest.raises(SpecError, match="key 'dtype_bytes' must be 4 with precision fp32"):
        load_spec("llama3-8b", {"precision": "fp32", "dtype_bytes": 2})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dtype_bytes": 2}, "key 'dtype_bytes' must be 4 with precision fp32"),
        ({"weight_bytes": 2}, "key 'weight_bytes' must be 4 with precision fp32"),
        ({"grad_bytes": 2}, "key 'grad_bytes' must be 4 with precision fp32"),
        ({"master_bytes": 4}, "key 'master_bytes' must be 0 with precision fp32"),
        ({"fp8_recipe": "delayed"}, "key 'fp8_recipe' .* needs precision fp8, got 'fp32'"),
        (
            {"attention": "flash", "attention_kernel": "flash2"},
            r"key 'attention_kernel' \(flash2\) runs fp16 and bf16 only",
        ),
        (
            {"attention": "flash", "attention_kernel": "cudnn"},
            r"key 'attention_kernel' \(cudnn\) runs fp16 and bf16 only",
        ),
    ],
)
def test_combinations_that_do_not_exist_are_refused(changes, message):
    with pytest.raises(SpecError, match=message):
        spec(precision="fp32", **changes)


def test_fp32_flash_attention_runs_through_sdpa():
    fp32 = spec(precision="fp32", attention="flash")
    assert fp32.attention_kernel == "sdpa"
    assert spec(attention="flash").attention_kernel == "flash2"


def test_the_trainer_caches_no_autocast_copies_in_fp32():
    """The Trainer's autocast (--bf16/--fp16) caches a bf16 copy of each fp32 weight; fp32
    training runs no autocast, so its weights are the only copy."""
    mixed, full = spec(framework="hf"), spec(framework="hf", precision="fp32")
    assert mixed.weight_bytes == full.weight_bytes == 4
    mixed_plan = evaluate(mixed, parse_strategy("none", mixed))
    full_plan = evaluate(full, parse_strategy("none", full))
    assert mixed_plan.model_states.buffers == 2 * mixed_plan.parameters_per_gpu
    assert full_plan.model_states.buffers == 0


@pytest.mark.parametrize("framework", ["deepspeed", "torchtitan", "hf"])
def test_sharded_data_parallelism_counted_in_bf16_is_refused(framework):
    with pytest.raises(SpecError, match=f"precision fp32 with {framework}'s sharded data"):
        spec(framework=framework, precision="fp32", zero=3, dp=4)
    assert spec(framework=framework, precision="fp32", dp=4).zero == 0
