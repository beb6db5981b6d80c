"""DeepSpeed ZeRO-3's traffic per micro-batch, by hand: the gradients reduce-scattered in the
half-precision dtype (`frameworks.reduce_bytes_per_parameter`), and the weights a re-run forward
gathers again (`frameworks.deepspeed_zero3_regathered`, `step_time.regathered_elements`).

GPT-3 175B (megatron-175b, h = 12288, FFN 4h, biases, LayerNorm): one layer's sub-modules hold
2h, 3h² + 3h, h² + h, 2h, 4h² + 4h and 4h² + h elements, 12h² + 13h = 1,812,099,072 in all.
"""

import pytest

from ckplan.hardware import communication as comm
from ckplan.hardware.step_time import (
    data_parallel_comm,
    deepspeed_zero3_layer_exposed,
    layer_time,
    regathered_elements,
)
from ckplan.inputs.gpus import load_gpu
from ckplan.model import memory
from ckplan.model.frameworks import (
    DEEPSPEED_MAX_REUSE,
    deepspeed_zero3_prefetch_windows,
    deepspeed_zero3_regathered,
    deepspeed_zero3_released,
    reduce_bytes_per_parameter,
)

H = 12288
GPT3_MODULES = (2 * H, 3 * H * H + 3 * H, H * H + H, 2 * H, 4 * H * H + 4 * H, 4 * H * H + H)


def test_hand_values():
    assert sum(GPT3_MODULES) == 1_812_099_072
    # between fc1's re-run forward and its backward: fc2's forward and backward
    assert 2 * GPT3_MODULES[5] == 1_207_984_128 >= DEEPSPEED_MAX_REUSE


def test_zero3_reduces_in_half_precision():
    assert reduce_bytes_per_parameter("deepspeed", 3, 4, 2) == 2
    assert reduce_bytes_per_parameter("deepspeed", 3, 4, 4) == 4  # fp32 training
    assert reduce_bytes_per_parameter("deepspeed", 2, 4, 2) == 4
    assert reduce_bytes_per_parameter("megatron", 3, 4, 2) == 4
    # hf's FSDP: accelerate's reduce_dtype, the half dtype unless fsdp_reduce_dtype says fp32
    assert reduce_bytes_per_parameter("hf", 3, 4, 2) == 2
    assert reduce_bytes_per_parameter("hf", 3, 4, 2, "bf16", "fp32") == 4


def test_regathered_by_reuse_distance():
    # a toy layer; max_reuse 100: fc2 (nothing between) and fc1 (2·40 = 80 between) stay,
    # the second norm (2·80), out-proj (2·90), QKV (2·100) and the first norm are fetched again
    assert deepspeed_zero3_regathered((10, 30, 10, 10, 40, 40), 100) == 10 + 30 + 10 + 10
    # a reuse distance above the whole layer's twice keeps everything
    assert deepspeed_zero3_regathered((10, 30, 10, 10, 40, 40), 281) == 0
    # 0 keeps nothing, as stage3_max_reuse_distance 0 does
    assert deepspeed_zero3_regathered((10, 30, 10, 10, 40, 40), 0) == 140


def test_gpt3_layer_modules(spec_of):
    spec = spec_of("megatron-175b", tp=1, pp=1, sp=False)
    assert memory.layer_module_parameters(spec) == GPT3_MODULES
    assert sum(GPT3_MODULES) == memory.layer_parameters(spec)
    # fc2 stays; the norms, QKV, out-proj and fc1 are gathered again: 8h² + 12h
    assert deepspeed_zero3_regathered(GPT3_MODULES) == 8 * H * H + 12 * H == 1_208_107_008


@pytest.mark.parametrize("name", ["llama3-8b", "gpt2", "llama2-70b", "gemma2-9b"])
def test_module_parameters_add_up_to_the_layer(spec_of, name):
    spec = spec_of(name)
    assert sum(memory.layer_module_parameters(spec)) == memory.layer_parameters(spec)
    tp = spec_of(name, tp=2)
    split = memory.layer_parameter_parts(tp).dense_per_rank(tp)
    assert sum(memory.layer_module_parameters(tp)) == split


def test_no_module_layout_for_moe(spec_of):
    assert memory.layer_module_parameters(spec_of("mixtral-8x7b")) is None


def test_regathered_elements_per_recomputed_layer(spec_of):
    spec = spec_of("megatron-175b", framework="deepspeed", tp=1, pp=1, sp=False, dp=8, zero=3)
    layers = spec.layers
    # the chain: the embedding, the layers, the output layer
    full = (1, *(2,) * layers, 1)
    assert regathered_elements(spec, 0, full) == layers * 1_208_107_008
    assert regathered_elements(spec, 0, (1,) * (layers + 2)) == 0
    # a layer run three times: one more whole layer
    twice = (1, 3, *(1,) * (layers - 1), 1)
    assert regathered_elements(spec, 0, twice) == sum(GPT3_MODULES) + 1_208_107_008
    # other frameworks and stages gather nothing again
    assert regathered_elements(spec.replace(framework="hf"), 0, full) == 0
    assert regathered_elements(spec.replace(zero=1), 0, full) == 0


def test_backward_gathers_the_regathered_weights(spec_of):
    a100 = load_gpu("a100-80gb")
    spec = spec_of("megatron-175b", framework="deepspeed", tp=1, pp=1, sp=False, dp=8, zero=3)
    params = memory.trainable_stage_parameters(spec, 0)[0]
    bandwidth = comm.group_bandwidth(a100, 8, 1)
    extra = spec.layers * 1_208_107_008
    parts = data_parallel_comm(spec, a100, extra)
    gather = comm.all_gather_seconds(2 * params, 8, bandwidth)
    assert parts.forward == pytest.approx(gather)
    # the backward's gather and the bf16 gradients' reduce-scatter, (8 - 1)/8 of each
    assert parts.backward == pytest.approx(
        comm.all_gather_seconds(2 * (params + extra), 8, bandwidth)
        + comm.reduce_scatter_seconds(2 * params, 8, bandwidth)
    )
    assert parts.backward == pytest.approx(7 / 8 * (2 * (params + extra) + 2 * params) / bandwidth)


def test_released_sub_modules():
    assert deepspeed_zero3_released((10, 30, 10, 10, 40, 40), 100) == (
        True, True, True, True, False, False,
    )  # fmt: skip
    assert deepspeed_zero3_released(GPT3_MODULES) == (True, True, True, True, True, False)


def test_prefetch_windows_by_hand():
    # (compute, gather): norm, QKV, out-proj, norm, fc1, fc2; the norms stay gathered
    uses = ((1.0, 0.0), (3.0, 3.0), (1.0, 1.0), (0.0, 0.0), (4.0, 4.0), (4.0, 4.5))
    assert deepspeed_zero3_prefetch_windows(uses) == (
        (3.0, 4.0 + 1.0),  # QKV's gather starts with the previous layer's fc2: fc2, norm
        (1.0, 3.0),  # out-proj's with QKV
        (4.0, 1.0 + 0.0),  # fc1's with out-proj: out-proj, norm
        (4.5, 4.0),  # fc2's with fc1
    )
    # one gathered use: its gather hides behind the whole cycle
    assert deepspeed_zero3_prefetch_windows(((5.0, 2.0), (1.0, 0.0))) == ((2.0, 6.0),)
    assert deepspeed_zero3_prefetch_windows(((5.0, 0.0),)) == ()


def _gpt3_zero3(spec_of, **overrides):
    return spec_of(
        "megatron-175b", framework="deepspeed", tp=1, pp=1, sp=False, dp=8, zero=3, **overrides
    )


def test_layer_exposure_only_where_one_weight_is_prefetched(spec_of):
    a100 = load_gpu("a100-80gb")
    spec = _gpt3_zero3(spec_of)
    plain = (1, *(1,) * spec.layers, 1)
    assert deepspeed_zero3_layer_exposed(spec, a100, plain) is not None
    # weights within stage3_prefetch_bucket_size: the prefetch runs deeper
    small = spec_of("llama3-8b", framework="deepspeed", tp=1, pp=1, sp=False, dp=8, zero=3)
    assert deepspeed_zero3_layer_exposed(small, a100, (1, *(1,) * small.layers, 1)) is None
    assert deepspeed_zero3_layer_exposed(spec.replace(zero=1), a100, plain) is None
    assert deepspeed_zero3_layer_exposed(spec.replace(framework="hf"), a100, plain) is None
    assert deepspeed_zero3_layer_exposed(spec.replace(dp_comm_overlap=False), a100, plain) is None
    thrice = (1, 3, *(1,) * (spec.layers - 1), 1)
    assert deepspeed_zero3_layer_exposed(spec, a100, thrice) is None


def test_forward_exposure_by_hand(spec_of):
    """Each weight's gather beside the compute since the previous gathered sub-module
    started: QKV beside fc2 and the first norm, out-proj beside QKV, fc1 beside out-proj and
    the second norm, fc2 beside fc1; compute split by the sub-modules' weights."""
    a100 = load_gpu("a100-80gb")
    spec = _gpt3_zero3(spec_of)
    layer = layer_time(spec, a100)
    compute = layer.forward.total
    share = layer.forward.matmul / compute
    slowdown = a100.sm_count / (a100.sm_count - a100.nccl_channels)
    bandwidth = comm.group_bandwidth(a100, 8, 1)
    norm, qkv, out_proj, _, fc1, fc2 = GPT3_MODULES
    total = sum(GPT3_MODULES)

    def gather(weights):
        return comm.all_gather_seconds(2 * weights, 8, bandwidth)

    def beside(weights, window_weights):
        window = compute * window_weights / total
        return comm.overlapped(gather(weights), window, window * (share * slowdown + 1 - share))

    by_hand = (
        beside(qkv, fc2 + norm)
        + beside(out_proj, qkv)
        + beside(fc1, out_proj + norm)
        + beside(fc2, fc1)
    )
    forward, _ = deepspeed_zero3_layer_exposed(spec, a100, (1, *(1,) * spec.layers, 1))
    assert forward == pytest.approx(spec.layers * by_hand)
    # the re-run forward changes the backward pass, not the forward
    full = (1, *(2,) * spec.layers, 1)
    assert deepspeed_zero3_layer_exposed(spec, a100, full)[0] == pytest.approx(forward)
