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
  gradients, Adam: 16 bytes per parameter over d. Buffers: the bf16 unsharded parameters of
  the layer running and of the one prefetched; the layer's unsharded bf16 gradients and the
  fp32 reduce-scatter input while it reduces; the root module (embedding, final norm, output)
  not resharded after forward. Under pipeline parallelism it does not reshard after forward
  (torchtitan's parallelize apply_fsdp): the whole stage stays unsharded; and the pipeline
  stage runs every micro-batch's backward without gradient sync, reduce-scattering once after
  the last (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`, PyTorch
  v2.13.0), so FSDP2 accumulates the stage's unsharded gradients in its reduce dtype, fp32
  (_fsdp_param.py `to_accumulated_grad_if_needed`): 4 bytes per parameter of the stage.
  zero 0 is its replicate (DDP/HSDP), 2 FSDP without resharding after forward, 3 FSDP.
- `deepspeed` (ZeRO, bf16): bf16 weights and gradients, fp32 master weights and Adam, 16 bytes
  per parameter (Rajbhandari et al. 2020, K = 12); ZeRO-3 accumulates its gradient partition in
  fp32 (stage3.py `grad_partitions_flat_buffer`, gradient_accumulation_dtype fp32). Buffers
  (deepspeed/runtime/zero/config.py defaults, v0.16.4): the reduce bucket, 5e8 elements in bf16,
  doubled with overlap_comm (default on for ZeRO-3 only), the all-gather bucket (5e8, ZeRO-1/2),
  ZeRO-3's prefetch bucket (5e7) and the parameters it keeps gathered, at most
  stage3_max_live_parameters (1e9) unless a single weight is larger. Pipeline parallelism only
  with ZeRO 0-1.
- `hf` (Hugging Face Trainer / accelerate, AMP bf16 over fp32 weights): fp32 weights, gradients
  and Adam, 16 bytes per parameter; DDP's reducer keeps its buckets beside the gradients
  (gradient_as_bucket_view off by default: another 4 bytes per parameter); autocast caches a bf16
  copy of every fp32 weight for the forward and backward (2 bytes per parameter; none when
  weight_bytes is 2, weights already in bf16 as in pure-bf16 training). No tensor, pipeline,
  context or expert parallelism; ZeRO-2/3 through accelerate's FSDP or DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.model import optimizers

DEEPSPEED_REDUCE_BUCKET = 500_000_000  # elements (reduce_bucket_size)
DEEPSPEED_ALLGATHER_BUCKET = 500_000_000  # elements (allgather_bucket_size)
DEEPSPEED_PREFETCH_BUCKET = 50_000_000  # elements (stage3_prefetch_bucket_size)
DEEPSPEED_MAX_LIVE = 1_000_000_000  # parameters (stage3_max_live_parameters)
HALF = 2  # bytes of a bf16 value


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


def largest_weight(spec) -> int:
    """The largest weight matrix of a layer on one GPU, which a gather cannot split."""
    widths = [spec.ffn_hidden, (spec.heads + 2 * spec.kv_heads) * spec.head_dim]
    if spec.experts:
        widths.append(spec.moe_ffn_hidden)
    return spec.hidden * max(widths) // spec.tp


def buffer_bytes(spec, stage_params: int, layer_params: int, root_params: int) -> int:
    """Bytes a framework holds beside the model states at its peak on one GPU: its
    communication buckets and unsharded copies (module docstring). `stage_params` are the
    parameters this GPU's pipeline stage holds, `layer_params` one layer's (the largest),
    `root_params` those outside the layers (embedding, final norm, output) on this stage."""
    framework, zero, dp = spec.framework, spec.zero, spec.dp
    # torchtitan's FSDP mesh is dp_shard·cp (context-parallel ranks hold the same parameters)
    if framework == "torchtitan" and dp * spec.cp > 1 and zero >= 2:
        if zero == 2 or spec.pp > 1:
            unsharded = HALF * stage_params  # no reshard after forward
        else:  # the running layer, the prefetched one, and the root module
            unsharded = HALF * (2 * layer_params + root_params)
        if spec.pp > 1:  # fp32 unsharded gradients of the stage, the running layer's in bf16
            return unsharded + 4 * stage_params + HALF * layer_params
        reducing = (HALF + 4) * layer_params  # bf16 gradients, fp32 reduce-scatter input
        return unsharded + reducing
    if framework == "deepspeed" and dp > 1 and zero >= 1:
        reduce = min(DEEPSPEED_REDUCE_BUCKET, stage_params) * HALF
        if zero == 3:  # overlap_comm on: two buckets; the prefetch bucket; the live parameters
            prefetch = min(DEEPSPEED_PREFETCH_BUCKET, stage_params) * HALF
            live = max(min(2 * layer_params, DEEPSPEED_MAX_LIVE), largest_weight(spec))
            return 2 * reduce + prefetch + HALF * live
        gather = min(DEEPSPEED_ALLGATHER_BUCKET, stage_params) * HALF
        return reduce + gather
    if framework == "hf":
        buckets = 4 * stage_params if dp > 1 and zero == 0 else 0  # DDP's reducer buckets
        # autocast caches the bf16 cast of an fp32 leaf weight only (PyTorch
        # aten/src/ATen/autocast_mode.cpp `cached_cast`: `arg.scalar_type() == at::kFloat &&
        # arg.requires_grad() && arg.is_leaf()`): weights already in bf16 are used as they are
        fp32_weights = spec.weight_bytes == 4
        autocast = HALF * (stage_params if zero < 3 else 2 * layer_params) if fp32_weights else 0
        return buckets + autocast
    return 0
