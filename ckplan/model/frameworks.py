"""Training frameworks: what each keeps per parameter, the buffers it adds, the layouts it runs.

ckplan's `zero` key names what is sharded over the data-parallel ranks, whatever the framework
calls it: 1 the fp32 master weights and optimizer states, 2 also the gradients, 3 also the
weights (Rajbhandari et al. 2020, §5). Each framework runs some of these, keeps its own bytes per
parameter (its mixed-precision recipe) and adds buffers of its own:

- `megatron` (Megatron-LM / Megatron-Core, NeMo): bf16 weights, fp32 main gradients in a
  contiguous buffer, fp32 master weights and Adam moments: 18 bytes per parameter, 6 + 12/d with
  the distributed optimizer (docs/user-guide/features/dist_optimizer.md: "bf16 parameters, fp32
  gradients | 18 | 6 + 12/d"); ZeRO-2/3 through Megatron-FSDP (`--use-megatron-fsdp
  --data-parallel-sharding-strategy optim_grads|optim_grads_params`), which its docs compose
  with TP and EP; ckplan runs it without pipeline parallelism.
- `torchtitan` (FSDP2, `fully_shard` with MixedPrecisionPolicy(param bf16, reduce fp32)): the
  sharded parameters stay fp32 and are the optimizer's ("does not require any extra memory to
  keep a high-precision copy", torch/distributed/fsdp/_fully_shard/_fsdp_api.py), fp32 sharded
  gradients, Adam: 16 bytes per parameter over d. Buffers with zero 3 on one pipeline stage
  (`fsdp2_resharding`), by torchtitan release (`framework_version`, `fsdp2_grouping`): the
  final norm and output layer unsharded in bf16 all step, and under torchtitan "2024.12" the
  embedding and the last layer too (`fsdp2_kept_unsharded_bytes`); while a layer runs, its
  unsharded parameters, the prefetched unit's all-gather output, its bf16 gradients, the
  previous unit's fp32 reduce-scatter input and, under "2024.12", the output layer's bf16
  gradients, as that layer's chain workspace (`fsdp2_layer_forward_bytes`,
  `fsdp2_layer_backward_bytes`; measured with PyTorch's FSDPMemTracker:
  validation/torch_fsdp2_memory.py). Reserved beside the allocated peak: the side streams'
  pools, the sharded gradients and the all-gather buffers (`fsdp2_stream_pool_bytes`,
  `fsdp2_all_gather_pool_bytes`). With zero 2: the bf16 unsharded parameters of the whole stage,
  the layer's bf16 gradients and fp32 reduce-scatter input. Under pipeline parallelism it does
  not reshard after forward (torchtitan's parallelize apply_fsdp): the whole stage stays
  unsharded; and the pipeline stage runs every micro-batch's backward without gradient sync,
  reduce-scattering once after the last (torch/distributed/pipelining/stage.py
  `backward_maybe_with_nosync`, PyTorch v2.13.0), so FSDP2 accumulates the stage's unsharded
  gradients in its reduce dtype, fp32 (_fsdp_param.py `to_accumulated_grad_if_needed`): 4 bytes
  per parameter of the stage.
  zero 0 is its replicate (DDP/HSDP), 2 FSDP without resharding after forward, 3 FSDP; both
  shard the fp32 parameters (`weights_sharded_from`).
- `deepspeed` (ZeRO, bf16): bf16 weights and gradients, fp32 master weights and Adam, 16 bytes
  per parameter (Rajbhandari et al. 2020, K = 12); ZeRO-3 accumulates its gradient partition in
  fp32 (stage3.py `grad_partitions_flat_buffer`, gradient_accumulation_dtype fp32). Buffers
  (deepspeed/runtime/zero/config.py defaults, v0.16.4): the reduce bucket, 5e8 elements in bf16
  (ZeRO-1/2: at most the parameters'; ZeRO-3: its IPG bucket allocated whole, beside
  reduce_scatter's flat copy of one bucket, `deepspeed_zero3_reduce_bytes`; Hugging Face's
  `auto` values, hidden² and the like, apply only where a DeepSpeed config file says "auto":
  accelerate's own config sets none of these keys), the all-gather bucket (5e8, ZeRO-1/2),
  ZeRO-3's prefetch bucket (5e7) and the parameters it keeps gathered, at most
  stage3_max_live_parameters (1e9) unless a single weight is larger. Pipeline parallelism only
  with ZeRO 0-1.
- `hf` (Hugging Face Trainer / accelerate, AMP bf16 over fp32 weights): fp32 weights, gradients
  and Adam, 16 bytes per parameter; DDP's reducer keeps its buckets beside the gradients
  (gradient_as_bucket_view off by default: another 4 bytes per parameter); autocast caches a bf16
  copy of every fp32 weight for the forward and backward (2 bytes per parameter; none when
  weight_bytes is 2, weights already in bf16 as in pure-bf16 training, and none under precision
  fp32, which runs no autocast). With zero 3 over more
  than one rank (FSDP1 FULL_SHARD with bf16 mixed precision, `fsdp1_resharding`) the weights
  autocast sees are FSDP's bf16 unsharded copies, so it caches none: FSDP1 keeps the root unit's
  copy (embedding, final norm, output layer) from the forward to the end of the backward
  (`fsdp1_kept_unsharded_bytes`) and, while a layer runs, its copy, its bf16 gradients and the
  output layer's waiting gradient, as that layer's chain workspace (`fsdp1_layer_forward_bytes`,
  `fsdp1_layer_backward_bytes`, `fsdp1_embedding_backward_bytes`; measured on the CPU:
  validation/torch_fsdp1_memory.py). That is `fsdp_version` 1; at 2 (the Trainer's default
  from transformers v5.10.1) accelerate's FSDP2 holds torchtitan 0.3's buffers with a bf16
  reduce-scatter input (`spec_fsdp2_grouping`, `fsdp2_reduce_bytes`), and beside frozen base
  weights each layer's gathered copy while it runs (`fsdp2_frozen_layer_backward_bytes`). At
  zero 2 both FSDPs shard the weights and keep their bf16 copies from forward to backward
  (`weights_sharded_from`). No tensor, pipeline, context or expert parallelism; ZeRO-2/3
  through accelerate's FSDP or DeepSpeed.

Model states in host memory (`optimizer_offload: cpu`, `param_offload: cpu`;
`state_offload_error` says what each framework runs, ckplan.model.memory `offloaded_states`
what stays on the GPU, ckplan.hardware.host_states the copies and the CPU step):

- `deepspeed`: ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model
  Training", USENIX ATC), `zero_optimization.offload_optimizer: {device: cpu}`, valid with
  ZeRO 1, 2 and 3 (deepspeed/runtime/zero/offload_config.py, v0.19.8): the fp32 master
  partition, its fp32 gradient and Adam's moments on the host, the step DeepSpeedCPUAdam's; and
  ZeRO-Infinity's `offload_param: {device: cpu}`, ZeRO-3 only ("Valid only with stage 3"): the
  bf16 parameter partition on the host too.
- `torchtitan`, `hf`: FSDP's CPU offload (FSDP2 `CPUOffloadPolicy`, torchtitan's
  `training.enable_cpu_offload`; accelerate's `fsdp_offload_params`), which moves the sharded
  parameters, their gradients and the optimizer step to the CPU together: both keys at once,
  with ZeRO 2 or 3 (FSDP).
- `megatron`: not modelled (Megatron-Core's `optimizer_cpu_offload` is another design,
  a hybrid device optimizer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ckplan.model import optimizers

DEEPSPEED_REDUCE_BUCKET = 500_000_000  # elements (reduce_bucket_size)
DEEPSPEED_ALLGATHER_BUCKET = 500_000_000  # elements (allgather_bucket_size)
DEEPSPEED_PREFETCH_BUCKET = 50_000_000  # elements (stage3_prefetch_bucket_size)
DEEPSPEED_MAX_LIVE = 1_000_000_000  # parameters (stage3_max_live_parameters)
DEEPSPEED_MAX_REUSE = 1_000_000_000  # elements (stage3_max_reuse_distance)
DEEPSPEED_PERSISTENCE = 100_000  # elements (stage3_param_persistence_threshold)
HALF = 2  # bytes of a bf16 value
FLOAT8 = 1  # bytes of a float8 value (torch.float8_e4m3fn)
OFFLOAD_DEVICES = ("none", "cpu")  # optimizer_offload, param_offload
GRAD_SYNCS = ("micro_batch", "step")  # grad_sync (`gradient_sync`)
# fsdp_backward_prefetch: FSDP1's BackwardPrefetch under hf (`fsdp1_prefetched_layers`)
BACKWARD_PREFETCHES = ("none", "backward_pre", "backward_post")
# fsdp_reduce_dtype: the dtype FSDP reduce-scatters the gradients in under hf
# (`fsdp_reduce_bytes`), bytes per value
FSDP_REDUCE_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
# the transformers releases among FRAMEWORK_VERSIONS["hf"] whose Trainer builds FSDP2 unless
# fsdp_config says version 1: `int(self.fsdp_config.get("version", 2))` in training_args.py
# from v5.10.1 (`get("version", 1)` through v5.9.0, and v4.44.2 builds FSDP1 alone)
FSDP2_DEFAULT_RELEASES = ("5.25",)
# the half dtype accelerate's mixed precision computes (and, by default, reduces) in per precision
# (accelerate/utils/dataclasses.py `set_mixed_precision` at v1.14.0: fp8 runs bf16)
_HALF_DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp8": "bf16", "float8": "bf16"}
# optimizer_implementation: the code path torch.optim.AdamW steps with (`optimizer_implementation`):
# `fused` (one kernel, in place) or `foreach` (a kernel per operation over every tensor at once,
# beside a copy of exp_avg_sq: ckplan.model.optimizers `foreach_adamw_workspace_bytes`)
OPTIMIZER_IMPLEMENTATIONS = ("fused", "foreach")
# the transformers releases among FRAMEWORK_VERSIONS["hf"] whose Trainer defaults to
# `optim="adamw_torch"`, torch.optim.AdamW with neither `fused` nor `foreach`, which PyTorch then
# runs foreach on CUDA (training_args.py v4.44.2 `default_optim = "adamw_torch"`; v5.25.0 makes
# it "adamw_torch_fused" from torch 2.8)
FOREACH_DEFAULT_RELEASES = ("4.44",)
# zero_grad: what the training loop's zero_grad leaves between steps (ckplan.model.memory
# `gradients_allocated_in_backward`): `none`, the gradients set to None (PyTorch's default
# since 2.0), or `zeros`, kept allocated and zeroed (the default before 2.0)
ZERO_GRADS = ("none", "zeros")
# framework_version: the releases whose semantics ckplan models apart, oldest first; the last
# is the default (`framework_version`). torchtitan: its FSDP2 grouping (`fsdp2_grouping`); hf:
# transformers' causal-LM loss (ckplan.model.loss `shifted_logits_elements`: 4.44 copies the
# shifted fp32 logits, 5.25 shifts the labels); deepspeed: the same transformers releases, for
# a transformers model that the Hugging Face Trainer or accelerate runs under DeepSpeed (the
# model code is transformers' whoever drives the step), and before them 0.5.4, DeepSpeed's own
# ZeRO-3 fetch and reduction path of 2021 (`deepspeed_list_collectives`; a transformers model
# there runs the newest transformers' loss); megatron: the Transformer Engine release its
# attention runs, whose context-parallel loops move different bytes
# (ckplan.model.context_parallel `TE_CP_MOVED`)
TRANSFORMERS_VERSIONS = ("4.44", "5.25")
DEEPSPEED_2021 = "0.5.4"
TRANSFORMER_ENGINE_RELEASES = tuple(
    f"te{release}"
    for release in (
        "1.8", "1.9", "1.10", "1.11", "1.12", "1.13", "2.0", "2.1", "2.2", "2.3", "2.4", "2.5",
        "2.6", "2.7", "2.8", "2.9", "2.10", "2.11", "2.12", "2.13", "2.14", "2.15", "2.16",
    )
)  # fmt: skip
FRAMEWORK_VERSIONS = {
    "megatron": TRANSFORMER_ENGINE_RELEASES,
    "hf": TRANSFORMERS_VERSIONS,
    "deepspeed": (DEEPSPEED_2021, *TRANSFORMERS_VERSIONS),
    "torchtitan": ("2024.12", "0.3"),
}


@dataclass(frozen=True)
class FrameworkRules:
    name: str
    zero_stages: tuple[int, ...]
    max_zero_with_pipeline: int  # the highest ZeRO stage it runs beside pp > 1
    model_parallel: bool  # tensor, pipeline, context and expert parallelism
    bytes_per_parameter: tuple[int, int, int, int]  # weight, grad, master, optimizer


RULES = {
    "megatron": FrameworkRules("megatron", (0, 1, 2, 3), 1, True, (2, 4, 4, 8)),
    "torchtitan": FrameworkRules("torchtitan", (0, 2, 3), 3, True, (4, 4, 0, 8)),
    "deepspeed": FrameworkRules("deepspeed", (0, 1, 2, 3), 1, True, (2, 2, 4, 8)),
    "hf": FrameworkRules("hf", (0, 2, 3), 0, False, (4, 4, 0, 8)),
}
TRAINING_KEYS = ("weight_bytes", "grad_bytes", "master_bytes", "optimizer_bytes")


def default_framework(
    training: str | None,
    zero: int | None,
    tp: int | None,
    pp: int | None,
    cp: int | None,
    ep: int | None,
) -> str:
    """The framework a model that names none runs under: for adapters (`training` lora or qlora)
    on a layout the Trainer runs (`layout_error`), Hugging Face's Trainer with PEFT, where LoRA
    and QLoRA run (bitsandbytes' 4-bit weights, `prepare_model_for_kbit_training`);
    Megatron-LM's arguments have no adapters (megatron/training/arguments.py at core_v0.19.0:
    its --q-lora-rank and --kv-lora-rank are MLA's projections). Otherwise Megatron-LM."""
    sizes = (size or 1 for size in (tp, pp, cp, ep))  # None: not given, the default 1
    if training in ("lora", "qlora") and layout_error("hf", zero or 0, *sizes) is None:
        return "hf"
    return "megatron"


def offload_strategies(framework: str, pp: int) -> tuple[str, ...]:
    """The activation-offload strategies (ckplan.plan.offload) `framework` runs at pipeline
    size `pp`, as `ckplan plan` tries them.

    - megatron: none. At NVIDIA/Megatron-LM core_v0.19.0, `--cpu-offloading-num-layers N`
      has Transformer Engine's `get_cpu_offload_context` (megatron/core/transformer/
      transformer_block.py) offload saved tensors of N < num_layers layers of the transformer
      block ("CPU offloading can be done only for layers less than
      num_layers", megatron/core/transformer/transformer_config.py), never the embedding's,
      and refuses recomputation and pipeline parallelism; `--offload-modules` moves submodule
      inputs. Neither stores ckplan's `offload` (every tape on host but the last stage's).
    - deepspeed: `full+offload`. `activation_checkpointing.cpu_checkpointing` moves the inputs
      of the checkpointed layers to host (deepspeedai/DeepSpeed,
      deepspeed/runtime/activation_checkpointing/checkpointing.py, v0.19.8: asynchronous on a
      side stream); the layers' stored tapes stay.
    - torchtitan, hf: `offload`, `selective+offload`, `full+offload` through
      `torch.autograd.graph.save_on_cpu` around the layers (ckplan's torch snippet export; the
      same hooks as torchtune's `enable_activation_offloading`).
    """
    if framework == "megatron":
        return ()
    if framework == "deepspeed":
        return ("full+offload",)
    return ("offload", "selective+offload", "full+offload")


def joint_offload(framework: str) -> bool:
    """Whether `ckplan plan` tries the joint keep/offload/recompute DP (`offload+optimal`) for
    `framework`: torchtitan and hf, whose layers take `save_on_cpu` or a checkpoint one by one
    (ckplan's torch snippet); Megatron-Core offloads at most num_layers - 1 layers
    without recomputation, DeepSpeed the inputs of every checkpointed layer, neither a
    mix."""
    return framework in ("torchtitan", "hf")


def training_defaults(framework: str, zero: int = 0, optimizer: str = "adamw") -> dict[str, int]:
    """The framework's bytes per parameter, as the TrainingState keys; DeepSpeed's ZeRO-3
    accumulates its gradient partition in fp32; optimizer_bytes the optimizer's own
    (`optimizers.per_parameter_bytes`, Adam's 8 for adamw or an unknown name, which the
    TrainingState record refuses)."""
    defaults = dict(zip(TRAINING_KEYS, RULES[framework].bytes_per_parameter, strict=True))
    if framework == "deepspeed" and zero == 3:
        defaults["grad_bytes"] = 4
    if optimizer in optimizers.OPTIMIZERS:
        defaults["optimizer_bytes"] = optimizers.per_parameter_bytes(
            optimizer, defaults["optimizer_bytes"]
        )
    return defaults


@dataclass(frozen=True)
class GradientSync:
    """When a framework moves the gradients and weights over its data-parallel ranks in a step
    of several micro-batches (`gradient_sync`). Weights gathered for no micro-batch are
    gathered once per step (ZeRO 1-2's updated weights, or a stage that stays unsharded)."""

    each_micro_batch: bool  # every micro-batch's gradients reduced (else once, after the last)
    gather_forward: bool = False  # the weights all-gathered for every micro-batch's forward
    gather_backward: bool = False  # and again for its backward


def gradient_sync(framework: str, zero: int, pp: int, grad_sync: str | None = None) -> GradientSync:
    """What `framework` does with the gradients under gradient accumulation at ZeRO `zero` and
    pipeline size `pp`: reduce (all-reduce under ZeRO 0, else reduce-scatter) every
    micro-batch's gradients into the accumulated (shard of the) gradient, or accumulate them
    unsharded and reduce once after the last micro-batch's backward; and whether it gathers
    the weights per micro-batch.

    - megatron, Megatron-LM core_v0.19.0. ZeRO 0-1 (DDP, distributed optimizer): the schedules
      run every micro-batch but the last under `no_sync` (megatron/core/pipeline_parallel/
      schedules.py:787-788, `forward_backward_no_pipelining`; the pipelined schedules'
      `disable_grad_sync`), which sets the bucket groups' is_last_microbatch False
      (megatron/core/distributed/distributed_data_parallel.py:504-514): the fp32 main
      gradients accumulate in the full buffer and are reduced once. ZeRO 2-3 (Megatron-FSDP
      optim_grads, optim_grads_params): "With gradient-sharding strategies, gradient reduction
      occurs on every backward propagation" (megatron/core/distributed/fsdp/src/megatron_fsdp/
      megatron_fsdp.py:755-772, `grad_reduce_every_bprop`; its `no_sync`, :1150-1161, "For
      grads shard mode there will actually always be gradient sync happening"); optim_grads
      keeps the model weights unsharded (param_and_grad_buffer.py:2331-2334,
      is_model_weight_buffer_distributed False) and gathers the updated ones once;
      optim_grads_params gathers them before each module's forward and backward. The same at
      core_r0.8.0 for ZeRO 0-1: `forward_backward_no_pipelining` runs all but the last
      micro-batch under no_sync (megatron/core/pipeline_parallel/schedules.py:437) and
      ParamAndGradBuffer.register_grad_ready readies a bucket only when is_last_microbatch
      (megatron/core/distributed/param_and_grad_buffer.py:537-549).
    - deepspeed, v0.19.8. ZeRO 0-1 communicate "only at gradient accumulation boundaries"
      (deepspeed/runtime/engine.py:3088-3095, `allreduce_gradients`; stage_1_and_2.py:2293-2294
      reduces a ZeRO-1 bucket only at the boundary), the bf16 gradients accumulated whole in
      between; ZeRO 2 "communicates during non gradient accumulation boundaries as well"
      (engine.py:3084-3086): each micro-batch's buckets are reduced to the ranks owning their
      partitions (stage_1_and_2.py `average_tensor`) and added to the partition
      (`independent_gradient_partition_epilogue`, :1016-1055); ZeRO 3 reduces every backward
      (stage3.py:2160-2164) into grad_partitions_flat_buffer (:2006-2043) and gathers the
      parameters for each forward and backward.
    - torchtitan 0.3.0: its train_step runs the micro-batches with gradient sync on
      (torchtitan/trainer.py:885-935: no `set_requires_gradient_sync`), so FSDP2 reduces every
      backward (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:216 reduce_grads
      True, `post_backward` :588-640) and adds the result to the sharded gradient
      (_fsdp_collectives.py:710, :744, PyTorch v2.13.0), zero 0 (FSDP2 over dp_replicate) an
      all-reduce every micro-batch; FSDP2 reshards after backward by default
      (_fsdp_param_group.py:223), so zero 2 (reshard_after_forward False) gathers for each
      forward, zero 3 for each forward and backward. Under pipeline parallelism the stage
      runs every backward but the last without gradient sync nor resharding
      (torch/distributed/pipelining/stage.py:844-848) and reduces once after the last
      (`perform_reduce_grad`, :1164-1177); torchtitan does not reshard after forward there
      (torchtitan/distributed/fsdp.py `get_fsdp_reshard_after_forward_policy`), so the stage
      is gathered once (the runtime schedules' UNSHARD/RESHARD actions, schedules.py
      `_add_unshard_reshard`, may gather a virtual stage again: not counted).
    - hf, transformers 5.25.0 with accelerate 1.16.0: the Trainer runs every micro-batch but the
      last under `accelerator.no_sync` unless DeepSpeed runs it (transformers/trainer.py:
      1941-1953), which is FSDP's no_sync (fsdp_version 1 by default, accelerate/utils/
      dataclasses.py) or FSDP2's set_requires_gradient_sync(False) (accelerate/
      accelerator.py:1126-1131): the unsharded gradients accumulate and are reduced once
      (torch/distributed/fsdp/_runtime_utils.py:1192-1197, "`.grad` remains the unsharded
      gradient from prior `no_sync()` iterations"). Under no_sync FSDP frees the unsharded
      parameters after backward only for strategies that reshard after forward
      (_runtime_utils.py:811-826): SHARD_GRAD_OP (zero 2) keeps them and gathers once,
      FULL_SHARD (zero 3) gathers for each forward and backward. Other loops over PyTorch
      FSDP sync every micro-batch (`grad_sync: micro_batch`, as torchtitan at pp 1): Composer
      (mosaicml/composer v0.16.4, composer/trainer/trainer.py:2377-2378, no sync context
      unless the model is DDP; composer/trainer/dist_strategy.py:71-73) and torchtune
      (recipes/full_finetune_distributed.py:818-821, v0.6.1: backward every micro-batch,
      no no_sync); FSDP then reshards after each backward.

    `grad_sync` (hf only, `grad_sync_error`): micro_batch or step, None the framework's.
    """
    if framework == "torchtitan":
        if pp > 1:
            return GradientSync(each_micro_batch=False)
        return GradientSync(
            each_micro_batch=True, gather_forward=zero >= 2, gather_backward=zero == 3
        )
    full = zero == 3
    if framework == "hf" and grad_sync == "micro_batch":
        return GradientSync(each_micro_batch=True, gather_forward=zero >= 2, gather_backward=full)
    if framework == "hf":
        return GradientSync(each_micro_batch=False, gather_forward=full, gather_backward=full)
    return GradientSync(each_micro_batch=zero >= 2, gather_forward=full, gather_backward=full)


def gradients_sharded(
    framework: str, zero: int, microbatches: int, grad_sync: str | None = None
) -> bool:
    """Whether the gradients a GPU holds through the step are its 1/d shard (ZeRO 2-3): one
    micro-batch (the backward reduce-scatters and frees each layer's gradients), or a framework
    that reduce-scatters every micro-batch's (`gradient_sync`; ZeRO 2-3 run beside pipeline
    parallelism in torchtitan only). Otherwise the accumulated gradients are unsharded until
    the last micro-batch: the full gradient (hf's FSDP under no_sync). torchtitan's pipelined
    stage, which accumulates unsharded fp32 gradients too, holds them in `buffer_bytes` beside
    its shard."""
    if zero < 2:
        return False
    return microbatches == 1 or gradient_sync(framework, zero, 1, grad_sync).each_micro_batch


def grad_sync_error(framework: str, grad_sync: str | None) -> str | None:
    """Why `grad_sync` cannot be set for `framework` (one line naming the key), or None: the
    loops over PyTorch FSDP/DDP that `hf` stands for differ (`gradient_sync`), the other
    frameworks run one way each."""
    if grad_sync is None or framework == "hf":
        return None
    return (
        f"key 'grad_sync' ({grad_sync}): {framework} reduces the gradients its own way "
        "(docs/memory.md); the key is for framework hf"
    )


def backward_prefetch_error(framework: str, prefetch: str | None) -> str | None:
    """Why `fsdp_backward_prefetch` cannot be set for `framework` (one line naming the key), or
    None: it is FSDP1's BackwardPrefetch, which ckplan models under hf."""
    if prefetch is None or framework == "hf":
        return None
    return (
        f"key 'fsdp_backward_prefetch' ({prefetch}): FSDP1's backward prefetch under the "
        f"Hugging Face Trainer; the key is for framework hf, not {framework}"
    )


def optimizer_implementation(spec) -> str:
    """How the spec's AdamW steps: its `optimizer_implementation`, else the framework's default.

    - hf: the Trainer's default `optim`, "adamw_torch" through the releases of
      `FOREACH_DEFAULT_RELEASES` (transformers v4.44.2 training_args.py), torch.optim.AdamW
      without `fused` or `foreach`, which PyTorch runs foreach on CUDA (torch/optim/optimizer.py
      `_default_to_fused_or_foreach` at v2.13.0: fused only when asked); "adamw_torch_fused"
      under v5.25.0 with torch >= 2.8 (`default_optim`, `fused=True` in trainer_optimizer.py).
    - deepspeed: at a transformers release (`framework_version` 4.44 or 5.25) the Trainer's
      optimizer as hf's: with no "optimizer" in the DeepSpeed config the Trainer builds its
      own (`trainer.create_optimizer()`, transformers v5.25.0 integrations/deepspeed.py
      `deepspeed_optim_sched`) and DeepSpeed steps it as the client optimizer; `fused` at
      0.5.4, DeepSpeed's own runs, whose config names "Adam" or "AdamW": FusedAdam
      (deepspeed/runtime/engine.py `_configure_basic_optimizer`, v0.19.8), in place.
    - torchtitan: `[optimizer] implementation = "fused"`, its default (torchtitan
      components/optimizer/optimizer.py at v0.3.0).
    - megatron: Transformer Engine's or Apex's FusedAdam, in place as the fused path.

    Optimizers other than adamw and adamw-bf16 run their own kernels: `fused` names them."""
    if spec.optimizer_implementation is not None:
        return spec.optimizer_implementation
    foreach_default = (
        spec.framework in ("hf", "deepspeed")
        and framework_version(spec) in FOREACH_DEFAULT_RELEASES
        and spec.optimizer == "adamw"
    )
    return "foreach" if foreach_default else "fused"


def optimizer_implementation_error(spec) -> str | None:
    """Why `optimizer_implementation` cannot be set (one line naming the key), or None: it picks
    torch.optim.AdamW's code path (optimizer adamw, or adamw-bf16 on bf16 parameters), which
    the Hugging Face Trainer (`optim` adamw_torch or adamw_torch_fused, also as DeepSpeed's
    client optimizer) and torchtitan (`[optimizer] implementation`) let a run choose;
    Megatron-LM steps with its own fused Adam."""
    chosen = spec.optimizer_implementation
    if chosen is None:
        return None
    if spec.framework == "megatron":
        return (
            f"key 'optimizer_implementation' ({chosen}): torch.optim.AdamW's code path under "
            "framework hf, deepspeed or torchtitan; megatron steps with its own fused Adam"
        )
    if spec.optimizer not in ("adamw", "adamw-bf16"):
        return (
            f"key 'optimizer_implementation' ({chosen}): torch.optim.AdamW's code path, for "
            f"optimizer adamw or adamw-bf16, not {spec.optimizer}"
        )
    return None


def fsdp_reduce_dtype_error(framework: str, precision: str, reduce_dtype: str | None) -> str | None:
    """Why `fsdp_reduce_dtype` cannot be set (one line naming the key), or None: it is the
    reduce_dtype of the MixedPrecision accelerate hands FSDP (framework hf), fp32 or the
    precision's half dtype; without mixed precision (precision fp32) fp32 alone."""
    if reduce_dtype is None:
        return None
    if framework != "hf":
        return (
            f"key 'fsdp_reduce_dtype' ({reduce_dtype}): the dtype FSDP reduces the gradients in "
            f"under the Hugging Face Trainer or accelerate; the key is for framework hf, not "
            f"{framework}"
        )
    allowed = ("fp32", *(() if precision not in _HALF_DTYPES else (_HALF_DTYPES[precision],)))
    if reduce_dtype not in allowed:
        return (
            f"key 'fsdp_reduce_dtype' must be {' or '.join(allowed)} under precision "
            f"{precision}, got {reduce_dtype!r}"
        )
    return None


def fsdp_reduce_bytes(precision: str, dtype_bytes: int, reduce_dtype: str | None) -> int:
    """Bytes per value of the gradients FSDP reduce-scatters under hf: `reduce_dtype` where set,
    else the mixed precision's half dtype, as accelerate sets it: under `--bf16`/`--fp16`
    (mixed_precision bf16 or fp16) accelerate/state.py hands the FSDP plugin the precision
    (`fsdp_plugin.set_mixed_precision(self._mixed_precision)`), whose policy is
    `MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)` (accelerate
    v0.33.0 and v1.14.0, utils/dataclasses.py `FullyShardedDataParallelPlugin.
    set_mixed_precision`); without mixed precision (precision fp32) no policy, fp32."""
    if reduce_dtype is not None:
        return FSDP_REDUCE_DTYPES[reduce_dtype]
    return dtype_bytes if precision in _HALF_DTYPES else 4


def fsdp_version(spec) -> int:
    """The PyTorch FSDP a spec shards with: 2 under torchtitan (`fully_shard`); under hf its
    `fsdp_version`, else its transformers release's Trainer default (`FSDP2_DEFAULT_RELEASES`:
    v5.25.0 training_args.py `fsdp_config.get("version", 2)`, where FSDP1 is deprecated;
    v4.44.2 builds FSDP1); 1 elsewhere (no PyTorch FSDP: the value names nothing)."""
    if spec.framework == "torchtitan":
        return 2
    if spec.framework != "hf":
        return 1
    if spec.fsdp_version is not None:
        return spec.fsdp_version
    return 2 if framework_version(spec) in FSDP2_DEFAULT_RELEASES else 1


def runs_fsdp2(spec) -> bool:
    """Whether the spec's sharded data parallelism is FSDP2 (`fully_shard`): torchtitan's, or
    accelerate's under hf at `fsdp_version` 2 (accelerate v1.14.0 utils/fsdp_utils.py
    `fsdp2_prepare_model`)."""
    return spec.framework in ("torchtitan", "hf") and fsdp_version(spec) == 2


def fsdp_version_error(spec) -> str | None:
    """Why `fsdp_version` cannot be set (one line naming the key), or None: it picks the
    PyTorch FSDP the Hugging Face Trainer builds (framework hf); FSDP1's backward prefetch
    (`fsdp_backward_prefetch`) has no FSDP2 counterpart, which always prefetches the next unit
    in backward."""
    if spec.fsdp_version is not None and spec.framework != "hf":
        return (
            f"key 'fsdp_version' ({spec.fsdp_version}): the PyTorch FSDP the Hugging Face Trainer "
            f"builds; the key is for framework hf, not {spec.framework}"
        )
    prefetch = spec.fsdp_backward_prefetch
    if spec.framework == "hf" and prefetch is not None and fsdp_version(spec) == 2:
        return (
            f"key 'fsdp_backward_prefetch' ({prefetch}) is FSDP1's; FSDP2 "
            "prefetches the next unit in backward itself: set fsdp_version: 1 or leave the key out"
        )
    return None


def fsdp2_reduce_bytes(spec) -> int:
    """Bytes per value of FSDP2's reduce-scatter input, its MixedPrecisionPolicy's reduce_dtype:
    torchtitan's fp32 (`mixed_precision_reduce` "float32", its default), accelerate's the half
    dtype unless `fsdp_reduce_dtype` says fp32 (`fsdp_reduce_bytes`: accelerate v1.14.0
    utils/dataclasses.py `set_mixed_precision` builds `MixedPrecisionPolicy(param_dtype=dtype,
    reduce_dtype=dtype, output_dtype=dtype)` under fsdp_version 2). FSDP2 allocates the input in
    reduce_dtype and copies the unsharded gradients into it (torch/distributed/fsdp/
    _fully_shard/_fsdp_collectives.py `foreach_reduce`, PyTorch v2.13.0)."""
    if spec.framework == "hf":
        return fsdp_reduce_bytes(spec.precision, spec.dtype_bytes, spec.fsdp_reduce_dtype)
    return 4


def fsdp1_cast_reduce(spec) -> bool:
    """Whether FSDP1 casts each unit's unsharded gradient to another dtype before its
    reduce-scatter: the gradient is computed in param_dtype (the half dtype under mixed
    precision) and `_post_backward_hook` makes `flat_param.grad.to(handle._reduce_dtype)`
    while the computed one stays alive on the post-backward stream
    (torch/distributed/fsdp/_runtime_utils.py, PyTorch v2.13.0): under hf with
    `fsdp_reduce_dtype: fp32` beside bf16 or fp16 weights in compute."""
    return (
        spec.framework == "hf"
        and fsdp_version(spec) == 1
        and spec.fsdp_reduce_dtype == "fp32"
        and spec.precision in _HALF_DTYPES
    )


def weights_sharded_from(spec) -> int:
    """The lowest ZeRO stage at which the spec's framework shards the weights it keeps
    (`weight_bytes`) over the data-parallel ranks: 3 (ZeRO-3, Rajbhandari et al. 2020 §5), but
    2 under PyTorch FSDP (torchtitan, hf), whose zero 2 keeps the parameters sharded too. FSDP2's
    is reshard_after_forward=False: `fully_shard` shards every parameter whatever that flag,
    which keeps only the unsharded copy in param_dtype alive from forward to backward
    (torch/distributed/fsdp/_fully_shard/_fully_shard.py, `reshard_after_forward` "If False,
    then this keeps the unsharded parameters in memory after forward"; _fsdp_param.py: the
    sharded fp32 data `_sharded_param_data`, the unsharded parameter in `param_dtype`, PyTorch
    v2.13.0); FSDP1's is SHARD_GRAD_OP, whose "parameters are sharded outside computation": it
    "does not reshard them after the forward, and only reshards them after the backward"
    (torch/distributed/fsdp/api.py `ShardingStrategy`). That unsharded copy is
    `buffer_bytes`'."""
    return 2 if spec.framework in ("torchtitan", "hf") else 3


def layout_error(framework: str, zero: int, tp: int, pp: int, cp: int, ep: int) -> str | None:
    """Why `framework` cannot run this layout (one line naming the key), or None."""
    rules = RULES[framework]
    if zero not in rules.zero_stages:
        stages = ", ".join(map(str, rules.zero_stages))
        return f"key 'zero' ({zero}): {framework} runs ZeRO {stages}" + _zero_hint(framework)
    if pp > 1 and zero > rules.max_zero_with_pipeline:
        return (
            f"key 'zero' ({zero}): {framework} shards at most ZeRO "
            f"{rules.max_zero_with_pipeline} beside pipeline parallelism (pp {pp})"
        )
    if not rules.model_parallel:
        for key, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
            if value > 1:
                return (
                    f"key {key!r} ({value}): {framework} runs data parallelism only; use "
                    "framework: torchtitan or megatron for model parallelism"
                )
    return None


def _zero_hint(framework: str) -> str:
    return {
        "torchtitan": " (FSDP2 shards the weights or nothing; use zero 3, 2 or 0)",
        "hf": " (DDP, or FSDP through accelerate: use zero 0, 2 or 3)",
    }.get(framework, "")


def largest_weight(spec, tp: int | None = None) -> int:
    """The largest weight matrix of a layer on one GPU, which a gather cannot split; `tp` a
    layout's, default the spec's."""
    widths = [spec.ffn_hidden, (spec.heads + 2 * spec.kv_heads) * spec.head_dim]
    if spec.experts:
        widths.append(spec.moe_ffn_hidden)
    return spec.hidden * max(widths) // (spec.tp if tp is None else tp)


def te_fp8_weight_copy_bytes(fp8_param_gather: bool) -> int:
    """Bytes per weight of an FP8 linear layer that Transformer Engine keeps beside the
    parameter all step under `precision` fp8 (on a GPU without FP8 GEMMs in non-TN layouts,
    Hopper: `is_non_tn_fp8_gemm_supported` false).

    - BF16 weights: the module's cached FP8 workspace (module/base.py `get_weight_workspace`,
      `_fp8_workspaces["weight"]`, NVIDIA/TransformerEngine v2.9), row-wise data and its
      transpose for the backward's GEMMs, one byte each: 2, refreshed on the first micro-batch
      of each step (`is_first_microbatch`) and kept between steps.
    - FP8 primary weights (`fp8_param_gather`; Transformer Engine's fp8_model_init): the
      parameter is the row-wise FP8 data, so `get_weight_workspace` returns it as it is and
      caches nothing ("Handle case where weights are already quantized"); `update_usage`
      (tensor/storage/float8_tensor_storage.py, v2.9) creates its transpose, `_transpose`,
      for the backward, one byte: 1. `_reset_caches` after each master-weight cast marks it
      stale and the next forward rewrites it (tensor/utils.py `cast_master_weights_to_fp8`).
    Block scaling (`fp8_recipe` blockwise) keeps the same copies: the workspace's row-wise and
    column-wise data (`Float8BlockQuantizer.make_empty`, tensor/float8_blockwise_tensor.py,
    v2.9), or the FP8 parameter's row-wise data and the column-wise copy the forward's
    `update_usage` makes from it (storage/float8_blockwise_tensor_storage.py: "For 2D
    scaling, if columnwise data/scale_inv is None, we can create them from rowwise"), which
    the master-weight cast drops again (`update_usage(rowwise_usage=True,
    columnwise_usage=False)`). The per-tensor fp32 scale_inv and amax (a few bytes a tensor)
    are not counted; block scaling's fp32 scales, one per 128x128 block of each matrix in
    each copy, are counted beside these bytes (`memory.fp8_weight_block_scale_bytes`)."""
    return 1 if fp8_param_gather else 2


def fp8_primary_weight_bytes(fp8_param_gather: bool, weight_bytes: int) -> int:
    """Bytes per weight of an FP8 linear layer as the model keeps it: `weight_bytes` (BF16),
    or with FP8 primary weights (Megatron-LM --fp8-param-gather) one byte: a Float8Tensor's
    `_data` is uint8, and Megatron-Core allocates the distributed optimizer's parameter
    buffer of these weights in torch.uint8 and points the tensor's data into it
    (megatron/core/distributed/distributed_data_parallel.py, "it is necessary to use
    torch.uint8, not the 'fake' dtype"; param_and_grad_buffer.py `modify_underlying_storage`,
    core_v0.14.0), so that buffer is the weights themselves. The layers' biases and norms, the
    embedding, the output layer and the router stay in `weight_bytes` (Transformer Engine
    quantizes the linear weights only; distrib_optimizer.py: "weights(in fp8 dtype) and
    biases(in bf16/fp16)")."""
    return 1 if fp8_param_gather else weight_bytes


def fp8_master_cast_bytes(fp8_recipe: str | None) -> int:
    """Bytes the optimizer step moves per FP8 primary weight of its shard to cast the fp32
    master weight into it (Megatron-Core core_v0.14.0 distrib_optimizer.py
    `_copy_main_params_to_model_params` -> fp8_utils.py `quantize_param_shard` ->
    Transformer Engine v2.9 transformer_engine/pytorch/tensor/utils.py
    `cast_master_weights_to_fp8`): the master weight is first cast to the BF16 dtype "to keep
    numerical consistency" (`master_weight.to(model_weight.dtype)`: read 4, write 2), then
    quantized into the FP8 shard (`update_quantized`: read 2, write 1), the amax found in the
    same kernel under delayed scaling (`_cast_master_weights_to_fp8_delayed_scaling`): 9;
    current scaling reads the BF16 copy once more for its amax first (`tex.compute_amax`,
    `_cast_master_weights_to_fp8_current_scaling`): 11. Block scaling casts from the fp32
    master weight itself, no BF16 copy: `tex.fp8_block_scaling_compute_partial_amax` reads it
    for each 128x128 block's amax, `tex.fp8_block_scaling_partial_cast` reads it again and
    writes the FP8 shard (`_cast_master_weights_to_fp8_blockwise_scaling`): 4 + 4 + 1 = 9.
    In place of the BF16 weight's write (`weight_bytes`) that
    `optimizers.step_bytes_per_parameter` counts."""
    if fp8_recipe == "blockwise":
        return 4 + 4 + 1
    amax_read = 2 if fp8_recipe == "current" else 0
    return 4 + 2 + amax_read + 2 + 1


# one fp32 amax per FP8 weight tensor (block scaling: per 128x128 block), packed into one
# all-reduce
FP8_AMAX_BYTES = 4


def step_buffer_bytes(spec, trainable_params: int) -> int:
    """Of `buffer_bytes`, what is still allocated at the optimizer step, after the backward,
    on a GPU that trains `trainable_params`: under hf DDP's reducer buckets (4 B per
    trainable parameter over several ranks at zero 0), which the reducer keeps from step to
    step (torch/nn/parallel/distributed.py, `_Reducer` built once in `__init__`, PyTorch
    v2.13.0). autocast's bf16 weight copies are released with the backward that saved them,
    and PyTorch FSDP reshards every unit in its post-backward, so the unsharded copies and
    gradients of either FSDP are freed by then (derived); torchtitan holds none at zero 0-3.
    DeepSpeed's ZeRO-3 keeps its IPG bucket, allocated whole at init
    (`deepspeed_zero3_reduce_bytes`); the gathered parameters are released by the backward's
    end. ZeRO 1-2's buckets are not counted here."""
    if spec.framework == "hf" and spec.dp > 1 and spec.zero == 0:
        return 4 * trainable_params
    if spec.framework == "deepspeed" and spec.dp > 1 and spec.zero == 3:
        return HALF * DEEPSPEED_REDUCE_BUCKET
    return 0


def buffer_bytes(
    spec,
    stage_params: int,
    layer_params: int,
    root_params: int,
    embedding_params: int = 0,
    gathered: tuple[int, int] | None = None,
    float8: tuple[int, int] = (0, 0),
) -> int:
    """Bytes a framework holds beside the model states at its peak on one GPU: its
    communication buckets and unsharded copies (module docstring). `stage_params` are the
    parameters this GPU's pipeline stage holds, `layer_params` one layer's (the largest),
    `root_params` those outside the layers (embedding, final norm, output) on this stage,
    `embedding_params` the token embedding's among them. `gathered`: (one layer's, its
    largest weight's) bytes as ZeRO-3 gathers them where frozen weights beside the trainable
    ones are gathered too (ckplan.model.finetune `gathered_layer_bytes`); None: the
    trainable parameters' in bf16. `float8`: (the stage's, one layer's) weights torchtitan's
    FSDP2 gathers in float8 (`fsdp2_gathered_bytes`)."""
    framework, zero, dp = spec.framework, spec.zero, spec.dp
    if fsdp2_resharding(spec):  # the layers' copies are their chain stages' (fsdp2_layer_*)
        grouping = spec_fsdp2_grouping(spec)
        kept = fsdp2_outer_units(root_params, embedding_params, grouping)[1]
        return fsdp2_kept_unsharded_bytes(
            kept, layer_params, grouping.last_block_kept, layer_float8=float8[1]
        )
    # torchtitan's FSDP mesh is dp_shard·cp (context-parallel ranks hold the same parameters)
    if runs_fsdp2(spec) and dp * spec.cp > 1 and zero >= 2:
        stage_float8, layer_float8 = float8
        if zero == 2 or spec.pp > 1:  # no reshard after forward
            unsharded = fsdp2_gathered_bytes(stage_params, stage_float8)
        else:  # the running layer, the prefetched one, and the root module
            unsharded = 2 * fsdp2_gathered_bytes(layer_params, layer_float8) + HALF * root_params
        if spec.pp > 1:  # fp32 unsharded gradients of the stage, the running layer's in bf16
            return unsharded + 4 * stage_params + HALF * layer_params
        # bf16 gradients, the reduce-scatter input in reduce_dtype (torchtitan's fp32)
        reducing = (HALF + fsdp2_reduce_bytes(spec)) * layer_params
        return unsharded + reducing
    if framework == "deepspeed" and dp > 1 and zero >= 1:
        reduce = min(DEEPSPEED_REDUCE_BUCKET, stage_params) * HALF
        if zero == 3:  # the reduce buffers; the prefetch bucket; the live parameters
            prefetch = min(DEEPSPEED_PREFETCH_BUCKET, stage_params) * HALF
            layer, largest = gathered or (HALF * layer_params, HALF * largest_weight(spec))
            live = deepspeed_zero3_live_bytes(layer, largest)
            return deepspeed_zero3_reduce_bytes(stage_params) + prefetch + live
        gather = min(DEEPSPEED_ALLGATHER_BUCKET, stage_params) * HALF
        return reduce + gather
    if fsdp1_resharding(spec):  # the layers' copies are their chain stages' (fsdp1_layer_*)
        return fsdp1_kept_unsharded_bytes(root_params)
    if framework == "hf" and zero == 2 and dp > 1:
        # FSDP1's SHARD_GRAD_OP: the stage's unsharded flat parameters in param_dtype (bf16 under
        # mixed precision, the weights' own under pure bf16) from forward to backward; autocast
        # sees them and caches none (`weights_sharded_from`)
        return HALF * stage_params
    if framework == "hf":
        buckets = 4 * stage_params if dp > 1 and zero == 0 else 0  # DDP's reducer buckets
        # autocast caches the bf16 cast of an fp32 leaf weight only (PyTorch
        # aten/src/ATen/autocast_mode.cpp `cached_cast`: `arg.scalar_type() == at::kFloat &&
        # arg.requires_grad() && arg.is_leaf()`): weights already in bf16 are used as they are,
        # and precision fp32 runs no autocast (the Trainer enables it for --bf16/--fp16 only)
        fp32_weights = spec.weight_bytes == 4 and spec.precision != "fp32"
        autocast = HALF * (stage_params if zero < 3 else 2 * layer_params) if fp32_weights else 0
        return buckets + autocast
    return 0


def deepspeed_zero3_reduce_bytes(
    trainable_params: int, bucket: int = DEEPSPEED_REDUCE_BUCKET
) -> int:
    """ZeRO-3's gradient-reduction buffers on one GPU for `trainable_params` parameters that
    train (the optimizer's): the IPG bucket, which DeepSpeedZeroOptimizer_Stage3 allocates
    whole at init, `bucket` (reduce_bucket_size) elements in the bf16 dtype, whatever the
    parameters number (contiguous_gradients True by default: `torch.empty(
    self.reduce_bucket_size, ...)`, deepspeed/runtime/zero/stage3.py at v0.14.0 lines 489-492,
    v0.16.4 lines 537-540), and the flat padded copy of one bucket's gradients that
    reduce_scatter_coalesced makes on the reduce stream (deepspeed/runtime/comm/
    coalesced_collectives.py at v0.14.0, `torch.cat(tensor_partitions_lst_with_padding)`),
    at most min(bucket, trainable_params) elements. With few trainable parameters (LoRA) the
    first stays a whole bucket: 1e9 bytes at the default 5e8 elements."""
    return HALF * bucket + HALF * min(bucket, trainable_params)


def reduce_bytes_per_parameter(
    framework: str,
    zero: int,
    grad_bytes: int,
    dtype_bytes: int,
    precision: str = "bf16",
    fsdp_reduce_dtype: str | None = None,
) -> int:
    """Bytes per parameter the data-parallel gradient reduction moves. DeepSpeed's ZeRO-3
    reduce-scatters each gradient in its half-precision dtype and only then adds the
    partition to its fp32 accumulation buffer (`grad_bytes` 4): at v0.3.16 and v0.5.4,
    deepspeed/runtime/zero/partition_parameters.py `_reduce_scatter_gradient` reduce-scatters
    `param.grad` in `param.dtype`; at v0.19.8, stage3.py `__avg_scatter_grads` reduces in
    `communication_data_type`, which engine.py `communication_data_type` sets to fp16 or bf16
    as the precision is, unless configured. FSDP under hf (zero 2 and 3) reduces in its
    policy's reduce_dtype (`fsdp_reduce_bytes`: the half dtype unless `fsdp_reduce_dtype`
    says fp32). Every other framework reduces its gradients in the dtype it keeps them in."""
    if framework == "deepspeed" and zero == 3:
        return dtype_bytes
    if framework == "hf" and zero >= 2:
        return fsdp_reduce_bytes(precision, dtype_bytes, fsdp_reduce_dtype)
    return grad_bytes


def spec_reduce_bytes(spec, zero: int | None = None) -> int:
    """`reduce_bytes_per_parameter` of a spec, at `zero` where given (a layout's), else its own."""
    return reduce_bytes_per_parameter(
        spec.framework,
        spec.zero if zero is None else zero,
        spec.grad_bytes,
        spec.dtype_bytes,
        spec.precision,
        spec.fsdp_reduce_dtype,
    )


def deepspeed_zero3_regathered(
    module_weights: tuple[int, ...], max_reuse: int = DEEPSPEED_MAX_REUSE
) -> int:
    """Elements ZeRO-3 gathers again for the backward of a layer whose forward it has just
    re-run (activation checkpointing), `module_weights` the layer's sub-modules' weights in
    forward order, as its hooks fetch them.

    The re-run forward fetches every sub-module's weights (its forward pre-hooks fire again)
    and, after each sub-module, releases them unless the trace uses them again before
    `max_reuse` elements of other sub-modules have been fetched (stage3_max_reuse_distance:
    deepspeed/runtime/zero/stage3.py at v0.3.16 and v0.5.4, `_keep_for_later`,
    "reuse_distance_in_numel < self.max_reuse_distance_in_numel";
    partitioned_param_coordinator.py at v0.19.8,
    `__params_to_release`). Between sub-module i's re-run forward and its backward come the
    re-run forwards of the sub-modules after it and then their backwards, so its weights stay
    iff 2·Σ_{j>i} module_weights[j] < max_reuse; the others are gathered again for the
    backward. GPT-3 175B (h 12288): the fc2 weight stays, QKV, out-proj and fc1 (8h², 1.2e9
    elements between fc1 and its backward) are gathered again.

    derived: the trace of one checkpointed layer, re-run forward then backward."""
    released = deepspeed_zero3_released(module_weights, max_reuse)
    return sum(weights for weights, again in zip(module_weights, released, strict=True) if again)


def deepspeed_zero3_released(
    module_weights: tuple[int, ...], max_reuse: int = DEEPSPEED_MAX_REUSE
) -> tuple[bool, ...]:
    """Which sub-modules of a layer whose forward was just re-run ZeRO-3 releases before their
    backward (`deepspeed_zero3_regathered`): 2·Σ_{j>i} module_weights[j] >= max_reuse."""
    return tuple(2 * sum(module_weights[i + 1 :]) >= max_reuse for i in range(len(module_weights)))


def deepspeed_list_collectives(spec) -> bool:
    """Whether `spec` runs DeepSpeed ZeRO-3's fetch and reduction path of 2021
    (`framework_version` 0.5.4): per weight, a zero-filled gather buffer and a device-wide
    synchronisation, and list collectives that PyTorch's ProcessGroupNCCL copies through a
    flat buffer (`deepspeed_zero3_gather_copy_bytes`, `deepspeed_zero3_reduce_call_bytes`).

    The fetch is the same code from ZeRO-3's first release, v0.3.12 (2021-03-12), to v0.5.4
    (2021-10-06): deepspeed/runtime/zero/partition_parameters.py `_allgather_param`,
    `_reduce_scatter_gradient` and stage3.py `fetch_sub_module`, `reduce_ipg_grads`,
    `average_tensor`, `reduce_independent_p_g_buckets_and_remove_grads` differ between them in
    log messages only. The gradients are reduce-scattered through the contiguous bucket as
    v0.5.4's defaults run them (constants.py: contiguous_gradients and reduce_scatter true);
    before v0.4.5 ZeRO-3 defaulted to contiguous_gradients false, which all-reduces each
    bucket instead (stage3.py `buffered_reduce_fallback`), not modelled."""
    return spec.framework == "deepspeed" and spec.framework_version == DEEPSPEED_2021


@dataclass(frozen=True)
class GatherCopies:
    """HBM bytes (read plus written) one rank moves around one ZeRO-3 weight gather beside the
    collective itself: `serial` before the sub-module's compute may start, `stream` on the
    communication streams, in the gather's time."""

    serial: int
    stream: int


def deepspeed_aligned_elements(elements: int, ranks: int) -> int:
    """A ZeRO-3 weight's elements padded to a multiple of the ranks
    (partition_parameters.py at v0.3.16 and v0.5.4, `_aligned_size`: ds_numel + `_padding_size`)."""
    return -(-elements // ranks) * ranks


def deepspeed_zero3_gather_copy_bytes(elements: int, ranks: int, dtype_bytes: int) -> GatherCopies:
    """What one rank copies to gather one weight of `elements` elements under DeepSpeed's
    ZeRO-3 of 2021 (deepspeed/runtime/zero/partition_parameters.py at v0.3.16 and v0.5.4,
    `_allgather_param`, the path of the coordinator's asynchronous fetch and prefetch):

    - `flat_tensor = torch.zeros(aligned_param_size)` fills the whole padded weight with zeros
      (written once), then `torch.cuda.synchronize()`; the coordinator (stage3.py,
      `fetch_sub_module` then `prefetch_next_sub_modules`, in the sub-module's pre-forward and
      pre-backward hooks) has synchronised the device just before, so nothing else runs while
      the zeros are written and the sub-module's kernels are launched only after: `serial`.
    - the rank's own partition is copied into its slice (read and written), then
      `torch.distributed.all_gather(partitions, ...)` with a list of `ranks` outputs:
      ProcessGroupNCCL gathers into a flat buffer of its own and copies it into the outputs one
      tensor per rank (torch/lib/c10d/ProcessGroupNCCL.cpp at 00f5dfd, `allgather`: "Copy the
      flattened output tensors to the outputs"), the whole padded weight read and written on
      the NCCL stream, which the next fetch's synchronisation waits for: `stream`."""
    aligned = deepspeed_aligned_elements(elements, ranks)
    partition = aligned // ranks
    return GatherCopies(
        serial=aligned * dtype_bytes, stream=(2 * partition + 2 * aligned) * dtype_bytes
    )


def deepspeed_zero3_reduce_triggers(
    gradients: tuple[int, ...], bucket: int = DEEPSPEED_REDUCE_BUCKET
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Which gradients each gradient's hook reduces under DeepSpeed's ZeRO-3 of 2021, and what
    is left for the end of the backward. `gradients`: elements each, in the order the
    backward's hooks deliver them; per gradient, the gradients its hook sends to a bucket
    reduction first (empty when none); then the gradients still held after the last hook.

    stage3.py at v0.3.16 and v0.5.4, `reduce_independent_p_g_buckets_and_remove_grads`: a
    gradient that would take the bucket past reduce_bucket_size (`bucket`) elements first
    reduces what the bucket holds (`reduce_ipg_grads`), and a gradient of more than `bucket`
    elements stays where it is but counts towards the bucket all the same;
    `independent_gradient_partition_epilogue` reduces the rest after the backward.

    derived: that rule run over `gradients`."""
    triggered: list[tuple[int, ...]] = []
    held: list[int] = []
    for elements in gradients:
        if held and sum(held) + elements > bucket:
            triggered.append(tuple(held))
            held = []
        else:
            triggered.append(())
        held.append(elements)
    return tuple(triggered), tuple(held)


def deepspeed_zero3_reduce_calls(
    gradients: tuple[int, ...], bucket: int = DEEPSPEED_REDUCE_BUCKET
) -> tuple[tuple[int, ...], ...]:
    """The gradients each bucket reduction of DeepSpeed's ZeRO-3 of 2021 takes, in order: those
    the hooks trigger, then the epilogue's (`deepspeed_zero3_reduce_triggers`)."""
    triggered, rest = deepspeed_zero3_reduce_triggers(gradients, bucket)
    return tuple(call for call in (*triggered, rest) if call)


def deepspeed_zero3_reduce_call_bytes(
    call: tuple[int, ...], ranks: int, dtype_bytes: int, bucket: int = DEEPSPEED_REDUCE_BUCKET
) -> GatherCopies:
    """What one rank copies around one bucket reduction of `call`'s gradients (elements each)
    under DeepSpeed's ZeRO-3 of 2021 with contiguous_gradients and overlap_comm (their
    defaults at v0.5.4), first micro-batch of a step (stage3.py and partition_parameters.py at
    v0.3.16 and v0.5.4), besides the reduce-scatters themselves:

    - `reduce_independent_p_g_buckets_and_remove_grads` copies each gradient of at most
      `bucket` elements into the contiguous reduction bucket (`new_grad_tensor.copy_`, read and
      written) from its hook, on the backward's stream: `serial`.
    - `reduce_ipg_grads` runs `average_tensor` on the reduction stream over
      `[self.ipg_buffer[self.ipg_index]]`, the whole bucket of `bucket` elements however much of
      it is filled (`backward` allocates it at reduce_bucket_size), plus the gradient above
      `bucket` it holds, if any: `tensor.div_` reads and writes each; `_reduce_scatter_gradient`
      reduce-scatters each gradient as a list of `ranks` slices, which ProcessGroupNCCL first
      copies into a flat buffer (torch/lib/c10d/ProcessGroupNCCL.cpp at 00f5dfd,
      `reduce_scatter`), the padded gradient read and written; `_partition_gradient` copies the
      rank's reduced partition into the gradient partition (`dest_tensor.copy_`): `stream`,
      which the reduce-scatters wait for. Later micro-batches add the partition instead
      (`add_`, a third partition's bytes), not counted here."""
    large = sum(elements for elements in call if elements > bucket)
    stream = 2 * (bucket + large) * dtype_bytes
    serial = 0
    for elements in call:
        aligned = deepspeed_aligned_elements(elements, ranks)
        stream += 2 * (aligned + aligned // ranks) * dtype_bytes
        if elements <= bucket:
            serial += 2 * elements * dtype_bytes
    return GatherCopies(serial=serial, stream=stream)


def deepspeed_zero3_reduce_copy_bytes(
    gradients: tuple[int, ...],
    ranks: int,
    dtype_bytes: int,
    bucket: int = DEEPSPEED_REDUCE_BUCKET,
) -> GatherCopies:
    """`deepspeed_zero3_reduce_call_bytes` over every bucket reduction of one backward's
    `gradients` (elements each, in hook order: `deepspeed_zero3_reduce_calls`)."""
    calls = [
        deepspeed_zero3_reduce_call_bytes(call, ranks, dtype_bytes, bucket)
        for call in deepspeed_zero3_reduce_calls(gradients, bucket)
    ]
    return GatherCopies(serial=sum(c.serial for c in calls), stream=sum(c.stream for c in calls))


def deepspeed_zero3_prefetch_windows(
    uses: tuple[tuple[float, float], ...],
    issued: tuple[float, ...] = (),
) -> tuple[tuple[float, float], ...]:
    """The compute each of ZeRO-3's all-gathers runs beside when no bucket of its prefetch
    holds more than one weight. `uses`: one layer's sub-module uses in trace order, repeated
    layer after layer, each (its compute seconds, its gather seconds, 0 when its weights are
    still gathered); for each gathered use, (its gather, the compute from the previous gathered
    use up to it, cyclically).

    The coordinator fetches a sub-module's weights, waits for them, and only then prefetches
    the next weights of the trace that are not gathered, while fewer than
    stage3_prefetch_bucket_size elements (5e7) are on their way: one weight when each holds
    more (deepspeed/runtime/zero/partitioned_param_coordinator.py at v0.19.8,
    `fetch_sub_module`: "kick off all gather for params in the next few submodules", `while
    self.__param_queue and numel_prefetching < max_params_to_prefetch`; at v0.3.16 and v0.5.4,
    stage3.py `prefetch_next_sub_modules`, "prefetch if there is no current prefetching in
    flight", and `fetch_sub_module`, which waits and synchronizes the device). So a weight's
    gather starts when the previous gathered sub-module starts and hides behind the compute
    until its own sub-module runs.

    `issued`: per use, the seconds of other collectives it issues on the same NCCL stream (the
    gradients' reduce-scatters of DeepSpeed's path of 2021), which the next fetch's device
    synchronisation waits for: they join the next gathered use's gather (at v0.3.16 and v0.5.4,
    stage3.py `_synchronize_communication`, `torch.cuda.synchronize()`; one process group, one
    NCCL stream: torch/lib/c10d/ProcessGroupNCCL.cpp at 00f5dfd, `ncclStreams_` per device).

    derived: the trace of one layer under that rule."""
    count = len(uses)
    gathered = [index for index, (_, gather) in enumerate(uses) if gather > 0]
    windows = []
    for position, index in enumerate(gathered):
        start = gathered[position - 1]  # the previous gathered use, cyclically
        window, work, step = 0.0, uses[index][1], start
        while True:
            window += uses[step][0]
            work += issued[step] if issued else 0.0
            step = (step + 1) % count
            if step == index:
                break
        windows.append((work, window))
    return tuple(windows)


def deepspeed_zero3_live_bytes(layer_bytes: int, largest_weight_bytes: int) -> int:
    """The parameters ZeRO-3 keeps gathered on one GPU: the running layer's and, prefetched,
    the next one's (`layer_bytes` each, as gathered), at most stage3_max_live_parameters (1e9
    bf16 elements: 2e9 bytes) unless a single weight (`largest_weight_bytes`) is larger.
    Frozen weights are gathered as any: the coordinator fetches every parameter of the module
    about to run whatever its requires_grad (deepspeed/runtime/zero/
    partitioned_param_coordinator.py `fetch_sub_module`, v0.14.0), and releases none that the
    trace uses again within stage3_max_reuse_distance (1e9 elements, `__params_to_release`):
    a layer's recomputation and backward keep it whole. A 4-bit weight is gathered as its
    packed storage (bf16 elements holding four values each under bnb_4bit_quant_storage
    bfloat16).

    derived: the running and the prefetched layer under the live-parameter cap."""
    return max(min(2 * layer_bytes, HALF * DEEPSPEED_MAX_LIVE), largest_weight_bytes)


def deepspeed_persistent_bytes(
    tensor_elements: tuple[int, ...], threshold: int = DEEPSPEED_PERSISTENCE
) -> int:
    """The whole bf16 copies ZeRO-3 keeps of its persistent parameters, those of at most
    `threshold` elements (stage3_param_persistence_threshold, default 1e5, with
    stage3_model_persistence_threshold unbounded): "the parameters are replicated throughout
    training and only partitioned before the step" (deepspeed/runtime/zero/
    partition_parameters.py at v0.14.0, `_convert_to_deepspeed_param`: ds_persist), and the
    coordinator never releases them (partitioned_param_coordinator.py `__params_to_release`:
    `if not p.ds_persist`). Their partitions are counted with the model states; this is the
    replicated copy beside them. `tensor_elements`: the elements of each parameter tensor."""
    return HALF * sum(elements for elements in tensor_elements if elements <= threshold)


def _reshards_unit_by_unit(spec, version: int, frozen: bool = False) -> bool:
    """Whether FSDP `version` (`fsdp_version`) runs this spec fully sharded, unit by unit:
    zero 3, one pipeline stage, more than one rank in the FSDP mesh dp·cp, full training (or,
    `frozen`, any). The layout both FSDP1 (`fsdp1_resharding`) and FSDP2 (`fsdp2_resharding`)
    reshard after forward."""
    return (
        spec.framework in ("torchtitan", "hf")
        and fsdp_version(spec) == version
        and spec.zero == 3
        and spec.pp == 1
        and spec.dp * spec.cp > 1
        and (frozen or spec.training == "full")
    )


def fsdp1_resharding(spec) -> bool:
    """Whether the spec runs PyTorch FSDP (FSDP1, FullyShardedDataParallel) with FULL_SHARD as
    the Hugging Face Trainer builds it through accelerate (hf, zero 3, more than one
    data-parallel rank, full training): each decoder layer an FSDP unit
    (`transformer_auto_wrap_policy`), the rest of the model (embedding, final norm, output
    layer) the root unit, bf16 mixed precision. Its layers' unsharded copies and gradients
    then live only while a layer runs, and ckplan holds them as the layers' chain workspaces
    (`fsdp1_layer_forward_bytes`, `fsdp1_layer_backward_bytes`) beside the root's copy kept
    from the forward to the end of the backward (`fsdp1_kept_unsharded_bytes`). The published
    runs ckplan reads as `hf` include torchtune's (FSDP2 since its 0.3) and Composer's (FSDP1
    with its own prefetch settings): at zero 3 over several ranks they are counted the
    Trainer's way. With frozen base weights (LoRA, QLoRA) too: the decoder layers and the root
    unit gather and reshard as in full training, with no gradient of their own
    (`fsdp1_frozen_layer_backward_bytes`)."""
    return spec.framework == "hf" and _reshards_unit_by_unit(spec, 1, frozen=True)


def fsdp1_kept_unsharded_bytes(root_params: int) -> int:
    """The bf16 unsharded parameters FSDP1 keeps from the forward to the end of the backward:
    the root unit's, every parameter outside the decoder layers (`root_params`: embedding,
    final norm, output layer). FSDP1 never frees the root's unsharded flat parameter after
    forward ("Do not free the root's parameters in the post-forward for `FULL_SHARD` with the
    intention that they are immediately used for backward computation",
    torch/distributed/fsdp/_runtime_utils.py `_post_forward_reshard`, PyTorch v2.13.0); it is
    freed at the root's post-backward, after the embedding's backward. Measured on the CPU
    (validation/torch_fsdp1_memory.py, a transformers LlamaForCausalLM under FSDP1 on 8 fake
    ranks): the root's 6,144,512-byte flat parameter (2 · 3,072,256) alive at the loss's and at
    every layer's backward peak."""
    return HALF * root_params


def fsdp1_layer_forward_bytes(layer_params: int) -> int:
    """What a decoder layer's forward (and its recomputation) holds of FSDP1's buffers: its
    bf16 unsharded flat parameter, freed at its post-forward. No other layer's: the Hugging
    Face Trainer leaves forward_prefetch off (transformers v4.43.0 training_args.py
    `fsdp_config.get("forward_prefetch", "false")`), and FSDP1's `limit_all_gathers` only
    throttles the CPU thread. derived from torch/distributed/fsdp/_runtime_utils.py
    (`_pre_forward_unshard`, `_post_forward_reshard`, PyTorch v2.13.0)."""
    return HALF * layer_params


def fsdp1_layer_backward_bytes(layer_params: int, output_params: int) -> int:
    """What a decoder layer's backward holds of FSDP1's buffers beyond the root's kept copy
    (`fsdp1_kept_unsharded_bytes`), under the Hugging Face Trainer's FSDP settings:

    - its bf16 unsharded parameters, gathered again at its pre-backward;
    - no prefetched layer: the Trainer's `backward_prefetch` defaults to "NO_PREFETCH"
      (transformers v4.43.0 training_args.py `fsdp_config.get("backward_prefetch",
      "NO_PREFETCH")`), which accelerate maps to FSDP's backward_prefetch None (accelerate
      v0.33.0 utils/dataclasses.py `FullyShardedDataParallelPlugin.__post_init__`);
    - its bf16 unsharded gradient (param_dtype bf16; reduce_dtype bf16, so no fp32 copy),
      reduce-scattered at its post-backward;
    - the output layer's bf16 gradient (`output_params`): the root unit's parameters are views
      of one flat parameter, whose gradient autograd forms only when the embedding's has
      arrived, so the output layer's waits from its backward (or, under Liger-Kernel's fused
      linear cross-entropy, from the loss's forward) to the end of the backward.

    derived: the sum of the above at the layer's backward compute; measured
    (validation/torch_fsdp1_memory.py, at the layers' backward peak): the root's copy, the
    output layer's 3,072,000-byte gradient (2 · 6000 · 256), one layer's 1,180,672-byte
    parameters and its weights' gradients as they are written."""
    return HALF * layer_params + HALF * layer_params + HALF * output_params


def fsdp1_cast_reduce_bytes(unit_params: int) -> int:
    """What a unit's post-backward holds of its gradient when FSDP1 casts it to fp32 before the
    reduce-scatter (`fsdp1_cast_reduce`): the bf16 gradient autograd computed, kept alive on
    the post-backward stream (`_no_dispatch_record_stream`), and its fp32 copy, 6 bytes a
    parameter. The unit's unsharded parameters are freed just before
    (`_post_backward_hook` runs `_post_backward_reshard` first; torch/distributed/fsdp/
    _runtime_utils.py, PyTorch v2.13.0). derived."""
    return (HALF + 4) * unit_params


def fsdp1_prefetched_layers(spec) -> int:
    """Layers' unsharded copies FSDP1 holds beside the running layer's in its backward.
    1 under `fsdp_backward_prefetch: backward_pre`, which gathers the next unit in backward
    order when the current one's backward starts (torch/distributed/fsdp/_runtime_utils.py
    `_pre_backward_hook` -> `_prefetch_handle`, PyTorch v2.13.0), so that two layers' copies
    live through its gradient computation. 0 under backward_post, which issues that gather
    from the post-backward hook after the current copy is resharded (`_post_backward_reshard`:
    `_reshard`, then `_prefetch_handle`), and under none, the Hugging Face Trainer's default
    ("NO_PREFETCH", `fsdp1_layer_backward_bytes`). Accelerate's config files set it
    (`fsdp_backward_prefetch: BACKWARD_PRE` in huggingface/peft examples/sft/configs)."""
    return 1 if spec.fsdp_backward_prefetch == "backward_pre" else 0


def fsdp1_frozen_layer_backward_bytes(layer_bytes: int, adapter_params: int) -> int:
    """What a decoder layer's backward holds of FSDP1's buffers beyond the root's kept copy
    when its base weights are frozen: its unsharded parameters gathered again (`layer_bytes`,
    as gathered: 4-bit weights packed), and its adapters' bf16 gradients, which PEFT's wrap
    policy (peft `fsdp_auto_wrap_policy`: every leaf module whose weight trains is its own
    unit) reduce-scatters adapter by adapter. The frozen FlatParameters get no gradient, and
    the frozen output layer none to wait with (`fsdp1_layer_backward_bytes`). derived from
    torch/distributed/fsdp/_runtime_utils.py (`_pre_backward_hook`, `_post_backward_hook`,
    PyTorch v2.13.0)."""
    return layer_bytes + HALF * adapter_params


def fsdp1_embedding_backward_bytes(
    root_params: int, embedding_params: int, output_params: int
) -> int:
    """What the embedding's backward holds of FSDP1's buffers beyond the root's kept copy: the
    embedding's dense bf16 gradient, the output layer's, which has waited since its backward
    (`fsdp1_layer_backward_bytes`), and the root unit's whole bf16 flat gradient, which
    autograd forms from them (the views' split backward) before the root's post-backward
    reduce-scatters it; the root's fp32 gradient shard comes only then, when the pieces are
    freed (torch/distributed/fsdp/_runtime_utils.py `_post_backward_hook`, `_reduce_grad`,
    PyTorch v2.13.0), so ckplan counts the root's gradient shard after the backward, not in it
    (ckplan.model.memory `chain_gradient_bytes`). Measured (validation/torch_fsdp1_memory.py,
    the embedding's backward peak): 2 · 6,144,512 (the kept copy and the flat gradient) +
    2 · 3,072,000 (the two V x h gradients)."""
    return HALF * (root_params + embedding_params + output_params)


# transformers releases whose gradient checkpointing defaults to use_reentrant=True
# (`checkpoint_reentrant`)
REENTRANT_CHECKPOINT_RELEASES = ("4.44",)


def checkpoint_reentrant(spec) -> bool:
    """Whether the run's activation checkpointing is PyTorch's reentrant variant, which runs a
    checkpointed forward without an autograd graph. transformers' `gradient_checkpointing_enable`
    without kwargs: `{"use_reentrant": True}` in v4.44.2 (modeling_utils.py), `{"use_reentrant":
    False}` in v5.25.0 (`_activation_checkpointing_enable`); `framework_version` picks the release
    under hf and under deepspeed driven by transformers. DeepSpeed's own path of 2021
    (`deepspeed.checkpointing.CheckpointFunction`, a torch.autograd.Function) is reentrant.
    Megatron-LM's `CheckpointFunction` (megatron/core/tensor_parallel/random.py, core_v0.15.0)
    is an autograd.Function too: reentrant. torchtitan wraps blocks with torch.distributed's
    `checkpoint_wrapper(module, preserve_rng_state=False)` (parallelize_llama.py at e7c0cae),
    non-reentrant by default (CheckpointImpl.NO_REENTRANT); the other frameworks are taken
    as non-reentrant. The `checkpoint_reentrant` key, where given, says instead."""
    if spec.checkpoint_reentrant is not None:
        return spec.checkpoint_reentrant
    if spec.framework in ("hf", "deepspeed"):
        version = framework_version(spec)
        return version == DEEPSPEED_2021 or version in REENTRANT_CHECKPOINT_RELEASES
    return spec.framework == "megatron"


def fsdp2_resharding(spec) -> bool:
    """Whether the spec runs FSDP2 resharding after forward (torchtitan's, or accelerate's at
    fsdp_version 2; zero 3, one pipeline stage, more than one rank in the FSDP mesh dp·cp, full
    training): its blocks' unsharded copies, gradients and reduce-scatter buffers then live
    only while a block runs, and ckplan holds them as the layers' chain workspaces
    (`fsdp2_layer_forward_bytes`, `fsdp2_layer_backward_bytes`) beside the copies kept all
    step (`fsdp2_kept_unsharded_bytes`)."""
    return _reshards_unit_by_unit(spec, 2)


def fsdp2_frozen_resharding(spec) -> bool:
    """Whether accelerate's FSDP2 (hf, fsdp_version 2) gathers and reshards frozen base weights
    unit by unit: zero 3, more than one rank, training other than full (LoRA, QLoRA). The
    blocks' copies then live while a block runs (`fsdp2_frozen_layer_backward_bytes`)."""
    return (
        spec.framework == "hf"
        and spec.training != "full"
        and _reshards_unit_by_unit(spec, 2, frozen=True)
    )


def framework_version_error(framework: str, version: str | None) -> str | None:
    """Why `version` cannot be set for `framework` (one line naming the key), or None:
    `FRAMEWORK_VERSIONS` names the releases each framework is modelled at; for the others the
    key has no meaning."""
    if version is None:
        return None
    versions = FRAMEWORK_VERSIONS.get(framework)
    if versions is None:
        return (
            f"key 'framework_version' ({version}): {framework} is modelled at one release; "
            f"the key is for frameworks {', '.join(sorted(FRAMEWORK_VERSIONS))}"
        )
    if version not in versions:
        return (
            f"key 'framework_version' must be one of {', '.join(versions)} for {framework}, "
            f"got {version!r}"
        )
    return None


def framework_version(spec) -> str | None:
    """The framework release the spec runs: its `framework_version`, else the newest
    modelled (`FRAMEWORK_VERSIONS`); None for a framework modelled at one release."""
    versions = FRAMEWORK_VERSIONS.get(spec.framework)
    if versions is None:
        return None
    return spec.framework_version or versions[-1]


@dataclass(frozen=True)
class FSDP2Grouping:
    """Which of a torchtitan model's modules are FSDP2 units of their own and which stay
    unsharded from the forward to the backward when the blocks reshard after forward (zero 3,
    one pipeline stage: `fsdp2_resharding`); the final norm and output layer are always kept.

    - `embedding_own_unit`: the token embedding is an FSDP unit of its own, resharded after
      forward, and the final norm and output layer another, whose gradients are reduce-scattered
      as soon as the output stage's backward ends; else the embedding, final norm and output
      are one unit (the root, or a tied embedding's group), kept unsharded and reduced after
      the embedding's backward.
    - `last_block_kept`: the last block is not resharded after forward."""

    embedding_own_unit: bool
    last_block_kept: bool


def spec_fsdp2_grouping(spec) -> FSDP2Grouping:
    """The FSDP2 units of the spec's framework: torchtitan's by release (`fsdp2_grouping`);
    accelerate's (hf) as v1.14.0 builds them (utils/fsdp_utils.py `fsdp2_prepare_model`):
    every decoder layer `fully_shard`ed with the plugin's reshard_after_forward (True under
    FULL_SHARD), then the input embedding its own unit, resharded, unless tied, and
    `[final_norm, lm_head]` (a tied embedding in its place) one unit with
    `reshard_after_forward=False`, the root holding none: torchtitan 0.3's grouping.
    Accelerate v1.6.0-v1.13.0 left the embedding, final norm and output in the root, kept all
    step: not modelled apart."""
    version = framework_version(spec) if spec.framework == "torchtitan" else "0.3"
    return fsdp2_grouping(version, spec.tied_embeddings)


def fsdp2_grouping(version: str | None, tied_embeddings: bool = False) -> FSDP2Grouping:
    """torchtitan's FSDP2 units by release (`FRAMEWORK_VERSIONS`):

    - "2024.12", apply_fsdp before pytorch/torchtitan 83e6941 (Jul 28 2025), e.g. 9dec370
      torchtitan/parallelisms/parallelize_llama.py: every block `fully_shard`ed with
      `reshard_after_forward=int(layer_id) < len(model.layers) - 1`, then `fully_shard(model,
      reshard_after_forward=not pp_enabled)`: the root module holds the embedding, final norm
      and output, and FSDP2 never reshards the root after forward (torch/distributed/fsdp/
      _fully_shard/_fsdp_state.py `_lazy_init`, PyTorch v2.13.0: "For the root, do not reshard
      after forward");
    - "0.3", from 83e6941 ("Improve reshard_after_forward logic") through torchtitan 0.3.0
      (torchtitan/distributed/fsdp.py `apply_fsdp_to_decoder`): `tok_embeddings` its own unit
      and every block with `reshard_after_forward` True (policy "default", no pipeline
      parallelism), `[norm, output]` one unit with `reshard_after_forward_policy == "always"`,
      False by default, and the root holding no parameters of its own. With tied embeddings
      (0.3.0's `enable_weight_tying`) `[tok_embeddings, norm, lm_head]` are one unit, kept.

    Under pipeline parallelism or zero 2 (policy "never") no unit reshards after forward in
    either release, and the grouping changes only the all-gather outputs
    (`fsdp2_outer_units`)."""
    if version == "2024.12":
        return FSDP2Grouping(embedding_own_unit=False, last_block_kept=True)
    return FSDP2Grouping(embedding_own_unit=not tied_embeddings, last_block_kept=False)


def fsdp2_outer_units(
    root_params: int, embedding_params: int, grouping: FSDP2Grouping
) -> tuple[int, int]:
    """(embedding unit, kept unit): the parameters on one GPU of the FSDP2 units outside the
    blocks (`fsdp2_grouping`), `root_params` all those outside the blocks on the stage,
    `embedding_params` the token embedding's there (0 off the first stage): the embedding's
    own unit (0 when it is the kept unit's), and the unit kept unsharded after forward.

    derived: the partition `fsdp2_grouping` names."""
    if grouping.embedding_own_unit:
        return embedding_params, root_params - embedding_params
    return 0, root_params


def fsdp2_gathered_bytes(params: int, float8_params: int = 0) -> int:
    """The bytes FSDP2 gathers and holds unsharded for `params` parameters of which
    `float8_params` are torchao float8 linears' weights under its float8 all-gather
    (`fsdp_float8_all_gather`): those 1 byte each, the rest in param_dtype bf16.
    `WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather` casts the fp32 shard to float8 and
    hands FSDP2 its data alone (the tensorwise scale, already all-reduced, rides as metadata),
    and `fsdp_post_all_gather` wraps the gathered bytes in a `Float8Tensor`, the unsharded
    weight (torchao/float8/fsdp_utils.py at eab345c): no bf16 copy of the weight is made. The
    scales (a 0-dim fp32 tensor a weight) are not counted."""
    return HALF * (params - float8_params) + FLOAT8 * float8_params


def fsdp2_kept_unsharded_bytes(
    kept_params: int, layer_params: int, last_block_kept: bool, layer_float8: int = 0
) -> int:
    """The bf16 unsharded parameters FSDP2 keeps from the forward to the backward
    (`fsdp2_grouping`): the kept unit outside the blocks (`fsdp2_outer_units`), and under
    torchtitan "2024.12" the last block. Measured (validation/torch_fsdp2_memory.py, Llama 3 8B
    on 8 ranks, "Unsharded Param" at the peak): "2024.12" 2,537,578,496 bytes = 2 ·
    (1,050,677,248 + 218,112,000), the root module and the last block; "0.3" 1,050,681,344 =
    2 · 525,340,672, the final norm and output layer. `layer_float8`: the block's weights
    gathered in float8 (`fsdp2_gathered_bytes`; the output layer is not converted)."""
    block = fsdp2_gathered_bytes(layer_params, layer_float8) if last_block_kept else 0
    return HALF * kept_params + block


def fsdp2_layer_forward_bytes(layer_params: int, kept: bool = False, float8: int = 0) -> int:
    """What a block's forward holds of FSDP2's buffers beyond the kept copies: its bf16
    unsharded parameters and the flat all-gather output they were copied out of, which FSDP2
    frees only at the next all-gather's copy-in (_fsdp_param_group.py `wait_for_unshard`:
    `AllGatherState` in forward, PyTorch v2.13.0); for a block kept unsharded its output
    alone. The same for torchtitan 0.3's resharded embedding (`fsdp2_embedding_forward_bytes`).
    Measured (validation/torch_fsdp2_memory.py): "All Gather" 436,224,000 bytes =
    2 · 218,112,000 beside the block's unsharded copy. `float8`: its weights gathered in
    float8, 1 byte each in both (`fsdp2_gathered_bytes`)."""
    return fsdp2_gathered_bytes(layer_params, float8) * (1 if kept else 2)


def fsdp2_layer_backward_bytes(
    layer_params: int,
    output_params: int,
    first: bool = False,
    last: bool = False,
    grouping: FSDP2Grouping = FSDP2Grouping(embedding_own_unit=False, last_block_kept=True),
    embedding_params: int = 0,
    float8: int = 0,
    reduce_bytes: int = 4,
) -> int:
    """What a block's backward holds of FSDP2's buffers beyond the kept copies (PyTorch
    v2.13.0, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py) under torchtitan's
    `grouping` (default "2024.12"'s):

    - its bf16 unsharded parameters (none for a kept last block: `fsdp2_kept_unsharded_bytes`);
    - the next unit's all-gather output, prefetched at its pre-backward (`_prefetch_unshard`);
      before the first block that is the embedding's own unit (`embedding_params`), else
      nothing: the kept unit is already unsharded;
    - its unsharded gradients, in param_dtype bf16 until its post-backward;
    - the previous unit's reduce-scatter input, `reduce_bytes` a value (reduce_dtype:
      torchtitan's float32, accelerate's bf16: `fsdp2_reduce_bytes`), which
      `reduce_scatter_states` holds until this block's post-backward frees it before its own
      (`reduce_scatter_max_input_buffers` 1): behind the last block (the first to run), the
      final norm and output's own unit (`output_params`), else none;
    - when the final norm and output share the kept unit with the embedding, their bf16
      gradients (`output_params`), which wait for that unit's post-backward at the end of the
      backward.

    Under the float8 all-gather the unsharded and prefetched blocks hold their `float8`
    converted weights in 1 byte each (`fsdp2_gathered_bytes`); the gradients stay bf16 (the
    `Float8Tensor` weight's dtype is bf16).

    derived: the sum of the above at the block's backward compute."""
    block = fsdp2_gathered_bytes(layer_params, float8)
    running = 0 if last and grouping.last_block_kept else block
    next_unit = embedding_params if grouping.embedding_own_unit else 0
    prefetched = HALF * next_unit if first else block
    behind = output_params if grouping.embedding_own_unit else 0
    previous_reduce = reduce_bytes * (behind if last else layer_params)
    waiting = 0 if grouping.embedding_own_unit else HALF * output_params
    return running + prefetched + HALF * layer_params + previous_reduce + waiting


def fsdp2_embedding_backward_bytes(
    embedding_params: int, layer_params: int, reduce_bytes: int = 4
) -> int:
    """What the embedding's backward holds of FSDP2's buffers when it is a unit of its own
    (torchtitan "0.3", `fsdp2_grouping`): its bf16 unsharded parameters (gathered again,
    prefetched by the first block), its bf16 unsharded gradient (the embedding's backward
    makes a dense one), and the first block's reduce-scatter input (`reduce_bytes` a value,
    `fsdp2_layer_backward_bytes`), freed at the embedding's post-backward.

    derived: as `fsdp2_layer_backward_bytes`, with nothing left to prefetch."""
    return HALF * embedding_params + HALF * embedding_params + reduce_bytes * layer_params


def fsdp2_frozen_layer_backward_bytes(
    layer_bytes: int, adapter_params: int, prefetched_bytes: int, reduce_bytes: int
) -> int:
    """What a decoder layer's backward holds of FSDP2's buffers when its base weights are
    frozen (hf, fsdp_version 2, `fsdp2_frozen_resharding`): its unsharded parameters gathered
    again (`layer_bytes`, as gathered: 4-bit weights packed), the unit before it in forward
    order, prefetched at its pre-backward (`prefetched_bytes`: the layer before; before the
    first layer the embedding's own unit, which FSDP2 prefetches from its post-forward order
    though the frozen embedding runs no backward), its adapters' bf16 gradients and the
    previous layer's adapters' reduce-scatter input (`reduce_bytes` a value,
    `fsdp2_reduce_bytes`). The frozen parameters get no gradient. derived from
    torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py (`pre_backward`,
    `_backward_prefetch`: `comm_ctx.post_forward_order[curr_index - 1]`, `post_backward`,
    PyTorch v2.13.0), as `fsdp2_layer_backward_bytes`."""
    return layer_bytes + prefetched_bytes + (HALF + reduce_bytes) * adapter_params


def fsdp2_pipeline_accumulates(spec) -> bool:
    """Whether `buffer_bytes` holds a pipeline stage's unsharded fp32 gradients, accumulated
    over the micro-batches (torchtitan's FSDP under pipeline parallelism, zero 2 or 3, dp·cp >
    1, full training): torch.distributed.pipelining reduces and frees them per model chunk
    (ckplan.plan.evaluate `interleaved_gradient_excess`).
    derived: `buffer_bytes`' torchtitan branch with pp > 1."""
    return (
        runs_fsdp2(spec)
        and spec.pp > 1
        and spec.zero >= 2
        and spec.dp * spec.cp > 1
        and spec.training == "full"
    )


def fsdp2_sharded(spec) -> bool:
    """Whether FSDP2 (`runs_fsdp2`) shards this full-training spec's gradients over more than
    one rank (zero 2 or 3, dp·cp > 1): its reduce-scatter and all-gather streams then keep
    pools of their own (`fsdp2_stream_pool_bytes`)."""
    return runs_fsdp2(spec) and spec.zero >= 2 and spec.dp * spec.cp > 1 and spec.training == "full"


def fsdp2_stream_pool_bytes(sharded_gradient_bytes: int, all_gather_pool_bytes: int) -> int:
    """What the CUDA caching allocator keeps reserved for FSDP2's side streams beside the
    default stream's blocks: it reuses a cached block only on the stream that allocated it
    (c10/cuda/CUDACachingAllocator.cpp, `get_free_block`: the pool is searched by
    (stream, size); with expandable segments one segment per stream, "Note [Expandable
    Segments]"), and FSDP2 allocates two kinds of buffers off the default stream
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, PyTorch v2.13.0):

    - the sharded gradients, views of the reduce-scatter output allocated on the
      reduce-scatter stream ("the GPU sharded gradient is allocated in the RS stream"), in
      reduce_dtype fp32: all of them live from the end of the backward to zero_grad, so that
      stream's pool holds `sharded_gradient_bytes` for the whole step;
    - the all-gather inputs and outputs, allocated on the all-gather copy-in stream
      (`foreach_all_gather`), bf16: `all_gather_pool_bytes` (`fsdp2_all_gather_pool_bytes`).

    derived: the pools' high-water marks; they are reserved, not allocated, at the allocated
    peak (the loss's backward), which the tracker measured without them
    (validation/torch_fsdp2_memory.py)."""
    return sharded_gradient_bytes + all_gather_pool_bytes


def fsdp2_all_gather_pool_bytes(
    before: int,
    layer: int,
    after: int,
    blocks: int,
    shards: int,
    expandable_segments: bool = True,
    layer_float8: int = 0,
) -> int:
    """The bytes the all-gather copy-in stream's pool reserves on one GPU: FSDP2 gathers the
    units in forward order, the unit before the blocks (`before` parameters: torchtitan
    "2024.12"'s root module, "0.3"'s token embedding; 0 where none is on the stage), `blocks`
    blocks of `layer` parameters, and the unit after them (`after`: "0.3"'s final norm and
    output; 0 where none), over `shards` ranks. Each gather allocates on that stream the bf16
    cast of the rank's shard (`_get_param_all_gather_inputs`' flat copy, freed after the
    copy-in) and the bf16 all-gather output (`foreach_all_gather`); in forward the output is
    kept until the next unit's `wait_for_unshard` (`AllGatherState`, "Defer free to allow for
    overlap of this copy-out with next all-gather collective"), after the next unit's output
    is allocated, so two consecutive units' outputs are alive at once
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, PyTorch v2.13.0). The backward
    gathers the blocks again, two at once when it prefetches, in the room the forward left.

    With expandable segments the stream's segment grows at its end
    (ckplan.model.allocator module docstring): the first unit's shard cast, freed, stays below
    its output, the later casts fit in it, and the segment reaches the first cast and the
    largest pair of consecutive outputs.

    With the default allocator every output that no free block of the stream fits gets a
    segment of its own (`get_free_block` takes the smallest free block at least the request,
    ckplan.model.allocator `segment_bytes`): the first unit's cast and output, and the second
    unit's output, made while the first's is alive. The blocks then alternate between the
    second unit's segment and the first's (the smallest free block that fits is the one the
    block before last freed), so the unit after the blocks finds free only the segment the
    last block does not hold, the first unit's when `blocks` is odd, the block segment when it
    is even; when its output is larger than that segment it takes a segment of its own
    (Llama 3's [norm, output] unit asks for 2·h bytes more than the token embedding's V·h
    bf16, a whole number of 2 MiB blocks). The first and second unit are two blocks where
    nothing precedes the blocks (a pipeline stage past the first).

    Under the float8 all-gather a block's input and output are `fsdp2_gathered_bytes` of its
    parameters, `layer_float8` of them 1 byte each (its shard cast to float8 by
    `fsdp_pre_all_gather` on the same stream).

    derived; validation/fsdp2_tp_allocator_replay.py `--streams` replays torchtitan's 8B steps
    on the streams and agrees within 60 MiB (results-fsdp2-default-allocator-streams-torch-2.13.0
    .json)."""
    from ckplan.model.allocator import segment_bytes

    block = fsdp2_gathered_bytes(layer, layer_float8)
    gathered = ((before, 0),) if before else ()
    gathered += ((layer, layer_float8),) * blocks + (((after, 0),) if after else ())
    if not gathered:
        return 0
    units = [fsdp2_gathered_bytes(*unit) for unit in gathered]
    first_cast = fsdp2_gathered_bytes(*(-(-n // max(shards, 1)) for n in gathered[0]))
    if expandable_segments:
        pairs = [a + b for a, b in itertools.pairwise(units)] or [units[0]]
        return first_cast + max(pairs)
    pool = segment_bytes(first_cast) + segment_bytes(units[0])
    if len(units) > 1:
        pool += segment_bytes(units[1])
    if after and len(units) > 2:
        first_free = before and blocks % 2 == 1
        free = segment_bytes(HALF * before if first_free else block)
        if segment_bytes(HALF * after) > free:
            pool += segment_bytes(HALF * after)
    return pool


def torch_pipeline_buffer_bytes(
    microbatches: int,
    in_flight: int,
    boundary_bytes: int,
    output_bytes: int,
    first: bool,
    last: bool,
) -> int:
    """Bytes one stage of torch.distributed.pipelining (torchtitan's pipeline parallelism, one
    stage per rank) holds at its peak beside its in-flight micro-batches' layer tapes, with
    `microbatches` micro-batches per step, `in_flight` of them waiting for their backward,
    `boundary_bytes` the activation passed between stages (the residual stream) and
    `output_bytes` one micro-batch's output of this stage (the boundary, or the logits on the
    last stage).

    derived from torch/distributed/pipelining/stage.py (PyTorch v2.13.0; `PipelineStage` has
    made the same buffers since v2.4): `_prepare_forward_infra` makes one receive buffer per
    micro-batch for a non-first stage (`_make_tensor_from_meta` for each chunk_id) and
    `_prepare_backward_infra` one gradient receive buffer per micro-batch for a non-last stage;
    both stay in `args_recv_info` / `grad_recv_info` for the whole step and the next. The
    in-flight micro-batches' receive buffers are their stages' inputs, which the first layer's
    tape already holds; the others are `microbatches - in_flight` more. `forward_one_chunk`
    keeps each micro-batch's output in `fwd_cache` until `backward_one_chunk` pops it
    (Megatron-LM frees a sent output's data, `deallocate_output_tensor`, as
    megatron/training/argument_utils.py sets deallocate_pipeline_outputs at 6e091e1b68; this
    does not): `in_flight` outputs, on the last stage its logits, which torchtitan's train step
    otherwise drops before backward (`del pred`). The input gradients the backward leaves on
    the receive buffers (`.grad`, cleared by `clear_runtime_states` at the next step) each come
    with a finished backward that freed its micro-batch's tape, so they do not raise the peak,
    the first backward's. Checked
    on the CPU with PyTorch 2.13 (three gloo ranks, Schedule1F1B, six micro-batches: at each
    stage's first backward rank 0 held 6 gradient buffers and 3 outputs, rank 1 6 receive and
    6 gradient buffers and 2 outputs, rank 2 6 receive buffers and 1 output)."""
    received = 0 if first else (microbatches - in_flight) * boundary_bytes
    gradients = 0 if last else microbatches * boundary_bytes
    return received + gradients + in_flight * output_bytes


def torch_pipeline_finished_bytes(
    microbatches: int,
    in_flight: int,
    boundary_bytes: int,
    output_bytes: int,
    first: bool,
) -> int:
    """Bytes one stage of torch.distributed.pipelining of late 2024 (the PyTorch torchtitan
    9dec370, 2024-12-26, trained with) still holds for the micro-batches whose backward has
    finished, at its last 1F1B backward that runs with `in_flight` micro-batches in flight (the
    backward of micro-batch `microbatches - in_flight`; its tapes are those of the first
    backward's peak): each finished micro-batch's output, `output_bytes` (the boundary, or the
    logits on the last stage), and on a non-first stage the gradient its backward left on its
    receive buffer, `boundary_bytes`. Both live to the next step's `clear_runtime_states`.

    derived from torch/distributed/pipelining/stage.py and _backward.py before two later
    changes: `forward_one_chunk` appended every stage's output to `output_chunks` (kept for
    `_merge_outputs`) until pytorch/pytorch#153383 (2025-05, 'Optimize memory usage by releasing
    output memory earlier') kept the last stage's only, and torchtitan's train step at 9dec370
    calls `pp_schedule.step` without `return_outputs=False` (torchtitan 0.3's trainer passes
    it, so the last stage keeps none); `stage_backward` ran `torch.autograd.backward` into the
    receive buffers and returned their `.grad` without clearing it until pytorch/pytorch#164329
    (2025-10, 'Optimize memory by early releasing stage inputs' gradients') set `val.grad =
    None`. The first stage's inputs are token ids, with no gradient. With `in_flight` equal to
    the micro-batches (the first stage of a short pipeline) nothing has finished."""
    finished = max(microbatches - in_flight, 0)
    return torch_pipeline_kept_bytes(finished, boundary_bytes, output_bytes, first)


def torch_pipeline_kept_bytes(
    finished: int, boundary_bytes: int, output_bytes: int, first: bool
) -> int:
    """Bytes one stage of the late-2024 torch.distributed.pipelining keeps for `finished`
    micro-batches whose backward has run: each one's output (`output_chunks`) and, on a
    non-first stage, the input gradient its backward left on the receive buffer
    (`torch_pipeline_finished_bytes`, whose sources these are)."""
    input_gradient = 0 if first else boundary_bytes
    return finished * (output_bytes + input_gradient)


def torch_microbatches_per_round(microbatches: int, pp: int) -> int:
    """The micro-batches ScheduleInterleaved1F1B sends through one local stage before moving to
    the next: `microbatches_per_round = n_microbatches // number_of_rounds`, `number_of_rounds =
    max(1, n_microbatches // pp_group_size)` (torch/distributed/pipelining/schedules.py,
    PyTorch v2.13.0; p when the micro-batches are a multiple of p, as Megatron-LM's default
    microbatch_group_size_per_vp_stage)."""
    return microbatches // max(1, microbatches // pp)


def torch_interleaved_chunk_counts(
    pp: int, virtual_stages: int, microbatches: int, rank: int
) -> tuple[tuple[int, int], ...]:
    """Per local stage of pipeline rank `rank` under torch.distributed.pipelining's
    ScheduleInterleaved1F1B (local stage c is model stage c·p + rank, torchtitan's 'loop'
    placement), (micro-batches in flight, micro-batches whose backward has run) at the latest
    point of the rank's order where it holds the most forwards: there its tapes peak, and the
    late-2024 runtime has kept the most finished outputs beside them (the rule
    `torch_pipeline_finished_bytes` takes for one stage per rank).

    The order (torch/distributed/pipelining/schedules.py, PyTorch v2.13.0:
    `ScheduleInterleaved1F1B._calculate_single_rank_operations`, `_get_warmup_ops`,
    `_get_1f1b_rank_ops`): warmup (v - 1)·g + 2·(p - 1 - rank) forwards, at most m·v, with g
    `torch_microbatches_per_round`; then a forward and a backward per step; then the remaining
    backwards. Forward op k runs local stage (k // g) mod v, backward op k local stage
    v - 1 - ((k - warmup) // g) mod v, each on its stage's next micro-batch.
    derived: the walk over that order; checked against the schedule itself on the CPU with two
    gloo ranks (validation/torch_pipeline_buffers.py --interleaved)."""
    v, m = virtual_stages, microbatches
    g = torch_microbatches_per_round(m, pp)
    total = m * v
    warmup = min((v - 1) * g + 2 * (pp - 1 - rank), total)
    in_flight, finished = [0] * v, [0] * v
    best, snapshot = -1, ()

    def forward(op: int) -> None:
        nonlocal best, snapshot
        in_flight[(op // g) % v] += 1
        if sum(in_flight) >= best:
            best = sum(in_flight)
            snapshot = tuple(zip(in_flight, finished, strict=True))

    def backward(op: int) -> None:
        chunk = v - 1 - ((op - warmup) // g) % v
        in_flight[chunk] -= 1
        finished[chunk] += 1

    for op in range(warmup):
        forward(op)
    for op in range(warmup, total):
        forward(op)
        backward(op)
    return snapshot


def torch_pipeline_keeps_finished(spec) -> bool:
    """Whether the spec's torchtitan release runs the late-2024 torch.distributed.pipelining
    that keeps finished micro-batches' outputs and input gradients to the end of the step
    (`torch_pipeline_finished_bytes`): torchtitan 2024.12, not 0.3 (whose PyTorch 2.13 keeps
    neither: `output_chunks` on the last stage only and torchtitan passes return_outputs=False;
    `stage_backward` clears the inputs' `.grad`)."""
    return spec.framework == "torchtitan" and framework_version(spec) == "2024.12"


def state_offload_error(
    spec, zero: int | None = None, pp: int | None = None, microbatches: int | None = None
) -> str | None:
    """Why the spec's `optimizer_offload` and `param_offload` cannot run as ckplan models them
    (one line naming the key), or None (module docstring): DeepSpeed's offload_optimizer with
    ZeRO 1-3 and its offload_param with ZeRO 3 beside it; FSDP's CPU offload, both keys, with
    ZeRO 2-3. Full training or frozen base weights (LoRA, QLoRA: the adapters' states go to
    the host, and with the parameters the frozen weights' shards), with Adam
    (DeepSpeedCPUAdam; torch's AdamW on CPU tensors, fp32 or, `adamw-bf16`, in the bf16
    parameters' dtype), one pipeline stage, and no
    optimizer_in_backward. One micro-batch per step (DeepSpeed accumulates micro-batches'
    gradients through host buffers and torchtitan's FSDP2 on the CPU, which ckplan does not
    time), but for hf's FSDP under its no_sync accumulation (`offload_accumulates_on_device`).
    `zero`, `pp`, `microbatches`: a layout's, default the spec's."""
    optimizer, param = spec.optimizer_offload != "none", spec.param_offload != "none"
    if not (optimizer or param):
        return None
    key = "optimizer_offload" if optimizer else "param_offload"
    framework = spec.framework
    zero = spec.zero if zero is None else zero
    pp = spec.pp if pp is None else pp
    microbatches = spec.microbatches if microbatches is None else microbatches
    if framework == "megatron":
        return (
            f"key {key!r}: model states on the host are modelled for framework deepspeed "
            "(ZeRO-Offload), torchtitan or hf (FSDP CPU offload), not megatron"
        )
    if param and not optimizer:
        return (
            "key 'param_offload' (cpu) needs optimizer_offload: cpu (the parameters' "
            "optimizer states go to the host first)"
        )
    if framework == "deepspeed":
        if zero < 1:
            return f"key 'zero' ({zero}): DeepSpeed's offload_optimizer runs with ZeRO 1, 2 or 3"
        if param and zero != 3:
            return f"key 'zero' ({zero}): DeepSpeed's offload_param runs with ZeRO 3 only"
    elif not param:
        return (
            f"key 'optimizer_offload' (cpu): {framework}'s FSDP CPU offload moves the parameters, "
            "gradients and optimizer step together; set param_offload: cpu too"
        )
    elif zero < 2:
        return f"key 'zero' ({zero}): FSDP's CPU offload shards the states; use zero 2 or 3"
    cpu_optimizers = ("adamw",) if framework == "deepspeed" else ("adamw", "adamw-bf16")
    if spec.optimizer not in cpu_optimizers:
        return (
            f"key {key!r}: the CPU step is modelled for optimizer: adamw "
            f"(DeepSpeedCPUAdam; torch's AdamW, or adamw-bf16, under FSDP), got {spec.optimizer}"
        )
    if spec.optimizer_in_backward:
        return f"key {key!r}: the CPU step runs after backward; drop optimizer_in_backward"
    if pp > 1 or (microbatches > 1 and not offload_accumulates_on_device(spec)):
        return (
            f"key {key!r}: model states on the host are modelled for one pipeline stage and "
            "one micro-batch per step (pp: 1, microbatches: 1; more micro-batches with "
            "framework hf, whose no_sync accumulates on the GPU)"
        )
    return None


def offload_accumulates_on_device(spec) -> bool:
    """Whether FSDP's CPU offload accumulates the micro-batches' gradients on the GPU: hf's
    Trainer runs all but the last micro-batch under FSDP's no_sync (`gradient_sync`), where
    "`.grad` remains the unsharded gradient from prior `no_sync()` iterations" on the device
    (torch/distributed/fsdp/_runtime_utils.py `_finalize_params`, PyTorch v2.13.0) and only
    the last backward reduce-scatters the sum and copies its shard to the host
    (`_offload_grad`). Outside no_sync FSDP1 cannot accumulate beside CPU offload ("Gradient
    accumulation outside `no_sync()` does not work with CPU offloading", _flat_param.py
    `prepare_gradient_for_backward`): `grad_sync: micro_batch` is refused."""
    return spec.framework == "hf" and not gradient_sync("hf", 3, 1, spec.grad_sync).each_micro_batch


def largest_parameter(spec, tp: int | None = None) -> int:
    """Values of the largest parameter tensor on one GPU: the vocab-parallel embedding or
    output layer (V/t rows of h) or a layer's largest weight (`largest_weight`). DeepSpeed's
    CPU offload sizes its gradient staging buffers by it (stage_1_and_2.py, v0.19.8:
    temp_grad_buffer_for_cpu_offload and temp_grad_buffer_for_gpu_offload, `largest_param_numel`
    values in the parameters' dtype). `tp`: a layout's, default the spec's."""
    tp = spec.tp if tp is None else tp
    vocab = -(-spec.vocab * spec.hidden // tp) if spec.vocab else 0
    return max(vocab, largest_weight(spec, tp))
