"""A DeepSpeed config fragment for a plan: `activation_checkpointing` and the batch and ZeRO
keys the plan was computed for.

DeepSpeed's `activation_checkpointing` block (deepspeed/runtime/activation_checkpointing/
config.py) has exactly six keys: `partition_activations`, `contiguous_memory_optimization`,
`cpu_checkpointing`, `number_checkpoints`, `synchronize_checkpoint_boundary`, `profile`. They
configure `deepspeed.checkpointing.checkpoint`; which layers it wraps is the model's code:
`PipelineModule(activation_checkpoint_interval=K)` checkpoints every chunk of K layers
(deepspeed/runtime/pipe/module.py, ckplan's `uniform:K` when the chunks are transformer
blocks), any other segmentation calls `deepspeed.checkpointing.checkpoint` on its ranges.
`number_checkpoints` sizes the buffer of `contiguous_memory_optimization`: the recomputed
segments per stage. ckplan does not model activation partitioning, which stays false.
`cpu_checkpointing` moves the inputs `deepspeed.checkpointing.checkpoint` keeps to host memory
(checkpointing.py, v0.19.8: without partitioning, asynchronously on a side stream, the last
checkpoint's inputs kept on the GPU, `keep_last_count=1`): ckplan's `full+offload`, whose
stored tapes are none but the embedding's and the output layer's; it is true for that plan
only, and other offload plans (stored tapes on host) are refused. The pipeline engine asserts
"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" (deepspeed/runtime/pipe/
engine.py).

Model states on the host (`optimizer_offload: cpu`, `param_offload: cpu`) become
`zero_optimization.offload_optimizer` and `offload_param`, `{"device": "cpu", "pin_memory":
true}` (deepspeed/runtime/zero/offload_config.py, v0.19.8: DeepSpeedZeroOffloadOptimizerConfig,
valid with stage 1, 2 and 3, and DeepSpeedZeroOffloadParamConfig, stage 3 only); ZeRO-Offload
asserts the optimizer is DeepSpeedCPUAdam (stage_1_and_2.py `_enforce_cpu_offload`), which a
config's `"optimizer": {"type": "AdamW"}` builds when offload_optimizer is set. Otherwise the
fragment names no optimizer, so DeepSpeed steps the client's (the Trainer's `optim`): where
ckplan counted its foreach path (`optimizer_implementation: foreach`), a note says so.
"""

from __future__ import annotations

import json

from ckplan.exports.segments import LayerSegments, module_reason
from ckplan.model.frameworks import optimizer_implementation
from ckplan.model.spec import ModelSpec
from ckplan.plan import Plan

NAME = "deepspeed"


def reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    if why := module_reason(layers, "DeepSpeed"):
        return why
    if spec.pp > 1 and spec.zero > 1:
        return f"zero={spec.zero} with pp={spec.pp}: DeepSpeed's pipeline engine allows ZeRO 0-1"
    if spec.moe_act_input_fp8:
        return "moe_act_input_fp8: DeepSpeed keeps the experts' activation input in BF16"
    if spec.moe_dispatch_fp8 or spec.moe_token_dispatcher_type == "flex":
        # deepspeed/moe/sharded_moe.py: MOELayer's _AllToAll sends every expert's capacity
        # buffer in the activation dtype
        key = "moe_dispatch_fp8" if spec.moe_dispatch_fp8 else "moe_token_dispatcher_type flex"
        return f"{key}: DeepSpeed's MoE dispatches with its own all-to-all in the activation dtype"
    if spec.pipeline_schedule == "dualpipe":
        # deepspeed/runtime/pipe/schedule.py: TrainSchedule, a 1F1B
        return "pipeline_schedule dualpipe: DeepSpeed's pipeline engine runs 1F1B (TrainSchedule)"
    if spec.param_offload != "none" and spec.zero != 3:
        return (
            f"param_offload with zero={spec.zero}: DeepSpeed's offload_param runs with ZeRO 3 only"
        )
    return None


def zero_section(spec: ModelSpec) -> dict:
    """`zero_optimization`: the stage and, with model states on the host, the offload blocks
    (module docstring)."""
    section: dict = {"stage": spec.zero}
    for key, block in (
        ("optimizer_offload", "offload_optimizer"),
        ("param_offload", "offload_param"),
    ):
        device = getattr(spec, key)
        if device != "none":
            section[block] = {"device": device, "pin_memory": True}
    return section


def offload_reason(layers: LayerSegments) -> str | None:
    """Why `cpu_checkpointing` cannot run these offloaded layers: it moves the inputs of
    checkpointed segments only, so the offloaded layers must be exactly the first layers of the
    recomputed segments (None: `full+offload`, `uniform:K+offload`, `sqrt+offload`)."""
    starts = {start for start, _ in layers.recomputed}
    if set(layers.offloaded) != starts or not starts:
        return (
            "DeepSpeed's cpu_checkpointing moves the inputs of checkpointed layers only, not "
            "stored tapes (use full+offload or uniform:K+offload, or --to torch)"
        )
    return None


def config(plan: Plan, layers: LayerSegments) -> dict:
    spec = plan.spec
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.microbatches,
        "zero_optimization": zero_section(spec),
        "activation_checkpointing": {
            "partition_activations": False,
            "cpu_checkpointing": bool(layers.offloaded),
            "contiguous_memory_optimization": False,
            "number_checkpoints": len(layers.recomputed) or None,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        },
    }


def render(plan: Plan, layers: LayerSegments) -> str:
    return json.dumps(config(plan, layers), indent=2) + "\n"


def notes(plan: Plan, layers: LayerSegments) -> list[str]:
    lines = []
    if layers.recomputed:
        ranges = ", ".join(f"{start}..{end - 1}" for start, end in layers.recomputed[:6])
        more = ", ..." if len(layers.recomputed) > 6 else ""
        lines.append(
            "wrap each range of layers with deepspeed.checkpointing.checkpoint: "
            f"layers {ranges}{more} of each stage"
        )
        size = layers.uniform_size()
        if size is not None:
            lines.append(
                "or, in a PipelineModule of transformer blocks: "
                f"activation_checkpoint_interval={size}"
            )
    if layers.selective:
        lines.append(
            "selective: wrap each layer's attention core (QKᵀ, softmax, dropout, ·V) in "
            "deepspeed.checkpointing.checkpoint"
        )
    if layers.offloaded:
        lines.append(
            "cpu_checkpointing: the inputs deepspeed.checkpointing.checkpoint keeps go to host "
            "memory; DeepSpeed keeps the last layer's on the GPU and the embedding's tape where "
            "the model keeps it, one layer input and the embedding's tape fewer on host than "
            "ckplan's full+offload"
        )
    if not lines:
        lines.append("no checkpointing: the plan stores every activation")
    if plan.spec.optimizer_offload != "none":
        lines.append(
            'offload_optimizer steps with DeepSpeedCPUAdam: give "optimizer": {"type": "AdamW"} '
            "(or pass deepspeed.ops.adam.DeepSpeedCPUAdam)"
        )
    spec = plan.spec
    if spec.optimizer_offload == "none" and optimizer_implementation(spec) == "foreach":
        lines.append(
            "the optimizer step counted is torch.optim.AdamW's foreach path with its copy of "
            "exp_avg_sq, the client optimizer DeepSpeed steps when its config names none (the "
            'Trainer\'s adamw_torch); "optimizer": {"type": "AdamW"} makes it FusedAdam, in '
            "place: --set optimizer_implementation=fused"
        )
    if spec.tp > 1 or spec.pp > 1 or spec.cp > 1:
        lines.append(
            f"tp={spec.tp} pp={spec.pp} cp={spec.cp} are the launcher's (Megatron-DeepSpeed: "
            "the flags of --to megatron)"
        )
    return lines
