"""ckplan's prediction of a published run, and its error against the published figure.

Each run is built as a user would describe it (its model, its published layout, its
recomputation), planned with `plan.evaluate` and timed with `hardware.step_time`. A throughput
figure implies a step time, so every time metric is compared as a step time (predicted /
published - 1, positive when ckplan is slower) and, where the publisher counts FLOPs, as MFU in
the publisher's own convention and peak (predicted - published, in points). A peak from
PyTorch's allocator statistics (allocated, active or reserved bytes) is compared with ckplan's
allocated or reserved peak less what lives outside that allocator (`ALLOCATOR_METRICS`,
`outside_allocator_bytes`); a peak nvidia-smi or NVML shows (`nvidia_smi_bytes`) with the
reserved peak plus what lives outside it (`hardware.device_memory`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckplan.errors import InputError
from ckplan.hardware.device_memory import device_memory, paged_optimizer_bytes
from ckplan.hardware.gpus import GPU
from ckplan.hardware.step_time import step_time
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_mapping, spec_from_values
from ckplan.model import allocator
from ckplan.model.flops import iteration_flops
from ckplan.model.loss import loss_cached_bytes
from ckplan.model.memory import layer_input_bytes, stream_pool_bytes
from ckplan.model.op import split_share
from ckplan.model.optimizers import OPTIMIZERS
from ckplan.model.spec import ModelSpec
from ckplan.plan import evaluate, parse_strategy
from ckplan.plan.evaluate import Plan
from ckplan.plan.search import DEFAULT_RESERVE
from ckplan.plan.timeline import memory_timeline
from ckplan.published.runs import MEMORY_METRICS, PublishedRun
from ckplan.schedules import BACKWARD, FORWARD_KEEP_ALL, FORWARD_KEEP_INPUT

# What ckplan cannot model yet, by run key and value: such runs are listed, not scored.
NOT_MODELLED: dict[tuple[str, str], str] = {}
# The publisher's framework as ckplan's `framework` key: NeMo and Megatron-Bridge run
# Megatron-Core; Megatron-DeepSpeed runs Megatron-LM's kernels; Composer (llm-foundry) runs
# PyTorch FSDP with eager modules, as Hugging Face Trainer and torchtune do; a private stack
# ("other": Meta's, metaseq, DeepSeek's) is taken as Megatron-like fused kernels.
FRAMEWORK_KEY = {
    "megatron": "megatron",
    "nemo": "megatron",
    "megatron-deepspeed": "megatron",
    "torchtitan": "torchtitan",
    "deepspeed": "deepspeed",
    "composer": "hf",
    "hf": "hf",
    "torchtune": "hf",
    "unsloth": "hf",
    "axolotl": "hf",
    "other": "megatron",
}


@dataclass(frozen=True)
class Prediction:
    run: PublishedRun
    status: str  # "ok", or why the run is not scored
    predicted: float | None = None  # in the published metric's unit
    error: float | None = None  # predicted / published - 1 (step time, or memory)
    predicted_step: float | None = None
    published_step: float | None = None
    predicted_mfu: float | None = None  # in the publisher's convention, where it has one
    published_mfu: float | None = None
    fits: bool | None = None
    memory_bytes: int | None = None
    spec: ModelSpec | None = None
    plan: Plan | None = None

    @property
    def scored(self) -> bool:
        return self.status == "ok"

    @property
    def mfu_points(self) -> float | None:
        if self.predicted_mfu is None or self.published_mfu is None:
            return None
        return 100 * (self.predicted_mfu - self.published_mfu)


def run_spec(run: PublishedRun) -> ModelSpec:
    """The run as a model description: its model, its layout, its micro-batches."""
    if isinstance(run.model, str):
        base, origin = load_mapping(run.model)
    else:
        base, origin = {"name": run.name, **run.model}, run.name
    layout = dict(run.layout)
    tp, pp, cp = (int(layout.get(key, 1)) for key in ("tp", "pp", "cp"))
    dp = int(layout.get("dp", run.gpus // (tp * pp * cp)))
    if tp * pp * cp * dp != run.gpus:
        raise InputError(f"{run.name}: tp·pp·cp·dp = {tp * pp * cp * dp}, not gpus {run.gpus}")
    per_step = run.micro_batch * dp
    if run.global_batch % per_step:
        raise InputError(
            f"{run.name}: global batch {run.global_batch} is not a multiple of micro_batch·dp "
            f"({per_step})"
        )
    execution: dict[str, Any] = {
        "framework": FRAMEWORK_KEY.get(run.framework, "megatron"),
        "precision": "bf16" if run.precision in ("fp16", "bf16") else run.precision,
    }
    if run.framework in FUSED_MODULES:
        execution["kernels"] = "fused"
    if run.framework in GRAD_SYNC_EACH_MICRO_BATCH:
        execution["grad_sync"] = "micro_batch"
    if run.framework in FSDP_REDUCE_FP32 and run.layout.get("zero", 0) >= 2:
        execution["fsdp_reduce_dtype"] = "fp32"
    if run.compile:
        execution["kernels"] = "compiled"
    if run.attention_kernel in ("flash2", "flash3", "cudnn", "triton", "sdpa"):
        # a fused attention kernel keeps no s x s matrix, whatever the preset's attention says
        execution["attention_kernel"] = run.attention_kernel
        execution["attention"] = "flash"
    loss = run.training.get("loss", FRAMEWORK_LOSS.get(run.framework))
    if loss == "fused-linear-ce":
        execution["loss"] = f"chunked:{liger_chunks(run)}"
    elif _modelled(loss, MODELLED_TRAINING["loss"]):
        execution["loss"] = loss
    values: dict[str, Any] = {
        **base,
        **execution,
        **finetune_values(run),
        **optimizer_values(run),
        **state_offload_values(run),
        **run.settings,
        **layout,
        "dp": dp,
        "seq": run.seq,
        "micro_batch": run.micro_batch,
        "microbatches": run.global_batch // per_step,
    }
    values.pop("zero", None)
    zero = int(layout.get("zero", 0))
    return spec_from_values({**values, "zero": zero}, origin)


def state_offload_values(run: PublishedRun) -> dict[str, Any]:
    """The run's `offload: params` as ckplan's model states on the host: accelerate's
    `fsdp_offload_params: true` builds FSDP with CPUOffload(offload_params=True)
    (accelerate/utils/dataclasses.py, FullyShardedDataParallelPlugin), whose parameters stay on
    the CPU when not computing and "this offloads gradients to CPU as well, meaning that the
    optimizer step runs on CPU" (torch/distributed/fsdp/api.py, `CPUOffload`, PyTorch
    v2.13.0): ckplan's FSDP CPU offload, param_offload and optimizer_offload both cpu
    (ckplan.model.frameworks)."""
    if run.training.get("offload") != "params":
        return {}
    return {"optimizer_offload": "cpu", "param_offload": "cpu"}


# Publishers ckplan runs as `hf` whose loops reduce the gradients of every micro-batch (the
# Hugging Face Trainer's no_sync reduces once per step): Composer and torchtune
# (ckplan.model.frameworks.gradient_sync).
GRAD_SYNC_EACH_MICRO_BATCH = ("composer", "torchtune")
# Publishers ckplan runs as `hf` whose FSDP reduces the gradients in fp32 where accelerate
# reduces them in the half dtype (`fsdp_reduce_dtype`): Composer's 'DEFAULT' mixed precision,
# param_dtype bf16 and reduce_dtype fp32 (composer/trainer/mosaic_fsdp_utils.py
# `get_mixed_precision`, the llm-foundry runs' assumptions)
FSDP_REDUCE_FP32 = ("composer",)


# torchtune's module names (torchtune/modules/peft/lora.py users: the attention's q_proj, k_proj,
# v_proj, output_proj; the SwiGLU FeedForward's w1 gate, w3 up, w2 down) as PEFT's
TORCHTUNE_TARGETS = {"output_proj": "o_proj", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def finetune_values(run: PublishedRun) -> dict[str, Any]:
    """The run's fine-tuning as ckplan's keys (docs/fine-tuning.md): training, the LoRA rank,
    targets (torchtune's names mapped to PEFT's) and dropout, the frozen weights' format."""
    training = run.training.get("training", "full")
    if training == "full":
        return {}
    values: dict[str, Any] = {"training": training}
    if "weight_format" in run.training:
        values["weight_format"] = run.training["weight_format"]
    lora = run.training.get("lora") or {}
    if training in ("lora", "qlora") and isinstance(lora, dict):
        if "rank" in lora:
            values["lora_rank"] = lora["rank"]
        if "alpha" in lora:
            values["lora_alpha"] = lora["alpha"]
        if "dropout" in lora:
            values["lora_dropout"] = lora["dropout"]
        if "targets" in lora:
            names = [name.strip() for name in str(lora["targets"]).split(",")]
            values["lora_targets"] = ",".join(TORCHTUNE_TARGETS.get(name, name) for name in names)
    return values


# The loss a framework runs when the run does not name one, as ckplan's `loss`: llm-foundry's
# MPT takes flash-attn's CrossEntropyLoss (`loss_fn` default 'fused_crossentropy',
# llmfoundry/models/mpt/modeling_mpt.py at b2a43a1477 (2023-10), 5e85bd62d4 and 495218376
# (2024-04); the benchmark script sets no loss_fn), which saves the bf16 logits themselves
# (ckplan.model.loss `xentropy`).
FRAMEWORK_LOSS = {"composer": "xentropy"}


# Frameworks that train in pure bf16: the model is built in the recipe's dtype, so weights,
# gradients and optimizer states are bf16 and there is no fp32 master copy. torchtune: "we
# don't support mixed-precision training" (docs/source/tutorials/memory_optimizations.rst,
# v0.6.1); the recipes build the model under `training.set_default_dtype(self._dtype)`
# (recipes/full_finetune_single_device.py `_setup_model`, 1814feb).
PURE_BF16 = ("torchtune",)
HALF = 2  # bytes of a bf16 value


def optimizer_values(run: PublishedRun) -> dict[str, Any]:
    """The run's optimizer and bytes per parameter as ckplan's keys (docs/fine-tuning.md,
    "Optimizers"). Under a pure-bf16 framework (`PURE_BF16`) the weights and gradients are bf16,
    no master copy is kept, and torch.optim.AdamW keeps exp_avg and exp_avg_sq in the
    parameters' dtype (`torch.zeros_like(p, memory_format=torch.preserve_format)`,
    torch/optim/adamw.py, PyTorch v2.5): `adamw` is ckplan's `adamw-bf16`. bitsandbytes' 8-bit
    states do not depend on the parameters' dtype (`optimizers.tensor_8bit_state_bytes`)."""
    optimizer = str(run.training.get("optimizer", "adamw"))
    values: dict[str, Any] = {}
    pure = run.framework in PURE_BF16 and run.precision == "bf16"
    if pure:
        values.update(weight_bytes=HALF, grad_bytes=HALF, master_bytes=0)
        if optimizer == "adamw":
            optimizer = "adamw-bf16"
    if optimizer != "adamw":
        values["optimizer"] = optimizer
    return values


def _modelled(value: Any, modelled: tuple[str, ...]) -> bool:
    """Whether `value` is one of `modelled`; `chunked:N` (`chunked-output:N`) stands for every
    N."""
    text = str(value)
    kind, _, count = text.partition(":")
    if kind in ("chunked", "chunked-output") and count:
        return f"{kind}:N" in modelled and count.isdigit()
    return text in modelled


# torchtune's OffloadActivations (torchtune/training/_activation_offloading.py at 1814feb):
# the default max_fwd_stash_size, the packed tensors the forward keeps on the device until
# their copy to the host is waited on.
TORCHTUNE_FORWARD_STASH = 5
# The tensors each chain stage packs through the saved-tensor hooks in the forward, each taking
# a tensor id whether it is offloaded or not (`pack_tensor` calls get_tensor_id first): the
# embedding its token ids; a checkpointed layer its input (non-reentrant checkpointing packs
# the region's input through the outer hooks and nothing else); the output stage the eager
# final RMSNorm's six (torchtune/modules/rms_norm.py at 1814feb: the fp32 input for pow and for
# the product, the rsqrt result twice, the bf16 normalised tensor and the scale, a Parameter
# that is not offloaded); the output layer runs under NoOpManager. Counted with
# torch.autograd.graph.saved_tensors_hooks on the CPU (torch 2.13).
EMBEDDING_PACKED = 1
LAYER_PACKED = 1
FINAL_NORM_PACKED = 6


def offloads_checkpoints(run: PublishedRun) -> bool:
    """Whether the run offloads the layer inputs that full recomputation keeps, as torchtune's
    `enable_activation_offloading` does beside activation checkpointing ("only the
    checkpointed tensors will be offloaded", docs/source/tutorials/memory_optimizations.rst,
    v0.6.1; the recipe refuses offloading without checkpointing)."""
    return (
        run.training.get("offload", "none") == "activations"
        and run.framework == "torchtune"
        and strategy_of(run) == "full"
    )


def checkpoint_offload_activation_bytes(plan: Plan) -> int:
    """The activation peak of a `full` plan whose checkpointed layer inputs move to the host
    as torchtune's OffloadActivations moves them (torchtune/training/_activation_offloading.py
    at 1814feb, streams on): the plan's replayed timeline (`plan.timeline.memory_timeline`)
    less, at every step, the layer inputs held on the host then (each `layer_input_bytes`).

    derived from that file: in the forward each packed tensor is copied to the host and the
    device copy stays in `fwd_stash` until a tensor `max_fwd_stash_size` (5) packs later is
    packed, so the newest 5 packed tensors stay on the device (`EMBEDDING_PACKED`,
    `LAYER_PACKED`, `FINAL_NORM_PACKED` count them); the stash is emptied once the first
    backward node has run; in the
    backward each input comes back when its layer's recomputation unpacks it. A checkpointed
    layer is taken to pack one tensor, its input. The device copy an unpacked input keeps
    until the compute stream is done (`record_stream`) is one layer input at most, counted
    within the layer's recomputation."""
    timeline = memory_timeline(plan)
    if timeline is None:
        raise ValueError("a full plan has a schedule")
    names = plan.stage_names
    X = layer_input_bytes(plan.spec)
    held: set[int] = set()  # checkpointed layer inputs
    packed = 0
    stash_alive = True
    peak = timeline.initial_bytes
    for t, step in enumerate(plan.steps):
        is_layer = names[step.stage].startswith("layer ")
        current = {step.stage}
        if stash_alive and step.kind != BACKWARD:
            if is_layer:
                packed += LAYER_PACKED
            else:
                packed += EMBEDDING_PACKED if step.stage == 0 else FINAL_NORM_PACKED
        waiting = len(held - current)
        on_host = min(waiting, max(0, packed - TORCHTUNE_FORWARD_STASH)) if stash_alive else waiting
        peak = max(peak, timeline.during_bytes[t] - on_host * X)
        if step.kind == FORWARD_KEEP_INPUT and is_layer:
            held.add(step.stage)
        elif step.kind in (FORWARD_KEEP_ALL, BACKWARD):
            held.discard(step.stage)
        if step.kind == BACKWARD:
            stash_alive = False
        waiting = len(held)
        on_host = min(waiting, max(0, packed - TORCHTUNE_FORWARD_STASH)) if stash_alive else waiting
        peak = max(peak, timeline.after_bytes[t] - on_host * X)
    return peak


def distributes_checkpoints(run: PublishedRun) -> bool:
    """Whether the run keeps each checkpointed layer input split over its tensor-parallel
    ranks, as metaseq's `--distribute-checkpointed-activations` does (and Megatron-LM's
    `--distribute-saved-activations`), under full recomputation."""
    return run.training.get("distribute_checkpoints") is True and strategy_of(run) == "full"


def distributed_checkpoint_activation_bytes(plan: Plan) -> int:
    """The activation peak of a `full` plan whose checkpointed layer inputs are kept split over
    the t tensor-parallel ranks: the plan's replayed timeline (`plan.timeline.memory_timeline`)
    less, at every step, X - X/t for each layer input held then (X = `layer_input_bytes`).

    derived from metaseq's checkpoint function
    (metaseq/modules/checkpoint_activation_wrapper/checkpoint_activations.py at f7ffa5f,
    `CheckpointFunction`): after the checkpointed block's forward it replaces the input's data
    by this rank's 1-D chunk (`mpu.split_tensor_into_1d_equal_chunks(..., new_buffer=True)`),
    so the whole input is freed and 1/t of it kept; the backward gathers it whole again
    (`gather_split_1d_tensor`) before it re-runs the block, so the layer being recomputed holds
    its input whole, as the timeline has it."""
    timeline = memory_timeline(plan)
    if timeline is None:
        raise ValueError("a full plan has a schedule")
    names = plan.stage_names
    whole = layer_input_bytes(plan.spec)
    spared = whole - split_share(whole, plan.spec.tp)
    held: set[int] = set()
    peak = timeline.initial_bytes
    for t, step in enumerate(plan.steps):
        peak = max(peak, timeline.during_bytes[t] - len(held - {step.stage}) * spared)
        if step.kind == FORWARD_KEEP_INPUT and names[step.stage].startswith("layer "):
            held.add(step.stage)
        elif step.kind in (FORWARD_KEEP_ALL, BACKWARD):
            held.discard(step.stage)
        peak = max(peak, timeline.after_bytes[t] - len(held) * spared)
    return peak


# PyTorch's caching-allocator statistics. `memory_active_bytes` is active_bytes.all.peak:
# c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch at 001074d2) raises allocated_bytes and
# active_bytes by the same block size in `alloc_found_block`; `free` lowers allocated_bytes at
# once but active_bytes only in `free_block`, which for a block used on another stream
# (`recordStream`) waits until that stream's events complete (`insert_events`). On one stream
# the two peaks are equal; ckplan's allocated peak is compared with it, the blocks awaiting
# another stream (torchtune's offloading stream) being at most one layer input here
# (`checkpoint_offload_activation_bytes`).
ALLOCATOR_METRICS = ("memory_allocated_bytes", "memory_active_bytes", "memory_reserved_bytes")


def outside_allocator_bytes(spec: ModelSpec) -> int:
    """Bytes of the plan's model states that PyTorch's caching allocator does not hold, so no
    torch.cuda.memory_stats figure counts them: a paged bitsandbytes optimizer's states
    (`device_memory.paged_optimizer_bytes`)."""
    return paged_optimizer_bytes(spec)


def liger_chunks(run: PublishedRun) -> int:
    """The token chunks of Liger-Kernel's fused linear cross-entropy, ckplan's `chunked:N`
    (src/liger_kernel/ops/fused_linear_cross_entropy.py at e85611c, `forward`): with BT tokens
    of a micro-batch, h the hidden size and V the vocabulary, inc_factor = ⌈V/h⌉, chunk_size =
    next_power_of_2(⌈BT/inc_factor⌉), num_chunks = ⌈BT/chunk_size⌉ (so that a chunk's logits are
    about the input's size)."""
    spec_values = run.model if not isinstance(run.model, str) else load_mapping(run.model)[0]
    hidden, vocab = int(spec_values["hidden"]), int(spec_values["vocab"])
    tokens = run.micro_batch * run.seq
    inc_factor = -(-vocab // hidden)
    per_chunk = -(-tokens // inc_factor)
    chunk_size = 1 << (per_chunk - 1).bit_length()
    return -(-tokens // chunk_size)


def strategy_of(run: PublishedRun) -> str:
    """ckplan's strategy for the run's recomputation (`full` is Megatron's uniform full
    recomputation of every layer, `selective` the attention core, `selective-op` torchtitan's
    per-op policy, `sac`)."""
    return RECOMPUTE_STRATEGIES.get(run.recompute, run.recompute)


# Frameworks whose model code runs one kernel per norm and activation although the training
# loop is PyTorch's: llm-foundry's MPT (low-precision LayerNorm, GELU, flash attention).
FUSED_MODULES = ("composer",)
# What ckplan models of how a run trains (PublishedRun.training), by key: anything else is listed
# as not modelled rather than scored.
MODELLED_TRAINING = {
    "training": ("full", "frozen", "lora", "qlora"),
    "weight_format": ("bf16", "fp16", "fp32", "nf4", "fp4", "int8"),
    "optimizer": OPTIMIZERS,
    "offload": ("none", "activations", "params"),
    "loss": (
        "fused",
        "eager",
        "xentropy",
        "compiled",
        "chunked:N",
        "chunked-output:N",
        "fused-linear-ce",
    ),
    "distribute_checkpoints": ("True", "False"),
}


# Run recompute names that are ckplan strategies under another name.
RECOMPUTE_STRATEGIES = {"selective-op": "sac"}


def unmodelled(run: PublishedRun) -> str | None:
    """Why ckplan cannot score `run` yet, or None."""
    for (key, value), why in NOT_MODELLED.items():
        if getattr(run, key, None) == value:
            return why
    for key, value in run.training.items():
        if key in MODELLED_TRAINING and not _modelled(value, MODELLED_TRAINING[key]):
            return f"{key} {value} is not modelled"
    offload = run.training.get("offload", "none")
    if offload == "activations" and not offloads_checkpoints(run):
        return (
            "offload activations is modelled only as torchtune's offload of the checkpointed "
            "layer inputs (recompute full)"
        )
    if run.training.get("distribute_checkpoints") is True and strategy_of(run) != "full":
        return "distribute_checkpoints is modelled only with recompute full"
    return None


def predict(run: PublishedRun, gpu: GPU | None = None) -> Prediction:
    why = unmodelled(run)
    if why:
        return Prediction(run, f"not modelled: {why}")
    try:
        spec = run_spec(run)
        gpu = gpu or load_gpu(run.gpu, run.gpu_settings)
        plan = evaluate(spec, parse_strategy(strategy_of(run), spec))
    except InputError as error:
        return Prediction(run, f"not modelled: {error}")
    memory = plan.total_bytes
    if offloads_checkpoints(run):
        memory = plan.model_states.total + checkpoint_offload_activation_bytes(plan)
    if distributes_checkpoints(run):
        memory = plan.model_states.total + distributed_checkpoint_activation_bytes(plan)
    fits = allocator.budgeted_bytes(memory) <= gpu.memory_bytes - DEFAULT_RESERVE
    if run.published.metric in ALLOCATOR_METRICS:
        memory -= outside_allocator_bytes(spec)
    metric, value = run.published.metric, run.published.value
    if metric == "nvidia_smi_bytes":
        device = device_memory(
            memory,
            spec,
            gpu,
            stream_pool_bytes(spec, plan.peak_stage),
            loss_cached_bytes(spec, plan.peak_stage),
        )
        predicted = device.total
        return Prediction(
            run, "ok", predicted, predicted / value - 1, fits=fits, memory_bytes=memory,
            spec=spec, plan=plan,
        )  # fmt: skip
    if metric in MEMORY_METRICS:
        if metric == "memory_reserved_bytes":
            available = gpu.memory_bytes - DEFAULT_RESERVE
            predicted = allocator.reserved_within(
                memory,
                available,
                spec.expandable_segments,
                stream_pool_bytes(spec, plan.peak_stage),
                loss_cached_bytes(spec, plan.peak_stage),
            )
        else:
            predicted = memory
        return Prediction(
            run, "ok", predicted, predicted / value - 1, fits=fits, memory_bytes=memory,
            spec=spec, plan=plan,
        )  # fmt: skip
    time = step_time(plan, gpu)
    if time is None:
        return Prediction(run, "not modelled: no step time for this plan", spec=spec, plan=plan)
    step = time.step_seconds
    flops = _convention_flops(spec, run)
    peak = run.published.peak_flops or gpu.bf16_flops
    published_step = _published_step(run, flops, peak)
    predicted = _metric_value(run, step, flops, peak)
    mfu = (lambda seconds: flops / (seconds * run.gpus * peak)) if flops else None
    return Prediction(
        run,
        "ok",
        predicted=predicted,
        error=step / published_step - 1,
        predicted_step=step,
        published_step=published_step,
        predicted_mfu=mfu(step) if mfu else None,
        published_mfu=mfu(published_step) if mfu else None,
        fits=fits,
        memory_bytes=memory,
        spec=spec,
        plan=plan,
    )


def _convention_flops(spec: ModelSpec, run: PublishedRun) -> int | None:
    convention = run.published.convention
    return iteration_flops(spec, run.global_batch, convention) if convention else None


def _published_step(run: PublishedRun, flops: int | None, peak: float) -> float:
    """The step time a published figure implies."""
    metric, value = run.published.metric, run.published.value
    tokens = run.global_batch * run.seq
    if metric == "step_seconds":
        return value
    if metric == "tokens_per_second_per_gpu":
        return tokens / (value * run.gpus)
    if metric == "samples_per_second":
        return run.global_batch / value
    if metric == "tflops_per_gpu":
        return flops / (value * 1e12 * run.gpus)
    if metric == "mfu":
        return flops / (value * run.gpus * peak)
    raise ValueError(metric)


def _metric_value(run: PublishedRun, step: float, flops: int | None, peak: float) -> float:
    metric = run.published.metric
    tokens = run.global_batch * run.seq
    return {
        "step_seconds": lambda: step,
        "tokens_per_second_per_gpu": lambda: tokens / (step * run.gpus),
        "samples_per_second": lambda: run.global_batch / step,
        "tflops_per_gpu": lambda: flops / (step * run.gpus) / 1e12,
        "mfu": lambda: flops / (step * run.gpus * peak),
    }[metric]()


def summarise(predictions: list[Prediction]) -> dict[str, Any]:
    """Mean and largest |step error|, mean signed error and mean MFU error in points, per
    split, per GPU and per framework (scored time runs), and the memory runs' errors."""
    time = [p for p in predictions if p.scored and p.run.published.metric not in MEMORY_METRICS]
    memory = [p for p in predictions if p.scored and p.run.published.metric in MEMORY_METRICS]
    groups: dict[str, Mapping[str, list[Prediction]]] = {
        "split": _group(time, lambda p: p.run.split),
        "gpu": _group(time, lambda p: p.run.gpu),
        "framework": _group(time, lambda p: p.run.framework),
    }
    return {
        "time": {"all": _stats(time), **{k: {g: _stats(v) for g, v in d.items()} for k, d in
                                         groups.items()}},
        "memory": {"all": _stats(memory), "split": {
            g: _stats(v) for g, v in _group(memory, lambda p: p.run.split).items()}},
        "not_scored": sum(1 for p in predictions if not p.scored),
    }  # fmt: skip


def _group(predictions: list[Prediction], key) -> dict[str, list[Prediction]]:
    groups: dict[str, list[Prediction]] = {}
    for prediction in predictions:
        groups.setdefault(key(prediction), []).append(prediction)
    return dict(sorted(groups.items()))


def _stats(predictions: list[Prediction]) -> dict[str, Any]:
    errors = [p.error for p in predictions if p.error is not None]
    points = [p.mfu_points for p in predictions if p.mfu_points is not None]
    if not errors:
        return {"runs": 0}
    return {
        "runs": len(errors),
        "mean_abs_error": sum(abs(e) for e in errors) / len(errors),
        "max_abs_error": max(abs(e) for e in errors),
        "mean_error": sum(errors) / len(errors),
        "mfu_runs": len(points),
        "mean_abs_mfu_points": sum(abs(x) for x in points) / len(points) if points else None,
    }
