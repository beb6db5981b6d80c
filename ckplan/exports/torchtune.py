"""Overrides for torchtune's fine-tuning recipes (torchtune v0.6.1, commit a6290a5b; docs/
exports.md): a YAML file of the keys the plan sets, and the same as `tune run` command-line
overrides (`key=value`, dotted for nested keys) on top of the user's own config.

The keys, as torchtune v0.6.1's recipes/configs and recipes read them:
- the recipe: `lora_finetune_single_device` / `lora_finetune_distributed` for LoRA, QLoRA and
  DoRA, `full_finetune_single_device` / `full_finetune_distributed` for full training;
- `batch_size` (per device), `gradient_accumulation_steps`, `dtype` (bf16 or fp32), `compile`;
- `enable_activation_checkpointing` (training.set_activation_checkpointing over every
  TransformerSelfAttentionLayer: every layer or none) and `enable_activation_offloading`
  (training.OffloadActivations, saved-tensor hooks over the whole model but the output layer:
  every tensor the layers save goes to host, their inputs alone with checkpointing: ckplan's
  `offload` and `full+offload`, every layer or none);
- `loss._component_`: torchtune.modules.loss.CEWithChunkedOutputLoss with
  `loss.num_output_chunks` (its constructor argument, default 8) for `loss: chunked:N`, or
  torch.nn.CrossEntropyLoss for `loss: eager`;
- `optimizer._component_` (torch.optim.AdamW with `fused: True`, as torchtune's own configs
  set it, or `fused: False, foreach: True` under `optimizer_implementation: foreach`) and, with full
  training, `optimizer_in_bwd`;
- the LoRA builders' arguments (torchtune/models/llama3/_model_builders.py `lora_llama3_8b`):
  `model.lora_attn_modules` (q_proj, k_proj, v_proj, output_proj), `model.apply_lora_to_mlp`
  (w1, w2 and w3 together), `model.apply_lora_to_output`, `model.lora_rank`,
  `model.lora_alpha`, `model.lora_dropout`, `model.use_dora`, `model.quantize_base` (QLoRA's
  NF4 base, torchao's NF4Tensor);
- `fsdp_reshard_after_forward` on the distributed recipes: True is FSDP2's full sharding
  (ZeRO-3), False keeps the gathered weights from forward to backward (ZeRO-2). A plan
  counted under FSDP1 (`fsdp_version: 1`) is refused. ckplan counts the Trainer's FSDP2 units
  (accelerate's: the embedding and `[norm, output]` units of their own); torchtune's
  `shard_model` leaves the embedding and output in the root unit, kept from forward to backward
  (about 2 bytes per embedding parameter more than counted).
"""

from __future__ import annotations

import yaml

from ckplan.exports.segments import LayerSegments, module_reason
from ckplan.model import frameworks
from ckplan.model.loss import chunks
from ckplan.model.spec import ModelSpec
from ckplan.plan import Plan

NAME = "torchtune"
RELEASE = "v0.6.1"
# ckplan's optimizer -> the optimizer torchtune's configs instantiate
OPTIMIZERS = {
    "adamw": "torch.optim.AdamW",
    "adamw-8bit": "bitsandbytes.optim.AdamW8bit",
    "paged-adamw-8bit": "bitsandbytes.optim.PagedAdamW8bit",
    "sgd-nomomentum": "torch.optim.SGD",
}
CHUNKED_LOSS = "torchtune.modules.loss.CEWithChunkedOutputLoss"
EAGER_LOSS = "torch.nn.CrossEntropyLoss"
# PEFT's names -> torchtune's attention modules (torchtune.modules.peft LORA_ATTN_MODULES)
ATTENTION = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "output_proj"}
MLP = ("gate_proj", "up_proj", "down_proj")  # torchtune's w1, w3, w2


def recipe(spec: ModelSpec) -> str:
    kind = "lora" if spec.finetune.adapters else "full"
    return f"{kind}_finetune_{'distributed' if spec.dp > 1 else 'single_device'}"


def reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    """Why torchtune's recipes cannot run this plan, or None."""
    if why := module_reason(layers, "torchtune"):
        return why
    if spec.kind != "transformer" or spec.experts:
        return "torchtune's LoRA and full fine-tuning recipes here are for dense transformers"
    for key in ("tp", "pp", "cp", "ep"):
        if getattr(spec, key) > 1:
            return f"{key}={getattr(spec, key)}: torchtune's fine-tuning recipes run FSDP only"
    if spec.dp > 1 and spec.zero not in (2, 3):
        return f"zero={spec.zero} with dp={spec.dp}: torchtune shards with FSDP2 (zero 2 or 3)"
    if spec.dp > 1 and spec.framework == "hf" and frameworks.fsdp_version(spec) == 1:
        return (
            "fsdp_version 1: torchtune shards with FSDP2 (training.shard_model's fully_shard); "
            "--set fsdp_version=2"
        )
    if spec.training == "frozen":
        return "training: frozen: torchtune's recipes train every weight or LoRA adapters"
    adapters = spec.finetune.adapters
    mlp = [name for name in MLP if name in adapters]
    if mlp and len(mlp) != len(MLP):
        return (
            f"lora_targets {spec.lora_targets}: torchtune's apply_lora_to_mlp adapts w1, w2 "
            "and w3 together (gate_proj, up_proj, down_proj)"
        )
    if spec.training == "qlora" and spec.weight_format != "nf4":
        return f"weight_format {spec.weight_format}: torchtune's QLoRA base is NF4"
    if spec.training == "lora" and spec.weight_format not in (None, "bf16", "fp32"):
        return f"weight_format {spec.weight_format} with training: lora: no torchtune key for it"
    if spec.optimizer not in OPTIMIZERS:
        return f"optimizer: {spec.optimizer}: no optimizer in torchtune's configs for it"
    if spec.optimizer_in_backward and adapters:
        return "optimizer_in_backward: torchtune's optimizer_in_bwd is in its full recipes only"
    if spec.precision != "bf16" and spec.dtype_bytes != 4:
        return f"precision {spec.precision}: torchtune's dtype is bf16 or fp32"
    if spec.loss in ("fused", "xentropy"):
        return (
            f"loss: {spec.loss}: torchtune v0.6.1's losses are CEWithChunkedOutputLoss (--set "
            "loss=chunked:8, its configs') or torch's cross-entropy (loss=eager)"
        )
    if spec.loss.startswith("chunked-output:") and spec.kernels != "compiled":
        return (
            f"loss: {spec.loss}: torchtune compiles CEWithChunkedOutputLoss's cross-entropy "
            "with the model (--set kernels=compiled)"
        )
    if spec.loss == "compiled" and spec.kernels != "compiled":
        return (
            "loss: compiled: torchtune's compile flag compiles the model and the loss together "
            "(--set kernels=compiled)"
        )
    if layers.selective:
        return (
            "selective recomputation: torchtune's enable_activation_checkpointing wraps whole "
            "layers"
        )
    if layers.offloaded and set(layers.offloaded) != set(range(layers.layers)):
        return (
            "offloaded layers: torchtune's enable_activation_offloading offloads every layer or "
            "none (use offload or full+offload, or --to torch)"
        )
    if layers.stores_all or layers.uniform_size() == 1:
        return None
    return (
        "these layer segments: torchtune's enable_activation_checkpointing recomputes every "
        "layer (one per checkpoint) or none"
    )


def values(plan: Plan, layers: LayerSegments) -> dict[str, object]:
    """The overrides, nested as the config file nests them."""
    spec = plan.spec
    out: dict[str, object] = {
        "batch_size": spec.micro_batch,
        "gradient_accumulation_steps": spec.microbatches,
        "dtype": "fp32" if spec.dtype_bytes == 4 else "bf16",
        "compile": spec.kernels == "compiled",
        "enable_activation_checkpointing": bool(layers.recomputed),
        "enable_activation_offloading": bool(layers.offloaded),
        "optimizer": {"_component_": OPTIMIZERS[spec.optimizer]},
    }
    if spec.optimizer == "adamw":  # the step ckplan counted, said whatever the config holds
        foreach = frameworks.optimizer_implementation(spec) == "foreach"
        out["optimizer"] |= {"fused": False, "foreach": True} if foreach else {"fused": True}
    if spec.loss.startswith(("chunked:", "chunked-output:")):
        out["loss"] = {"_component_": CHUNKED_LOSS, "num_output_chunks": chunks(spec.loss)}
    else:
        out["loss"] = {"_component_": EAGER_LOSS}
    if not spec.finetune.adapters:
        out["optimizer_in_bwd"] = spec.optimizer_in_backward
    if spec.dp > 1:
        out["fsdp_reshard_after_forward"] = spec.zero == 3
    adapters = spec.finetune.adapters
    if adapters:
        model: dict[str, object] = {
            "lora_attn_modules": [ATTENTION[name] for name in ATTENTION if name in adapters],
            "apply_lora_to_mlp": all(name in adapters for name in MLP),
            "apply_lora_to_output": False,
            "lora_rank": spec.lora_rank,
        }
        if spec.lora_alpha is not None:
            alpha = spec.lora_alpha
            model["lora_alpha"] = int(alpha) if float(alpha).is_integer() else alpha
        model["lora_dropout"] = spec.lora_dropout
        if spec.finetune.use_dora:
            model["use_dora"] = True
        if spec.training == "qlora":
            model["quantize_base"] = True
        out["model"] = model
    return out


def flat(mapping: dict, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, value) in order: the command-line form of the overrides."""
    items: list[tuple[str, object]] = []
    for key, value in mapping.items():
        if isinstance(value, dict):
            items += flat(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _argument(key: str, value: object) -> str:
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")
    text = text.removesuffix("...").strip()
    return f"{key}={text}" if "[" not in text else f"'{key}={text}'"


def command(plan: Plan, layers: LayerSegments) -> str:
    spec = plan.spec
    run = "tune run"
    if spec.dp > 1:
        run += f" --nproc_per_node {spec.dp}"
    overrides = " ".join(_argument(k, v) for k, v in flat(values(plan, layers)))
    return f"{run} {recipe(spec)} --config CONFIG {overrides}"


def render(plan: Plan, layers: LayerSegments) -> str:
    spec = plan.spec
    header = [
        f"# ckplan plan {plan.strategy} for {spec.name}: torchtune {RELEASE}, recipe "
        f"{recipe(spec)}",
        f"# {command(plan, layers)}",
    ]
    body = yaml.safe_dump(values(plan, layers), sort_keys=False, default_flow_style=None)
    return "\n".join(header) + "\n" + body


def notes(plan: Plan, layers: LayerSegments) -> list[str]:
    spec = plan.spec
    lines = [
        "CONFIG: the recipe's config for the model (e.g. llama3_1/8B_lora_single_device); "
        "these keys override it"
    ]
    lines.append(
        f"the plan's model states are {spec.framework}'s bytes per parameter; torchtune's "
        "recipes hold the weights (and the optimizer's states) in dtype, with no master copy"
    )
    if spec.optimizer.endswith("8bit"):
        lines.append(f"optimizer {OPTIMIZERS[spec.optimizer]} needs bitsandbytes installed")
    return lines
