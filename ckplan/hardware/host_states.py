"""Model states on the host: the copies they cost over the host link and the optimizer step the
host's CPU runs (`optimizer_offload: cpu`, `param_offload: cpu`; ckplan.model.frameworks
`state_offload_error` says who runs what, ckplan.model.memory `offloaded_states` what stays on
the GPU).

One step with one micro-batch, per GPU, over the parameters whose states it owns (`owned`: its
share over dp·cp, the experts' over their data-parallel group):

- gradients, device to host: 4 bytes per owned parameter under DeepSpeed (fp32; it converts
  each reduced bucket's partition to fp32 on the GPU and copies it out with non_blocking=True,
  stage_1_and_2.py `async_inplace_copy_grad_to_fp32_buffer_from_gpu`, v0.19.8), the sharded
  parameter's weight_bytes under FSDP (FSDP2 copies its reduce-scatter output to the CPU,
  _fsdp_collectives.py `foreach_reduce`, FSDP1 into `_cpu_grad`, PyTorch v2.13.0;
  `memory.host_gradient_bytes`). Both run beside the backward, on their own streams: exposed
  where they outlast it.
- parameters, host to device, on every gather: FSDP2 copies the fp32 shard to the GPU before
  each all-gather (_fsdp_param.py `all_gather_inputs`), twice a step with resharding after
  forward (zero 3), once without (zero 2), for each micro-batch where hf's no_sync
  accumulates several (FSDP1 copies each FlatParameter's shard up in `_unshard`); DeepSpeed's
  offload_param fetches the bf16 partition for the forward's and the backward's gathers.
  With frozen base weights (LoRA, QLoRA) their shards too, as stored
  (`memory.host_frozen_bytes`: 4-bit weights packed). Prefetched beside the forward and
  backward: exposed where they outlast both.
- parameters, host to device, after the step: DeepSpeed ZeRO 1-2 cast the updated fp32
  partition into a pinned bf16 buffer and copy it to the GPU (stage_1_and_2.py `step`,
  weight_bytes per owned parameter) before the next forward can gather it: exposed. (ZeRO-3
  without offload_param is counted the same way.)
- the CPU step (`cpu_adam_seconds`), after the backward: exposed. ZeRO-Offload's one-step
  delayed parameter update (Ren et al. 2021, "One-Step Delayed Parameter Update"), which
  overlaps the step with the next iteration's forward and backward by applying gradients one
  step late, is not modelled.

The host link is `hardware.host_link`'s (its rate shared by `gpus_per_host_link` GPUs); the
node's memory bandwidth and FLOP/s are the GPU file's `host_cpu_*` keys, shared by the job's
GPUs on the node (`gpus_stepping`), whose processes step at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.hardware.gpus import GPU
from ckplan.hardware.host_link import copy_seconds
from ckplan.model import frameworks, memory
from ckplan.model.op import split_share
from ckplan.model.spec import ModelSpec

FP32 = 4
# DeepSpeedCPUAdam, one element (csrc/includes/cpu_adam.h `Step_AVX`, v0.19.8): loads the
# gradient, exp_avg, exp_avg_sq and the fp32 parameter (4 x 4 bytes) and stores the parameter,
# exp_avg and exp_avg_sq (3 x 4). torch's fused AdamW on the CPU (FSDP's step) reads and writes
# the same tensors once.
CPU_ADAM_BYTES_PER_PARAMETER = 7 * FP32


def cpu_adam_bytes_per_parameter(spec: ModelSpec) -> int:
    """The CPU step's memory traffic per owned parameter: `CPU_ADAM_BYTES_PER_PARAMETER` for
    fp32 states; torch's AdamW over bf16 parameters and moments (`optimizer: adamw-bf16`, FSDP
    only) reads and writes the same seven tensors at 2 bytes. derived."""
    return CPU_ADAM_BYTES_PER_PARAMETER * (2 if spec.optimizer == "adamw-bf16" else 4) // FP32


# Its arithmetic in Step_AVX (AdamW with weight decay): mul, fma, mul, mul, fma, sqrt, fma, div,
# fma (decay), fma (update); an fma counts 2 FLOPs.
CPU_ADAM_FLOPS_PER_PARAMETER = 15
# DeepSpeed's cast of the updated fp32 partition to the bf16 copy it sends back (ZeRO 1-2) or
# keeps on the host (offload_param): reads 4 bytes, writes 2.
CAST_BYTES_PER_PARAMETER = FP32 + 2


@dataclass(frozen=True)
class StateTraffic:
    """Bytes the model states move over one GPU's host link in one step (module docstring)."""

    gradients_to_host: int  # beside the backward
    gathers_to_device: int  # beside the forward and backward
    after_step_to_device: int  # after the CPU step, exposed
    cpu_bytes: int  # the CPU step's memory traffic
    cpu_flops: int

    @property
    def total(self) -> int:
        return self.gradients_to_host + self.gathers_to_device + self.after_step_to_device


def owned_parameters(spec: ModelSpec) -> int:
    """The trainable parameters whose states one GPU of the busiest stage owns: its dense share
    over dp·cp and its experts' over their data-parallel group (as `memory.states_of`
    shards them; state offload needs ZeRO >= 1)."""
    dense, experts = memory.trainable_stage_parameters(spec, memory.busiest_stage(spec))
    return split_share(dense, spec.dp * spec.cp) + (
        split_share(experts, spec.expert_data_parallel) if experts else 0
    )


def state_traffic(
    spec: ModelSpec, owned: int | None = None, zero: int | None = None
) -> StateTraffic:
    """One step's host traffic and CPU work of the offloaded states (module docstring);
    `owned` defaults to `owned_parameters`, `zero` (a layout's) to the spec's. Zero without
    optimizer_offload."""
    if spec.optimizer_offload == "none":
        return StateTraffic(0, 0, 0, 0, 0)
    owned = owned_parameters(spec) if owned is None else owned
    zero = spec.zero if zero is None else zero
    params_out = spec.param_offload != "none"
    gathers = after = 0
    cpu_bytes = owned * cpu_adam_bytes_per_parameter(spec)
    # the shards fetched for a gather: the owned parameters' and the frozen weights'
    shards = owned * spec.weight_bytes + memory.host_frozen_bytes(spec, memory.busiest_stage(spec))
    if spec.framework == "deepspeed":
        if params_out:
            gathers = 2 * shards
        else:
            after = owned * spec.weight_bytes
        if zero < 3 or params_out:
            cpu_bytes += owned * CAST_BYTES_PER_PARAMETER
    else:  # FSDP: each gather copies the shard up; zero 2 does not reshard after forward
        gathers = (2 if zero >= 3 else 1) * shards
        if frameworks.offload_accumulates_on_device(spec):
            gathers *= spec.microbatches  # no_sync: every micro-batch gathers
    return StateTraffic(
        gradients_to_host=owned * memory.host_gradient_bytes(spec),
        gathers_to_device=gathers,
        after_step_to_device=after,
        cpu_bytes=cpu_bytes,
        cpu_flops=owned * CPU_ADAM_FLOPS_PER_PARAMETER,
    )


def gpus_stepping(spec: ModelSpec, gpu: GPU) -> int:
    """The GPUs of one node whose processes run the CPU step at once: the job's GPUs
    (tp·pp·cp·dp), at most gpus_per_node (derived)."""
    return min(gpu.gpus_per_node, spec.tp * spec.pp * spec.cp * spec.dp)


def host_cpu_bytes_per_second(gpu: GPU, sharing: int) -> float:
    """One GPU's share of its node's CPU memory bandwidth while `sharing` GPUs' processes step:
    datasheet rate x `host_cpu_memory_efficiency` / sharing (derived)."""
    return gpu.host_cpu_bytes_per_s * gpu.host_cpu_memory_efficiency / sharing


def cpu_adam_seconds(traffic: StateTraffic, gpu: GPU, sharing: int) -> float:
    """The CPU optimizer step of one GPU's owned parameters: the larger of its memory time and
    its arithmetic time on the GPU's share of the node's CPUs, `sharing` GPUs stepping at once
    (`gpus_stepping`) (roofline). derived: CPU Adam is
    bandwidth-bound, 15 FLOPs per 28 bytes (`CPU_ADAM_*`) against the default host's 23 FLOPs
    per byte of bandwidth, so the memory term decides."""
    memory_time = traffic.cpu_bytes / host_cpu_bytes_per_second(gpu, sharing)
    flops_time = traffic.cpu_flops / (gpu.host_cpu_flops / sharing)
    return max(memory_time, flops_time)


def exposed_state_copy_seconds(
    traffic: StateTraffic,
    gpu: GPU,
    forward_seconds: float,
    backward_seconds: float,
    passes: int = 1,
) -> float:
    """The host copies of the offloaded states that the compute does not hide (module
    docstring): the gradients' beyond the (last) backward, the gathers' beyond the `passes`
    micro-batches' forwards and backwards they are spread over, and the copy after the step
    in full (derived)."""
    gradients = max(0.0, copy_seconds(traffic.gradients_to_host, gpu) - backward_seconds)
    gathers = copy_seconds(traffic.gathers_to_device, gpu)
    gathers = max(0.0, gathers - passes * (forward_seconds + backward_seconds))
    return gradients + gathers + copy_seconds(traffic.after_step_to_device, gpu)
