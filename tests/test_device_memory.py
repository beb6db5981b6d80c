"""Device memory as nvidia-smi shows it (ckplan.hardware.device_memory), each term by hand."""

from __future__ import annotations

import json

import pytest

from ckplan.hardware.device_memory import (
    DeviceMemory,
    data_parallel_communicators,
    data_parallel_nccl_bytes,
    device_memory,
    nccl_communicator_bytes,
    nccl_connections_per_channel,
    nccl_nvls_bytes,
    nccl_p2p_connection_bytes,
    paged_optimizer_bytes,
)
from ckplan.hardware.gpus import GPUError
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model import allocator, finetune, memory
from ckplan.model.op import split_share
from ckplan.published.predict import predict, state_offload_values, unmodelled
from ckplan.published.suite import suite_runs

MIB = 2**20


def test_a_p2p_connection_pair_is_twelve_mib_read_or_not():
    # NCCL v2.19.3-1 buffers: LL 8 lines x 512 threads x 8 steps x 16 B = 524,288;
    # LL128 120 x 640 x 8 x 8 B = 4,915,200; Simple 4 MiB.
    # read on: receive 4 KiB + 524,288 + 4,915,200 = 5,443,584 -> 6 MiB; send 4 KiB + 4 MiB
    # -> 6 MiB. read off: receive 4 KiB + 9,633,792 -> 10 MiB; send 4 KiB -> 2 MiB.
    assert nccl_p2p_connection_bytes() == 12 * MIB


def test_ring_and_tree_connections_per_channel():
    assert nccl_connections_per_channel(1) == 0
    assert nccl_connections_per_channel(2) == 1  # ring and tree reach the one peer
    assert nccl_connections_per_channel(8) == 2  # a middle rank of the chain: both neighbours


def test_nvls_buffers_by_hand():
    # 16 channels x 2 x (4 MiB + 2 MiB) x 8 heads = 1,536 MiB
    assert nccl_nvls_bytes(16, 8) == 1536 * MIB
    assert nccl_nvls_bytes(16, 4) == 768 * MIB
    assert nccl_nvls_bytes(16, 2) == 0  # ncclNvlsInit: not with two GPUs or fewer
    assert nccl_nvls_bytes(0, 8) == 0


def test_communicator_bytes_by_hand():
    a100 = load_gpu("a100-80gb")  # 24 channels, no NVLS
    assert nccl_communicator_bytes(8, a100) == 24 * 2 * 12 * MIB
    assert nccl_communicator_bytes(2, a100) == 24 * 1 * 12 * MIB
    assert nccl_communicator_bytes(1, a100) == 0
    h100 = load_gpu("h100-sxm")  # 24 channels, 16 NVLS channels, 8 GPUs a node
    assert nccl_communicator_bytes(8, h100) == 24 * 2 * 12 * MIB + 1536 * MIB
    # 64 GPUs: the NVLS heads are the 8 on this GPU's node
    assert nccl_communicator_bytes(64, h100) == 24 * 2 * 12 * MIB + 1536 * MIB
    assert nccl_communicator_bytes(8, load_gpu("b200")) == 0  # no channel count: not modelled


def test_paged_optimizer_bytes_only_for_the_paged_optimizer():
    spec = load_spec("llama3-8b").replace(optimizer="paged-adamw-8bit")
    assert paged_optimizer_bytes(spec) > 0
    assert paged_optimizer_bytes(spec.replace(optimizer="adamw-8bit")) == 0
    assert paged_optimizer_bytes(spec.replace(dp=2, zero=1)) == 0


def test_device_memory_adds_the_outside_terms_to_the_reserved_peak():
    gpu = load_gpu("a100-80gb")
    spec = load_spec("llama3-8b").replace(dp=8, zero=3)
    allocated = 30 * 2**30
    device = device_memory(allocated, spec, gpu)
    assert device.cuda_context == 400 * MIB
    assert device.nccl == 24 * 2 * 12 * MIB
    assert device.paged_optimizer == 0
    assert device.reserved == allocator.reserved_bytes(allocated, spec.expandable_segments)
    assert device.total == device.reserved + 400 * MIB + 576 * MIB


def test_device_memory_caps_the_reserved_peak_at_what_the_rest_leaves():
    gpu = load_gpu("a100-80gb")
    spec = load_spec("llama3-8b")
    outside = gpu.cuda_context_bytes
    allocated = gpu.memory_bytes - outside - 2 * MIB  # the slack would not fit
    device = device_memory(allocated, spec, gpu)
    # the slack shrinks to what is left: the whole GPU is in use
    assert device.reserved == gpu.memory_bytes - outside
    assert device.total == gpu.memory_bytes


def test_device_memory_takes_the_paged_states_out_of_the_allocator():
    gpu = load_gpu("a100-80gb")
    spec = load_spec("llama3-8b").replace(optimizer="paged-adamw-8bit")
    paged = paged_optimizer_bytes(spec)
    allocated = 40 * 2**30
    device = device_memory(allocated, spec, gpu)
    assert device == DeviceMemory(
        allocator.reserved_bytes(allocated - paged, spec.expandable_segments),
        gpu.cuda_context_bytes,
        0,
        paged,
    )


def test_v100_context_is_the_anatomy_page_s_measurement():
    gpu = load_gpu("v100-sxm2-16gb")
    assert gpu.cuda_context_bytes == 1343 * MIB
    assert gpu.memory_bytes == 16945512448


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("cuda_context_bytes", -1, "key 'cuda_context_bytes' must be an integer number of bytes"),
        ("cuda_context_bytes", 1.5, "key 'cuda_context_bytes' must be an integer number of bytes"),
        ("cuda_context_bytes", 10**20, "key 'cuda_context_bytes' must be below memory_bytes"),
        ("nccl_nvls_channels", -2, "key 'nccl_nvls_channels' must be an integer >= 0"),
        ("nccl_nvls_channels", 500, "key 'nccl_nvls_channels' must be below sm_count"),
    ],
)
def test_new_gpu_keys_are_checked(key, value, fragment):
    with pytest.raises(GPUError, match=fragment):
        load_gpu("h100-sxm", {key: value})


def test_estimate_json_carries_device_bytes(cli):
    args = ["estimate", "llama3-8b", "--set", "dp=8", "--set", "zero=3", "--json"]
    code, out, err = cli(*args, "--gpu", "a100-80gb")
    assert code == 0, err
    with_gpu = json.loads(out)["memory"]
    terms = with_gpu["device"]
    assert with_gpu["device_bytes"] == (
        terms["reserved_bytes"]
        + terms["cuda_context_bytes"]
        + terms["nccl_bytes"]
        + terms["paged_optimizer_bytes"]
    )
    assert terms["nccl_bytes"] == 576 * MIB
    assert with_gpu["device_bytes"] > with_gpu["reserved_bytes"]
    without = json.loads(cli(*args)[1])["memory"]
    assert without["device_bytes"] is None


def _nvidia_smi_runs():
    return {r.name: r for r in suite_runs() if r.published.metric == "nvidia_smi_bytes"}


def test_nvidia_smi_runs_are_scored_as_device_memory():
    runs = _nvidia_smi_runs()
    run = runs["peft-docs-llama2-70b-qlora-zero3-2gpu"]
    prediction = predict(run)
    assert prediction.scored
    gpu = load_gpu(run.gpu)
    device = prediction.plan.device_memory(gpu)
    assert prediction.predicted == device.total
    # two ranks: one connection pair a channel, in each of ZeRO-3's two communicators
    assert device.nccl == 2 * 24 * 12 * MIB


def test_fsdp_param_offload_maps_to_both_state_offload_keys():
    run = _nvidia_smi_runs()["peft-docs-llama2-70b-qlora-fsdp-cpu-offload-2gpu"]
    assert unmodelled(run) is None
    assert state_offload_values(run) == {"optimizer_offload": "cpu", "param_offload": "cpu"}
    prediction = predict(run)
    assert prediction.scored
    spec, states = prediction.spec, prediction.plan.model_states
    # on the GPU of the frozen weights only the 4-bit statistics, no parameter's data; the
    # adapters' gradients whole, accumulated over the two micro-batches under no_sync
    statistics = spec.layers * finetune.layer_quantization_statistics_bytes(spec)
    assert states.weights == statistics
    adapters = spec.layers * finetune.lora_layer_parameters(spec)
    assert states.gradients == adapters * spec.grad_bytes
    frozen, _ = memory.frozen_weight_bytes(spec, 0, spec.weight_bytes)
    shard = split_share(frozen - statistics, 2)
    owned = split_share(adapters, 2)
    # all in bf16 (TRL leaves a sharded QLoRA model unprepared): weight, gradient, two moments
    assert (spec.weight_bytes, spec.grad_bytes, spec.master_bytes, spec.optimizer_bytes) == (
        2,
        2,
        0,
        4,
    )
    assert states.host == shard + owned * (2 + 2 + 4)


def test_deepspeed_zero3_holds_two_data_parallel_communicators():
    # ZeRO-3 without an mpu: the parameters gather on WORLD, the gradients reduce-scatter on
    # DeepSpeed's clone of it (groups._clone_world_group): two communicators over the dp ranks
    assert data_parallel_communicators("deepspeed", 3, 8, 1, 1) == 2
    assert data_parallel_communicators("deepspeed", 2, 8, 1, 1) == 1
    assert data_parallel_communicators("deepspeed", 3, 8, 2, 1) == 1  # Megatron-DeepSpeed's mpu
    assert data_parallel_communicators("hf", 3, 8, 1, 1) == 1
    assert data_parallel_communicators("deepspeed", 3, 1, 1, 1) == 0


def test_zero3_nccl_bytes_are_two_communicators_by_hand():
    a100 = load_gpu("a100-40gb")
    spec = load_spec("llama2-7b", {"framework": "deepspeed", "zero": 3, "dp": 2})
    # two communicators of 2 ranks: 2 x 24 channels x 1 connection pair x 12 MiB = 576 MiB
    assert data_parallel_nccl_bytes(spec, a100) == 2 * 24 * 1 * 12 * MIB
    ddp = load_spec("llama2-7b", {"framework": "deepspeed", "zero": 2, "dp": 2})
    assert data_parallel_nccl_bytes(ddp, a100) == 24 * 1 * 12 * MIB


def test_the_device_row_says_when_the_reserved_peak_is_not_the_reserved_row():
    """The "on the device" row adds the terms outside the allocator to the reserved peak that
    fits the GPU: it names the reserved peak as it is, within the GPU's memory (the cache
    freed) or, over the GPU, the allocated peak's blocks."""
    from ckplan.plan import evaluate, parse_strategy
    from ckplan.render.estimate import device_note

    gpu = load_gpu("rtx-4090")
    cases = [
        ({"seq": 1024, "training": "qlora"}, "as nvidia-smi shows it: reserved +"),
        ({"seq": 8192, "training": "qlora"}, "reserved within the GPU's memory ("),
        ({"seq": 8192}, "the allocated peak's blocks ("),
    ]
    for keys, words in cases:
        spec = load_spec("llama3-8b", keys)
        plan = evaluate(spec, parse_strategy("full", spec))
        device = plan.device_memory(gpu)
        note = device_note(plan, gpu)
        assert words in note and "CUDA context" in note
        if "within" in words:
            assert device.reserved < plan.reserved_bytes
            assert device.total <= gpu.memory_bytes
        if "blocks" in words:
            assert device.total > gpu.memory_bytes
            assert device.reserved == allocator.budgeted_bytes(plan.total_bytes)
