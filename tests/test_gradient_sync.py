"""Gradient accumulation per framework: when the gradients are reduced and the weights gathered
(`frameworks.gradient_sync`), the traffic that follows and the gradients held, by hand.

llama3-8b on one GPU holds 8,030,261,248 parameters; over dp 4 on an A100-80GB node the
data-parallel group runs at 300 GB/s x 0.7 = 210 GB/s, and a ring reduce-scatter or all-gather of
S bytes moves (4 - 1)/4 · S per rank."""

import pytest

from ckplan.hardware.roofline import OpTime
from ckplan.hardware.step_time import data_parallel_comm, data_parallel_exposed
from ckplan.hardware.times import ZERO, MicroBatchTime
from ckplan.inputs.gpus import load_gpu
from ckplan.model.frameworks import GradientSync, gradient_sync, gradients_sharded
from ckplan.model.memory import model_state_bytes

PARAMS = 8_030_261_248  # llama3-8b
BANDWIDTH = 300e9 * 0.7
FP32_GRADS = 4 * PARAMS  # 32,121,044,992 bytes
BF16 = 2 * PARAMS  # 16,060,522,496 bytes
# per rank, (d - 1)/d of the bytes over dp 4
RS_FP32 = 24_090_783_744 / BANDWIDTH  # the fp32 gradients' reduce-scatter
RS_BF16 = 12_045_391_872 / BANDWIDTH  # the gradients' reduce-scatter in bf16 (hf's FSDP)
AG_BF16 = 12_045_391_872 / BANDWIDTH  # the bf16 weights' all-gather


@pytest.fixture
def a100():
    return load_gpu("a100-80gb")


def test_hand_values():
    assert FP32_GRADS * 3 // 4 == 24_090_783_744
    assert BF16 * 3 // 4 == 12_045_391_872


@pytest.mark.parametrize(
    ("framework", "zero", "pp", "expected"),
    [
        # Megatron: DDP and the distributed optimizer under no_sync; Megatron-FSDP every bprop
        ("megatron", 0, 1, GradientSync(False)),
        ("megatron", 1, 4, GradientSync(False)),
        ("megatron", 2, 1, GradientSync(True)),
        ("megatron", 3, 1, GradientSync(True, True, True)),
        # DeepSpeed: ZeRO 0-1 at the accumulation boundary, ZeRO 2-3 every micro-batch
        ("deepspeed", 1, 1, GradientSync(False)),
        ("deepspeed", 2, 1, GradientSync(True)),
        ("deepspeed", 3, 1, GradientSync(True, True, True)),
        # torchtitan: sync on in every micro-batch; FSDP2 reshards after backward
        ("torchtitan", 0, 1, GradientSync(True)),
        ("torchtitan", 2, 1, GradientSync(True, True, False)),
        ("torchtitan", 3, 1, GradientSync(True, True, True)),
        # its pipeline stage: no sync nor reshard until the last backward
        ("torchtitan", 3, 4, GradientSync(False)),
        # the Hugging Face Trainer under no_sync: SHARD_GRAD_OP keeps the weights gathered
        ("hf", 2, 1, GradientSync(False)),
        ("hf", 3, 1, GradientSync(False, True, True)),
    ],
)
def test_what_each_framework_does_under_accumulation(framework, zero, pp, expected):
    assert gradient_sync(framework, zero, pp) == expected


def test_hf_loops_that_sync_every_micro_batch():
    # Composer and torchtune: FSDP reduce-scatters every backward and reshards after it
    assert gradient_sync("hf", 2, 1, "micro_batch") == GradientSync(True, True, False)
    assert gradient_sync("hf", 3, 1, "micro_batch") == GradientSync(True, True, True)
    assert gradient_sync("hf", 3, 1, "step") == gradient_sync("hf", 3, 1)


def test_megatron_fsdp_optim_grads_reduce_scatters_every_micro_batch(spec_of, a100):
    spec = spec_of("llama3-8b", dp=4, zero=2, microbatches=8)
    parts = data_parallel_comm(spec, a100)
    assert parts.reduce == 0.0
    assert parts.backward == pytest.approx(RS_FP32)
    assert parts.forward == 0.0
    assert parts.gather == pytest.approx(AG_BF16)  # the updated weights, once
    assert parts.total(8) == pytest.approx(8 * RS_FP32 + AG_BF16)
    # the distributed optimizer (ZeRO 1) reduces the accumulated gradients once
    zero1 = data_parallel_comm(spec.replace(zero=1), a100)
    assert zero1.reduce == pytest.approx(RS_FP32)
    assert zero1.backward == 0.0
    assert zero1.total(8) == pytest.approx(RS_FP32 + AG_BF16)


def test_one_micro_batch_costs_the_same_either_way(spec_of, a100):
    for zero in (1, 2):
        spec = spec_of("llama3-8b", dp=4, zero=zero, microbatches=1)
        assert data_parallel_comm(spec, a100).total(1) == pytest.approx(RS_FP32 + AG_BF16)


def test_zero_3_gathers_for_forward_and_backward(spec_of, a100):
    spec = spec_of("llama3-8b", dp=4, zero=3, microbatches=8)
    parts = data_parallel_comm(spec, a100)
    assert (parts.reduce, parts.gather) == (0.0, 0.0)
    assert parts.forward == pytest.approx(AG_BF16)
    assert parts.backward == pytest.approx(AG_BF16 + RS_FP32)


def test_hf_reduces_once_under_no_sync(spec_of, a100):
    # hf's fp32 weights are gathered in bf16 (the compute dtype), its gradients reduced in bf16
    # (accelerate's MixedPrecision: reduce_dtype the training precision's, `fsdp_reduce_dtype`)
    spec = spec_of("llama3-8b", framework="hf", dp=4, zero=3, microbatches=8)
    parts = data_parallel_comm(spec, a100)
    assert parts.reduce == pytest.approx(RS_BF16)
    assert parts.forward == pytest.approx(AG_BF16)
    assert parts.backward == pytest.approx(AG_BF16)
    each = data_parallel_comm(spec.replace(grad_sync="micro_batch"), a100)
    assert each.reduce == 0.0
    assert each.backward == pytest.approx(AG_BF16 + RS_BF16)
    fp32 = data_parallel_comm(spec.replace(fsdp_reduce_dtype="fp32"), a100)
    assert fp32.reduce == pytest.approx(RS_FP32)  # Composer's reduction


def test_torchtitan_all_reduces_every_micro_batch_without_fsdp_sharding(spec_of, a100):
    spec = spec_of("llama3-8b", framework="torchtitan", dp=4, zero=0, microbatches=8)
    parts = data_parallel_comm(spec, a100)
    assert parts.reduce == 0.0
    assert parts.backward == pytest.approx(2 * RS_FP32)  # ring all-reduce: 2(d-1)/d · S


def test_exposed_per_micro_batch_reduction(spec_of, a100):
    """Without overlap all of it but the GPU's dp_overlap share shows; with it, each
    micro-batch's reduce-scatter hides beside that micro-batch's backward, so the exposed
    time grows by the same amount per micro-batch."""
    busiest = MicroBatchTime(
        forward=OpTime(matmul=0.3, memory=0.05),
        backward=OpTime(matmul=0.6, memory=0.1),
        recompute=ZERO,
        forward_comm=0.0,
        backward_comm=0.0,
        recompute_comm=0.0,
    )
    spec = spec_of("llama3-8b", dp=4, zero=2, microbatches=8)
    plain = data_parallel_exposed(spec, a100, busiest)
    assert plain == pytest.approx((1 - a100.dp_overlap) * (8 * RS_FP32 + AG_BF16))
    overlap = [
        data_parallel_exposed(spec.replace(microbatches=m, dp_comm_overlap=True), a100, busiest)
        for m in (1, 2, 4, 8)
    ]
    step = overlap[1] - overlap[0]
    assert step > 0
    assert overlap[3] - overlap[2] == pytest.approx(4 * step)
    once = spec.replace(zero=1, dp_comm_overlap=True)
    assert data_parallel_exposed(once.replace(microbatches=8), a100, busiest) == pytest.approx(
        data_parallel_exposed(once.replace(microbatches=1), a100, busiest)
    )


def test_gradients_held_through_accumulation(spec_of):
    # a shard where every micro-batch is reduce-scattered, or with one micro-batch
    assert gradients_sharded("megatron", 2, 8)
    assert gradients_sharded("deepspeed", 2, 8)
    assert gradients_sharded("torchtitan", 2, 8)
    assert gradients_sharded("hf", 2, 1)
    assert gradients_sharded("hf", 2, 8, "micro_batch")
    # the Hugging Face Trainer accumulates unsharded under no_sync
    assert not gradients_sharded("hf", 2, 8)
    assert not gradients_sharded("hf", 3, 8)
    assert not gradients_sharded("megatron", 1, 1)
    # hf: fp32 gradients, 4 bytes per parameter, over dp 8
    spec = spec_of("llama3-8b", framework="hf", dp=8, zero=3, microbatches=1)
    assert model_state_bytes(spec).gradients == 4_015_130_624  # 4 · PARAMS / 8
    whole = model_state_bytes(spec.replace(microbatches=8)).gradients
    assert whole == FP32_GRADS == 32_121_044_992
    synced = spec.replace(microbatches=8, grad_sync="micro_batch")
    assert model_state_bytes(synced).gradients == 4_015_130_624
    # Megatron-FSDP holds its shard whatever the micro-batches
    megatron = spec_of("llama3-8b", dp=8, zero=2, microbatches=8)
    assert model_state_bytes(megatron).gradients == 4_015_130_624


def test_grad_sync_is_refused_beside_other_frameworks(spec_of):
    from ckplan.model.parts import SpecError

    with pytest.raises(SpecError, match="key 'grad_sync'"):
        spec_of("llama3-8b", framework="megatron", grad_sync="step")
    with pytest.raises(SpecError, match="key 'grad_sync'"):
        spec_of("llama3-8b", framework="hf", grad_sync="sometimes")
