"""Model states on the host (optimizer_offload, param_offload; ckplan.model.memory
`offloaded_states`, ckplan.hardware.host_states): the bytes left on the GPU and held on the
host of a small Llama-style model by hand, to the byte; the copies and the CPU step by hand;
each framework's refusals; the per-element traffic of DeepSpeedCPUAdam read from DeepSpeed's
own kernel; the host budget in the search."""

import importlib.util
import pathlib
import re

import pytest
from test_finetune import SMALL as FINETUNE_SMALL

from ckplan.hardware import communication as comm
from ckplan.hardware import host_states
from ckplan.hardware.gpus import gpu_from_mapping
from ckplan.hardware.host_link import host_link_bytes_per_second, host_memory_per_gpu
from ckplan.hardware.step_time import data_parallel_comm, optimizer_seconds, step_time
from ckplan.inputs.gpus import load_gpu
from ckplan.model import finetune, memory
from ckplan.model.frameworks import largest_parameter
from ckplan.model.memory import model_state_bytes, stage_parameters
from ckplan.model.spec import SpecError, spec_from_mapping
from ckplan.plan.evaluate import evaluate
from ckplan.plan.search import Candidate
from ckplan.plan.strategies import parse_strategy

# h 64, a 4, g 2 (d 16), F 128, V 256, two layers, untied: 106,816 parameters
P = 106_816
LARGEST = 256 * 64  # the embedding (and the output layer): V x h values


def spec(**changes):
    return spec_from_mapping({**FINETUNE_SMALL, **changes})


def deepspeed(zero=2, dp=4, **changes):
    return spec(framework="deepspeed", zero=zero, dp=dp, optimizer_offload="cpu", **changes)


def fsdp(framework="torchtitan", zero=3, dp=4, **changes):
    keys = {"optimizer_offload": "cpu", "param_offload": "cpu"}
    return spec(framework=framework, zero=zero, dp=dp, **keys, **changes)


def test_small_model():
    assert stage_parameters(spec(), 0) == (P, 0)
    assert largest_parameter(spec()) == LARGEST


def test_zero_offload_keeps_the_weights_and_pins_the_rest():
    """ZeRO-2 over 4 GPUs: the bf16 weights whole on the device, no gradient or optimizer
    buffer there; on the host per GPU the fp32 master partition, its fp32 gradient, Adam's
    moments (4 + 4 + 8) and the bf16 copy (2) of P/4 parameters, and the bf16 staging buffer of
    the largest parameter on each side."""
    plain = model_state_bytes(deepspeed().replace(optimizer_offload="none"))
    states = model_state_bytes(deepspeed())
    owned = P // 4
    assert states.weights == plain.weights == 2 * P
    assert (states.gradients, states.optimizer) == (0, 0)
    assert states.host == owned * (4 + 4 + 8 + 2) + 2 * LARGEST
    assert states.buffers == plain.buffers + 2 * LARGEST
    assert states.total == 2 * P + states.buffers


def test_zero3_offload_param_moves_the_partition():
    """ZeRO-3 over 4 GPUs: with offload_optimizer the bf16 partition stays on the device and the
    host holds master, gradient and moments; offload_param moves the partition too. ZeRO-3
    accumulates in fp32 (grad_bytes 4), which no longer counts on the device."""
    owned = P // 4
    optimizer_only = model_state_bytes(deepspeed(zero=3))
    assert optimizer_only.weights == 2 * owned
    assert optimizer_only.host == owned * (4 + 4 + 8)
    both = model_state_bytes(deepspeed(zero=3, param_offload="cpu"))
    assert both.weights == 0
    assert both.host == owned * (4 + 4 + 8 + 2)
    assert both.buffers == optimizer_only.buffers


@pytest.mark.parametrize("framework", ["torchtitan", "hf"])
def test_fsdp_offload_moves_every_state(framework):
    """FSDP CPU offload: the fp32 parameter shard, its fp32 gradient and AdamW's moments on the
    host (4 + 4 + 8 per owned parameter, no master copy); only the gathered parameters and the
    buckets (buffers) on the device."""
    states = model_state_bytes(fsdp(framework))
    plain = model_state_bytes(
        fsdp(framework).replace(optimizer_offload="none", param_offload="none")
    )
    assert (states.weights, states.gradients, states.optimizer) == (0, 0, 0)
    assert states.host == (P // 4) * 16 == plain.total - plain.buffers
    assert states.buffers == plain.buffers


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"framework": "megatron", "zero": 1, "optimizer_offload": "cpu"}, "not megatron"),
        ({"framework": "deepspeed", "zero": 0, "optimizer_offload": "cpu"}, "ZeRO 1, 2 or 3"),
        (
            {
                "framework": "deepspeed",
                "zero": 2,
                "optimizer_offload": "cpu",
                "param_offload": "cpu",
            },
            "offload_param runs with ZeRO 3 only",
        ),
        ({"framework": "deepspeed", "zero": 3, "param_offload": "cpu"}, "needs optimizer_offload"),
        (
            {"framework": "torchtitan", "zero": 3, "optimizer_offload": "cpu"},
            "set param_offload: cpu too",
        ),
        (
            {
                "framework": "torchtitan",
                "zero": 0,
                "optimizer_offload": "cpu",
                "param_offload": "cpu",
            },
            "use zero 2 or 3",
        ),
        (
            {"framework": "deepspeed", "zero": 2, "optimizer_offload": "cpu", "microbatches": 2},
            "one micro-batch per step",
        ),
        (
            {"framework": "deepspeed", "zero": 2, "optimizer_offload": "cpu", "optimizer": "sgd"},
            "modelled for optimizer: adamw",
        ),
        (
            {
                "framework": "hf",
                "zero": 3,
                "optimizer_offload": "cpu",
                "param_offload": "cpu",
                "microbatches": 2,
                "grad_sync": "micro_batch",
            },
            "one micro-batch per step",
        ),
        (
            {
                "framework": "torchtitan",
                "zero": 3,
                "optimizer_offload": "cpu",
                "param_offload": "cpu",
                "microbatches": 2,
            },
            "more micro-batches with framework hf",
        ),
        (
            {
                "framework": "deepspeed",
                "zero": 2,
                "optimizer_offload": "cpu",
                "optimizer_in_backward": True,
            },
            "drop optimizer_in_backward",
        ),
        ({"optimizer_offload": "nvme"}, "key 'optimizer_offload' must be one of none, cpu"),
        ({"param_offload": "gpu"}, "key 'param_offload' must be one of none, cpu"),
    ],
)
def test_refusals_name_the_key(changes, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        spec(dp=4, **changes)


def test_traffic_by_hand():
    """ZeRO-2: fp32 gradients out, the bf16 partition back after the step; the CPU step reads
    and writes 28 bytes per parameter and casts 6. ZeRO-3 with offload_param: the partition
    comes up for the forward's and the backward's gathers. FSDP at zero 3: the fp32 shard comes
    up twice; at zero 2 once."""
    owned = P // 4
    t = host_states.state_traffic(deepspeed())
    assert (t.gradients_to_host, t.gathers_to_device, t.after_step_to_device) == (
        4 * owned,
        0,
        2 * owned,
    )
    assert (t.cpu_bytes, t.cpu_flops) == (34 * owned, 15 * owned)
    t = host_states.state_traffic(deepspeed(zero=3, param_offload="cpu"))
    assert (t.gathers_to_device, t.after_step_to_device, t.cpu_bytes) == (4 * owned, 0, 34 * owned)
    t = host_states.state_traffic(deepspeed(zero=3))
    assert (t.after_step_to_device, t.cpu_bytes) == (2 * owned, 28 * owned)
    assert host_states.state_traffic(fsdp()).gathers_to_device == 2 * 4 * owned
    assert host_states.state_traffic(fsdp(zero=2)).gathers_to_device == 4 * owned
    assert host_states.state_traffic(spec()).total == 0


def test_cpu_step_and_exposed_copies_by_hand():
    """The CPU step on the node's bandwidth shared by the GPUs stepping (4 of an 8-GPU node),
    the copies beside 1 ms of forward and 2 ms of backward on the host link."""
    gpu = load_gpu("a100-80gb")
    s = deepspeed()
    traffic = host_states.state_traffic(s)
    assert host_states.gpus_stepping(s, gpu) == 4
    rate = gpu.host_cpu_bytes_per_s * gpu.host_cpu_memory_efficiency / 4
    assert host_states.cpu_adam_seconds(traffic, gpu, 4) == pytest.approx(traffic.cpu_bytes / rate)
    assert optimizer_seconds(s, gpu) == pytest.approx(traffic.cpu_bytes / rate)
    link = host_link_bytes_per_second(gpu)
    exposed = host_states.exposed_state_copy_seconds(traffic, gpu, 1e-3, 2e-3)
    grads = max(0.0, traffic.gradients_to_host / link - 2e-3)
    assert exposed == pytest.approx(grads + traffic.after_step_to_device / link)


def test_step_time_adds_the_copies():
    gpu = load_gpu("a100-80gb")
    s = deepspeed()
    time = step_time(evaluate(s, parse_strategy("none", s)), gpu)
    assert time.state_copy_seconds > 0
    assert time.to_dict()["state_copy_seconds"] == time.state_copy_seconds
    parts = (
        time.forward_seconds
        + time.backward_seconds
        + time.recompute_seconds
        + time.communication_seconds
        + time.bubble_seconds
        + time.optimizer_seconds
        + time.state_copy_seconds
    )
    assert time.step_seconds == pytest.approx(parts)


def test_host_budget_binds():
    """The host bytes per GPU count against the host memory per GPU, as offloaded tapes do."""
    s = deepspeed(dp=1)
    plan = evaluate(s, parse_strategy("none", s))
    need = plan.model_states.host
    assert plan.host_total_bytes == need
    gpu = load_gpu("a100-80gb")
    roomy = Candidate(plan, 10**12, None, host_memory_per_gpu(gpu))
    assert roomy.fits
    tight = gpu.replace(host_memory_bytes=2**20 * gpu.gpus_per_node)
    assert host_memory_per_gpu(tight) < need
    assert not Candidate(plan, 10**12, None, host_memory_per_gpu(tight)).fits


def test_host_cpu_keys_validated():
    base = load_gpu("a100-80gb").to_dict()
    with pytest.raises(Exception, match="host_cpu_memory_efficiency"):
        gpu_from_mapping({**base, "host_cpu_memory_efficiency": 1.5})
    with pytest.raises(Exception, match="host_cpu_bytes_per_s"):
        gpu_from_mapping({**base, "host_cpu_bytes_per_s": 0})


def _deepspeed_source(relative: str) -> pathlib.Path:
    found = importlib.util.find_spec("deepspeed")
    if found is None or found.origin is None:
        pytest.skip("deepspeed is not installed: its CPU Adam kernel was not read")
    path = pathlib.Path(found.origin).parent / relative
    if not path.exists():
        pytest.skip(f"deepspeed ships no {relative}")
    return path


def test_cpu_adam_traffic_is_deepspeeds():
    """DeepSpeedCPUAdam's vectorised step loads four fp32 arrays and stores three per element
    (csrc/includes/cpu_adam.h `Step_AVX`): 28 bytes, as CPU_ADAM_BYTES_PER_PARAMETER."""
    text = _deepspeed_source("ops/csrc/includes/cpu_adam.h").read_text()
    body = text[text.index("void Adam_Optimizer::Step_AVX") :]
    body = body[: body.index("*rounded_size = new_rounded_size;")]
    loads = re.findall(r"simd_load<span>\(\w+, (\w+) \+ i\)", body)
    stores = re.findall(r"simd_store<span>\((\w+) \+ i,", body)
    assert sorted(loads) == ["_exp_avg", "_exp_avg_sq", "_params", "grads"]
    assert sorted(stores) == ["_exp_avg", "_exp_avg_sq", "_params"]
    assert 4 * (len(loads) + len(stores)) == host_states.CPU_ADAM_BYTES_PER_PARAMETER
    # AdamW: the weight decay of Adam's mode (folded into the gradient) does not run
    adam_mode = re.search(r"if \(_weight_decay > 0 && !_adamw_mode\) \{[^}]*\}", body)
    assert adam_mode is not None
    body = body.replace(adam_mode.group(0), "")
    ops = re.findall(r"simd_(mul|fma|sqrt|div)<span>", body)
    flops = sum(2 if op == "fma" else 1 for op in ops)
    assert flops == host_states.CPU_ADAM_FLOPS_PER_PARAMETER


def test_layout_search_runs_offloaded_layouts(capsys):
    """`ckplan plan` with model states on the host: every layout it tries runs them (ZeRO >= 1
    for DeepSpeed, one micro-batch per step), and its bounds count the host's states off the
    device."""
    import json

    from ckplan.cli import main

    argv = ["plan", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--seq", "4096"]
    argv += ["--set", "framework=deepspeed", "--set", "optimizer_offload=cpu", "--json"]
    try:
        main(argv)
    except SystemExit as exit:
        assert exit.code in (0, None)
    data = json.loads(capsys.readouterr().out)
    layouts = data["layouts"]
    assert layouts
    assert all(layout["zero"] >= 1 and layout["microbatches"] == 1 for layout in layouts)
    assert all(layout["time"]["state_copy_seconds"] > 0 for layout in layouts)


def test_json_shows_the_host_states(capsys):
    """`estimate --json`: the host bytes in `memory.model_states.host`, the copies and the CPU
    step in `state_offload`, the exposed copies in `time.state_copy_seconds`."""
    import json

    from ckplan.cli import main

    argv = ["estimate", "llama3-8b", "--gpu", "h100-sxm", "--set", "framework=deepspeed"]
    argv += ["--set", "zero=2", "--set", "dp=8", "--set", "optimizer_offload=cpu", "--json"]
    main(argv)
    data = json.loads(capsys.readouterr().out)
    offload = data["state_offload"]
    owned = -(-8_030_261_248 // 8)
    assert offload["host_bytes"] == data["memory"]["model_states"]["host"]
    assert offload["host_bytes"] == owned * 18 + 2 * 128_256 * 4096
    assert offload["gradients_to_host_bytes"] == 4 * owned
    assert offload["after_step_to_device_bytes"] == 2 * owned
    assert offload["cpu_step_bytes"] == 34 * owned
    assert offload["exposed_seconds"] == data["time"]["state_copy_seconds"]
    assert offload["cpu_step_seconds"] == data["time"]["optimizer_seconds"]


# The small model's frozen weights under QLoRA: 2 layers of linears (q 64x64, k and v 64x32,
# o 64x64, gate, up and down 64x128: 36,864 values each layer) packed two to a byte, and the
# rest (norms 2 x 2 x 64 + 64, embedding and output layer 2 x 256 x 64: 33,088 values) at
# hf's 4 bytes; LoRA r 16 on q_proj (16 x (64 + 64)) and v_proj (16 x (64 + 32)) each layer.
LINEAR_VALUES = 2 * 36_864
OTHER_VALUES = 33_088
ADAPTERS = 2 * (16 * 128 + 16 * 96)


def qlora_fsdp(**changes):
    return fsdp("hf", training="qlora", weight_format="nf4", **changes)


def test_small_qlora_by_hand():
    assert LINEAR_VALUES + OTHER_VALUES == P
    assert finetune.lora_layer_parameters(qlora_fsdp()) * 2 == ADAPTERS


def test_fsdp_offload_beside_frozen_weights_by_hand():
    """QLoRA under FSDP's CPU offload over 4 GPUs: the host holds each GPU's shard of the
    frozen weights' data (the packed 4-bit values and the rest at 4 bytes) and the adapters'
    states (4 + 4 + 8 per owned parameter); the GPU keeps only the 4-bit statistics, which are
    no parameter's data."""
    s = qlora_fsdp()
    statistics = 2 * finetune.layer_quantization_statistics_bytes(s)
    shard = (LINEAR_VALUES // 2 + 4 * OTHER_VALUES) // 4
    assert memory.host_frozen_bytes(s, 0) == shard
    states = model_state_bytes(s)
    assert (states.weights, states.gradients, states.optimizer) == (statistics, 0, 0)
    assert states.host == shard + (ADAPTERS // 4) * 16
    kept = model_state_bytes(s.replace(optimizer_offload="none", param_offload="none"))
    assert kept.weights == statistics + shard + (ADAPTERS // 4) * 4
    # SHARD_GRAD_OP (zero 2) offloads the same shards: only the statistics stay, as at zero 3
    assert model_state_bytes(qlora_fsdp(zero=2)).weights == statistics


def test_hf_accumulation_keeps_the_adapters_gradients_on_the_gpu():
    """hf's FSDP under no_sync over 3 micro-batches: the adapters' unsharded gradients (4 bytes
    each) stay on the GPU until the last backward; every micro-batch gathers the shards up
    again, twice at zero 3, and the gradients go out once."""
    s = qlora_fsdp(microbatches=3)
    assert model_state_bytes(s).gradients == ADAPTERS * 4
    shard = (LINEAR_VALUES // 2 + 4 * OTHER_VALUES) // 4
    t = host_states.state_traffic(s)
    assert t.gathers_to_device == 3 * 2 * (shard + (ADAPTERS // 4) * 4)
    assert t.gradients_to_host == (ADAPTERS // 4) * 4
    assert t.cpu_bytes == (ADAPTERS // 4) * 28


def test_deepspeed_optimizer_offload_beside_frozen_weights():
    """ZeRO-Offload of a LoRA fine-tune at ZeRO 2: the frozen weights stay on the GPU, whole;
    only the adapters' fp32 master, gradient, moments and bf16 copy go to the host, with the
    staging buffer of the largest adapter tensor."""
    s = deepspeed(training="lora")
    plain = model_state_bytes(s.replace(optimizer_offload="none"))
    states = model_state_bytes(s)
    assert states.weights == plain.weights
    owned = ADAPTERS // 4
    # the staging buffers: DeepSpeed's largest parameter that trains, a lora_A of q_proj or
    # v_proj (16 x 64) or q_proj's lora_B (64 x 16), in bf16
    assert memory.largest_trained_parameter(s) == 16 * 64
    assert states.host == owned * (4 + 4 + 8 + 2) + 2 * 16 * 64


def test_zero3_gathers_the_frozen_weights_every_pass():
    """ZeRO-3 (hf's FULL_SHARD) of a QLoRA fine-tune gathers, for each forward and backward,
    the adapters in bf16 and the frozen weights' data: the packed 4-bit values and the rest in
    the compute dtype (2 bytes), not their statistics."""
    s = spec(framework="hf", zero=3, dp=4, training="qlora", weight_format="nf4")
    frozen = LINEAR_VALUES // 2 + 2 * OTHER_VALUES
    assert memory.frozen_gathered_bytes(s, 0) == frozen
    gpu = load_gpu("h100-sxm")
    bandwidth = comm.group_bandwidth(gpu, 4, 1)
    parts = data_parallel_comm(s, gpu)
    assert parts.forward == pytest.approx(
        comm.all_gather_seconds(2 * ADAPTERS + frozen, 4, bandwidth)
    )
    assert parts.backward == parts.forward
    assert memory.frozen_gathered_bytes(spec(framework="hf", zero=3, dp=4), 0) == 0


def test_fsdp_offload_of_bf16_states():
    """torch's AdamW over bf16 parameters under FSDP's CPU offload (adamw-bf16, no master
    copy): the host holds the bf16 shard, its bf16 gradient (FSDP1's `_cpu_grad` is
    zeros_like the shard) and two bf16 moments, 8 bytes per owned parameter, and the CPU step
    moves the seven tensors at 2 bytes; DeepSpeedCPUAdam steps fp32 states only."""
    s = fsdp("hf", weight_bytes=2, grad_bytes=2, master_bytes=0, optimizer="adamw-bf16")
    owned = P // 4
    assert memory.host_gradient_bytes(s) == 2
    assert model_state_bytes(s).host == owned * (2 + 2 + 4)
    t = host_states.state_traffic(s)
    assert (t.gradients_to_host, t.cpu_bytes) == (2 * owned, 14 * owned)
    assert memory.host_gradient_bytes(deepspeed()) == 4
    with pytest.raises(SpecError, match="DeepSpeedCPUAdam"):
        deepspeed(optimizer="adamw-bf16")
